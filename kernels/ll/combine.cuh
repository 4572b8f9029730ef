// Low-latency combine: send phase ([L8]) and receive phase ([L9]).
#pragma once
#include <cuda_bf16.h>

#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/reduce.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "ll/shared.cuh"

namespace epcomm::ll {

template <class Net>
__device__ __forceinline__ void combine_reduce(const OpArgs& a, Shared& s, Schedule<Net>& sched);

// combine_reduce's work items: (token, run of 32-vector column steps), at most
// kReduceMaxSteps steps each (split_rows), kReduceUnroll steps' loads in flight at once.
constexpr int kReduceUnroll = 1, kReduceMaxSteps = 8;
__device__ __forceinline__ Split reduce_split(const OpArgs& a) {
  return split_rows(a.num_tokens, (a.hidden * 2 / 16 + 31) / 32, gridDim.x * kWarps,
                    kReduceMaxSteps, false);
}

// Brings the routing (ids, weights and, without a hook, the packed-row indices of its own
// entries, ll_self_row) of the token this warp reduces first into L2.
__device__ __forceinline__ void prefetch_reduce_routing(const OpArgs& a) {
  const int t = (threadIdx.x / 32 * gridDim.x + blockIdx.x) / reduce_split(a).nch;
  const int lane = threadIdx.x % 32;
  if (t >= a.num_tokens || lane >= 3) return;
  if (lane == 2 && (a.flags & kFlagFused) == 0) return;
  const int64_t k = static_cast<int64_t>(t) * a.top_k;
  prefetch_l2(lane == 0   ? reinterpret_cast<const uint8_t*>(a.topk_idx) + k * 8
              : lane == 1 ? reinterpret_cast<const uint8_t*>(a.topk_weights) + k * 4
                          : reinterpret_cast<const uint8_t*>(a.ll_self_row) + k * 4);
}

// This warp's first reduction item (reduce_split): its token and the byte range [lo, lo +
// bytes) of each of its rows. False when the warp has none.
__device__ __forceinline__ bool first_reduce_item(const OpArgs& a, int* t, int* lo, int* bytes) {
  const Split sp = reduce_split(a);
  const int item = threadIdx.x / 32 * gridDim.x + blockIdx.x;
  if (item >= a.num_tokens * sp.nch) return false;
  const int n16 = a.hidden * 2 / 16, steps = (n16 + 31) / 32;
  const int s0 = item % sp.nch * sp.per_item, s1 = min(steps, s0 + sp.per_item);
  *t = item / sp.nch;
  *lo = s0 * 32 * 16;
  *bytes = (min(n16, s1 * 32) - s0 * 32) * 16;
  return true;
}

// The one-kernel op's own rows (entries whose expert is on this rank, read from y) of the
// warp's first reduction item, brought into L2 once the send loop is done, so that their DRAM
// latency overlaps the publication and the done wait (y is final when the kernel starts). `load` (lane
// k: entry k) before the send loop, `issue` after it, so the routing's round trip is hidden
// behind the loop.
struct OwnRowsPrefetch {
  int64_t e = -1;
  int32_t own = -1;
  int t = 0, lo = 0, bytes = 0;
  __device__ __forceinline__ void load(const OpArgs& a) {
    const int lane = threadIdx.x % 32;
    if (lane >= a.top_k || !first_reduce_item(a, &t, &lo, &bytes)) return;
    const int64_t entry = static_cast<int64_t>(t) * a.top_k + lane;
    e = reinterpret_cast<const int64_t*>(a.topk_idx)[entry];
    own = reinterpret_cast<const int32_t*>(a.ll_self_row)[entry];
  }
  __device__ __forceinline__ void issue(const OpArgs& a) const {
    const int epr = a.num_experts / a.world;
    const int64_t y_rows = static_cast<int64_t>(a.num_experts) * a.ll_max_tokens;
    if (e == -1 || e / epr != a.rank || own < 0 || own >= y_rows) return;
    prefetch_l2_bulk(reinterpret_cast<const uint8_t*>(a.x) +
                         static_cast<int64_t>(own) * a.hidden * 2 + lo,
                     static_cast<uint32_t>(bytes));
  }
};

// The hook's receive phase: every combine row of the warp's first reduction item into L2,
// right after the prologue (which gives the parity), so that its DRAM latency overlaps the
// done wait (a row still being written is updated in L2, so the prefetch is never stale).
__device__ __forceinline__ void prefetch_comb_rows(const OpArgs& a, const Shared& s) {
  int t, lo, bytes;
  const int lane = threadIdx.x % 32;
  if (lane >= a.top_k || !first_reduce_item(a, &t, &lo, &bytes)) return;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const uint64_t par = (s.seq.ll_combine & 1) * a.parity_stride;
  prefetch_l2_bulk(s.bases[a.rank] + a.off_ll_comb + par +
                       (static_cast<int64_t>(t) * a.top_k + lane) * row_bytes + lo,
                   static_cast<uint32_t>(bytes));
}

// Send phase: every packed row y[l][pos] (pos < the dispatch's count of local expert l) goes
// back to its source rank, into the combine row [token][k] of the entry it came from. Rows
// are dealt to warps over the packed rows of all local experts together. kOneKernel: as for
// dispatch_send.
template <class Net, bool kOneKernel>
__device__ __forceinline__ void combine_send(const OpArgs& a, Shared& s, uint32_t* dyn) {
  const uint64_t t_start = globaltimer_ns();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const int epr = a.num_experts / world, M = a.ll_max_tokens;
  // The per-expert counts into L2 while the prologue reads the sequence state, and without a
  // hook the routing of the token this warp reduces first.
  for (int i = tid; i < (epr + 31) / 32; i += kThreads)
    prefetch_l2(reinterpret_cast<const int*>(a.ll_recv_count) + i * 32);
  if ((a.flags & kFlagFused) != 0)
    for (int i = tid; i < (epr * world + 15) / 16; i += kThreads)
      prefetch_l2(reinterpret_cast<const int64_t*>(a.ll_layout_range) + i * 16);
  if ((a.flags & kFlagFused) != 0) prefetch_reduce_routing(a);
  if (!prologue<Net>(a, s, kOpLlCombine)) return;
  const OpSeq q = s.seq;
  const uint64_t par = (q.ll_combine & 1) * a.parity_stride;
  uint64_t* const stats = u64_at(s.bases[me], a.off_stats);
  if (blockIdx.x == 0 && tid == 0) stats[kStatStart] = t_start;  // the op's start (stats)
  Schedule<Net> sched(a);
  if (!sched.barrier(a, s)) return;  // [G1]
  // First packed row of every local expert in the flat order (prefix of the counts), and
  // without a hook this rank's own rows of each expert (reduced straight from y, not pushed).
  const bool fused = (a.flags & kFlagFused) != 0;
  int* first = reinterpret_cast<int*>(dyn);  // [epr + 1]
  int* own_first = first + epr + 1;           // [epr]
  int* own_rows = own_first + epr;            // [epr]
  if (fused)
    for (int l = tid; l < epr; l += kThreads) {
      const int64_t range = reinterpret_cast<const int64_t*>(a.ll_layout_range)[l * world + me];
      own_first[l] = static_cast<int>(range >> 32);
      own_rows[l] = static_cast<int>(range & 0xffffffff);
    }
  block_prefix(reinterpret_cast<const int*>(a.ll_recv_count), epr, first, s.warp_sum);
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const int64_t cap = static_cast<int64_t>(world) * M;
  const int32_t* src_info = reinterpret_cast<const int32_t*>(a.ll_src_info);
  const int32_t* route = reinterpret_cast<const int32_t*>(a.ll_route);
  const uint8_t* y = reinterpret_cast<const uint8_t*>(a.x);
  const uint64_t off_comb = a.off_ll_comb + par;
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  const int total = first[epr];
  OwnRowsPrefetch own_rows_pf;
  if (kOneKernel && fused) own_rows_pf.load(a);
  // Work items are (packed row, run of 32-vector steps) (split_rows), the run's loads issued
  // before the row's routing is read; a row for a transport peer goes whole (one put).
  const Split sp = split_rows(total, (n16 + 31) / 32, nwarps, kCopyUnroll, a.remote_mask != 0);
  const int nch = sp.nch;
  for (int item = gwarp; item < total * nch; item += nwarps) {
    const int row = item / nch, c = item % nch;
    int lo = 0, hi = epr - 1;  // the expert whose range holds `row` (binary search)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first[mid] <= row) lo = mid; else hi = mid - 1;
    }
    const int j = row - first[lo];  // row of expert lo
    if (fused && static_cast<unsigned>(j - own_first[lo]) < static_cast<unsigned>(own_rows[lo]))
      continue;  // one of this rank's own tokens: the reduction reads it from y
    const int64_t idx = static_cast<int64_t>(lo) * cap + j;
    const uint8_t* src = y + idx * row_bytes;
    if (nch == 1) {
      const int t = src_info[idx], rk = route[idx];
      const int r = rk / K, k = rk % K;
      if (masked(s, r)) continue;  // a masked rank is sent nothing
      uint8_t* dst = s.bases[r] + off_comb + (static_cast<int64_t>(t) * K + k) * row_bytes;
      // A transport peer's row: the Net policy's warp put (common/net.cuh, `put_row`).
      if (Net::put_row(Net::remote(a.remote_mask, r), dst, src, static_cast<size_t>(row_bytes), r))
        continue;
      warp_copy_row(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst), n16, lane);
      continue;
    }
    const int base = c * 32 * sp.per_item, end = min(n16, base + 32 * sp.per_item);
    int4 v[kCopyUnroll];
    load_step(v, reinterpret_cast<const int4*>(src), base, end, lane);
    const int t = src_info[idx], rk = route[idx];
    const int r = rk / K, k = rk % K;
    if (masked(s, r)) continue;
    uint8_t* dst = s.bases[r] + off_comb + (static_cast<int64_t>(t) * K + k) * row_bytes;
    store_step(reinterpret_cast<int4*>(dst), v, base, end, lane);
  }
  if (kOneKernel && fused) own_rows_pf.issue(a);
  if (!all_ok(s, Net::quiet(s.wait, a.remote_mask))) return;
  if (blockIdx.x == 0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // This block's rows for every source are written: publish (release), to masked ranks too
  // (as in the dispatch).
  if (tid < world)
    Net::publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, tid,
                     Net::remote(a.remote_mask, tid));
  if constexpr (kOneKernel) {
    if ((a.flags & kFlagFused) != 0) {  // no hook: the receive phase in the same kernel
      if (!await_sends<Net>(a, s, sched, kWaitLlCombine)) return;
      return combine_reduce<Net>(a, s, sched);
    }
  }
  epilogue(a, s, sched.count);
}

