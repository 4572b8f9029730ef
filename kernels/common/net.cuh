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
//    `nvshmem*_put*`, publication with `nvshmemx_signal_op` / put-with-signal. `ProxyNet`
//    (common/net_proxy.cuh) turns the same writes into descriptors for the CPU proxy.
//
// A policy is a struct with two layers: primitives (single writes and publications) and
// operations (what one phase of an op sends, per peer: stores, element puts, row puts or
// descriptors). The bodies call the operations and the publication and completion primitives
// and never branch on the policy: each policy picks its own way in its operations, and an
// operation with nothing to do is empty, so it inlines to nothing.
//
// Primitives, static device functions:
//   remote(mask, d)                 whether rank d is reached through the transport
//   set_word(p, v, pe, remote)      relaxed u64 store (tagged or monotonic words)
//   publish_set(p, v, pe, remote)   release u64 store after this thread's earlier writes
//   publish_add(p, v, pe, remote)   release add after every write that happens-before it
//   fence()                         orders this thread's earlier puts before its later ones
//   put_signal_add_warp(dst, src, bytes, sig, v, pe)  warp-collective: a row, then `v` added to
//                                   the peer's word `sig`, landing after the row and after
//                                   every earlier put of a lane that called fence() (rail
//                                   forwarding's ring entries, intranode/forward.cuh)
//   quiet(w, mask)                  completes the block's outstanding puts; called by every
//                                   thread of the block, its result then goes through
//                                   `all_ok` (a block barrier); false (in some thread) when
//                                   the puts could not complete: the failure is recorded
//                                   through WaitCtx `w` (wait.cuh) and the block must publish
//                                   nothing more
//   put_elem(p, v, pe, remote)      one int64_t / int32_t / float element
//   kMetadataRows                   whether the normal dispatch reads the caller's scales,
//                                   top-k ids and weights as put sources (raw rows a transport
//                                   peer's receiver finishes in [E8]); the host mirrors it
//                                   (KernelFamily::puts_metadata_rows) to register those arrays
//   kWholeWords                     whether every set_word reaches its peer as one 8-byte
//                                   single-copy-atomic write (a reader never sees its tag
//                                   without its value), so a tagged word is valid the moment
//                                   its tag matches, before any publication that follows it
// and, in a policy with a transport, what its operations use: the warp-collective puts
// `put_warp(dst, src, bytes, pe)`, `put_signal_warp(dst, src, bytes, sig, v, pe)` and the
// ordering point `fence()` (ProxyNet adds `put_lanes` and its descriptor writers); the
// operations both transport policies share are templates over them at the end of this file.
//
// Operations. Each op phase has a per-warp type, built from the op's description (below:
// DispatchSend, CombinePush, LlDispatchSend; `op`), whose members all take that description;
// the type holds whatever the policy keeps across calls (ProxyNet's open runs). rows[d]: the
// row of the current token in rank d, -1 for none (shared memory).
//   DispatchSender                  [E4] intranode/dispatch.cuh
//     deal(gwarp, nwarps, n)        static: the warp's tokens (TokenDeal), block-first
//                                   (`deal_block_first`: consecutive tokens on different SMs)
//                                   or one contiguous chunk per warp (`deal_chunks`)
//     first(op, deal, token_slot, offsets, rows)  before the body's loop over the warp's
//                                   tokens (warp-collective): what the policy sends of them
//                                   itself, ahead of the body's stores (rows: the warp's
//                                   scratch, free again after it)
//     send_row(op, src, rows, n16)  the token's row (warp-collective): stores to every mapped
//                                   rank (warp_copy_row_multi), and to transport ranks what
//                                   the policy sends row by row
//     elements(op, d)               whether rank d gets the token's scales, top-k ids and
//                                   weights and its source index from the body, every element
//                                   in its final form by `put_elem`; false: the policy sends
//                                   them (`first`)
//   finish_dispatch(op, local, tid, nthreads)  static, [E8]: block 0 after [E6] (every
//                                   source's data landed) makes final what transport sources
//                                   sent raw
//   CombinePusher                   [C1] intranode/combine.cuh
//     push_runs(op, gwarp, nwarps, n)  before the block-first push, a pass of its own over
//                                   receive rows 0 .. n - 1: the rows the policy sends itself
//     sent(op, r)                   whether the rows of source r went in `push_runs`
//     push(op, r, row, slot)        receive row `row` of source r into r's combine slot
//                                   `slot`: true when the policy sent it with its weights and
//                                   flag (warp-collective), false when the body stores them
//   LlDispatchSender                [L3] ll/dispatch.cuh
//     send_row(op, src, rows, off, n16)  a BF16 row (whole when any rank is remote): stores
//                                   to every mapped rank, and the policy's puts
//     send_fp8(op, rows, stage, stage_sc)  after the cast into this rank's FP8 send rows
//                                   (warp-collective): the row and its scales to transport ranks
//     meta_row(op, d, row, remote)  where the body writes rank d's metadata row `row` with
//                                   `put_elem`, `remote` updated (a row staged here is stored)
//     put_meta(op, rows)            after the metadata rows: what `meta_row` staged
//   put_row(remote, dst, src, bytes, pe)  static, [L8] ll/combine.cuh: when `remote`, the row
//                                   to a transport rank (warp-collective) and true; false: the
//                                   body stores it
// StoreNet's operations store, and are empty where the others send to transport ranks;
// NvshmemNet sends rows by warp puts, metadata by element puts and a combine row with its flag
// by put-with-signal (deal: block-first); ProxyNet sends the normal dispatch's and the
// combine's transport rows as runs of descriptors (deal: chunks) and the low-latency
// metadata as staged rows.
//
// Ordering contract of the remote path (docs/protocol.md, "Net policies"): a thread that issued
// puts calls `quiet` before the block barrier that precedes a publication; a per-row
// publication uses put-with-signal, which NVSHMEM delivers after the row. Receivers poll their
// own signal words with acquire loads (wait.cuh), bounded as every other wait.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/ptx.cuh"

