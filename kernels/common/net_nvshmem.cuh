// The NVSHMEM Net policy (contract: common/net.cuh): peers whose bit is set in
// OpArgs::remote_mask are reached with NVSHMEM put/signal, every other peer through its mapping
// exactly as StoreNet does. Needs the NVSHMEM device headers and an image device-linked with
// libnvshmem_device, so only such images' entry files include it.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/net.cuh"
#include "common/seq.cuh"
#include "common/wait.cuh"

namespace epcomm {

struct NvshmemNet {
  // Metadata goes element by element (`nvshmem_<type>_p`), in its final form.
  static constexpr bool kMetadataRows = false;
  static constexpr bool kWholeWords = true;  // stores, or nvshmemx_signal_op (an atomic)

  __device__ static __forceinline__ bool remote(uint64_t remote_mask, int d) {
    return ((remote_mask >> d) & 1ull) != 0;
  }

  __device__ static __forceinline__ void set_word(uint64_t* p, uint64_t v, int pe, bool remote) {
    if (remote)
      nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_SET, pe);
    else
      StoreNet::set_word(p, v, pe, false);
  }

  __device__ static __forceinline__ void publish_set(uint64_t* p, uint64_t v, int pe,
                                                     bool remote) {
    if (!remote) return StoreNet::publish_set(p, v, pe, false);
    nvshmem_fence();
    nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_SET, pe);
  }

  __device__ static __forceinline__ void publish_add(uint64_t* p, uint64_t v, int pe,
                                                     bool remote) {
    if (!remote) return StoreNet::publish_add(p, v, pe, false);
    nvshmem_fence();
    nvshmemx_signal_op(p, v, NVSHMEM_SIGNAL_ADD, pe);
  }

  __device__ static __forceinline__ bool quiet(const WaitCtx&, uint64_t remote_mask) {
    if (remote_mask != 0) nvshmem_quiet();
    return true;
  }

  // One element: a store, or `nvshmem_<type>_p` on the remote path.
  template <typename T>
  __device__ static __forceinline__ void put_elem(T* p, T v, int pe, bool remote) {
    if (remote)
      put_remote_elem(p, v, pe);
    else
      *p = v;
  }
  __device__ static __forceinline__ void put_remote_elem(int64_t* p, int64_t v, int pe) {
    nvshmem_int64_p(p, v, pe);
  }
  __device__ static __forceinline__ void put_remote_elem(int32_t* p, int32_t v, int pe) {
    nvshmem_int32_p(p, v, pe);
  }
  __device__ static __forceinline__ void put_remote_elem(float* p, float v, int pe) {
    nvshmem_float_p(p, v, pe);
  }

  // Orders this thread's earlier puts before its later ones to the same PE.
  __device__ static __forceinline__ void fence() { nvshmem_fence(); }

  // Warp-collective put of `bytes` from local `src` into rank `pe`'s copy of symmetric `dst`.
  __device__ static __forceinline__ void put_warp(void* dst, const void* src, size_t bytes,
                                                  int pe) {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
  }

  // Warp-collective put of a row followed by a signal set, delivered after the row.
  __device__ static __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes,
                                                         uint64_t* sig, uint64_t v, int pe) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, v, NVSHMEM_SIGNAL_SET, pe);
  }

  // Warp-collective put of a row followed by a signal add, delivered after the row.
  __device__ static __forceinline__ void put_signal_add_warp(void* dst, const void* src,
                                                             size_t bytes, uint64_t* sig,
                                                             uint64_t v, int pe) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, v, NVSHMEM_SIGNAL_ADD, pe);
  }

  // [E4] Tokens block-first, each on its own: its row by stores and one warp put per transport
  // rank, its metadata and source index element by element (`put_elem`) to every rank.
  using DispatchSender = PutDispatchSender<NvshmemNet>;

  // [E8] Every row arrived in its final form.
  __device__ static __forceinline__ void finish_dispatch(const DispatchSend&, uint8_t*, int, int) {}

  // [C1] A transport rank's row: its weights, then the row with its flag (put-with-signal,
  // delivered after the row), ordered by a fence; block-first as the mapped ranks' rows.
  struct CombinePusher {
    __device__ __forceinline__ explicit CombinePusher(const CombinePush&) {}
    __device__ __forceinline__ void push_runs(const CombinePush&, int, int, int) const {}
    __device__ __forceinline__ bool sent(const CombinePush&, int) const { return false; }
    __device__ __forceinline__ bool push(const CombinePush& op, int r, int row,
                                         int64_t slot) const {
      if (!remote(op.a.remote_mask, r)) return false;
      if (op.has_w)
        put_warp(op.bases[r] + op.off_comb_w + slot * op.top_k * 4,
                 op.y_w + static_cast<int64_t>(row) * op.top_k,
                 static_cast<size_t>(op.top_k) * 4, peer_pe(op.w, r));
      fence();
      put_signal_warp(op.bases[r] + op.off_comb_x + slot * op.row_bytes, op.y + row * op.row_bytes,
                      static_cast<size_t>(op.row_bytes),
                      u64_at(op.bases[r], op.a.off_comb_flags) + slot, op.epoch,
                      peer_pe(op.w, r));
      return true;
    }
  };

  // [L3] Rows and FP8 rows by warp puts, metadata element by element.
  using LlDispatchSender = PutLlDispatchSender<NvshmemNet>;

  // [L8] A transport rank's row by one warp put.
  __device__ static __forceinline__ bool put_row(bool is_remote, void* dst, const void* src,
                                                 size_t bytes, int pe) {
    return put_row_if_remote<NvshmemNet>(is_remote, dst, src, bytes, pe);
  }
};

}  // namespace epcomm
