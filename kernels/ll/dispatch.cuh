// Low-latency dispatch: send phase ([L1]-[L4]) and receive phase ([L5]-[L7]).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/abi.cuh"
#include "common/copy.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"
#include "ll/shared.cuh"

namespace epcomm::ll {

// One lane's 8 channels of an FP8 row: cast with the group's scale (amax over the 16 lanes of
// its 128-channel group), DeepEP's per-token, per-128-channel cast:
//   amax = max(max |x|, 1e-4); scale_inv = amax / 448 (rounded up to a power of two with
//   kFlagRoundScale); q = e4m3(x * (448 / amax)), or e4m3(x * (1 / scale_inv)) when rounded.
// Every operation is an IEEE-rounded one, so the CPU reference reproduces the bits.
__device__ __forceinline__ uint2 cast_fp8x8(const int4& v, bool round_scale, float* scale_inv) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float f[8];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = __bfloat1622float2(h[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
    amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
  }
#pragma unroll
  for (int m = 8; m >= 1; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  amax = fmaxf(amax, 1e-4f);
  float inv = __fdiv_rn(amax, 448.f);
  float mul = __fdiv_rn(448.f, amax);
  if (round_scale) {
    inv = pow2_ceil(inv);
    mul = __fdiv_rn(1.f, inv);
  }
  *scale_inv = inv;
  uint2 out;
  uint16_t* q = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    q[j] = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(f[2 * j], mul), __fmul_rn(f[2 * j + 1], mul)), __NV_SATFINITE,
        __NV_E4M3);
  return out;
}

template <class Net>
__device__ __forceinline__ void dispatch_unpack(const OpArgs& a, Shared& s, uint32_t* dyn,
                                                Schedule<Net>& sched);

// [L6]'s waits: every source's tagged counts (its rows; its rows per local expert of this rank)
// into s.prefix[source] and first[l * world + source] (see await_sends_and_counts).
template <class Net>
struct CountWaits {
  const OpArgs& a;
  Shared& s;
  int* first;  // [epr][world] (dynamic shared memory)
  __device__ __forceinline__ bool operator()(int i0, int stride) const {
    const int world = a.world, epr = a.num_experts / world;
    const uint64_t par = (s.seq.ll_dispatch & 1) * a.parity_stride;
    const uint64_t* counts = u64_at(s.bases[a.rank], a.off_ll_counts + par);
    bool ok = true;
    for (int i = i0; ok && i < (epr + 1) * world; i += stride) {
      const int r = i % world, l = i / world;  // l == epr: the source's row count
      uint32_t n = 0;
      ok = wait_tag<Net>(s.wait, counts + r * (1 + epr) + (l == epr ? 0 : 1 + l), s.seq.epoch,
                         kWaitLlDispatch, r, &n, nullptr);
      if (l == epr)
        s.prefix[r] = static_cast<int>(n);
      else
        first[i] = static_cast<int>(n);
    }
    return ok;
  }
};

// [L5] and [L6]'s waits. A count carries this op's epoch, so where it lands whole
// (Net::kWholeWords) it is valid once its tag matches, whatever the done counters say: its
// wait then runs beside the done waits (await_sends' side wait), a round trip less after
// them. Otherwise (the CPU proxy's signals) a count is read only after the done counter that
// follows it, as the protocol orders them. `dyn` holds the counts (its routing bitmaps, in a
// send kernel, are done with).
template <class Net>
__device__ __forceinline__ bool await_sends_and_counts(const OpArgs& a, Shared& s,
                                                       Schedule<Net>& sched, uint32_t* dyn) {
  const CountWaits<Net> counts{a, s, reinterpret_cast<int*>(dyn)};
  if constexpr (Net::kWholeWords) {
    return await_sends<Net>(a, s, sched, kWaitLlDispatch, counts);
  } else {
    if (!await_sends<Net>(a, s, sched, kWaitLlDispatch)) return false;
    return all_ok(s, counts(threadIdx.x, kThreads));
  }
}

