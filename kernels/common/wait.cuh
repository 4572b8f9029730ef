// Bounded waits and failure records. Every spin in epcomm goes through `wait_geq` or
// `wait_tag`: each gives up after `timeout_ns`, records which op / wait / peer / values into the
// host-mapped ErrorRecord (first failure wins), and returns false so the caller can leave the
// kernel. Nothing traps: a trap would poison the CUDA context (sticky error) for the process.
//
// Failures travel: the thread that records this rank's first failure also writes an abort word
// into every peer's buffer (`broadcast_abort`), and every wait polls this rank's own abort word
// on its slow path, so a peer of a failed rank stops within microseconds with kPeerFailed
// naming the origin, instead of waiting out its timeout. The next op's prologue checks both the
// claim and the abort word and leaves before writing anything (docs/protocol.md, "Failures").
//
// The functions that may tell peers (record_failure, should_stop, the waits) are templates over
// the image's Net policy (common/net.cuh), which routes the abort word to each peer.
#pragma once
#include "common/abi.cuh"
#include "common/net.cuh"
#include "common/ptx.cuh"

namespace epcomm {

// What a failing wait records and whom it tells. One per block, in shared memory, filled by one
// thread before the block's first barrier (the kernels' prologue): built per thread it lived in
// local memory and cost every op a stack frame.
struct WaitCtx {
  ErrorRecord* record;     // host-mapped
  uint32_t* claim;         // device word; the first failing thread flips it 0 -> 1
  uint64_t timeout_ns;
  uint64_t epoch;
  uint32_t op;
  int32_t rank;
  // Failure propagation (null in the layout kernel, which has no peers): this rank's abort
  // word, and where every peer's abort word lives (base + abort_off, route by remote_mask).
  const uint64_t* abort_word;
  uint8_t* const* bases;
  uint64_t abort_off;
  uint64_t remote_mask;
  int32_t world;
  // Group ranks are transport PEs pe_base + d * pe_stride (OpArgs); `rank`, `world` and the
  // peers named in failures are group ranks.
  int32_t pe_base;
  int32_t pe_stride;
  // Op agreement ([A2], docs/protocol.md "Op agreement"): this op's intent word, and the byte
  // offset in this rank's buffer (bases[rank]) where the peers' intent words for this op land
  // ([world], by source rank); 0 where there are no peers (the layout kernel).
  uint64_t intent_off;
  uint64_t intent;
  // Rank masking (kFlagMasking, low-latency ops; docs/low-latency.md "Masking ranks"): this
  // rank's mask words ([kMaxWorld] u32 by group rank, 1 = masked), null when the op does not
  // mask; and bit d set when this block last saw peer d masked (refresh_mask).
  uint32_t* mask;
  uint64_t masked;
};

// Masking: true when group rank `peer` is masked, as this block last saw it or as the mask
// words say now (another block, or a thread of this one, may have masked it since).
__device__ __forceinline__ bool peer_masked(const WaitCtx& w, int32_t peer) {
  if (w.mask == nullptr || peer < 0 || peer >= w.world || peer == w.rank) return false;
  return ((w.masked >> peer) & 1u) != 0 ||
         *reinterpret_cast<const volatile uint32_t*>(w.mask + peer) != 0u;
}

// Masking: a wait for group rank `peer` expired; masks the peer (true) instead of failing,
// when the op masks and `peer` is a peer. Every later wait for it returns at once.
__device__ __forceinline__ bool mask_on_timeout(const WaitCtx& w, int32_t peer) {
  if (w.mask == nullptr || peer < 0 || peer >= w.world || peer == w.rank) return false;
  *reinterpret_cast<volatile uint32_t*>(w.mask + peer) = 1u;
  __threadfence();
  return true;
}

// The transport PE of group rank `d`: what every Net call takes as its `pe`.
__device__ __forceinline__ int peer_pe(const WaitCtx& w, int d) {
  return w.pe_base + d * w.pe_stride;
}

// Abort word: code (16 bits) | origin world rank + 1 (16 bits) | late world rank + 1 (16 bits;
// 0: none) | origin's op sequence (low 16 bits). Never 0 once written (origin + 1 >= 1). The
// late rank is the one the origin waited for when it timed out (or the peer whose op disagreed
// with its own), so that every rank that stops on the failure names it, not only the ranks
// whose own wait expired.
__device__ __forceinline__ uint64_t make_abort(uint32_t code, int32_t origin, int32_t late,
                                               uint64_t op) {
  return (static_cast<uint64_t>(code & 0xffffu) << 48) |
         (static_cast<uint64_t>((origin + 1) & 0xffff) << 32) |
         (static_cast<uint64_t>((late + 1) & 0xffff) << 16) | (op & 0xffffull);
}
__device__ __forceinline__ int32_t abort_origin(uint64_t a) {
  return static_cast<int32_t>((a >> 32) & 0xffffu) - 1;
}
__device__ __forceinline__ int32_t abort_late(uint64_t a) {
  return static_cast<int32_t>((a >> 16) & 0xffffu) - 1;
}
__device__ __forceinline__ uint32_t abort_code(uint64_t a) {
  return static_cast<uint32_t>(a >> 48);
}

// The late world rank of a failure this rank (world rank `self`) recorded with `code` and world
// rank `peer` (-1: none): the rank a timeout waited for, or the peer of an op mismatch. Other
// failures have none (their `peer` is a destination or a token index), nor has a wait for this
// rank's own progress (the proxy's completions: `peer` is `self`).
__device__ __forceinline__ int32_t late_of(uint32_t code, int32_t peer, int32_t self) {
  return (code == kTimeout || code == kOpMismatch) && peer != self ? peer : -1;
}

// kPeerFailed's `expected`: the origin's code (low 32 bits) and its late world rank + 1 (high
// 32 bits, 0: none), as the abort word carries them.
__device__ __forceinline__ uint64_t peer_failed_expected(uint64_t a) {
  return static_cast<uint64_t>(abort_code(a)) | (static_cast<uint64_t>(abort_late(a) + 1) << 32);
}

// The fields two intent words disagree on, as the abort word carries them (kOpMismatch): bit 0
// the op kind (then nothing else: the other fields mean nothing across kinds), bits 1..5 the
// `flags` bits of kIntentFlagMask, bit 6 the row bytes.
__device__ __forceinline__ uint32_t intent_fields(uint64_t mine, uint64_t theirs) {
  const uint32_t d = static_cast<uint32_t>(mine ^ theirs);
  if ((d >> kIntentKindShift) != 0) return 1u;
  return ((d >> kIntentFlagShift) & kIntentFlagMask) | ((d & kIntentRowMask) != 0 ? 64u : 0u);
}

// The code an abort word carries for a failure recorded with (code, expected, seen): the code,
// and for kOpMismatch the fields that differ in bits 8..15, so that the peers report them too.
__device__ __forceinline__ uint32_t abort_code_of(uint32_t code, uint64_t expected,
                                                  uint64_t seen) {
  return code == kOpMismatch ? code | (intent_fields(expected, seen) << 8) : code;
}

// Tells every peer that this rank failed (one thread). Idempotent: peers only test for != 0.
template <class Net>
__device__ __noinline__ void broadcast_abort(const WaitCtx& w, uint64_t value) {
  if (w.bases == nullptr) return;
  for (int d = 0; d < w.world; ++d) {
    if (d == w.rank) continue;
    Net::set_word(reinterpret_cast<uint64_t*>(w.bases[d] + w.abort_off), value, peer_pe(w, d),
                  Net::remote(w.remote_mask, d));
  }
  __threadfence_system();
}

// Records a failure (first thread only) and, unless it was learned from a peer, sends it to
// every peer. Records and abort words name world ranks (the transport's PEs), whatever group
// the op runs over, so a failure relayed from one tier's buffer to the other's (they share the
// claim word and record) still names its origin.
template <class Net>
__device__ __noinline__ void record_failure(const WaitCtx& w, uint32_t code, uint32_t wait_id,
                                            int32_t peer, uint64_t expected, uint64_t seen,
                                            uint64_t waited_ns) {
  if (atomicCAS(w.claim, 0u, 1u) != 0u) return;
  volatile ErrorRecord* r = w.record;
  r->op = w.op;
  r->wait_id = wait_id;
  // A peer index is a group rank (made a world rank here); kPeerFailed's `peer` (the origin,
  // from an abort word) is a world rank already; other values (a token index) stay as they are.
  const int32_t world_peer =
      code != kPeerFailed && peer >= 0 && peer < w.world ? peer_pe(w, peer) : peer;
  r->peer = world_peer;
  r->block = blockIdx.x;
  r->rank = static_cast<uint32_t>(peer_pe(w, w.rank));
  r->epoch = w.epoch;
  r->expected = expected;
  r->seen = seen;
  r->waited_ns = waited_ns;
  __threadfence_system();
  r->code = code;
  __threadfence_system();
  // A failure of this rank's own (not one learned from a peer) goes to every peer.
  if (code != kPeerFailed)
    broadcast_abort<Net>(w, make_abort(abort_code_of(code, expected, seen), peer_pe(w, w.rank),
                                       peer >= 0 && peer < w.world
                                           ? late_of(code, world_peer, peer_pe(w, w.rank))
                                           : -1,
                                       w.epoch));
}

// This op's intent slot of group rank `d` in this rank's buffer (w.intent_off != 0).
__device__ __forceinline__ const uint64_t* intent_slot(const WaitCtx& w, int d) {
  return reinterpret_cast<const uint64_t*>(w.bases[w.rank] + w.intent_off) + d;
}

// [A2] inside a wait for group rank `peer` (its slow path): true, with kOpMismatch recorded,
// when that peer's intent word for this op has arrived and differs from this rank's. So ranks
// that wait for signals the other never sends (one stages its combine, the other pushes; one
// dispatches, the other combines) fail as soon as both started the op, not at the timeout.
template <class Net>
__device__ __noinline__ bool intent_differs(const WaitCtx& w, uint32_t wait_id, int32_t peer) {
  if (w.intent_off == 0 || peer < 0 || peer >= w.world || peer == w.rank) return false;
  const uint64_t v = *reinterpret_cast<const volatile uint64_t*>(intent_slot(w, peer));
  if ((v >> 32) != (w.intent >> 32) || v == w.intent) return false;  // not yet, or agreed
  record_failure<Net>(w, kOpMismatch, wait_id, peer, w.intent, v, 0);
  return true;
}

// How often a spinning wait looks at the abort word (in spins): a peer's failure is seen
// within a few microseconds, and the spin loop stays as tight as before.
constexpr uint32_t kAbortPollMask = 1023u;

// True when this op must stop: this rank already failed (the claim is set), or (checked every
// kAbortPollMask + 1 spins) a peer's abort word arrived, recorded here as kPeerFailed naming the
// origin, during wait `wait_id`.
template <class Net>
__device__ __noinline__ bool should_stop(const WaitCtx& w, uint32_t wait_id, uint32_t spins) {
  if (*reinterpret_cast<volatile uint32_t*>(w.claim) != 0) return true;
  if (w.abort_word == nullptr || ((spins >> 6) & (kAbortPollMask >> 6)) != 0) return false;
  const uint64_t a = *reinterpret_cast<const volatile uint64_t*>(w.abort_word);
  if (a == 0) return false;
  record_failure<Net>(w, kPeerFailed, wait_id, abort_origin(a), peer_failed_expected(a),
                      a & 0xffffull, 0);
  return true;
}

// What a spinning wait's periodic check (wait_verdict) decides.
constexpr int kWaitGoOn = 0;  // keep spinning
constexpr int kWaitDone = 1;  // stop, waited for: `peer` is masked (or was, at its timeout)
constexpr int kWaitFail = 2;  // stop, failed: recorded (timeout, op mismatch) or a peer failed

// The periodic check of the spin loops (every 64 spins), out of line so that the loops, which
// every op inlines several times, stay small: `peer` masked; the wait past its timeout (then
// masked, or kTimeout recorded with `expected` and `seen`); the peer's intent word for another
// op; this rank or a peer failed.
template <class Net>
__device__ __noinline__ int wait_verdict(const WaitCtx& w, uint64_t t0, uint32_t wait_id,
                                         int32_t peer, uint64_t expected, uint64_t seen,
                                         uint32_t spins) {
  const uint64_t now = globaltimer_ns();
  if (peer_masked(w, peer)) return kWaitDone;
  if (now - t0 > w.timeout_ns) {
    if (mask_on_timeout(w, peer)) return kWaitDone;
    record_failure<Net>(w, kTimeout, wait_id, peer, expected, seen, now - t0);
    return kWaitFail;
  }
  if (intent_differs<Net>(w, wait_id, peer)) return kWaitFail;
  if (should_stop<Net>(w, wait_id, spins)) return kWaitFail;
  return kWaitGoOn;
}

// Spin until *p >= target (acquire). Returns false on timeout, when another thread of this
// rank failed, or when a peer reported a failure. Under masking (w.mask), true at once when
// `peer` is masked, and the peer masked instead of a timeout (*arrived_ns then unset).
template <class Net>
__device__ __forceinline__ bool wait_geq(const WaitCtx& w, const uint64_t* p, uint64_t target,
                                         uint32_t wait_id, int32_t peer, uint64_t* arrived_ns) {
  uint64_t v = ld_acquire_sys(p);
  if (v >= target) {
    if (arrived_ns) *arrived_ns = globaltimer_ns();
    return true;
  }
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spins = 1;; ++spins) {
    v = ld_acquire_sys(p);
    if (v >= target) {
      if (arrived_ns) *arrived_ns = globaltimer_ns();
      return true;
    }
    if ((spins & 63u) == 0u) {
      const int verdict = wait_verdict<Net>(w, t0, wait_id, peer, target, v, spins);
      if (verdict != kWaitGoOn) return verdict == kWaitDone;  // kWaitDone: masked
    }
  }
}

// Tagged words: (tag << 32) | value, tag >= 1, so an unwritten (zero) word never matches.
__device__ __forceinline__ uint64_t make_tagged(uint64_t tag, uint32_t value) {
  return (tag << 32) | value;
}

// Spin until the word's tag equals `tag` (acquire); returns the value through *value. Under
// masking, a masked `peer` (or one masked at the timeout) gives true and *value = 0.
template <class Net>
__device__ __forceinline__ bool wait_tag(const WaitCtx& w, const uint64_t* p, uint64_t tag,
                                         uint32_t wait_id, int32_t peer, uint32_t* value,
                                         uint64_t* arrived_ns) {
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t v = ld_acquire_sys(p);
    if ((v >> 32) == (tag & 0xffffffffull)) {
      *value = static_cast<uint32_t>(v);
      if (arrived_ns) *arrived_ns = globaltimer_ns();
      return true;
    }
    if ((spins & 63u) == 63u) {
      const int verdict = wait_verdict<Net>(w, t0, wait_id, peer, tag, v >> 32, spins);
      if (verdict == kWaitDone) *value = 0;  // masked: nothing comes from it
      if (verdict != kWaitGoOn) return verdict == kWaitDone;
    }
  }
}

}  // namespace epcomm
