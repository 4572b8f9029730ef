//! Accepting connections: the acceptor thread, and one reader thread per connection that reads
//! the handshake and then forwards every client message to the coordinator thread as an
//! [`Event`].
//!
//! Contract: a connection becomes visible to the coordinator only through a well-formed
//! `Hello` ([`Event::Hello`]); anything else (wrong magic, garbage, silence for
//! [`HELLO_TIMEOUT`]) is dropped without an event, so strangers never disturb the group. After
//! the handshake, every arrival of bytes is stamped as a sign of life before it is decoded.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::{ConnId, Event, ms_since};
use crate::config::Liveness;
use crate::wire::{self, ClientMsg, FrameReader, MAX_FRAME, MAX_HANDSHAKE_FRAME, Progress};

/// How long a fresh connection may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll interval of the acceptor thread.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// Every accepted connection's socket and reader thread, so shutdown can wake and join them.
pub(super) type Registry = Arc<Mutex<Vec<(TcpStream, thread::JoinHandle<()>)>>>;

pub(super) fn accept_loop(
    listener: TcpListener,
    tx: Sender<Event>,
    stop: Arc<AtomicBool>,
    reg: Registry,
    liveness: Liveness,
    origin: Instant,
) {
    let mut next_id: ConnId = 0;
    while !stop.load(Ordering::SeqCst) {
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            // WouldBlock: nothing pending. Other errors (EMFILE, ECONNABORTED) are transient
            // from the listener's point of view; keep serving.
            Err(_) => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = liveness.apply_keepalive(&stream);
        let Ok(registered) = stream.try_clone() else {
            continue;
        };
        let id = next_id;
        next_id += 1;
        let tx = tx.clone();
        let spawned = thread::Builder::new()
            .name(format!("epcomm-bootstrap-conn-{id}"))
            .spawn(move || reader_loop(id, stream, peer.to_string(), tx, origin));
        if let Ok(handle) = spawned {
            let mut reg = reg.lock().unwrap_or_else(PoisonError::into_inner);
            // Release the descriptors of connections whose reader has finished (strangers,
            // departed ranks); the coordinator keeps its own handle where it still needs one.
            reg.retain(|(_, reader)| !reader.is_finished());
            reg.push((registered, handle));
        }
    }
}

/// Reads the handshake, then forwards every client message to the coordinator, stamping each
/// arrival of bytes (heartbeats included) as a sign of life. A connection that does not start
/// with a valid `Hello` (wrong magic, garbage, silence) is dropped without affecting the group.
fn reader_loop(
    conn: ConnId,
    mut stream: TcpStream,
    peer: String,
    tx: Sender<Event>,
    origin: Instant,
) {
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut reader = FrameReader::new(MAX_HANDSHAKE_FRAME);
    let Ok(body) = reader.read_frame(&mut stream) else {
        return;
    };
    let Ok(hello) = wire::decode_hello(&body) else {
        return;
    };
    if stream.set_read_timeout(None).is_err() {
        return;
    }
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let heard = Arc::new(AtomicU64::new(ms_since(origin)));
    if tx
        .send(Event::Hello {
            conn,
            writer,
            peer,
            hello,
            heard: heard.clone(),
        })
        .is_err()
    {
        return;
    }
    reader.set_max(MAX_FRAME);
    let mut source = Progress {
        inner: &stream,
        on_progress: || heard.store(ms_since(origin), Ordering::SeqCst),
    };
    loop {
        let event = match reader
            .read_frame(&mut source)
            .map(|b| wire::decode_client(&b))
        {
            Ok(Ok(ClientMsg::Heartbeat)) => continue,
            Ok(Ok(ClientMsg::Op(op))) => Event::Op { conn, op },
            Ok(Ok(ClientMsg::Goodbye)) => {
                let _ = tx.send(Event::Goodbye { conn });
                return;
            }
            // End of stream, socket error, oversized frame or undecodable message: the peer is
            // treated as dead.
            Ok(Err(_)) | Err(_) => {
                let _ = tx.send(Event::Closed { conn });
                return;
            }
        };
        if tx.send(event).is_err() {
            return;
        }
    }
}
