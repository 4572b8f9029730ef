//! The pure logic of the verbs executor, testable without a device: the per-queue-pair
//! bookkeeping of work requests (send-queue depth, selective signalling, in-order completion)
//! and the shadow words that turn a signal's ADD into a store.
//!
//! # Work requests and completions
//!
//! A [`SendQueue`] holds requests in two stages: **pending** (accepted by `submit_*`, not yet
//! handed to `ibv_post_send`) and **posted** (in the hardware send queue, not yet known
//! complete). Pending requests are posted as one chain (one doorbell) when there are
//! `signal_every` of them, and at every [`SendQueue::flush`] — the proxy's `poll`, which ends
//! each submit round. The last request of every chain is signalled, so:
//!
//! * at most `signal_every` requests go unsignalled in a row, and no unsignalled request is
//!   ever left at the tail of the send queue waiting for a later signalled one;
//! * on a reliable-connected queue pair send completions arrive in posting order, so a
//!   signalled completion with sequence number `s` completes every request up to `s`
//!   ([`SendQueue::complete`]): each operation is reported once, in order, when its last
//!   request is covered;
//! * a request that fails always produces a completion (signalled or not), carrying its own
//!   `wr_id`; [`SendQueue::failed`] names the operation it belongs to.
//!
//! Posted plus pending never exceeds the depth: [`SendQueue::has_room`] is what turns a full
//! send queue into `Submit::Busy`. A slot is freed only by a completion, so the completion
//! queue never holds more than the send queues' total depth of entries.
//!
//! # Signals: ADD through a shadow word
//!
//! In this protocol every signal word of a peer has a single writer — this rank — so the
//! value the word will hold after an ADD is known here: [`ShadowWords`] keeps the running
//! value per `(peer, offset)` and an ADD becomes an 8-byte inline RDMA WRITE of the new sum
//! (SET writes the value and resets the shadow). Compared with `IBV_WR_ATOMIC_FETCH_AND_ADD`
//! this needs no local scratch region, no remote-atomic access on the peer's buffer (NIC
//! atomics on GPU memory through PCIe are not atomic with respect to the GPU's own atomics,
//! and some NICs lack them on peer memory), no responder read resources
//! (`max_rd_atomic`), and it is one inline work request like SET. Its cost: the word must
//! start at 0 (or be SET first) and no one else may change it.

use std::collections::{HashMap, VecDeque};

use crate::executor::OpId;

/// What a work request is, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrKind {
    /// RDMA WRITE of a transfer (from a registered region).
    Transfer,
    /// Inline RDMA WRITE of a 4- or 8-byte store.
    Write,
    /// Inline RDMA WRITE of a signal's SET value.
    SignalSet,
    /// Inline RDMA WRITE of a signal's ADD (the shadow's new value).
    SignalAdd,
}

impl WrKind {
    /// The name used in errors.
    pub fn opcode(self) -> &'static str {
        match self {
            WrKind::Transfer => "RDMA WRITE (transfer)",
            WrKind::Write => "RDMA WRITE inline (write)",
            WrKind::SignalSet => "RDMA WRITE inline (signal set)",
            WrKind::SignalAdd => "RDMA WRITE inline (signal add)",
        }
    }
}

/// The most bytes one inline work request carries here (a write's elements or a signal's words
/// are packed into as few requests as this and the queue pair's `max_inline_data` allow).
pub const INLINE_MAX: usize = 64;

/// Where the bytes of a work request come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// A registered local range (one scatter/gather entry).
    Gather {
        /// Local address (or IOVA).
        addr: u64,
        /// Bytes.
        len: u32,
        /// The region's local key.
        lkey: u32,
    },
    /// Bytes copied into the work queue entry at post time (`IBV_SEND_INLINE`).
    Inline {
        /// The bytes, little-endian; the first `len` are sent.
        bytes: [u8; INLINE_MAX],
        /// 1 ..= [`INLINE_MAX`] (and at most what the queue pair grants).
        len: u8,
    },
}

/// One RDMA WRITE, ready to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// The sequence number within its queue pair (`wr_id`).
    pub wr_id: u64,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// The bytes.
    pub payload: Payload,
    /// Whether it produces a completion on success.
    pub signaled: bool,
}

