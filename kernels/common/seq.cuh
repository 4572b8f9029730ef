// Sequence state and the per-block op state every dispatch/combine-style kernel starts with.
//
// Kernels never receive per-op values in their arguments: each block derives this op's
// sequence numbers from the device SeqState in its prologue, and the last block to finish
// advances SeqState in its epilogue (docs/architecture.md, "Sequencing, parities, graphs").
#pragma once
#include "common/abi.cuh"
#include "common/wait.cuh"

namespace epcomm {

// This op's sequence numbers, derived from the device SeqState by block thread 0.
struct OpSeq {
  uint64_t op;             // op sequence number (>= 1)
  uint64_t epoch;          // dispatch: notify seq (count tag); combine: combine seq (flag value)
  uint64_t notify, dispatch, combine;
  uint64_t ll_dispatch, ll_combine;  // low-latency ops so far, this one included
  uint64_t done_expected;  // done[src] value once this op's sends all landed
  uint64_t barrier_base;   // barrier[src] value before this op's first barrier
};

// The shared-memory state of one block of an op kernel. Written by the prologue; every thread
// reads it only after the prologue's closing __syncthreads. Kernels extend it with their own
// tables (struct Shared : OpState).
struct OpState {
  OpSeq seq;
  WaitCtx wait;                // what a failing wait records and whom it tells
  uint8_t* bases[kMaxWorld];   // every rank's symmetric buffer (through the Net policy)
  int abort;                   // block-uniform "leave now" flag (all_ok)
};

// The op's token count: `num_tokens`, or the device count at `num_tokens_ptr` (capped by it).
// The cap never truncates in epcomm's use: the count is a rail dispatch's receive count, which
// that dispatch keeps within its capacity (it fails with kOverflow first, and then this rank's
// later ops do not run at all: the tiers share the claim word), and `num_tokens` is that
// capacity. It only keeps a corrupt count from reading or writing out of bounds.
__device__ __forceinline__ int op_tokens(const OpArgs& a) {
  if (a.num_tokens_ptr == 0) return a.num_tokens;
  return min(a.num_tokens, *reinterpret_cast<const int32_t*>(a.num_tokens_ptr));
}

__device__ __forceinline__ uint64_t* u64_at(uint8_t* base, uint64_t off) {
  return reinterpret_cast<uint64_t*>(base + off);
}

// [A1] The intent word of op number `op` of `kind` (abi.cuh, kIntentKindShift): what every
// peer must be running as the same op. A receive phase has its send phase's intent.
__device__ __forceinline__ uint64_t op_intent(const OpArgs& a, uint32_t kind, uint64_t op) {
  const uint32_t k = kind == kOpLlDispatchRecv  ? kOpLlDispatch
                     : kind == kOpLlCombineRecv ? kOpLlCombine
                                                : kind;
  const uint32_t rb = static_cast<uint32_t>(a.row_bytes);
  const uint32_t content = (k << kIntentKindShift) |
                           ((a.flags & kIntentFlagMask) << kIntentFlagShift) |
                           ((rb ^ (rb >> 20)) & kIntentRowMask);
  return ((op & 0xffffffffull) << 32) | content;
}

// Byte offset, in every rank's buffer, of the intent slots of op number `op` ([world] by
// source rank; two parities, so a peer one op ahead writes the other slots).
__device__ __forceinline__ uint64_t intent_off(const OpArgs& a, uint64_t op) {
  return a.off_stats + kStatsIntentOffset + (op & 1) * kMaxWorld * sizeof(uint64_t);
}

// Fills s.wait for an op of `kind` (one thread; s.seq is set, s.bases is the table the other
// threads fill).
__device__ __forceinline__ void make_wait(const OpArgs& a, OpState& s, uint32_t kind) {
  WaitCtx& w = s.wait;
  w.record = reinterpret_cast<ErrorRecord*>(a.err_record);
  w.claim = reinterpret_cast<uint32_t*>(a.err_claim);
  w.timeout_ns = a.timeout_ns;
  w.epoch = s.seq.op;
  w.op = kind;
  w.rank = a.rank;
  w.abort_word = reinterpret_cast<const uint64_t*>(a.abort_word);
  w.bases = s.bases;
  w.abort_off = a.off_stats + kStatsAbortOffset;
  w.remote_mask = a.remote_mask;
  w.world = a.world;
  w.pe_base = a.pe_base;
  w.pe_stride = a.pe_stride;
  // (Read through bases[rank], which the prologue's closing barrier publishes, so that the
  // prologue issues no extra load.)
  w.intent_off = intent_off(a, s.seq.op);
  w.intent = op_intent(a, kind, s.seq.op);
  // The mask words (kFlagMasking): `masked` is written by warps 0 and 1 (load_mask).
  if ((a.flags & kFlagMasking) != 0) {
    const uint64_t local = reinterpret_cast<const uint64_t*>(a.peer_bases)[a.rank];
    w.mask = reinterpret_cast<uint32_t*>(local + a.off_stats + kStatsMaskOffset);
  } else {
    w.mask = nullptr;
    w.masked = 0;
  }
}

// Masking (kFlagMasking): warps 0 and 1 read the mask words of peers 0..63 into the block's
// `s.wait.masked` (one half each); every other thread does nothing. The caller's next
// __syncthreads publishes it. `mask` is the op's mask words (this rank's stats region).
__device__ __forceinline__ void load_mask(const OpArgs& a, OpState& s, const uint32_t* mask) {
  const int tid = threadIdx.x;
  if (tid >= 64) return;
  const bool m = tid < a.world && tid != a.rank &&
                 *reinterpret_cast<const volatile uint32_t*>(mask + tid) != 0u;
  const uint32_t bits = __ballot_sync(0xffffffffu, m);
  if (tid % 32 == 0) reinterpret_cast<uint32_t*>(&s.wait.masked)[tid / 32] = bits;
}

// Masking: every thread of the block calls it after a wait that may have masked peers; the
// block's `masked` then holds every peer masked so far (ends with __syncthreads). Nothing
// without kFlagMasking.
__device__ __forceinline__ void refresh_mask(const OpArgs& a, OpState& s) {
  if ((a.flags & kFlagMasking) == 0) return;
  load_mask(a, s, s.wait.mask);
  __syncthreads();
}

// Reads the sequence numbers, loads peer bases, fills the wait context, clears the abort flag.
// Returns false (in every block) when the op must not run: this rank failed earlier (its claim
// is set: the failure is sent to the peers again, in case the failing kernel could not) or a
// peer's abort word arrived. Such an op writes nothing and publishes nothing, so no peer can
// mistake it for progress. Ends with __syncthreads: s is then complete for every thread.
// An op that runs then publishes its intent word ([A1]) to every peer (block 0, thread d for
// peer d; not a receive phase, whose send phase did), before any other write of the op.
template <class Net>
__device__ __forceinline__ bool prologue(const OpArgs& a, OpState& s, uint32_t kind) {
  const int tid = threadIdx.x;
  const uint64_t* peer_bases = reinterpret_cast<const uint64_t*>(a.peer_bases);
  if (tid < a.world) s.bases[tid] = reinterpret_cast<uint8_t*>(peer_bases[tid]);
  if ((a.flags & kFlagMasking) != 0)
    load_mask(a, s, reinterpret_cast<const uint32_t*>(peer_bases[a.rank] + a.off_stats +
                                                      kStatsMaskOffset));
  if (tid == 0) {
    s.abort = 0;
    // Issue the failure-word loads with the SeqState loads so their latencies overlap.
    const uint32_t claim = *reinterpret_cast<const volatile uint32_t*>(a.err_claim);
    const uint64_t abort = *reinterpret_cast<const volatile uint64_t*>(a.abort_word);
    const volatile SeqState* st = reinterpret_cast<const volatile SeqState*>(a.seq_state);
    // A receive phase (kOpLl*Recv) belongs to the op its send phase started: it advances
    // nothing, and waits for the done counters the send phase left behind.
    const bool recv_phase = kind == kOpLlDispatchRecv || kind == kOpLlCombineRecv;
    OpSeq q;
    q.op = st->op + (recv_phase ? 0 : 1);
    q.notify = st->notify + (kind == kOpDispatch ? 1 : 0);
    q.dispatch = st->dispatch + (kind == kOpDispatch || kind == kOpCachedDispatch ? 1 : 0);
    q.combine = st->combine + (kind == kOpCombine ? 1 : 0);
    q.ll_dispatch = st->ll_dispatch + (kind == kOpLlDispatch ? 1 : 0);
    q.ll_combine = st->ll_combine + (kind == kOpLlCombine ? 1 : 0);
    q.epoch = kind == kOpCombine                                      ? q.combine
              : kind == kOpLlDispatch || kind == kOpLlDispatchRecv ? q.ll_dispatch
              : kind == kOpLlCombine || kind == kOpLlCombineRecv   ? q.ll_combine
                                                                   : q.notify;
    q.done_expected = st->done + (recv_phase ? 0 : gridDim.x);
    q.barrier_base = st->barriers;
    s.seq = q;
    make_wait(a, s, kind);
    if (claim != 0 || abort != 0) {  // the rare path: this rank or a peer failed earlier
      // Every base, for the broadcast (the same values the other threads store).
      for (int d = 0; d < a.world; ++d) s.bases[d] = reinterpret_cast<uint8_t*>(peer_bases[d]);
      const WaitCtx& w = s.wait;
      s.abort = 1;
      if (claim != 0) {
        const volatile ErrorRecord* r = w.record;
        const uint32_t code = r->code;
        // Sent again to this op's peers, which may be another tier's (the claim word and the
        // record are shared by the tiers of a hierarchical buffer): an own failure, or one
        // learned from a peer with its origin (world rank), cause and op.
        // The record's `peer` is a world rank already (record_failure).
        if (code != kOk && code != kPeerFailed)
          broadcast_abort<Net>(w, make_abort(abort_code_of(code, r->expected, r->seen),
                                             peer_pe(w, a.rank),
                                             late_of(code, r->peer, peer_pe(w, a.rank)),
                                             r->epoch));
        else if (code == kPeerFailed)
          broadcast_abort<Net>(w, make_abort(static_cast<uint32_t>(r->expected), r->peer,
                                             static_cast<int32_t>(r->expected >> 32) - 1,
                                             r->seen));
      } else {
        should_stop<Net>(w, kWaitOpStart, 0);  // records PeerFailed naming the origin
      }
    }
  }
  __syncthreads();
  if (s.abort != 0) return false;
  if (blockIdx.x == 0 && tid < a.world && tid != a.rank && kind != kOpLlDispatchRecv &&
      kind != kOpLlCombineRecv)  // [A1]
    Net::set_word(reinterpret_cast<uint64_t*>(s.bases[tid] + intent_off(a, s.seq.op)) + a.rank,
                  s.wait.intent, peer_pe(s.wait, tid), Net::remote(a.remote_mask, tid));
  return true;
}

// [A2] The intent word of group rank `d` as it is now (0 for this rank, or without peers): read
// before the op's last wait for `d`, so that its latency overlaps that wait's. `d` published
// it when its op started, so it is there by then in the common case.
__device__ __forceinline__ uint64_t peek_intent(const WaitCtx& w, int d) {
  if (w.intent_off == 0 || d == w.rank) return 0;
  return *reinterpret_cast<const volatile uint64_t*>(intent_slot(w, d));
}

// [A2] after the op's last wait for group rank `d` (block 0, thread d): d's intent word for this
// op must equal this rank's; otherwise kOpMismatch is recorded (and sent to every peer) and
// false returned. `early` is `peek_intent(w, d)` from before that wait: when it carries this
// op's tag it is the word (no other op writes that tag), else the word is waited for (bounded:
// d published it when its op started). Catches what no wait does: ranks whose ops pass each
// other's waits (weights on one rank only, BF16 against FP8, a dispatch against a combine that
// sends it nothing).
template <class Net>
__device__ __forceinline__ bool check_intent(const WaitCtx& w, int d, uint64_t early) {
  if (w.intent_off == 0 || d == w.rank || peer_masked(w, d)) return true;
  uint32_t content = static_cast<uint32_t>(early);
  if ((early >> 32) != (w.intent >> 32) &&
      !wait_tag<Net>(w, intent_slot(w, d), w.intent >> 32, kWaitIntent, d, &content, nullptr))
    return false;
  if (peer_masked(w, d)) return true;  // masked while waited for
  if (content == static_cast<uint32_t>(w.intent)) return true;
  const uint64_t theirs = make_tagged(w.intent >> 32, content);
  record_failure<Net>(w, kOpMismatch, kWaitIntent, d, w.intent, theirs, 0);
  return false;
}

// Called once per block on the success path, after `barriers` all-rank barriers of this op
// (Global schedule; 0 under Epoch); the last block to finish advances SeqState.
// The exit count needs no fence before it. What it must order is every block's prologue reads
// of SeqState before the last block's writes: those loads returned their values, which went to
// shared memory before the barrier above, before this add is issued, and a load that has
// returned cannot see a later store. The op's other writes reach the next kernel by stream
// order; a fence here only held every block until its writes were acknowledged.
__device__ __forceinline__ void epilogue(const OpArgs& a, const OpState& s, uint64_t barriers) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  SeqState* st = reinterpret_cast<SeqState*>(a.seq_state);
  if (atomicAdd(&st->exits, 1u) != gridDim.x - 1) return;
  const OpSeq& q = s.seq;
  volatile SeqState* v = st;
  v->op = q.op;
  v->notify = q.notify;
  v->dispatch = q.dispatch;
  v->combine = q.combine;
  v->ll_dispatch = q.ll_dispatch;
  v->ll_combine = q.ll_combine;
  v->done = q.done_expected;
  v->barriers = q.barrier_base + barriers * gridDim.x;
  v->exits = 0;
  __threadfence();
}

// Block-uniform: true when every thread's `ok` held.
__device__ __forceinline__ bool all_ok(OpState& s, bool ok) {
  if (!ok) s.abort = 1;
  __syncthreads();
  return s.abort == 0;
}

}  // namespace epcomm
