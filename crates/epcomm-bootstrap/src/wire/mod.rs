//! Wire format: length-prefixed frames and the messages they carry.
//!
//! See the crate documentation for the normative description; this module is its
//! implementation, one layer per submodule:
//!
//! * [`frame`]: frames on a byte stream (writing whole frames, reading them back across read
//!   timeouts, size limits);
//! * [`codec`]: the little-endian primitives message bodies are made of;
//! * [`message`]: the message bodies of both directions and their type bytes;
//! * [`remote_error`]: the errors the coordinator sends, and their codes.
//!
//! The constants below are the protocol's fixed numbers, shared by all layers.

mod codec;
mod frame;
mod message;
mod remote_error;

pub(crate) use frame::{FrameError, FrameReader, Progress, write_frame, write_frame_locked};
pub(crate) use message::{
    ClientMsg, Hello, HelloMsg, OpMsg, ServerMsg, decode_client, decode_hello, decode_server,
    encode_client, encode_hello, encode_server,
};
pub(crate) use remote_error::RemoteError;

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
