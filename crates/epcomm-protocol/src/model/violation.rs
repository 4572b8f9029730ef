//! What the model reports and the checks that produce it.
//!
//! A [`Violation`] means the protocol (or the variant run) is wrong; an [`OpError`] is the
//! protocol's own failure path; [`RunError`] adds misuse of [`run_rank`](super::run_rank). The
//! checks on [`Rank`] compare what a rank reads against the routing oracle of
//! [`crate::config`]: the `[R]` recheck of the live dispatch output, the rows, the counts.

use std::fmt;

use super::{Live, Rank, Stop};
use crate::config::{OpKind, route_count};
use crate::outcome::OutcomeViolation;
use crate::step::Step;
use crate::sync::Ordering;

/// Which data region a [`Violation::Data`] was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Region {
    /// `recv[parity][slot]`, the dispatch receive slots.
    Recv,
    /// `comb[parity][src][token]`, the combine receive slots (slot = `src * tokens + token`).
    Comb,
    /// `ll_x[parity][src][j]`, the low-latency receive rows (slot = `src * tokens + j`).
    LlX,
    /// `ll_comb[parity][token][k]`, the low-latency combine rows (slot = `token * world + k`).
    LlComb,
    /// `rail_buf[parity][src_node][r]`, the internode rail rows (slot = `src_node * tokens + r`).
    RailBuf,
    /// `ring[src_node][slot]`, the chunked-forwarding ring (reported with the source node in
    /// place of the parity: one region, chunks counted since setup).
    Ring,
    /// `pring[node][slot]`, the ring of streamed combine partials (reported like `ring`).
    PRing,
    /// `xrecv[parity][src][j]`, the internode receive rows (slot = `src * tokens + j`).
    XRecv,
    /// `cdirect[parity][src][token]`, the internode combine's direct contributions (slot =
    /// `src * tokens + token`).
    CDirect,
    /// `cfwd[parity][src][token][j]`, the contributions a forwarder reduces (slot =
    /// `(src * tokens + token) * L + j`).
    CFwd,
    /// `cpart[parity][node][token]`, the rail partials (slot = `node * tokens + token`).
    CPart,
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Region::Recv => "recv",
            Region::Comb => "comb",
            Region::LlX => "ll_x",
            Region::LlComb => "ll_comb",
            Region::RailBuf => "rail_buf",
            Region::Ring => "ring",
            Region::PRing => "pring",
            Region::XRecv => "xrecv",
            Region::CDirect => "cdirect",
            Region::CFwd => "cfwd",
            Region::CPart => "cpart",
        })
    }
}

/// A protocol violation detected by the model: the protocol (or the variant run) is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A count word carried another notify epoch than the op's: stale (older) or written by a
    /// peer more than one op ahead (newer). Property (a).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: count_matrix[{parity}][{src}][{dst}] carries notify epoch {found}, the op runs notify epoch {expected}"
    )]
    CountTag {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Count region index.
        parity: usize,
        /// Row (sender).
        src: usize,
        /// Column (receiver).
        dst: usize,
        /// The op's notify epoch.
        expected: u64,
        /// The tag found.
        found: u64,
    },
    /// A low-latency count word carried another LL epoch than the op's (stale, newer, or
    /// untagged). Property (a).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: ll_counts[{parity}][{src}] carries LL epoch {found}, the op runs LL epoch {expected}"
    )]
    LlCountTag {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// LL region index.
        parity: usize,
        /// Sender.
        src: usize,
        /// The op's LL dispatch epoch.
        expected: u64,
        /// The tag found.
        found: u64,
    },
    /// An internode count word (`rail_count` or `xcount`) carried another internode notify
    /// epoch than the op's (stale, newer, or never written). Property (a).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: {word}[{parity}][{src}][{index}] carries internode notify epoch {found}, the op runs epoch {expected}"
    )]
    InterCountTag {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// `"rail_count"` or `"xcount"`.
        word: &'static str,
        /// Count region index.
        parity: usize,
        /// Source node (`rail_count`) or source rank (`xcount`).
        src: usize,
        /// Entry within the source (`rail_count`: `j`; `xcount`: 0).
        index: usize,
        /// The op's internode notify epoch.
        expected: u64,
        /// The tag found.
        found: u64,
    },
    /// A count word carried the right tag but a count the routing does not produce.
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: count {src}->{dst} is {found}, the routing gives {expected}"
    )]
    CountValue {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// The routing's count.
        expected: u64,
        /// The count read.
        found: u64,
    },
    /// A data slot held another value than the sequential expectation: it was overwritten before
    /// its owner consumed it, or read before it landed. Properties (b) and (d).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: {region}[{parity}] slot {slot} holds {found:#x}, expected {expected:#x}"
    )]
    Data {
        /// Rank that read the slot.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Which region.
        region: Region,
        /// Region index (the parity, or 0 under
        /// [`Mutation::SingleRegion`](crate::config::Mutation::SingleRegion)).
        parity: usize,
        /// Slot within the region.
        slot: usize,
        /// The sequential expectation.
        expected: u64,
        /// The value read.
        found: u64,
    },
    /// A bounded wait expired (std runs only; loom reports deadlock itself). Property (c).
    #[error(
        "rank {rank}, op {op} ({kind:?}), wait {step}: timed out after {waited_ms} ms on peer {peer}: waiting for {expected}, last seen {seen}"
    )]
    Timeout {
        /// Waiting rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The wait.
        step: Step,
        /// Peer whose word never arrived.
        peer: usize,
        /// Value (or epoch) waited for.
        expected: u64,
        /// Last value (or epoch) seen.
        seen: u64,
        /// How long it waited.
        waited_ms: u64,
    },
    /// A rank that failed wrote shared memory again (a count, data, flag or done word): its
    /// prologue `[F1]` must stop every later op before the first write. Property (e).
    #[error("rank {rank}, op {op} ({kind:?}), {step}: writes shared memory after this rank failed")]
    WriteAfterFailure {
        /// The rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The writing step.
        step: Step,
    },
    /// `[A2]`: a peer's intent word for this op is another op's (a peer two agreed ops ahead
    /// overwrote the slot: the two-slot argument is broken) or says another kind (the ranks
    /// run the same ops in the model, so this is a protocol bug).
    #[error(
        "rank {rank}, op {op} ({kind:?}), [A2] check intent: peer {peer}'s intent word is \
         {seen:#x}, expected {expected:#x}"
    )]
    Intent {
        /// The rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The peer whose word was read.
        peer: usize,
        /// This rank's word for the op.
        expected: u64,
        /// The word read.
        seen: u64,
    },
    /// The results of all ranks break a property of the outcome (see [`crate::check_outcome`]).
    #[error(transparent)]
    Outcome(#[from] OutcomeViolation),
    /// A wait was abandoned because another rank already reported a violation (std runs only).
    #[error(
        "rank {rank}, op {op} ({kind:?}), wait {step}: abandoned on peer {peer} because rank {failed} reported a violation"
    )]
    PeerFailed {
        /// Waiting rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The wait.
        step: Step,
        /// Peer waited on.
        peer: usize,
        /// Rank that failed first.
        failed: usize,
    },
}

