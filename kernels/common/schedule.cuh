// Schedules: when the ranks of an op synchronise with each other (docs/architecture.md,
// "Barrier strategies").
//  * Epoch: never; every wait is for the data or counter it needs.
//  * Global: DeepEP-V1's all-rank barriers at the points the kernels mark [G*].
// A run-time switch (OpArgs::global_barriers) rather than a template parameter: a template
// would double every kernel of every image for a branch taken once per barrier point.
#pragma once
#include "common/seq.cuh"
#include "common/stats.cuh"

namespace epcomm {

template <class Net>
struct Schedule {
  bool global;     // Global when true, Epoch otherwise
  uint64_t count;  // barriers passed so far in this op

  __device__ __forceinline__ explicit Schedule(const OpArgs& a)
      : global(a.global_barriers != 0), count(0) {}

  // A barrier point [G*]: under Global, every block of every rank arrives before any leaves;
  // under Epoch, nothing. False when the op must stop (block-uniform).
  __device__ __forceinline__ bool barrier(const OpArgs& a, OpState& s) {
    return !global || rank_barrier(a, s, ++count);
  }

  // Round-aware all-rank barrier over every block of every rank. Monotonic counters: barrier k
  // of this op completes when every peer's counter reached barrier_base + k * gridDim.x. Never
  // reset, so no cleaning and no add-then-reset race.
  __device__ static bool rank_barrier(const OpArgs& a, OpState& s, uint64_t k) {
    if (!all_ok(s, Net::quiet(s.wait, a.remote_mask))) return false;
    const int tid = threadIdx.x;
    bool ok = true;
    if (tid < a.world) {
      Net::publish_add(u64_at(s.bases[tid], a.off_barrier) + a.rank, 1, peer_pe(s.wait, tid),
                       Net::remote(a.remote_mask, tid));
      uint64_t arrived = 0;
      ok = wait_geq<Net>(s.wait, u64_at(s.bases[a.rank], a.off_barrier) + tid,
                         s.seq.barrier_base + k * gridDim.x, kWaitBarrier, tid, &arrived);
      // Block 0 records when each peer reached the barrier: where Global waits for late ranks.
      if (ok && blockIdx.x == 0)
        u64_at(s.bases[a.rank], a.off_stats)[kStatPeers + a.world + tid] = arrived;
    }
    return all_ok(s, ok);
  }
};

}  // namespace epcomm
