// The exported kernels of an intranode image. An image's entry file includes its Net policy
// and this header, then instantiates every kernel once, with the symbol names the Rust side
// loads (`IntranodeKernels`):
//
//   #include "common/net.cuh"
//   #include "intranode/kernels.cuh"
//   EPCOMM_INTRANODE_KERNELS(epcomm::StoreNet)
//
// epcomm_abi_probe, epcomm_delay and epcomm_layout do not depend on the Net policy;
// epcomm_dispatch and epcomm_combine are the bodies of intranode/dispatch.cuh and
// intranode/combine.cuh over it.
#pragma once
#include "common/abi_probe.cuh"
#include "common/copy_rows.cuh"
#include "common/ptx.cuh"
#include "intranode/combine.cuh"
#include "intranode/dispatch.cuh"
#include "intranode/layout.cuh"
#include "intranode/shared.cuh"

// Diagnostics: epcomm_delay holds this stream for `ns` nanoseconds (one thread spinning on
// %globaltimer), so tests and `epcomm bench --delay-rank` can make one rank late by an exact
// amount. epcomm_abi_probe writes the device's view of the ABI (common/abi_probe.cuh), which
// the host compares with its own before the first launch. epcomm_copy_counted_rows copies
// the rows a dispatch received out of a receive region, as many as the device counted
// (common/copy_rows.cuh).
#define EPCOMM_INTRANODE_KERNELS(Net)                                                         \
  extern "C" __global__ void epcomm_abi_probe(uint64_t* out) { epcomm::abi_probe(out); }     \
  extern "C" __global__ void epcomm_copy_counted_rows(                                       \
      uint8_t* dst, const uint8_t* even, const uint8_t* odd, const int64_t* parity,          \
      const int32_t* count, uint64_t row_bytes, uint64_t max_rows) {                         \
    epcomm::copy_counted_rows(dst, even, odd, parity, count, row_bytes, max_rows);           \
  }                                                                                          \
  extern "C" __global__ void epcomm_delay(uint64_t ns) { epcomm::spin_ns(ns); }              \
  extern "C" __global__ void __launch_bounds__(epcomm::intranode::kThreads)                  \
      epcomm_layout(const epcomm::LayoutArgs a) {                                            \
    epcomm::intranode::layout(a);                                                            \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(epcomm::intranode::kThreads, 1)               \
      epcomm_dispatch(const epcomm::OpArgs a) {                                              \
    __shared__ epcomm::intranode::Shared s;                                                  \
    epcomm::intranode::dispatch<Net>(a, s);                                                  \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(epcomm::intranode::kThreads, 1)               \
      epcomm_combine(const epcomm::OpArgs a) {                                               \
    __shared__ epcomm::intranode::Shared s;                                                  \
    epcomm::intranode::combine<Net>(a, s);                                                   \
  }
