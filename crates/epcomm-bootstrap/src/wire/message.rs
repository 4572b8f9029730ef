//! The messages of the protocol and their bodies: the handshake ([`Hello`]), client messages
//! ([`ClientMsg`]) and coordinator messages ([`ServerMsg`]).
//!
//! Contracts: every `decode_*` is the inverse of its `encode_*`; a body that is truncated, has
//! trailing bytes or carries an unknown type byte is a [`DecodeError`]. [`decode_hello`] reads
//! only the frozen prefix (magic, protocol, rank, world size) of a foreign protocol version.

use super::codec::{Dec, DecodeError, Enc};
use super::remote_error::RemoteError;
use super::{MAGIC, PROTOCOL_VERSION};
use crate::error::OpKind;

// Message type bytes, client to coordinator.
const T_HELLO: u8 = 0x01;
const T_OP: u8 = 0x02;
const T_GOODBYE: u8 = 0x03;
const T_HEARTBEAT: u8 = 0x04;
/// The high bit of a type byte marks a message from the coordinator.
const FROM_COORDINATOR: u8 = 0x80;
const T_WELCOME: u8 = FROM_COORDINATOR | 0x01;
const T_REJECT: u8 = FROM_COORDINATOR | 0x02;
const T_OP_OK: u8 = FROM_COORDINATOR | 0x03;
const T_OP_ERR: u8 = FROM_COORDINATOR | 0x04;
const T_SHUTDOWN: u8 = FROM_COORDINATOR | 0x05;
const T_SERVER_HEARTBEAT: u8 = FROM_COORDINATOR | 0x06;

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
        ClientMsg::Op(op) => e
            .u8(T_OP)
            .u64(op.seq)
            .u8(op.kind.code())
            .str(&op.tag)
            .usize(op.root)
            .bytes(&op.data),
        ClientMsg::Goodbye => e.u8(T_GOODBYE),
        ClientMsg::Heartbeat => e.u8(T_HEARTBEAT),
    };
    e.0
}

/// Decodes a client message body received after the handshake.
pub(crate) fn decode_client(body: &[u8]) -> Result<ClientMsg, DecodeError> {
    decode_body(body, "client", |t, d| {
        Ok(Some(match t {
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
            _ => return Ok(None),
        }))
    })
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
    decode_body(body, "coordinator", |t, d| {
        Ok(Some(match t {
            T_WELCOME => {
                d.magic()?;
                ServerMsg::Welcome {
                    protocol: d.u32("protocol version")?,
                    crate_version: d.str("crate version")?,
                    world_size: d.usize("world size")?,
                }
            }
            T_REJECT => ServerMsg::Reject(RemoteError::decode(d)?),
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
                    error: RemoteError::decode(d)?,
                }
            }
            T_SHUTDOWN => ServerMsg::Shutdown,
            T_SERVER_HEARTBEAT => ServerMsg::Heartbeat,
            _ => return Ok(None),
        }))
    })
}

/// Decodes a message body sent by `side` ("client" or "coordinator"): its type byte, then the
/// fields `fields` reads for that type, then nothing. `fields` returns `None` for a type that
/// `side` does not send, which is an error naming the type.
fn decode_body<T>(
    body: &[u8],
    side: &str,
    fields: impl FnOnce(u8, &mut Dec<'_>) -> Result<Option<T>, DecodeError>,
) -> Result<T, DecodeError> {
    let mut d = Dec::new(body);
    let t = d.u8("message type")?;
    let Some(msg) = fields(t, &mut d)? else {
        return Err(DecodeError(format!(
            "unexpected {side} message type {t:#04x}"
        )));
    };
    d.finish(&format!("{side} message"))?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CRATE_VERSION;
    use crate::wire::remote_error::every_remote_error;

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
    fn type_bytes_are_the_documented_ones() {
        let client = [T_HELLO, T_OP, T_GOODBYE, T_HEARTBEAT];
        let coordinator = [T_WELCOME, T_REJECT, T_OP_OK, T_OP_ERR, T_SHUTDOWN];
        assert_eq!(client, [0x01, 0x02, 0x03, 0x04]);
        assert_eq!(coordinator, [0x81, 0x82, 0x83, 0x84, 0x85]);
        assert_eq!(T_SERVER_HEARTBEAT, 0x86);
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
        let errors = every_remote_error();
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
}
