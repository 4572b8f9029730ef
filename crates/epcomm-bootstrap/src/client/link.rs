//! The write side of a rank's connection to the coordinator: [`Link`] and the
//! [`HeartbeatThread`] that shares it.
//!
//! Contract: frames written through a [`Link`] never interleave, whichever thread writes them;
//! the heartbeat thread skips a beat while another write is in progress (those bytes are a sign
//! of life too) and stops for good at the first failed write, leaving the failure for the next
//! collective to report.

use std::io;
use std::net::TcpStream;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::wire::{self, ClientMsg};

/// The connection to the coordinator, shared by the calling thread and the heartbeat thread.
/// Writes go through [`Link::send`] so that frames of the two threads never interleave.
#[derive(Debug)]
pub(super) struct Link {
    pub(super) stream: TcpStream,
    pub(super) write_lock: Mutex<()>,
}

impl Link {
    pub(super) fn send(&self, body: &[u8]) -> io::Result<()> {
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
pub(super) struct HeartbeatThread {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl HeartbeatThread {
    pub(super) fn start(link: Arc<Link>, every: Duration, rank: usize) -> io::Result<Self> {
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
    pub(super) fn stop(&mut self) {
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
