//! `EPCOMM_PROXY_TRACE=2`: a thread that prints the ring's state a few times a second while a
//! buffer lives (what the proxy has taken and completed, whether the next slot is published,
//! what the copy engines hold when the executor has a [`CallWatch`]), so a stalled op can be
//! followed over time. Off by default.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use epcomm_proxy::ring;

use crate::watch::CallWatch;

/// The tracing thread of one buffer.
pub(crate) struct Tracer {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer").finish_non_exhaustive()
    }
}

impl Tracer {
    /// Starts the thread over the ring at host address `ring` (`slots` slots), which must
    /// stay mapped until [`Tracer::stop`] returns, for the transport `backend`; `None` when
    /// the thread cannot start.
    pub(crate) fn start(
        backend: &'static str,
        ring: usize,
        slots: u64,
        watch: Option<Arc<CallWatch>>,
    ) -> Option<Tracer> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("epcomm-proxy-trace".into())
            .spawn(move || run(backend, ring, slots, watch.as_deref(), &flag))
            .ok()?;
        Some(Tracer { stop, thread })
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
    }
}

fn word(ring: usize, offset: usize) -> u64 {
    // SAFETY: `offset` lies inside the ring region (header words or a slot's first word), which
    // stays mapped until the tracer is stopped (`Tracer::start`); the words are only ever
    // accessed atomically, and an 8-byte aligned atomic load of them is always valid.
    unsafe { (*((ring + offset) as *const AtomicU64)).load(Ordering::Acquire) }
}

fn run(
    backend: &'static str,
    ring: usize,
    slots: u64,
    watch: Option<&CallWatch>,
    stop: &AtomicBool,
) {
    let start = Instant::now();
    let pid = std::process::id();
    let mut last = (u64::MAX, u64::MAX, u64::MAX);
    let mut printed = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let tail = word(ring, ring::OFFSET_TAIL);
        let completed = word(ring, ring::OFFSET_COMPLETED);
        let slot = (tail & (slots - 1)) as usize;
        let seq = word(ring, ring::HEADER_BYTES + slot * ring::SLOT_BYTES);
        let now = (tail, completed, seq);
        if now != last || printed.elapsed() > Duration::from_secs(2) {
            let engines = watch.map_or(String::new(), |w| {
                let (n, age) = w.in_flight();
                format!(
                    ", {n} in the copy engines (oldest {age:?}), {} rounds, in call {:?}",
                    w.polls(),
                    w.in_call()
                )
            });
            eprintln!(
                "epcomm {backend} trace [pid {pid}] {:>8.3}s: taken {tail}, completed \
                 {completed}, next slot seq {seq} (published when {}), status {}{engines}",
                start.elapsed().as_secs_f64(),
                tail + 1,
                word(ring, ring::OFFSET_STATUS),
            );
            last = now;
            printed = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
