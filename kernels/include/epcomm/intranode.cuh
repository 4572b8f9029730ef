// Intranode (NVLink domain) layout, dispatch and combine kernels.
//
// Protocol: docs/protocol.md (step labels [E1]..[E7], [C1]..[C4], [G1]..[G5] are cited below).
// Memory: every rank owns one symmetric buffer; peers write into it through a mapping (CUDA IPC,
// `nvshmem_ptr`) or, in the NVSHMEM variant, with NVSHMEM put/signal (net.cuh says which).
//  * dispatch writes each token straight into its final row of every destination's receive
//    region (rows ordered by source rank, then source token index), so the receiver's output
//    is the region itself: no receiver-side copy;
//  * combine pushes each received row back into the owner's combine region at
//    [sender][token], and the owner reduces in rank order (fp32, deterministic).
// Nothing is ever cleaned: counts are epoch-tagged, completion counters are monotonic, and the
// receive regions alternate by parity (a rank is at most one op ahead of any peer).
#pragma once
#include <cuda_bf16.h>

#include "epcomm/abi.cuh"
#include "epcomm/net.cuh"
#include "epcomm/ptx.cuh"
#include "epcomm/wait.cuh"

using namespace epcomm;

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // 16-byte vectors per lane in flight per copy step
constexpr int kHistChunk = 4096;
constexpr int kReduceUnroll = 4;  // combine: 16-byte vectors per lane and source in flight

// Stats block (local u64 words), read by `Buffer::last_op_stats`.
constexpr int kStatOpSeq = 0;
constexpr int kStatStart = 1;
constexpr int kStatCountsReady = 2;
constexpr int kStatSent = 3;
constexpr int kStatEnd = 4;
constexpr int kStatKind = 5;
constexpr int kStatWorld = 6;
constexpr int kStatPeers = 8;  // [world] unused, [world] count-row (or barrier) arrivals,
                               // [world] data-landed arrivals (this GPU's clock only)

// This op's sequence numbers, derived from the device SeqState by block thread 0.
struct OpSeq {
  uint64_t op;             // op sequence number (>= 1)
  uint64_t epoch;          // dispatch: notify seq (count tag); combine: combine seq (flag value)
  uint64_t notify, dispatch, combine;
  uint64_t done_expected;  // done[src] value once this op's sends all landed
  uint64_t barrier_base;   // barrier[src] value before this op's first barrier
};


struct Shared {
  OpSeq seq;
  uint8_t* bases[kMaxWorld];
  int offsets[kMaxWorld + 1];
  int rows[kWarps][kMaxWorld];
  uint32_t counts[kMaxWorld * kMaxWorld];
  int abort;
};

__device__ __forceinline__ uint64_t* u64_at(uint8_t* base, uint64_t off) {
  return reinterpret_cast<uint64_t*>(base + off);
}

__device__ __forceinline__ WaitCtx make_wait(const OpArgs& a, const Shared& s, uint32_t op) {
  WaitCtx w;
  w.record = reinterpret_cast<ErrorRecord*>(a.err_record);
  w.claim = reinterpret_cast<uint32_t*>(a.err_claim);
  w.timeout_ns = a.timeout_ns;
  w.epoch = s.seq.op;
  w.op = op;
  w.rank = a.rank;
  w.abort_word = reinterpret_cast<const uint64_t*>(a.abort_word);
  w.bases = s.bases;
  w.abort_off = a.off_stats + kStatsAbortOffset;
  w.remote_mask = a.remote_mask;
  w.world = a.world;
  return w;
}

