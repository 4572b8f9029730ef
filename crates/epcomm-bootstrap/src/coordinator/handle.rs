//! [`CoordinatorHandle`]: starts the coordinator's threads and stops them.
//!
//! Contract: [`CoordinatorHandle::start`] either starts all three long-lived threads
//! (acceptor, coordinator, heartbeat) or none (it joins whatever it had started before
//! failing); [`CoordinatorHandle::shutdown`], also run on drop, joins every thread it started,
//! per-connection readers included, and is idempotent.

use std::io;
use std::net::{Shutdown, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Instant;

use super::accept::{Registry, accept_loop};
use super::liveness::{Beats, heartbeat_loop};
use super::{Coordinator, Event};
use crate::config::Liveness;

/// Owner of the coordinator threads. Dropping it (or calling [`CoordinatorHandle::shutdown`])
/// tells connected ranks the coordinator is going away and joins every thread it started.
#[derive(Debug)]
pub(crate) struct CoordinatorHandle {
    events: Sender<Event>,
    stop_accept: Arc<AtomicBool>,
    coordinator: Option<JoinHandle<()>>,
    acceptor: Option<JoinHandle<()>>,
    registry: Registry,
    stop_beats: Option<Sender<()>>,
    beater: Option<JoinHandle<()>>,
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl CoordinatorHandle {
    /// Starts serving `listener` for a group of `world_size` ranks that must all report
    /// `crate_version`. `liveness` gives the keepalive settings of accepted sockets; heartbeat
    /// settings are each rank's own, from its handshake.
    pub(crate) fn start(
        listener: TcpListener,
        world_size: usize,
        crate_version: String,
        liveness: Liveness,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let origin = Instant::now();
        let (tx, rx) = mpsc::channel();
        let stop_accept = Arc::new(AtomicBool::new(false));
        let registry: Registry = Arc::new(Mutex::new(Vec::new()));
        let beats: Beats = Arc::new(Mutex::new(Vec::new()));
        let (stop_beats, beats_stopped) = mpsc::channel();
        let beater = {
            let beats = beats.clone();
            thread::Builder::new()
                .name("epcomm-bootstrap-beat".into())
                .spawn(move || heartbeat_loop(beats, beats_stopped, origin))?
        };
        let state = Coordinator::new(world_size, crate_version, origin, beats);
        let coordinator = thread::Builder::new()
            .name("epcomm-bootstrap-coordinator".into())
            .spawn(move || state.run(rx));
        let coordinator = match coordinator {
            Ok(c) => c,
            Err(e) => {
                drop(stop_beats);
                let _ = beater.join();
                return Err(e);
            }
        };
        let acceptor = {
            let (tx, stop, registry) = (tx.clone(), stop_accept.clone(), registry.clone());
            thread::Builder::new()
                .name("epcomm-bootstrap-accept".into())
                .spawn(move || accept_loop(listener, tx, stop, registry, liveness, origin))
        };
        let acceptor = match acceptor {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(Event::Stop);
                let _ = coordinator.join();
                drop(stop_beats);
                let _ = beater.join();
                return Err(e);
            }
        };
        Ok(CoordinatorHandle {
            events: tx,
            stop_accept,
            coordinator: Some(coordinator),
            acceptor: Some(acceptor),
            registry,
            stop_beats: Some(stop_beats),
            beater: Some(beater),
        })
    }

    /// Stops accepting, sends `Shutdown` to connected ranks, waits briefly for them to close,
    /// then closes every socket and joins all threads. Idempotent.
    pub(crate) fn shutdown(&mut self) {
        self.stop_accept.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        if let Some(c) = self.coordinator.take() {
            let _ = self.events.send(Event::Stop);
            let _ = c.join();
        }
        let conns =
            std::mem::take(&mut *self.registry.lock().unwrap_or_else(PoisonError::into_inner));
        for (stream, _) in &conns {
            // Wakes readers blocked in read() (they then see end-of-stream and exit).
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, reader) in conns {
            let _ = reader.join();
        }
        // Last: a heartbeat write blocked on a stuck peer was woken by the shutdowns above.
        self.stop_beats.take();
        if let Some(b) = self.beater.take() {
            let _ = b.join();
        }
    }
}
