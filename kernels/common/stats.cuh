// The stats block: per-op timing words in this rank's symmetric buffer (local u64 words at
// OpArgs::off_stats), read by `Buffer::last_op_stats`. Times are this GPU's %globaltimer.
#pragma once
#include "common/seq.cuh"

namespace epcomm {

// The word indices (kStat*) are part of the ABI: common/abi.cuh (mirrored in Rust as
// `epcomm_abi::STAT_*`).

// Block 0 of an op that succeeded: which op, when it started and ended.
__device__ __forceinline__ void finish_stats(const OpArgs& a, OpState& s, uint64_t t_start,
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

}  // namespace epcomm
