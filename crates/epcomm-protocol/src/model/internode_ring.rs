//! The rail rings (model only, docs/protocol.md, "Chunked forwarding"), used when
//! [`crate::ModelConfig::with_rail_ring`] is set: the internode dispatch's rail rows go to the
//! forwarder through a ring there (`[I6c]`, `[I8c]`, `[I9c]`, in place of the rail half of
//! `[I6]`..`[I9]`), and the internode combine's partials go back to the source through a ring
//! there (`[J6c]`, `[J8c]`, `[J9c]`, in place of `cpart`/`cpdone`, `[J6]`..`[J8]`'s rail half).
//!
//! Each ring has `R` slots of `C` rows per peer node; an op's last chunk to a peer may hold
//! fewer than `C`. Chunks are numbered since setup, on both ends: the sender's `ring_sent` and
//! the receiver's `ring_taken` continue across ops, and the shared words (`chunks_in`,
//! `ring_credit`) only grow, so no value an earlier op left can satisfy a wait of a later one
//! and a ring needs neither a per-op credit nor a reset.
//!
//! The kernels give the sending and the receiving role different blocks. The model's one thread
//! per rank interleaves them without blocking: it sends the next chunk to a peer whose slot is
//! free, takes the next chunk that has landed, and waits (bounded) only when neither can move.
//! Running the roles one after the other instead would deadlock as soon as a rank has more
//! chunks to send than a ring holds: two peers each blocked sending wait for the other to take.

use super::violation::Region;
use super::wait::Poll;
use super::{Rank, Stop};
use crate::config::{Mutation, RailRing};
use crate::step::Step;
use crate::sync::Ordering;

/// Which ring: the dispatch's (at the forwarder) or the combine's (at the source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RingOf {
    /// Rail rows of the internode dispatch, source → forwarder.
    Dispatch,
    /// Partials of the internode combine, forwarder → source.
    Combine,
}

impl RingOf {
    /// Its index in the per-ring arrays.
    pub(super) fn index(self) -> usize {
        match self {
            RingOf::Dispatch => 0,
            RingOf::Combine => 1,
        }
    }

    /// Its steps: send a chunk, wait for a chunk, take a chunk.
    fn steps(self) -> (Step, Step, Step) {
        match self {
            RingOf::Dispatch => (Step::I6c, Step::I8c, Step::I9c),
            RingOf::Combine => (Step::J6c, Step::J8c, Step::J9c),
        }
    }

    fn region(self) -> Region {
        match self {
            RingOf::Dispatch => Region::Ring,
            RingOf::Combine => Region::PRing,
        }
    }
}

/// What this rank sends one rail peer through its ring in this op: the rows, in order (chunks
/// of `C` of them).
pub(super) struct RingSend {
    /// The peer's node.
    pub node: usize,
    /// The peer (my rail peer in `node`).
    pub peer: usize,
    /// The rows (the dispatch's data words, the combine's partials).
    pub rows: Vec<u64>,
}

/// What this rank takes from one rail peer's chunks in this op: the rows it must find, in
/// order.
pub(super) struct RingTake {
    /// The peer's node.
    pub node: usize,
    /// The peer (my rail peer in `node`).
    pub peer: usize,
    /// The rows the peer must have sent, in order: each taken row is checked against its own.
    pub expected: Vec<u64>,
}

