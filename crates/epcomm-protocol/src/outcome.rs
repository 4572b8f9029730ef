//! The vocabulary of a run's results, shared by the model (which produces them), the
//! references (which say what they must be) and the outcome rules (which judge them): what an
//! op produced ([`OpOutput`]) or how it ended ([`OpError`]), one rank's [`RankReport`], and the
//! [`OutcomeViolation`]s a judge finds; plus the two comparisons every rule makes.

use crate::config::ModelConfig;
use crate::step::Step;

/// What one op produced on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpOutput {
    /// Rows received by a dispatch, ordered by source rank then token (the `[E3]` offsets).
    /// Also the output of the internode dispatches (`seq`: their own sequence number).
    Dispatch {
        /// Dispatch sequence number (the epoch).
        seq: u64,
        /// The received data words.
        rows: Vec<u64>,
    },
    /// Per-token reductions of a combine (wrapping sum over contributors in rank order).
    /// Also the output of the internode combine (`seq`: its own sequence number; the sum of
    /// the contributors' [`crate::config::inter_combine_word`]s, whatever the grouping).
    Combine {
        /// Combine sequence number.
        seq: u64,
        /// One reduced word per token this rank owns.
        reduced: Vec<u64>,
    },
    /// The packed rows of a low-latency dispatch, ordered by source rank then token (the model
    /// has one expert per rank, so the packed order of `[L6]`/`[L7]` is the source order).
    LlDispatch {
        /// LL dispatch sequence number (the kernels' `ll_dispatch`).
        seq: u64,
        /// The received rows ([`crate::config::ll_row_word`]).
        rows: Vec<u64>,
    },
    /// Per-token reductions of a low-latency combine (wrapping sum over the token's valid top-k
    /// slots in increasing `k`).
    LlCombine {
        /// LL combine sequence number (the kernels' `ll_combine`).
        seq: u64,
        /// One reduced word per token this rank owns (0 for a token routed nowhere).
        reduced: Vec<u64>,
    },
}

/// How one op ended on one rank: its output, or the error it ended in.
pub type OpResult = Result<OpOutput, OpError>;

/// Everything one rank produced, one entry per op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// One result per op, in op order.
    pub outputs: Vec<OpResult>,
}

/// A property of a run's final results that the run broke; found by
/// [`check_outcome`](crate::check_outcome).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutcomeViolation {
    /// The reports do not cover every rank and every op.
    #[error("rank {rank}: {found} results for {expected} ops (or a missing rank)")]
    Length {
        /// The rank.
        rank: usize,
        /// Number of ops.
        expected: usize,
        /// Number of results.
        found: usize,
    },
    /// A completed op produced something else than the sequential reference. Property (d).
    #[error(
        "rank {rank}, op {op}: completed with {found:?}, the sequential reference is {expected:?}"
    )]
    Output {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The sequential reference.
        expected: OpOutput,
        /// What the op returned.
        found: OpOutput,
    },
    /// An op ended in an error that the configuration cannot cause at that rank and op (no
    /// failure injected, or one that cannot reach this op yet).
    #[error("rank {rank}, op {op}: ended in an error the configuration cannot cause: {error}")]
    UnexpectedError {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The error.
        error: OpError,
    },
    /// The injected failure did not happen where it was configured.
    #[error("rank {rank}, op {op}: the injected failure must end this op, found {found:?}")]
    MissingFailure {
        /// The failing rank.
        rank: usize,
        /// The failing op.
        op: usize,
        /// What the op returned instead.
        found: OpResult,
    },
    /// An op ran although an earlier op of the same rank failed: the prologue `[F1]` must
    /// refuse every later op before it writes anything. Property (e).
    #[error(
        "rank {rank}, op {op}: op {failed} failed, so [F1] must refuse this op; found {found:?}"
    )]
    NotRefused {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The earlier op that failed.
        failed: usize,
        /// What the op returned.
        found: OpResult,
    },
    /// A peer completed an op that needs a signal the failing rank never published. Property (e).
    #[error(
        "rank {rank}, op {op}: completed, but rank {failing} failed in op {fail_op} before signalling what this op waits for"
    )]
    CompletedWithoutPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The failing rank.
        failing: usize,
        /// The op it failed in.
        fail_op: usize,
    },
    /// A run with a stopped rank: a survivor completed an op that waits for the stopped rank
    /// without masking it (masking off, or not a low-latency op), at or after the op it
    /// stopped in.
    #[error(
        "rank {rank}, op {op}: completed, but it waits for rank {stopped}, which stopped in op {stop_op}, without masking it"
    )]
    CompletedWithoutStoppedPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The stopped rank.
        stopped: usize,
        /// The op it stopped in.
        stop_op: usize,
    },
    /// A run with a stopped rank: the stopped rank's result of an op is not what its stop
    /// makes it (completed before the stop op, [`OpError::Stopped`] from it on).
    #[error(
        "rank {rank} (stopped in op {stop_op}), op {op}: expected {}, found {found:?}",
        expected.as_ref().map_or("a completed op".to_string(), |e| format!("{e:?}"))
    )]
    StoppedRankResult {
        /// The stopped rank.
        rank: usize,
        /// The op it stopped in.
        stop_op: usize,
        /// The op.
        op: usize,
        /// The [`OpError::Stopped`] the op must report; `None`: it must complete.
        expected: Option<OpError>,
        /// What it reported.
        found: OpResult,
    },
    /// An internode-family run: an op completed although a signal one of its waits needs was
    /// never published (its writer failed, or gave up, before publishing it), directly or
    /// through a forwarder or a credit. Property (e), [`crate::check_outcome_internode`].
    #[error(
        "rank {rank}, op {op}: completed, but its wait {step:?} on peer {peer} needs a signal no report published (rank {failing} failed in op {fail_op})"
    )]
    CompletedWithoutSignal {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The wait's step (`None`: the coarse wait of an intranode op for every done signal).
        step: Option<Step>,
        /// The peer the wait names.
        peer: usize,
        /// The failing rank.
        failing: usize,
        /// The op it failed in.
        fail_op: usize,
    },
}

