// The exported low-latency kernels of an image: its entry file includes its Net policy and this
// header, then instantiates them once, next to the intranode ones:
//
//   EPCOMM_LL_KERNELS(epcomm::StoreNet)
//
// Each takes an OpArgs block and OpArgs::ll_smem_words u32 words of dynamic shared memory.
#pragma once
#include "ll/combine.cuh"
#include "ll/dispatch.cuh"
#include "ll/shared.cuh"

// One kernel per op, named epcomm::ll::dispatch and epcomm::ll::combine (profilers list them
// under those names): the send phase, or with kFlagRecvPhase the receive phase (a hook's);
// with kFlagFused the send phase runs the receive phase too.
#define EPCOMM_LL_KERNEL(name, send, recv, Net)                                                \
  namespace epcomm::ll {                                                                       \
  __global__ void __launch_bounds__(kThreads, 1) name(const OpArgs a) {                       \
    __shared__ Shared s;                                                                       \
    extern __shared__ uint32_t epcomm_ll_dyn[];                                                \
    if ((a.flags & kFlagRecvPhase) != 0)                                                       \
      recv<Net>(a, s, epcomm_ll_dyn);                                                          \
    else                                                                                       \
      send<Net>(a, s, epcomm_ll_dyn);                                                          \
  }                                                                                            \
  }

#define EPCOMM_LL_KERNELS(Net)                                                                 \
  EPCOMM_LL_KERNEL(dispatch, dispatch_send, dispatch_recv, Net)                                \
  EPCOMM_LL_KERNEL(combine, combine_send, combine_recv, Net)