/// What a ring exchange does with each row it takes (after checking it, before the chunk's
/// credit): `(rank, takes index, row index in the op, value)`.
pub(super) type TakeRow<'t, 'w> = dyn FnMut(&Rank<'w>, usize, usize, u64) -> Result<(), Stop> + 't;

/// The role a wait is for.
enum Pending {
    Send(usize),
    Take(usize),
}

impl<'w> Rank<'w> {
    /// Sends `sends` through the peers' rings `of` (of `ring`'s shape) and takes every chunk of
    /// `takes` from mine, interleaved. Each row taken is checked against its expectation, then handed to `take`
    /// (`takes` index, row index in the op, value) before the chunk's credit is stored.
    pub(super) fn ring_exchange(
        &mut self,
        (of, ring): (RingOf, RailRing),
        sends: &[RingSend],
        takes: &[RingTake],
        take: &mut TakeRow<'_, 'w>,
    ) -> Result<(), Stop> {
        // Rows sent per peer and taken per peer in this op (whole chunks, the last partial).
        let mut sent = vec![0usize; sends.len()];
        let mut taken = vec![0usize; takes.len()];
        loop {
            let mut moved = false;
            for (s, send) in sends.iter().enumerate() {
                while sent[s] < send.rows.len() && self.slot_free(of, ring, send.node) {
                    let end = send.rows.len().min(sent[s] + ring.chunk_rows);
                    self.send_chunk((of, ring), send, &send.rows[sent[s]..end])?;
                    sent[s] = end;
                    moved = true;
                }
            }
            for (f, from) in takes.iter().enumerate() {
                while taken[f] < from.expected.len() && self.chunk_landed(of, from.node) {
                    let end = from.expected.len().min(taken[f] + ring.chunk_rows);
                    self.take_chunk((of, ring), f, from, taken[f]..end, take)?;
                    taken[f] = end;
                    moved = true;
                }
            }
            if moved {
                continue;
            }
            // Neither role can move: wait (bounded) until one can, naming the first peer
            // still owed something (a send's before a take's).
            let pending = sends
                .iter()
                .enumerate()
                .find(|&(s, send)| sent[s] < send.rows.len())
                .map(|(s, _)| Pending::Send(s))
                .or_else(|| {
                    (0..takes.len())
                        .find(|&f| taken[f] < takes[f].expected.len())
                        .map(Pending::Take)
                });
            let Some(pending) = pending else { break };
            let (send_step, wait_step, _) = of.steps();
            let words = self.w.ring_words(of, self.me);
            let (step, peer, expected, word) = match pending {
                Pending::Send(s) => {
                    let k = sends[s].node;
                    let g = self.ring_sent[of.index()][k];
                    let needed = (g + 1).saturating_sub(ring.slots as u64);
                    (send_step, sends[s].peer, needed, &words.credit[k])
                }
                Pending::Take(f) => {
                    let k = takes[f].node;
                    let g = self.ring_taken[of.index()][k];
                    (wait_step, takes[f].peer, g + 1, &words.chunks_in[k])
                }
            };
            self.wait(step, peer, expected, || {
                for (s, send) in sends.iter().enumerate() {
                    if sent[s] < send.rows.len() && self.slot_free(of, ring, send.node) {
                        return Ok(Poll::Ready(()));
                    }
                }
                for (f, from) in takes.iter().enumerate() {
                    if taken[f] < from.expected.len() && self.chunk_landed(of, from.node) {
                        return Ok(Poll::Ready(()));
                    }
                }
                // What the named peer's word holds, reported if the wait times out (under
                // loom, which has no timeout, not loaded: a load is one more schedule point).
                #[cfg(loom)]
                let seen = {
                    let _ = word;
                    0
                };
                #[cfg(not(loom))]
                let seen = word.load(Ordering::Relaxed);
                Ok(Poll::Pending(seen))
            })?;
        }
        Ok(())
    }

    /// Whether the slot of my next chunk to the peer in node `k` is free:
    /// `credit[k] >= g + 1 - R` (acquire), always under [`Mutation::RingSkipCredit`].
    fn slot_free(&self, of: RingOf, ring: RailRing, k: usize) -> bool {
        if of == RingOf::Dispatch && self.cfg.has(Mutation::RingSkipCredit) {
            return true;
        }
        let g = self.ring_sent[of.index()][k];
        let slots = ring.slots as u64;
        let credit = self.w.ring_words(of, self.me).credit[k].load(Ordering::Acquire);
        credit + slots > g
    }

    /// Whether the next chunk of the peer in node `k` landed: `chunks_in[k] >= g + 1`
    /// (acquire), always under [`Mutation::RingSkipChunkWait`] (the dispatch's ring) and
    /// [`Mutation::PartialRingSkipChunkWait`] (the combine's).
    fn chunk_landed(&self, of: RingOf, k: usize) -> bool {
        let skip = match of {
            RingOf::Dispatch => Mutation::RingSkipChunkWait,
            RingOf::Combine => Mutation::PartialRingSkipChunkWait,
        };
        if self.cfg.has(skip) {
            return true;
        }
        let g = self.ring_taken[of.index()][k];
        self.w.ring_words(of, self.me).chunks_in[k].load(Ordering::Acquire) > g
    }

    /// `[I6c]`/`[J6c]`: my next chunk (`rows`, at most `C`) into slot `g % R` of the peer's
    /// ring for my node (relaxed), then `chunks_in[n] := g + 1` on it (release). The slot is
    /// free: `slot_free` said so (unless [`Mutation::RingSkipCredit`] skipped it, dispatch ring).
    fn send_chunk(
        &mut self,
        (of, ring): (RingOf, RailRing),
        send: &RingSend,
        rows: &[u64],
    ) -> Result<(), Stop> {
        let (step, _, _) = of.steps();
        self.step(step)?;
        let n = self.cfg.node_of(self.me);
        let g = self.ring_sent[of.index()][send.node];
        let slot = (g % ring.slots as u64) as usize;
        for (r, &row) in rows.iter().enumerate() {
            self.write(step, || {
                self.w
                    .ring_row(of, send.peer, n, slot, r)
                    .store(row, Ordering::Relaxed);
            })?;
        }
        self.write(step, || {
            self.w.ring_words(of, send.peer).chunks_in[n].store(g + 1, Ordering::Release);
        })?;
        self.ring_sent[of.index()][send.node] = g + 1;
        Ok(())
    }

    /// `[I8c]`/`[J8c]` then `[I9c]`/`[J9c]`: the next chunk of `from` (landed; its rows: `rows`
    /// of the op's), each checked and handed to `take`, then `credit[n] := g + 1` on the peer
    /// (release; `g + 2` under [`Mutation::RingCreditAhead`], the dispatch's ring).
    fn take_chunk(
        &mut self,
        (of, ring): (RingOf, RailRing),
        f: usize,
        from: &RingTake,
        rows: std::ops::Range<usize>,
        take: &mut TakeRow<'_, 'w>,
    ) -> Result<(), Stop> {
        let cfg = self.cfg;
        let (_, wait_step, take_step) = of.steps();
        self.step(wait_step)?;
        self.step(take_step)?;
        let n = cfg.node_of(self.me);
        let g = self.ring_taken[of.index()][from.node];
        let slot = (g % ring.slots as u64) as usize;
        for (r, index) in rows.enumerate() {
            let expected = from.expected[index];
            let row = self
                .w
                .ring_row(of, self.me, from.node, slot, r)
                .load(Ordering::Relaxed);
            if row != expected {
                let at = slot * ring.chunk_rows + r;
                return Err(self
                    .data_violation(take_step, of.region(), from.node, at, expected, row)
                    .into());
            }
            take(self, f, index, row)?;
        }
        let credit = if of == RingOf::Dispatch && cfg.has(Mutation::RingCreditAhead) {
            g + 2
        } else {
            g + 1
        };
        self.write(take_step, || {
            self.w.ring_words(of, from.peer).credit[n].store(credit, Ordering::Release);
        })?;
        self.ring_taken[of.index()][from.node] = g + 1;
        Ok(())
    }
}
