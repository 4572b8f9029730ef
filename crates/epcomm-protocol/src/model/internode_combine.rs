//! The hierarchical internode combine (model only: the kernels do not exist yet), `[J1]`..
//! `[J9]` (and the Global schedule's `[G1]` barrier).
//!
//! Every rank returns the rows of its live internode dispatch output (cached or not) to their
//! sources, reusing that dispatch's layout. A row of a source `(k, ls)` in another node goes to
//! the rank that forwarded it in the dispatch, the rail peer `(n, ls)` of my node, which
//! reduces its node's contributions into **one partial per token** and returns it over the
//! rail; a row of a source in my node goes to it directly over NVLink. Everything is point to
//! point: per-peer done words carry the combine sequence number, per-peer credits guard the
//! reuse of the two combine regions, and no wait spans the world.
//!
//! Contract: the op has its own sequence number `q` (combine regions `q % 2`, done values and
//! credits); the output, per token of mine, is the wrapping sum of every contributor's
//! [`inter_combine_word`], which equals the flat combine's reduction for the same layout (the
//! sequential reference). It neither needs nor releases anything but the live internode
//! output, which stays live until the next internode dispatch.

use epcomm_topology::Schedule;

use super::internode_ring::{RingOf, RingSend, RingTake};
use super::violation::Region;
use super::{Rank, Stop};
use crate::config::{Mutation, data_word, inter_combine_word, routes_to, split_data_word};
use crate::outcome::OpOutput;
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Runs one internode combine as this rank: returns its rows of the last internode
    /// dispatch, forwards partials for the sources of other nodes, reduces its own tokens.
    pub(super) fn internode_combine(&mut self) -> Result<OpOutput, Stop> {
        let cfg = self.cfg;
        let (me, tokens) = (self.me, cfg.tokens());
        let (nodes, lsz) = (cfg.nodes(), cfg.local_ranks());
        let (n, l) = (cfg.node_of(me), cfg.local_of(me));
        self.seq.inter_combine_seq += 1;
        let q = self.seq.inter_combine_seq;
        let par = cfg.parity(q);
        if cfg.schedule() == Schedule::Global {
            // [G1] barrier (the baseline): every rank finished its previous op.
            self.barrier(Step::G1)?;
        }
        // The rows returned: the live output of the last internode dispatch `i`, under the
        // layout of the last non-cached one.
        let live = self.inter_live.clone().unwrap_or_default();
        let i = self.seq.inter_seq;
        let layout = self.inter_layout.clone();
        let layout_seq = layout.seq;
        let local_peers: Vec<usize> = (0..lsz).map(|j| cfg.rank_of(n, j)).collect();
        let rail_peers: Vec<(usize, usize)> = (0..nodes)
            .filter(|&k| k != n)
            .map(|k| (k, cfg.rank_of(k, l)))
            .collect();
        // The contributors of node `k` to token `t` of `src`: the ranks of `k` it went to.
        let contributors = |src: usize, t: usize, k: usize| -> Vec<usize> {
            (0..lsz)
                .map(|j| cfg.rank_of(k, j))
                .filter(|&d| routes_to(layout_seq, src, t, d))
                .collect()
        };
        // The value a node's contributors return for token `t` of `src`: the wrapping sum of
        // their contributions (the partial a forwarder must send).
        let expected_sum = |src: usize, t: usize, k: usize| -> u64 {
            let row = data_word(i, src, t);
            contributors(src, t, k).into_iter().fold(0u64, |acc, d| {
                acc.wrapping_add(inter_combine_word(q, d, row))
            })
        };

        // Where my rows go: to a source of my node directly, to the forwarder of my node for
        // the sources of other nodes (me, for my own rail's sources: kept local).
        let dest = |s: usize| -> usize {
            if cfg.node_of(s) == n {
                s
            } else {
                cfg.rank_of(n, cfg.local_of(s))
            }
        };
        // The peers I write into this combine: my rows' destinations (not me) and the sources
        // of other nodes I send partials to.
        let mut targets: Vec<usize> = live
            .rows
            .iter()
            .map(|&(s, _, _)| dest(s))
            .filter(|&d| d != me)
            .collect();
        // Streamed partials: the rings' chunk counts guard the sources' slots.
        let ring = cfg.rail_ring().is_some();
        targets.extend(
            rail_peers
                .iter()
                .filter(|&&(k, _)| !ring && layout.rail.get(k).copied().unwrap_or(0) > 0)
                .map(|&(_, src)| src),
        );
        targets.sort_unstable();
        targets.dedup();

        // [J1] release combine credit: I read nothing of internode combine q - 1 any more;
        // every rank that may write my combine regions learns it (release).
        self.step(Step::J1)?;
        for d in local_peers
            .iter()
            .copied()
            .chain(rail_peers.iter().map(|&(_, p)| p))
        {
            self.write(Step::J1, || {
                self.w.ranks[d].ccredit[me].store(q - 1, Ordering::Release);
            })?;
        }

        // [J2] wait combine credit: every peer I write into has finished reading combine
        // q - 2, the last one that used the same parity (acquire).
        self.step(Step::J2)?;
        if q > 2 && !cfg.has(Mutation::InterCombineSkipCredit) {
            for &p in &targets {
                let word = &self.w.ranks[me].ccredit[p];
                self.wait_geq(Step::J2, p, word, q - 2, Ordering::Acquire)?;
            }
        }

        // [J3] write contributions (relaxed): each row of my live output, read back from
        // xrecv, as my contribution to its token.
        self.step(Step::J3)?;
        let mut own_direct: Vec<Option<u64>> = vec![None; tokens];
        let mut own_fwd: Vec<Option<u64>> = vec![None; cfg.world() * tokens];
        let mut wrote: Vec<usize> = Vec::new();
        for &(s, j, expected) in &live.rows {
            let row = self.w.xrecv(me, live.parity, s, j).load(Ordering::Relaxed);
            if row != expected {
                let slot = s * tokens + j;
                return Err(self
                    .data_violation(Step::J3, Region::XRecv, live.parity, slot, expected, row)
                    .into());
            }
            let (_, src, t) = split_data_word(row);
            let value = inter_combine_word(q, me, row);
            let d = dest(src);
            if cfg.node_of(src) == n {
                if d == me {
                    own_direct[t] = Some(value);
                } else {
                    self.write(Step::J3, || {
                        self.w
                            .cdirect(d, par, me, t)
                            .store(value, Ordering::Relaxed);
                    })?;
                    wrote.push(d);
                }
            } else if d == me {
                own_fwd[src * tokens + t] = Some(value);
            } else {
                self.write(Step::J3, || {
                    self.w
                        .cfwd(d, par, src, t, l)
                        .store(value, Ordering::Relaxed);
                })?;
                wrote.push(d);
            }
        }
        wrote.sort_unstable();
        wrote.dedup();
        // [J4] signal contributions (release), only to the ranks that got some.
        self.step(Step::J4)?;
        for &d in &wrote {
            self.write(Step::J4, || {
                self.w.ranks[d].cdone[me].store(q, Ordering::Release);
            })?;
        }

        // The forwarder: per rail source whose tokens crossed to my node in the dispatch.
        // Streamed (`ring`): the partials go through the sources' rings below instead.
        let mut partial_sends: Vec<RingSend> = Vec::new();
        for &(k, src) in &rail_peers {
            if layout.rail.get(k).copied().unwrap_or(0) == 0 {
                continue;
            }
            let crossing: Vec<usize> = (0..tokens)
                .filter(|&t| !contributors(src, t, n).is_empty())
                .collect();
            // [J5] wait local contributions: cdone[d] >= q (acquire) for every other rank d
            // of my node that holds a row of src.
            self.step(Step::J5)?;
            if !cfg.has(Mutation::InterCombineSkipLocalWait) {
                for &d in local_peers.iter().filter(|&&d| d != me) {
                    if crossing.iter().any(|&t| routes_to(layout_seq, src, t, d)) {
                        let word = &self.w.ranks[me].cdone[d];
                        self.wait_geq(Step::J5, d, word, q, Ordering::Acquire)?;
                    }
                }
            }
            // [J6] reduce each crossing token's node-local contributions into one partial and
            // write it into the source's cpart[q%2][n][t] over the rail (relaxed).
            self.step(Step::J6)?;
            let mut partials = Vec::with_capacity(crossing.len());
            for &t in &crossing {
                let row = data_word(i, src, t);
                let mut partial = 0u64;
                for d in contributors(src, t, n) {
                    let expected = inter_combine_word(q, d, row);
                    let j = cfg.local_of(d);
                    let found = if d == me {
                        own_fwd[src * tokens + t].unwrap_or(0)
                    } else {
                        self.w.cfwd(me, par, src, t, j).load(Ordering::Relaxed)
                    };
                    if found != expected {
                        let slot = (src * tokens + t) * lsz + j;
                        return Err(self
                            .data_violation(Step::J6, Region::CFwd, par, slot, expected, found)
                            .into());
                    }
                    partial = partial.wrapping_add(found);
                }
                if ring {
                    partials.push(partial);
                    continue;
                }
                self.write(Step::J6, || {
                    self.w
                        .cpart(src, par, n, t)
                        .store(partial, Ordering::Relaxed);
                })?;
            }
            if ring {
                partial_sends.push(RingSend {
                    node: k,
                    peer: src,
                    rows: partials,
                });
                continue;
            }
            // [J7] signal the partials (release).
            self.step(Step::J7)?;
            self.write(Step::J7, || {
                self.w.ranks[src].cpdone[n].store(q, Ordering::Release);
            })?;
        }
        // [J6c], [J8c], [J9c]: my partials through my sources' rings, and the partials of every
        // node my tokens crossed to through mine (each checked against its contributors' sum
        // as it is taken): streamed[k][t].
        let mut streamed: Vec<Vec<Option<u64>>> = vec![vec![None; tokens]; nodes];
        if let Some(rail_ring) = cfg.rail_ring() {
            let crossed: Vec<(usize, usize, Vec<usize>)> = rail_peers
                .iter()
                .map(|&(k, p)| {
                    let ts = (0..tokens)
                        .filter(|&t| !contributors(me, t, k).is_empty())
                        .collect();
                    (k, p, ts)
                })
                .filter(|(_, _, ts): &(usize, usize, Vec<usize>)| !ts.is_empty())
                .collect();
            let takes: Vec<RingTake> = crossed
                .iter()
                .map(|(k, p, ts)| RingTake {
                    node: *k,
                    peer: *p,
                    expected: ts.iter().map(|&t| expected_sum(me, t, *k)).collect(),
                })
                .collect();
            self.ring_exchange(
                (RingOf::Combine, rail_ring),
                &partial_sends,
                &takes,
                &mut |_, f, index, row| {
                    let (k, _, ref ts) = crossed[f];
                    streamed[k][ts[index]] = Some(row);
                    Ok(())
                },
            )?;
        }

        // [J8] the source: wait (acquire) for the direct contributions of every other rank of
        // my node my tokens went to, and for the partials of every node they crossed to.
        self.step(Step::J8)?;
        let went_to = |d: usize| (0..tokens).any(|t| routes_to(layout_seq, me, t, d));
        for &d in local_peers.iter().filter(|&&d| d != me) {
            if went_to(d) {
                let word = &self.w.ranks[me].cdone[d];
                self.wait_geq(Step::J8, d, word, q, Ordering::Acquire)?;
            }
        }
        if !ring && !cfg.has(Mutation::InterCombineSkipPartialWait) {
            for &(k, p) in &rail_peers {
                if (0..tokens).any(|t| !contributors(me, t, k).is_empty()) {
                    let word = &self.w.ranks[me].cpdone[k];
                    self.wait_geq(Step::J8, p, word, q, Ordering::Acquire)?;
                }
            }
        }

        // [J9] reduce each of my tokens: my own contribution and my node's direct ones, then
        // one partial per other node it crossed to; each must hold exactly its contributors.
        self.step(Step::J9)?;
        let mut reduced = vec![0u64; tokens];
        for (t, out) in reduced.iter_mut().enumerate() {
            let row = data_word(i, me, t);
            let mut acc = 0u64;
            for d in contributors(me, t, n) {
                let expected = inter_combine_word(q, d, row);
                let found = if d == me {
                    own_direct[t].unwrap_or(0)
                } else {
                    self.w.cdirect(me, par, d, t).load(Ordering::Relaxed)
                };
                if found != expected {
                    let slot = d * tokens + t;
                    return Err(self
                        .data_violation(Step::J9, Region::CDirect, par, slot, expected, found)
                        .into());
                }
                acc = acc.wrapping_add(found);
            }
            for &(k, _) in &rail_peers {
                if contributors(me, t, k).is_empty() {
                    continue;
                }
                let expected = expected_sum(me, t, k);
                let found = match streamed[k][t] {
                    // Taken from the ring (checked there).
                    Some(value) => value,
                    None => self.w.cpart(me, par, k, t).load(Ordering::Relaxed),
                };
                if found != expected {
                    let slot = k * tokens + t;
                    return Err(self
                        .data_violation(Step::J9, Region::CPart, par, slot, expected, found)
                        .into());
                }
                acc = acc.wrapping_add(found);
            }
            *out = acc;
        }
        Ok(OpOutput::Combine { seq: q, reduced })
    }
}
