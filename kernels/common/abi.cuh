// The kernel ABI: every structure and number shared bit-for-bit with the Rust side. This header
// is the single source: `cargo xtask codegen` parses it and writes the Rust mirror
// (crates/epcomm-abi/src/abi_generated.rs) and the device probe (common/abi_probe.cuh),
// which the host runs at module load to compare every size, offset and constant below with its
// own; `cargo xtask codegen --check` fails when either generated file is stale.
//
// Because a program reads it, the header keeps to a small format:
//  * `/// text` lines document the item that follows (they become its Rust doc);
//  * `///< text` documents the member on the same line; a `///<` line of its own continues it;
//  * `constexpr <type> kName = <integer>;` becomes `pub const NAME: <type>`;
//  * `enum Name : uint32_t {  // rust: mod <module>, strip <prefix>` becomes `pub mod <module>`
//    with one `pub const` per `kPrefixName = <integer or 1u << n>,` (the prefix dropped) and
//    `ALL`, every value in header order;
//  * `struct Name {` holds one `<type> <name>;` per line; a plain `//` line inside it is a
//    group heading, kept as a comment in Rust;
//  * types: uint64_t (u64), uint32_t (u32), int32_t (i32), size_t (usize); other `//` comments
//    and the namespace lines are ignored.
#pragma once
#include <cstddef>
#include <cstdint>

