//! Errors of the frontend.

use std::time::Duration;

use epcomm_kernels::abi;

/// Which device wait expired (docs/protocol.md step labels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitKind {
    /// \[E2] a peer's count row.
    CountRow,
    /// \[E2] a peer's per-expert counts.
    ExpertCounts,
    /// \[E6] a peer's dispatch data.
    DispatchData,
    /// \[C3] a peer's combine contributions.
    CombineData,
    /// \[G*] a Global-strategy barrier.
    Barrier,
    /// The host's wait for the receive count (HostSync).
    HostRecvCount,
    /// The op's start: a peer's failure was already known.
    OpStart,
    /// \[L5]/\[L6] a peer's low-latency dispatch rows and counts.
    LlDispatchData,
    /// \[L9] a peer's low-latency combine rows.
    LlCombineData,
    /// \[P2] this rank's CPU proxy completing its puts (or a free slot in its ring): the
    /// proxy thread stopped, failed or fell behind.
    ProxyCompletion,
    /// Unknown code (newer kernels).
    Other(u32),
}

impl WaitKind {
    pub(crate) fn from_code(code: u32) -> Self {
        match code {
            abi::wait::COUNT_ROW => Self::CountRow,
            abi::wait::EXPERT_COUNTS => Self::ExpertCounts,
            abi::wait::DISPATCH_DONE => Self::DispatchData,
            abi::wait::COMBINE_DONE => Self::CombineData,
            abi::wait::BARRIER => Self::Barrier,
            abi::wait::OP_START => Self::OpStart,
            abi::wait::LL_DISPATCH => Self::LlDispatchData,
            abi::wait::LL_COMBINE => Self::LlCombineData,
            abi::wait::PROXY => Self::ProxyCompletion,
            other => Self::Other(other),
        }
    }
}

