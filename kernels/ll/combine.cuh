// Low-latency combine: send phase ([L8]) and receive phase ([L9]).
#pragma once
#include <cuda_bf16.h>

#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "ll/shared.cuh"

namespace epcomm::ll {

template <class Net>
__device__ __forceinline__ void combine_reduce(const OpArgs& a, Shared& s, Schedule<Net>& sched);

// combine_reduce's work items: (token, column chunk of kReduceUnroll * 32 vectors).
constexpr int kReduceUnroll = 2;
__device__ __forceinline__ int reduce_chunks(const OpArgs& a) {
  return (a.hidden * 2 / 16 + 32 * kReduceUnroll - 1) / (32 * kReduceUnroll);
}

// Brings the routing (ids and weights) of the token this warp reduces first into L2.
__device__ __forceinline__ void prefetch_reduce_routing(const OpArgs& a) {
  const int t = (threadIdx.x / 32 * gridDim.x + blockIdx.x) / reduce_chunks(a);
  const int lane = threadIdx.x % 32;
  if (t >= a.num_tokens || lane >= 2) return;
  const int64_t k = static_cast<int64_t>(t) * a.top_k;
  prefetch_l2(lane == 0 ? reinterpret_cast<const uint8_t*>(a.topk_idx) + k * 8
                        : reinterpret_cast<const uint8_t*>(a.topk_weights) + k * 4);
}

// Send phase: every packed row y[l][pos] (pos < the dispatch's count of local expert l) goes
// back to its source rank, into the combine row [token][k] of the entry it came from. Rows
// are dealt to warps over the packed rows of all local experts together.
template <class Net>
__device__ __forceinline__ void combine_send(const OpArgs& a, Shared& s, uint32_t* dyn) {
  const uint64_t t_start = globaltimer_ns();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const int epr = a.num_experts / world, M = a.ll_max_tokens;
  // The per-expert counts into L2 while the prologue reads the sequence state, and without a
  // hook the routing of the token this warp reduces first.
  for (int i = tid; i < (epr + 31) / 32; i += kThreads)
    prefetch_l2(reinterpret_cast<const int*>(a.ll_recv_count) + i * 32);
  if ((a.flags & kFlagFused) != 0) prefetch_reduce_routing(a);
  if (!prologue<Net>(a, s, kOpLlCombine)) return;
  const OpSeq q = s.seq;
  const uint64_t par = (q.ll_combine & 1) * a.parity_stride;
  uint64_t* const stats = u64_at(s.bases[me], a.off_stats);
  if (blockIdx.x == 0 && tid == 0) stats[kStatStart] = t_start;  // the op's start (stats)
  Schedule<Net> sched(a);
  if (!sched.barrier(a, s)) return;  // [G1]
  // First packed row of every local expert in the flat order (prefix of the counts).
  int* first = reinterpret_cast<int*>(dyn);  // [epr + 1]
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
  // Work items are (packed row, chunk of 32 * kCopyUnroll vectors), the chunk's loads issued
  // before the row's routing is read; a row for a transport peer goes whole (one put).
  const int nch = a.remote_mask != 0 ? 1 : (n16 + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll);
  for (int item = gwarp; item < total * nch; item += nwarps) {
    const int row = item / nch, c = item % nch;
    int lo = 0, hi = epr - 1;  // the expert whose range holds `row` (binary search)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first[mid] <= row) lo = mid; else hi = mid - 1;
    }
    const int64_t idx = static_cast<int64_t>(lo) * cap + (row - first[lo]);
    const uint8_t* src = y + idx * row_bytes;
    if (nch == 1) {
      const int t = src_info[idx], rk = route[idx];
      const int r = rk / K, k = rk % K;
      uint8_t* dst = s.bases[r] + off_comb + (static_cast<int64_t>(t) * K + k) * row_bytes;
      if constexpr (Net::kTransport) {
        if (Net::remote(a.remote_mask, r)) {
          Net::put_warp(dst, src, static_cast<size_t>(row_bytes), r);
          continue;
        }
      }
      warp_copy_row(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst), n16, lane);
      continue;
    }
    const int base = c * 32 * kCopyUnroll;
    int4 v[kCopyUnroll];
    load_step(v, reinterpret_cast<const int4*>(src), base, n16, lane);
    const int t = src_info[idx], rk = route[idx];
    const int r = rk / K, k = rk % K;
    uint8_t* dst = s.bases[r] + off_comb + (static_cast<int64_t>(t) * K + k) * row_bytes;
    store_step(reinterpret_cast<int4*>(dst), v, base, n16, lane);
  }
  if (!all_ok(s, Net::quiet(s.wait, a.remote_mask))) return;
  if (blockIdx.x == 0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // This block's rows for every source are written: publish (release).
  if (tid < world)
    Net::publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, tid,
                     Net::remote(a.remote_mask, tid));
  if ((a.flags & kFlagFused) != 0) {  // no hook: the receive phase in the same kernel
    if (!await_sends<Net>(a, s, sched, kWaitLlCombine)) return;
    return combine_reduce<Net>(a, s, sched);
  }
  epilogue(a, s, sched.count);
}

