//! Error type of the bootstrap: every failure is a [`BootstrapError`] variant that names the
//! variable, argument, rank or value involved.

use std::fmt;
use std::io;
use std::time::Duration;

/// Which bootstrap operation an error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// The rendezvous performed by [`crate::Bootstrap::connect`].
    Connect,
    /// [`crate::Bootstrap::all_gather`].
    AllGather,
    /// [`crate::Bootstrap::broadcast`].
    Broadcast,
    /// [`crate::Bootstrap::barrier`].
    Barrier,
}

impl OpKind {
    /// The stable lowercase name used in messages (`"all_gather"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Connect => "connect",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        }
    }

    /// Wire code of the operation (see the crate docs).
    pub(crate) fn code(self) -> u8 {
        match self {
            OpKind::Connect => 0,
            OpKind::AllGather => 1,
            OpKind::Broadcast => 2,
            OpKind::Barrier => 3,
        }
    }

    /// Inverse of [`OpKind::code`].
    pub(crate) fn from_code(code: u8) -> Option<OpKind> {
        match code {
            0 => Some(OpKind::Connect),
            1 => Some(OpKind::AllGather),
            2 => Some(OpKind::Broadcast),
            3 => Some(OpKind::Barrier),
            _ => None,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can go wrong while configuring, connecting or running collectives.
///
/// Errors produced by the coordinator (timeouts, dead peers, mismatches) are delivered to every
/// rank that takes part in the failed operation, so all ranks report the same cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// None of the launcher rank variables is present in the environment.
    #[error(
        "no launcher environment found: none of RANK (torchrun), SLURM_PROCID (Slurm) or \
         OMPI_COMM_WORLD_RANK (OpenMPI) is set"
    )]
    NoLauncherEnv,

    /// A variable required by the detected launcher is not set.
    #[error("environment variable {var} is not set ({context})")]
    MissingEnv {
        /// The variable that is missing.
        var: String,
        /// Why it is required (which launcher was detected).
        context: String,
    },

    /// A variable is set but its value cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {rule}")]
    InvalidEnv {
        /// The offending variable.
        var: String,
        /// Its value.
        value: String,
        /// The rule the value breaks.
        rule: String,
    },

    /// A [`crate::BootstrapConfig`] field breaks a rule.
    #[error("invalid bootstrap config: {field} = {value} ({rule})")]
    InvalidConfig {
        /// The config field.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule the value breaks.
        rule: String,
    },

    /// An argument of a collective call breaks a rule; nothing was sent to the coordinator.
    #[error("invalid argument `{argument}` to {op}: {rule}")]
    InvalidArgument {
        /// The operation called.
        op: OpKind,
        /// The argument name.
        argument: &'static str,
        /// The rule the argument breaks.
        rule: String,
    },

    /// `master_addr:master_port` could not be resolved to a socket address.
    #[error("cannot resolve bootstrap address {addr}: {source}")]
    Resolve {
        /// The `host:port` string.
        addr: String,
        /// The resolver error.
        #[source]
        source: io::Error,
    },

    /// Rank 0 could not bind the coordinator listener.
    #[error("rank 0 cannot bind the bootstrap coordinator on {addr}: {source}")]
    Bind {
        /// The address that was tried last.
        addr: String,
        /// The bind error.
        #[source]
        source: io::Error,
    },

    /// No TCP connection to the coordinator could be made before the timeout.
    #[error(
        "could not connect to the bootstrap coordinator at {addr} within {waited:?} \
         (last error: {last_error})"
    )]
    ConnectTimeout {
        /// The `host:port` string.
        addr: String,
        /// How long connecting was retried.
        waited: Duration,
        /// The last connection error seen.
        last_error: String,
    },

    /// A socket operation failed while talking to the coordinator.
    #[error("I/O error talking to the bootstrap coordinator during {op} (tag {tag:?}): {source}")]
    Io {
        /// The operation in progress.
        op: OpKind,
        /// Its tag.
        tag: String,
        /// The socket error.
        #[source]
        source: io::Error,
    },

    /// The other side sent something that is not valid bootstrap protocol.
    #[error("bootstrap protocol violation: {detail}")]
    Protocol {
        /// What was wrong.
        detail: String,
    },

    /// The coordinator and a joining rank speak different wire protocol versions.
    #[error(
        "bootstrap protocol version mismatch: coordinator speaks {coordinator}, rank {peer_rank} \
         speaks {peer}"
    )]
    ProtocolVersionMismatch {
        /// Version spoken by the coordinator (rank 0).
        coordinator: u32,
        /// Version spoken by the joining rank.
        peer: u32,
        /// The joining rank.
        peer_rank: usize,
    },

    /// The coordinator and a joining rank run different `epcomm-bootstrap` versions.
    #[error(
        "epcomm-bootstrap version mismatch: coordinator (rank 0) runs {coordinator}, rank \
         {peer_rank} runs {peer}"
    )]
    CrateVersionMismatch {
        /// Crate version of the coordinator (rank 0).
        coordinator: String,
        /// Crate version of the joining rank.
        peer: String,
        /// The joining rank.
        peer_rank: usize,
    },

    /// A joining rank was started with a different world size than rank 0.
    #[error(
        "world size mismatch: coordinator (rank 0) expects {coordinator} ranks, rank {peer_rank} \
         was started with world size {peer}"
    )]
    WorldSizeMismatch {
        /// World size of the coordinator (rank 0).
        coordinator: usize,
        /// World size of the joining rank.
        peer: usize,
        /// The joining rank.
        peer_rank: usize,
    },

    /// Two processes claimed the same rank.
    #[error("rank {rank} joined twice: first from {first}, again from {second}")]
    DuplicateRank {
        /// The rank claimed twice.
        rank: usize,
        /// Address of the process that claimed it first.
        first: String,
        /// Address of the process that claimed it again.
        second: String,
    },

    /// A rank number outside `0..world_size` tried to join.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank claimed.
        rank: usize,
        /// The world size of the coordinator.
        world_size: usize,
    },

    /// A rank tried to join after the rendezvous had already completed (or failed).
    #[error("rank {rank} tried to join after the rendezvous had completed")]
    RendezvousClosed {
        /// The rank that arrived late.
        rank: usize,
    },

    /// Not every rank arrived at an operation before the timeout.
    #[error(
        "{op} (tag {tag:?}, round {round}) timed out after {waited:?}: rank(s) {missing_ranks:?} \
         did not arrive"
    )]
    Timeout {
        /// The operation.
        op: OpKind,
        /// Its tag (empty for [`OpKind::Connect`]).
        tag: String,
        /// Its round (sequence number; 0 for [`OpKind::Connect`]).
        round: u64,
        /// Ranks the coordinator was still waiting for, ascending.
        missing_ranks: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },

    /// A rank's connection dropped without a goodbye (its process died or its socket broke).
    /// `rank == 0` also means the coordinator itself is gone.
    #[error("rank {rank} died (connection lost) before {op} (tag {tag:?}) could complete")]
    PeerDied {
        /// The rank that died.
        rank: usize,
        /// The operation that cannot complete.
        op: OpKind,
        /// Its tag.
        tag: String,
    },

    /// Nothing (not even a heartbeat) arrived from a rank for longer than its
    /// [`crate::Liveness::peer_timeout`], although its connection is still open: its process is
    /// frozen (stopped, in a debugger, hung) or its host is unreachable. `rank == 0` means this
    /// rank heard nothing from the coordinator. The rank is treated as dead from then on.
    #[error(
        "rank {rank} sent nothing for {silent_for:?} (frozen, stopped or unreachable) before \
         {op} (tag {tag:?}) could complete; the limit is EPCOMM_BOOTSTRAP_PEER_TIMEOUT_MS"
    )]
    PeerUnresponsive {
        /// The silent rank.
        rank: usize,
        /// The operation that cannot complete.
        op: OpKind,
        /// Its tag.
        tag: String,
        /// How long nothing had arrived from it when it was declared dead.
        silent_for: Duration,
    },

    /// A rank dropped its [`crate::Bootstrap`] cleanly while others still needed it.
    #[error("rank {rank} closed its bootstrap before {op} (tag {tag:?}) could complete")]
    PeerLeft {
        /// The rank that left.
        rank: usize,
        /// The operation that cannot complete.
        op: OpKind,
        /// Its tag.
        tag: String,
    },

    /// Ranks called different collectives (or tags, or roots) in the same round.
    #[error(
        "collective mismatch in round {round}: rank {rank_a} called {call_a}, rank {rank_b} called {call_b}"
    )]
    OpMismatch {
        /// The round (sequence number).
        round: u64,
        /// The first rank.
        rank_a: usize,
        /// What the first rank called.
        call_a: String,
        /// The second rank.
        rank_b: usize,
        /// What the second rank called.
        call_b: String,
    },

    /// The result (or a contribution) of an operation is larger than one frame may carry.
    #[error("{op} (tag {tag:?}) needs {size} bytes in one frame, over the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The operation.
        op: OpKind,
        /// Its tag.
        tag: String,
        /// Bytes needed.
        size: u64,
        /// The limit.
        limit: u64,
    },

    /// The coordinator did not answer within the timeout plus a grace period.
    #[error(
        "the bootstrap coordinator did not answer {op} (tag {tag:?}, round {round}) within {waited:?}"
    )]
    CoordinatorUnresponsive {
        /// The operation.
        op: OpKind,
        /// Its tag.
        tag: String,
        /// Its round.
        round: u64,
        /// How long this rank waited.
        waited: Duration,
    },

    /// An earlier failure left the connection to the coordinator unusable.
    #[error("bootstrap connection is unusable for {op} (tag {tag:?}): {cause}")]
    ConnectionBroken {
        /// The operation attempted.
        op: OpKind,
        /// Its tag.
        tag: String,
        /// The earlier failure.
        cause: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = BootstrapError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_codes_round_trip() {
        for op in [
            OpKind::Connect,
            OpKind::AllGather,
            OpKind::Broadcast,
            OpKind::Barrier,
        ] {
            assert_eq!(OpKind::from_code(op.code()), Some(op));
        }
        assert_eq!(OpKind::from_code(4), None);
    }

    #[test]
    fn unresponsive_message_names_rank_and_silence() {
        let e = BootstrapError::PeerUnresponsive {
            rank: 3,
            op: OpKind::AllGather,
            tag: "ids".into(),
            silent_for: Duration::from_millis(5200),
        };
        let msg = e.to_string();
        assert!(msg.starts_with("rank 3 sent nothing for 5.2s"), "{msg}");
        assert!(msg.contains("all_gather"), "{msg}");
        assert!(msg.contains("EPCOMM_BOOTSTRAP_PEER_TIMEOUT_MS"), "{msg}");
    }

    #[test]
    fn timeout_message_names_missing_ranks() {
        let e = BootstrapError::Timeout {
            op: OpKind::Barrier,
            tag: "init".into(),
            round: 3,
            missing_ranks: vec![2, 5],
            waited: Duration::from_millis(1500),
        };
        let msg = e.to_string();
        assert!(msg.contains("barrier"), "{msg}");
        assert!(msg.contains("[2, 5]"), "{msg}");
        assert!(msg.contains("round 3"), "{msg}");
    }
}