// Reads the sequence numbers, loads peer bases, clears the abort flag. Returns false (in every
// block) when the op must not run: this rank failed earlier (its claim is set: the failure is
// sent to the peers again, in case the failing kernel could not) or a peer's abort word arrived.
// Such an op writes nothing and publishes nothing, so no peer can mistake it for progress.
__device__ __forceinline__ bool prologue(const OpArgs& a, Shared& s, uint32_t kind) {
  const int tid = threadIdx.x;
  const uint64_t* peer_bases = reinterpret_cast<const uint64_t*>(a.peer_bases);
  if (tid < a.world) s.bases[tid] = reinterpret_cast<uint8_t*>(peer_bases[tid]);
  if (tid == 0) {
    s.abort = 0;
    // Issue the failure-word loads with the SeqState loads so their latencies overlap.
    const uint32_t claim = *reinterpret_cast<const volatile uint32_t*>(a.err_claim);
    const uint64_t abort = *reinterpret_cast<const volatile uint64_t*>(a.abort_word);
    const volatile SeqState* st = reinterpret_cast<const volatile SeqState*>(a.seq_state);
    OpSeq q;
    q.op = st->op + 1;
    q.notify = st->notify + (kind == kOpDispatch ? 1 : 0);
    q.dispatch = st->dispatch + (kind == kOpDispatch || kind == kOpCachedDispatch ? 1 : 0);
    q.combine = st->combine + (kind == kOpCombine ? 1 : 0);
    q.epoch = kind == kOpCombine ? q.combine : q.notify;
    q.done_expected = st->done + gridDim.x;
    q.barrier_base = st->barriers;
    s.seq = q;
    if (claim != 0 || abort != 0) {  // the rare path: this rank or a peer failed earlier
      // Every base, for the broadcast (the same values the other threads store).
      for (int d = 0; d < a.world; ++d) s.bases[d] = reinterpret_cast<uint8_t*>(peer_bases[d]);
      const WaitCtx w = make_wait(a, s, kind);
      s.abort = 1;
      if (claim != 0) {
        const volatile ErrorRecord* r = w.record;
        const uint32_t code = r->code;
        if (code != kOk && code != kPeerFailed)
          broadcast_abort(w, make_abort(code, a.rank, r->epoch));
      } else {
        should_stop(w, kWaitOpStart, 0);  // records PeerFailed naming the origin
      }
    }
  }
  __syncthreads();
  return s.abort == 0;
}

// Called once per block on the success path; the last block to finish advances SeqState.
__device__ __forceinline__ void epilogue(const OpArgs& a, const Shared& s, uint64_t barriers) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  SeqState* st = reinterpret_cast<SeqState*>(a.seq_state);
  __threadfence();
  if (atomicAdd(&st->exits, 1u) != gridDim.x - 1) return;
  const OpSeq& q = s.seq;
  volatile SeqState* v = st;
  v->op = q.op;
  v->notify = q.notify;
  v->dispatch = q.dispatch;
  v->combine = q.combine;
  v->done = q.done_expected;
  v->barriers = q.barrier_base + (a.global_barriers ? barriers * gridDim.x : 0);
  v->exits = 0;
  __threadfence();
}

// Block-uniform: true when every thread's `ok` held.
__device__ __forceinline__ bool all_ok(Shared& s, bool ok) {
  if (!ok) s.abort = 1;
  __syncthreads();
  return s.abort == 0;
}

// [G*] Round-aware all-rank barrier over every block of every rank (Global strategy only).
// Monotonic counters: barrier k of this op completes when every peer's counter reached
// barrier_base + k * gridDim.x. Never reset, so no cleaning and no add-then-reset race.
__device__ bool rank_barrier(const OpArgs& a, const WaitCtx& w, Shared& s, uint64_t k) {
  net_quiet(a.remote_mask);
  __syncthreads();
  const int tid = threadIdx.x;
  bool ok = true;
  if (tid < a.world) {
    net_publish_add(u64_at(s.bases[tid], a.off_barrier) + a.rank, 1, tid,
                    net_remote(a.remote_mask, tid));
    uint64_t arrived = 0;
    ok = wait_geq(w, u64_at(s.bases[a.rank], a.off_barrier) + tid,
                  s.seq.barrier_base + k * gridDim.x, kWaitBarrier, tid, &arrived);
    // Block 0 records when each peer reached the barrier: where Global waits for late ranks.
    if (ok && blockIdx.x == 0)
      u64_at(s.bases[a.rank], a.off_stats)[kStatPeers + a.world + tid] = arrived;
  }
  return all_ok(s, ok);
}

__device__ __forceinline__ void finish_stats(const OpArgs& a, Shared& s, uint64_t t_start,
                                             uint32_t kind) {
  uint64_t* stats = u64_at(s.bases[a.rank], a.off_stats);
  const int tid = threadIdx.x;
  if (tid == 0) {
    stats[kStatOpSeq] = s.seq.op;
    stats[kStatStart] = t_start;
    stats[kStatKind] = kind;
    stats[kStatWorld] = static_cast<uint64_t>(a.world);
    stats[kStatEnd] = globaltimer_ns();
  }
}

