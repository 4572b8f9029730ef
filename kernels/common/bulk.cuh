// Bulk copies (sm_90 `cp.async.bulk`, the TMA engine's one-dimensional form): global -> shared
// completes on an mbarrier, shared -> global completes per bulk group. They move bytes without
// the load/store units, which is what lets a few SMs keep many more bytes in flight than
// 16-byte register copies do.
//
// Contract (PTX ISA, cp.async.bulk): sizes and both addresses are multiples of 16 bytes. A
// shared buffer may be refilled only after the stores that read it have read it
// (`bulk_wait_read<0>`); data written by a bulk store is published to other agents only after
// its group completed (`bulk_wait<N>`) and the async proxy was fenced against the generic one
// (`fence_proxy_async_global`), then with the usual release (common/ptx.cuh).
#pragma once
#include <cstdint>

namespace epcomm {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: an mbarrier expecting one arrival per phase, visible to the async proxy.
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Starts a bulk load of `bytes` from global `src` into shared `dst`; the current phase of
// `bar` completes when they have landed (this thread's arrival carries the byte count).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Waits until the phase with parity `parity` of `bar` completed. The phase is a bulk load of
// this thread's own (local memory to shared memory), which always completes: no bound needed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "epcomm_mbar_wait_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra epcomm_mbar_wait_%=;\n\t}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Starts a bulk store of `bytes` from shared `src` to global `dst` (a peer's mapped memory
// too) in the current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's committed bulk groups are incomplete (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's committed bulk groups have not read their source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// bulk_wait<min(n, 7)>: leaves at most n groups incomplete (fewer when n > 7: stricter, still
// correct for a caller that needs everything but the newest n).
__device__ __forceinline__ void bulk_wait_all_but(int n) {
  switch (n) {
    case 0: bulk_wait<0>(); break;
    case 1: bulk_wait<1>(); break;
    case 2: bulk_wait<2>(); break;
    case 3: bulk_wait<3>(); break;
    case 4: bulk_wait<4>(); break;
    case 5: bulk_wait<5>(); break;
    case 6: bulk_wait<6>(); break;
    default: bulk_wait<7>(); break;
  }
}

// Orders this thread's completed async-proxy (bulk) global writes before its later generic
// operations, such as the release that publishes them.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace epcomm