/// Errors of epcomm operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument broke a rule.
    #[error("invalid {argument}: {rule}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// The rule it broke.
        rule: String,
    },
    /// A bounded wait expired. The buffer is failed; destroy it and make a new one.
    #[error(
        "timeout in {op} on rank {rank}: waited {waited:?} for {wait:?} from rank {peer} \
         (op #{op_seq}, expected {expected}, saw {seen}); rank {peer} is late or gone"
    )]
    Timeout {
        /// The op.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// What was waited for.
        wait: WaitKind,
        /// The peer waited for.
        peer: i64,
        /// Op sequence number.
        op_seq: u64,
        /// Value waited for.
        expected: u64,
        /// Value last seen.
        seen: u64,
        /// How long.
        waited: Duration,
    },
    /// A dispatch would receive more rows than allowed; nothing was written.
    #[error("{op}: rank {dest} would receive {requested} rows, more than the capacity {capacity}")]
    Overflow {
        /// The op.
        op: &'static str,
        /// The receiving rank.
        dest: i64,
        /// Rows it would receive.
        requested: u64,
        /// Allowed rows (buffer capacity or `RecvMode::Bounded`).
        capacity: u64,
    },
    /// A top-k id outside `[-1, num_experts)`.
    #[error(
        "invalid topk_idx: token {token} has expert id {value}, must be -1 or in 0..{num_experts}"
    )]
    InvalidExpert {
        /// Token index.
        token: i64,
        /// The id (as stored, two's complement).
        value: i64,
        /// Number of experts.
        num_experts: u64,
    },
    /// A low-latency dispatch found a token naming one expert twice.
    #[error("invalid topk_idx: token {token} names expert {expert} more than once")]
    DuplicateExpert {
        /// Token index.
        token: i64,
        /// The expert id.
        expert: i64,
    },
    /// Another rank failed first (its own error names the cause); this rank's op stopped
    /// within microseconds of learning it. The buffer is failed on every rank.
    #[error(
        "{op} on rank {rank} stopped during {wait:?}: rank {origin} failed first ({cause} in \
         its op #{origin_op_seq}); destroy this Buffer on every rank and create a new one"
    )]
    PeerFailed {
        /// The op that stopped here.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// Where this rank was when it learned of the failure.
        wait: WaitKind,
        /// The rank whose failure came first.
        origin: usize,
        /// What happened there (timeout, overflow, invalid expert id).
        cause: &'static str,
        /// The origin's op sequence number (low 32 bits).
        origin_op_seq: u64,
    },
    /// Ranks built a `Buffer` with different configurations (every rank gets this error).
    #[error(
        "ranks disagree on {field} ({values}); every rank must create its Buffer with the same value"
    )]
    ConfigMismatch {
        /// The field that differs.
        field: &'static str,
        /// Every rank's value, e.g. "rank 0: 24, rank 1: 32".
        values: String,
    },
    /// An earlier error left this buffer unusable.
    #[error("this Buffer failed earlier ({0}); destroy it and create a new one")]
    Failed(String),
    /// A kernel's wait on this rank's own transport machinery failed (the CPU proxy's
    /// completions, [`WaitKind::ProxyCompletion`]): `cause` is the kernel's typed error,
    /// `backend` what the transport reports about that machinery (its own error, its progress).
    #[error("{cause}; {backend}")]
    BackendStalled {
        /// The kernel's error (a [`Error::Timeout`]).
        cause: Box<Error>,
        /// The transport's report.
        backend: String,
    },
    /// Transport error.
    #[error(transparent)]
    Transport(#[from] epcomm_transport::TransportError),
    /// A host collective (all-gather, barrier) over the bootstrap failed.
    #[error(transparent)]
    Bootstrap(#[from] epcomm_bootstrap::BootstrapError),
    /// Kernel loading/launch error.
    #[error(transparent)]
    Kernel(#[from] epcomm_kernels::KernelError),
    /// Topology/config error.
    #[error(transparent)]
    Topology(#[from] epcomm_topology::TopologyError),
    /// CUDA driver error.
    #[error("CUDA driver error while {context}: {source}")]
    Driver {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
}

impl Error {
    /// Translates a device failure record.
    pub(crate) fn from_record(r: &abi::ErrorRecord) -> Self {
        let op = match r.op {
            abi::op::LAYOUT => "layout",
            abi::op::DISPATCH => "dispatch",
            abi::op::CACHED_DISPATCH => "cached dispatch",
            abi::op::COMBINE => "combine",
            abi::op::LL_DISPATCH | abi::op::LL_DISPATCH_RECV => "low-latency dispatch",
            abi::op::LL_COMBINE | abi::op::LL_COMBINE_RECV => "low-latency combine",
            _ => "unknown op",
        };
        match r.code {
            abi::code::OVERFLOW => Self::Overflow {
                op,
                dest: r.peer as i64,
                requested: r.seen,
                capacity: r.expected,
            },
            abi::code::INVALID_EXPERT => Self::InvalidExpert {
                token: r.peer as i64,
                value: r.seen as i64,
                num_experts: r.expected,
            },
            abi::code::DUPLICATE_EXPERT => Self::DuplicateExpert {
                token: r.peer as i64,
                expert: r.seen as i64,
            },
            abi::code::PEER_FAILED => Self::PeerFailed {
                op,
                rank: r.rank as usize,
                wait: WaitKind::from_code(r.wait_id),
                origin: r.peer.max(0) as usize,
                cause: match r.expected as u32 {
                    abi::code::TIMEOUT => "a timeout",
                    abi::code::OVERFLOW => "a receive overflow",
                    abi::code::INVALID_EXPERT => "an invalid expert id",
                    abi::code::DUPLICATE_EXPERT => "a duplicate expert id",
                    _ => "a device failure",
                },
                origin_op_seq: r.seen,
            },
            _ => Self::Timeout {
                op,
                rank: r.rank as usize,
                wait: WaitKind::from_code(r.wait_id),
                peer: r.peer as i64,
                op_seq: r.epoch,
                expected: r.expected,
                seen: r.seen,
                waited: Duration::from_nanos(r.waited_ns),
            },
        }
    }
}

pub(crate) trait DriverContext<T> {
    fn context(self, context: &'static str) -> Result<T, Error>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn context(self, context: &'static str) -> Result<T, Error> {
        self.map_err(|source| Error::Driver { context, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of `code` in `op` naming `peer`, with the values `expected` and `seen`.
    fn record(code: u32, op: u32, peer: i32, expected: u64, seen: u64) -> abi::ErrorRecord {
        abi::ErrorRecord {
            code,
            op,
            peer,
            expected,
            seen,
            ..Default::default()
        }
    }

    #[test]
    fn records_become_typed_errors_naming_the_peer() {
        let r = abi::ErrorRecord {
            wait_id: abi::wait::COMBINE_DONE,
            rank: 1,
            epoch: 9,
            waited_ns: 2_000_000,
            ..record(abi::code::TIMEOUT, abi::op::COMBINE, 3, 48, 24)
        };
        let e = Error::from_record(&r).to_string();
        assert!(
            e.contains("combine") && e.contains("rank 3") && e.contains("CombineData"),
            "{e}"
        );
        let invalid = record(abi::code::INVALID_EXPERT, abi::op::LAYOUT, 7, 64, 99);
        let overflow = record(abi::code::OVERFLOW, abi::op::DISPATCH, 0, 10, 12);
        let errors = (Error::from_record(&invalid), Error::from_record(&overflow));
        assert!(
            matches!(
                errors,
                (
                    Error::InvalidExpert {
                        token: 7,
                        value: 99,
                        num_experts: 64
                    },
                    Error::Overflow {
                        requested: 12,
                        capacity: 10,
                        ..
                    }
                )
            ),
            "{errors:?}"
        );
        let r = abi::ErrorRecord {
            wait_id: abi::wait::OP_START,
            rank: 1,
            ..record(
                abi::code::PEER_FAILED,
                abi::op::CACHED_DISPATCH,
                2,
                abi::code::INVALID_EXPERT as u64,
                7,
            )
        };
        let e = Error::from_record(&r);
        assert!(
            matches!(
                e,
                Error::PeerFailed {
                    rank: 1,
                    origin: 2,
                    wait: WaitKind::OpStart,
                    origin_op_seq: 7,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("rank 2 failed first") && text.contains("invalid expert id"),
            "{text}"
        );
    }
}
