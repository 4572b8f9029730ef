//! Errors of the frontend.

use std::time::Duration;

use epcomm_kernels::abi;

use crate::stats::OpKind;

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
    /// \[A2] a peer's intent word for this op (docs/protocol.md, "Op agreement").
    OpIntent,
    /// \[I6c] rail forwarding: the rail peer in another node freeing a slot of its ring (its
    /// forwarder is late or gone).
    RingSlotFreed,
    /// \[I8c] rail forwarding: a rail source's entries landing in this rank's ring.
    RingEntries,
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
            abi::wait::INTENT => Self::OpIntent,
            abi::wait::RING_FREE => Self::RingSlotFreed,
            abi::wait::RING_CHUNK => Self::RingEntries,
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
        "{op} on rank {rank} stopped during {wait:?}: rank {origin} failed first ({cause}{} in \
         its op #{origin_op_seq}); destroy this Buffer on every rank and create a new one",
        late_text(*.late)
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
        /// The rank the origin waited for when it timed out (the late rank), or the peer
        /// whose op disagreed with its own; `None` for failures of the origin's own (an
        /// overflow, an invalid expert id).
        late: Option<usize>,
        /// The origin's op sequence number (low 16 bits).
        origin_op_seq: u64,
    },
    /// Ranks issued different ops at the same point of their sequence, or the same op with
    /// arguments every rank must share (docs/protocol.md, "Op agreement"): another op kind
    /// (a skipped or extra op), top-k weights on some ranks only, BF16 rows against FP8, a
    /// staged or in-place combine against a pushed one (the ranks' receive modes or captures
    /// differ). Each rank compares one word per peer and op, so every rank of the op fails
    /// within microseconds of the last one starting it, instead of finishing with rows it
    /// never received or waiting out the timeout. The buffer is failed on every rank.
    #[error(
        "{op} on rank {rank}: ranks {rank} and {peer} disagree on this op's {fields} \
         (op #{op_seq}; {detail}); every rank must issue the same ops in the same order, with \
         the same kind, dtype, weights and combine mode; destroy this Buffer on every rank and \
         create a new one"
    )]
    OpMismatch {
        /// The op this rank was running.
        op: &'static str,
        /// This rank (world rank).
        rank: usize,
        /// The peer that disagrees (world rank).
        peer: usize,
        /// What differs, e.g. "weights" or "dtype (FP8 scales), row bytes".
        fields: String,
        /// Both ranks' ops when this rank found the difference itself, e.g. `rank 0: combine
        /// [weights, push], rank 1: combine [push]`; else that the peer found it.
        detail: String,
        /// The op's sequence number (low 16 bits when learned from the peer).
        op_seq: u64,
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
        let op = OpKind::of(r.op).map_or("unknown op", |o| o.name);
        match r.code {
            abi::code::OP_MISMATCH => Self::OpMismatch {
                op,
                rank: r.rank as usize,
                peer: r.peer.max(0) as usize,
                fields: field_names(intent_fields(r.expected, r.seen)),
                detail: format!(
                    "rank {}: {}, rank {}: {}",
                    r.rank,
                    describe_intent(r.expected),
                    r.peer,
                    describe_intent(r.seen)
                ),
                op_seq: r.epoch,
            },
            // A peer found a mismatch first: its abort code carries the fields (bits 8..15).
            abi::code::PEER_FAILED if r.expected as u32 & 0xff == abi::code::OP_MISMATCH => {
                Self::OpMismatch {
                    op,
                    rank: r.rank as usize,
                    peer: r.peer.max(0) as usize,
                    fields: field_names((r.expected as u32 >> 8) & 0xff),
                    detail: match r.expected >> 32 {
                        0 => format!("rank {} found it first", r.peer),
                        l => format!("rank {} found it first, against rank {}", r.peer, l - 1),
                    },
                    op_seq: r.seen,
                }
            }
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
                late: match r.expected >> 32 {
                    0 => None,
                    l => Some(l as usize - 1),
                },
                cause: match r.expected as u32 & 0xff {
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

/// `PeerFailed`'s words on the late rank, when the origin named one.
fn late_text(late: Option<usize>) -> String {
    late.map_or(String::new(), |l| format!(" waiting for rank {l}"))
}

/// The fields two intent words (`ErrorRecord::expected`/`seen` of `code::OP_MISMATCH`) differ
/// in, as the kernels put them in an abort word: bit 0 the op kind (alone: nothing else compares
/// across kinds), bits 1..5 the `abi::flags` bits of `INTENT_FLAG_MASK`, bit 6 the row bytes.
fn intent_fields(mine: u64, theirs: u64) -> u32 {
    let d = (mine ^ theirs) as u32;
    if d >> abi::INTENT_KIND_SHIFT != 0 {
        return 1;
    }
    let rows = if d & abi::INTENT_ROW_MASK != 0 { 64 } else { 0 };
    ((d >> abi::INTENT_FLAG_SHIFT) & abi::INTENT_FLAG_MASK) | rows
}

/// The names of the fields in `fields` ([`intent_fields`]), e.g. "weights, row bytes".
fn field_names(fields: u32) -> String {
    let names: Vec<&str> = [
        (1, "op kind"),
        (abi::flags::HAS_SCALES, "dtype (FP8 scales)"),
        (abi::flags::HAS_WEIGHTS, "weights"),
        (abi::flags::HAS_TOPK, "top-k ids"),
        (
            abi::flags::IN_PLACE,
            "combine mode (staged or in place against pushed)",
        ),
        (abi::flags::ROUND_SCALE, "scale rounding"),
        (64, "row bytes (hidden size or dtype)"),
    ]
    .into_iter()
    .filter(|&(bit, _)| fields & bit != 0)
    .map(|(_, name)| name)
    .collect();
    if names.is_empty() {
        "arguments".into()
    } else {
        names.join(", ")
    }
}

/// An intent word in words: the op kind, its flags and its row bytes, e.g.
/// "combine [weights, in place]" or "dispatch [fp8, top-k ids], 7168-byte rows".
fn describe_intent(word: u64) -> String {
    let c = word as u32;
    let kind = OpKind::of(c >> abi::INTENT_KIND_SHIFT)
        .filter(|o| o.in_intent)
        .map_or("another op", |o| o.name);
    let flags = (c >> abi::INTENT_FLAG_SHIFT) & abi::INTENT_FLAG_MASK;
    let mut parts: Vec<&str> = [
        (abi::flags::HAS_SCALES, "fp8"),
        (abi::flags::HAS_WEIGHTS, "weights"),
        (abi::flags::HAS_TOPK, "top-k ids"),
        (abi::flags::IN_PLACE, "in place"),
        (abi::flags::ROUND_SCALE, "rounded scales"),
    ]
    .into_iter()
    .filter(|&(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect();
    if c >> abi::INTENT_KIND_SHIFT == abi::op::COMBINE && flags & abi::flags::IN_PLACE == 0 {
        parts.push("push");
    }
    let rows = c & abi::INTENT_ROW_MASK;
    let rows = if rows == 0 {
        String::new()
    } else {
        format!(", {rows}-byte rows")
    };
    format!("{kind} [{}]{rows}", parts.join(", "))
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
    use crate::stats::OP_KINDS;

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
        assert!(
            matches!(e, Error::PeerFailed { late: None, .. }),
            "an invalid expert id has no late rank: {e:?}"
        );
        // A timeout relayed with the rank its origin waited for (high 32 bits: late + 1).
        let r = abi::ErrorRecord {
            wait_id: abi::wait::DISPATCH_DONE,
            rank: 0,
            ..record(
                abi::code::PEER_FAILED,
                abi::op::DISPATCH,
                2,
                abi::code::TIMEOUT as u64 | (4 << 32),
                9,
            )
        };
        let e = Error::from_record(&r);
        assert!(
            matches!(
                e,
                Error::PeerFailed {
                    rank: 0,
                    origin: 2,
                    late: Some(3),
                    cause: "a timeout",
                    origin_op_seq: 9,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("rank 2 failed first (a timeout waiting for rank 3 in its op #9)"),
            "{text}"
        );
    }

    /// The intent word the kernels publish (kernels/common/seq.cuh, `op_intent`).
    fn intent(op_seq: u64, kind: u32, flags: u32, row_bytes: u32) -> u64 {
        let content = (kind << abi::INTENT_KIND_SHIFT)
            | ((flags & abi::INTENT_FLAG_MASK) << abi::INTENT_FLAG_SHIFT)
            | ((row_bytes ^ (row_bytes >> 20)) & abi::INTENT_ROW_MASK);
        (op_seq & 0xffff_ffff) << 32 | u64::from(content)
    }

    #[test]
    fn op_mismatch_records_name_the_fields_and_both_ranks() {
        use abi::flags::{HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, IN_PLACE};
        let mismatch = |op, mine, theirs| {
            let r = abi::ErrorRecord {
                wait_id: abi::wait::INTENT,
                rank: 1,
                epoch: 5,
                ..record(abi::code::OP_MISMATCH, op, 0, mine, theirs)
            };
            Error::from_record(&r)
        };
        let d = abi::op::DISPATCH;
        let cases = [
            // Weights on one rank only.
            (
                abi::op::COMBINE,
                intent(5, abi::op::COMBINE, 0, 0),
                intent(5, abi::op::COMBINE, HAS_WEIGHTS, 0),
                "weights",
            ),
            // BF16 on one rank, FP8 on the other: the scales and the row size differ.
            (
                d,
                intent(5, d, HAS_TOPK, 14336),
                intent(5, d, HAS_TOPK | HAS_SCALES, 7168),
                "dtype (FP8 scales), row bytes",
            ),
            // Staged (in place) against pushed.
            (
                abi::op::COMBINE,
                intent(5, abi::op::COMBINE, IN_PLACE, 0),
                intent(5, abi::op::COMBINE, 0, 0),
                "combine mode",
            ),
            // Another op: only the kind is named.
            (
                abi::op::CACHED_DISPATCH,
                intent(5, abi::op::CACHED_DISPATCH, 0, 14336),
                intent(5, abi::op::COMBINE, IN_PLACE | HAS_WEIGHTS, 0),
                "op kind",
            ),
        ];
        for (op, mine, theirs, field) in cases {
            let e = mismatch(op, mine, theirs);
            let Error::OpMismatch {
                rank: 1,
                peer: 0,
                op_seq: 5,
                ref fields,
                ..
            } = e
            else {
                panic!("{e:?}");
            };
            assert!(fields.starts_with(field), "{fields} vs {field}");
            let text = e.to_string();
            assert!(
                text.contains(field) && text.contains("ranks 1 and 0") && text.contains("rank 0:"),
                "{text}"
            );
        }
        // The kind alone when kinds differ.
        let e = mismatch(
            abi::op::DISPATCH,
            intent(5, d, HAS_TOPK, 14336),
            intent(5, abi::op::COMBINE, 0, 0),
        );
        assert!(
            matches!(&e, Error::OpMismatch { fields, .. } if fields == "op kind"),
            "{e:?}"
        );
        // Learned from the peer: its abort code carries the fields (bits 8..15).
        let code = abi::code::OP_MISMATCH | (abi::flags::HAS_WEIGHTS << 8);
        let r = abi::ErrorRecord {
            wait_id: abi::wait::COMBINE_DONE,
            rank: 0,
            ..record(
                abi::code::PEER_FAILED,
                abi::op::COMBINE,
                1,
                u64::from(code),
                5,
            )
        };
        let e = Error::from_record(&r);
        let text = e.to_string();
        assert!(
            matches!(&e, Error::OpMismatch { rank: 0, peer: 1, op_seq: 5, fields, .. } if fields == "weights")
                && text.contains("rank 1 found it first"),
            "{e:?}"
        );
        // Other causes keep their names with the upper bits clear.
        let r = record(
            abi::code::PEER_FAILED,
            abi::op::COMBINE,
            1,
            u64::from(abi::code::TIMEOUT),
            5,
        );
        assert!(
            Error::from_record(&r).to_string().contains("a timeout"),
            "{r:?}"
        );
    }

    /// Every op kind the ABI defines (`abi::op::ALL`) is named in errors and, where an intent
    /// word can carry it, in intent words; the names are the ones these messages always used.
    #[test]
    fn every_abi_op_kind_is_named_in_errors() {
        let timeout_op = |op| match Error::from_record(&record(abi::code::TIMEOUT, op, 0, 1, 0)) {
            Error::Timeout { op, .. } => op,
            e => panic!("{e:?}"),
        };
        for kind in abi::op::ALL {
            let entry = OpKind::of(kind).unwrap_or_else(|| panic!("op kind {kind} has no name"));
            assert_eq!(timeout_op(kind), entry.name, "op kind {kind}");
            let described = describe_intent(intent(3, kind, 0, 256));
            let name = if entry.in_intent {
                entry.name
            } else {
                "another op"
            };
            assert!(described.starts_with(name), "op kind {kind}: {described}");
        }
        assert_eq!(timeout_op(0), "unknown op");
        let names: Vec<&str> = abi::op::ALL.into_iter().map(timeout_op).collect();
        assert_eq!(
            names,
            [
                "layout",
                "dispatch",
                "cached dispatch",
                "combine",
                "low-latency dispatch",
                "low-latency dispatch",
                "low-latency combine",
                "low-latency combine"
            ]
        );
        let intents: Vec<u32> = OP_KINDS
            .iter()
            .filter(|o| o.in_intent)
            .map(|o| o.kind)
            .collect();
        assert_eq!(
            intents,
            [
                abi::op::DISPATCH,
                abi::op::CACHED_DISPATCH,
                abi::op::COMBINE,
                abi::op::LL_DISPATCH,
                abi::op::LL_COMBINE
            ]
        );
    }
}
