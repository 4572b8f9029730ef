//! Wire format: length-prefixed frames and the messages they carry.
//!
//! See the crate documentation for the normative description; this module is its implementation.

use std::io::{self, Read, Write};

use crate::error::OpKind;

/// First 8 bytes of every `Hello` and `Welcome` body.
pub(crate) const MAGIC: [u8; 8] = *b"EPCOMMBS";
/// Version of the wire protocol described in the crate docs.
pub(crate) const PROTOCOL_VERSION: u32 = 2;
/// Version of this crate, exchanged in the handshake.
pub(crate) const CRATE_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Largest frame body accepted after the handshake.
pub(crate) const MAX_FRAME: usize = 1 << 30;
/// Largest frame body accepted before the handshake completed (keeps strangers cheap).
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 64 * 1024;
/// Bytes of frame budget reserved for headers and the tag in an `Op`/`OpOk` frame.
pub(crate) const FRAME_OVERHEAD: usize = 64 * 1024;

// Message type bytes.
const T_HELLO: u8 = 0x01;
const T_OP: u8 = 0x02;
const T_GOODBYE: u8 = 0x03;
const T_HEARTBEAT: u8 = 0x04;
const T_WELCOME: u8 = 0x81;
const T_REJECT: u8 = 0x82;
const T_OP_OK: u8 = 0x83;
const T_OP_ERR: u8 = 0x84;
const T_SHUTDOWN: u8 = 0x85;
const T_SERVER_HEARTBEAT: u8 = 0x86;

// RemoteError codes.
const E_TIMEOUT: u8 = 1;
const E_PEER_DIED: u8 = 2;
const E_PEER_LEFT: u8 = 3;
const E_PROTOCOL_MISMATCH: u8 = 4;
const E_CRATE_MISMATCH: u8 = 5;
const E_WORLD_MISMATCH: u8 = 6;
const E_DUPLICATE_RANK: u8 = 7;
const E_RANK_RANGE: u8 = 8;
const E_OP_MISMATCH: u8 = 9;
const E_TOO_LARGE: u8 = 10;
const E_CLOSED: u8 = 11;
const E_PEER_UNRESPONSIVE: u8 = 12;

/// Writes one frame: `u32` little-endian body length, then the body.
pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "frame of {} bytes exceeds the {MAX_FRAME}-byte limit",
                    body.len()
                ),
            )
        })?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

/// [`write_frame`] to `stream` while holding `lock`, the stream's write lock, so frames of
/// concurrent writers never interleave. A poisoned lock is taken over: it guards no data, only
/// the order of whole frames.
pub(crate) fn write_frame_locked(
    lock: &std::sync::Mutex<()>,
    stream: &std::net::TcpStream,
    body: &[u8],
) -> io::Result<()> {
    let _guard = lock
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    write_frame(&mut &*stream, body)
}

/// Why [`FrameReader::read_frame`] returned no frame.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection at a frame boundary.
    Eof,
    /// The peer closed the connection in the middle of a frame.
    Truncated,
    /// The length prefix is larger than allowed.
    TooLarge { len: usize, max: usize },
    /// A socket error; `WouldBlock`/`TimedOut` mean the read timeout expired and the partial frame
    /// is kept, so reading may resume.
    Io(io::Error),
}

impl FrameError {
    /// True when the error is a read timeout (the reader stays usable).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, FrameError::Io(e)
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Eof => f.write_str("connection closed"),
            FrameError::Truncated => f.write_str("connection closed in the middle of a frame"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame length {len} exceeds the limit of {max} bytes")
            }
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Incremental frame reader that keeps partially received frames across read timeouts.
#[derive(Debug)]
pub(crate) struct FrameReader {
    buf: Vec<u8>,
    max: usize,
}

impl FrameReader {
    /// A reader accepting bodies of at most `max` bytes.
    pub(crate) fn new(max: usize) -> Self {
        FrameReader {
            buf: Vec::new(),
            max,
        }
    }

