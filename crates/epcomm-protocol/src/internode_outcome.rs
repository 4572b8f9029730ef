//! The failure rule of the hierarchical internode ops ([`check_outcome_internode`]): which ops
//! of the peers of a failed rank may complete, and which must end in an error.
//!
//! The internode ops wait only on the peers they receive from (directly, or through the rail
//! peer that forwards for them) and on the credits of the peers they write into, so a peer of a
//! failed rank can legitimately finish an op without it. The rule is therefore stated as a
//! dependency graph: every op of every rank is a list of events in program order (the steps it
//! announces, the signals it publishes, the waits it performs, each naming the one peer the
//! model's wait names), and an op may complete only if every signal it waits for was published
//! by an op that, according to the reports, got that far.

use std::collections::HashSet;

use crate::config::{Failure, ModelConfig, OpKind, RailRing, route_count, routes_to};
use crate::outcome::{
    OpError, OutcomeViolation, RankReport, check_lengths, check_output, check_refused,
};
use crate::reference::sequential_reference;
use crate::sequential_outcome::check_outcome_sequential;
use crate::step::Step;
use crate::stopped_outcome::check_outcome_stopped;
use epcomm_topology::Schedule;

/// One signal a wait can need: a word with one writer, named by what it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Sig {
    /// The Global schedule's barrier of `(rank, op)`.
    Barrier(usize, usize),
    /// An intranode op's done signals of `(rank, op)` (coarse: every rank waits for all).
    Done(usize, usize),
    /// `[I1]` dispatch credit of `(rank, op)`.
    Credit(usize, usize),
    /// `[I2]` rail counts of `(src, op)`.
    RailCount(usize, usize),
    /// `[I3]`/`[I4]` count word of `src` for `dst` in `op` (`src`'s own, or relayed).
    XCount(usize, usize, usize),
    /// `[I7]` rail rows of `src` to its rail peer `to` in `op`.
    RailDone(usize, usize, usize),
    /// `[I7]`/`[I9]` rows of `src` delivered to `dst` in `op` (by `src`, or forwarded).
    IDone(usize, usize, usize),
    /// `[I6c]`/`[J6c]` chunks of `from` to its rail peer `to` in `op`, landed (the rail rings).
    Chunks(usize, usize, usize),
    /// `[I9c]`/`[J9c]` ring credit of `taker` for the chunks of `from` in `op`.
    RingCredit(usize, usize, usize),
    /// `[J1]` combine credit of `(rank, op)`.
    CCredit(usize, usize),
    /// `[J4]` contributions of `from` to `to` in `op`.
    CDone(usize, usize, usize),
    /// `[J7]` partials of forwarder `fwd` to source `src` in `op`.
    CpDone(usize, usize, usize),
}

/// One event of an op, in program order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    /// The op announces `step` (where an injected failure fires, at its first announcement).
    Step(Step),
    /// The op publishes a signal.
    Publish(Sig),
    /// The op waits (at `step`, `None` for the coarse intranode wait) on `peer` for a signal.
    Wait(Option<Step>, usize, Sig),
}

/// Every rank's events, `[rank][op]`, for the op sequence of `cfg`.
fn events(cfg: &ModelConfig) -> Vec<Vec<Vec<Ev>>> {
    (0..cfg.world())
        .map(|me| {
            let mut state = SeqWalk::default();
            cfg.ops()
                .iter()
                .enumerate()
                .map(|(k, &kind)| state.op_events(cfg, me, k, kind))
                .collect()
        })
        .collect()
}

/// The internode sequence state the events need (the same on every rank).
#[derive(Default)]
struct SeqWalk {
    inter_seq: u64,
    layout_seq: u64,
    last_dispatch: Option<usize>,
    combine_seq: u64,
    last_combine: Option<usize>,
    /// The rail rings, per (ring: 0 the dispatch's, 1 the combine's; peer node): `(op, chunks)`
    /// of every op so far that sent that peer chunks, in order (chunk indices run on across
    /// ops).
    ring_sent: std::collections::HashMap<(usize, usize), Vec<(usize, u64)>>,
}