/// How an op ended when it did not complete: the protocol's failure path, not a violation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub enum OpError {
    /// The injected failure ([`crate::config::Failure`]): this rank's wait before `step` timed
    /// out; it recorded the failure and published the abort word (`[F2]`).
    #[error("{step}: timed out (injected failure)")]
    TimedOut {
        /// The step the failure was injected before.
        step: Step,
    },
    /// A bounded wait gave up because rank `by` failed: the abort word it published, or (when
    /// `by` is this rank) this rank's own failure claim.
    #[error("wait {step}: gave up on peer {peer}, rank {by} failed")]
    Aborted {
        /// The wait.
        step: Step,
        /// The peer it waited on.
        peer: usize,
        /// The rank that failed.
        by: usize,
    },
    /// `[F1]`: the op exited at its prologue, before writing anything, because rank `by` failed
    /// (this rank's failure claim, or the abort word).
    #[error("[F1] refused: rank {by} failed")]
    Refused {
        /// The rank that failed.
        by: usize,
    },
    /// A bounded wait for `peer` expired because `peer` stopped
    /// ([`crate::config::StoppedRank`]), in an op that does not mask it (masking off, or not a
    /// low-latency op): the kernels' `kTimeout`. This rank records the failure and publishes
    /// the abort word (`[F2]`), as for [`OpError::TimedOut`].
    #[error("wait {step}: expired on peer {peer}, which stopped")]
    Expired {
        /// The wait.
        step: Step,
        /// The stopped peer it waited for.
        peer: usize,
    },
    /// This rank stopped ([`crate::config::StoppedRank`]) before `step` of this op, or (`step`
    /// = [`Step::F1`]) before the op started: it ran no more of it. Not a failure: it claims
    /// nothing and publishes nothing.
    #[error("stopped before {step}")]
    Stopped {
        /// The step it stopped before.
        step: Step,
    },
}

/// `found`, the output rank `rank` reported for op `op`, against the sequential reference's.
///
/// # Errors
/// [`OutcomeViolation::Output`] when they differ.
pub(crate) fn check_output(
    reference: &[RankReport],
    rank: usize,
    op: usize,
    found: &OpOutput,
) -> Result<(), OutcomeViolation> {
    let expected = reference[rank].outputs[op]
        .as_ref()
        .expect("the reference completes every op");
    if found != expected {
        return Err(OutcomeViolation::Output {
            rank,
            op,
            expected: expected.clone(),
            found: found.clone(),
        });
    }
    Ok(())
}

/// Every rank has a report, in rank order, with one result per op.
///
/// # Errors
/// [`OutcomeViolation::Length`] for the first rank whose report is missing or short.
pub(crate) fn check_lengths(
    cfg: &ModelConfig,
    reports: &[RankReport],
) -> Result<(), OutcomeViolation> {
    let ops = cfg.ops().len();
    if reports.len() != cfg.world() {
        return Err(OutcomeViolation::Length {
            rank: reports.len().min(cfg.world()),
            expected: ops,
            found: 0,
        });
    }
    for (rank, report) in reports.iter().enumerate() {
        if report.rank != rank || report.outputs.len() != ops {
            return Err(OutcomeViolation::Length {
                rank,
                expected: ops,
                found: report.outputs.len(),
            });
        }
    }
    Ok(())
}

/// After op `failed` of `rank` failed, its op `op` ended in `result`: `refused` says whether
/// the rule accepts that as the prologue's refusal (`[F1]`).
///
/// # Errors
/// [`OutcomeViolation::NotRefused`] unless `refused`.
pub(crate) fn check_refused(
    rank: usize,
    op: usize,
    failed: usize,
    result: &OpResult,
    refused: bool,
) -> Result<(), OutcomeViolation> {
    if refused {
        return Ok(());
    }
    Err(OutcomeViolation::NotRefused {
        rank,
        op,
        failed,
        found: result.clone(),
    })
}

/// Op `op` of `rank` ended in `error`: `allowed` says whether the rule allows it there.
///
/// # Errors
/// [`OutcomeViolation::UnexpectedError`] unless `allowed`.
pub(crate) fn check_allowed(
    rank: usize,
    op: usize,
    error: &OpError,
    allowed: bool,
) -> Result<(), OutcomeViolation> {
    if allowed {
        return Ok(());
    }
    Err(OutcomeViolation::UnexpectedError {
        rank,
        op,
        error: error.clone(),
    })
}
