//! Out-of-band rendezvous for epcomm processes (one process per GPU).
//!
//! Every process builds a [`BootstrapConfig`] (usually [`BootstrapConfig::from_env`], which
//! understands torchrun, Slurm and OpenMPI variables) and calls [`Bootstrap::connect`]. Rank 0
//! runs a small coordinator on `MASTER_ADDR:MASTER_PORT`; all ranks, rank 0 included, connect to
//! it over TCP. The resulting [`Bootstrap`] offers host-side collectives over bytes:
//! [`Bootstrap::all_gather`], [`Bootstrap::broadcast`] and [`Bootstrap::barrier`], used to
//! exchange IPC handles, NVSHMEM unique ids, queue-pair info and the like.
//!
//! Everything is blocking `std::net` plus threads; there is no async runtime.
//!
//! # Failure model
//!
//! * Every operation is bounded by [`BootstrapConfig::timeout`]. The coordinator knows which
//!   ranks have not arrived and reports them in [`BootstrapError::Timeout`] to every waiting
//!   rank.
//! * A rank whose connection drops without a goodbye (its process died) makes every pending and
//!   later collective fail promptly with [`BootstrapError::PeerDied`] naming it; a rank that
//!   dropped its `Bootstrap` yields [`BootstrapError::PeerLeft`]. Rank 0's death is seen by
//!   the others as `PeerDied { rank: 0, .. }`.
//! * A rank whose connection stays open but carries nothing (its process is frozen, stopped or
//!   hung, or its host vanished without a FIN or RST) is caught by heartbeats within
//!   [`Liveness::peer_timeout`] (default 5 s), not at the end of the operation timeout: every
//!   pending and later collective fails with [`BootstrapError::PeerUnresponsive`] naming it
//!   and how long it was silent; a silent coordinator is reported as rank 0. TCP keepalive
//!   (2 s idle, 1 s interval, 3 probes by default) runs on every bootstrap socket as a second
//!   line. A rank that is merely busy between collectives keeps sending heartbeats from a
//!   background thread and is waited for as before. See [`Liveness`] for the knobs and their
//!   `EPCOMM_BOOTSTRAP_*` environment overrides.
//! * Handshake mismatches (protocol version, crate version, world size, duplicate or
//!   out-of-range rank) fail the rendezvous: the offending process and every rank that had
//!   joined get the same typed error naming both values.
//! * A round fails as a whole: once the coordinator decides an error for a round, every rank
//!   that takes part in that round gets the same error, including ranks that arrive later.
//!
//! # Wire protocol (version 2)
//!
//! A connection carries **frames**: a `u32` little-endian body length followed by that many
//! body bytes. Bodies are limited to 64 KiB before the handshake completes and 1 GiB after.
//! The first body byte is the message type. Integers are little-endian; `u32`/`u64` are 4/8
//! bytes; ranks, world sizes and roots are `u64`; `bytes` is a `u32` length then the bytes;
//! `str` is `bytes` holding UTF-8.
//!
//! Client → coordinator:
//!
//! | type | message | fields |
//! |------|---------|--------|
//! | `0x01` | `Hello` | magic `b"EPCOMMBS"`, protocol `u32`, rank `u64`, world_size `u64`, crate_version `str`, local_rank `u64`, local_world_size `u64`, op_timeout_ms `u64`, join_budget_ms `u64`, heartbeat_ms `u64`, peer_timeout_ms `u64` |
//! | `0x02` | `Op` | seq `u64`, kind `u8` (1 all_gather, 2 broadcast, 3 barrier), tag `str`, root `u64`, data `bytes` |
//! | `0x03` | `Goodbye` | — |
//! | `0x04` | `Heartbeat` | — |
//!
//! Coordinator → client:
//!
//! | type | message | fields |
//! |------|---------|--------|
//! | `0x81` | `Welcome` | magic, protocol `u32`, crate_version `str`, world_size `u64` |
//! | `0x82` | `Reject` | error |
//! | `0x83` | `OpOk` | seq `u64`, count `u32`, `count` × payload `bytes` |
//! | `0x84` | `OpErr` | seq `u64`, error |
//! | `0x85` | `Shutdown` | — |
//! | `0x86` | `Heartbeat` | — |
//!
//! An *error* is a code `u8` and its fields: 1 timeout (count `u32`, missing ranks `u64`…),
//! 2 peer died (rank), 3 peer left (rank), 4 protocol mismatch (coordinator `u32`, peer `u32`,
//! peer rank), 5 crate version mismatch (coordinator `str`, peer `str`, peer rank), 6 world size
//! mismatch (coordinator, peer, peer rank), 7 duplicate rank (rank, first address `str`, second
//! address `str`), 8 rank out of range (rank, world size), 9 op mismatch (rank a, call a `str`,
//! rank b, call b `str`), 10 too large (size `u64`, limit `u64`), 11 rendezvous closed (rank),
//! 12 peer unresponsive (rank, silence in ms `u64`).
//!
//! The `Hello` prefix up to and including world_size is frozen across protocol versions, so a
//! coordinator can name the rank and versions of a peer speaking another version. Version 2
//! added the two liveness fields of `Hello`, both `Heartbeat` messages and error 12; a version 1
//! peer is rejected with a protocol mismatch naming both versions.
//!
//! Sequence of a session:
//!
//! 1. The client connects (retrying until its timeout) and sends `Hello`. A connection whose
//!    first frame is not a well-formed `Hello` with the right magic is closed silently and does
//!    not disturb the group.
//! 2. The coordinator checks protocol, crate version, world size and rank. On success the rank
//!    waits; when all `world_size` ranks are present every one receives `Welcome`. On failure
//!    the offender and every waiting rank receive `Reject`, and the rendezvous is over. If not
//!    all ranks arrive within the earliest `join_budget_ms`, all waiting ranks receive a
//!    timeout `Reject` naming the missing ranks.
//! 3. Each collective call sends one `Op`; `seq` counts the calls of a rank from 1, so the n-th
//!    call of every rank forms round n regardless of its tag (repeated tags never mix). The
//!    coordinator checks that kind, tag and (for broadcast) root agree, and when all ranks have
//!    contributed sends `OpOk` to each: all contributions in rank order (all_gather), the
//!    root's data (broadcast) or nothing (barrier). A round fails with `OpErr` when its earliest
//!    deadline (arrival + op_timeout_ms of each rank present) passes, when a rank that has not
//!    contributed departs, or on a mismatch. Ranks arriving at a failed round get the same
//!    `OpErr` at once.
//! 4. Liveness, per client connection, with that client's `heartbeat_ms` and
//!    `peer_timeout_ms` (both 0: off). From its `Hello` until it leaves, the client sends
//!    `Heartbeat` every `heartbeat_ms`. While the client waits for an answer (from `Hello` to
//!    `Welcome`/`Reject`, from an `Op` to its `OpOk`/`OpErr`) the coordinator sends it
//!    `Heartbeat` every `heartbeat_ms`; it sends none otherwise, because an idle client does
//!    not read. Receivers skip `Heartbeat` frames; any bytes received count as a sign of life.
//!    When nothing arrived from a client for `peer_timeout_ms`, the coordinator treats it as
//!    departed (error 12, like a broken connection) and closes it; when a waiting client
//!    received nothing for `peer_timeout_ms`, it gives up on the coordinator.
//! 5. A client leaving cleanly sends `Goodbye`, half-closes, and waits briefly for the
//!    coordinator to close. When rank 0 leaves, the coordinator sends `Shutdown` to every
//!    remaining client, half-closes and closes all connections after a short linger.
//!
//! # Launching locally
//!
//! The [`launch`] module starts one process per rank on this machine with the torchrun
//! variables set, and supervises them (used by the CLI and the multi-process tests).

mod client;
mod config;
mod coordinator;
mod error;
pub mod launch;
mod wire;

pub use client::{Bootstrap, Identity, MAX_PAYLOAD, MAX_TAG_LEN};
pub use config::{BootstrapConfig, DEFAULT_TIMEOUT, Liveness, TIMEOUT_ENV};
pub use error::{BootstrapError, OpKind, Result};

/// Version of the bootstrap wire protocol spoken by this build.
pub const PROTOCOL_VERSION: u32 = wire::PROTOCOL_VERSION;

/// Version of this crate, exchanged in the handshake.
pub const CRATE_VERSION: &str = wire::CRATE_VERSION;

/// Shared settings of the unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;

    use crate::Liveness;

    /// A bound no test should reach.
    pub(crate) const LONG: Duration = Duration::from_secs(60);

    /// Heartbeats every 100 ms, a peer silent for 1 s is unresponsive.
    pub(crate) fn fast_liveness() -> Liveness {
        Liveness {
            heartbeat_interval: Duration::from_millis(100),
            peer_timeout: Duration::from_millis(1000),
            ..Liveness::default()
        }
    }
}