impl SeqWalk {
    fn op_events(&mut self, cfg: &ModelConfig, me: usize, k: usize, kind: OpKind) -> Vec<Ev> {
        let mut ev = vec![Ev::Step(Step::Recheck)];
        if !kind.is_internode_family() {
            // Coarse: an intranode op publishes its done signals, then waits for every rank's.
            ev.push(Ev::Publish(Sig::Done(me, k)));
            ev.extend((0..cfg.world()).map(|s| Ev::Wait(None, s, Sig::Done(s, k))));
            return ev;
        }
        let (wsz, tokens, lsz) = (cfg.world(), cfg.tokens(), cfg.local_ranks());
        let (n, l) = (cfg.node_of(me), cfg.local_of(me));
        if cfg.schedule() == Schedule::Global {
            ev.push(Ev::Step(Step::G1));
            ev.push(Ev::Publish(Sig::Barrier(me, k)));
            ev.extend((0..wsz).map(|s| Ev::Wait(Some(Step::G1), s, Sig::Barrier(s, k))));
        }
        let local: Vec<usize> = (0..lsz).map(|j| cfg.rank_of(n, j)).collect();
        let rail: Vec<(usize, usize)> = (0..cfg.nodes())
            .filter(|&kk| kk != n)
            .map(|kk| (kk, cfg.rank_of(kk, l)))
            .collect();
        let cached = kind == OpKind::InternodeCachedDispatch;
        if kind == OpKind::InternodeDispatch {
            self.layout_seq = self.inter_seq + 1;
        }
        let ls = self.layout_seq;
        let count = |s: usize, d: usize| route_count(ls, tokens, s, d);
        let crosses = |s: usize, kk: usize| {
            (0..tokens).any(|t| (0..lsz).any(|j| routes_to(ls, s, t, cfg.rank_of(kk, j))))
        };
        if kind.is_internode() {
            self.inter_seq += 1;
            let i = self.inter_seq;
            ev.push(Ev::Step(Step::I1));
            ev.push(Ev::Publish(Sig::Credit(me, k)));
            if !cached {
                ev.push(Ev::Step(Step::I2));
                ev.push(Ev::Publish(Sig::RailCount(me, k)));
                ev.push(Ev::Step(Step::I3));
                ev.extend(local.iter().map(|&d| Ev::Publish(Sig::XCount(me, d, k))));
                ev.push(Ev::Step(Step::I4));
                for &(_, src) in &rail {
                    ev.push(Ev::Wait(Some(Step::I4), src, Sig::RailCount(src, k)));
                    ev.extend(local.iter().map(|&d| Ev::Publish(Sig::XCount(src, d, k))));
                }
            }
            // The peers I write into: my rail peers and local ranks with rows, and the local
            // ranks I forward rows to.
            let my_rail: Vec<usize> = rail
                .iter()
                .filter(|&&(kk, _)| crosses(me, kk))
                .map(|&(_, p)| p)
                .collect();
            let my_local: Vec<usize> = local
                .iter()
                .copied()
                .filter(|&d| count(me, d) > 0)
                .collect();
            // Chunked forwarding: the rings need no credit of the rail peers.
            let ring = cfg.rail_ring();
            let mut targets: Vec<usize> = my_rail
                .iter()
                .filter(|_| ring.is_none())
                .chain(&my_local)
                .copied()
                .collect();
            for &(_, src) in &rail {
                targets.extend(local.iter().copied().filter(|&d| count(src, d) > 0));
            }
            targets.sort_unstable();
            targets.dedup();
            ev.push(Ev::Step(Step::I5));
            if let (true, Some(prev)) = (i > 2, self.last_dispatch) {
                ev.extend(
                    targets
                        .iter()
                        .map(|&p| Ev::Wait(Some(Step::I5), p, Sig::Credit(p, prev))),
                );
            }
            ev.push(Ev::Step(Step::I6));
            ev.push(Ev::Step(Step::I7));
            ev.extend(
                my_rail
                    .iter()
                    .filter(|_| ring.is_none())
                    .map(|&p| Ev::Publish(Sig::RailDone(me, p, k))),
            );
            ev.extend(my_local.iter().map(|&d| Ev::Publish(Sig::IDone(me, d, k))));
            if let Some(ring) = ring {
                self.ring_events(cfg, (me, k), ring, false, &mut ev);
            }
            for &(_, src) in rail.iter().filter(|_| ring.is_none()) {
                if !crosses(src, n) {
                    continue;
                }
                ev.push(Ev::Step(Step::I8));
                ev.push(Ev::Wait(Some(Step::I8), src, Sig::RailDone(src, me, k)));
                ev.push(Ev::Step(Step::I9));
                ev.extend(
                    local
                        .iter()
                        .filter(|&&d| count(src, d) > 0)
                        .map(|&d| Ev::Publish(Sig::IDone(src, d, k))),
                );
            }
            // The waits of [I10]/[I11] name the word's one writer: the forwarder for a
            // source of another node.
            let writer = |s: usize| {
                if cfg.node_of(s) == n {
                    s
                } else {
                    cfg.rank_of(n, cfg.local_of(s))
                }
            };
            if !cached {
                ev.push(Ev::Step(Step::I10));
                ev.extend(
                    (0..wsz).map(|s| Ev::Wait(Some(Step::I10), writer(s), Sig::XCount(s, me, k))),
                );
            }
            ev.push(Ev::Step(Step::I11));
            ev.extend(
                (0..wsz)
                    .filter(|&s| count(s, me) > 0)
                    .map(|s| Ev::Wait(Some(Step::I11), writer(s), Sig::IDone(s, me, k))),
            );
            ev.push(Ev::Step(Step::I12));
            self.last_dispatch = Some(k);
            return ev;
        }
        // InternodeCombine: the rows of the live dispatch output go back to their sources.
        self.combine_seq += 1;
        let q = self.combine_seq;
        let dest = |s: usize| {
            if cfg.node_of(s) == n {
                s
            } else {
                cfg.rank_of(n, cfg.local_of(s))
            }
        };
        let mut wrote: Vec<usize> = (0..wsz)
            .filter(|&s| count(s, me) > 0)
            .map(dest)
            .filter(|&d| d != me)
            .collect();
        wrote.sort_unstable();
        wrote.dedup();
        let ring = cfg.rail_ring();
        let mut targets = wrote.clone();
        targets.extend(
            rail.iter()
                .filter(|&&(_, src)| ring.is_none() && crosses(src, n))
                .map(|&(_, src)| src),
        );
        targets.sort_unstable();
        targets.dedup();
        ev.push(Ev::Step(Step::J1));
        ev.push(Ev::Publish(Sig::CCredit(me, k)));
        ev.push(Ev::Step(Step::J2));
        if let (true, Some(prev)) = (q > 2, self.last_combine) {
            ev.extend(
                targets
                    .iter()
                    .map(|&p| Ev::Wait(Some(Step::J2), p, Sig::CCredit(p, prev))),
            );
        }
        ev.push(Ev::Step(Step::J3));
        ev.push(Ev::Step(Step::J4));
        ev.extend(wrote.iter().map(|&d| Ev::Publish(Sig::CDone(me, d, k))));
        for &(_, src) in &rail {
            if !crosses(src, n) {
                continue;
            }
            ev.push(Ev::Step(Step::J5));
            ev.extend(
                local
                    .iter()
                    .filter(|&&d| d != me && count(src, d) > 0)
                    .map(|&d| Ev::Wait(Some(Step::J5), d, Sig::CDone(d, me, k))),
            );
            ev.push(Ev::Step(Step::J6));
            if ring.is_none() {
                ev.push(Ev::Step(Step::J7));
                ev.push(Ev::Publish(Sig::CpDone(me, src, k)));
            }
        }
        if let Some(ring) = ring {
            self.ring_events(cfg, (me, k), ring, true, &mut ev);
        }
        ev.push(Ev::Step(Step::J8));
        ev.extend(
            local
                .iter()
                .filter(|&&d| d != me && count(me, d) > 0)
                .map(|&d| Ev::Wait(Some(Step::J8), d, Sig::CDone(d, me, k))),
        );
        ev.extend(
            rail.iter()
                .filter(|&&(kk, _)| ring.is_none() && crosses(me, kk))
                .map(|&(_, p)| Ev::Wait(Some(Step::J8), p, Sig::CpDone(p, me, k))),
        );
        ev.push(Ev::Step(Step::J9));
        self.last_combine = Some(k);
        ev
    }
}

