//! [`Bootstrap`]: one rank's connection to the coordinator and the collectives over it.

//!
//! One idea per submodule: [`connect`] joins the group, [`collective`] runs the collectives,
//! [`link`] and [`channel`] are the write and read sides of the connection to the coordinator
//! (heartbeats and silence detection included), and [`remote_error`] maps the coordinator's
//! errors to [`BootstrapError`](crate::BootstrapError). This module holds the [`Bootstrap`] type itself, its accessors
//! and its goodbye on drop.

mod channel;
mod collective;
mod connect;
mod link;
mod remote_error;

use std::io::{self, Read};
use std::net::Shutdown;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use channel::Channel;
use link::HeartbeatThread;

use crate::coordinator::CoordinatorHandle;
use crate::wire::{self, ClientMsg, FRAME_OVERHEAD, MAX_FRAME};

/// Longest tag accepted by the collectives, in bytes.
pub const MAX_TAG_LEN: usize = 4096;

/// Largest contribution one rank may pass to a collective, in bytes.
pub const MAX_PAYLOAD: usize = MAX_FRAME - FRAME_OVERHEAD;

/// Extra time a rank waits for the coordinator beyond its own timeout before declaring the
/// coordinator unresponsive (the coordinator normally reports the timeout first).
const COORDINATOR_GRACE: Duration = Duration::from_secs(1);

/// How long [`Bootstrap`]'s `Drop` waits for the coordinator to acknowledge a goodbye.
const GOODBYE_LINGER: Duration = Duration::from_millis(500);

/// What a rank advertises in its handshake. [`Identity::current`] is what
/// [`Bootstrap::connect`] uses; other values exist to test the compatibility checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Wire protocol version announced by this rank as a client.
    pub protocol_version: u32,
    /// Crate version announced by this rank; on rank 0 also the version the coordinator
    /// requires of every rank.
    pub crate_version: String,
}

impl Identity {
    /// This build's protocol version and crate version.
    pub fn current() -> Self {
        Identity {
            protocol_version: wire::PROTOCOL_VERSION,
            crate_version: wire::CRATE_VERSION.to_string(),
        }
    }
}

impl Default for Identity {
    fn default() -> Self {
        Identity::current()
    }
}

/// A rank's membership in a bootstrap group.
///
/// Created by [`Bootstrap::connect`], which returns only once all `world_size` ranks have
/// joined. Collectives must be called in the same order, with the same tags, on every rank;
/// calls are serialised by an internal lock, so a `Bootstrap` may be shared between threads, but
/// issuing collectives concurrently from several threads makes their order (and hence their
/// matching across ranks) unspecified.
///
/// Dropping it says goodbye to the coordinator; on rank 0 it then stops the coordinator, after
/// which the other ranks' collectives fail with [`BootstrapError::PeerLeft`](crate::BootstrapError::PeerLeft)
/// naming rank 0.
#[derive(Debug)]
pub struct Bootstrap {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    timeout: Duration,
    /// Write timeout of the socket: a coordinator that accepts no bytes for this long is dead.
    write_timeout: Duration,
    channel: Mutex<Channel>,
    heartbeat: Option<HeartbeatThread>,
    coordinator: Option<CoordinatorHandle>,
}

impl Bootstrap {
    /// Global rank of this process.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank of this process on its node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// Bound applied to each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        // No heartbeat may follow the goodbye.
        if let Some(mut hb) = self.heartbeat.take() {
            hb.stop();
        }
        let ch = self
            .channel
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let mut stream = &ch.link.stream;
        if ch.broken.is_none() {
            let _ = stream.set_write_timeout(Some(GOODBYE_LINGER));
            let _ = ch.link.send(&wire::encode_client(&ClientMsg::Goodbye));
        }
        let _ = stream.shutdown(Shutdown::Write);
        // Wait for the coordinator to close its side, so our goodbye is read before our socket
        // goes away (closing with unread data would reset the connection instead).
        let deadline = Instant::now() + GOODBYE_LINGER;
        let mut sink = [0u8; 4096];
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() || stream.set_read_timeout(Some(remaining)).is_err() {
                break;
            }
            match stream.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        if let Some(mut c) = self.coordinator.take() {
            c.shutdown();
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
