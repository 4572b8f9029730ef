// PTX helpers: the memory-model primitives used by every epcomm kernel.
//
// Ordering contract (see docs/protocol.md): a producer writes payload with plain or relaxed
// stores, then publishes with a release operation at system scope (`red_add_release_sys`,
// `st_release_sys`); a consumer observes the publication with `ld_acquire_sys` and only then
// reads the payload. Peer memory is reached through mappings over NVLink (CUDA IPC,
// `nvshmem_ptr`), so every cross-GPU publication uses `.sys` scope.
#pragma once
#include <cstdint>

namespace epcomm {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins (one thread) until `ns` nanoseconds of %globaltimer have passed.
__device__ __forceinline__ void spin_ns(uint64_t ns) {
  const uint64_t t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < ns) {
  }
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Streaming 16-byte load of data this kernel never writes (inputs): skip L1.
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Plain 16-byte load (data written by peers earlier in this op, made visible by an acquire).
__device__ __forceinline__ int4 ld_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// ld_nc_v4 when `nc`, else ld_v4: one predicated instruction each, no branch (a reduction over
// rows of both kinds keeps all of its loads in flight). Ordered like ld_v4 ("memory").
__device__ __forceinline__ int4 ld_v4_nc_if(const int4* p, bool nc) {
  int4 v;
  asm volatile(
      "{\n\t.reg .pred nc;\n\tsetp.ne.b32 nc, %5, 0;\n\t"
      "@nc ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];\n\t"
      "@!nc ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(nc))
      : "memory");
  return v;
}

// Brings the 128-byte line holding `p` into L2 without waiting for it (a hint: no fault, no
// result). Kernels issue it for their inputs before the prologue's round trip, so that the
// loads that follow it find the lines in L2.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Brings `bytes` bytes from `p` into L2 without waiting for them (sm_90's bulk prefetch; a
// hint, no result). `p` and `bytes` multiples of 16, the range inside one allocation. L2 is
// where every writer's stores land (this GPU's, a peer's over NVLink, a copy engine's), so a
// line prefetched before its last write is updated there, never stale.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// 16-byte store that does not allocate in L1 (peer or local destination).
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace epcomm