impl SeqWalk {
    /// The events of a rail ring in op `k`: chunked forwarding (`[I6c]`..`[I9c]`) in an
    /// internode dispatch (my rail rows to each rail peer; the rows of each rail source taken
    /// and forwarded, its `idone` signals published after them), or streamed partials
    /// (`[J6c]`..`[J9c]`, `combine`) in an internode combine (my partials to each rail source
    /// whose tokens crossed to my node; the partials of each node my tokens crossed to taken).
    fn ring_events(
        &mut self,
        cfg: &ModelConfig,
        (me, k): (usize, usize),
        ring: RailRing,
        combine: bool,
        ev: &mut Vec<Ev>,
    ) {
        let (tokens, lsz, n) = (cfg.tokens(), cfg.local_ranks(), cfg.node_of(me));
        let ls = self.layout_seq;
        let peers = rail_peers(cfg, me);
        // Rows that cross from `src` to `node`; the dispatch sends mine, the combine returns
        // the peer's.
        let rows = |src: usize, node: usize| crossing_rows(cfg, ls, src, node);
        let sends: Vec<(usize, usize, u64)> = peers
            .iter()
            .map(|&(node, p)| (node, p, if combine { rows(p, n) } else { rows(me, node) }))
            .collect();
        let takes: Vec<(usize, Vec<Ev>)> = peers
            .iter()
            .filter(|&&(node, p)| if combine { rows(me, node) } else { rows(p, n) } > 0)
            .map(|&(_, p)| {
                let done = (0..lsz)
                    .map(|j| cfg.rank_of(n, j))
                    .filter(|&d| !combine && route_count(ls, tokens, p, d) > 0)
                    .map(|d| Ev::Publish(Sig::IDone(p, d, k)))
                    .collect();
                (p, done)
            })
            .collect();
        let steps = if combine {
            (Step::J6c, Step::J8c)
        } else {
            (Step::I6c, Step::I8c)
        };
        self.ring_block(usize::from(combine), me, k, ring, &sends, &takes, steps, ev);
    }

