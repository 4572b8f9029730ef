// Net policy: how a kernel writes into another rank's symmetric buffer.
//
// Every cross-rank write of the dispatch/combine kernels goes through the functions below, with
// the destination address computed as `bases[d] + offset` and a `remote` flag:
//  * remote == false: `bases[d]` is a mapping of rank d's buffer in this process (CUDA IPC or
//    `nvshmem_ptr`); writes are plain stores, publication is a system-scope release op
//    (ptx.cuh). This is the only path the store variant (`intranode.fatbin`) has.
//  * remote == true (NVSHMEM variant only, EPCOMM_NET_NVSHMEM): `bases[d]` is this rank's own
//    symmetric address (NVSHMEM addresses a peer's copy by the local symmetric address plus a
//    PE); payload travels with `nvshmem*_put*`, publication with `nvshmemx_signal_op` /
//    `nvshmemx_putmem_signal_nbi_warp`.
//
// Ordering contract of the remote path (docs/protocol.md, "Net policies"): a thread that issued
// puts calls `net_quiet()` before the block barrier that precedes a publication; a per-row
// publication uses put-with-signal, which NVSHMEM delivers after the row. Receivers poll their
// own signal words with acquire loads (wait.cuh), bounded as every other wait.
#pragma once
#include <cstdint>

#include "epcomm/ptx.cuh"

#ifdef EPCOMM_NET_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace epcomm {

#ifdef EPCOMM_NET_NVSHMEM
constexpr bool kNetTransport = true;
#else
constexpr bool kNetTransport = false;
#endif

// True when rank d is reached through the transport (bit d of OpArgs::remote_mask).
__device__ __forceinline__ bool net_remote(uint64_t remote_mask, int d) {
  return kNetTransport && ((remote_mask >> d) & 1ull) != 0;
}

// Sets a tagged or monotonic u64 word of rank `pe` (relaxed: the tag makes it self-validating).
__device__ __forceinline__ void net_set_word(uint64_t* p, uint64_t v, int pe, bool remote) {
#ifdef EPCOMM_NET_NVSHMEM
  if (remote) {
    nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_SET, pe);
    return;
  }
#endif
  (void)pe;
  (void)remote;
  st_relaxed_sys(p, v);
}

// Publishes `v` into a u64 word of rank `pe` after this thread's earlier writes (release store).
__device__ __forceinline__ void net_publish_set(uint64_t* p, uint64_t v, int pe, bool remote) {
#ifdef EPCOMM_NET_NVSHMEM
  if (remote) {
    nvshmem_fence();
    nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_SET, pe);
    return;
  }
#endif
  (void)pe;
  (void)remote;
  st_release_sys(p, v);
}

// Adds `v` to a monotonic u64 counter of rank `pe` after every write that happens-before this
// call (callers: quiet, block barrier, then this from one thread).
__device__ __forceinline__ void net_publish_add(uint64_t* p, uint64_t v, int pe, bool remote) {
#ifdef EPCOMM_NET_NVSHMEM
  if (remote) {
    nvshmem_fence();
    nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_ADD, pe);
    return;
  }
#endif
  (void)pe;
  (void)remote;
  __threadfence_system();
  red_add_release_sys(p, v);
}

// Completes this thread's outstanding puts (no-op in the store variant, whose publications are
// release operations that order every earlier store of the block after a block barrier).
__device__ __forceinline__ void net_quiet(uint64_t remote_mask) {
#ifdef EPCOMM_NET_NVSHMEM
  if (remote_mask != 0) nvshmem_quiet();
#endif
  (void)remote_mask;
}

// Single-element writes into rank `pe`'s buffer (`nvshmem_<type>_p` on the remote path).
#ifdef EPCOMM_NET_NVSHMEM
#define EPCOMM_NET_PUT_ELEM(Type, Name)                                                  \
  __device__ __forceinline__ void net_put_elem(Type* p, Type v, int pe, bool remote) {  \
    if (remote)                                                                          \
      nvshmem_##Name##_p(p, v, pe);                                                      \
    else                                                                                 \
      *p = v;                                                                            \
  }
#else
#define EPCOMM_NET_PUT_ELEM(Type, Name)                                                  \
  __device__ __forceinline__ void net_put_elem(Type* p, Type v, int, bool) { *p = v; }
#endif
EPCOMM_NET_PUT_ELEM(int64_t, int64)
EPCOMM_NET_PUT_ELEM(int32_t, int32)
EPCOMM_NET_PUT_ELEM(float, float)
#undef EPCOMM_NET_PUT_ELEM

#ifdef EPCOMM_NET_NVSHMEM
// Warp-collective put of `bytes` from local `src` into rank `pe`'s copy of symmetric `dst`.
__device__ __forceinline__ void net_put_warp(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
}

// Warp-collective put of a row followed by a signal set, delivered after the row.
__device__ __forceinline__ void net_put_signal_warp(void* dst, const void* src, size_t bytes,
                                                    uint64_t* sig, uint64_t v, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, v, NVSHMEM_SIGNAL_SET, pe);
}
#endif

}  // namespace epcomm
