// What every low-latency kernel shares: the launch shape, the block's shared state and the
// helpers of the routing bitmaps.
//
// Low-latency mode (docs/low-latency.md) moves decode-sized batches with no count round trip
// and no host read: each op is a send phase and a receive phase, two kernels, so a caller can
// run other work between them (a "hook"). Memory, per LL parity (the LL op's sequence number
// % 2), in every rank's symmetric buffer:
//  * dispatch rows [source][slot]: a source writes each token once per destination rank, at
//    slot = the token's index among the source's tokens for that rank, with a metadata row
//    (token index; per k: local expert << 16 | index among the source's tokens for that
//    expert, or -1) and, per destination, tagged counts (rows; rows per local expert);
//  * combine rows [token][k]: the rank holding expert topk_idx[t][k] writes its output for
//    token t there, on the token's source rank.
// The receive phase of a dispatch packs the rows expert-major into caller memory, in a fixed
// order (source rank, then token index, then k): the same input gives the same output bits.
// Nothing is cleaned: counts are tagged with the LL sequence number, completion uses the same
// monotonic done counters as every other op, and a rank is at most one op ahead of a peer.
// Step labels [L1]..[L9] are those of docs/protocol.md.
#pragma once
#include "common/abi.cuh"
#include "common/schedule.cuh"
#include "common/seq.cuh"
#include "common/stats.cuh"
#include "common/wait.cuh"

namespace epcomm::ll {

constexpr int kThreads = 512;  // every low-latency kernel (IntranodeKernels::THREADS in Rust)
constexpr int kWarps = kThreads / 32;

// One block's shared state. The routing tables whose size depends on the shape live in
// dynamic shared memory (OpArgs::ll_smem_words u32 words).
struct Shared : OpState {
  int prefix[kMaxWorld + 1];  // first received row of every source (dispatch receive)
  int warp_sum[kWarps];       // block_prefix's per-warp totals
};

// out[i] = in[0] + ... + in[i - 1] for i <= n (out[n]: the total), `in` in global memory, `out`
// in shared memory. Every thread of the block calls it; each loads its own few entries (all
// loads of the block in flight together), then a warp scan and one across the warps. Ends with
// __syncthreads: `out` is then complete for every thread.
__device__ __forceinline__ void block_prefix(const int* in, int n, int* out, int* warp_sum) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int sum = 0;
  for (int i = lo; i < hi; ++i) {
    out[i] = in[i];
    sum += out[i];
  }
  int incl = sum;  // inclusive scan of the threads' sums within the warp
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  int acc = incl - sum;
  for (int w = 0; w < warp; ++w) acc += warp_sum[w];
  for (int i = lo; i < hi; ++i) {
    const int c = out[i];
    out[i] = acc;
    acc += c;
  }
  if (tid == kThreads - 1) out[n] = acc;  // the last thread's running sum is the total
  __syncthreads();
}

// How work of `rows` rows of `steps` steps each is cut into items for `nwarps` warps: every
// item is a run of up to `max_per_item` steps of one row, as few steps per item as keep every
// warp busy (a small batch spreads over all warps, a large one keeps `max_per_item` loads in
// flight per lane). `whole` (rows that travel through the transport, one put each) makes every
// row one item.
struct Split {
  int per_item;  // steps per item
  int nch;       // items per row
};
__device__ __forceinline__ Split split_rows(int rows, int steps, int nwarps, int max_per_item,
                                            bool whole) {
  if (whole || steps <= 0) return {max(steps, 1), 1};
  const int64_t total = static_cast<int64_t>(rows) * steps;
  const int64_t want = (total + nwarps - 1) / nwarps;  // steps per warp
  const int per = want < 1 ? 1 : want > max_per_item ? max_per_item : static_cast<int>(want);
  return {per, (steps + per - 1) / per};
}

// Index of token t among the tokens whose bit is set in `mask` (bits below t).
__device__ __forceinline__ int rank_in_mask(const uint32_t* mask, int t) {
  int n = 0;
  for (int w = 0; w < t / 32; ++w) n += __popc(mask[w]);
  return n + __popc(mask[t / 32] & ((1u << (t % 32)) - 1u));
}

__device__ __forceinline__ bool bit_of(const uint32_t* mask, int t) {
  return (mask[t / 32] >> (t % 32)) & 1u;
}

// Smallest power of two >= x (x a positive normal float): UE8M0 scales.
__device__ __forceinline__ float pow2_ceil(float x) {
  uint32_t b = __float_as_uint(x);
  if ((b & 0x7fffffu) != 0u) b = (b & 0xff800000u) + 0x800000u;
  return __uint_as_float(b);
}

// No wait of its own beside await_sends' (see there).
struct NoSideWait {
  __device__ __forceinline__ bool operator()(int, int) const { return true; }
};

// [G2] then [L5]: every peer's send phase of this op is done (monotonic done counters; block
// 0 records when each peer's arrived, for the stats). False (block-uniform) when the op must
// stop. A fused send kernel (kFlagFused) calls it right after its own [L4].
// `side(i, stride)` runs meanwhile on the threads of the warps past the first
// ceil(world / 32) (thread i of `stride`), for waits whose words are self-validating (tagged,
// and landing whole: Net::kWholeWords) and so need not follow the done counters: their
// latency then overlaps the done waits instead of following them. It returns false when the
// op must stop; its writes to shared memory are complete for every thread on return.
template <class Net, class Side = NoSideWait>
__device__ __forceinline__ bool await_sends(const OpArgs& a, Shared& s, Schedule<Net>& sched,
                                            uint32_t wait_id, Side side = Side{}) {
  if (!sched.barrier(a, s)) return false;  // [G2]
  bool ok = true;
  const int tid = threadIdx.x;
  const int side_base = (a.world + 31) / 32 * 32;
  if (tid < a.world) {
    uint8_t* const local = s.bases[a.rank];
    const bool block0 = blockIdx.x == 0;
    // [A2] once per op, in block 0 (every block waits for the same counters); the intent
    // word's load overlaps the wait.
    const uint64_t intent = block0 ? peek_intent(s.wait, tid) : 0;
    uint64_t arrived = 0;
    ok = wait_geq<Net>(s.wait, u64_at(local, a.off_done) + tid, s.seq.done_expected, wait_id,
                       tid, &arrived);
    if (ok && block0) u64_at(local, a.off_stats)[kStatPeers + 2 * a.world + tid] = arrived;
    ok = ok && (!block0 || check_intent<Net>(s.wait, tid, intent));
  } else if (tid >= side_base) {
    ok = side(tid - side_base, kThreads - side_base);
  }
  if (!all_ok(s, ok)) return false;
  refresh_mask(a, s);  // peers masked by these waits (any block's)
  return true;
}

// Masking: true when this block saw group rank `d` masked (s.wait.masked; 0 without masking).
__device__ __forceinline__ bool masked(const OpState& s, int d) {
  return static_cast<unsigned>(d) < kMaxWorld && ((s.wait.masked >> d) & 1u) != 0;
}

}  // namespace epcomm::ll