namespace epcomm {

/// Version of the kernel protocol and argument blocks; ranks compare it when a `Buffer` is
/// built. Bump it with any change of this header or of the kernels' cross-rank protocol.
constexpr uint64_t kAbiVersion = 20;

/// Largest world size the intranode kernels support (shared-memory tables are this large).
constexpr size_t kMaxWorld = 64;

/// Most slots of a rail-forwarding ring (`OpArgs::ring_slots`).
constexpr int32_t kMaxRingSlots = 8;

/// Failure codes written by kernels into `ErrorRecord::code`.
enum ErrorCode : uint32_t {  // rust: mod code, strip k
  kOk = 0,             ///< No failure.
  kTimeout = 1,        ///< A bounded wait expired.
  kOverflow = 2,       ///< The receive count exceeds the capacity (buffer or `Bounded(n)`).
  kInvalidExpert = 3,  ///< A top-k id outside `[-1, num_experts)`.
  kPeerFailed = 4,     ///< A peer failed first: `peer` = origin rank, `expected` = its code
                       ///< (low 32 bits) and the rank it waited for + 1 (high 32 bits; 0:
                       ///< none), `seen` = its op sequence number (low 16 bits).
  kDuplicateExpert = 5,  ///< Low-latency dispatch: a token names one expert twice (`peer` =
                         ///< token index, `seen` = the expert id).
  kOpMismatch = 6,  ///< A peer issued another op, or this op with other arguments ([A2]): `peer`
                    ///< = that peer, `expected` = this rank's intent word, `seen` = the peer's.
                    ///< Its abort word's code carries the fields that differ in bits 8..15
                    ///< (bit 0: op kind; bits 1..5: the op-flag bits of kIntentFlagMask; bit 6:
                    ///< row bytes).
};

/// Which operation a kernel was running (`ErrorRecord::op`, stats kind).
enum OpKind : uint32_t {  // rust: mod op, strip kOp
  kOpLayout = 1,          ///< The layout kernel.
  kOpDispatch = 2,        ///< Dispatch with count exchange.
  kOpCachedDispatch = 3,  ///< Dispatch reusing a handle's routing.
  kOpCombine = 4,         ///< Combine.
  kOpLlDispatch = 5,      ///< Low-latency dispatch, send phase.
  kOpLlDispatchRecv = 6,  ///< Low-latency dispatch, receive phase.
  kOpLlCombine = 7,       ///< Low-latency combine, send phase.
  kOpLlCombineRecv = 8,   ///< Low-latency combine, receive phase.
};

/// Which wait expired (`ErrorRecord::wait_id`); labels refer to docs/protocol.md.
enum WaitId : uint32_t {  // rust: mod wait, strip kWait
  kWaitNone = 0,          ///< Not a wait (overflow, invalid input).
  kWaitCountRow = 1,      ///< [E2] a peer's count row for this epoch.
  kWaitExpertCounts = 2,  ///< [E2] a peer's per-expert counts for this epoch.
  kWaitDispatchDone = 3,  ///< [E6] a peer's dispatch data landing.
  kWaitCombineDone = 4,   ///< [C3] a peer's combine contributions landing.
  kWaitBarrier = 5,       ///< [G*] a Global-strategy barrier.
  kWaitOpStart = 6,       ///< The op's prologue: a peer's failure was known before the op started.
  kWaitLlDispatch = 7,    ///< [L5]/[L6] a peer's low-latency dispatch rows and counts.
  kWaitLlCombine = 8,     ///< [L5] before [L9]: a peer's low-latency combine rows.
  kWaitProxy = 9,         ///< [P2] the CPU proxy completing this rank's puts (or a free ring slot).
  kWaitIntent = 10,       ///< [A2] a peer's intent word for this op (after the op's last wait).
  kWaitRingFree = 11,     ///< [I6c] a rail peer's forwarder freeing a ring slot (rail forwarding).
  kWaitRingChunk = 12,    ///< [I8c] a rail source's chunk landing in this rank's ring.
};

/// Byte offset, inside the stats region, of the in-place combine's `[world]` ready words.
constexpr uint64_t kStatsReadyOffset = 3072;
/// Byte offset, inside the stats region, of the intent words ([A1]): [2][kMaxWorld] u64, by op
/// sequence parity, [source rank] within a parity.
constexpr uint64_t kStatsIntentOffset = 2048;
/// Byte offset, inside the stats region, of the abort word failing peers write.
constexpr uint64_t kStatsAbortOffset = 3584;
/// Byte offset, inside the stats region, of the rank mask of the low-latency ops
/// ([kMaxWorld] u32 by group rank: 1 = masked, skipped by every op with kFlagMasking; set by
/// such an op whose wait for that peer expired, and by the host).
constexpr uint64_t kStatsMaskOffset = 3840;

/// Stats word: the op's sequence number (`SeqState::op`). The stats block is u64 words at
/// `OpArgs::off_stats`, local to this rank, indexed by the kStat* constants: the op kernels
/// fill it (common/stats.cuh), `Buffer::last_op_stats` reads it; times are this GPU's
/// %globaltimer.
constexpr int32_t kStatOpSeq = 0;
/// Stats word: when the op started.
constexpr int32_t kStatStart = 1;
/// Stats word: when the count exchange was done (dispatch; also stamped by the low-latency
/// dispatch's receive phase).
constexpr int32_t kStatCountsReady = 2;
/// Stats word: when this rank's sends were done.
constexpr int32_t kStatSent = 3;
/// Stats word: when the op ended.
constexpr int32_t kStatEnd = 4;
/// Stats word: the op's kind (one of `op`).
constexpr int32_t kStatKind = 5;
/// Stats word: the ranks of the op (the buffer's group).
constexpr int32_t kStatWorld = 6;
/// First of the stats block's [3][world] per-peer words: [world] unused, [world] count-row (or
/// barrier) arrivals, [world] data-landed arrivals (this GPU's clock only). Word 7 is unused.
constexpr int32_t kStatPeers = 8;

/// Failure record written by the first failing device thread into host-mapped memory. Kernels
/// never trap: they record, then leave.
struct ErrorRecord {
  uint32_t code;       ///< One of `code`.
  uint32_t op;         ///< One of `op`.
  uint32_t wait_id;    ///< One of `wait`.
  int32_t peer;        ///< The peer waited for (timeout), destination (overflow) or token index
                       ///< (invalid input).
  uint32_t block;      ///< Block that failed.
  uint32_t rank;       ///< Rank that failed.
  uint64_t epoch;      ///< Op sequence number.
  uint64_t expected;   ///< Value waited for / capacity / number of experts.
  uint64_t seen;       ///< Value last seen / requested / offending id.
  uint64_t waited_ns;  ///< Time spent waiting.
};

/// Bits of `OpArgs::flags`.
enum OpFlags : uint32_t {  // rust: mod flags, strip kFlag
  kFlagCached = 1u << 0,      ///< Cached dispatch: no count exchange; offsets come from the handle.
  kFlagHasScales = 1u << 1,   ///< FP8 dispatch: per-128-channel f32 scales travel with x.
  kFlagHasWeights = 1u << 2,  ///< Top-k weights travel (dispatch) or are reduced (combine).
  kFlagHasTopk = 1u << 3,     ///< Top-k ids travel (dispatch).
  kFlagInPlace = 1u << 4,     ///< Combine pulls y from every rank's latest dispatch receive region.
  kFlagRoundScale = 1u << 5,  ///< Low-latency FP8 dispatch: scales rounded up to powers of two.
  kFlagFused = 1u << 6,       ///< Low-latency send kernel also runs the receive phase (no hook).
  kFlagRecvPhase = 1u << 7,   ///< Low-latency kernel: run the receive phase only (the hook).
  kFlagMasking = 1u << 8,     ///< Low-latency op: masked peers are skipped, and a peer whose wait
                              ///< expires is masked instead of failing the op (kStatsMaskOffset).
  kFlagScalesColumnMajor = 1u << 9,  ///< Low-latency FP8 dispatch: ll_recv_scales is
                                     ///< [epr][num_scales][world * ll_max_tokens] (each local
                                     ///< expert's scales column-major, DeepEP's layout).
  kFlagForward = 1u << 10,   ///< Dispatch: rows for another node's ranks go once per node, through
                             ///< the ring of the rail peer there, which stores them (rail forwarding).
};

/// An op's intent word ([A1], docs/protocol.md "Op agreement"): (op sequence number, low 32
/// bits) << 32 | op kind << kIntentKindShift | (`flags` & kIntentFlagMask) << kIntentFlagShift |
/// row bytes folded to 20 bits (kIntentRowMask). Ranks compare it per peer and op.
constexpr uint32_t kIntentKindShift = 28;
/// Shift of the flag bits in an intent word.
constexpr uint32_t kIntentFlagShift = 20;
/// The `flags` bits ranks must agree on: scales (FP8), weights, top-k ids, in place (staged or
/// pulled combine vs pushed), rounded scales.
constexpr uint32_t kIntentFlagMask = 62;
/// The row-bytes bits of an intent word.
constexpr uint32_t kIntentRowMask = 1048575;

/// Arguments of `epcomm_dispatch` and `epcomm_combine`. All addresses are device addresses.
struct OpArgs {
  // Caller inputs/outputs (local device memory).
  uint64_t x;             ///< Dispatch: [T][row_bytes]; combine: y [R][hidden] bf16.
  uint64_t x_scales;      ///< Dispatch FP8: [T][num_scales] f32.
  uint64_t topk_idx;      ///< Dispatch: [T][K] i64.
  uint64_t topk_weights;  ///< Dispatch: [T][K] f32; combine: y weights [R][K] f32.
  uint64_t out;           ///< Combine: [T][hidden] bf16.
  uint64_t out_weights;   ///< Combine: [T][K] f32.
  // Layout (device memory written by the layout kernel).
  uint64_t token_slot;     ///< [T][world] i32, -1 = not sent there.
  uint64_t layout_counts;  ///< [world] tokens per rank, then [E] tokens per expert (u32).
  uint64_t layout_status;  ///< u32: nonzero when the layout kernel rejected its input.
  // Handle (device memory owned by the host handle).
  uint64_t send_offsets;        ///< [world] i32: first row of my tokens in each destination.
  uint64_t recv_prefix;         ///< [world + 1] i32: first row received from each source.
  uint64_t recv_src_idx;        ///< [max_recv] i32: source token index of each received row.
  uint64_t recv_expert_counts;  ///< [experts_per_rank] i32.
  // Symmetric buffer.
  uint64_t peer_bases;         ///< [world] u64: base of every rank's symmetric buffer (mine too).
  uint64_t off_x;              ///< Dispatch region (per parity): x rows.
  uint64_t off_scales;         ///< Dispatch region (per parity): FP8 scales.
  uint64_t off_topk_idx;       ///< Dispatch region (per parity): top-k ids.
  uint64_t off_topk_w;         ///< Dispatch region (per parity): top-k weights.
  uint64_t off_src_idx;        ///< Dispatch region (per parity): source token indices.
  uint64_t off_comb_x;         ///< Combine region (per parity): rows, [sender][token].
  uint64_t off_comb_w;         ///< Combine region (per parity): weights, [sender][token].
  uint64_t off_comb_flags;     ///< [world][max_tokens] monotonic u64: last combine whose row
                               ///< landed.
  uint64_t off_counts;         ///< [world][world] tagged u64 (notify parity).
  uint64_t off_expert_counts;  ///< [world][experts_per_rank] tagged u64 (notify parity).
  uint64_t off_done;           ///< [world] monotonic u64.
  uint64_t off_barrier;        ///< [world] monotonic u64.
  uint64_t off_stats;          ///< Stats block (local only).
  // Failure reporting.
  uint64_t err_claim;    ///< Device u32, claimed by the first failing thread.
  uint64_t err_record;   ///< Host-mapped ErrorRecord.
  uint64_t host_counts;  ///< Host-mapped: [0] tag, [1] recv rows, [2, 2 + E) per local expert,
                         ///< [2 + E] first row from this rank, [3 + E] rows from this rank.
  // Sequencing: read from device memory so that a captured CUDA graph replays correctly.
  uint64_t timeout_ns;     ///< Bound of every wait.
  uint64_t seq_state;      ///< SeqState (local device memory), advanced by each op's last block.
  uint64_t parity_stride;  ///< Bytes between the two copies of every per-parity region.
  uint64_t remote_mask;    ///< Bit d: rank d is reached with transport put/signal (NVSHMEM
                           ///< image only; peer_bases[d] is then this rank's own base).
  uint64_t abort_word;     ///< This rank's abort word (stats region + kStatsAbortOffset): peers
                           ///< that failed write it; every prologue and every wait read it.
  uint64_t num_tokens_ptr;  ///< 0, or a device i32: the op's token count, known only on the
                            ///< device (an earlier op's receive count); at most num_tokens.
  // Low-latency mode: caller outputs (LL dispatch) / inputs (LL combine), local device memory.
  uint64_t ll_recv_x;        ///< [epr][world * ll_max_tokens][row_bytes] received rows, packed.
  uint64_t ll_recv_scales;   ///< [epr][world * ll_max_tokens][num_scales] f32 (FP8; with
                             ///< kFlagScalesColumnMajor [epr][num_scales][world * ll_max_tokens]).
  uint64_t ll_recv_count;    ///< [epr] i32 rows received per local expert.
  uint64_t ll_src_info;      ///< [epr][world * ll_max_tokens] i32 source token index of each row.
  uint64_t ll_layout_range;  ///< [epr][world] i64: (first row << 32) | rows, per source rank.
  uint64_t ll_route;         ///< [epr][world * ll_max_tokens] i32: source rank * top_k + k.
  // Low-latency mode: symmetric-buffer regions.
  uint64_t off_ll_x;       ///< LL dispatch (per parity): rows, [source][slot][row_bytes].
  uint64_t off_ll_scales;  ///< LL dispatch (per parity): FP8 scales, [source][slot][num_scales].
  uint64_t off_ll_meta;    ///< LL dispatch (per parity): [source][slot][top_k + 1] i32: token
                           ///< index, then (local expert << 16 | index in expert) or -1 per k.
  uint64_t off_ll_counts;  ///< LL dispatch (per parity): [source][1 + epr] tagged u64: rows, then
                           ///< rows per local expert.
  uint64_t off_ll_comb;    ///< LL combine (per parity): rows, [token][top_k][hidden] bf16.
  uint64_t off_ll_send_fp8;  ///< LL FP8 send rows (shared): [ll_max_tokens][row_bytes + scales]
                             ///< FP8 rows cast for put/signal peers.
  int32_t ll_max_tokens;   ///< Low-latency per-rank token capacity (0: no low-latency regions).
  int32_t ll_smem_words;   ///< u32 words of dynamic shared memory of the low-latency kernels.
  int32_t num_tokens;      ///< Tokens of this rank.
  int32_t hidden;          ///< Elements per row.
  int32_t row_bytes;       ///< Bytes per x row (hidden * elem size).
  int32_t num_scales;      ///< f32 scales per row (FP8).
  int32_t top_k;           ///< Experts per token.
  int32_t num_experts;     ///< Experts in the world.
  int32_t world;           ///< Ranks.
  int32_t rank;            ///< This rank.
  int32_t pe_base;         ///< Transport PE of group rank d: pe_base + d * pe_stride (a buffer
  int32_t pe_stride;       ///< over the whole world: 0 and 1). `world`/`rank` are the group's.
  int32_t max_tokens;      ///< Per-rank token capacity of the buffer.
  int32_t max_recv_rows;   ///< Receive capacity (buffer or Bounded(n)).
  uint32_t flags;            ///< Bits of `flags`.
  uint32_t global_barriers;  ///< 1: Global schedule (DeepEP-equivalent barriers), 0: Epoch.
  // Low-latency mode: send rows for policies that send metadata rows (Net::kMetadataRows).
  uint64_t off_ll_send_meta;  ///< LL metadata send rows (shared): [world][ll_max_tokens][top_k +
                              ///< 1] i32, each destination's metadata rows as they land there.
  uint64_t ll_self_row;  ///< [ll_max_tokens][top_k] i32, local device memory: for each of this
                         ///< rank's own entries whose expert is local, its packed row (of
                         ///< ll_recv_x, and of the combine's y). Written by the LL dispatch's
                         ///< receive phase; a one-kernel LL combine reads those entries
                         ///< straight from y instead of pushing them to itself.
  uint64_t ll_cumulative_stats;  ///< 0, or [epr] i32, local device memory: each LL dispatch's
                                 ///< receive phase adds its rows per local expert (`ll_recv_count`)
                                 ///< to it (DeepEP's cumulative_local_expert_recv_stats).
  // Rail forwarding (kFlagForward; intranode/forward.cuh). Ranks are nodes x gpus_per_node; a
  // token for ranks of another node crosses once, to this rank's rail peer there (the rank of
  // that node with this rank's local index), through a ring of ring_slots slots of ring_chunk
  // entries; entries are counted since the buffer was made.
  uint64_t token_node_slot;   ///< [T][nodes] i32: the token's index among this rank's tokens for
                              ///< each node (-1: none), written by the layout kernel.
  uint64_t recv_node_counts;  ///< Handle: [nodes] i32: tokens each source node's rail peer sent
                              ///< through this rank (a cached dispatch reads them).
  uint64_t off_ring;          ///< Ring entries (shared): [source node][slots * chunk][ring_entry_bytes].
  uint64_t off_ring_landed;   ///< [source node][slots] monotonic u64 (shared): entries landed in a slot.
  uint64_t off_ring_freed;    ///< [destination node][slots] monotonic u64 (shared): entries the rail
                              ///< peer there freed in a slot.
  uint64_t off_ring_state;    ///< Local u64 (shared): [2][2][nodes] entries sent to / taken from each
                              ///< node before the op, by dispatch parity; then [nodes] forwarder
                              ///< blocks finished per source node.
  uint64_t off_node_counts;   ///< [source node] tagged u64 (notify parity): tokens its rail peer sends
                              ///< through this rank.
  int32_t gpus_per_node;      ///< Ranks per node (1 without forwarding).
  int32_t ring_slots;         ///< Slots of a ring (0: no forwarding).
  int32_t ring_chunk;         ///< Entries per slot: what a forwarder takes and frees at once.
  int32_t ring_entry_bytes;   ///< Bytes per entry (intranode/forward.cuh, RingEntry).
  int32_t fwd_blocks;         ///< Forwarding blocks per source node, the grid's last ones.
  int32_t pad_fwd;            ///< Padding.
};

/// Op sequence numbers kept on the device. Every rank issues the same ops, so every rank's copy
/// holds the same values. The last block of each op advances it (stream order makes the next op
/// see the new values), so kernel arguments never carry per-op values: graph replays just work.
struct SeqState {
  uint64_t op;        ///< Ops so far.
  uint64_t notify;    ///< Count exchanges so far (the count tag).
  uint64_t dispatch;  ///< Dispatches so far, cached ones included (receive-region parity).
  uint64_t combine;   ///< Combines so far (combine-region parity, row-flag value).
  uint64_t done;      ///< Every done[src] counter's value after the last op.
  uint64_t barriers;  ///< Every barrier[src] counter's value after the last op.
  uint64_t ll_dispatch;  ///< Low-latency dispatches so far (their region parity and tag).
  uint64_t ll_combine;   ///< Low-latency combines so far (their region parity).
  uint32_t exits;     ///< Blocks of the running op that finished (0 between ops).
  uint32_t pad;       ///< Padding.
};

/// Bytes of the CPU-proxy ring header (crates/epcomm-proxy, docs/proxy.md); slots follow it.
constexpr uint64_t kRingHeaderBytes = 320;
/// Byte offset of the ring's `tail` word (descriptors the proxy has taken).
constexpr uint64_t kRingTailOffset = 128;
/// Byte offset of the ring's `completed` word (descriptors whose effects are complete, a prefix).
constexpr uint64_t kRingCompletedOffset = 192;
/// Byte offset of the ring's `status` word (0 running, 1 closed, 2 failed).
constexpr uint64_t kRingStatusOffset = 256;
/// Bytes per ring slot: `seq` (position + 1, written last with release), then the 4 words.
constexpr uint64_t kRingSlotBytes = 64;
/// Descriptor kind: move bytes (arg0 source, arg1 destination offset, arg2 bytes).
constexpr uint64_t kProxyKindTransfer = 1;
/// Descriptor kind: set or add a peer's 64-bit word (arg0 offset, arg1 value; arg2 the number of
/// consecutive words a set stores the value into, 0 read as 1; an add has one word).
constexpr uint64_t kProxyKindSignal = 2;
/// Descriptor kind: store a 4- or 8-byte value (arg0 offset, arg1 value, arg2 width; with
/// kProxyFlagWriteSequence arg2's bits 32..63 hold a count n >= 1 of consecutive elements
/// value, value + 1, ..., value + n - 1).
constexpr uint64_t kProxyKindWrite = 3;
/// Words of `ProxyChannel::counters` (device memory, zeroed).
constexpr uint64_t kProxyCounterWords = 5;
/// Counter: the next ring position to claim (producers' atomic add).
constexpr uint64_t kProxyCounterHead = 0;
/// Counter: the largest ring `tail` a producer has seen.
constexpr uint64_t kProxyCounterTailSeen = 1;
/// Counter: nonzero once a producer gave up on a full ring.
constexpr uint64_t kProxyCounterGaveUp = 2;
/// Counter: the proxy's mirror of the ring's `tail` (written by its stream; 0 when unused).
constexpr uint64_t kProxyCounterTaken = 3;
/// Counter: the proxy's mirror of the ring's `completed` (written by its stream; 0 when unused).
constexpr uint64_t kProxyCounterCompleted = 4;
/// Transfer flag: arg0 is a device address in the producing process (else a buffer offset).
constexpr uint64_t kProxyFlagSrcAddress = 1;
/// Signal flag: add the value (else store it).
constexpr uint64_t kProxyFlagSignalAdd = 1;
/// Write flag: a sequence of elements (the count in arg2's bits 32..63), not one.
constexpr uint64_t kProxyFlagWriteSequence = 1;

/// The CPU-proxy channel of a module of the proxy image: the module global
/// `epcomm_proxy_channel`, written by the host once per buffer before the first launch. Kernels
/// reach a proxied peer (bit set in `OpArgs::remote_mask`) by writing descriptors into the ring;
/// the proxy thread executes them in ring order (docs/proxy.md).
struct ProxyChannel {
  uint64_t ring;        ///< The ring region: host memory mapped into the device (device address).
  uint64_t counters;    ///< Device memory, kProxyCounterWords zeroed u64 (kProxyCounter*).
  uint64_t capacity;    ///< Ring slots (a power of two).
  uint64_t local_base;  ///< This rank's symmetric base: a proxied peer's `bases[d]` is this, so
                        ///< an address minus it is the offset in the peer's buffer.
  uint64_t timeout_ns;  ///< Bound of a producer's wait for a free slot.
};

/// Arguments of `epcomm_layout`.
struct LayoutArgs {
  uint64_t topk_idx;       ///< [T][K] i64.
  uint64_t counts;         ///< Out: [world] per rank, [E] per expert, [nodes] per node (u32).
  uint64_t token_slot;     ///< Out: [T][world] i32.
  uint64_t status;         ///< Out: u32, 0 = ok.
  uint64_t err_record;     ///< Host-mapped ErrorRecord.
  uint64_t err_claim;      ///< Device u32.
  uint64_t num_tokens_ptr;  ///< 0, or a device i32: the token count (at most num_tokens).
  uint64_t in_rank;        ///< 0 (route by topk_idx), or [T][world] u8 (nonzero: the token goes
                           ///< to that rank): route by it, topk_idx unused.
  uint64_t expert_counts;  ///< With in_rank: [E] i32 top-k entries per expert (copied into
                           ///< `counts` as they are).
  int32_t num_tokens;      ///< Tokens of this rank.
  int32_t top_k;           ///< Experts per token.
  int32_t num_experts;     ///< Experts in the world.
  int32_t world;           ///< Ranks.
  int32_t gpus_per_node;   ///< Ranks per node.
  int32_t rank;            ///< This rank (of the group).
  int32_t pe_base;         ///< World rank of group rank 0 (`OpArgs::pe_base`): records name
                           ///< world ranks.
  int32_t pe_stride;       ///< World-rank stride between group ranks (`OpArgs::pe_stride`).
  uint64_t token_node_slot;  ///< 0, or out: [T][nodes] i32, the token's index among those for each
                             ///< node (-1: none).
};

}  // namespace epcomm
