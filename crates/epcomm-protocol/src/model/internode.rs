//! The hierarchical internode dispatch (model only: the kernels do not exist yet), `[I1]`..
//! `[I12]` (and the Global schedule's `[G1]` barrier).
//!
//! Ranks are `(node n, local l)`, rank `n * L + l`. A token of source `(ns, ls)` crosses the
//! network once per destination node `k != ns`, to the rail peer `(k, ls)`, which forwards it
//! over NVLink to the ranks of node `k` it goes to; ranks of the source's own node get it
//! directly. Everything is point to point: counts travel as epoch-tagged words on the rail and
//! over NVLink, the receive sizes are computed from them, and each wait names one peer.
//!
//! Contract: the op has its own sequence number `i` (data regions `i % 2`, done values) and
//! notify sequence `m` (count regions `m % 2`, tags); a cached op reuses the layout this rank
//! learned from the count words of the last non-cached one. The output, by source then token,
//! equals the flat dispatch's for the same layout, and stays live (re-checked by `[R]`) until
//! this rank's next internode dispatch starts and releases it with `[I1]`.

use epcomm_topology::Schedule;

use super::internode_ring::{RingOf, RingSend, RingTake};
use super::violation::{Region, Violation};
use super::wait::Poll;
use super::{InterLayout, InterLive, Rank, Stop};
use crate::config::{
    Mutation, RailRing, count_word, data_word, route_count, routes_to, split_count_word,
};
use crate::outcome::OpOutput;
use crate::step::Step;
use crate::sync::{AtomicU64, Ordering};

