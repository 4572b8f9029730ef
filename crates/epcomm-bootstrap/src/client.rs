//! [`Bootstrap`]: one rank's connection to the coordinator and the collectives over it.

use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::config::{BootstrapConfig, Liveness};
use crate::coordinator::CoordinatorHandle;
use crate::error::{BootstrapError, OpKind, Result};
use crate::wire::{
    self, ClientMsg, FRAME_OVERHEAD, FrameError, FrameReader, Hello, MAX_FRAME,
    MAX_HANDSHAKE_FRAME, OpMsg, Progress, RemoteError, ServerMsg,
};

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

/// The connection to the coordinator, shared by the calling thread and the heartbeat thread.
/// Writes go through [`Link::send`] so that frames of the two threads never interleave.
#[derive(Debug)]
struct Link {
    stream: TcpStream,
    write_lock: Mutex<()>,
}

impl Link {
    fn send(&self, body: &[u8]) -> io::Result<()> {
        wire::write_frame_locked(&self.write_lock, &self.stream, body)
    }

    /// Sends `body` unless another write is in progress (its bytes then show we are alive);
    /// `None` when skipped.
    fn try_send(&self, body: &[u8]) -> Option<io::Result<()>> {
        let _guard = match self.write_lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(wire::write_frame(&mut &self.stream, body))
    }
}