// Receive phase: out[t] = sum over k with topk_idx[t][k] != -1, in increasing k, of
// w[t][k] * y[t][k] (f32: a product, then a sum, both IEEE-rounded, so the CPU reference gives
// the same bits), rounded to bf16 once.
template <class Net>
__device__ __forceinline__ void combine_recv(const OpArgs& a, Shared& s, uint32_t*) {
  Schedule<Net> sched(a);
  prefetch_reduce_routing(a);  // while the wait runs
  // [L9] every peer finished its send phase, then reduce.
  if (!begin_receive<Net>(a, s, sched, kOpLlCombineRecv, kWaitLlCombine)) return;
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
  // Work items are (token, column chunk of 32 * kUnroll vectors). Per item the token's routing
  // (lane k: entry k) and the rows of up to kBatch entries are loaded together, before any is
  // added; a row of a -1 entry is loaded too (its slot exists) and never added.
  constexpr int kUnroll = kReduceUnroll, kBatch = 8;
  const int nch = reduce_chunks(a);
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  for (int item = gwarp; item < a.num_tokens * nch; item += nwarps) {
    const int t = item / nch, base = (item % nch) * 32 * kUnroll;
    int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * row_bytes);
    const uint8_t* rows_t = comb + static_cast<int64_t>(t) * K * row_bytes;
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
    for (int k32 = 0; k32 < K; k32 += 32) {
      const int kl = k32 + lane;
      const bool use_l = kl < K && topk_idx[static_cast<int64_t>(t) * K + kl] != -1;
      const float w_l = use_l ? topk_w[static_cast<int64_t>(t) * K + kl] : 0.f;
      for (int k0 = k32; k0 < min(K, k32 + 32); k0 += kBatch) {
        int4 v[kBatch][kUnroll];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int4* p = reinterpret_cast<const int4*>(rows_t + (k0 + b) * row_bytes);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (k0 + b < K && i < n16) v[b][u] = ld_v4(p + i);
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const bool use = __shfl_sync(0xffffffffu, use_l, (k0 + b - k32) & 31) && k0 + b < K;
          const float wt = __shfl_sync(0xffffffffu, w_l, (k0 + b - k32) & 31);
          if (!use) continue;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (base + u * 32 + lane >= n16) continue;
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[b][u]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(h[j]);
              acc[u][2 * j] = __fadd_rn(acc[u][2 * j], __fmul_rn(wt, f.x));
              acc[u][2 * j + 1] = __fadd_rn(acc[u][2 * j + 1], __fmul_rn(wt, f.y));
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i >= n16) continue;
      int4 o;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
      st_na_v4(out + i, o);
    }
  }
  if (block0) finish_stats(a, s, t_start, kOpLlCombineRecv);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::ll
