// Dispatch (and cached dispatch, kFlagCached): the count exchange fused with the data.
#pragma once
#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "intranode/shared.cuh"

namespace epcomm::intranode {

// [E4] under Net::kCoalesceRuns: a lane's open runs, one per peer d = lane + 32 * i (i < kSlots),
// kept in registers (every index is a compile-time constant). len 0: no open run. A run holds
// at most `max_len` tokens (PeerRunLimits).
struct PeerRuns {
  static constexpr int kSlots = static_cast<int>((kMaxWorld + 31) / 32);
  int t0[kSlots], row0[kSlots], len[kSlots];
  int max_len;
  __device__ __forceinline__ void init(int row_bytes) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) t0[i] = row0[i] = len[i] = 0;
    max_len = PeerRunLimits::max_rows(row_bytes);
  }
};

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

  // [E4] every token once to every destination rank, straight into its final row. Work is
  // dealt block-first (consecutive tokens on different SMs) so small batches use every SM;
  // under a policy with Net::kCoalesceRuns (the CPU proxy) each warp takes a contiguous chunk
  // of tokens instead, so that its tokens bound for a proxied peer form runs (below).
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  const int32_t* token_slot = reinterpret_cast<const int32_t*>(a.token_slot);
  const int n16 = a.row_bytes / 16;
  const bool has_scales = (a.flags & kFlagHasScales) != 0;
  const bool has_topk = (a.flags & kFlagHasTopk) != 0;
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const float* topk_w = reinterpret_cast<const float*>(a.topk_weights);
  const float* scales = reinterpret_cast<const float*>(a.x_scales);
  const int num_tokens = op_tokens(a);
  // Whether rank d gets the token's metadata element by element, in its final form (stores,
  // or the transport's single-element puts): every rank unless the policy sends transport
  // peers whole raw rows (Net::kMetadataRows; then [E8] on the receiver finishes them).
  auto per_elem = [&](int d) { return !Net::kMetadataRows || !Net::remote(a.remote_mask, d); };
  // This warp's tokens: t_first, t_first + t_step, ... below t_end.
  int t_first = gwarp, t_end = num_tokens, t_step = nwarps;
  if constexpr (Net::kCoalesceRuns) {
    const int64_t chunk = (static_cast<int64_t>(num_tokens) + nwarps - 1) / nwarps;
    t_first = static_cast<int>(min(static_cast<int64_t>(gwarp) * chunk,
                                   static_cast<int64_t>(num_tokens)));
    t_end = static_cast<int>(min(static_cast<int64_t>(gwarp + 1) * chunk,
                                 static_cast<int64_t>(num_tokens)));
    t_step = 1;
  }
  // Runs (Net::kCoalesceRuns): lane `l` keeps, in registers, the open run of every proxied peer
  // d = l + 32 * i: tokens t0 .. t0 + len - 1 of this warp's chunk, bound for rows
  // row0 .. row0 + len - 1 of d. A token extends its peer's run when it continues it in both;
  // otherwise (or when the run is full) the run is sent (`put_run`) and a new one starts. The
  // lane sends every open run after the chunk, before `quiet` below.
  PeerRuns runs;
  if constexpr (Net::kCoalesceRuns) runs.init(a.row_bytes);
  // One thread sends run (t0, row0, len) to proxied peer d: ONE claim of consecutive ring
  // positions (after a system fence, as every put), then the `len` x rows as one TRANSFER, the
  // scales, top-k ids and top-k weights (those the op has) as one TRANSFER each of the `len`
  // raw caller rows ([E8] finishes the ids and weights on the receiver), then the `len` source
  // indices t0 .. t0 + len - 1 as WRITEs of consecutive words on consecutive positions (the
  // copy-engine executor stages them as one copy). No warp collective: one lane calls it. A
  // descriptor that could not be written (the proxy stopped, or the slot wait's bound passed)
  // ends the run early: the proxy cannot pass that position, and the block's `quiet` records
  // the failure, so the rest would only wait out the bound again, slot by slot.
  auto put_run = [&](int d, int t0, int row0, int len) {
    if constexpr (Net::kCoalesceRuns) {
      uint8_t* const base = s.bases[d];
      const int pe = peer_pe(w, d);
      const bool sc = has_scales && a.num_scales > 0, ids = has_topk && K > 0;
      const bool wts = ids && has_w;
      const int64_t t = t0, row = row0, n = len;
      uint64_t p = Net::claim_fenced(static_cast<uint32_t>(1 + sc + ids + wts + len));
      if (!Net::emit_transfer(p++, base + off_x + row * a.row_bytes,
                              reinterpret_cast<const uint8_t*>(a.x) + t * a.row_bytes,
                              static_cast<size_t>(n * a.row_bytes), pe))
        return;
      if (sc && !Net::emit_transfer(p++, base + off_scales + row * a.num_scales * 4,
                                    scales + t * a.num_scales,
                                    static_cast<size_t>(n * a.num_scales * 4), pe))
        return;
      if (ids && !Net::emit_transfer(p++, base + off_topk_idx + row * K * 8, topk_idx + t * K,
                                     static_cast<size_t>(n * K * 8), pe))
        return;
      if (wts && !Net::emit_transfer(p++, base + off_topk_w + row * K * 4, topk_w + t * K,
                                     static_cast<size_t>(n * K * 4), pe))
        return;
      int32_t* const src_idx = reinterpret_cast<int32_t*>(base + off_src_idx) + row;
      for (int j = 0; j < len; ++j)
        if (!Net::emit_write(p++, src_idx + j, static_cast<int32_t>(t0 + j), pe)) return;
    }
  };
  int* rows = s.rows[warp];
  for (int t = t_first; t < t_end; t += t_step) {
    for (int d = lane; d < world; d += 32) {
      const int slot = token_slot[static_cast<int64_t>(t) * world + d];
      rows[d] = slot >= 0 ? s.offsets[d] + slot : -1;
    }
    __syncwarp();
    if constexpr (Net::kCoalesceRuns) {
#pragma unroll
      for (int i = 0; i < PeerRuns::kSlots; ++i) {
        const int d = lane + 32 * i;
        // Per lane, no warp collective: the lanes meet again at the __syncwarp below.
        if (d >= world || !Net::remote(a.remote_mask, d) || rows[d] < 0) continue;
        const int row = rows[d], len = runs.len[i];
        if (len > 0 && len < runs.max_len && t == runs.t0[i] + len && row == runs.row0[i] + len) {
          runs.len[i] = len + 1;
          continue;
        }
        if (len > 0) put_run(d, runs.t0[i], runs.row0[i], len);
        runs.t0[i] = t;
        runs.row0[i] = row;
        runs.len[i] = 1;
      }
    }
    // Stores to every mapped rank; puts of the row to transport ranks unless they get runs.
    warp_copy_row_multi<Net, !Net::kCoalesceRuns>(
        reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.row_bytes), s.bases, rows,
        off_x, a.row_bytes, world, n16, lane, a.remote_mask, w.pe_base, w.pe_stride);
    if (has_scales)
      for (int i = lane; i < a.num_scales; i += 32) {
        const float v = scales[static_cast<int64_t>(t) * a.num_scales + i];
        for (int d = 0; d < world; ++d)
          if (rows[d] >= 0 && per_elem(d))
            Net::put_elem(reinterpret_cast<float*>(s.bases[d] + off_scales) +
                              static_cast<int64_t>(rows[d]) * a.num_scales + i,
                          v, peer_pe(w, d), Net::remote(a.remote_mask, d));
      }
    if (has_topk)
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
        const float wt = has_w ? topk_w[static_cast<int64_t>(t) * K + k] : 0.f;
        for (int d = 0; d < world; ++d) {
          if (rows[d] < 0 || !per_elem(d)) continue;
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
    if constexpr (Net::kMetadataRows && !Net::kCoalesceRuns) {
      // Transport peers: the token's scales, top-k ids and top-k weights as they are in the
      // caller's memory, one transfer each (lane i: peer i / 3, record i % 3).
      const int64_t tt = t;
      for (int j0 = 0; a.remote_mask != 0 && j0 < world * 3; j0 += 32) {
        const int j = j0 + lane, d = j / 3, rec = j % 3;
        bool valid = false;
        void* dst = nullptr;
        const void* src = nullptr;
        size_t bytes = 0;
        if (d < world && rows[d] >= 0 && Net::remote(a.remote_mask, d)) {
          const int64_t row = rows[d];
          if (rec == 0 && has_scales && a.num_scales > 0) {
            valid = true;
            dst = s.bases[d] + off_scales + row * a.num_scales * 4;
            src = scales + tt * a.num_scales;
            bytes = static_cast<size_t>(a.num_scales) * 4;
          } else if (rec == 1 && has_topk && K > 0) {
            valid = true;
            dst = s.bases[d] + off_topk_idx + row * K * 8;
            src = topk_idx + tt * K;
            bytes = static_cast<size_t>(K) * 8;
          } else if (rec == 2 && has_topk && has_w && K > 0) {
            valid = true;
            dst = s.bases[d] + off_topk_w + row * K * 4;
            src = topk_w + tt * K;
            bytes = static_cast<size_t>(K) * 4;
          }
        }
        Net::put_lanes(valid, dst, src, bytes, peer_pe(w, d));
      }
    }
    if (lane == 0)
      for (int d = 0; d < world; ++d)
        if (rows[d] >= 0 && !(Net::kCoalesceRuns && Net::remote(a.remote_mask, d)))
          Net::put_elem(reinterpret_cast<int32_t*>(s.bases[d] + off_src_idx) + rows[d],
                        static_cast<int32_t>(t), peer_pe(w, d), Net::remote(a.remote_mask, d));
    __syncwarp();
  }
  if constexpr (Net::kCoalesceRuns) {
#pragma unroll
    for (int i = 0; i < PeerRuns::kSlots; ++i)
      if (runs.len[i] > 0) put_run(lane + 32 * i, runs.t0[i], runs.row0[i], runs.len[i]);
  }
  // Every descriptor of this block (the runs' too) was claimed before quiet's block barrier,
  // so quiet waits for all of them.
  if (!all_ok(s, Net::quiet(s.wait, a.remote_mask))) return;
  if (block0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [E5] this block's data for every destination is written: publish (release, system scope).
  if (tid < world)
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
  // [E7] the receive region is the output; keep the source indices with the handle.
  if (!cached) {
    const int num_recv = reinterpret_cast<const int*>(a.recv_prefix)[world];
    const int32_t* src = reinterpret_cast<const int32_t*>(local + off_src_idx);
    int32_t* out = reinterpret_cast<int32_t*>(a.recv_src_idx);
    for (int i = tid; i < num_recv; i += kThreads) out[i] = src[i];
  }
  if constexpr (Net::kMetadataRows) {
    // [E8] the rows of transport sources carry the senders' raw top-k ids and weights: make
    // them what a store sender writes (ids of my experts made local, every other id -1 with
    // weight 0). Only those rows (recv_prefix[r]..recv_prefix[r + 1] for r in remote_mask);
    // every source's data landed ([E6]) and the op owns its receive region until it ends.
    if (has_topk && a.remote_mask != 0) {
      const int* prefix = reinterpret_cast<const int*>(a.recv_prefix);
      const int64_t lo = static_cast<int64_t>(me) * epr;
      int64_t* ids = reinterpret_cast<int64_t*>(local + off_topk_idx);
      float* wts = reinterpret_cast<float*>(local + off_topk_w);
      for (int r = 0; r < world; ++r) {
        if (!Net::remote(a.remote_mask, r)) continue;
        const int64_t end = static_cast<int64_t>(prefix[r + 1]) * K;
        for (int64_t i = static_cast<int64_t>(prefix[r]) * K + tid; i < end; i += kThreads) {
          const int64_t e = ids[i];
          const bool here = e >= lo && e < lo + epr;
          ids[i] = here ? e - lo : int64_t{-1};
          if (has_w && !here) wts[i] = 0.f;
        }
      }
    }
  }
  finish_stats(a, s, t_start, kind);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::intranode