// Copies one row of `n16` 16-byte vectors from `src` to row `rows[d]` of the region at
// `bases[d] + off` for every destination d with rows[d] >= 0 (both tables in shared memory).
// One warp; each lane keeps kUnroll vectors in flight. Destinations reached through the
// transport (`remote_mask`) get one warp put of the row instead.
__device__ __forceinline__ void warp_copy_row_multi(const int4* src, uint8_t* const* bases,
                                                    const int* rows, uint64_t off,
                                                    int64_t row_bytes, int ndst, int n16,
                                                    int lane, uint64_t remote_mask) {
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < n16) v[u] = ld_nc_v4(src + i);
    }
    for (int d = 0; d < ndst; ++d) {
      const int row = rows[d];
      if (row < 0 || net_remote(remote_mask, d)) continue;
      int4* out = reinterpret_cast<int4*>(bases[d] + off + row * row_bytes);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < n16) st_na_v4(out + i, v[u]);
      }
    }
  }
#ifdef EPCOMM_NET_NVSHMEM
  for (int d = 0; remote_mask != 0 && d < ndst; ++d)
    if (rows[d] >= 0 && net_remote(remote_mask, d))
      net_put_warp(bases[d] + off + rows[d] * row_bytes, src, static_cast<size_t>(n16) * 16, d);
#endif
}

// One row, one destination.
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* out, int n16, int lane) {
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < n16) v[u] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < n16) st_na_v4(out + i, v[u]);
    }
  }
}

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return v;
}

}  // namespace

// Host checks these against its own mirror of abi.cuh before the first launch.
extern "C" __global__ void epcomm_abi_probe(uint64_t* out) {
  out[0] = sizeof(OpArgs);
  out[1] = offsetof(OpArgs, num_tokens);
  out[2] = offsetof(OpArgs, global_barriers);
  out[3] = sizeof(LayoutArgs);
  out[4] = offsetof(LayoutArgs, num_tokens);
  out[5] = sizeof(ErrorRecord);
  out[6] = offsetof(ErrorRecord, epoch);
  out[7] = sizeof(SeqState);
}

// Diagnostics: holds this stream for `ns` nanoseconds (one thread spinning on %globaltimer), so
// tests and `epcomm bench --delay-rank` can make one rank late by an exact amount.
extern "C" __global__ void epcomm_delay(uint64_t ns) {
  const uint64_t t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < ns) {
  }
}

// Layout: blocks [0, world) scan tokens for one rank each (slot = exclusive prefix of the
// tokens sent there, deterministic), blocks [world, world + nodes) do the same per node, and
// the remaining blocks build the per-expert histogram in chunks of kHistChunk experts. The
// first histogram block also validates every top-k id and writes `status`.
extern "C" __global__ void __launch_bounds__(kThreads) epcomm_layout(const LayoutArgs a) {
  __shared__ int s_warp[kWarps];
  __shared__ uint32_t s_hist[kHistChunk];
  __shared__ int s_invalid;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, nodes = world / a.gpus_per_node, E = a.num_experts;
  const int T = a.num_tokens, K = a.top_k, epr = E / world;
  const int64_t* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  uint32_t* counts = reinterpret_cast<uint32_t*>(a.counts);
  const int b = blockIdx.x;

  if (b < world + nodes) {
    const bool is_rank = b < world;
    const int g = is_rank ? b : b - world;
    const int64_t width = is_rank ? epr : static_cast<int64_t>(epr) * a.gpus_per_node;
    const int64_t lo = g * width, hi = lo + width;
    int32_t* slots = reinterpret_cast<int32_t*>(a.token_slot);
    int base = 0;
    for (int t0 = 0; t0 < T; t0 += kThreads) {
      const int t = t0 + tid;
      int flag = 0;
      if (t < T)
        for (int k = 0; k < K; ++k) {
          const int64_t v = idx[static_cast<int64_t>(t) * K + k];
          flag |= (v >= lo && v < hi) ? 1 : 0;
        }
      int incl = flag;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      if (lane == 31) s_warp[warp] = incl;
      __syncthreads();
      int warp_base = 0, total = 0;
      for (int i = 0; i < kWarps; ++i) {
        if (i < warp) warp_base += s_warp[i];
        total += s_warp[i];
      }
      if (is_rank && t < T)
        slots[static_cast<int64_t>(t) * world + g] = flag ? base + warp_base + incl - flag : -1;
      base += total;
      __syncthreads();
    }
    if (tid == 0) counts[is_rank ? g : world + E + g] = static_cast<uint32_t>(base);
    return;
  }

  const int chunk = b - world - nodes;
  const int lo = chunk * kHistChunk;
  const int n = min(kHistChunk, E - lo);
  for (int i = tid; i < kHistChunk; i += kThreads) s_hist[i] = 0;
  if (tid == 0) s_invalid = 0;
  __syncthreads();
  const int64_t total = static_cast<int64_t>(T) * K;
  for (int64_t i = tid; i < total; i += kThreads) {
    const int64_t v = idx[i];
    if (v >= lo && v < lo + n) atomicAdd(&s_hist[v - lo], 1u);
    if (chunk == 0 && (v < -1 || v >= E)) {
      s_invalid = 1;
      WaitCtx w;
      w.record = reinterpret_cast<ErrorRecord*>(a.err_record);
      w.claim = reinterpret_cast<uint32_t*>(a.err_claim);
      w.timeout_ns = 0;
      w.epoch = 0;
      w.op = kOpLayout;
      w.rank = a.rank;
      w.abort_word = nullptr;  // no peers here: the next op's prologue tells them
      w.bases = nullptr;
      w.abort_off = 0;
      w.remote_mask = 0;
      w.world = 0;
      // peer = token index, expected = num_experts, seen = the offending id.
      record_failure(w, kInvalidExpert, kWaitNone, static_cast<int32_t>(i / K),
                     static_cast<uint64_t>(E), static_cast<uint64_t>(v), 0);
    }
  }
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) counts[world + lo + i] = s_hist[i];
  if (chunk == 0 && tid == 0) *reinterpret_cast<uint32_t*>(a.status) = s_invalid;
}

