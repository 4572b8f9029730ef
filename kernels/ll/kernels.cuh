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

#define EPCOMM_LL_KERNEL(name, body, Net)                                                     \
  extern "C" __global__ void __launch_bounds__(epcomm::ll::kThreads, 1)                      \
      name(const epcomm::OpArgs a) {                                                          \
    __shared__ epcomm::ll::Shared s;                                                          \
    extern __shared__ uint32_t epcomm_ll_dyn[];                                               \
    epcomm::ll::body<Net>(a, s, epcomm_ll_dyn);                                               \
  }

#define EPCOMM_LL_KERNELS(Net)                                                                \
  EPCOMM_LL_KERNEL(epcomm_ll_dispatch_send, dispatch_send, Net)                               \
  EPCOMM_LL_KERNEL(epcomm_ll_dispatch_recv, dispatch_recv, Net)                               \
  EPCOMM_LL_KERNEL(epcomm_ll_combine_send, combine_send, Net)                                 \
  EPCOMM_LL_KERNEL(epcomm_ll_combine_recv, combine_recv, Net)
