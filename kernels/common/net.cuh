// Net policies: how a kernel writes into another rank's symmetric buffer.
//
// Kernel bodies are templates over a Net policy; every cross-rank write goes through it, with
// the destination address computed as `bases[d] + offset` and a per-peer `remote` flag from
// `Net::remote(OpArgs::remote_mask, d)`:
//  * not remote: `bases[d]` is a mapping of rank d's buffer in this process (CUDA IPC or
//    `nvshmem_ptr`); writes are plain stores, publication is a system-scope release op
//    (ptx.cuh). `StoreNet` (below) has only this path: `remote` is always false.
//  * remote (`NvshmemNet`, common/net_nvshmem.cuh, only in images linked with
//    libnvshmem_device): `bases[d]` is this rank's own symmetric address (NVSHMEM addresses a
//    peer's copy by the local symmetric address plus a PE); payload travels with
//    `nvshmem*_put*`, publication with `nvshmemx_signal_op` / put-with-signal.
//
// A policy is a struct of static device functions:
//   kTransport                      true when any peer can be remote (else `remote` is false
//                                   and bodies drop their transport branches at compile time)
//   remote(mask, d)                 whether rank d is reached through the transport
//   set_word(p, v, pe, remote)      relaxed u64 store (tagged or monotonic words)
//   publish_set(p, v, pe, remote)   release u64 store after this thread's earlier writes
//   publish_add(p, v, pe, remote)   release add after every write that happens-before it
//   quiet(w, mask)                  completes the block's outstanding puts; called by every
//                                   thread of the block, its result then goes through
//                                   `all_ok` (a block barrier); false (in some thread) when
//                                   the puts could not complete: the failure is recorded
//                                   through WaitCtx `w` (wait.cuh) and the block must publish
//                                   nothing more
//   put_elem(p, v, pe, remote)      one int64_t / int32_t / float element
//   kMetadataRows                   true when a transport peer gets a dispatched token's
//                                   metadata as whole-row transfers (`put_lanes`) instead of
//                                   one put per element: the normal dispatch sends the
//                                   caller's scales, top-k ids and weights raw and the receiver
//                                   finishes the ids and weights of its transport sources after
//                                   [E6] (intranode/dispatch.cuh, [E8]); the low-latency
//                                   dispatch stages each destination's final metadata row and
//                                   sends it (ll/dispatch.cuh, [L3]). False: every element is
//                                   written in its final form by `put_elem`
//   kCoalesceRuns                   true when the normal dispatch sends a transport peer its
//                                   tokens as runs (intranode/dispatch.cuh, [E4]): each warp
//                                   takes a contiguous chunk of tokens, and consecutive tokens
//                                   bound for consecutive rows of one transport peer leave as
//                                   one transfer per record (rows, scales, ids, weights) plus
//                                   the source indices, from one thread (`claim_fenced`,
//                                   `emit_transfer`, `emit_write`); and when the combine
//                                   pushes rows to transport peers as runs (intranode/
//                                   combine.cuh, [C1]: contiguous chunks of rows, a run's rows
//                                   and weights as one transfer each, its flags by
//                                   `emit_signal`). False: tokens and rows are dealt
//                                   block-first and sent one by one (needs kMetadataRows)
// and, when kTransport, the warp-collective puts `put_warp(dst, src, bytes, pe)`,
// `put_signal_warp(dst, src, bytes, sig, v, pe)` and the ordering point `fence()`; when
// kMetadataRows also `put_lanes(valid, dst, src, bytes, pe)`, a warp-collective put of one
// transfer per lane with `valid` (each lane its own source, destination, size and peer).
//
// Ordering contract of the remote path (docs/protocol.md, "Net policies"): a thread that issued
// puts calls `quiet` before the block barrier that precedes a publication; a per-row
// publication uses put-with-signal, which NVSHMEM delivers after the row. Receivers poll their
// own signal words with acquire loads (wait.cuh), bounded as every other wait.
#pragma once
#include <cstdint>

#include "common/ptx.cuh"

namespace epcomm {

struct WaitCtx;  // common/wait.cuh

// Every peer through its mapping: plain stores and system-scope release operations.
struct StoreNet {
  static constexpr bool kTransport = false;
  static constexpr bool kMetadataRows = false;
  static constexpr bool kCoalesceRuns = false;

  __device__ static __forceinline__ bool remote(uint64_t, int) { return false; }

  __device__ static __forceinline__ void set_word(uint64_t* p, uint64_t v, int, bool) {
    st_relaxed_sys(p, v);
  }

  __device__ static __forceinline__ void publish_set(uint64_t* p, uint64_t v, int, bool) {
    st_release_sys(p, v);
  }

  __device__ static __forceinline__ void publish_add(uint64_t* p, uint64_t v, int, bool) {
    __threadfence_system();
    red_add_release_sys(p, v);
  }

  // Publications are release operations that order every earlier store of the block after a
  // block barrier: nothing to complete.
  __device__ static __forceinline__ bool quiet(const WaitCtx&, uint64_t) { return true; }

  template <typename T>
  __device__ static __forceinline__ void put_elem(T* p, T v, int, bool) {
    *p = v;
  }
};

}  // namespace epcomm
