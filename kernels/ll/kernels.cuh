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

// Two kernels per op, each listed by profilers under the op's name:
// * epcomm::ll::dispatch / epcomm::ll::combine run an op without a hook: the send phase, then
//   (kFlagFused) the receive phase's work once every peer's sends landed;
// * epcomm::ll::hook::dispatch / epcomm::ll::hook::combine run the phases of an op with a hook:
//   the send phase alone, or (kFlagRecvPhase, the hook) the receive phase.
// A profile of either kind of op shows one kernel per op; each kernel holds one copy of the
// receive phase's work.
#define EPCOMM_LL_KERNEL(name, send, recv, Net)                                                \
  namespace epcomm::ll {                                                                       \
  __global__ void __launch_bounds__(kThreads, 1) name(const OpArgs a) {                       \
    __shared__ Shared s;                                                                       \
    extern __shared__ uint32_t epcomm_ll_dyn[];                                                \
    send<Net, true>(a, s, epcomm_ll_dyn);                                                      \
  }                                                                                            \
  namespace hook {                                                                             \
  __global__ void __launch_bounds__(kThreads, 1) name(const OpArgs a) {                       \
    __shared__ Shared s;                                                                       \
    extern __shared__ uint32_t epcomm_ll_dyn[];                                                \
    if ((a.flags & kFlagRecvPhase) != 0)                                                       \
      recv<Net>(a, s, epcomm_ll_dyn);                                                          \
    else                                                                                       \
      send<Net, false>(a, s, epcomm_ll_dyn);                                                   \
  }                                                                                            \
  }                                                                                            \
  }

#define EPCOMM_LL_KERNELS(Net)                                                                 \
  EPCOMM_LL_KERNEL(dispatch, dispatch_send, dispatch_recv, Net)                                \
  EPCOMM_LL_KERNEL(combine, combine_send, combine_recv, Net)
