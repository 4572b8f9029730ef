// Combine (and in-place combine, kFlagInPlace).
#pragma once
#include <cuda_bf16.h>

#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/reduce.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "intranode/shared.cuh"

namespace epcomm::intranode {

// [C4] reduction shape (any choice gives the same bits; only speed and registers change). A
// step of a token's reduction loads U 16-byte vectors per lane of each of up to S sources, all
// in flight, then adds them source by source. A lane keeps U * S = 16 vectors (8 KiB per warp)
// in flight whenever the token has enough sources, picking the shape per token from its
// source count: 8 x 2, 4 x 4, 2 x 8 (one group: no accumulator lives across groups, so 8 x 2
// fits the 128 registers of kThreads = 512), and 4 x 4 with accumulators across groups above 8.
constexpr int kReduceVectorsInFlight = 16;  // 16-byte vectors per lane in one step
constexpr int kWeightSrcInFlight = 8;       // sources whose weight loads are in flight together
constexpr int kPushUnroll = 16;             // 16-byte vectors per lane in flight in the push

// Source list entry: the row's address, bit 0 set when the row never changes during the kernel
// (non-coherent loads allowed).
__device__ __forceinline__ const int4* src_row(uintptr_t e) {
  return reinterpret_cast<const int4*>(e & ~static_cast<uintptr_t>(1));
}

// One step, all nsrc <= S sources in one group: vectors base + u * 32 + lane (u < U) of the
// output are 0.f + src_0 + ... + src_{nsrc-1} (fp32, list order), rounded once to bf16.
template <int U, int S>
__device__ __forceinline__ void reduce_step_one_group(const uintptr_t* src, int nsrc, int base,
                                                      int n16, int lane, int4* out) {
  int4 v[S][U];
#pragma unroll
  for (int b = 0; b < S; ++b) {
    const uintptr_t e = b < nsrc ? src[b] : 0;
    const int4* p = src_row(e) + base + lane;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[b][u] = make_int4(0, 0, 0, 0);
      if (b < nsrc && base + lane + u * 32 < n16) v[b][u] = ld_v4_nc_if(p + u * 32, e & 1);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * 32 + lane;
    if (i >= n16) continue;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.f;
#pragma unroll
    for (int b = 0; b < S; ++b)
      if (b < nsrc) add_bf16x8(acc, v[b][u]);
    st_na_v4(out + i, pack_bf16x8(acc));
  }
}

// One step for any nsrc: groups of S sources (loads of a group first, then the adds in list
// order), accumulators kept across groups.
template <int U, int S>
__device__ __forceinline__ void reduce_step_groups(const uintptr_t* src, int nsrc, int base,
                                                   int n16, int lane, int4* out) {
  float acc[U][8];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
  for (int g = 0; g < nsrc; g += S) {
    // (v starts defined so that no value of an earlier group stays live across groups.)
    int4 v[S][U];
#pragma unroll
    for (int b = 0; b < S; ++b) {
      const uintptr_t e = g + b < nsrc ? src[g + b] : 0;
      const int4* p = src_row(e) + base + lane;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v[b][u] = make_int4(0, 0, 0, 0);
        if (g + b < nsrc && base + lane + u * 32 < n16) v[b][u] = ld_v4_nc_if(p + u * 32, e & 1);
      }
    }
#pragma unroll
    for (int b = 0; b < S; ++b) {
      if (g + b >= nsrc) continue;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (base + lane + u * 32 < n16) add_bf16x8(acc[u], v[b][u]);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * 32 + lane;
    if (i < n16) st_na_v4(out + i, pack_bf16x8(acc[u]));
  }
}

// [C4] one token's row: out = sum of the nsrc listed rows in list order (one warp).
template <int U, int S, bool kOneGroup>
__device__ __forceinline__ void reduce_row_shaped(const uintptr_t* src, int nsrc, int n16,
                                                  int lane, int4* out) {
  for (int base = 0; base < n16; base += 32 * U) {
    if constexpr (kOneGroup)
      reduce_step_one_group<U, S>(src, nsrc, base, n16, lane, out);
    else
      reduce_step_groups<U, S>(src, nsrc, base, n16, lane, out);
  }
}
__device__ __forceinline__ void reduce_row(const uintptr_t* src, int nsrc, int n16, int lane,
                                           int4* out) {
  static_assert(kReduceVectorsInFlight == 16, "the shapes below keep 16 vectors in flight");
  if (nsrc <= 2)
    reduce_row_shaped<8, 2, true>(src, nsrc, n16, lane, out);
  else if (nsrc <= 4)
    reduce_row_shaped<4, 4, true>(src, nsrc, n16, lane, out);
  else if (nsrc <= 8)
    reduce_row_shaped<2, 8, true>(src, nsrc, n16, lane, out);
  else
    reduce_row_shaped<4, 4, false>(src, nsrc, n16, lane, out);
}

// Combine: y rows (in this rank's receive order) go back to their source ranks and are summed
// there in rank order (fp32 accumulate, one bf16 rounding).
//
// Every warp first pushes its share of rows (dealt block-first; the Net policy's pusher may send
// the rows of transport peers first, in a pass of its own) and publishes each row with
// a monotonic per-token flag (the combine sequence number: flags[sender][token] on the owner),
// then reduces tokens of this rank, each as soon as the flags of exactly the peers that hold a
// contribution (known locally from the layout) arrived: warps that finish sending early reduce
// while the last rows are still crossing NVLink, and a small batch has a short critical path.
//
// Reduction of a token (one warp): the contributing sources' rows are listed once, in rank
// order, in the warp's s_src (bit 0 set: the row never changes during this kernel, so
// non-coherent loads; clear: a peer pushed it in [C1], plain loads) and s_wsrc (weights). Then,
// per step of 32 * U vectors, per group of up to S listed sources (reduce_row picks U x S from
// the source count): every load of the group is issued, then the values are added source by
// source in list order. Each output element is therefore 0.f + src_0 + src_1 + ... in rank order (fp32: the same adds
// in the same order whatever the constants), rounded once to bf16: bit-identical results, with
// one dependent load round trip per group and step instead of one per source and step. The
// weights are summed the same way (0.f + w_0 + w_1 + ..., fp32, rank order).
template <class Net>
__device__ __forceinline__ void combine(const OpArgs& a, Shared& s) {
  __shared__ unsigned long long s_arrival[kMaxWorld];
  __shared__ int s_send_off[kMaxWorld];
  // [C4] one token's contributions in rank order: rows (bit 0: non-coherent) and weight rows.
  __shared__ uintptr_t s_src[kWarps][kMaxWorld];
  __shared__ const float* s_wsrc[kWarps][kMaxWorld];
  const uint64_t t_start = globaltimer_ns();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const bool block0 = blockIdx.x == 0;
  if (!prologue<Net>(a, s, kOpCombine)) return;
  const OpSeq q = s.seq;
  const WaitCtx& w = s.wait;
  const uint64_t cpar = (q.combine & 1) * a.parity_stride;
  const uint64_t off_comb_x = a.off_comb_x + cpar, off_comb_w = a.off_comb_w + cpar;
  uint8_t* const local = s.bases[me];
  uint64_t* const stats = u64_at(local, a.off_stats);
  const bool in_place = (a.flags & kFlagInPlace) != 0;
  if (tid <= world) s.offsets[tid] = reinterpret_cast<const int*>(a.recv_prefix)[tid];
  if (tid < world) {
    s_arrival[tid] = 0;
    s_send_off[tid] = in_place ? reinterpret_cast<const int*>(a.send_offsets)[tid] : 0;
  }
  __syncthreads();
  Schedule<Net> sched(a);
  if (!sched.barrier(a, s)) return;  // [G1]
  // In place: every rank's y is its latest dispatch's receive region (same parity everywhere).
  const uint64_t dpar = (q.dispatch & 1) * a.parity_stride;
  const uint64_t off_y = a.off_x + dpar, off_yw = a.off_topk_w + dpar;

  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int32_t* src_idx = reinterpret_cast<const int32_t*>(a.recv_src_idx);
  // y and its weights: the caller's (a.x, a.topk_weights), or in place my receive region. A
  // staged combine (the copy engine wrote y over the rows peers read) may pass y in place too:
  // my own rows are then read from it and were not copied.
  const bool own_from_y = in_place && a.x != 0;
  const uint8_t* y =
      in_place && !own_from_y ? local + off_y : reinterpret_cast<const uint8_t*>(a.x);
  const float* y_w = in_place && !own_from_y ? reinterpret_cast<const float*>(local + off_yw)
                                             : reinterpret_cast<const float*>(a.topk_weights);
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  bool ok = true;

  if (in_place) {
    // [P1] my y is complete (earlier kernels on this stream wrote it): tell every peer.
    if (block0 && tid < world) {
      __threadfence_system();
      Net::publish_set(u64_at(s.bases[tid], a.off_stats + kStatsReadyOffset) + me, q.epoch,
                       peer_pe(w, tid), Net::remote(a.remote_mask, tid));
    }
    // [P2] every block waits until every peer's y is complete, then pulls it directly.
    bool ready = true;
    if (tid < world && tid != me) {
      uint64_t arrived = 0;
      ready = wait_geq<Net>(w, u64_at(local, a.off_stats + kStatsReadyOffset) + tid, q.epoch,
                       kWaitCombineDone, tid, &arrived);
      if (ready && block0) s_arrival[tid] = arrived;
    }
    if (!all_ok(s, ready)) return;
  }
  // [C1] push every received row whose source is another rank, then publish it (release).
  // In place, rows of mapped peers are pulled below; rows of peers reached through the
  // transport (remote_mask) are still pushed, since a remote read would stall every token.
  const int num_rows = in_place && a.remote_mask == 0 ? 0 : s.offsets[world];
  // The Net policy's pusher (common/net.cuh, `CombinePusher`) sends the rows of transport
  // peers: in a pass of its own first (`push_runs`: the CPU proxy's runs), or one by one in the
  // block-first pass below (`push`: NVSHMEM put-with-signal). Every other row is stored.
  const CombinePush op{a, s.bases, w, s.offsets, src_idx, y, y_w, off_comb_x, off_comb_w, q.epoch,
                       row_bytes, world, me, K, lane, has_w};
  const typename Net::CombinePusher tx(op);
  tx.push_runs(op, gwarp, nwarps, num_rows);
  for (int row = gwarp; row < num_rows; row += nwarps) {
    const int r = row_rank(s.offsets, world, row);
    if (r == me || (in_place && !Net::remote(a.remote_mask, r))) continue;
    if (tx.sent(op, r)) continue;  // sent by push_runs
    const int t = src_idx[row];
    const int64_t slot = static_cast<int64_t>(me) * a.max_tokens + t;
    if (tx.push(op, r, row, slot)) continue;  // weights, then the row with its flag (ordered)
    warp_copy_row<kPushUnroll>(reinterpret_cast<const int4*>(y + row * row_bytes),
                  reinterpret_cast<int4*>(s.bases[r] + off_comb_x + slot * row_bytes), n16, lane);
    if (has_w)
      for (int k = lane; k < K; k += 32)
        reinterpret_cast<float*>(s.bases[r] + off_comb_w)[slot * K + k] =
            y_w[static_cast<int64_t>(row) * K + k];
    __syncwarp();
    if (lane == 0) st_release_sys(u64_at(s.bases[r], a.off_comb_flags) + slot, q.epoch);
  }

  // [C3] wait for exactly the contributions token t has, [C4] reduce it in rank order.
  const int32_t* token_slot = reinterpret_cast<const int32_t*>(a.token_slot);
  const uint8_t* comb = local + off_comb_x;
  const float* comb_w = reinterpret_cast<const float*>(local + off_comb_w);
  const uint64_t* flags = u64_at(local, a.off_comb_flags);
  int* rows = s.rows[warp];
  const int num_tokens = op_tokens(a);
  for (int t = gwarp; ok && t < num_tokens; t += nwarps) {
    bool lane_ok = true;
    for (int r = lane; r < world; r += 32) {
      const int slot = token_slot[static_cast<int64_t>(t) * world + r];
      if (in_place && !Net::remote(a.remote_mask, r)) {
        rows[r] = slot < 0 ? -1 : s_send_off[r] + slot;  // my token's row in r's region
        continue;
      }
      rows[r] = slot < 0 ? -1 : (r == me ? s.offsets[me] + slot : t);
      if (slot >= 0 && r != me) {
        uint64_t arrived = 0;
        lane_ok = lane_ok && wait_geq<Net>(w, flags + static_cast<int64_t>(r) * a.max_tokens + t,
                                      q.epoch, kWaitCombineDone, r, &arrived);
        if (lane_ok && block0) atomicMax(&s_arrival[r], static_cast<unsigned long long>(arrived));
      }
    }
    ok = __all_sync(0xffffffffu, lane_ok);
    if (!ok) break;
    // Reconverge before the reduction: without it the lanes that waited and the ones that did
    // not may run the loop below apart (measured: put/signal combine 531 -> 407 us).
    __syncwarp();
    // The contributing sources' rows, compacted in rank order (ballot + prefix count).
    uintptr_t* src = s_src[warp];
    const float** wsrc = s_wsrc[warp];
    int nsrc = 0;
    for (int r0 = 0; r0 < world; r0 += 32) {
      const int r = r0 + lane;
      const int row = r < world ? rows[r] : -1;
      const unsigned have = __ballot_sync(0xffffffffu, row >= 0);
      if (row >= 0) {
        const int n = nsrc + __popc(have & ((1u << lane) - 1u));
        const bool pulled = in_place && !Net::remote(a.remote_mask, r) && !(r == me && own_from_y);
        const int64_t pushed = static_cast<int64_t>(r) * a.max_tokens + t;  // comb slot
        const uint8_t* p = pulled    ? s.bases[r] + off_y + row * row_bytes
                           : r == me ? y + static_cast<int64_t>(row) * row_bytes
                                     : comb + pushed * row_bytes;
        // Pulled rows (in place) and y never change during this kernel: non-coherent loads.
        // Rows peers pushed during this kernel ([C1]) must be plain loads.
        const bool nc = pulled || r == me;
        src[n] = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(nc);
        wsrc[n] = pulled ? reinterpret_cast<const float*>(s.bases[r] + off_yw) +
                               static_cast<int64_t>(row) * K
                  : r == me ? y_w + static_cast<int64_t>(row) * K
                            : comb_w + pushed * K;
      }
      nsrc += __popc(have);
    }
    __syncwarp();
    reduce_row(src, nsrc, n16, lane,
               reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * row_bytes));
    // Weights: the same sources in the same order (loads of a group first, then the adds).
    if (has_w)
      for (int k = lane; k < K; k += 32) {
        float acc = 0.f;
        for (int g = 0; g < nsrc; g += kWeightSrcInFlight) {
          float wv[kWeightSrcInFlight];
#pragma unroll
          for (int b = 0; b < kWeightSrcInFlight; ++b) wv[b] = g + b < nsrc ? wsrc[g + b][k] : 0.f;
#pragma unroll
          for (int b = 0; b < kWeightSrcInFlight; ++b)
            if (g + b < nsrc) acc += wv[b];
        }
        reinterpret_cast<float*>(a.out_weights)[static_cast<int64_t>(t) * K + k] = acc;
      }
    __syncwarp();
  }
  const bool quiet_ok = Net::quiet(s.wait, a.remote_mask);
  if (!all_ok(s, ok && quiet_ok)) return;
  if (block0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [C2] completion counters stay in step with every other op (cumulative expectations).
  if (tid < world)
    Net::publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, peer_pe(w, tid),
                     Net::remote(a.remote_mask, tid));
  if (!block0) return epilogue(a, s, sched.count);
  // [C5] every peer finished this combine's sends: finishing an op implies every peer started
  // it, which is what lets the next ops reuse the parity regions (docs/protocol.md).
  ok = true;
  if (tid < world) {
    const uint64_t intent = peek_intent(w, tid);  // [A2], its load overlapping the wait
    ok = wait_geq<Net>(w, u64_at(local, a.off_done) + tid, q.done_expected, kWaitCombineDone,
                       tid, nullptr);
    stats[kStatPeers + 2 * world + tid] = s_arrival[tid];
    ok = ok && check_intent<Net>(w, tid, intent);  // [A2]
  }
  if (!all_ok(s, ok)) return;
  finish_stats(a, s, t_start, kOpCombine);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::intranode