    /// The events of one ring exchange of op `k` (ring `which`: 0 the dispatch's, 1 the
    /// combine's), given `sends` (peer node, peer, rows of op `k`) and `takes` (peer, what is
    /// published once its chunks are taken).
    ///
    /// A rank interleaves its sending and taking roles in an order the schedule decides, so
    /// the events are not in program order: every signal first, then every wait. A failure is
    /// never injected inside this block ([`Failure::step_is_valid`]), so a completed op or a
    /// failure before or after it is judged exactly; an op aborted in one of its waits counts
    /// as having published everything of the block (lenient: it may have published less).
    ///
    /// The sender's wait for its peer `p`: the chunks `g` of op `k` need `credit >= g + 1 - R`,
    /// so the last of them needs the chunk at index `G + c - R - 1` taken (`G` chunks before
    /// op `k`, `c = ceil(rows / C)` in it), which the op that sent that chunk takes: no wait if
    /// it is negative. The taker's wait: the peer's chunks of op `k`.
    #[allow(clippy::too_many_arguments)]
    fn ring_block(
        &mut self,
        which: usize,
        me: usize,
        k: usize,
        ring: RailRing,
        sends: &[(usize, usize, u64)],
        takes: &[(usize, Vec<Ev>)],
        (send_step, take_step): (Step, Step),
        ev: &mut Vec<Ev>,
    ) {
        let slots = ring.slots as u64;
        let mut waits = Vec::new();
        for &(node, p, rows) in sends {
            let c = ring.chunks(rows);
            if c == 0 {
                continue;
            }
            ev.push(Ev::Publish(Sig::Chunks(me, p, k)));
            let history = self.ring_sent.entry((which, node)).or_default();
            let before: u64 = history.iter().map(|&(_, c)| c).sum();
            history.push((k, c));
            if let Some(needed) = (before + c).checked_sub(slots + 1) {
                // The op whose chunks include index `needed`.
                let mut start = 0;
                let op = history
                    .iter()
                    .find(|&&(_, c)| {
                        start += c;
                        needed < start
                    })
                    .map(|&(op, _)| op)
                    .unwrap_or(k);
                waits.push(Ev::Wait(Some(send_step), p, Sig::RingCredit(p, me, op)));
            }
        }
        for (p, after) in takes {
            ev.push(Ev::Publish(Sig::RingCredit(me, *p, k)));
            ev.extend(after.iter().copied());
            waits.push(Ev::Wait(Some(take_step), *p, Sig::Chunks(*p, me, k)));
        }
        ev.extend(waits);
    }
}

/// `me`'s rail peers: `(node, rank)` for every other node, the rank with my local index.
fn rail_peers(cfg: &ModelConfig, me: usize) -> Vec<(usize, usize)> {
    let (n, l) = (cfg.node_of(me), cfg.local_of(me));
    (0..cfg.nodes())
        .filter(|&node| node != n)
        .map(|node| (node, cfg.rank_of(node, l)))
        .collect()
}

