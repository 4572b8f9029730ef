//! Chunked forwarding of the internode dispatch (model only): `[I6c]`, `[I8c]`, `[I9c]`
//! (docs/protocol.md, "Chunked forwarding"), which replace the rail half of `[I6]`..`[I9]`
//! when [`crate::ModelConfig::with_rail_ring`] is set.
//!
//! Each source node's rail rows move through a ring of `R` slots of `C` rows at the forwarder;
//! an op's last chunk to a peer may hold fewer than `C`. Chunks are numbered since setup, on both ends: the sender's
//! `ring_sent[k]` and the forwarder's `ring_forwarded[k]` continue across ops, cached or not,
//! and the shared words (`chunks_in`, `ring_credit`) only grow, so no value an earlier op left
//! can satisfy a wait of a later one and the ring needs neither a per-op credit nor a reset.
//!
//! The kernels give the sender and the forwarder different blocks. The model's one thread per
//! rank interleaves the two roles without blocking: it sends the next chunk to a rail peer
//! whose slot is free, forwards the next chunk that has landed, and waits (bounded) only when
//! neither role can move. Running the roles one after the other instead would deadlock as soon
//! as a rank has more chunks to send than the ring holds: two rail peers each blocked in
//! `[I6c]` wait for the other's `[I9c]`.

use super::violation::Region;
use super::wait::Poll;
use super::{InterLayout, Rank, Stop};
use crate::config::{Mutation, data_word, routes_to};
use crate::step::Step;
use crate::sync::Ordering;

/// What this rank sends one rail peer in this op: its chunks (tokens, in order).
pub(super) struct RingSend {
    /// The peer's node.
    pub node: usize,
    /// The peer, `(node, my local index)`.
    pub peer: usize,
    /// My tokens that cross to `node`, in order: chunks of `C` of them.
    pub tokens: Vec<usize>,
}

/// What this rank forwards for one rail source in this op.
struct RingForward {
    node: usize,
    src: usize,
    /// The source's tokens crossing to my node (the rows it sends me, in order).
    tokens: Vec<usize>,
    /// Rows forwarded so far in this op.
    done: usize,
    /// `next[j]`: the next slot in rank `(my node, j)`'s `xrecv[i%2][src]`.
    next: Vec<usize>,
}

/// The role that moved, or the one a wait is for.
enum Move {
    Send(usize),
    Forward(usize),
}

