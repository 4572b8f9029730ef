// Dispatch (and cached dispatch, kFlagCached): the count exchange fused with the data.
#pragma once
#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "intranode/forward.cuh"
#include "intranode/shared.cuh"

namespace epcomm::intranode {

// The body of `epcomm_dispatch` over the image's Net policy; `s` is the block's shared state.
template <class Net>
__device__ __forceinline__ void dispatch(const OpArgs& a, Shared& s) {
  const uint64_t t_start = globaltimer_ns();
  const bool cached = (a.flags & kFlagCached) != 0;
  const uint32_t kind = cached ? kOpCachedDispatch : kOpDispatch;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const int epr = a.num_experts / world;
  const bool block0 = blockIdx.x == 0;
  if (!prologue<Net>(a, s, kind)) return;
  const OpSeq q = s.seq;
  const WaitCtx& w = s.wait;
  // Regions of this op: receive rows by dispatch parity, counts by notify parity.
  const uint64_t dpar = (q.dispatch & 1) * a.parity_stride;
  const uint64_t npar = (q.notify & 1) * a.parity_stride;
  const uint64_t off_x = a.off_x + dpar, off_scales = a.off_scales + dpar;
  const uint64_t off_topk_idx = a.off_topk_idx + dpar, off_topk_w = a.off_topk_w + dpar;
  const uint64_t off_src_idx = a.off_src_idx + dpar;
  const uint64_t off_counts = a.off_counts + npar;
  const uint64_t off_expert_counts = a.off_expert_counts + npar;
  const uint64_t off_node_counts = a.off_node_counts + npar;
  // Rail forwarding (intranode/forward.cuh): the grid's last fwd_blocks * (nodes - 1) blocks
  // forward, the others send.
  const bool forward = (a.flags & kFlagForward) != 0;
  // Without forwarding the world is one node (every rank gets its rows from here).
  const int L = forward ? a.gpus_per_node : world, nodes = world / L, n_me = me / L;
  const int nfwd = forward ? a.fwd_blocks * (nodes - 1) : 0;
  const int nsend = static_cast<int>(gridDim.x) - nfwd;
  const bool forwarder = static_cast<int>(blockIdx.x) >= nsend;
  const uint64_t rpar = q.dispatch & 1;  // the ring state words of this op
  uint8_t* const local = s.bases[me];
  uint64_t* const stats = u64_at(local, a.off_stats);
  // The layout kernel (earlier on this stream) rejected its input: move nothing.
  if (*reinterpret_cast<const volatile uint32_t*>(a.layout_status) != 0) return;
  Schedule<Net> sched(a);
  if (!sched.barrier(a, s)) return;  // [G1]

  if (!cached) {
    const uint32_t* per_rank = reinterpret_cast<const uint32_t*>(a.layout_counts);
    const uint32_t* per_expert = per_rank + world;
    if (block0) {  // [E1] my count row (and per-expert counts) to every rank, epoch-tagged
      for (int i = tid; i < world * world; i += kThreads) {
        const int d = i / world, j = i % world;
        Net::set_word(u64_at(s.bases[d], off_counts) + me * world + j,
                      make_tagged(q.epoch, per_rank[j]), peer_pe(w, d),
                      Net::remote(a.remote_mask, d));
      }
      for (int i = tid; i < world * epr; i += kThreads) {
        const int d = i / epr, l = i % epr;
        Net::set_word(u64_at(s.bases[d], off_expert_counts) + me * epr + l,
                      make_tagged(q.epoch, per_expert[d * epr + l]), peer_pe(w, d),
                      Net::remote(a.remote_mask, d));
      }
      // Rail forwarding: to the rail peer in every other node, how many of my tokens go
      // through it (the layout's per-node counts follow the per-expert ones).
      if (forward && tid < nodes && tid != n_me) {
        const int f = tid * L + me % L;
        Net::set_word(u64_at(s.bases[f], off_node_counts) + n_me,
                      make_tagged(q.epoch, per_expert[a.num_experts + tid]), peer_pe(w, f),
                      Net::remote(a.remote_mask, f));
      }
    }
    if (!sched.barrier(a, s)) return;  // [G3]
    // [E2] the whole count matrix, from my own buffer.
    const uint64_t* counts = u64_at(local, off_counts);
    bool ok = true;
    for (int i = tid; ok && i < world * world; i += kThreads) {
      const bool track = block0 && (i % world) == 0;
      uint64_t arrived = 0;
      ok = wait_tag<Net>(w, counts + i, q.epoch, kWaitCountRow, i / world, &s.counts[i],
                    track ? &arrived : nullptr);
      if (ok && track) stats[kStatPeers + world + i / world] = arrived;
    }
    if (!all_ok(s, ok)) return;
    // [E3] offsets of my rows in every destination; capacity check (same on every rank).
    if (tid < world) {
      int off = 0;
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        if (r < me) off += s.counts[r * world + tid];
        total += s.counts[r * world + tid];
      }
      s.offsets[tid] = off;
      if (total > a.max_recv_rows) {
        record_failure<Net>(w, kOverflow, kWaitNone, tid, static_cast<uint64_t>(a.max_recv_rows),
                       static_cast<uint64_t>(total), 0);
        ok = false;
      }
    }
    if (!all_ok(s, ok)) return;
    if (block0) {  // handle + host-visible counts
      int* send_offsets = reinterpret_cast<int*>(a.send_offsets);
      int* recv_prefix = reinterpret_cast<int*>(a.recv_prefix);
      volatile uint64_t* host = reinterpret_cast<volatile uint64_t*>(a.host_counts);
      if (tid < world) send_offsets[tid] = s.offsets[tid];
      if (tid == 0) {
        int acc = 0;
        for (int r = 0; r < world; ++r) {
          recv_prefix[r] = acc;
          acc += s.counts[r * world + me];
        }
        recv_prefix[world] = acc;
        host[1] = static_cast<uint64_t>(acc);
        host[2 + epr] = static_cast<uint64_t>(recv_prefix[me]);  // rows I sent myself
        host[3 + epr] = static_cast<uint64_t>(s.counts[me * world + me]);
        stats[kStatCountsReady] = globaltimer_ns();
      }
      const uint64_t* ecounts = u64_at(local, off_expert_counts);
      int* recv_expert = reinterpret_cast<int*>(a.recv_expert_counts);
      for (int l = tid; ok && l < epr; l += kThreads) {
        uint32_t sum = 0;
        for (int r = 0; ok && r < world; ++r) {
          uint32_t v = 0;
          ok = wait_tag<Net>(w, ecounts + r * epr + l, q.epoch, kWaitExpertCounts, r, &v, nullptr);
          sum += v;
        }
        recv_expert[l] = static_cast<int>(sum);
        host[2 + l] = sum;
      }
      if (!all_ok(s, ok)) return;
      if (tid == 0) {
        __threadfence_system();
        host[0] = q.epoch;  // the host may now read the sizes (HostSync), data still moving
      }
    }
    if (!sched.barrier(a, s)) return;  // [G5]
  } else {
    if (tid < world) s.offsets[tid] = reinterpret_cast<const int*>(a.send_offsets)[tid];
    __syncthreads();
  }