impl Violation {
    /// Whether this violation is a consequence of another rank's violation.
    pub fn is_secondary(&self) -> bool {
        matches!(self, Violation::PeerFailed { .. })
    }
}

pub use crate::outcome::OpError;

/// Misuse of [`run_rank`](super::run_rank).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// `rank` is not below the world size.
    #[error("rank = {rank}: must be below the world size {world}")]
    Rank {
        /// The rejected rank.
        rank: usize,
        /// World size of the [`World`](super::World).
        world: usize,
    },
    /// The protocol was violated.
    #[error(transparent)]
    Violation(#[from] Violation),
}

/// Every violation of a failed [`run_model`](super::run_model), causes first.
#[cfg(not(loom))]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} protocol violation(s); first: {}", violations.len(), violations.first().map(ToString::to_string).unwrap_or_default())]
pub struct ModelFailure {
    /// The violations, primary ones (not [`Violation::PeerFailed`]) first.
    pub violations: Vec<Violation>,
}

impl Rank<'_> {
    /// `[R]`: the output of the last dispatch must be intact when the next op starts; a new
    /// dispatch then releases it.
    pub(super) fn recheck(&mut self) -> Result<(), Stop> {
        self.step(Step::Recheck)?;
        if let Some(live) = &self.live {
            self.check_rows(Step::Recheck, live)?;
        }
        if self.kind.is_dispatch() {
            self.live = None;
        }
        if let Some(live) = &self.inter_live {
            for &(src, j, expected) in &live.rows {
                let found = self
                    .w
                    .xrecv(self.me, live.parity, src, j)
                    .load(Ordering::Relaxed);
                if found != expected {
                    let slot = src * self.cfg.tokens() + j;
                    return Err(self
                        .data_violation(
                            Step::Recheck,
                            Region::XRecv,
                            live.parity,
                            slot,
                            expected,
                            found,
                        )
                        .into());
                }
            }
        }
        if self.kind.is_internode() {
            self.inter_live = None;
        }
        Ok(())
    }

    pub(super) fn check_rows(&self, step: Step, live: &Live) -> Result<(), Violation> {
        for (slot, &expected) in live.rows.iter().enumerate() {
            let found = self
                .w
                .recv(self.me, live.parity, slot)
                .load(Ordering::Relaxed);
            if found != expected {
                return Err(self.data_violation(
                    step,
                    Region::Recv,
                    live.parity,
                    slot,
                    expected,
                    found,
                ));
            }
        }
        Ok(())
    }

    pub(super) fn data_violation(
        &self,
        step: Step,
        region: Region,
        parity: usize,
        slot: usize,
        expected: u64,
        found: u64,
    ) -> Violation {
        Violation::Data {
            rank: self.me,
            op: self.op,
            kind: self.kind,
            step,
            region,
            parity,
            slot,
            expected,
            found,
        }
    }

    pub(super) fn count_tag(
        &self,
        step: Step,
        parity: usize,
        src: usize,
        dst: usize,
        expected: u64,
        found: u64,
    ) -> Violation {
        Violation::CountTag {
            rank: self.me,
            op: self.op,
            kind: self.kind,
            step,
            parity,
            src,
            dst,
            expected,
            found,
        }
    }

    pub(super) fn check_count(
        &self,
        step: Step,
        layout_seq: u64,
        src: usize,
        dst: usize,
        found: u64,
    ) -> Result<u64, Violation> {
        let expected = route_count(layout_seq, self.cfg.tokens(), src, dst);
        self.check_count_value(step, expected, src, dst, found)
    }

    /// A count `found` of `src -> dst` read at `step` must equal the routing's `expected`.
    pub(super) fn check_count_value(
        &self,
        step: Step,
        expected: u64,
        src: usize,
        dst: usize,
        found: u64,
    ) -> Result<u64, Violation> {
        if found == expected {
            Ok(found)
        } else {
            Err(Violation::CountValue {
                rank: self.me,
                op: self.op,
                kind: self.kind,
                step,
                src,
                dst,
                expected,
                found,
            })
        }
    }
}