impl Rank<'_> {
    /// `[I6c]`..`[I9c]` of internode dispatch `i` (data parity `par`, routing `layout_seq`):
    /// sends `sends` through the rail peers' rings and forwards every chunk the rail sources of
    /// `layout` send this rank, interleaved, then signals `idone` per source as `[I9]` does.
    pub(super) fn ring_exchange(
        &mut self,
        i: u64,
        par: usize,
        layout_seq: u64,
        sends: &[RingSend],
        layout: &InterLayout,
    ) -> Result<(), Stop> {
        let cfg = self.cfg;
        let (me, lsz) = (self.me, cfg.local_ranks());
        let (n, l) = (cfg.node_of(me), cfg.local_of(me));
        let ring = cfg
            .rail_ring()
            .expect("ring_exchange runs only with a ring");
        // Rows sent per peer in this op (whole chunks, the last one possibly partial).
        let mut sent = vec![0usize; sends.len()];
        let mut forwards: Vec<RingForward> = (0..cfg.nodes())
            .filter(|&k| k != n && layout.rail[k] > 0)
            .map(|k| {
                let src = cfg.rank_of(k, l);
                let tokens = (0..cfg.tokens())
                    .filter(|&t| (0..lsz).any(|j| routes_to(layout_seq, src, t, cfg.rank_of(n, j))))
                    .take(layout.rail[k] as usize)
                    .collect();
                RingForward {
                    node: k,
                    src,
                    tokens,
                    done: 0,
                    next: vec![0; lsz],
                }
            })
            .collect();
        loop {
            let mut moved = false;
            for (s, send) in sends.iter().enumerate() {
                while sent[s] < send.tokens.len() && self.slot_free(send) {
                    let end = send.tokens.len().min(sent[s] + ring.chunk_rows);
                    self.send_chunk(i, send, &send.tokens[sent[s]..end])?;
                    sent[s] = end;
                    moved = true;
                }
            }
            for f in &mut forwards {
                while f.done < f.tokens.len() && self.chunk_landed(f.node) {
                    self.forward_chunk(i, par, layout_seq, f)?;
                    moved = true;
                }
            }
            if moved {
                continue;
            }
            // Neither role can move: wait (bounded) until one can, naming the first peer
            // still owed something (a sender's rail peer before a forwarder's source).
            let pending = sends
                .iter()
                .enumerate()
                .find(|&(s, send)| sent[s] < send.tokens.len())
                .map(|(s, _)| Move::Send(s))
                .or_else(|| {
                    forwards
                        .iter()
                        .position(|f| f.done < f.tokens.len())
                        .map(Move::Forward)
                });
            let Some(pending) = pending else { break };
            let me_words = &self.w.ranks[me];
            let (step, peer, expected, word) = match pending {
                Move::Send(s) => {
                    let k = sends[s].node;
                    let needed = (self.ring_sent[k] + 1).saturating_sub(ring.slots as u64);
                    (Step::I6c, sends[s].peer, needed, &me_words.ring_credit[k])
                }
                Move::Forward(f) => {
                    let k = forwards[f].node;
                    let needed = self.ring_forwarded[k] + 1;
                    (Step::I8c, forwards[f].src, needed, &me_words.chunks_in[k])
                }
            };
            self.wait(step, peer, expected, || {
                for (s, send) in sends.iter().enumerate() {
                    if sent[s] < send.tokens.len() && self.slot_free(send) {
                        return Ok(Poll::Ready(()));
                    }
                }
                for f in &forwards {
                    if f.done < f.tokens.len() && self.chunk_landed(f.node) {
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
        // [I9c], end of the op: `idone[src] := i` on each rank of my node a source's rows went to.
        for f in &forwards {
            for (j, &count) in f.next.iter().enumerate() {
                if count > 0 {
                    let d = cfg.rank_of(n, j);
                    self.write(Step::I9c, || {
                        self.w.ranks[d].idone[f.src].store(i, Ordering::Release);
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Whether the slot of my next chunk to `send.node` is free: `ring_credit >= g + 1 - R`
    /// (acquire), always under [`Mutation::RingSkipCredit`].
    fn slot_free(&self, send: &RingSend) -> bool {
        let g = self.ring_sent[send.node];
        let slots = self.cfg.rail_ring().map_or(1, |r| r.slots) as u64;
        if self.cfg.has(Mutation::RingSkipCredit) {
            return true;
        }
        let credit = self.w.ranks[self.me].ring_credit[send.node].load(Ordering::Acquire);
        credit + slots > g
    }

    /// Whether the next chunk of the rail peer in node `k` landed: `chunks_in[k] >= g + 1`
    /// (acquire), always under [`Mutation::RingSkipChunkWait`].
    fn chunk_landed(&self, k: usize) -> bool {
        if self.cfg.has(Mutation::RingSkipChunkWait) {
            return true;
        }
        let g = self.ring_forwarded[k];
        self.w.ranks[self.me].chunks_in[k].load(Ordering::Acquire) > g
    }

    /// `[I6c]`: my next chunk (the rows of `tokens`, at most `C`) into the peer's
    /// `ring[n][g % R]` (relaxed), then `chunks_in[n] := g + 1` on it (release).
    fn send_chunk(&mut self, i: u64, send: &RingSend, tokens: &[usize]) -> Result<(), Stop> {
        self.step(Step::I6c)?;
        let n = self.cfg.node_of(self.me);
        let g = self.ring_sent[send.node];
        let slot = (g % self.cfg.rail_ring().map_or(1, |r| r.slots) as u64) as usize;
        for (r, &t) in tokens.iter().enumerate() {
            let row = data_word(i, self.me, t);
            self.write(Step::I6c, || {
                self.w
                    .ring(send.peer, n, slot, r)
                    .store(row, Ordering::Relaxed);
            })?;
        }
        self.write(Step::I6c, || {
            self.w.ranks[send.peer].chunks_in[n].store(g + 1, Ordering::Release);
        })?;
        self.ring_sent[send.node] = g + 1;
        Ok(())
    }

    /// `[I8c]`/`[I9c]`: the next chunk of `f`'s source (landed; its rows: the next `C` of the
    /// op, fewer for its last) into each rank of my node each row goes to, then
    /// `ring_credit[n] := g + 1` on the source (release; `g + 2` under
    /// [`Mutation::RingCreditAhead`]).
    fn forward_chunk(
        &mut self,
        i: u64,
        par: usize,
        layout_seq: u64,
        f: &mut RingForward,
    ) -> Result<(), Stop> {
        let cfg = self.cfg;
        self.step(Step::I8c)?;
        self.step(Step::I9c)?;
        let ring = cfg
            .rail_ring()
            .expect("forward_chunk runs only with a ring");
        let n = cfg.node_of(self.me);
        let g = self.ring_forwarded[f.node];
        let slot = (g % ring.slots as u64) as usize;
        let end = f.tokens.len().min(f.done + ring.chunk_rows);
        for (r, &t) in f.tokens[f.done..end].iter().enumerate() {
            let expected = data_word(i, f.src, t);
            let row = self
                .w
                .ring(self.me, f.node, slot, r)
                .load(Ordering::Relaxed);
            if row != expected {
                let at = slot * ring.chunk_rows + r;
                return Err(self
                    .data_violation(Step::I9c, Region::Ring, f.node, at, expected, row)
                    .into());
            }
            for j in 0..cfg.local_ranks() {
                let d = cfg.rank_of(n, j);
                if routes_to(layout_seq, f.src, t, d) {
                    let at = f.next[j];
                    f.next[j] += 1;
                    self.write(Step::I9c, || {
                        self.w
                            .xrecv(d, par, f.src, at)
                            .store(row, Ordering::Relaxed);
                    })?;
                }
            }
        }
        let credit = if cfg.has(Mutation::RingCreditAhead) {
            g + 2
        } else {
            g + 1
        };
        self.write(Step::I9c, || {
            self.w.ranks[f.src].ring_credit[n].store(credit, Ordering::Release);
        })?;
        self.ring_forwarded[f.node] = g + 1;
        f.done = end;
        Ok(())
    }
}