  // [E4] every token once to every destination rank, straight into its final row. The Net
  // policy's sender deals this warp its tokens (block-first, so small batches use every SM, or
  // in contiguous chunks) and sends what it sends itself; every other rank gets the row by
  // stores and the metadata element by element (common/net.cuh, `DispatchSender`).
  const int gwarp = warp * nsend + blockIdx.x, nwarps = nsend * kWarps;
  const int32_t* token_slot = reinterpret_cast<const int32_t*>(a.token_slot);
  const int n16 = a.row_bytes / 16;
  const bool has_scales = (a.flags & kFlagHasScales) != 0;
  const bool has_topk = (a.flags & kFlagHasTopk) != 0;
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const float* topk_w = reinterpret_cast<const float*>(a.topk_weights);
  const float* scales = reinterpret_cast<const float*>(a.x_scales);
  const int num_tokens = op_tokens(a);
  const DispatchSend op{a, s.bases, w, scales, topk_idx, topk_w, off_x, off_scales, off_topk_idx,
                        off_topk_w, off_src_idx, world, me, epr, K, lane, has_scales, has_topk,
                        has_w};
  bool sent_ok = true;
  if (forwarder) {
    // [I8c]/[I9c] this block's share of one source node's entries.
    const int g = static_cast<int>(blockIdx.x) - nsend, mi = g / a.fwd_blocks;
    const int m = mi < n_me ? mi : mi + 1, src = m * L + me % L;
    uint32_t count = 0;
    if (tid == 0) {
      if (cached) {
        count = static_cast<uint32_t>(reinterpret_cast<const int32_t*>(a.recv_node_counts)[m]);
      } else {
        sent_ok = wait_tag<Net>(w, u64_at(local, off_node_counts) + m, q.epoch, kWaitCountRow, src,
                                &count, nullptr);
        if (sent_ok && g % a.fwd_blocks == 0)
          reinterpret_cast<int32_t*>(a.recv_node_counts)[m] = static_cast<int32_t>(count);
      }
      s.counts[0] = count;
    }
    if (!all_ok(s, sent_ok)) return;
    count = s.counts[0];
    if (!forward_source<Net>(a, s, m, g % a.fwd_blocks, a.fwd_blocks,
                             *ring_taken(local, a, rpar, m, nodes), count, off_x, off_scales,
                             off_topk_idx, off_topk_w, off_src_idx))
      return;
    __syncthreads();
    if (tid == 0) forward_done<Net>(a, s, m, a.fwd_blocks);
  }
  const int32_t* token_node_slot = reinterpret_cast<const int32_t*>(a.token_node_slot);
  const TokenDeal deal =
      forwarder ? TokenDeal{0, 0, 1} : Net::DispatchSender::deal(gwarp, nwarps, num_tokens);
  typename Net::DispatchSender tx(op);
  int* rows = s.rows[warp];
  tx.first(op, deal, token_slot, s.offsets, rows);
  for (int t = deal.first; t < deal.end; t += deal.step) {
    for (int d = lane; d < world; d += 32) {
      const int slot = token_slot[static_cast<int64_t>(t) * world + d];
      rows[d] = slot >= 0 ? s.offsets[d] + slot : -1;
    }
    __syncwarp();
    if (forward) {
      // [I6c] once to the rail peer of every other node the token goes to, then only the
      // ranks of this node get it from here.
      for (int n = 0; n < nodes && sent_ok; ++n) {
        if (n == n_me) continue;
        const int j = token_node_slot[static_cast<int64_t>(t) * nodes + n];
        if (j < 0) continue;
        sent_ok = ring_send<Net>(op, n, *ring_sent(local, a, rpar, n, nodes) + j, t, rows,
                                 reinterpret_cast<const uint8_t*>(
                                     a.x + static_cast<int64_t>(t) * a.row_bytes));
      }
      if (!sent_ok) break;
      __syncwarp();
      for (int d = lane; d < world; d += 32)
        if (d / L != n_me) rows[d] = -1;
      __syncwarp();
    }
    tx.send_row(op, reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.row_bytes),
                rows, n16);
    // The metadata of every rank the sender leaves to element writes (`put_elem`: stores, or
    // the transport's single-element puts), in its final form.
    if (has_scales)
      for (int i = lane; i < a.num_scales; i += 32) {
        const float v = scales[static_cast<int64_t>(t) * a.num_scales + i];
        for (int d = 0; d < world; ++d)
          if (rows[d] >= 0 && tx.elements(op, d))
            Net::put_elem(reinterpret_cast<float*>(s.bases[d] + off_scales) +
                              static_cast<int64_t>(rows[d]) * a.num_scales + i,
                          v, peer_pe(w, d), Net::remote(a.remote_mask, d));
      }
    if (has_topk)
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
        const float wt = has_w ? topk_w[static_cast<int64_t>(t) * K + k] : 0.f;
        for (int d = 0; d < world; ++d) {
          if (rows[d] < 0 || !tx.elements(op, d)) continue;
          const int64_t lo = static_cast<int64_t>(d) * epr;
          const bool here = e >= lo && e < lo + epr;
          const int64_t r = static_cast<int64_t>(rows[d]) * K + k;
          const bool remote = Net::remote(a.remote_mask, d);
          Net::put_elem(reinterpret_cast<int64_t*>(s.bases[d] + off_topk_idx) + r,
                        here ? e - lo : int64_t{-1}, peer_pe(w, d), remote);
          if (has_w)
            Net::put_elem(reinterpret_cast<float*>(s.bases[d] + off_topk_w) + r, here ? wt : 0.f,
                          peer_pe(w, d), remote);
        }
      }
    if (lane == 0)
      for (int d = 0; d < world; ++d)
        if (rows[d] >= 0 && tx.elements(op, d))
          Net::put_elem(reinterpret_cast<int32_t*>(s.bases[d] + off_src_idx) + rows[d],
                        static_cast<int32_t>(t), peer_pe(w, d), Net::remote(a.remote_mask, d));
    __syncwarp();
  }
  // Every put and descriptor of this block (`first`'s too) was issued before quiet's block
  // barrier, so quiet waits for all of them.
  if (!all_ok(s, Net::quiet(s.wait, a.remote_mask) && sent_ok)) return;
  if (block0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [E5] this block's data for every destination is written: publish (release, system scope).
  // Forwarding: to the ranks of this node only; the forwarders publish for the others.
  if (tid < world && tid / L == n_me)
    Net::publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, peer_pe(w, tid),
                     Net::remote(a.remote_mask, tid));
  if (!block0) return epilogue(a, s, sched.count);
  // [E6] wait until every source's data landed here (monotonic counters, never reset).
  bool ok = true;
  if (tid < world) {
    const uint64_t intent = peek_intent(w, tid);  // [A2], its load overlapping the wait
    uint64_t arrived = 0;
    ok = wait_geq<Net>(w, u64_at(local, a.off_done) + tid, q.done_expected, kWaitDispatchDone,
                       tid, &arrived);
    if (ok) stats[kStatPeers + 2 * world + tid] = arrived;
    ok = ok && check_intent<Net>(w, tid, intent);  // [A2]
  }
  if (!all_ok(s, ok)) return;
  // Forwarding: the ring state of the next op of the other parity (every entry of this op was
  // sent, and every entry through this rank forwarded: [E6] waited for this rank's forwarders
  // too, which publish here as at every rank of this node).
  if (forward && tid < nodes && tid != n_me) {
    const uint32_t* per_node =
        reinterpret_cast<const uint32_t*>(a.layout_counts) + world + a.num_experts;
    *ring_sent(local, a, rpar ^ 1, tid, nodes) =
        *ring_sent(local, a, rpar, tid, nodes) + per_node[tid];
    *ring_taken(local, a, rpar ^ 1, tid, nodes) =
        *ring_taken(local, a, rpar, tid, nodes) +
        static_cast<uint32_t>(reinterpret_cast<const int32_t*>(a.recv_node_counts)[tid]);
  }
  // [E7] the receive region is the output; keep the source indices with the handle.
  if (!cached) {
    const int num_recv = reinterpret_cast<const int*>(a.recv_prefix)[world];
    const int32_t* src = reinterpret_cast<const int32_t*>(local + off_src_idx);
    int32_t* out = reinterpret_cast<int32_t*>(a.recv_src_idx);
    for (int i = tid; i < num_recv; i += kThreads) out[i] = src[i];
  }
  // [E8] what transport sources sent raw, made final (the Net policy's `finish_dispatch`).
  Net::finish_dispatch(op, local, tid, kThreads);
  finish_stats(a, s, t_start, kind);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::intranode