/// Posts a chain of work requests in order: `ibv_post_send` on a queue pair, or a recorder in
/// tests.
pub trait PostSink {
    /// Posts `chain` in order as one call.
    ///
    /// # Errors
    /// The poster's message (`ibv_post_send`'s `errno` text); nothing of the chain is
    /// considered posted.
    fn post(&mut self, chain: &[WorkRequest]) -> Result<(), String>;
}

/// A request's record until it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    seq: u64,
    /// Set on the last request of an operation.
    op: Option<OpId>,
    kind: WrKind,
}

/// The work requests of one queue pair (see the [module docs](self)).
#[derive(Debug)]
pub struct SendQueue {
    depth: usize,
    signal_every: usize,
    next_seq: u64,
    pending: Vec<(WorkRequest, Entry)>,
    posted: VecDeque<Entry>,
}

/// A failed completion, resolved to its operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failed {
    /// The operation the request belongs to (`None`: matches nothing outstanding).
    pub op: Option<OpId>,
    /// What the request was.
    pub kind: Option<WrKind>,
}

impl SendQueue {
    /// A queue of `depth` requests (> 0), signalling at least every `signal_every` (> 0).
    pub fn new(depth: usize, signal_every: usize) -> SendQueue {
        SendQueue {
            depth: depth.max(1),
            signal_every: signal_every.max(1),
            next_seq: 0,
            pending: Vec::new(),
            posted: VecDeque::new(),
        }
    }

    /// The depth.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Requests accepted and not yet complete.
    pub fn outstanding(&self) -> usize {
        self.pending.len() + self.posted.len()
    }

    /// Whether `n` more requests fit.
    pub fn has_room(&self, n: usize) -> bool {
        self.outstanding() + n <= self.depth
    }

    /// Accepts a request (the caller checked [`SendQueue::has_room`]); `op` is set on the last
    /// request of an operation. Posts the pending chain when it reaches `signal_every`.
    ///
    /// # Errors
    /// The sink's error, with the first operation of the chain (see [`SendQueue::flush`]).
    pub fn push(
        &mut self,
        remote_addr: u64,
        rkey: u32,
        payload: Payload,
        op: Option<OpId>,
        kind: WrKind,
        sink: &mut dyn PostSink,
    ) -> Result<(), (Option<OpId>, String)> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let wr = WorkRequest {
            wr_id: seq,
            remote_addr,
            rkey,
            payload,
            signaled: false,
        };
        self.pending.push((wr, Entry { seq, op, kind }));
        if self.pending.len() >= self.signal_every {
            self.flush(sink)?;
        }
        Ok(())
    }

    /// Posts the pending chain with its last request signalled.
    ///
    /// # Errors
    /// The sink's error and the first operation of the chain (every request of the chain is
    /// dropped: the queue pair is unusable after a refused post).
    pub fn flush(&mut self, sink: &mut dyn PostSink) -> Result<(), (Option<OpId>, String)> {
        let Some(last) = self.pending.last_mut() else {
            return Ok(());
        };
        last.0.signaled = true;
        let chain: Vec<WorkRequest> = self.pending.iter().map(|(wr, _)| *wr).collect();
        let result = sink.post(&chain);
        let entries = self.pending.drain(..).map(|(_, e)| e);
        match result {
            Ok(()) => {
                self.posted.extend(entries);
                Ok(())
            }
            Err(message) => {
                let first = entries.filter_map(|e| e.op).next();
                Err((first, message))
            }
        }
    }

    /// The first operation outstanding (posted or pending), if any.
    pub fn oldest_op(&self) -> Option<OpId> {
        self.posted
            .iter()
            .chain(self.pending.iter().map(|(_, e)| e))
            .find_map(|e| e.op)
    }

    /// A successful signalled completion of request `wr_id`: every posted request up to it is
    /// complete; their operations are appended to `done` in order.
    ///
    /// # Errors
    /// `wr_id` is not posted (`Err(())`).
    #[allow(clippy::result_unit_err)]
    pub fn complete(&mut self, wr_id: u64, done: &mut Vec<OpId>) -> Result<(), ()> {
        if !self.posted.iter().any(|e| e.seq == wr_id) {
            return Err(());
        }
        while let Some(e) = self.posted.front().copied() {
            if e.seq > wr_id {
                break;
            }
            self.posted.pop_front();
            done.extend(e.op);
        }
        Ok(())
    }

    /// The operation of failed request `wr_id`: its own, or that of the first later request
    /// that ends an operation (a failed request in the middle of a multi-request transfer).
    pub fn failed(&self, wr_id: u64) -> Failed {
        let mut after = self.posted.iter().skip_while(|e| e.seq < wr_id);
        match after.next() {
            Some(e) if e.seq == wr_id => Failed {
                op: e.op.or_else(|| after.find_map(|e| e.op)),
                kind: Some(e.kind),
            },
            _ => Failed {
                op: None,
                kind: None,
            },
        }
    }
}