namespace epcomm {

struct WaitCtx;  // common/wait.cuh

// The tokens a warp sends: first, first + step, ... below end.
struct TokenDeal {
  int first, end, step;
};

// Block-first: warp g of n takes tokens g, g + n, ... (consecutive tokens on different SMs, so
// a small batch uses every SM).
__device__ __forceinline__ TokenDeal deal_block_first(int gwarp, int nwarps, int n) {
  return {gwarp, n, nwarps};
}

// Contiguous chunks: warp g of `nwarps` takes tokens [g * c, min((g + 1) * c, n)) with
// c = ceil(n / nwarps).
__device__ __forceinline__ TokenDeal deal_chunks(int gwarp, int nwarps, int n) {
  const int64_t chunk = (static_cast<int64_t>(n) + nwarps - 1) / nwarps;
  return {static_cast<int>(min(static_cast<int64_t>(gwarp) * chunk, static_cast<int64_t>(n))),
          static_cast<int>(min(static_cast<int64_t>(gwarp + 1) * chunk, static_cast<int64_t>(n))),
          1};
}

// [E4] A normal dispatch as its sender sees it. Token t's records in the caller's memory: its
// row at a.x + t * a.row_bytes, its scales, top-k ids and weights at `scales`, `topk_idx`,
// `topk_w` + t * (a.num_scales, top_k, top_k) (those the op has); in rank d's buffer row `row`
// of each at bases[d] + off_<record> + row * (its size), its source index at
// bases[d] + off_src_idx + row * 4.
struct DispatchSend {
  const OpArgs& a;
  uint8_t* const* bases;  // every rank's buffer (OpState::bases)
  const WaitCtx& w;       // transport PEs (peer_pe)
  const float* scales;
  const int64_t* topk_idx;
  const float* topk_w;
  uint64_t off_x, off_scales, off_topk_idx, off_topk_w, off_src_idx;
  int world, me, epr, top_k, lane;
  bool has_scales, has_topk, has_w;
};

// [C1] A combine's push as its pusher sees it: receive row `row` (of source rank
// row_rank(offsets, world, row), holding its token src_idx[row]) is y + row * row_bytes with
// weights y_w + row * top_k; its place in source r's buffer is combine slot `slot`
// (me * a.max_tokens + token): bases[r] + off_comb_x + slot * row_bytes, weights at
// off_comb_w + slot * top_k * 4, flag at a.off_comb_flags + slot * 8 (set to `epoch`).
struct CombinePush {
  const OpArgs& a;
  uint8_t* const* bases;  // every rank's buffer (OpState::bases)
  const WaitCtx& w;       // transport PEs (peer_pe)
  const int* offsets;     // the receive prefix, world + 1 entries (shared memory)
  const int32_t* src_idx;
  const uint8_t* y;
  const float* y_w;
  uint64_t off_comb_x, off_comb_w, epoch;
  int64_t row_bytes;
  int world, me, top_k, lane;
  bool has_w;
};

// The source rank of receive row `row` (offsets: the receive prefix, world + 1 entries).
__device__ __forceinline__ int row_rank(const int* offsets, int world, int row) {
  int r = 0;
  while (r + 1 < world && offsets[r + 1] <= row) ++r;
  return r;
}

// [L3] A low-latency dispatch as its sender sees it: rank d's row `row` of this rank's rows is
// at bases[d] + off_x + row * row_bytes (scales: off_sc + row * num_scales * 4, metadata:
// off_meta + row * (top_k + 1) * 4); this rank's metadata send rows (policies with
// kMetadataRows) at bases[me] + a.off_ll_send_meta, [world][max_tokens][top_k + 1] i32.
struct LlDispatchSend {
  const OpArgs& a;
  uint8_t* const* bases;  // every rank's buffer (OpState::bases)
  uint64_t off_x, off_sc, off_meta;
  int world, me, top_k, max_tokens, hidden, num_scales, row_bytes, lane;
};

// Every peer through its mapping: plain stores and system-scope release operations.
struct StoreNet {
  static constexpr bool kMetadataRows = false;
  static constexpr bool kWholeWords = true;  // aligned st.relaxed.sys

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

