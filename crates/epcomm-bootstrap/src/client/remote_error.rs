//! Turning the errors the coordinator decides ([`RemoteError`]) into the public
//! [`BootstrapError`], with this rank's context (operation, tag, round, time waited).

use std::time::Duration;

use crate::error::{BootstrapError, OpKind};
use crate::wire::RemoteError;

/// Turns a coordinator-decided error into the public error, adding this rank's context.
pub(super) fn remote_error(
    e: RemoteError,
    op: OpKind,
    tag: &str,
    round: u64,
    waited: Duration,
) -> BootstrapError {
    let tag = tag.to_string();
    match e {
        RemoteError::Timeout { missing } => BootstrapError::Timeout {
            op,
            tag,
            round,
            missing_ranks: missing,
            waited,
        },
        RemoteError::PeerDied { rank } => BootstrapError::PeerDied { rank, op, tag },
        RemoteError::PeerLeft { rank } => BootstrapError::PeerLeft { rank, op, tag },
        RemoteError::ProtocolMismatch {
            coordinator,
            peer,
            peer_rank,
        } => BootstrapError::ProtocolVersionMismatch {
            coordinator,
            peer,
            peer_rank,
        },
        RemoteError::CrateMismatch {
            coordinator,
            peer,
            peer_rank,
        } => BootstrapError::CrateVersionMismatch {
            coordinator,
            peer,
            peer_rank,
        },
        RemoteError::WorldMismatch {
            coordinator,
            peer,
            peer_rank,
        } => BootstrapError::WorldSizeMismatch {
            coordinator,
            peer,
            peer_rank,
        },
        RemoteError::DuplicateRank {
            rank,
            first,
            second,
        } => BootstrapError::DuplicateRank {
            rank,
            first,
            second,
        },
        RemoteError::RankOutOfRange { rank, world_size } => {
            BootstrapError::RankOutOfRange { rank, world_size }
        }
        RemoteError::OpMismatch {
            rank_a,
            call_a,
            rank_b,
            call_b,
        } => BootstrapError::OpMismatch {
            round,
            rank_a,
            call_a,
            rank_b,
            call_b,
        },
        RemoteError::TooLarge { size, limit } => BootstrapError::PayloadTooLarge {
            op,
            tag,
            size,
            limit,
        },
        RemoteError::RendezvousClosed { rank } => BootstrapError::RendezvousClosed { rank },
        RemoteError::PeerUnresponsive { rank, silent_ms } => BootstrapError::PeerUnresponsive {
            rank,
            op,
            tag,
            silent_for: Duration::from_millis(silent_ms),
        },
    }
}
