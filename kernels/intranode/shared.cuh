// What every intranode kernel shares: the launch shape and the block's shared state.
//
// Intranode = one NVLink domain (docs/architecture.md). Memory: every rank owns one symmetric
// buffer; peers write into it through a mapping (CUDA IPC, `nvshmem_ptr`) or, for the peers
// the Net policy routes through the transport, with put/signal (common/net.cuh).
//  * dispatch writes each token straight into its final row of every destination's receive
//    region (rows ordered by source rank, then source token index), so the receiver's output
//    is the region itself: no receiver-side copy;
//  * combine pushes each received row back into the owner's combine region at
//    [sender][token], and the owner reduces in rank order (fp32, deterministic).
// Nothing is ever cleaned: counts are epoch-tagged, completion counters are monotonic, and the
// receive regions alternate by parity (a rank is at most one op ahead of any peer).
// Protocol: docs/protocol.md (step labels [E1]..[E8], [C1]..[C5], [P1]..[P2], [G1]..[G5] are
// cited in the bodies).
#pragma once
#include "common/abi.cuh"
#include "common/seq.cuh"

namespace epcomm::intranode {

constexpr int kThreads = 512;  // every intranode kernel (IntranodeKernels::THREADS in Rust)
constexpr int kWarps = kThreads / 32;

// One block's shared state: the op state (sequence, wait context, bases) and the tables of
// dispatch and combine.
struct Shared : OpState {
  int offsets[kMaxWorld + 1];
  int rows[kWarps][kMaxWorld];
  uint32_t counts[kMaxWorld * kMaxWorld];
};

}  // namespace epcomm::intranode