/// The value this rank last stored in each signal word of each peer (see the
/// [module docs](self)).
#[derive(Debug, Default)]
pub struct ShadowWords {
    words: HashMap<(u32, u64), u64>,
}

impl ShadowWords {
    /// The value to write for a signal on `(peer, offset)`: `value` for SET, the running sum
    /// plus `value` (wrapping) for ADD. Changes nothing: call [`ShadowWords::commit`] once the
    /// write is accepted.
    pub fn next(&self, peer: u32, offset: u64, value: u64, add: bool) -> u64 {
        if add {
            self.current(peer, offset).wrapping_add(value)
        } else {
            value
        }
    }

    /// Records that `(peer, offset)` now holds `value`.
    pub fn commit(&mut self, peer: u32, offset: u64, value: u64) {
        self.words.insert((peer, offset), value);
    }

    /// What `(peer, offset)` holds as far as this rank knows (0 before any signal).
    pub fn current(&self, peer: u32, offset: u64) -> u64 {
        self.words.get(&(peer, offset)).copied().unwrap_or(0)
    }

    /// Whether `(peer, offset)` has been signalled.
    pub fn tracks(&self, peer: u32, offset: u64) -> bool {
        self.words.contains_key(&(peer, offset))
    }
}

/// How a transfer of `bytes` splits into RDMA WRITEs of at most `chunk` bytes: `(offset in
/// the transfer, length)` pairs.
pub fn chunks(bytes: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let chunk = chunk.max(1);
    (0..bytes.div_ceil(chunk)).map(move |i| {
        let start = i * chunk;
        (start, chunk.min(bytes - start))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        chains: Vec<Vec<WorkRequest>>,
        refuse: bool,
    }

    impl PostSink for Recorder {
        fn post(&mut self, chain: &[WorkRequest]) -> Result<(), String> {
            if self.refuse {
                return Err("Cannot allocate memory (os error 12)".to_string());
            }
            self.chains.push(chain.to_vec());
            Ok(())
        }
    }

    fn inline(v: u64) -> Payload {
        let mut bytes = [0; INLINE_MAX];
        bytes[..8].copy_from_slice(&v.to_le_bytes());
        Payload::Inline { bytes, len: 8 }
    }

    fn push(q: &mut SendQueue, op: OpId, sink: &mut Recorder) {
        assert!(q.has_room(1));
        q.push(
            0x1000 + op * 8,
            7,
            inline(op),
            Some(op),
            WrKind::SignalSet,
            sink,
        )
        .expect("post");
    }

    #[test]
    fn chains_are_posted_every_n_and_at_flush_with_the_last_signalled() {
        let mut q = SendQueue::new(16, 4);
        let mut sink = Recorder::default();
        for op in 0..6 {
            push(&mut q, op, &mut sink);
        }
        // One chain of 4 posted by the fourth push; 2 pending.
        assert_eq!(sink.chains.len(), 1);
        let signaled: Vec<bool> = sink.chains[0].iter().map(|w| w.signaled).collect();
        assert_eq!(signaled, [false, false, false, true]);
        assert_eq!(q.outstanding(), 6);
        q.flush(&mut sink).expect("flush");
        assert_eq!(sink.chains.len(), 2);
        let signaled: Vec<bool> = sink.chains[1].iter().map(|w| w.signaled).collect();
        assert_eq!(signaled, [false, true]);
        let ids: Vec<u64> = sink.chains.iter().flatten().map(|w| w.wr_id).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
        // Flushing nothing posts nothing.
        q.flush(&mut sink).expect("flush");
        assert_eq!(sink.chains.len(), 2);
    }

    #[test]
    fn a_full_send_queue_is_busy_until_completions_free_slots() {
        let mut q = SendQueue::new(4, 2);
        let mut sink = Recorder::default();
        for op in 0..4 {
            push(&mut q, op, &mut sink);
        }
        assert!(!q.has_room(1), "depth reached: Busy");
        assert!(q.has_room(0));
        let mut done = Vec::new();
        // The first chain's signalled request (wr_id 1) completes ops 0 and 1.
        q.complete(1, &mut done).expect("posted");
        assert_eq!(done, [0, 1]);
        assert!(q.has_room(2));
        assert!(!q.has_room(3));
        q.complete(3, &mut done).expect("posted");
        assert_eq!(done, [0, 1, 2, 3]);
        assert_eq!(q.outstanding(), 0);
        assert_eq!(q.complete(3, &mut done), Err(()), "already complete");
    }

    #[test]
    fn a_pending_request_is_not_completed_by_a_completion() {
        let mut q = SendQueue::new(8, 4);
        let mut sink = Recorder::default();
        push(&mut q, 10, &mut sink);
        let mut done = Vec::new();
        assert_eq!(q.complete(0, &mut done), Err(()), "not posted yet");
        q.flush(&mut sink).expect("flush");
        q.complete(0, &mut done).expect("posted");
        assert_eq!(done, [10]);
    }

    #[test]
    fn multi_request_operations_complete_on_their_last_request() {
        let mut q = SendQueue::new(8, 8);
        let mut sink = Recorder::default();
        let gather = |addr| Payload::Gather {
            addr,
            len: 4,
            lkey: 1,
        };
        // Op 5 spans three requests, op 6 one.
        q.push(0, 1, gather(0), None, WrKind::Transfer, &mut sink)
            .expect("ok");
        q.push(4, 1, gather(4), None, WrKind::Transfer, &mut sink)
            .expect("ok");
        q.push(8, 1, gather(8), Some(5), WrKind::Transfer, &mut sink)
            .expect("ok");
        q.push(64, 1, inline(1), Some(6), WrKind::SignalAdd, &mut sink)
            .expect("ok");
        q.flush(&mut sink).expect("flush");
        // A failure of the middle request names op 5; of the signal, op 6.
        assert_eq!(
            q.failed(1),
            Failed {
                op: Some(5),
                kind: Some(WrKind::Transfer)
            }
        );
        assert_eq!(
            q.failed(3),
            Failed {
                op: Some(6),
                kind: Some(WrKind::SignalAdd)
            }
        );
        assert_eq!(q.failed(9).op, None);
        let mut done = Vec::new();
        q.complete(3, &mut done).expect("posted");
        assert_eq!(done, [5, 6]);
    }

    #[test]
    fn a_refused_post_names_the_first_operation_of_the_chain() {
        let mut q = SendQueue::new(8, 8);
        let mut sink = Recorder {
            refuse: true,
            ..Recorder::default()
        };
        q.push(0, 1, inline(0), Some(3), WrKind::Write, &mut sink)
            .expect("pending");
        q.push(8, 1, inline(0), Some(4), WrKind::Write, &mut sink)
            .expect("pending");
        let (op, message) = q.flush(&mut sink).expect_err("refused");
        assert_eq!(op, Some(3));
        assert!(message.contains("os error 12"), "{message}");
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn shadow_add_is_a_running_sum_per_word_and_set_resets_it() {
        let mut s = ShadowWords::default();
        assert!(!s.tracks(1, 8));
        let v = s.next(1, 8, 3, true);
        assert_eq!(v, 3);
        // Not committed (Busy): the next attempt computes the same value.
        assert_eq!(s.next(1, 8, 3, true), 3);
        s.commit(1, 8, v);
        let v = s.next(1, 8, 4, true);
        assert_eq!(v, 7);
        s.commit(1, 8, v);
        // Other words and peers are independent.
        assert_eq!(s.next(1, 16, 1, true), 1);
        assert_eq!(s.next(2, 8, 1, true), 1);
        // SET stores and resets.
        let v = s.next(1, 8, 100, false);
        assert_eq!(v, 100);
        s.commit(1, 8, v);
        assert_eq!(s.next(1, 8, 1, true), 101);
        // Wrapping.
        s.commit(1, 8, u64::MAX);
        assert_eq!(s.next(1, 8, 2, true), 1);
        assert!(s.tracks(1, 8));
        assert_eq!(s.current(3, 0), 0);
    }

    #[test]
    fn chunking() {
        assert_eq!(chunks(10, 4).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
        assert_eq!(chunks(1, 1 << 30).collect::<Vec<_>>(), [(0, 1)]);
        assert_eq!(chunks(0, 4).count(), 0);
    }
}
