// Rail forwarding (kFlagForward): the normal dispatch over a world of nodes x gpus_per_node
// ranks in which a token bound for ranks of another node crosses the rail once per node, not
// once per rank. docs/internode.md ("The fused op") has the plan, docs/protocol.md
// ("Chunked forwarding") the model-checked protocol whose steps are cited here.
//
// Rank me = (node n_me, local index l_me). Its rail peer in node n is f(n) = n * L + l_me.
//  * Sender ([I6c], the dispatch's sending warps): a token for ranks of node n != n_me is one
//    entry of this rank's stream to node n: entry j of the op (its index among this rank's
//    tokens for node n, `token_node_slot`) is entry G = sent[n] + j since the buffer was made.
//    It goes to position G % (R C) of f(n)'s ring for source node n_me, in slot
//    (G / C) % R, once the forwarder freed the slot's whole chunk of the lap before (this
//    rank's word `freed[n][slot]`), not only the entry that held this position: an op may end
//    inside a chunk and free part of it, and an entry of the next lap landing in a freed part
//    before the rest of that chunk would count towards the chunk's `landed` wait (both rules
//    explored in epcomm_protocol::ring_entries). An entry carries the token index, the token's row
//    in each rank of node n (-1: none), its row, scales, top-k ids and weights; it lands by
//    one put whose signal adds 1 to `landed[n_me][slot]` at f(n).
//  * Forwarder ([I8c]/[I9c], the grid's last fwd_blocks blocks per source node m != n_me): the
//    op's entries from the rail peer s = m * L + l_me, taken a chunk at a time (the entries of
//    one slot and lap; the op's first and last chunks may be partial), chunk c of the op by
//    block c % fwd_blocks of the group. Once every entry of the chunk landed, the block stores
//    each into the receive rows of the ranks of this node it goes to, in its final form (the
//    flat dispatch's rows: the same bits), then frees the slot (sets s's freed word to the
//    entries freed there). The last block of the group to finish adds the op's done count for
//    s (gridDim.x) at every rank of this node ([E5] on s's behalf).
// Entries are counted since the buffer was made (`sent`, `taken`: OpArgs::off_ring_state by
// dispatch parity, advanced by block 0 at the op's end), so nothing is reset between ops.
#pragma once
#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/net.cuh"
#include "common/wait.cuh"
#include "intranode/shared.cuh"