// Receive phase: out[t] = sum over k with topk_idx[t][k] != -1 (and, under masking, the
// expert's rank not masked), in increasing k, of w[t][k] * y[t][k] (f32: a product, then a sum, both IEEE-rounded, so the CPU reference gives
// the same bits), rounded to bf16 once.
template <class Net>
__device__ __forceinline__ void combine_recv(const OpArgs& a, Shared& s, uint32_t*) {
  Schedule<Net> sched(a);
  prefetch_reduce_routing(a);  // while the prologue and the wait run
  // [L9] every peer finished its send phase, then reduce.
  if (!prologue<Net>(a, s, kOpLlCombineRecv)) return;
  prefetch_comb_rows(a, s);
  if (!await_sends<Net>(a, s, sched, kWaitLlCombine)) return;
  combine_reduce<Net>(a, s, sched);
}

// [L9]'s reduction after the wait, then the op's epilogue.
template <class Net>
__device__ __forceinline__ void combine_reduce(const OpArgs& a, Shared& s, Schedule<Net>& sched) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int me = a.rank, K = a.top_k;
  const bool block0 = blockIdx.x == 0;
  const uint64_t par = (s.seq.ll_combine & 1) * a.parity_stride;
  uint8_t* const local = s.bases[me];
  const uint64_t t_start = u64_at(local, a.off_stats)[kStatStart];  // the send phase's start
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const float* topk_w = reinterpret_cast<const float*>(a.topk_weights);
  const uint8_t* comb = local + a.off_ll_comb + par;
  // Without a hook the entries whose expert is on this rank come straight from y, at the
  // packed row the dispatch recorded (ll_self_row; bounded, so a routing that differs from the
  // dispatch's reads a wrong row of y, never outside it); every other entry from its combine
  // row. (With a hook the send phase pushed every row, this rank's own included.)
  const bool own_from_y = (a.flags & kFlagFused) != 0;
  const int epr = a.num_experts / a.world;
  const int64_t y_rows = static_cast<int64_t>(a.num_experts) * a.ll_max_tokens;  // epr * cap
  const uint8_t* y = reinterpret_cast<const uint8_t*>(a.x);
  const int32_t* self_row = reinterpret_cast<const int32_t*>(a.ll_self_row);
  // Work items are (token, run of column steps) (reduce_split). Per item the token's routing
  // (lane k: entry k) is loaded once, then per kUnroll steps the rows of up to kBatch entries
  // together, before any is added; a row of a -1 entry is loaded too (its slot exists) and
  // never added.
  constexpr int kUnroll = kReduceUnroll, kBatch = 8;
  const Split sp = reduce_split(a);
  const int steps = (n16 + 31) / 32;
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  for (int item = gwarp; item < a.num_tokens * sp.nch; item += nwarps) {
    const int t = item / sp.nch, s0 = (item % sp.nch) * sp.per_item;
    const int s1 = min(steps, s0 + sp.per_item);
    int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * row_bytes);
    const uint8_t* rows_t = comb + static_cast<int64_t>(t) * K * row_bytes;
    // Lane k's entry k0 + k: its row and weight (null row: not added).
    auto route = [&](int k0, const uint8_t** row, float* wt) {
      const int kl = k0 + lane;
      const int64_t entry = static_cast<int64_t>(t) * K + kl;
      const int64_t e = kl < K ? topk_idx[entry] : -1;
      const int32_t own = own_from_y && kl < K ? self_row[entry] : -1;
      *wt = e != -1 ? topk_w[entry] : 0.f;
      *row = nullptr;
      if (e == -1 || masked(s, static_cast<int>(e / epr))) return;  // masked: contributes 0
      *row = rows_t + static_cast<int64_t>(kl) * row_bytes;
      if (own_from_y && e / epr == me && own >= 0 && own < y_rows)
        *row = y + static_cast<int64_t>(own) * row_bytes;
    };
    const uint8_t* row0;
    float w0;
    route(0, &row0, &w0);
    for (int step = s0; step < s1; step += kUnroll) {
      const int base = step * 32;
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
      for (int k32 = 0; k32 < K; k32 += 32) {
        const uint8_t* row_l = row0;
        float w_l = w0;
        if (k32 != 0) route(k32, &row_l, &w_l);
        for (int k0 = k32; k0 < min(K, k32 + 32); k0 += kBatch) {
          int4 v[kBatch][kUnroll];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const int4* p = reinterpret_cast<const int4*>(__shfl_sync(
                0xffffffffu, reinterpret_cast<unsigned long long>(row_l), (k0 + b - k32) & 31));
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int i = base + u * 32 + lane;
              if (p != nullptr && k0 + b < K && step + u < s1 && i < n16) v[b][u] = ld_v4(p + i);
            }
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            const bool use =
                __shfl_sync(0xffffffffu, row_l != nullptr, (k0 + b - k32) & 31) && k0 + b < K;
            const float wt = __shfl_sync(0xffffffffu, w_l, (k0 + b - k32) & 31);
            if (!use) continue;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              if (step + u >= s1 || base + u * 32 + lane >= n16) continue;
              add_weighted_bf16x8(acc[u], v[b][u], wt);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (step + u >= s1 || i >= n16) continue;
        st_na_v4(out + i, pack_bf16x8(acc[u]));
      }
    }
  }
  if (block0) finish_stats(a, s, t_start, kOpLlCombineRecv);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::ll