impl Rank<'_> {
    /// Runs one internode dispatch as this rank (`cached`: reusing the last internode layout).
    pub(super) fn internode_dispatch(&mut self, cached: bool) -> Result<OpOutput, Stop> {
        let cfg = self.cfg;
        let (me, wsz, tokens) = (self.me, cfg.world(), cfg.tokens());
        let (nodes, lsz) = (cfg.nodes(), cfg.local_ranks());
        let (n, l) = (cfg.node_of(me), cfg.local_of(me));
        self.seq.inter_seq += 1;
        let i = self.seq.inter_seq;
        let par = cfg.parity(i);
        if !cached {
            self.seq.inter_notify_seq += 1;
        }
        let m = self.seq.inter_notify_seq;
        let mpar = cfg.parity(m);
        let layout_seq = if cached { self.inter_layout.seq } else { i };
        if cfg.schedule() == Schedule::Global {
            // [G1] barrier (the baseline): every rank finished its previous op.
            self.barrier(Step::G1)?;
        }
        let local_peers: Vec<usize> = (0..lsz).map(|j| cfg.rank_of(n, j)).collect();
        let rail_peers: Vec<(usize, usize)> = (0..nodes)
            .filter(|&k| k != n)
            .map(|k| (k, cfg.rank_of(k, l)))
            .collect();
        // Whether token t of src crosses to node k (goes to at least one of its ranks).
        let crosses = |src: usize, t: usize, k: usize| {
            (0..lsz).any(|j| routes_to(layout_seq, src, t, cfg.rank_of(k, j)))
        };
        let crossing = |src: usize, k: usize| -> Vec<usize> {
            (0..tokens).filter(|&t| crosses(src, t, k)).collect()
        };

        // [I1] release credit: the previous internode op's output and rail rows are no longer
        // read; every rank that may write my internode regions learns it (release).
        self.step(Step::I1)?;
        for d in local_peers
            .iter()
            .copied()
            .chain(rail_peers.iter().map(|&(_, p)| p))
        {
            self.write(Step::I1, || {
                self.w.ranks[d].credit[me].store(i - 1, Ordering::Release);
            })?;
        }

        let count_load = self.ordering(Mutation::CountLoadsRelaxed, Ordering::Acquire);
        if !cached {
            // [I2] write rail counts (relaxed, tagged m): my count for each rank of node k and
            // my number of rows crossing to k, into my rail peer in k.
            self.step(Step::I2)?;
            for &(k, p) in &rail_peers {
                for j in 0..=lsz {
                    let c = if j < lsz {
                        route_count(layout_seq, tokens, me, cfg.rank_of(k, j))
                    } else {
                        crossing(me, k).len() as u64
                    };
                    self.write(Step::I2, || {
                        self.w
                            .rail_count(p, mpar, n, j)
                            .store(count_word(m, c), Ordering::Relaxed);
                    })?;
                }
            }
            // [I3] write local counts (relaxed, tagged m) into every rank of my node.
            self.step(Step::I3)?;
            for &d in &local_peers {
                let c = route_count(layout_seq, tokens, me, d);
                self.write(Step::I3, || {
                    self.w
                        .xcount(d, mpar, me)
                        .store(count_word(m, c), Ordering::Relaxed);
                })?;
            }
            // [I4] per rail source: wait until its count words carry tag m (acquire), then relay
            // its counts for my node's ranks over NVLink, tagged m.
            self.step(Step::I4)?;
            let mut rail = vec![0u64; nodes];
            let mut fwd = vec![0u64; nodes * lsz];
            for &(k, src) in &rail_peers {
                for j in 0..=lsz {
                    let word = self.w.rail_count(me, mpar, k, j);
                    let count = if cfg.has(Mutation::InterSkipRailCountWait) {
                        // Mutated: take the word as it is (the model still checks its tag).
                        let (tag, count) = split_count_word(word.load(count_load));
                        if tag != m {
                            return Err(self
                                .inter_count_tag(Step::I4, "rail_count", mpar, k, j, m, tag)
                                .into());
                        }
                        count
                    } else {
                        self.wait_tag(Step::I4, src, word, m, count_load, |tag| {
                            self.inter_count_tag(Step::I4, "rail_count", mpar, k, j, m, tag)
                        })?
                    };
                    let (expected, dst) = if j < lsz {
                        let d = cfg.rank_of(n, j);
                        (route_count(layout_seq, tokens, src, d), d)
                    } else {
                        (crossing(src, n).len() as u64, me)
                    };
                    let count = self.check_count_value(Step::I4, expected, src, dst, count)?;
                    if j < lsz {
                        fwd[k * lsz + j] = count;
                    } else {
                        rail[k] = count;
                    }
                }
                for (j, &d) in local_peers.iter().enumerate() {
                    let word = count_word(m, fwd[k * lsz + j]);
                    self.write(Step::I4, || {
                        self.w.xcount(d, mpar, src).store(word, Ordering::Relaxed);
                    })?;
                }
            }
            self.inter_layout = InterLayout {
                seq: i,
                recv: Vec::new(),
                rail,
                fwd,
            };
        }
        let layout = self.inter_layout.clone();

        // What I write this op: my rows per rail peer and per local rank, and the local ranks
        // I forward to (known from the counts, or the cached layout).
        let my_rail: Vec<(usize, Vec<usize>)> = rail_peers
            .iter()
            .map(|&(k, p)| (p, crossing(me, k)))
            .filter(|(_, ts)| !ts.is_empty())
            .collect();
        let my_local: Vec<(usize, Vec<usize>)> = local_peers
            .iter()
            .map(|&d| {
                let ts = (0..tokens)
                    .filter(|&t| routes_to(layout_seq, me, t, d))
                    .collect();
                (d, ts)
            })
            .filter(|(_, ts): &(usize, Vec<usize>)| !ts.is_empty())
            .collect();
        // Chunked forwarding: the ring's chunk counts guard the rail peers' slots, so [I5]
        // waits only for the ranks of my node.
        let ring = cfg.rail_ring().is_some();
        let mut targets: Vec<usize> = my_rail
            .iter()
            .filter(|_| !ring)
            .chain(&my_local)
            .map(|(p, _)| *p)
            .collect();
        for &(k, _) in &rail_peers {
            for (j, &d) in local_peers.iter().enumerate() {
                if layout.fwd[k * lsz + j] > 0 {
                    targets.push(d);
                }
            }
        }
        targets.sort_unstable();
        targets.dedup();

        // [I5] wait credit: every peer I write into this op has released op i - 2, the last
        // op that used the same parity (acquire).
        self.step(Step::I5)?;
        if i > 2 && !cfg.has(Mutation::InterSkipCredit) {
            for &p in &targets {
                let word = &self.w.ranks[me].credit[p];
                self.wait_geq(Step::I5, p, word, i - 2, Ordering::Acquire)?;
            }
        }

        // [I6] write my rows (relaxed): once per destination node over the rail, directly to
        // the ranks of my node.
        self.step(Step::I6)?;
        for (p, ts) in my_rail.iter().filter(|_| !ring) {
            for (r, &t) in ts.iter().enumerate() {
                self.write(Step::I6, || {
                    self.w
                        .rail_buf(*p, par, n, r)
                        .store(data_word(i, me, t), Ordering::Relaxed);
                })?;
            }
        }
        for (d, ts) in &my_local {
            for (j, &t) in ts.iter().enumerate() {
                self.write(Step::I6, || {
                    self.w
                        .xrecv(*d, par, me, j)
                        .store(data_word(i, me, t), Ordering::Relaxed);
                })?;
            }
        }
        // [I7] signal my rows (release), only to the peers that got some.
        self.step(Step::I7)?;
        for (p, _) in my_rail.iter().filter(|_| !ring) {
            self.write(Step::I7, || {
                self.w.ranks[*p].rail_done[n].store(i, Ordering::Release);
            })?;
        }
        for (d, _) in &my_local {
            self.write(Step::I7, || {
                self.w.ranks[*d].idone[me].store(i, Ordering::Release);
            })?;
        }

        if let Some(rail_ring) = cfg.rail_ring() {
            self.ring_dispatch(i, par, (layout_seq, rail_ring), my_rail, &layout)?;
        }
        // The forwarder: per rail source that sends me rows.
        for &(k, src) in rail_peers.iter().filter(|_| !ring) {
            let rows = layout.rail[k] as usize;
            if rows == 0 {
                continue;
            }
            // [I8] wait rail rows: rail_done[k] >= i (acquire).
            self.step(Step::I8)?;
            let word = &self.w.ranks[me].rail_done[k];
            self.wait_geq(Step::I8, src, word, i, Ordering::Acquire)?;
            // [I9] forward each rail row to the ranks of my node it goes to (relaxed), then
            // signal each of them (release).
            self.step(Step::I9)?;
            let expected_tokens = crossing(src, n);
            let mut next = vec![0usize; lsz];
            for (r, &t) in expected_tokens.iter().enumerate().take(rows) {
                let expected = data_word(i, src, t);
                let row = self.w.rail_buf(me, par, k, r).load(Ordering::Relaxed);
                if row != expected {
                    let slot = k * tokens + r;
                    return Err(self
                        .data_violation(Step::I9, Region::RailBuf, par, slot, expected, row)
                        .into());
                }
                // The row carries its routing (the kernels: its top-k metadata).
                for (j, &d) in local_peers.iter().enumerate() {
                    if routes_to(layout_seq, src, t, d) {
                        let slot = next[j];
                        next[j] += 1;
                        self.write(Step::I9, || {
                            self.w
                                .xrecv(d, par, src, slot)
                                .store(row, Ordering::Relaxed);
                        })?;
                    }
                }
            }
            for (j, &d) in local_peers.iter().enumerate() {
                if next[j] > 0 {
                    self.write(Step::I9, || {
                        self.w.ranks[d].idone[src].store(i, Ordering::Release);
                    })?;
                }
            }
        }

        // The one writer of my `xcount[s]` and `idone[s]`, which the waits below name: `s`
        // itself in my node, its rail peer in my node (the forwarder) otherwise.
        let writer = |s: usize| {
            if cfg.node_of(s) == n {
                s
            } else {
                cfg.rank_of(n, cfg.local_of(s))
            }
        };

        // [I10] receive sizes: every source's count word for me, tagged m (acquire); cached:
        // the layout's.
        let recv: Vec<u64> = if cached {
            layout.recv.clone()
        } else {
            self.step(Step::I10)?;
            let mut recv = Vec::with_capacity(wsz);
            for s in 0..wsz {
                let word = self.w.xcount(me, mpar, s);
                let count = self.wait_tag(Step::I10, writer(s), word, m, count_load, |tag| {
                    self.inter_count_tag(Step::I10, "xcount", mpar, s, 0, m, tag)
                })?;
                recv.push(self.check_count(Step::I10, layout_seq, s, me, count)?);
            }
            self.inter_layout.recv = recv.clone();
            recv
        };

        // [I11] wait done: idone[s] >= i for exactly the sources I receive from (acquire).
        self.step(Step::I11)?;
        for (s, &c) in recv.iter().enumerate() {
            if c == 0 || (cfg.has(Mutation::InterSkipForwardDoneWait) && cfg.node_of(s) != n) {
                continue;
            }
            let word = &self.w.ranks[me].idone[s];
            self.wait_geq(Step::I11, writer(s), word, i, Ordering::Acquire)?;
        }

        // [I12] read the output: (non-cached) the count words must still carry tag m; then the
        // rows, by source then token.
        self.step(Step::I12)?;
        if !cached {
            for s in 0..wsz {
                let (tag, count) = split_count_word(self.w.xcount(me, mpar, s).load(count_load));
                if tag != m {
                    return Err(self
                        .inter_count_tag(Step::I12, "xcount", mpar, s, 0, m, tag)
                        .into());
                }
                self.check_count(Step::I12, layout_seq, s, me, count)?;
            }
        }
        let mut rows = Vec::new();
        let mut live = Vec::new();
        for s in 0..wsz {
            let mine = (0..tokens).filter(|&t| routes_to(layout_seq, s, t, me));
            for (j, t) in mine.enumerate() {
                let expected = data_word(i, s, t);
                let found = self.w.xrecv(me, par, s, j).load(Ordering::Relaxed);
                if found != expected {
                    let slot = s * tokens + j;
                    return Err(self
                        .data_violation(Step::I12, Region::XRecv, par, slot, expected, found)
                        .into());
                }
                rows.push(found);
                live.push((s, j, found));
            }
        }
        self.inter_live = Some(InterLive {
            parity: par,
            rows: live,
        });
        Ok(OpOutput::Dispatch { seq: i, rows })
    }

    /// Bounded wait until the tagged count `word` (written by `peer`) carries tag `m`
    /// (acquire); a newer tag is a violation (`newer`).
    fn wait_tag(
        &self,
        step: Step,
        peer: usize,
        word: &AtomicU64,
        m: u64,
        order: Ordering,
        newer: impl Fn(u64) -> Violation,
    ) -> Result<u64, Stop> {
        self.wait(step, peer, m, || {
            let (tag, count) = split_count_word(word.load(order));
            if tag == m {
                Ok(Poll::Ready(count))
            } else if tag > m {
                Err(newer(tag))
            } else {
                Ok(Poll::Pending(tag))
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn inter_count_tag(
        &self,
        step: Step,
        word: &'static str,
        parity: usize,
        src: usize,
        index: usize,
        expected: u64,
        found: u64,
    ) -> Violation {
        Violation::InterCountTag {
            rank: self.me,
            op: self.op,
            kind: self.kind,
            step,
            word,
            parity,
            src,
            index,
            expected,
            found,
        }
    }
}

impl Rank<'_> {
    /// `[I6c]`, `[I8c]`, `[I9c]` of internode dispatch `i`: my rail rows (`my_rail`: per rail
    /// peer, my tokens crossing to its node) through my rail peers' rings, and the chunks of
    /// every rail source of `layout` through mine, each row forwarded to the ranks of my node
    /// it goes to; then `idone` per source as `[I9]` does.
    fn ring_dispatch(
        &mut self,
        i: u64,
        par: usize,
        (layout_seq, ring): (u64, RailRing),
        my_rail: Vec<(usize, Vec<usize>)>,
        layout: &InterLayout,
    ) -> Result<(), Stop> {
        let cfg = self.cfg;
        let (me, lsz) = (self.me, cfg.local_ranks());
        let (n, l) = (cfg.node_of(me), cfg.local_of(me));
        let local_peers: Vec<usize> = (0..lsz).map(|j| cfg.rank_of(n, j)).collect();
        let sends: Vec<RingSend> = my_rail
            .into_iter()
            .map(|(peer, tokens)| RingSend {
                node: cfg.node_of(peer),
                peer,
                rows: tokens.iter().map(|&t| data_word(i, me, t)).collect(),
            })
            .collect();
        // Per rail source that sends me rows: its tokens crossing to my node, in order.
        let sources: Vec<(usize, usize, Vec<usize>)> = (0..cfg.nodes())
            .filter(|&k| k != n && layout.rail[k] > 0)
            .map(|k| {
                let src = cfg.rank_of(k, l);
                let tokens = (0..cfg.tokens())
                    .filter(|&t| {
                        local_peers
                            .iter()
                            .any(|&d| routes_to(layout_seq, src, t, d))
                    })
                    .take(layout.rail[k] as usize)
                    .collect();
                (k, src, tokens)
            })
            .collect();
        let takes: Vec<RingTake> = sources
            .iter()
            .map(|(k, src, tokens)| RingTake {
                node: *k,
                peer: *src,
                expected: tokens.iter().map(|&t| data_word(i, *src, t)).collect(),
            })
            .collect();
        // next[f][j]: the next slot in rank (my node, j)'s xrecv[i%2][source f].
        let mut next = vec![vec![0usize; lsz]; sources.len()];
        self.ring_exchange(
            (RingOf::Dispatch, ring),
            &sends,
            &takes,
            &mut |r, f, index, row| {
                let (_, src, ref tokens) = sources[f];
                for (j, &d) in local_peers.iter().enumerate() {
                    if routes_to(layout_seq, src, tokens[index], d) {
                        let slot = next[f][j];
                        next[f][j] += 1;
                        r.write(Step::I9c, || {
                            r.w.xrecv(d, par, src, slot).store(row, Ordering::Relaxed);
                        })?;
                    }
                }
                Ok(())
            },
        )?;
        // [I9c], end of the op: idone[src] := i on each rank of my node a source's rows went to.
        for (f, &(_, src, _)) in sources.iter().enumerate() {
            for (j, &d) in local_peers.iter().enumerate() {
                if next[f][j] > 0 {
                    self.write(Step::I9c, || {
                        self.w.ranks[d].idone[src].store(i, Ordering::Release);
                    })?;
                }
            }
        }
        Ok(())
    }
}