  // Stores need no ordering point of their own: the publication after them orders them.
  __device__ static __forceinline__ void fence() {}

  // [I6c] Warp-collective: `bytes` (a multiple of 16) from `src` into `dst`, then `v` added to
  // `sig` (release, after every earlier store of the warp).
  __device__ static __forceinline__ void put_signal_add_warp(void* dst, const void* src,
                                                             size_t bytes, uint64_t* sig,
                                                             uint64_t v, int) {
    const int lane = threadIdx.x % 32;
    warp_copy_row(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst),
                  static_cast<int>(bytes / 16), lane);
    __syncwarp();
    if (lane == 0) publish_add(sig, v, 0, false);
    __syncwarp();
  }

  // [E4] Tokens block-first; every rank gets the token by stores.
  struct DispatchSender {
    __device__ __forceinline__ explicit DispatchSender(const DispatchSend&) {}
    __device__ static __forceinline__ TokenDeal deal(int gwarp, int nwarps, int n) {
      return deal_block_first(gwarp, nwarps, n);
    }
    __device__ __forceinline__ void first(const DispatchSend&, const TokenDeal&, const int32_t*,
                                          const int*, int*) {}
    __device__ __forceinline__ void send_row(const DispatchSend& op, const int4* src,
                                             const int* rows, int n16) const {
      warp_copy_row_multi<StoreNet>(src, op.bases, rows, op.off_x, op.a.row_bytes, op.world, n16,
                                    op.lane, op.a.remote_mask);
    }
    __device__ __forceinline__ bool elements(const DispatchSend&, int) const { return true; }
  };

  // [E8] Every row arrived in its final form.
  __device__ static __forceinline__ void finish_dispatch(const DispatchSend&, uint8_t*, int, int) {}

  // [C1] Every row is stored by the body.
  struct CombinePusher {
    __device__ __forceinline__ explicit CombinePusher(const CombinePush&) {}
    __device__ __forceinline__ void push_runs(const CombinePush&, int, int, int) const {}
    __device__ __forceinline__ bool sent(const CombinePush&, int) const { return false; }
    __device__ __forceinline__ bool push(const CombinePush&, int, int, int64_t) const {
      return false;
    }
  };

  // [L3] Every row, scale and metadata element is stored by the body or `send_row`.
  struct LlDispatchSender {
    __device__ __forceinline__ explicit LlDispatchSender(const LlDispatchSend&) {}
    __device__ __forceinline__ void send_row(const LlDispatchSend& op, const int4* src,
                                             const int* rows, uint64_t off, int n16) const {
      warp_copy_row_multi<StoreNet>(src, op.bases, rows, off, op.row_bytes, op.world, n16,
                                    op.lane, op.a.remote_mask);
    }
    __device__ __forceinline__ void send_fp8(const LlDispatchSend&, const int*, const uint8_t*,
                                             const float*) const {}
    __device__ __forceinline__ int32_t* meta_row(const LlDispatchSend& op, int d, int row,
                                                 bool&) const {
      return reinterpret_cast<int32_t*>(op.bases[d] + op.off_meta) +
             static_cast<int64_t>(row) * (op.top_k + 1);
    }
    __device__ __forceinline__ void put_meta(const LlDispatchSend&, const int*) const {}
  };