// Dispatch (and cached dispatch, kFlagCached).
extern "C" __global__ void __launch_bounds__(kThreads, 1) epcomm_dispatch(const OpArgs a) {
  __shared__ Shared s;
  const uint64_t t_start = globaltimer_ns();
  const bool cached = (a.flags & kFlagCached) != 0;
  const uint32_t kind = cached ? kOpCachedDispatch : kOpDispatch;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const int epr = a.num_experts / world;
  const bool block0 = blockIdx.x == 0;
  if (!prologue(a, s, kind)) return;
  const OpSeq q = s.seq;
  const WaitCtx w = make_wait(a, s, kind);
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
  uint64_t barrier_k = 0;
  if (a.global_barriers && !rank_barrier(a, w, s, ++barrier_k)) return;  // [G1]

  if (!cached) {
    const uint32_t* per_rank = reinterpret_cast<const uint32_t*>(a.layout_counts);
    const uint32_t* per_expert = per_rank + world;
    if (block0) {  // [E1] my count row (and per-expert counts) to every rank, epoch-tagged
      for (int i = tid; i < world * world; i += kThreads) {
        const int d = i / world, j = i % world;
        net_set_word(u64_at(s.bases[d], off_counts) + me * world + j,
                     make_tagged(q.epoch, per_rank[j]), d, net_remote(a.remote_mask, d));
      }
      for (int i = tid; i < world * epr; i += kThreads) {
        const int d = i / epr, l = i % epr;
        net_set_word(u64_at(s.bases[d], off_expert_counts) + me * epr + l,
                     make_tagged(q.epoch, per_expert[d * epr + l]), d,
                     net_remote(a.remote_mask, d));
      }
    }
    if (a.global_barriers && !rank_barrier(a, w, s, ++barrier_k)) return;  // [G3]
    // [E2] the whole count matrix, from my own buffer.
    const uint64_t* counts = u64_at(local, off_counts);
    bool ok = true;
    for (int i = tid; ok && i < world * world; i += kThreads) {
      const bool track = block0 && (i % world) == 0;
      uint64_t arrived = 0;
      ok = wait_tag(w, counts + i, q.epoch, kWaitCountRow, i / world, &s.counts[i],
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
        record_failure(w, kOverflow, kWaitNone, tid, static_cast<uint64_t>(a.max_recv_rows),
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
        stats[kStatCountsReady] = globaltimer_ns();
      }
      const uint64_t* ecounts = u64_at(local, off_expert_counts);
      int* recv_expert = reinterpret_cast<int*>(a.recv_expert_counts);
      for (int l = tid; ok && l < epr; l += kThreads) {
        uint32_t sum = 0;
        for (int r = 0; ok && r < world; ++r) {
          uint32_t v = 0;
          ok = wait_tag(w, ecounts + r * epr + l, q.epoch, kWaitExpertCounts, r, &v, nullptr);
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
    if (a.global_barriers && !rank_barrier(a, w, s, ++barrier_k)) return;  // [G5]
  } else {
    if (tid < world) s.offsets[tid] = reinterpret_cast<const int*>(a.send_offsets)[tid];
    __syncthreads();
  }

  // [E4] every token once to every destination rank, straight into its final row. Work is
  // dealt block-first (consecutive tokens on different SMs) so small batches use every SM.
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  const int32_t* token_slot = reinterpret_cast<const int32_t*>(a.token_slot);
  const int n16 = a.row_bytes / 16;
  const bool has_scales = (a.flags & kFlagHasScales) != 0;
  const bool has_topk = (a.flags & kFlagHasTopk) != 0;
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const float* topk_w = reinterpret_cast<const float*>(a.topk_weights);
  const float* scales = reinterpret_cast<const float*>(a.x_scales);
  int* rows = s.rows[warp];
  for (int t = gwarp; t < a.num_tokens; t += nwarps) {
    for (int d = lane; d < world; d += 32) {
      const int slot = token_slot[static_cast<int64_t>(t) * world + d];
      rows[d] = slot >= 0 ? s.offsets[d] + slot : -1;
    }
    __syncwarp();
    warp_copy_row_multi(reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.row_bytes),
                        s.bases, rows, off_x, a.row_bytes, world, n16, lane, a.remote_mask);
    if (has_scales)
      for (int i = lane; i < a.num_scales; i += 32) {
        const float v = scales[static_cast<int64_t>(t) * a.num_scales + i];
        for (int d = 0; d < world; ++d)
          if (rows[d] >= 0)
            net_put_elem(reinterpret_cast<float*>(s.bases[d] + off_scales) +
                             static_cast<int64_t>(rows[d]) * a.num_scales + i,
                         v, d, net_remote(a.remote_mask, d));
      }
    if (has_topk)
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
        const float wt = has_w ? topk_w[static_cast<int64_t>(t) * K + k] : 0.f;
        for (int d = 0; d < world; ++d) {
          if (rows[d] < 0) continue;
          const int64_t lo = static_cast<int64_t>(d) * epr;
          const bool here = e >= lo && e < lo + epr;
          const int64_t r = static_cast<int64_t>(rows[d]) * K + k;
          const bool remote = net_remote(a.remote_mask, d);
          net_put_elem(reinterpret_cast<int64_t*>(s.bases[d] + off_topk_idx) + r,
                       here ? e - lo : int64_t{-1}, d, remote);
          if (has_w)
            net_put_elem(reinterpret_cast<float*>(s.bases[d] + off_topk_w) + r, here ? wt : 0.f,
                         d, remote);
        }
      }
    if (lane == 0)
      for (int d = 0; d < world; ++d)
        if (rows[d] >= 0)
          net_put_elem(reinterpret_cast<int32_t*>(s.bases[d] + off_src_idx) + rows[d],
                       static_cast<int32_t>(t), d, net_remote(a.remote_mask, d));
    __syncwarp();
  }
  net_quiet(a.remote_mask);
  __syncthreads();
  if (block0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [E5] this block's data for every destination is written: publish (release, system scope).
  if (tid < world)
    net_publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, tid, net_remote(a.remote_mask, tid));
  const uint64_t nbarriers = a.global_barriers ? (cached ? 1 : 3) : 0;
  if (!block0) return epilogue(a, s, nbarriers);
  // [E6] wait until every source's data landed here (monotonic counters, never reset).
  bool ok = true;
  if (tid < world) {
    uint64_t arrived = 0;
    ok = wait_geq(w, u64_at(local, a.off_done) + tid, q.done_expected, kWaitDispatchDone, tid,
                  &arrived);
    if (ok) stats[kStatPeers + 2 * world + tid] = arrived;
  }
  if (!all_ok(s, ok)) return;
  // [E7] the receive region is the output; keep the source indices with the handle.
  if (!cached) {
    const int num_recv = reinterpret_cast<const int*>(a.recv_prefix)[world];
    const int32_t* src = reinterpret_cast<const int32_t*>(local + off_src_idx);
    int32_t* out = reinterpret_cast<int32_t*>(a.recv_src_idx);
    for (int i = tid; i < num_recv; i += kThreads) out[i] = src[i];
  }
  finish_stats(a, s, t_start, kind);
  epilogue(a, s, nbarriers);
}

// Combine: y rows (in this rank's receive order) go back to their source ranks and are summed
// there in rank order (fp32 accumulate, one bf16 rounding).
//
// Every warp first pushes its share of rows (dealt block-first) and publishes each row with a
// monotonic per-token flag (the combine sequence number: flags[sender][token] on the owner),
// then reduces tokens of this rank, each as soon as the flags of exactly the peers that hold a
// contribution (known locally from the layout) arrived: warps that finish sending early reduce
// while the last rows are still crossing NVLink, and a small batch has a short critical path.
extern "C" __global__ void __launch_bounds__(kThreads, 1) epcomm_combine(const OpArgs a) {
  __shared__ Shared s;
  __shared__ unsigned long long s_arrival[kMaxWorld];
  __shared__ int s_send_off[kMaxWorld];
  const uint64_t t_start = globaltimer_ns();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const bool block0 = blockIdx.x == 0;
  if (!prologue(a, s, kOpCombine)) return;
  const OpSeq q = s.seq;
  const WaitCtx w = make_wait(a, s, kOpCombine);
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
  uint64_t barrier_k = 0;
  if (a.global_barriers && !rank_barrier(a, w, s, ++barrier_k)) return;  // [G1]
  // In place: every rank's y is its latest dispatch's receive region (same parity everywhere).
  const uint64_t dpar = (q.dispatch & 1) * a.parity_stride;
  const uint64_t off_y = a.off_x + dpar, off_yw = a.off_topk_w + dpar;

  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const bool has_w = (a.flags & kFlagHasWeights) != 0;
  const int32_t* src_idx = reinterpret_cast<const int32_t*>(a.recv_src_idx);
  // y and its weights: the caller's (a.x, a.topk_weights), or in place my receive region.
  const uint8_t* y = in_place ? local + off_y : reinterpret_cast<const uint8_t*>(a.x);
  const float* y_w = in_place ? reinterpret_cast<const float*>(local + off_yw)
                              : reinterpret_cast<const float*>(a.topk_weights);
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  bool ok = true;

  if (in_place) {
    // [P1] my y is complete (earlier kernels on this stream wrote it): tell every peer.
    if (block0 && tid < world) {
      __threadfence_system();
      net_publish_set(u64_at(s.bases[tid], a.off_stats + kStatsReadyOffset) + me, q.epoch, tid,
                      net_remote(a.remote_mask, tid));
    }
    // [P2] every block waits until every peer's y is complete, then pulls it directly.
    bool ready = true;
    if (tid < world && tid != me) {
      uint64_t arrived = 0;
      ready = wait_geq(w, u64_at(local, a.off_stats + kStatsReadyOffset) + tid, q.epoch,
                       kWaitCombineDone, tid, &arrived);
      if (ready && block0) s_arrival[tid] = arrived;
    }
    if (!all_ok(s, ready)) return;
  }
  // [C1] push every received row whose source is another rank, then publish it (release).
  // In place, rows of mapped peers are pulled below; rows of peers reached through the
  // transport (remote_mask) are still pushed, since a remote read would stall every token.
  const int num_rows = in_place && a.remote_mask == 0 ? 0 : s.offsets[world];
  for (int row = gwarp; row < num_rows; row += nwarps) {
    int r = 0;
    while (r + 1 < world && s.offsets[r + 1] <= row) ++r;
    if (r == me || (in_place && !net_remote(a.remote_mask, r))) continue;
    const int t = src_idx[row];
    const int64_t slot = static_cast<int64_t>(me) * a.max_tokens + t;
#ifdef EPCOMM_NET_NVSHMEM
    if (net_remote(a.remote_mask, r)) {  // weights, then the row with its flag (ordered)
      if (has_w)
        net_put_warp(s.bases[r] + off_comb_w + slot * K * 4, y_w + static_cast<int64_t>(row) * K,
                     static_cast<size_t>(K) * 4, r);
      nvshmem_fence();
      net_put_signal_warp(s.bases[r] + off_comb_x + slot * row_bytes, y + row * row_bytes,
                          static_cast<size_t>(row_bytes), u64_at(s.bases[r], a.off_comb_flags) + slot,
                          q.epoch, r);
      continue;
    }
#endif
    warp_copy_row(reinterpret_cast<const int4*>(y + row * row_bytes),
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
  for (int t = gwarp; ok && t < a.num_tokens; t += nwarps) {
    bool lane_ok = true;
    for (int r = lane; r < world; r += 32) {
      const int slot = token_slot[static_cast<int64_t>(t) * world + r];
      if (in_place && !net_remote(a.remote_mask, r)) {
        rows[r] = slot < 0 ? -1 : s_send_off[r] + slot;  // my token's row in r's region
        continue;
      }
      rows[r] = slot < 0 ? -1 : (r == me ? s.offsets[me] + slot : t);
      if (slot >= 0 && r != me) {
        uint64_t arrived = 0;
        lane_ok = lane_ok && wait_geq(w, flags + static_cast<int64_t>(r) * a.max_tokens + t,
                                      q.epoch, kWaitCombineDone, r, &arrived);
        if (lane_ok && block0) atomicMax(&s_arrival[r], static_cast<unsigned long long>(arrived));
      }
    }
    ok = __all_sync(0xffffffffu, lane_ok);
    if (!ok) break;
    // Reconverge before the reduction: without it the lanes that waited and the ones that did
    // not may run the loop below apart (measured: put/signal combine 531 -> 407 us).
    __syncwarp();
    int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * row_bytes);
    for (int base = 0; base < n16; base += 32 * kReduceUnroll) {
      float acc[kReduceUnroll][8];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
      for (int r = 0; r < world; ++r) {
        const int row = rows[r];
        if (row < 0) continue;
        const bool pulled = in_place && !net_remote(a.remote_mask, r);
        const int4* p =
            pulled ? reinterpret_cast<const int4*>(s.bases[r] + off_y + row * row_bytes)
            : r == me ? reinterpret_cast<const int4*>(y + static_cast<int64_t>(row) * row_bytes)
                      : reinterpret_cast<const int4*>(
                            comb + (static_cast<int64_t>(r) * a.max_tokens + t) * row_bytes);
        // Pulled rows (in place) and y never change during this kernel: non-coherent loads.
        const bool nc = pulled || r == me;
        int4 v[kReduceUnroll];
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
          const int i = base + u * 32 + lane;
          if (i < n16) v[u] = nc ? ld_nc_v4(p + i) : ld_v4(p + i);
        }
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u)
          if (base + u * 32 + lane < n16) add_bf16x8(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < n16) st_na_v4(out + i, pack_bf16x8(acc[u]));
      }
    }
    if (has_w)
      for (int k = lane; k < K; k += 32) {
        float acc = 0.f;
        for (int r = 0; r < world; ++r) {
          const int row = rows[r];
          if (row < 0) continue;
          acc += in_place && !net_remote(a.remote_mask, r)
                     ? reinterpret_cast<const float*>(s.bases[r] + off_yw)[
                                static_cast<int64_t>(row) * K + k]
                 : r == me ? y_w[static_cast<int64_t>(row) * K + k]
                           : comb_w[(static_cast<int64_t>(r) * a.max_tokens + t) * K + k];
        }
        reinterpret_cast<float*>(a.out_weights)[static_cast<int64_t>(t) * K + k] = acc;
      }
    __syncwarp();
  }
  net_quiet(a.remote_mask);
  if (!all_ok(s, ok)) return;
  if (block0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [C2] completion counters stay in step with every other op (cumulative expectations).
  if (tid < world)
    net_publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, tid, net_remote(a.remote_mask, tid));
  const uint64_t nbarriers = a.global_barriers ? 1 : 0;
  if (!block0) return epilogue(a, s, nbarriers);
  // [C5] every peer finished this combine's sends: finishing an op implies every peer started
  // it, which is what lets the next ops reuse the parity regions (docs/protocol.md).
  ok = true;
  if (tid < world) {
    ok = wait_geq(w, u64_at(local, a.off_done) + tid, q.done_expected, kWaitCombineDone, tid,
                  nullptr);
    stats[kStatPeers + 2 * world + tid] = s_arrival[tid];
  }
  if (!all_ok(s, ok)) return;
  finish_stats(a, s, t_start, kOpCombine);
  epilogue(a, s, nbarriers);
}
