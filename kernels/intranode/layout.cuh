// The layout kernel: where each token goes. Net-independent (it writes only local memory).
#pragma once
#include "common/abi.cuh"
#include "common/net.cuh"
#include "common/wait.cuh"
#include "intranode/shared.cuh"

namespace epcomm::intranode {

constexpr int kHistChunk = 4096;  // experts per histogram block (HIST_CHUNK in Rust)

// Blocks [0, world) scan tokens for one rank each (slot = exclusive prefix of the tokens sent
// there, deterministic), blocks [world, world + nodes) do the same per node (writing the
// slots too when `token_node_slot` is given: rail forwarding), and the remaining
// blocks build the per-expert histogram in chunks of kHistChunk experts. The first histogram
// block also validates every top-k id and writes `status`.
//
// With `in_rank` the routing is given instead of computed: a token goes to rank g where
// in_rank[t][g] is nonzero (to a node where it goes to one of its ranks), and the per-expert
// counts are `expert_counts`, copied.
__device__ __forceinline__ void layout(const LayoutArgs& a) {
  __shared__ int s_warp[kWarps];
  __shared__ uint32_t s_hist[kHistChunk];
  __shared__ int s_invalid;
  __shared__ WaitCtx s_wait;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int world = a.world, nodes = world / a.gpus_per_node, E = a.num_experts;
  const int T = a.num_tokens_ptr == 0
                    ? a.num_tokens
                    : min(a.num_tokens, *reinterpret_cast<const int32_t*>(a.num_tokens_ptr));
  const int K = a.top_k, epr = E / world;
  const int64_t* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const uint8_t* in_rank = reinterpret_cast<const uint8_t*>(a.in_rank);
  uint32_t* counts = reinterpret_cast<uint32_t*>(a.counts);
  const int b = blockIdx.x;

  if (b < world + nodes) {
    const bool is_rank = b < world;
    const int g = is_rank ? b : b - world;
    const int64_t width = is_rank ? epr : static_cast<int64_t>(epr) * a.gpus_per_node;
    const int64_t lo = g * width, hi = lo + width;
    int32_t* slots = reinterpret_cast<int32_t*>(a.token_slot);
    int32_t* node_slots = reinterpret_cast<int32_t*>(a.token_node_slot);
    int base = 0;
    for (int t0 = 0; t0 < T; t0 += kThreads) {
      const int t = t0 + tid;
      int flag = 0;
      if (t < T && in_rank != nullptr) {
        const int64_t row = static_cast<int64_t>(t) * world;
        if (is_rank) {
          flag = in_rank[row + g] != 0 ? 1 : 0;
        } else {
          for (int r = g * a.gpus_per_node; r < (g + 1) * a.gpus_per_node; ++r)
            flag |= in_rank[row + r] != 0 ? 1 : 0;
        }
      } else if (t < T)
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
      if (!is_rank && t < T && node_slots != nullptr)
        node_slots[static_cast<int64_t>(t) * nodes + g] = flag ? base + warp_base + incl - flag : -1;
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
  if (tid == 0) {
    s_invalid = 0;
    // No peers here (null bases and abort word): the next op's prologue tells them.
    WaitCtx& w = s_wait;
    w.record = reinterpret_cast<ErrorRecord*>(a.err_record);
    w.claim = reinterpret_cast<uint32_t*>(a.err_claim);
    w.timeout_ns = 0;
    w.epoch = 0;
    w.op = kOpLayout;
    w.rank = a.rank;
    w.abort_word = nullptr;
    w.bases = nullptr;
    w.abort_off = 0;
    w.remote_mask = 0;
    w.world = 0;
    // World ranks in the record (the group's mapping, as in OpArgs).
    w.pe_base = a.pe_base;
    w.pe_stride = a.pe_stride;
    w.intent_off = 0;  // no peers, no op agreement
    w.intent = 0;
  }
  __syncthreads();
  if (in_rank != nullptr) {
    // Given counts are only reported back (the receivers' per-expert counts), never used as
    // sizes or offsets: copied as they are.
    const uint32_t* given = reinterpret_cast<const uint32_t*>(a.expert_counts);
    for (int i = tid; i < n; i += kThreads) counts[world + lo + i] = given[lo + i];
    if (chunk == 0 && tid == 0) *reinterpret_cast<uint32_t*>(a.status) = 0;
    return;
  }
  const int64_t total = static_cast<int64_t>(T) * K;
  for (int64_t i = tid; i < total; i += kThreads) {
    const int64_t v = idx[i];
    if (v >= lo && v < lo + n) atomicAdd(&s_hist[v - lo], 1u);
    if (chunk == 0 && (v < -1 || v >= E)) {
      s_invalid = 1;
      // peer = token index, expected = num_experts, seen = the offending id.
      record_failure<StoreNet>(s_wait, kInvalidExpert, kWaitNone, static_cast<int32_t>(i / K),
                     static_cast<uint64_t>(E), static_cast<uint64_t>(v), 0);
    }
  }
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) counts[world + lo + i] = s_hist[i];
  if (chunk == 0 && tid == 0) *reinterpret_cast<uint32_t*>(a.status) = s_invalid;
}

}  // namespace epcomm::intranode
