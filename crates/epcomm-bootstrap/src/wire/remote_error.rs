//! [`RemoteError`]: the errors the coordinator decides and sends to the ranks concerned (in
//! `Reject` and `OpErr`), and their wire codes.
//!
//! An error travels as a code `u8` and its fields; the codes are part of the protocol and never
//! change meaning. Decoding an unknown code is a [`DecodeError`].

use super::codec::{Dec, DecodeError, Enc};

// Error codes, each followed on the wire by the fields named (ranks and sizes are `u64`).
/// Timeout: count `u32`, then that many missing ranks.
const E_TIMEOUT: u8 = 1;
/// Peer died: rank.
const E_PEER_DIED: u8 = 2;
/// Peer left: rank.
const E_PEER_LEFT: u8 = 3;
/// Protocol mismatch: coordinator `u32`, peer `u32`, peer rank.
const E_PROTOCOL_MISMATCH: u8 = 4;
/// Crate version mismatch: coordinator `str`, peer `str`, peer rank.
const E_CRATE_MISMATCH: u8 = 5;
/// World size mismatch: coordinator, peer, peer rank.
const E_WORLD_MISMATCH: u8 = 6;
/// Duplicate rank: rank, first address `str`, second address `str`.
const E_DUPLICATE_RANK: u8 = 7;
/// Rank out of range: rank, world size.
const E_RANK_RANGE: u8 = 8;
/// Op mismatch: rank a, call a `str`, rank b, call b `str`.
const E_OP_MISMATCH: u8 = 9;
/// Too large: size, limit.
const E_TOO_LARGE: u8 = 10;
/// Rendezvous closed: rank.
const E_CLOSED: u8 = 11;
/// Peer unresponsive: rank, silence in milliseconds.
const E_PEER_UNRESPONSIVE: u8 = 12;

/// Errors decided by the coordinator and sent to the ranks concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RemoteError {
    Timeout {
        missing: Vec<usize>,
    },
    PeerDied {
        rank: usize,
    },
    PeerLeft {
        rank: usize,
    },
    ProtocolMismatch {
        coordinator: u32,
        peer: u32,
        peer_rank: usize,
    },
    CrateMismatch {
        coordinator: String,
        peer: String,
        peer_rank: usize,
    },
    WorldMismatch {
        coordinator: usize,
        peer: usize,
        peer_rank: usize,
    },
    DuplicateRank {
        rank: usize,
        first: String,
        second: String,
    },
    RankOutOfRange {
        rank: usize,
        world_size: usize,
    },
    OpMismatch {
        rank_a: usize,
        call_a: String,
        rank_b: usize,
        call_b: String,
    },
    TooLarge {
        size: u64,
        limit: u64,
    },
    RendezvousClosed {
        rank: usize,
    },
    PeerUnresponsive {
        rank: usize,
        silent_ms: u64,
    },
}

impl RemoteError {
    /// Appends the code and fields of this error.
    pub(super) fn encode(&self, e: &mut Enc) {
        match self {
            RemoteError::Timeout { missing } => {
                e.u8(E_TIMEOUT).u32(missing.len() as u32);
                for &r in missing {
                    e.usize(r);
                }
            }
            RemoteError::PeerDied { rank } => {
                e.u8(E_PEER_DIED).usize(*rank);
            }
            RemoteError::PeerLeft { rank } => {
                e.u8(E_PEER_LEFT).usize(*rank);
            }
            RemoteError::ProtocolMismatch {
                coordinator,
                peer,
                peer_rank,
            } => {
                e.u8(E_PROTOCOL_MISMATCH)
                    .u32(*coordinator)
                    .u32(*peer)
                    .usize(*peer_rank);
            }
            RemoteError::CrateMismatch {
                coordinator,
                peer,
                peer_rank,
            } => {
                e.u8(E_CRATE_MISMATCH)
                    .str(coordinator)
                    .str(peer)
                    .usize(*peer_rank);
            }
            RemoteError::WorldMismatch {
                coordinator,
                peer,
                peer_rank,
            } => {
                e.u8(E_WORLD_MISMATCH)
                    .usize(*coordinator)
                    .usize(*peer)
                    .usize(*peer_rank);
            }
            RemoteError::DuplicateRank {
                rank,
                first,
                second,
            } => {
                e.u8(E_DUPLICATE_RANK).usize(*rank).str(first).str(second);
            }
            RemoteError::RankOutOfRange { rank, world_size } => {
                e.u8(E_RANK_RANGE).usize(*rank).usize(*world_size);
            }
            RemoteError::OpMismatch {
                rank_a,
                call_a,
                rank_b,
                call_b,
            } => {
                e.u8(E_OP_MISMATCH)
                    .usize(*rank_a)
                    .str(call_a)
                    .usize(*rank_b)
                    .str(call_b);
            }
            RemoteError::TooLarge { size, limit } => {
                e.u8(E_TOO_LARGE).u64(*size).u64(*limit);
            }
            RemoteError::RendezvousClosed { rank } => {
                e.u8(E_CLOSED).usize(*rank);
            }
            RemoteError::PeerUnresponsive { rank, silent_ms } => {
                e.u8(E_PEER_UNRESPONSIVE).usize(*rank).u64(*silent_ms);
            }
        }
    }