    /// Changes the body size limit (used once the handshake has completed).
    pub(crate) fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    fn take_buffered(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let body = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(body))
    }

    /// Returns the next complete frame body, reading from `r` as needed.
    pub(crate) fn read_frame(&mut self, r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
        loop {
            if let Some(body) = self.take_buffered()? {
                return Ok(body);
            }
            // Read at least 64 KiB at a time, or the rest of the current frame if larger.
            let pending = if self.buf.len() >= 4 {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
                (len as usize + 4).saturating_sub(self.buf.len())
            } else {
                0
            };
            let want = pending.max(64 * 1024);
            let old = self.buf.len();
            self.buf.resize(old + want, 0);
            let res = r.read(&mut self.buf[old..]);
            let got = *res.as_ref().unwrap_or(&0);
            self.buf.truncate(old + got);
            match res {
                Ok(0) if self.buf.is_empty() => return Err(FrameError::Eof),
                Ok(0) => return Err(FrameError::Truncated),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
    }
}

/// A reader that calls `on_progress` each time the underlying read returns data, so that a
/// large frame arriving slowly still counts as a sign of life before it is complete.
#[derive(Debug)]
pub(crate) struct Progress<R, F> {
    pub(crate) inner: R,
    pub(crate) on_progress: F,
}

impl<R: Read, F: FnMut()> Read for Progress<R, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 {
            (self.on_progress)();
        }
        Ok(n)
    }
}

/// A malformed message body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        // Bodies never exceed MAX_FRAME (< u32::MAX), which write_frame enforces.
        self.u32(v.len().min(u32::MAX as usize) as u32);
        self.0.extend_from_slice(v);
        self
    }
    fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

