// Structures shared bit-for-bit with Rust (`epcomm-kernels/src/abi.rs`). Any change here must be
// mirrored there; `epcomm_abi_probe` lets the host verify sizes and offsets at load time.
#pragma once
#include <cstddef>
#include <cstdint>

namespace epcomm {

// Largest world an intranode kernel supports (bounded by shared-memory tables).
constexpr int kMaxWorld = 64;

enum ErrorCode : uint32_t {
  kOk = 0,
  kTimeout = 1,
  kOverflow = 2,
  kInvalidExpert = 3,
  kPeerFailed = 4,  // a peer failed first: peer = origin rank, expected = its code,
                    // seen = its op sequence number (low 32 bits)
};

enum OpKind : uint32_t {
  kOpLayout = 1,
  kOpDispatch = 2,
  kOpCachedDispatch = 3,
  kOpCombine = 4,
};

// Which wait expired (see docs/protocol.md for the step labels).
enum WaitId : uint32_t {
  kWaitNone = 0,
  kWaitCountRow = 1,     // [E2] a peer's count row for this epoch
  kWaitExpertCounts = 2, // [E2] a peer's per-expert counts for this epoch
  kWaitDispatchDone = 3, // [E6] a peer's dispatch data landed
  kWaitCombineDone = 4,  // [C3] a peer's combine contributions landed
  kWaitBarrier = 5,      // [G*] a Global-strategy barrier
  kWaitOpStart = 6,      // the op's prologue (a peer's failure was already known)
};

// Byte offsets inside the stats region (per rank, symmetric): [world] "my y is ready" words of
// the in-place combine, then the abort word that failing peers write.
constexpr uint64_t kStatsReadyOffset = 3072;
constexpr uint64_t kStatsAbortOffset = 3584;

// Written once per failure into host-mapped memory (first failing thread wins). Kernels never
// trap: they record, then leave.
struct ErrorRecord {
  uint32_t code;
  uint32_t op;
  uint32_t wait_id;
  int32_t peer;
  uint32_t block;
  uint32_t rank;
  uint64_t epoch;
  uint64_t expected;
  uint64_t seen;
  uint64_t waited_ns;
};

enum OpFlags : uint32_t {
  kFlagCached = 1u << 0,       // cached dispatch: no count exchange, offsets from the handle
  kFlagHasScales = 1u << 1,    // FP8 dispatch: per-128-channel f32 scales travel with x
  kFlagHasWeights = 1u << 2,   // top-k weights travel (dispatch) / are reduced (combine)
  kFlagHasTopk = 1u << 3,      // top-k ids travel (dispatch)
  kFlagInPlace = 1u << 4,      // combine: y is the latest dispatch's receive region; pull it
};

// Arguments of the dispatch and combine kernels. All addresses are device addresses (u64).
struct OpArgs {
  // Caller inputs/outputs (local device memory).
  uint64_t x;             // dispatch: [T][row_bytes]; combine: y [R][hidden] bf16
  uint64_t x_scales;      // dispatch FP8: [T][num_scales] f32
  uint64_t topk_idx;      // dispatch: [T][K] i64
  uint64_t topk_weights;  // dispatch: [T][K] f32; combine: y weights [R][K] f32
  uint64_t out;           // combine: [T][hidden] bf16
  uint64_t out_weights;   // combine: [T][K] f32
  // Layout (device memory written by the layout kernel).
  uint64_t token_slot;    // [T][world] i32, -1 = not sent there
  uint64_t layout_counts; // [world] tokens per rank, then [E] tokens per expert (u32)
  uint64_t layout_status; // u32: nonzero when the layout kernel rejected its input
  // Handle (device memory owned by the host handle).
  uint64_t send_offsets;  // [world] i32: first row of my tokens in each destination
  uint64_t recv_prefix;   // [world + 1] i32: first row received from each source
  uint64_t recv_src_idx;  // [max_recv] i32: source token index of each received row
  uint64_t recv_expert_counts; // [experts_per_rank] i32
  // Symmetric buffer.
  uint64_t peer_bases;    // [world] u64: base of every rank's symmetric buffer (mine included)
  uint64_t off_x, off_scales, off_topk_idx, off_topk_w, off_src_idx;  // dispatch region (parity)
  uint64_t off_comb_x, off_comb_w;                                     // combine region (parity)
  uint64_t off_comb_flags;     // [world][chunks] monotonic u64: last combine whose chunk landed
  uint64_t off_counts;         // [world][world] tagged u64 (notify parity)
  uint64_t off_expert_counts;  // [world][experts_per_rank] tagged u64 (notify parity)
  uint64_t off_done;           // [world] monotonic u64
  uint64_t off_barrier;        // [world] monotonic u64
  uint64_t off_stats;          // stats block (local only)
  // Failure reporting.
  uint64_t err_claim;          // device u32, claimed by the first failing thread
  uint64_t err_record;         // host-mapped ErrorRecord
  uint64_t host_counts;        // host-mapped: [0] tag, [1] recv rows, [2..] per local expert
  // Sequencing: read from device memory so that a captured CUDA graph replays correctly.
  uint64_t timeout_ns;
  uint64_t seq_state;          // SeqState (local device memory), advanced by each op's last block
  uint64_t parity_stride;      // bytes between the two copies of every per-parity region
  uint64_t remote_mask;        // bit d: rank d is reached with transport put/signal (NVSHMEM
                               // variant only; peer_bases[d] is then this rank's own base)
  uint64_t abort_word;         // this rank's abort word (stats region + kStatsAbortOffset)
  int32_t num_tokens;
  int32_t hidden;              // elements per row
  int32_t row_bytes;           // bytes per x row (hidden * elem size)
  int32_t num_scales;          // f32 scales per row (FP8)
  int32_t top_k;
  int32_t num_experts;
  int32_t world;
  int32_t rank;
  int32_t max_tokens;          // per-rank token capacity of the buffer
  int32_t max_recv_rows;       // receive capacity (buffer or Bounded(n))
  uint32_t flags;
  uint32_t global_barriers;    // 1: Global strategy (DeepEP-equivalent barriers)
};

// Op sequence numbers kept on the device. Every rank issues the same ops, so every rank's copy
// holds the same values. The last block of each op advances it (stream order makes the next op
// see the new values), so kernel arguments never carry per-op values: graph replays just work.
struct SeqState {
  uint64_t op;        // ops so far
  uint64_t notify;    // count exchanges so far (the count tag)
  uint64_t dispatch;  // dispatches so far, cached ones included (receive-region parity)
  uint64_t combine;   // combines so far (combine-region parity, chunk-flag value)
  uint64_t done;      // every done[src] counter's value after the last op
  uint64_t barriers;  // every barrier[src] counter's value after the last op
  uint32_t exits;     // blocks of the running op that finished
  uint32_t pad;
};

struct LayoutArgs {
  uint64_t topk_idx;       // [T][K] i64
  uint64_t counts;         // out: [world] per rank, [E] per expert, [nodes] per node (u32)
  uint64_t token_slot;     // out: [T][world] i32
  uint64_t status;         // out: u32, 0 = ok
  uint64_t err_record;     // host-mapped ErrorRecord
  uint64_t err_claim;      // device u32
  int32_t num_tokens;
  int32_t top_k;
  int32_t num_experts;
  int32_t world;
  int32_t gpus_per_node;
  int32_t rank;
};

}  // namespace epcomm
