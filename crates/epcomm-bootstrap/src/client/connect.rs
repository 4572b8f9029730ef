//! Joining a group: [`Bootstrap::connect`] and its variants, which resolve the coordinator's
//! address, start the coordinator on rank 0, connect with retries and perform the handshake.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::channel::Channel;
use super::link::{HeartbeatThread, Link};
use super::remote_error::remote_error;
use super::{Bootstrap, COORDINATOR_GRACE, Identity, millis};
use crate::config::{BootstrapConfig, Liveness};
use crate::coordinator::CoordinatorHandle;
use crate::error::{BootstrapError, OpKind, Result};
use crate::wire::{self, FrameReader, Hello, MAX_FRAME, MAX_HANDSHAKE_FRAME, ServerMsg};

impl Bootstrap {
    /// Joins the group described by `cfg`.
    ///
    /// Rank 0 first binds `master_addr:master_port` and starts the coordinator; every rank
    /// (rank 0 included) then connects to it, retrying refused connections, and sends its
    /// handshake. Returns when all ranks have joined, or fails with:
    /// * [`BootstrapError::Timeout`] (op `connect`) naming the ranks that had not joined within
    ///   `cfg.timeout`;
    /// * a handshake error ([`BootstrapError::CrateVersionMismatch`],
    ///   [`BootstrapError::ProtocolVersionMismatch`], [`BootstrapError::WorldSizeMismatch`],
    ///   [`BootstrapError::DuplicateRank`], ...): a rejected rank fails the whole rendezvous,
    ///   and every rank that had joined gets the same error;
    /// * [`BootstrapError::ConnectTimeout`], [`BootstrapError::Bind`],
    ///   [`BootstrapError::Resolve`], [`BootstrapError::InvalidConfig`] for local problems;
    /// * [`BootstrapError::PeerUnresponsive`] when a rank that had joined (or the coordinator)
    ///   went silent for longer than its [`Liveness::peer_timeout`].
    ///
    /// Failure detection uses [`Liveness::from_env`] (defaults unless `EPCOMM_BOOTSTRAP_*`
    /// overrides are set; an invalid override fails with [`BootstrapError::InvalidEnv`]).
    pub fn connect(cfg: BootstrapConfig) -> Result<Bootstrap> {
        Self::connect_with_identity(cfg, Identity::current())
    }

    /// [`Bootstrap::connect`] with explicit failure-detection settings instead of
    /// [`Liveness::from_env`].
    pub fn connect_with_liveness(cfg: BootstrapConfig, liveness: Liveness) -> Result<Bootstrap> {
        Self::connect_inner(cfg, Identity::current(), liveness)
    }

    /// [`Bootstrap::connect`] advertising `identity` instead of [`Identity::current`]; meant
    /// for testing version checks.
    pub fn connect_with_identity(cfg: BootstrapConfig, identity: Identity) -> Result<Bootstrap> {
        Self::connect_inner(cfg, identity, Liveness::from_env()?)
    }