#[derive(Debug)]
struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Dec { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() - self.pos < n {
            return Err(DecodeError(format!(
                "message truncated while reading {what} ({n} bytes needed, {} left)",
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn usize(&mut self, what: &str) -> Result<usize, DecodeError> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| DecodeError(format!("{what} = {v} does not fit in usize")))
    }
    fn bytes(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    fn str(&mut self, what: &str) -> Result<String, DecodeError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
    fn magic(&mut self) -> Result<(), DecodeError> {
        if self.take(8, "magic")? != MAGIC {
            return Err(DecodeError(
                "bad magic: peer is not an epcomm bootstrap".into(),
            ));
        }
        Ok(())
    }
    fn finish(&self, what: &str) -> Result<(), DecodeError> {
        if self.pos != self.buf.len() {
            return Err(DecodeError(format!(
                "{} trailing bytes after {what}",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// First message of a client. Magic, protocol version, rank and world size form a prefix that
/// is frozen across protocol versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) protocol: u32,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) crate_version: String,
    pub(crate) local_rank: usize,
    pub(crate) local_world_size: usize,
    /// Per-operation timeout of this rank.
    pub(crate) op_timeout_ms: u64,
    /// Remaining time this rank is willing to wait for the rendezvous.
    pub(crate) join_budget_ms: u64,
    /// How often this rank sends `Heartbeat`, and wants one while it waits (0: never).
    pub(crate) heartbeat_ms: u64,
    /// Silence after which this rank and the coordinator declare each other dead (0: never).
    pub(crate) peer_timeout_ms: u64,
}

/// A decoded `Hello`: either in our protocol, or only the frozen prefix of a foreign one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HelloMsg {
    Ours(Hello),
    Foreign {
        protocol: u32,
        rank: usize,
        world_size: usize,
    },
}

/// One contribution to a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OpMsg {
    pub(crate) seq: u64,
    pub(crate) kind: OpKind,
    pub(crate) tag: String,
    pub(crate) root: usize,
    pub(crate) data: Vec<u8>,
}

/// Messages after the handshake, client to coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClientMsg {
    Op(OpMsg),
    Goodbye,
    Heartbeat,
}

/// Messages from coordinator to client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ServerMsg {
    Welcome {
        protocol: u32,
        crate_version: String,
        world_size: usize,
    },
    Reject(RemoteError),
    OpOk {
        seq: u64,
        payloads: Vec<Vec<u8>>,
    },
    OpErr {
        seq: u64,
        error: RemoteError,
    },
    Shutdown,
    Heartbeat,
}

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
    fn encode(&self, e: &mut Enc) {
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

    fn decode(d: &mut Dec<'_>) -> Result<RemoteError, DecodeError> {
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

/// Encodes a `Hello` body.
pub(crate) fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut e = Enc::default();
    e.u8(T_HELLO);
    e.0.extend_from_slice(&MAGIC);
    e.u32(h.protocol)
        .usize(h.rank)
        .usize(h.world_size)
        .str(&h.crate_version)
        .usize(h.local_rank)
        .usize(h.local_world_size)
        .u64(h.op_timeout_ms)
        .u64(h.join_budget_ms)
        .u64(h.heartbeat_ms)
        .u64(h.peer_timeout_ms);
    e.0
}

/// Decodes a `Hello` body; a foreign protocol version yields only the frozen prefix.
pub(crate) fn decode_hello(body: &[u8]) -> Result<HelloMsg, DecodeError> {
    let mut d = Dec::new(body);
    let t = d.u8("message type")?;
    if t != T_HELLO {
        return Err(DecodeError(format!(
            "expected Hello (0x01), got message type {t:#04x}"
        )));
    }
    d.magic()?;
    let protocol = d.u32("protocol version")?;
    let rank = d.usize("rank")?;
    let world_size = d.usize("world size")?;
    if protocol != PROTOCOL_VERSION {
        return Ok(HelloMsg::Foreign {
            protocol,
            rank,
            world_size,
        });
    }
    let h = Hello {
        protocol,
        rank,
        world_size,
        crate_version: d.str("crate version")?,
        local_rank: d.usize("local rank")?,
        local_world_size: d.usize("local world size")?,
        op_timeout_ms: d.u64("op timeout")?,
        join_budget_ms: d.u64("join budget")?,
        heartbeat_ms: d.u64("heartbeat interval")?,
        peer_timeout_ms: d.u64("peer timeout")?,
    };
    d.finish("Hello")?;
    Ok(HelloMsg::Ours(h))
}

/// Encodes a client message body.
pub(crate) fn encode_client(m: &ClientMsg) -> Vec<u8> {
    let mut e = Enc::default();
    match m {
        ClientMsg::Op(op) => {
            e.u8(T_OP)
                .u64(op.seq)
                .u8(op.kind.code())
                .str(&op.tag)
                .usize(op.root)
                .bytes(&op.data);
        }
        ClientMsg::Goodbye => {
            e.u8(T_GOODBYE);
        }
        ClientMsg::Heartbeat => {
            e.u8(T_HEARTBEAT);
        }
    }
    e.0
}

/// Decodes a client message body received after the handshake.
pub(crate) fn decode_client(body: &[u8]) -> Result<ClientMsg, DecodeError> {
    let mut d = Dec::new(body);
    let msg = match d.u8("message type")? {
        T_OP => {
            let seq = d.u64("sequence number")?;
            let code = d.u8("op kind")?;
            let kind = OpKind::from_code(code)
                .ok_or_else(|| DecodeError(format!("unknown op kind {code}")))?;
            ClientMsg::Op(OpMsg {
                seq,
                kind,
                tag: d.str("tag")?,
                root: d.usize("root")?,
                data: d.bytes("data")?.to_vec(),
            })
        }
        T_GOODBYE => ClientMsg::Goodbye,
        T_HEARTBEAT => ClientMsg::Heartbeat,
        t => {
            return Err(DecodeError(format!(
                "unexpected client message type {t:#04x}"
            )));
        }
    };
    d.finish("client message")?;
    Ok(msg)
}

/// Encodes a coordinator message body.
pub(crate) fn encode_server(m: &ServerMsg) -> Vec<u8> {
    let mut e = Enc::default();
    match m {
        ServerMsg::Welcome {
            protocol,
            crate_version,
            world_size,
        } => {
            e.u8(T_WELCOME);
            e.0.extend_from_slice(&MAGIC);
            e.u32(*protocol).str(crate_version).usize(*world_size);
        }
        ServerMsg::Reject(err) => {
            e.u8(T_REJECT);
            err.encode(&mut e);
        }
        ServerMsg::OpOk { seq, payloads } => {
            e.u8(T_OP_OK).u64(*seq).u32(payloads.len() as u32);
            for p in payloads {
                e.bytes(p);
            }
        }
        ServerMsg::OpErr { seq, error } => {
            e.u8(T_OP_ERR).u64(*seq);
            error.encode(&mut e);
        }
        ServerMsg::Shutdown => {
            e.u8(T_SHUTDOWN);
        }
        ServerMsg::Heartbeat => {
            e.u8(T_SERVER_HEARTBEAT);
        }
    }
    e.0
}

/// Decodes a coordinator message body.
pub(crate) fn decode_server(body: &[u8]) -> Result<ServerMsg, DecodeError> {
    let mut d = Dec::new(body);
    let msg = match d.u8("message type")? {
        T_WELCOME => {
            d.magic()?;
            ServerMsg::Welcome {
                protocol: d.u32("protocol version")?,
                crate_version: d.str("crate version")?,
                world_size: d.usize("world size")?,
            }
        }
        T_REJECT => ServerMsg::Reject(RemoteError::decode(&mut d)?),
        T_OP_OK => {
            let seq = d.u64("sequence number")?;
            let n = d.u32("payload count")? as usize;
            let mut payloads = Vec::with_capacity(n.min(1 << 16));
            for _ in 0..n {
                payloads.push(d.bytes("payload")?.to_vec());
            }
            ServerMsg::OpOk { seq, payloads }
        }
        T_OP_ERR => {
            let seq = d.u64("sequence number")?;
            ServerMsg::OpErr {
                seq,
                error: RemoteError::decode(&mut d)?,
            }
        }
        T_SHUTDOWN => ServerMsg::Shutdown,
        T_SERVER_HEARTBEAT => ServerMsg::Heartbeat,
        t => {
            return Err(DecodeError(format!(
                "unexpected coordinator message type {t:#04x}"
            )));
        }
    };
    d.finish("coordinator message")?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            rank: 3,
            world_size: 8,
            crate_version: "1.2.3".into(),
            local_rank: 1,
            local_world_size: 2,
            op_timeout_ms: 1500,
            join_budget_ms: 1400,
            heartbeat_ms: 250,
            peer_timeout_ms: 2000,
        }
    }

    #[test]
    fn hello_round_trips() {
        let h = hello();
        assert_eq!(decode_hello(&encode_hello(&h)).unwrap(), HelloMsg::Ours(h));
    }

    #[test]
    fn foreign_hello_keeps_frozen_prefix() {
        let mut h = hello();
        h.protocol = 99;
        let mut body = encode_hello(&h);
        body.truncate(1 + 8 + 4 + 8 + 8); // A future protocol may change everything after.
        body.extend_from_slice(b"future fields");
        assert_eq!(
            decode_hello(&body).unwrap(),
            HelloMsg::Foreign {
                protocol: 99,
                rank: 3,
                world_size: 8
            }
        );
    }

    #[test]
    fn hello_with_bad_magic_is_rejected() {
        let mut body = encode_hello(&hello());
        body[1] = b'X';
        assert!(decode_hello(&body).unwrap_err().0.contains("magic"));
        assert!(decode_hello(b"GET / HTTP/1.1\r\n").is_err());
    }

    #[test]
    fn client_messages_round_trip() {
        let msgs = [
            ClientMsg::Op(OpMsg {
                seq: 7,
                kind: OpKind::Broadcast,
                tag: "nvshmem-uid".into(),
                root: 2,
                data: vec![1, 2, 3],
            }),
            ClientMsg::Goodbye,
            ClientMsg::Heartbeat,
        ];
        for m in msgs {
            assert_eq!(decode_client(&encode_client(&m)).unwrap(), m);
        }
    }

    #[test]
    fn server_messages_round_trip() {
        let errors = [
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
        ];
        let mut msgs = vec![
            ServerMsg::Welcome {
                protocol: PROTOCOL_VERSION,
                crate_version: CRATE_VERSION.into(),
                world_size: 4,
            },
            ServerMsg::OpOk {
                seq: 9,
                payloads: vec![vec![], vec![5; 300]],
            },
            ServerMsg::Shutdown,
            ServerMsg::Heartbeat,
        ];
        for e in errors {
            msgs.push(ServerMsg::Reject(e.clone()));
            msgs.push(ServerMsg::OpErr { seq: 4, error: e });
        }
        for m in msgs {
            assert_eq!(decode_server(&encode_server(&m)).unwrap(), m);
        }
    }

    #[test]
    fn truncated_and_trailing_bodies_are_errors() {
        let body = encode_server(&ServerMsg::OpOk {
            seq: 1,
            payloads: vec![vec![1, 2, 3]],
        });
        for cut in 0..body.len() {
            assert!(
                decode_server(&body[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
        let mut long = body.clone();
        long.push(0);
        assert!(decode_server(&long).unwrap_err().0.contains("trailing"));
    }

    /// A reader that hands out data in fixed small chunks, then reports a timeout once.
    struct Chunky {
        data: Vec<u8>,
        pos: usize,
        chunk: usize,
        timeout_at: Option<usize>,
    }

    impl Read for Chunky {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.timeout_at == Some(self.pos) {
                self.timeout_at = None;
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timeout"));
            }
            let n = self.chunk.min(buf.len()).min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    #[test]
    fn frame_reader_survives_partial_reads_and_timeouts() {
        let mut data = Vec::new();
        write_frame(&mut data, b"hello").unwrap();
        write_frame(&mut data, &[]).unwrap();
        write_frame(&mut data, &[7u8; 100_000]).unwrap();
        let mut src = Chunky {
            data,
            pos: 0,
            chunk: 3,
            timeout_at: Some(6),
        };
        let mut r = FrameReader::new(MAX_FRAME);
        let err = r.read_frame(&mut src).unwrap_err();
        assert!(err.is_timeout());
        assert_eq!(r.read_frame(&mut src).unwrap(), b"hello");
        assert_eq!(r.read_frame(&mut src).unwrap(), b"");
        assert_eq!(r.read_frame(&mut src).unwrap(), vec![7u8; 100_000]);
        assert!(matches!(r.read_frame(&mut src), Err(FrameError::Eof)));
    }

    #[test]
    fn frame_reader_rejects_oversized_and_truncated_frames() {
        let mut data = Vec::new();
        write_frame(&mut data, &[0u8; 100]).unwrap();
        let mut r = FrameReader::new(99);
        let mut src = Chunky {
            data: data.clone(),
            pos: 0,
            chunk: 1000,
            timeout_at: None,
        };
        assert!(matches!(
            r.read_frame(&mut src),
            Err(FrameError::TooLarge { len: 100, max: 99 })
        ));
        data.truncate(50);
        let mut r = FrameReader::new(MAX_FRAME);
        let mut src = Chunky {
            data,
            pos: 0,
            chunk: 1000,
            timeout_at: None,
        };
        assert!(matches!(r.read_frame(&mut src), Err(FrameError::Truncated)));
    }
}