namespace epcomm::intranode {

// Byte layout of one ring entry: header (token index, then the token's row in each rank of the
// destination node, i32), row (hidden * 2 bytes: BF16 or FP8), FP8 scales, top-k ids (i64,
// the source's, global), top-k weights (f32). The host sizes entries with the same formula
// (epcomm_topology::RingEntry).
struct RingEntry {
  int64_t row, scales, ids, weights, bytes;
  __device__ __forceinline__ explicit RingEntry(const OpArgs& a) {
    const auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
    row = up(4 * (1 + static_cast<int64_t>(a.gpus_per_node)), 16);
    scales = row + 2 * static_cast<int64_t>(a.hidden);
    ids = up(scales + 4 * static_cast<int64_t>(a.hidden / 128), 8);
    weights = ids + 8 * static_cast<int64_t>(a.top_k);
    bytes = up(weights + 4 * static_cast<int64_t>(a.top_k), 16);
  }
};

// Where entry G of a stream lives: its ring position, slot, and index among every entry ever
// placed in that slot (the unit of `landed` and `freed`).
struct RingPos {
  uint64_t pos, slot, k;
  __device__ __forceinline__ RingPos(uint64_t g, const OpArgs& a) {
    const uint64_t c = static_cast<uint64_t>(a.ring_chunk);
    const uint64_t rc = c * static_cast<uint64_t>(a.ring_slots);
    pos = g % rc;
    slot = pos / c;
    k = g / rc * c + pos % c;
  }
};

// The ring state words of this rank (OpArgs::off_ring_state): before this op, entries sent to
// node n (`sent`) and taken from node m (`taken`), by dispatch parity; then the forwarder
// blocks finished per source node (monotonic).
__device__ __forceinline__ uint64_t* ring_sent(uint8_t* local, const OpArgs& a, uint64_t par,
                                               int n, int nodes) {
  return u64_at(local, a.off_ring_state) + (par * 2 + 0) * nodes + n;
}
__device__ __forceinline__ uint64_t* ring_taken(uint8_t* local, const OpArgs& a, uint64_t par,
                                                int m, int nodes) {
  return u64_at(local, a.off_ring_state) + (par * 2 + 1) * nodes + m;
}
__device__ __forceinline__ uint64_t* ring_blocks_done(uint8_t* local, const OpArgs& a, int m,
                                                      int nodes) {
  return u64_at(local, a.off_ring_state) + 4 * nodes + m;
}

// [I6c] One entry, warp-collective: token t (row `src`), bound for node n (rows: the token's
// row in every rank, -1 for none) as entry G of this rank's stream there. False (the whole
// warp) when the wait for its slot failed (recorded).
template <class Net>
__device__ __forceinline__ bool ring_send(const DispatchSend& op, int n, uint64_t g, int t,
                                          const int* rows, const uint8_t* src) {
  const OpArgs& a = op.a;
  const int L = a.gpus_per_node, lane = op.lane;
  const int me = op.me, n_me = me / L, f = n * L + me % L;
  const RingPos p(g, a);
  const RingEntry ent(a);
  uint8_t* const local = op.bases[me];
  // The slot's chunk of the previous lap (entries below k rounded down to a chunk) must have
  // been freed, every entry of it: `landed` counts entries, not which ones, so no entry of
  // this lap may land while one of the previous lap is still to land.
  bool ok = true;
  const uint64_t C = static_cast<uint64_t>(a.ring_chunk);
  if (lane == 0 && p.k >= C)
    ok = wait_geq<Net>(op.w, u64_at(local, a.off_ring_freed) + n * a.ring_slots + p.slot,
                       p.k / C * C, kWaitRingFree, f, nullptr);
  if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
  const bool remote = Net::remote(a.remote_mask, f);
  const int pe = peer_pe(op.w, f);
  uint8_t* const e = op.bases[f] + a.off_ring +
                     (static_cast<int64_t>(n_me) * a.ring_slots * a.ring_chunk + p.pos) * ent.bytes;
  int32_t* const hdr = reinterpret_cast<int32_t*>(e);
  if (lane == 0) Net::put_elem(hdr, static_cast<int32_t>(t), pe, remote);
  for (int i = lane; i < L; i += 32) Net::put_elem(hdr + 1 + i, rows[n * L + i], pe, remote);
  if (op.has_scales)
    for (int i = lane; i < a.num_scales; i += 32)
      Net::put_elem(reinterpret_cast<float*>(e + ent.scales) + i,
                    op.scales[static_cast<int64_t>(t) * a.num_scales + i], pe, remote);
  if (op.has_topk)
    for (int k = lane; k < op.top_k; k += 32) {
      const int64_t i = static_cast<int64_t>(t) * op.top_k + k;
      Net::put_elem(reinterpret_cast<int64_t*>(e + ent.ids) + k, op.topk_idx[i], pe, remote);
      if (op.has_w)
        Net::put_elem(reinterpret_cast<float*>(e + ent.weights) + k, op.topk_w[i], pe, remote);
    }
  uint64_t* const sig = u64_at(op.bases[f], a.off_ring_landed) + n_me * a.ring_slots + p.slot;
  if (remote) {
    Net::fence();  // every lane: its header and metadata puts before the row and its signal
    Net::put_signal_add_warp(e + ent.row, src, static_cast<size_t>(a.row_bytes), sig, 1, pe);
  } else {
    StoreNet::put_signal_add_warp(e + ent.row, src, static_cast<size_t>(a.row_bytes), sig, 1, pe);
  }
  return true;
}

// [I8c]/[I9c] Forwarder block `fb` of `nfb` for source node m: takes the op's `count` entries
// from the rail peer there, starting at entry `g0` of its stream, and stores each into the
// receive regions of the ranks of this node. False (block-uniform) when a wait failed.
template <class Net>
__device__ __forceinline__ bool forward_source(const OpArgs& a, Shared& s, int m, int fb, int nfb,
                                               uint64_t g0, uint64_t count, uint64_t off_x,
                                               uint64_t off_scales, uint64_t off_topk_idx,
                                               uint64_t off_topk_w, uint64_t off_src_idx) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int L = a.gpus_per_node, me = a.rank, n_me = me / L, world = a.world, K = a.top_k;
  const int src = m * L + me % L, epr = a.num_experts / world;
  const WaitCtx& w = s.wait;
  uint8_t* const local = s.bases[me];
  const RingEntry ent(a);
  const uint64_t C = static_cast<uint64_t>(a.ring_chunk);
  const bool has_scales = (a.flags & kFlagHasScales) != 0;
  const bool has_topk = (a.flags & kFlagHasTopk) != 0;
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int n16 = a.row_bytes / 16;
  int* rows = s.rows[warp];
  if (count == 0) return true;
  const uint64_t g1 = g0 + count, c0 = g0 / C, c1 = (g1 - 1) / C;
  for (uint64_t c = c0 + fb; c <= c1; c += nfb) {
    const uint64_t lo = max(g0, c * C), hi = min(g1, (c + 1) * C);
    const RingPos last(hi - 1, a);
    bool ok = true;
    if (tid == 0)
      ok = wait_geq<Net>(w, u64_at(local, a.off_ring_landed) + m * a.ring_slots + last.slot,
                         last.k + 1, kWaitRingChunk, src, nullptr);
    if (!all_ok(s, ok)) return false;
    for (uint64_t g = lo + warp; g < hi; g += kWarps) {
      const RingPos p(g, a);
      const uint8_t* e =
          local + a.off_ring + (static_cast<int64_t>(m) * a.ring_slots * a.ring_chunk + p.pos) * ent.bytes;
      const int32_t* hdr = reinterpret_cast<const int32_t*>(e);
      for (int d = lane; d < world; d += 32)
        rows[d] = d / L == n_me ? reinterpret_cast<const volatile int32_t*>(hdr)[1 + d % L] : -1;
      const int32_t t = reinterpret_cast<const volatile int32_t*>(hdr)[0];
      __syncwarp();
      // The row, once per rank of this node it goes to (all mapped).
      const int4* row = reinterpret_cast<const int4*>(e + ent.row);
      for (int base = 0; base < n16; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int i = base + u * 32 + lane;
          if (i < n16) v[u] = ld_v4(row + i);
        }
        for (int i = 0; i < L; ++i) {
          const int d = n_me * L + i, r = rows[d];
          if (r < 0) continue;
          store_step(reinterpret_cast<int4*>(s.bases[d] + off_x + static_cast<int64_t>(r) * a.row_bytes),
                     v, base, n16, lane);
        }
      }
      if (has_scales)
        for (int i = lane; i < a.num_scales; i += 32) {
          const float v = reinterpret_cast<const volatile float*>(e + ent.scales)[i];
          for (int j = 0; j < L; ++j) {
            const int d = n_me * L + j, r = rows[d];
            if (r >= 0)
              reinterpret_cast<float*>(s.bases[d] + off_scales)[static_cast<int64_t>(r) * a.num_scales + i] = v;
          }
        }
      if (has_topk)
        for (int k = lane; k < K; k += 32) {
          const int64_t id = reinterpret_cast<const volatile int64_t*>(e + ent.ids)[k];
          const float wt = has_w ? reinterpret_cast<const volatile float*>(e + ent.weights)[k] : 0.f;
          for (int j = 0; j < L; ++j) {
            const int d = n_me * L + j, r = rows[d];
            if (r < 0) continue;
            const int64_t lo_e = static_cast<int64_t>(d) * epr;
            const bool here = id >= lo_e && id < lo_e + epr;
            const int64_t at = static_cast<int64_t>(r) * K + k;
            reinterpret_cast<int64_t*>(s.bases[d] + off_topk_idx)[at] = here ? id - lo_e : int64_t{-1};
            if (has_w) reinterpret_cast<float*>(s.bases[d] + off_topk_w)[at] = here ? wt : 0.f;
          }
        }
      if (lane < L) {
        const int d = n_me * L + lane, r = rows[d];
        if (r >= 0) reinterpret_cast<int32_t*>(s.bases[d] + off_src_idx)[r] = t;
      }
      __syncwarp();
    }
    __syncthreads();  // every entry of the chunk read (and stored)
    // [I9c] the slot's entries up to the chunk's last are free again at the sender.
    if (tid == 0)
      Net::publish_set(u64_at(s.bases[src], a.off_ring_freed) + n_me * a.ring_slots + last.slot,
                       last.k + 1, peer_pe(w, src), Net::remote(a.remote_mask, src));
  }
  return true;
}

// After a forwarder block's last chunk of source node m: the group's last block to finish
// adds the op's done count for the source (gridDim.x, what its own blocks add at the ranks of
// its node) at every rank of this node, after every store of the group. One thread.
template <class Net>
__device__ __forceinline__ void forward_done(const OpArgs& a, Shared& s, int m, int nfb) {
  const int L = a.gpus_per_node, me = a.rank, n_me = me / L, nodes = a.world / L;
  const int src = m * L + me % L;
  __threadfence_system();
  const unsigned long long before =
      atomicAdd(reinterpret_cast<unsigned long long*>(ring_blocks_done(s.bases[me], a, m, nodes)), 1ull);
  if ((before + 1) % static_cast<unsigned long long>(nfb) != 0) return;
  __threadfence_system();
  for (int i = 0; i < L; ++i) {
    const int d = n_me * L + i;
    Net::publish_add(u64_at(s.bases[d], a.off_done) + src, gridDim.x, peer_pe(s.wait, d),
                     Net::remote(a.remote_mask, d));
  }
}

}  // namespace epcomm::intranode