// Steps of a send work item: 256 channels each (8 per lane), at most kCastUnroll loaded
// together; a row that goes through the transport is one item.
constexpr int kCastUnroll = 8;
__device__ __forceinline__ Split send_split(const OpArgs& a, int tokens) {
  return split_rows(tokens, (a.hidden + 255) / 256, gridDim.x * kWarps, kCastUnroll,
                    a.remote_mask != 0);
}

// kCastUnroll chunks of 256 channels from channel c0 of a BF16 row (8 per lane; zeros past
// c_end), all loads in flight together.
__device__ __forceinline__ void load_cast_chunk(int4 (&v)[kCastUnroll], const int4* row, int c0,
                                                int c_end, int lane) {
#pragma unroll
  for (int u = 0; u < kCastUnroll; ++u) {
    const int ch = c0 + u * 256 + lane * 8;
    v[u] = ch < c_end ? ld_nc_v4(row + ch / 8) : make_int4(0, 0, 0, 0);
  }
}

// Send phase. Every block builds the routing bitmaps of all tokens in shared memory (the
// batch is small), so slots and indices need no communication between blocks; warps are dealt
// tokens block-first. kOneKernel: the kernel of an op without a hook, which runs the receive
// phase's work after the send phase when kFlagFused says so (the hook's kernel has no such path).
template <class Net, bool kOneKernel>
__device__ __forceinline__ void dispatch_send(const OpArgs& a, Shared& s, uint32_t* dyn) {
  const uint64_t t_start = globaltimer_ns();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k, E = a.num_experts, T = a.num_tokens;
  const int epr = E / world, M = a.ll_max_tokens;
  const bool fp8 = (a.flags & kFlagHasScales) != 0;
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  // Work items are (token, run of 256-channel steps) (send_split): a warp keeps all of its
  // item's loads in flight at once, and even one token spreads over several warps. Rows that
  // travel through the transport go whole (one item per token: one put per row).
  const Split sp = send_split(a, T);
  const int nch = sp.nch;
  const int span = nch == 1 ? a.hidden : sp.per_item * 256;  // channels per item
  // Inputs, issued before the prologue's round trip so that their latency overlaps it and the
  // bitmaps: the routing into L2, and the first chunk of this warp's first item (x is final
  // when the kernel starts): FP8 straight into registers (`v`, cast in the send loop), BF16
  // into L2 (the Net's send_row loads it).
  const int64_t idx_lines = (static_cast<int64_t>(T) * K * 8 + 127) / 128;
  for (int64_t i = tid; i < idx_lines; i += kThreads)
    prefetch_l2(reinterpret_cast<const uint8_t*>(a.topk_idx) + i * 128);
  int4 v[kCastUnroll];
  bool preloaded = false;
  if (gwarp < T * nch) {
    const int c_begin = gwarp % nch * span, c_end = min(a.hidden, c_begin + span);
    const int64_t first = static_cast<int64_t>(gwarp / nch) * a.hidden;  // the row's channel 0
    // Past the registers' chunk (FP8, a whole row through the transport), into L2.
    const int l2_from = fp8 ? min(c_end, c_begin + 256 * kCastUnroll) : c_begin;
    if (fp8) {
      load_cast_chunk(v, reinterpret_cast<const int4*>(a.x) + first / 8, c_begin, c_end, lane);
      preloaded = true;
    }
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.x) + (first + l2_from) * 2;
    for (int b = lane * 128; b < (c_end - l2_from) * 2; b += 32 * 128) prefetch_l2(row + b);
  }
  if (!prologue<Net>(a, s, kOpLlDispatch)) return;
  const OpSeq q = s.seq;
  const WaitCtx& w = s.wait;
  const uint64_t par = (q.ll_dispatch & 1) * a.parity_stride;
  uint64_t* const stats = u64_at(s.bases[me], a.off_stats);
  if (blockIdx.x == 0 && tid == 0) stats[kStatStart] = t_start;  // the op's start (stats)
  Schedule<Net> sched(a);
  if (!sched.barrier(a, s)) return;  // [G1]

  // [L1] bitmaps over my tokens: emask[e] (token picks expert e), dmask[d] (token goes to d).
  const int W = (T + 31) / 32;
  uint32_t* emask = dyn;
  uint32_t* dmask = dyn + static_cast<int64_t>(E) * W;
  for (int i = tid; i < (E + world) * W; i += kThreads) dyn[i] = 0u;
  __syncthreads();
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  bool ok = true;
  for (int i = tid; i < T * K; i += kThreads) {
    const int64_t e = topk_idx[i];
    const int t = i / K;
    if (e == -1) continue;
    if (e < 0 || e >= E) {
      if (ok)
        record_failure<Net>(w, kInvalidExpert, kWaitNone, t, static_cast<uint64_t>(E),
                            static_cast<uint64_t>(e), 0);
      ok = false;
      continue;
    }
    const uint32_t bit = 1u << (t % 32);
    if (atomicOr(&emask[e * W + t / 32], bit) & bit) {
      if (ok)
        record_failure<Net>(w, kDuplicateExpert, kWaitNone, t, static_cast<uint64_t>(E),
                            static_cast<uint64_t>(e), 0);
      ok = false;
    }
    atomicOr(&dmask[(e / epr) * W + t / 32], bit);
  }
  if (!all_ok(s, ok)) return;

  // [L2] per destination: rows, then rows per local expert, tagged with this LL epoch.
  if (blockIdx.x == 0)
    for (int i = tid; i < world * (1 + epr); i += kThreads) {
      const int d = i / (1 + epr), l = i % (1 + epr);
      if (masked(s, d)) continue;  // a masked rank is sent nothing
      const uint32_t* m = l == 0 ? dmask + d * W : emask + static_cast<int64_t>(d * epr + l - 1) * W;
      uint32_t n = 0;
      for (int j = 0; j < W; ++j) n += __popc(m[j]);
      Net::set_word(u64_at(s.bases[d], a.off_ll_counts + par) + me * (1 + epr) + l,
                    make_tagged(q.epoch, n), d, Net::remote(a.remote_mask, d));
    }

  // [L3] every token once to every rank holding one of its experts: row, scales, metadata.
  const bool round_scale = (a.flags & kFlagRoundScale) != 0;
  const int H = a.hidden, S = a.num_scales, row_bytes = a.row_bytes;
  const int64_t mine = static_cast<int64_t>(me) * M;  // my first slot in every destination
  const uint64_t off_x = a.off_ll_x + par + mine * row_bytes;
  const uint64_t off_sc = a.off_ll_scales + par + mine * S * 4;
  const uint64_t off_meta = a.off_ll_meta + par + mine * (K + 1) * 4;
  __shared__ int rows_tab[kWarps][kMaxWorld];
  int* rows = rows_tab[warp];
  // What reaches transport peers, and how, is the Net policy's (common/net.cuh,
  // `LlDispatchSender`): rows and staged FP8 rows by warp puts, metadata rows element by element
  // or staged and sent whole.
  const LlDispatchSend op{a, s.bases, off_x, off_sc, off_meta, world, me, K, M, H, S, row_bytes,
                          lane};
  const typename Net::LlDispatchSender tx(op);
  const uint8_t* x = reinterpret_cast<const uint8_t*>(a.x);
  for (int item = gwarp; item < T * nch; item += nwarps) {
    const int t = item / nch, c = item % nch;
    const int c_begin = c * span, c_end = min(H, c_begin + span);
    for (int d = lane; d < world; d += 32)
      rows[d] = bit_of(dmask + d * W, t) && !masked(s, d) ? rank_in_mask(dmask + d * W, t) : -1;
    __syncwarp();
    if (!fp8) {
      tx.send_row(op,
                  reinterpret_cast<const int4*>(x + (static_cast<int64_t>(t) * H + c_begin) * 2),
                  rows, off_x + static_cast<uint64_t>(c_begin) * 2, (c_end - c_begin) / 8);
    } else {
      // Cast once, store to every mapped destination; stage for put/signal destinations.
      uint8_t* stage = s.bases[me] + a.off_ll_send_fp8 + static_cast<int64_t>(t) * H;
      float* stage_sc = reinterpret_cast<float*>(s.bases[me] + a.off_ll_send_fp8 +
                                                 static_cast<int64_t>(M) * H) +
                        static_cast<int64_t>(t) * S;
      const int4* src = reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * H * 2);
      // kCastUnroll chunks of 256 channels (8 per lane) loaded before any is cast, so the
      // loads of a row are in flight together.
      for (int c0 = c_begin; c0 < c_end; c0 += 256 * kCastUnroll) {
        if (!preloaded) load_cast_chunk(v, src, c0, c_end, lane);
        preloaded = false;
        // One copy of the cast and its stores (after an L2 flush every SM fetches the code
        // again; unrolled 8 times it made the kernel 3,000 instructions longer): each pass
        // casts v[0], then the next chunk's vector moves to the front (register moves).
#pragma unroll 1
        for (int u = 0; u < kCastUnroll; ++u) {
          if (c0 + u * 256 >= c_end) break;  // warp-uniform: the cast shuffles across the warp
          const int ch = c0 + u * 256 + lane * 8;
          float inv;
          const uint2 b = cast_fp8x8(v[0], round_scale, &inv);
          if (ch < c_end) {
            const bool group_head = (lane % 16) == 0;
            for (int d = 0; d < world; ++d) {
              if (rows[d] < 0) continue;
              if (Net::remote(a.remote_mask, d)) continue;
              *reinterpret_cast<uint2*>(s.bases[d] + off_x +
                                        static_cast<int64_t>(rows[d]) * row_bytes + ch) = b;
              if (group_head)
                reinterpret_cast<float*>(s.bases[d] + off_sc)[static_cast<int64_t>(rows[d]) * S +
                                                             ch / 128] = inv;
            }
            if (a.remote_mask != 0) {
              *reinterpret_cast<uint2*>(stage + ch) = b;
              if (group_head) stage_sc[ch / 128] = inv;
            }
          }
#pragma unroll
          for (int j = 0; j + 1 < kCastUnroll; ++j) v[j] = v[j + 1];
        }
      }
      tx.send_fp8(op, rows, stage, stage_sc);  // nch == 1: this warp cast the whole row
    }
    if (c != 0) {  // the token's first chunk writes its metadata
      __syncwarp();
      continue;
    }
    // Metadata: the token index, then per k its (local expert, index) where d holds it.
    for (int d = 0; d < world; ++d) {
      if (rows[d] < 0) continue;
      bool remote = Net::remote(a.remote_mask, d);
      int32_t* meta = tx.meta_row(op, d, rows[d], remote);  // d's row, or one staged here
      if (lane == 0) Net::put_elem(meta, static_cast<int32_t>(t), d, remote);
      for (int k = lane; k < K; k += 32) {
        const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
        int32_t entry = -1;
        if (e >= 0 && e / epr == d)
          entry = static_cast<int32_t>(((e % epr) << 16) |
                                       rank_in_mask(emask + static_cast<int64_t>(e) * W, t));
        Net::put_elem(meta + 1 + k, entry, d, remote);
      }
    }
    tx.put_meta(op, rows);  // what meta_row staged
    __syncwarp();
  }
  if (!all_ok(s, Net::quiet(s.wait, a.remote_mask))) return;
  if (blockIdx.x == 0 && tid == 0) stats[kStatSent] = globaltimer_ns();
  // [L4] this block's rows for every destination are written: publish (release). Masked ranks
  // too: their done counters stay in step, so a rank masked while it kept running can be
  // unmasked.
  if (tid < world)
    Net::publish_add(u64_at(s.bases[tid], a.off_done) + me, 1, tid,
                     Net::remote(a.remote_mask, tid));
  if constexpr (kOneKernel) {
    if ((a.flags & kFlagFused) != 0) {  // no hook: the receive phase in the same kernel
      // The routing bitmaps in `dyn` are done with (the block barrier above).
      if (!await_sends_and_counts<Net>(a, s, sched, dyn)) return;
      return dispatch_unpack<Net>(a, s, dyn, sched);
    }
  }
  epilogue(a, s, sched.count);
}