/// The tokens of `src` that go to some rank of `node` under layout `ls`.
fn crossing_rows(cfg: &ModelConfig, ls: u64, src: usize, node: usize) -> u64 {
    let lsz = cfg.local_ranks();
    (0..cfg.tokens())
        .filter(|&t| (0..lsz).any(|j| routes_to(ls, src, t, cfg.rank_of(node, j))))
        .count() as u64
}

/// How far the failing op of the injected failure gets: the events before the first
/// announcement of its step (for an intranode op: its done signals iff
/// [`Failure::after_done`]); `None` if the op never announces that step (the failure cannot
/// fire: a forwarder step of a rank that forwards nothing, or a single node).
fn failure_cutoff(cfg: &ModelConfig, ev: &[Ev], f: &Failure) -> Option<usize> {
    if !cfg.ops()[f.op].is_internode_family() {
        return Some(if f.after_done() { 2 } else { 0 });
    }
    ev.iter().position(|e| *e == Ev::Step(f.at))
}

/// Whether the failure injected into `cfg` fires: the failing rank announces the configured
/// step in the failing op (always true for the intranode ops; an internode forwarder step
/// `[I8]`, `[I9]`, `[J5]`..`[J7]` fires only on a rank that forwards rows from some rail peer
/// in that op). `false` without an injected failure.
pub fn failure_fires(cfg: &ModelConfig) -> bool {
    let Some(f) = cfg.failure() else {
        return false;
    };
    let ev = events(cfg);
    failure_cutoff(cfg, &ev[f.rank][f.op], &f).is_some()
}