    fn connect_inner(
        cfg: BootstrapConfig,
        identity: Identity,
        liveness: Liveness,
    ) -> Result<Bootstrap> {
        cfg.validate()?;
        liveness.validate()?;
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let addr_text = if cfg.master_addr.contains(':') {
            format!("[{}]:{}", cfg.master_addr, cfg.master_port)
        } else {
            format!("{}:{}", cfg.master_addr, cfg.master_port)
        };
        let addrs: Vec<SocketAddr> = (cfg.master_addr.as_str(), cfg.master_port)
            .to_socket_addrs()
            .map_err(|source| BootstrapError::Resolve {
                addr: addr_text.clone(),
                source,
            })?
            .collect();
        if addrs.is_empty() {
            return Err(BootstrapError::Resolve {
                addr: addr_text,
                source: io::Error::new(io::ErrorKind::NotFound, "no addresses found"),
            });
        }
        let coordinator = if cfg.rank == 0 {
            let listener = bind_any(&addrs)?;
            let handle = CoordinatorHandle::start(
                listener,
                cfg.world_size,
                identity.crate_version.clone(),
                liveness,
            )
            .map_err(|source| BootstrapError::Io {
                op: OpKind::Connect,
                tag: String::new(),
                source,
            })?;
            Some(handle)
        } else {
            None
        };

        let stream = connect_retry(&addrs, &addr_text, start, deadline)?;
        let io_err = |source| BootstrapError::Io {
            op: OpKind::Connect,
            tag: String::new(),
            source,
        };
        stream.set_nodelay(true).map_err(io_err)?;
        liveness.apply_keepalive(&stream).map_err(io_err)?;
        let write_timeout = write_timeout(cfg.timeout, &liveness);
        stream
            .set_write_timeout(Some(write_timeout))
            .map_err(io_err)?;
        let heartbeats = !liveness.peer_timeout.is_zero();
        let hello = Hello {
            protocol: identity.protocol_version,
            rank: cfg.rank,
            world_size: cfg.world_size,
            crate_version: identity.crate_version.clone(),
            local_rank: cfg.local_rank,
            local_world_size: cfg.local_world_size,
            op_timeout_ms: millis(cfg.timeout),
            join_budget_ms: millis(deadline.saturating_duration_since(Instant::now())),
            heartbeat_ms: if heartbeats {
                millis(liveness.heartbeat_interval)
            } else {
                0
            },
            peer_timeout_ms: millis(liveness.peer_timeout),
        };
        let link = Arc::new(Link {
            stream,
            write_lock: Mutex::new(()),
        });
        link.send(&wire::encode_hello(&hello)).map_err(io_err)?;
        // Heartbeats start with the handshake: a rank waiting for the others to join is alive.
        let heartbeat = if heartbeats {
            let every = liveness.heartbeat_interval;
            Some(HeartbeatThread::start(link.clone(), every, cfg.rank).map_err(io_err)?)
        } else {
            None
        };

        let mut channel = Channel {
            link,
            reader: FrameReader::new(MAX_HANDSHAKE_FRAME),
            next_seq: 1,
            broken: None,
            peer_timeout: liveness.peer_timeout,
            last_heard: Instant::now(),
        };
        let msg = channel.receive(OpKind::Connect, "", 0, start, deadline + COORDINATOR_GRACE)?;
        match msg {
            ServerMsg::Welcome { world_size, .. } if world_size == cfg.world_size => {}
            ServerMsg::Welcome { world_size, .. } => {
                return Err(BootstrapError::Protocol {
                    detail: format!(
                        "coordinator welcomed us into a world of {world_size} ranks, we expect {}",
                        cfg.world_size
                    ),
                });
            }
            ServerMsg::Reject(e) => {
                return Err(remote_error(e, OpKind::Connect, "", 0, start.elapsed()));
            }
            other => {
                return Err(BootstrapError::Protocol {
                    detail: format!("expected Welcome or Reject during connect, got {other:?}"),
                });
            }
        }
        channel.reader.set_max(MAX_FRAME);
        Ok(Bootstrap {
            rank: cfg.rank,
            world_size: cfg.world_size,
            local_rank: cfg.local_rank,
            local_world_size: cfg.local_world_size,
            timeout: cfg.timeout,
            write_timeout,
            channel: Mutex::new(channel),
            heartbeat,
            coordinator,
        })
    }
}

/// Write timeout of a client socket: the operation timeout, shortened to the peer timeout when
/// silence detection is on (a coordinator that takes no bytes for that long is unresponsive).
fn write_timeout(timeout: Duration, liveness: &Liveness) -> Duration {
    if liveness.peer_timeout.is_zero() {
        timeout
    } else {
        timeout.min(liveness.peer_timeout)
    }
}

fn bind_any(addrs: &[SocketAddr]) -> Result<TcpListener> {
    let mut last = None;
    for addr in addrs {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((addr, e)),
        }
    }
    let (addr, source) = match last {
        Some((a, e)) => (a.to_string(), e),
        None => (
            "<none>".into(),
            io::Error::new(io::ErrorKind::NotFound, "no address"),
        ),
    };
    Err(BootstrapError::Bind { addr, source })
}

fn connect_retry(
    addrs: &[SocketAddr],
    addr_text: &str,
    start: Instant,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last_error = String::from("no attempt made");
    loop {
        for addr in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(addr, remaining.min(Duration::from_secs(2))) {
                Ok(s) => return Ok(s),
                Err(e) => last_error = format!("{addr}: {e}"),
            }
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(BootstrapError::ConnectTimeout {
                addr: addr_text.to_string(),
                waited: start.elapsed(),
                last_error,
            });
        }
        thread::sleep(backoff.min(remaining));
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}