  // [L8] Every row is stored by the body.
  __device__ static __forceinline__ bool put_row(bool, void*, const void*, size_t, int) {
    return false;
  }
};

// Operations the policies with a transport share (NvshmemNet all of them, ProxyNet those of
// the low-latency kernels: its normal dispatch and combine send runs instead): a row, or a
// staged row, to every transport destination by one warp put each (`Net::put_warp`:
// NVSHMEM's `putmem_nbi_warp`, or a proxy TRANSFER).

// warp_copy_row_multi (stores to every mapped destination), then one warp put of the row to
// every transport destination d with rows[d] >= 0, to PE pe_base + d * pe_stride. One warp.
template <class Net>
__device__ __forceinline__ void warp_copy_put_row_multi(const int4* src, uint8_t* const* bases,
                                                        const int* rows, uint64_t off,
                                                        int64_t row_bytes, int ndst, int n16,
                                                        int lane, uint64_t remote_mask,
                                                        int pe_base, int pe_stride) {
  warp_copy_row_multi<Net>(src, bases, rows, off, row_bytes, ndst, n16, lane, remote_mask);
  for (int d = 0; remote_mask != 0 && d < ndst; ++d)
    if (rows[d] >= 0 && Net::remote(remote_mask, d))
      Net::put_warp(bases[d] + off + rows[d] * row_bytes, src, static_cast<size_t>(n16) * 16,
                    pe_base + d * pe_stride);
}

// [E4] The dispatch sender of a policy with warp puts whose transport ranks get each token on
// its own: StoreNet's (block-first, metadata element by element), with the row also put to
// every transport rank.
template <class Net>
struct PutDispatchSender : StoreNet::DispatchSender {
  __device__ __forceinline__ explicit PutDispatchSender(const DispatchSend& op)
      : StoreNet::DispatchSender(op) {}

  __device__ __forceinline__ void send_row(const DispatchSend& op, const int4* src,
                                           const int* rows, int n16) const {
    warp_copy_put_row_multi<Net>(src, op.bases, rows, op.off_x, op.a.row_bytes, op.world, n16,
                                 op.lane, op.a.remote_mask, op.w.pe_base, op.w.pe_stride);
  }
};

// [L8] `put_row` of a policy with warp puts: when `remote`, the row by one warp put (true).
template <class Net>
__device__ __forceinline__ bool put_row_if_remote(bool remote, void* dst, const void* src,
                                                  size_t bytes, int pe) {
  if (!remote) return false;
  Net::put_warp(dst, src, bytes, pe);
  return true;
}

// [L3] The low-latency dispatch sender of a policy with warp puts: a BF16 row by stores and
// puts, an FP8 row and its scales from this rank's send rows by one put each; metadata rows as
// StoreNet writes them (`put_elem` reaches a transport rank element by element). Rows are put
// to PE d (the low-latency kernels address group ranks as PEs).
template <class Net>
struct PutLlDispatchSender : StoreNet::LlDispatchSender {
  __device__ __forceinline__ explicit PutLlDispatchSender(const LlDispatchSend& op)
      : StoreNet::LlDispatchSender(op) {}

  __device__ __forceinline__ void send_row(const LlDispatchSend& op, const int4* src,
                                           const int* rows, uint64_t off, int n16) const {
    warp_copy_put_row_multi<Net>(src, op.bases, rows, off, op.row_bytes, op.world, n16, op.lane,
                                 op.a.remote_mask, 0, 1);
  }

  // After the warp cast the whole row (nch == 1) into `stage` (and `stage_sc`): the stores of
  // the whole warp are made visible, then rank d gets both (warp-collective).
  __device__ __forceinline__ void send_fp8(const LlDispatchSend& op, const int* rows,
                                           const uint8_t* stage, const float* stage_sc) const {
    if (op.a.remote_mask == 0) return;
    __syncwarp();
    __threadfence();
    for (int d = 0; d < op.world; ++d)
      if (rows[d] >= 0 && Net::remote(op.a.remote_mask, d)) {
        Net::put_warp(op.bases[d] + op.off_x + static_cast<int64_t>(rows[d]) * op.row_bytes,
                      stage, static_cast<size_t>(op.hidden), d);
        Net::put_warp(op.bases[d] + op.off_sc + static_cast<int64_t>(rows[d]) * op.num_scales * 4,
                      stage_sc, static_cast<size_t>(op.num_scales) * 4, d);
      }
  }
};

}  // namespace epcomm