/// Judges the results of a run of `cfg` whose op sequence contains internode ops, with an
/// injected failure of rank `f` in op `n` (without one, or without internode ops, it is
/// [`crate::check_outcome`]'s rule). The rule, for the hierarchical protocol:
///
/// * every op that completes, on any rank, equals the sequential reference;
/// * rank `f` completes ops `0..n` (nothing failed yet), op `n` ends in the injected
///   [`OpError::TimedOut`] at its step, every later op is [`OpError::Refused`] by `[F1]`;
/// * a peer may complete **any** op whose waits are all satisfied: an op completes only if
///   every signal it waits for (counts, rows, forwarded rows and counts, contributions,
///   partials, credits of an earlier op, barriers) was published by an op that, according to
///   the reports, got that far — `f`'s failing op up to the failing step, a completed op
///   entirely, an op that ended in [`OpError::Aborted`] up to the wait it gave up in (its last
///   occurrence), a refused op not at all. So an op that depends on `f` directly, or
///   transitively through a forwarder or a credit, never completes; one that does not
///   depend on it may complete, even after `f` failed (there is no global synchronisation
///   that would stop it). Intranode ops in the sequence count as waiting for every rank's done
///   signals ([`Failure::after_done`] for the failing op);
/// * a peer may also end any op in an error (it can see the abort word while it waits), but
///   its first error must name the failure's origin — [`OpError::Aborted`] or
///   [`OpError::Refused`] with `by == f` (the abort word) — and every later op of it must be
///   [`OpError::Refused`] (by `f`, or by itself, its own claim); no peer times out itself.
///
/// That no op hangs is the run's own check (every std wait is bounded and reports
/// [`crate::Violation::Timeout`]); together with the last rule, every op that depends on `f`
/// ends in an error naming `f`.
pub fn check_outcome_internode(
    cfg: &ModelConfig,
    reports: &[RankReport],
) -> Result<(), OutcomeViolation> {
    check_lengths(cfg, reports)?;
    let ops = cfg.ops().len();
    let Some(f) = cfg.failure() else {
        // No failure: the rules of `check_outcome` for runs without one.
        return match cfg.stopped_rank() {
            Some(s) => check_outcome_stopped(cfg, s, reports),
            None => check_outcome_sequential(cfg, reports),
        };
    };
    let reference = sequential_reference(cfg);
    let ev = events(cfg);
    // How far each op got, by the reports.
    let mut reached = vec![vec![0usize; ops]; cfg.world()];
    for (rank, report) in reports.iter().enumerate() {
        let mut failed: Option<usize> = None;
        for (op, result) in report.outputs.iter().enumerate() {
            let injected = rank == f.rank && op == f.op;
            let events = &ev[rank][op];
            if let Some(failed) = failed {
                let refused =
                    matches!(result, Err(OpError::Refused { by }) if *by == rank || *by == f.rank);
                check_refused(rank, op, failed, result, refused)?;
                continue;
            }
            reached[rank][op] = match result {
                Ok(found) => {
                    if injected {
                        return Err(OutcomeViolation::MissingFailure {
                            rank,
                            op,
                            found: result.clone(),
                        });
                    }
                    check_output(&reference, rank, op, found)?;
                    events.len()
                }
                Err(error) => {
                    failed = Some(op);
                    let unexpected = || OutcomeViolation::UnexpectedError {
                        rank,
                        op,
                        error: error.clone(),
                    };
                    if rank == f.rank {
                        match (injected, error) {
                            (true, OpError::TimedOut { step }) if *step == f.at => {
                                failure_cutoff(cfg, events, &f).ok_or_else(unexpected)?
                            }
                            _ if op <= f.op => {
                                return Err(OutcomeViolation::MissingFailure {
                                    rank,
                                    op: f.op,
                                    found: report.outputs[f.op].clone(),
                                });
                            }
                            _ => return Err(unexpected()),
                        }
                    } else {
                        match error {
                            OpError::Refused { by } if *by == f.rank => 0,
                            OpError::Aborted { step, peer, by } if *by == f.rank => {
                                if cfg.ops()[op].is_internode_family() {
                                    events
                                        .iter()
                                        .rposition(|e| {
                                            matches!(e, Ev::Wait(Some(s), p, _) if s == step && p == peer)
                                        })
                                        .ok_or_else(unexpected)?
                                } else if (Failure {
                                    rank,
                                    op,
                                    at: *step,
                                })
                                .after_done()
                                {
                                    2
                                } else {
                                    0
                                }
                            }
                            _ => return Err(unexpected()),
                        }
                    }
                }
            };
        }
    }
    let published: HashSet<Sig> = ev
        .iter()
        .zip(&reached)
        .flat_map(|(ops, reached)| {
            ops.iter()
                .zip(reached)
                .flat_map(|(events, &upto)| events[..upto].iter())
        })
        .filter_map(|e| match e {
            Ev::Publish(sig) => Some(*sig),
            _ => None,
        })
        .collect();
    for (rank, report) in reports.iter().enumerate() {
        for (op, result) in report.outputs.iter().enumerate() {
            if result.is_err() {
                continue;
            }
            for e in &ev[rank][op] {
                if let Ev::Wait(step, peer, sig) = e
                    && !published.contains(sig)
                {
                    return Err(OutcomeViolation::CompletedWithoutSignal {
                        rank,
                        op,
                        step: *step,
                        peer: *peer,
                        failing: f.rank,
                        fail_op: f.op,
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OpKind::{InternodeCachedDispatch, InternodeDispatch};
    use crate::outcome::OpResult;

    /// 2x1 (rank 1 is rank 0's rail peer), tokens such that rank 1's rows cross to rank 0,
    /// `[ID, ICD]`, rank 1 fails in op 0 before `at`.
    fn two_by_one(at: Step) -> ModelConfig {
        let tokens = (1..16).find(|&t| route_count(1, t, 1, 0) > 0).unwrap();
        ModelConfig::new(
            2,
            tokens,
            1,
            Schedule::Epoch,
            vec![InternodeDispatch, InternodeCachedDispatch],
        )
        .unwrap()
        .with_nodes(2)
        .unwrap()
        .with_failure(Failure { rank: 1, op: 0, at })
        .unwrap()
    }

    fn reports(cfg: &ModelConfig, r0: [OpResult; 2]) -> Vec<RankReport> {
        let at = cfg.failure().unwrap().at;
        vec![
            RankReport {
                rank: 0,
                outputs: r0.to_vec(),
            },
            RankReport {
                rank: 1,
                outputs: vec![
                    Err(OpError::TimedOut { step: at }),
                    Err(OpError::Refused { by: 1 }),
                ],
            },
        ]
    }

    #[test]
    fn a_forwarder_cannot_complete_without_its_rail_peer() {
        let cfg = two_by_one(Step::I7);
        let reference = sequential_reference(&cfg);
        let ok = |op: usize| reference[0].outputs[op].clone();
        let aborted = Err(OpError::Aborted {
            step: Step::I8,
            peer: 1,
            by: 1,
        });
        for r0 in [
            [aborted.clone(), Err(OpError::Refused { by: 0 })],
            [
                Err(OpError::Refused { by: 1 }),
                Err(OpError::Refused { by: 0 }),
            ],
        ] {
            assert_eq!(check_outcome_internode(&cfg, &reports(&cfg, r0)), Ok(()));
        }
        assert_eq!(
            check_outcome_internode(&cfg, &reports(&cfg, [ok(0), aborted.clone()])),
            Err(OutcomeViolation::CompletedWithoutSignal {
                rank: 0,
                op: 0,
                step: Some(Step::I8),
                peer: 1,
                failing: 1,
                fail_op: 0
            })
        );
        // The first error must name the origin; every later op is refused.
        let wrong_origin = Err(OpError::Aborted {
            step: Step::I8,
            peer: 1,
            by: 0,
        });
        assert!(matches!(
            check_outcome_internode(
                &cfg,
                &reports(&cfg, [wrong_origin, Err(OpError::Refused { by: 0 })])
            ),
            Err(OutcomeViolation::UnexpectedError { rank: 0, op: 0, .. })
        ));
        assert!(matches!(
            check_outcome_internode(&cfg, &reports(&cfg, [aborted, ok(1)])),
            Err(OutcomeViolation::NotRefused { rank: 0, op: 1, .. })
        ));
        // An abort at a wait the op does not perform is no outcome of the protocol.
        let elsewhere = Err(OpError::Aborted {
            step: Step::I11,
            peer: 1,
            by: 1,
        });
        assert!(matches!(
            check_outcome_internode(
                &cfg,
                &reports(&cfg, [elsewhere, Err(OpError::Refused { by: 0 })])
            ),
            Err(OutcomeViolation::UnexpectedError { rank: 0, op: 0, .. })
        ));
    }

    #[test]
    fn a_failure_after_the_last_signal_lets_peers_complete_that_op_only() {
        let cfg = two_by_one(Step::I12);
        let reference = sequential_reference(&cfg);
        let ok = |op: usize| reference[0].outputs[op].clone();
        let refused = Err(OpError::Refused { by: 1 });
        assert_eq!(
            check_outcome_internode(&cfg, &reports(&cfg, [ok(0), refused])),
            Ok(())
        );
        // The cached dispatch needs rank 1's rail rows of op 1, which it never sends.
        assert!(matches!(
            check_outcome_internode(&cfg, &reports(&cfg, [ok(0), ok(1)])),
            Err(OutcomeViolation::CompletedWithoutSignal {
                rank: 0,
                op: 1,
                peer: 1,
                ..
            })
        ));
        // The failing op must time out where configured.
        let mut missing = reports(&cfg, [ok(0), Err(OpError::Refused { by: 1 })]);
        missing[1].outputs[0] = reference[1].outputs[0].clone();
        assert!(matches!(
            check_outcome_internode(&cfg, &missing),
            Err(OutcomeViolation::MissingFailure { rank: 1, op: 0, .. })
        ));
        // A forwarder step fires only where rows are forwarded.
        assert!(failure_fires(&cfg));
        assert!(failure_fires(&two_by_one(Step::I8)));
        let single = ModelConfig::new(2, 1, 1, Schedule::Epoch, vec![InternodeDispatch])
            .unwrap()
            .with_failure(Failure {
                rank: 0,
                op: 0,
                at: Step::I8,
            })
            .unwrap();
        assert!(!failure_fires(&single));
    }

    /// 2x1, three tokens (each rank sends the other two chunks), a ring of `slots`, `[ID]`,
    /// rank 1 fails before `at`.
    fn ring_two_by_one(slots: usize, at: Step) -> ModelConfig {
        assert!(
            route_count(1, 3, 0, 1) == 2 && route_count(1, 3, 1, 0) == 2,
            "the routing oracle changed: pick another layout"
        );
        ModelConfig::new(2, 3, 1, Schedule::Epoch, vec![InternodeDispatch])
            .unwrap()
            .with_nodes(2)
            .unwrap()
            .with_rail_ring(RailRing {
                slots,
                chunk_rows: 1,
            })
            .unwrap()
            .with_failure(Failure { rank: 1, op: 0, at })
            .unwrap()
    }

    #[test]
    fn a_ring_sender_cannot_complete_without_its_forwarders_credit() {
        let one_op = |cfg: &ModelConfig, r0: OpResult| {
            let at = cfg.failure().unwrap().at;
            vec![
                RankReport {
                    rank: 0,
                    outputs: vec![r0],
                },
                RankReport {
                    rank: 1,
                    outputs: vec![Err(OpError::TimedOut { step: at })],
                },
            ]
        };
        let aborted = |step| {
            Err(OpError::Aborted {
                step,
                peer: 1,
                by: 1,
            })
        };
        // One slot: rank 0's second chunk needs rank 1 to forward its first.
        let cfg = ring_two_by_one(1, Step::I7);
        let ok = sequential_reference(&cfg)[0].outputs[0].clone();
        for step in [Step::I6c, Step::I8c] {
            assert_eq!(
                check_outcome_internode(&cfg, &one_op(&cfg, aborted(step))),
                Ok(())
            );
        }
        assert_eq!(
            check_outcome_internode(&cfg, &one_op(&cfg, ok.clone())),
            Err(OutcomeViolation::CompletedWithoutSignal {
                rank: 0,
                op: 0,
                step: Some(Step::I6c),
                peer: 1,
                failing: 1,
                fail_op: 0
            })
        );
        // Two slots: both chunks fit, so rank 0 never waits as a sender; as a forwarder it
        // still needs rank 1's chunks.
        let cfg = ring_two_by_one(2, Step::I7);
        assert!(matches!(
            check_outcome_internode(&cfg, &one_op(&cfg, aborted(Step::I6c))),
            Err(OutcomeViolation::UnexpectedError { rank: 0, op: 0, .. })
        ));
        assert_eq!(
            check_outcome_internode(&cfg, &one_op(&cfg, ok.clone())),
            Err(OutcomeViolation::CompletedWithoutSignal {
                rank: 0,
                op: 0,
                step: Some(Step::I8c),
                peer: 1,
                failing: 1,
                fail_op: 0
            })
        );
        // After the ring (rank 1 fails before reading its output), rank 0 may complete.
        let cfg = ring_two_by_one(1, Step::I12);
        assert_eq!(check_outcome_internode(&cfg, &one_op(&cfg, ok)), Ok(()));
        // [I8] and [I9] are not the ring's steps: a failure there never fires.
        assert!(!failure_fires(&ring_two_by_one(1, Step::I8)));
        assert!(failure_fires(&ring_two_by_one(1, Step::I7)));
    }

    #[test]
    fn a_source_cannot_complete_a_streamed_combine_without_its_forwarders_partials() {
        use crate::config::OpKind::InternodeCombine;
        assert!(route_count(1, 3, 0, 1) > 0, "the routing oracle changed");
        // 2x1, [ID, IC], a ring of one slot: rank 1 forwards rank 0's tokens and fails in the
        // combine before it reduces them ([J6]), so it never streams their partials.
        let cfg = ModelConfig::new(
            2,
            3,
            1,
            Schedule::Epoch,
            vec![InternodeDispatch, InternodeCombine],
        )
        .unwrap()
        .with_nodes(2)
        .unwrap()
        .with_rail_ring(RailRing {
            slots: 1,
            chunk_rows: 1,
        })
        .unwrap()
        .with_failure(Failure {
            rank: 1,
            op: 1,
            at: Step::J6,
        })
        .unwrap();
        let reference = sequential_reference(&cfg);
        let reports = |r0: OpResult| {
            vec![
                RankReport {
                    rank: 0,
                    outputs: vec![reference[0].outputs[0].clone(), r0],
                },
                RankReport {
                    rank: 1,
                    outputs: vec![
                        reference[1].outputs[0].clone(),
                        Err(OpError::TimedOut { step: Step::J6 }),
                    ],
                },
            ]
        };
        let aborted = Err(OpError::Aborted {
            step: Step::J8c,
            peer: 1,
            by: 1,
        });
        assert_eq!(check_outcome_internode(&cfg, &reports(aborted)), Ok(()));
        // Rank 0 needs rank 1's partials ([J8c]) and, its own two partials for rank 1 going
        // through one slot, rank 1's credit for the first ([J6c]): the rule names the first.
        assert!(matches!(
            check_outcome_internode(&cfg, &reports(reference[0].outputs[1].clone())),
            Err(OutcomeViolation::CompletedWithoutSignal {
                rank: 0,
                op: 1,
                step: Some(Step::J6c | Step::J8c),
                peer: 1,
                failing: 1,
                fail_op: 1
            })
        ));
        // [J7] is not a step of the streamed combine: a failure there never fires.
        let at_j7 = cfg
            .clone()
            .with_failure(Failure {
                rank: 1,
                op: 1,
                at: Step::J7,
            })
            .unwrap();
        assert!(!failure_fires(&at_j7) && failure_fires(&cfg));
    }
}