/// Background thread sending a `Heartbeat` frame every interval until stopped or until the
/// connection fails (the next collective then reports the failure).
#[derive(Debug)]
struct HeartbeatThread {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl HeartbeatThread {
    fn start(link: Arc<Link>, every: Duration, rank: usize) -> io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let body = wire::encode_client(&ClientMsg::Heartbeat);
        let thread = thread::Builder::new()
            .name(format!("epcomm-bootstrap-heartbeat-{rank}"))
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    if let Some(Err(_)) = link.try_send(&body) {
                        return;
                    }
                }
            })?;
        Ok(HeartbeatThread {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops and joins the thread. Idempotent.
    fn stop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HeartbeatThread {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug)]
struct Channel {
    link: Arc<Link>,
    reader: FrameReader,
    next_seq: u64,
    /// Set once the connection can no longer be trusted; every later op fails with it.
    broken: Option<String>,
    /// Silence from the coordinator after which a waiting call fails (zero: never).
    peer_timeout: Duration,
    /// When bytes last arrived from the coordinator (or the current wait began).
    last_heard: Instant,
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
/// which the other ranks' collectives fail with [`BootstrapError::PeerLeft`] naming rank 0.
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

    /// Gathers `data` from every rank; element `r` of the result is rank `r`'s contribution.
    ///
    /// Contributions may differ in length. Fails with [`BootstrapError::Timeout`] if some rank
    /// does not arrive within the timeout, [`BootstrapError::PeerDied`] /
    /// [`BootstrapError::PeerLeft`] if a rank is gone, [`BootstrapError::OpMismatch`] if ranks
    /// called different collectives or tags in this round.
    pub fn all_gather(&self, tag: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let out = self.collective(OpKind::AllGather, tag, 0, data)?;
        self.expect_len(OpKind::AllGather, tag, out, self.world_size)
    }

    /// Sends `root`'s data to every rank and returns it (on the root too).
    ///
    /// The root must pass `Some(data)`; other ranks' `data` is ignored and may be `None`.
    /// `root` must be below `world_size` and the same on all ranks. Errors as for
    /// [`Bootstrap::all_gather`].
    pub fn broadcast(&self, tag: &str, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        if root >= self.world_size {
            return Err(BootstrapError::InvalidArgument {
                op: OpKind::Broadcast,
                argument: "root",
                rule: format!("root {root} must be below world_size {}", self.world_size),
            });
        }
        let data = match (self.rank == root, data) {
            (true, None) => {
                return Err(BootstrapError::InvalidArgument {
                    op: OpKind::Broadcast,
                    argument: "data",
                    rule: format!("rank {root} is the root and must supply Some(data)"),
                });
            }
            (true, Some(d)) => d,
            (false, _) => &[],
        };
        let out = self.collective(OpKind::Broadcast, tag, root, data)?;
        let mut out = self.expect_len(OpKind::Broadcast, tag, out, 1)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Returns once every rank has entered the barrier with the same tag.
    /// Errors as for [`Bootstrap::all_gather`].
    pub fn barrier(&self, tag: &str) -> Result<()> {
        let out = self.collective(OpKind::Barrier, tag, 0, &[])?;
        self.expect_len(OpKind::Barrier, tag, out, 0).map(|_| ())
    }

    fn expect_len(
        &self,
        op: OpKind,
        tag: &str,
        out: Vec<Vec<u8>>,
        want: usize,
    ) -> Result<Vec<Vec<u8>>> {
        if out.len() == want {
            return Ok(out);
        }
        Err(BootstrapError::Protocol {
            detail: format!(
                "{op} (tag {tag:?}) result has {} payloads, expected {want}",
                out.len()
            ),
        })
    }

    fn collective(&self, op: OpKind, tag: &str, root: usize, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if tag.len() > MAX_TAG_LEN {
            return Err(BootstrapError::InvalidArgument {
                op,
                argument: "tag",
                rule: format!("{} bytes exceeds the limit of {MAX_TAG_LEN}", tag.len()),
            });
        }
        if data.len() > MAX_PAYLOAD {
            return Err(BootstrapError::PayloadTooLarge {
                op,
                tag: tag.to_string(),
                size: data.len() as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        let mut guard = self.channel.lock().unwrap_or_else(PoisonError::into_inner);
        let ch = &mut *guard;
        if let Some(cause) = &ch.broken {
            return Err(BootstrapError::ConnectionBroken {
                op,
                tag: tag.to_string(),
                cause: cause.clone(),
            });
        }
        let seq = ch.next_seq;
        ch.next_seq += 1;
        let start = Instant::now();
        let body = wire::encode_client(&ClientMsg::Op(OpMsg {
            seq,
            kind: op,
            tag: tag.to_string(),
            root,
            data: data.to_vec(),
        }));
        let _ = ch.link.stream.set_write_timeout(Some(self.write_timeout));
        if let Err(e) = ch.link.send(&body) {
            ch.broken = Some(format!("sending {op} (tag {tag:?}) failed: {e}"));
            // The coordinator may have said why it went away before closing.
            ch.last_heard = Instant::now();
            let peek = Instant::now() + Duration::from_millis(50);
            let stalled = matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            return Err(match ch.receive(op, tag, seq, start, peek) {
                Ok(ServerMsg::Shutdown) => BootstrapError::PeerLeft {
                    rank: 0,
                    op,
                    tag: tag.into(),
                },
                // The coordinator accepted no bytes for the whole write timeout.
                _ if stalled => BootstrapError::PeerUnresponsive {
                    rank: 0,
                    op,
                    tag: tag.to_string(),
                    silent_for: self.write_timeout,
                },
                _ => BootstrapError::PeerDied {
                    rank: 0,
                    op,
                    tag: tag.to_string(),
                },
            });
        }
        // The coordinator may have been silent while we were not listening; count from now.
        ch.last_heard = Instant::now();
        let deadline = start + self.timeout + COORDINATOR_GRACE;
        loop {
            match ch.receive(op, tag, seq, start, deadline)? {
                ServerMsg::OpOk { seq: s, payloads } if s == seq => return Ok(payloads),
                ServerMsg::OpErr { seq: s, error } if s == seq => {
                    return Err(remote_error(error, op, tag, seq, start.elapsed()));
                }
                // Late answer to an earlier op this rank gave up on.
                ServerMsg::OpOk { seq: s, .. } | ServerMsg::OpErr { seq: s, .. } if s < seq => {}
                ServerMsg::Shutdown => {
                    ch.broken = Some("the coordinator (rank 0) shut down".into());
                    return Err(BootstrapError::PeerLeft {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                    });
                }
                other => {
                    let detail = format!("unexpected message during {op} round {seq}: {other:?}");
                    ch.broken = Some(detail.clone());
                    return Err(BootstrapError::Protocol { detail });
                }
            }
        }
    }
}

impl Channel {
    /// Reads the next coordinator message other than a heartbeat, waiting until `deadline`.
    /// A closed connection means the coordinator (rank 0) is gone, and so does silence (not a
    /// byte, heartbeats included) for `peer_timeout`; the channel is then marked broken.
    fn receive(
        &mut self,
        op: OpKind,
        tag: &str,
        round: u64,
        start: Instant,
        deadline: Instant,
    ) -> Result<ServerMsg> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BootstrapError::CoordinatorUnresponsive {
                    op,
                    tag: tag.to_string(),
                    round,
                    waited: start.elapsed(),
                });
            }
            let mut wait = remaining;
            if !self.peer_timeout.is_zero() {
                let silent = self.last_heard.elapsed();
                if silent >= self.peer_timeout {
                    self.broken = Some(format!(
                        "the coordinator (rank 0) sent nothing for {silent:?}"
                    ));
                    return Err(BootstrapError::PeerUnresponsive {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                        silent_for: silent,
                    });
                }
                wait = wait.min(self.peer_timeout - silent);
            }
            if let Err(source) = self.link.stream.set_read_timeout(Some(wait)) {
                return Err(BootstrapError::Io {
                    op,
                    tag: tag.to_string(),
                    source,
                });
            }
            let last_heard = &mut self.last_heard;
            let mut source = Progress {
                inner: &self.link.stream,
                on_progress: || *last_heard = Instant::now(),
            };
            match self.reader.read_frame(&mut source) {
                Ok(body) => match wire::decode_server(&body) {
                    Ok(ServerMsg::Heartbeat) => {}
                    Ok(msg) => return Ok(msg),
                    Err(e) => {
                        self.broken = Some(format!("undecodable coordinator message: {e}"));
                        return Err(BootstrapError::Protocol {
                            detail: e.to_string(),
                        });
                    }
                },
                Err(e) if e.is_timeout() => {}
                Err(e @ FrameError::TooLarge { .. }) => {
                    self.broken = Some(e.to_string());
                    return Err(BootstrapError::Protocol {
                        detail: e.to_string(),
                    });
                }
                Err(e) => {
                    self.broken = Some(format!("connection to the coordinator lost: {e}"));
                    return Err(BootstrapError::PeerDied {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                    });
                }
            }
        }
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

/// Write timeout of a client socket: the operation timeout, shortened to the peer timeout when
/// silence detection is on (a coordinator that takes no bytes for that long is unresponsive).
fn write_timeout(timeout: Duration, liveness: &Liveness) -> Duration {
    if liveness.peer_timeout.is_zero() {
        timeout
    } else {
        timeout.min(liveness.peer_timeout)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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

/// Turns a coordinator-decided error into the public error, adding this rank's context.
fn remote_error(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::HelloMsg;

    use crate::testing::{LONG, fast_liveness as liveness};

    /// Rank 1 of 2 on this machine.
    fn cfg(port: u16) -> BootstrapConfig {
        BootstrapConfig::single_host(port, 1, 2, LONG)
    }

    /// A hand-driven coordinator: accepts rank 1 and checks its handshake.
    fn fake_coordinator() -> (TcpListener, u16) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        (listener, port)
    }

    fn accept_hello(listener: &TcpListener) -> (TcpStream, FrameReader) {
        let (mut s, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(MAX_HANDSHAKE_FRAME);
        let body = r.read_frame(&mut s).unwrap();
        match wire::decode_hello(&body).unwrap() {
            HelloMsg::Ours(h) => {
                assert_eq!((h.heartbeat_ms, h.peer_timeout_ms), (100, 1000));
            }
            other => panic!("unexpected {other:?}"),
        }
        r.set_max(MAX_FRAME);
        (s, r)
    }

    fn welcome(s: &mut TcpStream) {
        let body = wire::encode_server(&ServerMsg::Welcome {
            protocol: wire::PROTOCOL_VERSION,
            crate_version: wire::CRATE_VERSION.into(),
            world_size: 2,
        });
        wire::write_frame(s, &body).unwrap();
    }

    /// Reads client messages until the connection closes; returns (heartbeats, ops).
    fn drain(mut s: TcpStream, mut r: FrameReader) -> thread::JoinHandle<(usize, usize)> {
        thread::spawn(move || {
            let (mut beats, mut ops) = (0, 0);
            while let Ok(body) = r.read_frame(&mut s) {
                match wire::decode_client(&body).unwrap() {
                    ClientMsg::Heartbeat => beats += 1,
                    ClientMsg::Op(_) => ops += 1,
                    ClientMsg::Goodbye => break,
                }
            }
            (beats, ops)
        })
    }

    #[test]
    fn silent_coordinator_fails_a_collective_within_the_peer_timeout() {
        let (listener, port) = fake_coordinator();
        let rank = thread::spawn(move || {
            let bs = Bootstrap::connect_with_liveness(cfg(port), liveness()).expect("connect");
            let start = Instant::now();
            let err = bs.barrier("b").expect_err("the coordinator is silent");
            let waited = start.elapsed();
            let again = bs.barrier("c").expect_err("the connection is broken");
            (err, waited, again)
        });
        let (mut s, r) = accept_hello(&listener);
        welcome(&mut s);
        // Read everything (the kernel of a frozen host would ACK it), answer nothing.
        let drained = drain(s, r);
        let (err, waited, again) = rank.join().unwrap();
        match err {
            BootstrapError::PeerUnresponsive {
                rank: 0,
                op: OpKind::Barrier,
                silent_for,
                ..
            } => assert!(silent_for >= Duration::from_millis(1000), "{silent_for:?}"),
            other => panic!("expected PeerUnresponsive naming rank 0, got {other}"),
        }
        assert!(waited >= Duration::from_millis(950), "{waited:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        assert!(
            matches!(again, BootstrapError::ConnectionBroken { .. }),
            "{again}"
        );
        // The rank kept sending heartbeats (every 100 ms) while it waited.
        let (beats, ops) = drained.join().unwrap();
        assert_eq!(ops, 1);
        assert!(beats >= 4, "only {beats} heartbeats");
    }

    #[test]
    fn silent_coordinator_fails_connect_within_the_peer_timeout() {
        let (listener, port) = fake_coordinator();
        let rank = thread::spawn(move || {
            let start = Instant::now();
            let err = Bootstrap::connect_with_liveness(cfg(port), liveness()).unwrap_err();
            (err, start.elapsed())
        });
        let (s, r) = accept_hello(&listener);
        let drained = drain(s, r);
        let (err, waited) = rank.join().unwrap();
        assert!(
            matches!(
                err,
                BootstrapError::PeerUnresponsive {
                    rank: 0,
                    op: OpKind::Connect,
                    ..
                }
            ),
            "{err}"
        );
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        drained.join().unwrap();
    }

    #[test]
    fn coordinator_heartbeats_keep_a_waiting_rank_patient() {
        let (listener, port) = fake_coordinator();
        let rank = thread::spawn(move || {
            let bs = Bootstrap::connect_with_liveness(cfg(port), liveness()).expect("connect");
            let start = Instant::now();
            let got = bs.all_gather("g", b"mine");
            (got, start.elapsed())
        });
        let (mut s, mut r) = accept_hello(&listener);
        welcome(&mut s);
        let seq = loop {
            match wire::decode_client(&r.read_frame(&mut s).unwrap()).unwrap() {
                ClientMsg::Op(op) => break op.seq,
                ClientMsg::Heartbeat => {}
                ClientMsg::Goodbye => panic!("unexpected goodbye"),
            }
        };
        // Answer only after two peer timeouts, sending heartbeats meanwhile.
        let heartbeat = wire::encode_server(&ServerMsg::Heartbeat);
        let until = Instant::now() + Duration::from_millis(2000);
        while Instant::now() < until {
            wire::write_frame(&mut s, &heartbeat).unwrap();
            thread::sleep(Duration::from_millis(100));
        }
        let ok = wire::encode_server(&ServerMsg::OpOk {
            seq,
            payloads: vec![b"zero".to_vec(), b"mine".to_vec()],
        });
        wire::write_frame(&mut s, &ok).unwrap();
        let drained = drain(s, r);
        let (got, waited) = rank.join().unwrap();
        assert_eq!(got.unwrap(), vec![b"zero".to_vec(), b"mine".to_vec()]);
        assert!(waited >= Duration::from_millis(1900), "{waited:?}");
        drained.join().unwrap();
    }
}
