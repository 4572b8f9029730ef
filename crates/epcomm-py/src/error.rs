//! [`BindError`], every failure of the native layer, and [`ErrorInfo`], the Python exception it
//! becomes: a class of the `epcomm.errors` module, the Rust error's message unchanged, and the
//! typed fields as attributes (the late rank of a timeout, the argument a rule names, ...).
//!
//! The mapping is plain data, so it is tested here without Python; the PyO3 layer only turns
//! an [`ErrorInfo`] into an exception object.

use std::time::Duration;

use epcomm_backends::TransportError;
use epcomm_bootstrap::BootstrapError;
use epcomm_topology::TopologyError;

/// Everything the native layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// An op of the frontend failed.
    #[error(transparent)]
    Epcomm(#[from] epcomm::Error),
    /// Building the transport failed, or a transport spec is invalid.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The rendezvous (or a host collective) failed.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// A shape or name the topology rules refuse.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The reference workload generator refused its arguments.
    #[error(transparent)]
    Reference(#[from] epcomm_reference::RefError),
    /// An argument of the native layer broke a rule.
    #[error("invalid {argument}: {rule}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// The rule it broke.
        rule: String,
    },
    /// The CUDA driver library is not there.
    #[error("no CUDA driver: the driver library (libcuda.so.1) is not found by the dynamic loader")]
    NoDriver,
    /// A CUDA driver call of the native layer failed.
    #[error("CUDA driver error while {context}: {source}")]
    Driver {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The buffer was destroyed (explicitly or after a failed destroy).
    #[error("this Buffer was destroyed; create a new one")]
    Destroyed,
    /// The native layer's view of the frontend's memory layout disagrees with the frontend's.
    #[error("epcomm internal error: {0}")]
    Internal(String),
}

/// Results of the native layer.
pub type Result<T, E = BindError> = std::result::Result<T, E>;

/// The value of one exception attribute.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    /// `None`.
    None,
    /// An `int`.
    Int(i64),
    /// A `float` (durations are seconds).
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list[int]`.
    Ints(Vec<i64>),
}

/// A Python exception to raise: `epcomm.errors.<class>(message, **attrs)`.
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorInfo {
    /// The class name in `epcomm.errors`.
    pub class: &'static str,
    /// The message (the Rust error's `Display`).
    pub message: String,
    /// Keyword attributes.
    pub attrs: Vec<(&'static str, Attr)>,
}

impl ErrorInfo {
    fn new(class: &'static str, message: String) -> Self {
        Self {
            class,
            message,
            attrs: Vec::new(),
        }
    }

    fn with(mut self, key: &'static str, value: Attr) -> Self {
        self.attrs.push((key, value));
        self
    }

    /// The attribute `key`, if set.
    pub fn attr(&self, key: &str) -> Option<&Attr> {
        self.attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

fn int(v: impl TryInto<i64>) -> Attr {
    v.try_into().map_or(Attr::None, Attr::Int)
}

fn secs(d: Duration) -> Attr {
    Attr::Float(d.as_secs_f64())
}

/// A rank given as i64 where -1 means "no rank" (the host's own wait).
fn rank_or_none(peer: i64) -> Attr {
    if peer < 0 {
        Attr::None
    } else {
        Attr::Int(peer)
    }
}

fn invalid(message: String, argument: Option<&str>, rule: Option<String>) -> ErrorInfo {
    let rule = rule.unwrap_or_else(|| message.clone());
    ErrorInfo::new("InvalidArgumentError", message)
        .with(
            "argument",
            argument.map_or(Attr::None, |a| Attr::Str(a.into())),
        )
        .with("rule", Attr::Str(rule))
}

impl BindError {
    /// The Python exception this error becomes.
    pub fn info(&self) -> ErrorInfo {
        let message = self.to_string();
        match self {
            Self::Epcomm(e) => epcomm_info(e, message),
            Self::Transport(e) => transport_info(e, message),
            Self::Bootstrap(e) => bootstrap_info(e, message),
            Self::Topology(e) => invalid(message, topology_argument(e), None),
            Self::Reference(_) => invalid(message, None, None),
            Self::InvalidArgument { argument, rule } => {
                invalid(message, Some(argument), Some(rule.clone()))
            }
            Self::NoDriver | Self::Driver { .. } => ErrorInfo::new("CudaError", message),
            Self::Destroyed => ErrorInfo::new("BufferFailedError", message)
                .with("reason", Attr::Str("destroyed".into())),
            Self::Internal(_) => ErrorInfo::new("EpcommError", message),
        }
    }
}

/// The argument a topology error names.
fn topology_argument(e: &TopologyError) -> Option<&'static str> {
    #[allow(unreachable_patterns)] // newer variants fall through
    match e {
        TopologyError::Zero { arg }
        | TopologyError::NotMultiple { arg, .. }
        | TopologyError::IndexOutOfRange { arg, .. }
        | TopologyError::OutOfRange { arg, .. }
        | TopologyError::NotPositiveFinite { arg, .. } => Some(arg),
        TopologyError::UnknownName { what, .. } => Some(what),
        _ => None,
    }
}

fn epcomm_info(e: &epcomm::Error, message: String) -> ErrorInfo {
    use epcomm::Error as E;
    #[allow(unreachable_patterns)] // variants added to the frontend later fall through
    match e {
        E::InvalidArgument { argument, rule } => {
            invalid(message, Some(argument), Some(rule.clone()))
        }
        E::Timeout {
            op,
            rank,
            wait,
            peer,
            op_seq,
            expected,
            seen,
            waited,
        } => ErrorInfo::new("TimeoutError", message)
            .with("late_rank", rank_or_none(*peer))
            .with("op", Attr::Str((*op).into()))
            .with("rank", int(*rank))
            .with("wait", Attr::Str(format!("{wait:?}")))
            .with("op_seq", int(*op_seq))
            .with("expected", int(*expected))
            .with("seen", int(*seen))
            .with("waited", secs(*waited)),
        E::Overflow {
            op,
            dest,
            requested,
            capacity,
        } => ErrorInfo::new("ReceiveOverflowError", message)
            .with("op", Attr::Str((*op).into()))
            .with("dest", int(*dest))
            .with("requested", int(*requested))
            .with("capacity", int(*capacity)),
        E::InvalidExpert {
            token,
            value,
            num_experts,
        } => ErrorInfo::new("InvalidExpertError", message)
            .with("argument", Attr::Str("topk_idx".into()))
            .with("rule", Attr::Str(message_rule(e)))
            .with("token", int(*token))
            .with("value", int(*value))
            .with("num_experts", int(*num_experts)),
        E::DuplicateExpert { token, expert } => ErrorInfo::new("InvalidExpertError", message)
            .with("argument", Attr::Str("topk_idx".into()))
            .with("rule", Attr::Str(message_rule(e)))
            .with("token", int(*token))
            .with("value", int(*expert)),
        E::PeerFailed {
            op,
            rank,
            wait,
            origin,
            late,
            cause,
            origin_op_seq,
        } => ErrorInfo::new("PeerFailedError", message)
            .with("origin", int(*origin))
            .with("late_rank", late.map_or(Attr::None, int))
            .with("op", Attr::Str((*op).into()))
            .with("rank", int(*rank))
            .with("wait", Attr::Str(format!("{wait:?}")))
            .with("cause", Attr::Str((*cause).into()))
            .with("origin_op_seq", int(*origin_op_seq)),
        E::OpMismatch {
            op,
            rank,
            peer,
            fields,
            detail,
            op_seq,
        } => ErrorInfo::new("OpMismatchError", message)
            .with("op", Attr::Str((*op).into()))
            .with("rank", int(*rank))
            .with("peer", int(*peer))
            .with("fields", Attr::Str(fields.clone()))
            .with("detail", Attr::Str(detail.clone()))
            .with("op_seq", int(*op_seq)),
        E::ConfigMismatch { field, values } => ErrorInfo::new("ConfigMismatchError", message)
            .with("field", Attr::Str((*field).into()))
            .with("values", Attr::Str(values.clone())),
        E::Failed(reason) => {
            ErrorInfo::new("BufferFailedError", message).with("reason", Attr::Str(reason.clone()))
        }
        // The kernel's own error decides the class (a timeout); the message keeps the report.
        E::BackendStalled { cause, .. } => epcomm_info(cause, message),
        E::Transport(t) => transport_info(t, message),
        E::Bootstrap(b) => bootstrap_info(b, message),
        E::Kernel(_) => ErrorInfo::new("KernelError", message),
        E::Topology(t) => invalid(message, topology_argument(t), None),
        E::Driver { .. } => ErrorInfo::new("CudaError", message),
        _ => ErrorInfo::new("EpcommError", message),
    }
}

/// The part of an `invalid topk_idx: ...` message after the argument.
fn message_rule(e: &epcomm::Error) -> String {
    let m = e.to_string();
    m.strip_prefix("invalid topk_idx: ")
        .unwrap_or(&m)
        .to_string()
}

fn transport_info(e: &TransportError, message: String) -> ErrorInfo {
    #[allow(unreachable_patterns)] // newer variants fall through
    match e {
        TransportError::InvalidArgument { argument, rule } => {
            invalid(message, Some(argument), Some(rule.clone()))
        }
        TransportError::Topology(t) => invalid(message, topology_argument(t), None),
        TransportError::Bootstrap { source, .. } => bootstrap_info(source, message),
        _ => ErrorInfo::new("TransportError", message),
    }
}

fn bootstrap_info(e: &BootstrapError, message: String) -> ErrorInfo {
    #[allow(unreachable_patterns)] // the enum is non-exhaustive
    match e {
        BootstrapError::Timeout {
            op,
            missing_ranks,
            waited,
            ..
        } => ErrorInfo::new("BootstrapTimeoutError", message)
            .with(
                "late_rank",
                missing_ranks.first().map_or(Attr::None, |&r| int(r)),
            )
            .with(
                "missing_ranks",
                Attr::Ints(missing_ranks.iter().map(|&r| r as i64).collect()),
            )
            .with("op", Attr::Str(op.name().into()))
            .with("waited", secs(*waited)),
        BootstrapError::PeerDied { rank, op, .. }
        | BootstrapError::PeerLeft { rank, op, .. }
        | BootstrapError::PeerUnresponsive { rank, op, .. } => {
            ErrorInfo::new("PeerLostError", message)
                .with("rank", int(*rank))
                .with("op", Attr::Str(op.name().into()))
        }
        BootstrapError::MissingEnv { var, .. } | BootstrapError::InvalidEnv { var, .. } => {
            invalid(message, Some(var), None)
        }
        BootstrapError::InvalidConfig { field, rule, .. } => {
            invalid(message, Some(field), Some(rule.clone()))
        }
        BootstrapError::InvalidArgument { argument, rule, .. } => {
            invalid(message, Some(argument), Some(rule.clone()))
        }
        BootstrapError::NoLauncherEnv => invalid(message, Some("environment"), None),
        _ => ErrorInfo::new("BootstrapError", message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_carry_the_late_rank_and_the_same_message() {
        let e = BindError::Epcomm(epcomm::Error::Timeout {
            op: "dispatch",
            rank: 0,
            wait: epcomm::WaitKind::CountRow,
            peer: 3,
            op_seq: 7,
            expected: 2,
            seen: 1,
            waited: Duration::from_millis(1500),
        });
        let info = e.info();
        assert_eq!(info.class, "TimeoutError");
        assert_eq!(info.message, e.to_string());
        assert_eq!(info.attr("late_rank"), Some(&Attr::Int(3)));
        assert_eq!(info.attr("wait"), Some(&Attr::Str("CountRow".into())));
        assert_eq!(info.attr("waited"), Some(&Attr::Float(1.5)));
        // The host's own wait names no peer.
        let host = BindError::Epcomm(epcomm::Error::Timeout {
            op: "dispatch",
            rank: 1,
            wait: epcomm::WaitKind::HostRecvCount,
            peer: -1,
            op_seq: 1,
            expected: 1,
            seen: 0,
            waited: Duration::from_secs(1),
        });
        assert_eq!(host.info().attr("late_rank"), Some(&Attr::None));
        // A stalled proxy: the kernel's timeout decides the class, the report rides along.
        let stalled = BindError::Epcomm(epcomm::Error::BackendStalled {
            cause: Box::new(epcomm::Error::Timeout {
                op: "dispatch",
                rank: 1,
                wait: epcomm::WaitKind::ProxyCompletion,
                peer: 1,
                op_seq: 1,
                expected: 10,
                seen: 0,
                waited: Duration::from_secs(2),
            }),
            backend: "the proxy thread stopped".into(),
        });
        let info = stalled.info();
        assert_eq!(info.class, "TimeoutError");
        assert_eq!(
            info.attr("wait"),
            Some(&Attr::Str("ProxyCompletion".into()))
        );
        assert!(
            info.message.ends_with("; the proxy thread stopped"),
            "{}",
            info.message
        );
    }

    #[test]
    fn invalid_arguments_name_the_argument_at_every_layer() {
        let frontend = BindError::Epcomm(epcomm::Error::InvalidArgument {
            argument: "x",
            rule: "must hold 4 values (holds 3)".into(),
        });
        let transport: BindError = "carrier-pigeon"
            .parse::<epcomm_backends::TransportSpec>()
            .unwrap_err()
            .into();
        let topology: BindError = "sometimes"
            .parse::<epcomm_topology::Schedule>()
            .unwrap_err()
            .into();
        let config: BindError = epcomm::BufferConfig {
            hidden: 7001,
            ..epcomm::BufferConfig::new(16, 128, 2, 8)
        }
        .validate()
        .unwrap_err()
        .into();
        for (e, argument) in [
            (frontend, "x"),
            (transport, "transport"),
            (topology, "schedule"),
            (config, "hidden"),
        ] {
            let info = e.info();
            assert_eq!(info.class, "InvalidArgumentError", "{e}");
            assert_eq!(info.message, e.to_string());
            assert_eq!(
                info.attr("argument"),
                Some(&Attr::Str(argument.into())),
                "{e}"
            );
        }
    }

    #[test]
    fn device_failures_become_their_own_classes() {
        let cases = [
            (
                epcomm::Error::Overflow {
                    op: "dispatch",
                    dest: 1,
                    requested: 9,
                    capacity: 8,
                },
                "ReceiveOverflowError",
            ),
            (
                epcomm::Error::InvalidExpert {
                    token: 4,
                    value: 99,
                    num_experts: 16,
                },
                "InvalidExpertError",
            ),
            (
                epcomm::Error::PeerFailed {
                    op: "combine",
                    rank: 0,
                    wait: epcomm::WaitKind::OpStart,
                    origin: 1,
                    late: None,
                    cause: "a timeout",
                    origin_op_seq: 3,
                },
                "PeerFailedError",
            ),
            (
                epcomm::Error::ConfigMismatch {
                    field: "hidden",
                    values: "rank 0: 128, rank 1: 256".into(),
                },
                "ConfigMismatchError",
            ),
            (
                epcomm::Error::OpMismatch {
                    op: "combine",
                    rank: 0,
                    peer: 1,
                    fields: "weights".into(),
                    detail: "rank 0: combine [weights, push], rank 1: combine [push]".into(),
                    op_seq: 7,
                },
                "OpMismatchError",
            ),
            (
                epcomm::Error::Failed("an earlier timeout".into()),
                "BufferFailedError",
            ),
        ];
        for (e, class) in cases {
            let b = BindError::Epcomm(e);
            let info = b.info();
            assert_eq!(info.class, class);
            assert_eq!(info.message, b.to_string());
        }
        let e = BindError::Epcomm(epcomm::Error::InvalidExpert {
            token: 4,
            value: 99,
            num_experts: 16,
        });
        let info = e.info();
        assert_eq!(info.attr("argument"), Some(&Attr::Str("topk_idx".into())));
        assert_eq!(info.attr("value"), Some(&Attr::Int(99)));
        let peer = BindError::Epcomm(epcomm::Error::PeerFailed {
            op: "combine",
            rank: 0,
            wait: epcomm::WaitKind::OpStart,
            origin: 1,
            late: Some(2),
            cause: "a timeout",
            origin_op_seq: 3,
        });
        assert_eq!(peer.info().attr("origin"), Some(&Attr::Int(1)));
        assert_eq!(peer.info().attr("late_rank"), Some(&Attr::Int(2)));
    }

    #[test]
    fn bootstrap_timeouts_name_the_missing_ranks() {
        let e = BindError::Bootstrap(BootstrapError::Timeout {
            op: epcomm_bootstrap::OpKind::Connect,
            tag: String::new(),
            round: 0,
            missing_ranks: vec![2, 5],
            waited: Duration::from_secs(3),
        });
        let info = e.info();
        assert_eq!(info.class, "BootstrapTimeoutError");
        assert_eq!(info.attr("late_rank"), Some(&Attr::Int(2)));
        assert_eq!(info.attr("missing_ranks"), Some(&Attr::Ints(vec![2, 5])));
        assert!(info.message.contains("[2, 5]"), "{}", info.message);
        let lost = BindError::Bootstrap(BootstrapError::PeerDied {
            rank: 1,
            op: epcomm_bootstrap::OpKind::Barrier,
            tag: "t".into(),
        });
        assert_eq!(lost.info().class, "PeerLostError");
        assert_eq!(lost.info().attr("rank"), Some(&Attr::Int(1)));
    }

    #[test]
    fn the_native_layers_own_errors() {
        assert_eq!(BindError::NoDriver.info().class, "CudaError");
        assert_eq!(BindError::Destroyed.info().class, "BufferFailedError");
        let e = BindError::InvalidArgument {
            argument: "timeout",
            rule: "must be a finite number of seconds > 0 (got -1)".into(),
        };
        assert_eq!(
            e.info().message,
            "invalid timeout: must be a finite number of seconds > 0 (got -1)"
        );
        assert_eq!(
            e.info().attr("rule"),
            Some(&Attr::Str(
                "must be a finite number of seconds > 0 (got -1)".into()
            ))
        );
    }
}