    /// Reads an error written by [`RemoteError::encode`].
    pub(super) fn decode(d: &mut Dec<'_>) -> Result<RemoteError, DecodeError> {
        let code = d.u8("error code")?;
        Ok(match code {
            E_TIMEOUT => {
                let n = d.u32("missing rank count")? as usize;
                let mut missing = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    missing.push(d.usize("missing rank")?);
                }
                RemoteError::Timeout { missing }
            }
            E_PEER_DIED => RemoteError::PeerDied {
                rank: d.usize("rank")?,
            },
            E_PEER_LEFT => RemoteError::PeerLeft {
                rank: d.usize("rank")?,
            },
            E_PROTOCOL_MISMATCH => RemoteError::ProtocolMismatch {
                coordinator: d.u32("coordinator protocol")?,
                peer: d.u32("peer protocol")?,
                peer_rank: d.usize("peer rank")?,
            },
            E_CRATE_MISMATCH => RemoteError::CrateMismatch {
                coordinator: d.str("coordinator version")?,
                peer: d.str("peer version")?,
                peer_rank: d.usize("peer rank")?,
            },
            E_WORLD_MISMATCH => RemoteError::WorldMismatch {
                coordinator: d.usize("coordinator world size")?,
                peer: d.usize("peer world size")?,
                peer_rank: d.usize("peer rank")?,
            },
            E_DUPLICATE_RANK => RemoteError::DuplicateRank {
                rank: d.usize("rank")?,
                first: d.str("first address")?,
                second: d.str("second address")?,
            },
            E_RANK_RANGE => RemoteError::RankOutOfRange {
                rank: d.usize("rank")?,
                world_size: d.usize("world size")?,
            },
            E_OP_MISMATCH => RemoteError::OpMismatch {
                rank_a: d.usize("rank a")?,
                call_a: d.str("call a")?,
                rank_b: d.usize("rank b")?,
                call_b: d.str("call b")?,
            },
            E_TOO_LARGE => RemoteError::TooLarge {
                size: d.u64("size")?,
                limit: d.u64("limit")?,
            },
            E_CLOSED => RemoteError::RendezvousClosed {
                rank: d.usize("rank")?,
            },
            E_PEER_UNRESPONSIVE => RemoteError::PeerUnresponsive {
                rank: d.usize("rank")?,
                silent_ms: d.u64("silence")?,
            },
            other => return Err(DecodeError(format!("unknown error code {other}"))),
        })
    }
}

/// One error of every kind, with distinct field values (for round-trip tests).
#[cfg(test)]
pub(super) fn every_remote_error() -> Vec<RemoteError> {
    vec![
        RemoteError::Timeout {
            missing: vec![1, 4],
        },
        RemoteError::PeerDied { rank: 2 },
        RemoteError::PeerLeft { rank: 0 },
        RemoteError::ProtocolMismatch {
            coordinator: 1,
            peer: 2,
            peer_rank: 5,
        },
        RemoteError::CrateMismatch {
            coordinator: "a".into(),
            peer: "b".into(),
            peer_rank: 1,
        },
        RemoteError::WorldMismatch {
            coordinator: 4,
            peer: 3,
            peer_rank: 1,
        },
        RemoteError::DuplicateRank {
            rank: 1,
            first: "x".into(),
            second: "y".into(),
        },
        RemoteError::RankOutOfRange {
            rank: 9,
            world_size: 4,
        },
        RemoteError::OpMismatch {
            rank_a: 0,
            call_a: "barrier".into(),
            rank_b: 1,
            call_b: "all_gather".into(),
        },
        RemoteError::TooLarge { size: 10, limit: 5 },
        RemoteError::RendezvousClosed { rank: 3 },
        RemoteError::PeerUnresponsive {
            rank: 2,
            silent_ms: 5123,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_round_trips_alone() {
        for error in every_remote_error() {
            let mut e = Enc::default();
            error.encode(&mut e);
            let mut d = Dec::new(&e.0);
            assert_eq!(RemoteError::decode(&mut d).unwrap(), error);
            d.finish("error").unwrap();
        }
    }

    #[test]
    fn unknown_error_code_is_a_decode_error() {
        let mut d = Dec::new(&[200]);
        let err = RemoteError::decode(&mut d).unwrap_err();
        assert!(err.0.contains("unknown error code 200"), "{err}");
    }
}