// Receive phase: wait for every source's send phase, then pack the rows expert-major into the
// caller's arrays (per local expert: by source rank, then token index), with their source
// token index, route (source rank * top_k + k), per-expert counts and per-source ranges.
template <class Net>
__device__ __forceinline__ void dispatch_recv(const OpArgs& a, Shared& s, uint32_t* dyn) {
  Schedule<Net> sched(a);
  // [L5] every source finished its send phase, and [L6]'s counts.
  if (!prologue<Net>(a, s, kOpLlDispatchRecv) || !await_sends_and_counts<Net>(a, s, sched, dyn))
    return;
  dispatch_unpack<Net>(a, s, dyn, sched);
}

// [L6]-[L7] after [L5] and [L6]'s waits (await_sends_and_counts), then the op's epilogue.
template <class Net>
__device__ __forceinline__ void dispatch_unpack(const OpArgs& a, Shared& s, uint32_t* dyn,
                                                Schedule<Net>& sched) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, me = a.rank, K = a.top_k;
  const int epr = a.num_experts / world, M = a.ll_max_tokens;
  const bool block0 = blockIdx.x == 0;
  const OpSeq q = s.seq;
  const uint64_t par = (q.ll_dispatch & 1) * a.parity_stride;
  uint8_t* const local = s.bases[me];
  uint64_t* const stats = u64_at(local, a.off_stats);
  const uint64_t t_start = stats[kStatStart];  // written by the send phase (stats span both)
  // [L6] first packed row of every (local expert, source); counts and ranges (block 0), from
  // the counts CountWaits left in shared memory: prefixes there.
  int* first = reinterpret_cast<int*>(dyn);  // [epr][world]: rows, then first packed row
  if ((a.flags & kFlagMasking) != 0) {  // a source masked by any block counts no rows here
    // Load-bearing: wait_tag accepts a count whose tag is this op's before it looks at the
    // mask, so a source that stopped after [L2] but before [L4] may have left a current count;
    // only this zeroing keeps its rows (never sent, or stale) out of the packing.
    refresh_mask(a, s);
    for (int i = tid; i < (epr + 1) * world; i += kThreads) {
      const int r = i % world, l = i / world;
      if (!masked(s, r)) continue;
      if (l == epr)
        s.prefix[r] = 0;
      else
        first[i] = 0;
    }
    __syncthreads();
  }
  for (int l = tid; l < epr; l += kThreads) {
    int acc = 0;
    for (int r = 0; r < world; ++r) {
      const int n = first[l * world + r];
      first[l * world + r] = acc;
      if (block0)
        reinterpret_cast<int64_t*>(a.ll_layout_range)[l * world + r] =
            (static_cast<int64_t>(acc) << 32) | static_cast<uint32_t>(n);
      acc += n;
    }
    if (block0) {
      reinterpret_cast<int*>(a.ll_recv_count)[l] = acc;
      // One thread per local expert, stream-ordered after the previous op: a plain add.
      if (a.ll_cumulative_stats != 0) reinterpret_cast<int*>(a.ll_cumulative_stats)[l] += acc;
    }
  }
  if (tid == 0) {
    int acc = 0;
    for (int r = 0; r < world; ++r) {
      const int n = s.prefix[r];
      s.prefix[r] = acc;
      acc += n;
    }
    s.prefix[world] = acc;
  }
  __syncthreads();
  if (block0 && tid == 0) stats[kStatCountsReady] = globaltimer_ns();

  // [L7] every received row to the packed row of each of its local experts. Work items are
  // (row, run of 32-vector steps) (split_rows): the run's loads are issued first, together,
  // then the row's metadata names the destinations. Own tokens also record, per local entry,
  // their packed row (ll_self_row: a one-kernel combine reads those entries from y).
  const int row_bytes = a.row_bytes, S = a.num_scales, n16 = row_bytes / 16;
  const int total = s.prefix[world];
  const Split sp = split_rows(total, (n16 + 31) / 32, gridDim.x * kWarps, kCopyUnroll, false);
  const int nch = sp.nch;
  int32_t* self_row = reinterpret_cast<int32_t*>(a.ll_self_row);
  const bool fp8 = (a.flags & kFlagHasScales) != 0;
  const bool scales_col = (a.flags & kFlagScalesColumnMajor) != 0;
  const int64_t cap = static_cast<int64_t>(world) * M;  // rows per local expert
  const uint8_t* rx = local + a.off_ll_x + par;
  const float* rsc = reinterpret_cast<const float*>(local + a.off_ll_scales + par);
  const int32_t* rmeta = reinterpret_cast<const int32_t*>(local + a.off_ll_meta + par);
  uint8_t* out_x = reinterpret_cast<uint8_t*>(a.ll_recv_x);
  float* out_sc = reinterpret_cast<float*>(a.ll_recv_scales);
  int32_t* src_info = reinterpret_cast<int32_t*>(a.ll_src_info);
  int32_t* route = reinterpret_cast<int32_t*>(a.ll_route);
  __shared__ int64_t dst_tab[kWarps][32];
  // FP8: the offset of entry k's first scale in out_sc (-1: not mine); scale i is at
  // offset + i * scale_step (row-major: 1; per expert column-major: cap).
  __shared__ int64_t sc_tab[kWarps][32];
  const int64_t scale_step = scales_col ? cap : 1;
  const int gwarp = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * kWarps;
  for (int item = gwarp; item < total * nch; item += nwarps) {
    const int row = item / nch, c = item % nch;
    const int base = c * 32 * sp.per_item, end = min(n16, base + 32 * sp.per_item);
    int r = 0;
    while (r + 1 < world && s.prefix[r + 1] <= row) ++r;
    const int64_t slot = static_cast<int64_t>(r) * M + (row - s.prefix[r]);
    int4 v[kCopyUnroll];
    const int4* src = reinterpret_cast<const int4*>(rx + slot * row_bytes);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < end) v[u] = ld_v4(src + i);
    }
    const int32_t* meta = rmeta + slot * (K + 1);
    const int32_t t = meta[0];
    int64_t* dst = dst_tab[warp];
    int64_t* sco = sc_tab[warp];
    for (int k0 = 0; k0 < K; k0 += 32) {
      // dst[i]: the packed row of entry k0 + i (-1: not one of my experts).
      const int nk = min(32, K - k0);
      if (lane < nk) {
        const int32_t e = meta[1 + k0 + lane];
        int64_t d = -1, so = -1;
        if (e >= 0) {
          const int l = e >> 16, i = e & 0xffff;
          const int64_t prow = first[l * world + r] + i;  // row within expert l
          d = static_cast<int64_t>(l) * cap + prow;
          // Row-major [l][row][S], or per expert column-major [l][S][row].
          so = scales_col ? static_cast<int64_t>(l) * S * cap + prow : d * S;
          if (c == 0) {
            src_info[d] = t;
            route[d] = r * K + k0 + lane;
            if (r == me) self_row[static_cast<int64_t>(t) * K + k0 + lane] = static_cast<int32_t>(d);
          }
        }
        dst[lane] = d;
        sco[lane] = so;
      }
      __syncwarp();
      for (int k = 0; k < nk; ++k)
        if (dst[k] >= 0)
          store_step(reinterpret_cast<int4*>(out_x + dst[k] * row_bytes), v, base, end, lane);
      if (fp8 && c == 0)
        for (int i = lane; i < S; i += 32) {
          const float sc = rsc[slot * S + i];
          for (int k = 0; k < nk; ++k)
            if (sco[k] >= 0) out_sc[sco[k] + i * scale_step] = sc;
        }
      __syncwarp();
    }
  }
  if (block0) finish_stats(a, s, t_start, kOpLlDispatchRecv);
  epilogue(a, s, sched.count);
}

}  // namespace epcomm::ll
