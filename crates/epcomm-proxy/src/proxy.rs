//! The proxy: one thread per GPU that takes descriptors from the ring in order, coalesces
//! them, hands them to an [`Executor`] and publishes completions into the ring.
//!
//! Each round of [`run`]:
//!
//! 1. **take**: while fewer than [`ProxyConfig::max_pending`] operations wait for the executor,
//!    take published descriptors in ring order (following only the slots' `seq` tags, so a
//!    ring filled by many producers that claim positions elsewhere is drained the same way),
//!    decode them against [`ProxyConfig::limits`] and coalesce them ([`Coalescer`]); then
//!    flush the coalescer (nothing is held back for a merge that may never come). When the
//!    executor is saturated the proxy stops taking, the ring fills and the producers wait:
//!    that is the flow control.
//! 2. **submit** waiting operations in order until the executor answers [`Submit::Busy`]:
//!    transfers to [`Executor::submit_transfer`], writes to [`Executor::submit_write`], signals
//!    to [`Executor::submit_signal`]. The coalescer's order keeps every transfer and write
//!    ahead of the signals that follow it in the ring (see [`crate::descriptor`]).
//! 3. **poll** the executor and publish the prefix of complete descriptors (`completed`).
//! 4. **check** the oldest operation in the executor against [`ProxyConfig::op_timeout`].
//!
//! **Shutdown** ([`Proxy::shutdown`], or dropping the [`Proxy`]): the ring is marked closed
//! (the producer's waits end with [`RingError::Closed`]), what was already published is taken
//! and executed, every operation completes (bounded by the op timeout), the final count is
//! published and the thread ends. **Failure**: the first error marks the ring failed (the
//! producer's waits end with [`RingError::ProxyFailed`]) and is returned, naming the peer and
//! the descriptor.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::coalesce::{Coalescer, Op};
use crate::completion::Completions;
use crate::descriptor::{Descriptor, DescriptorError, Limits, RawDescriptor};
use crate::executor::{Executor, OpFailure, OpId, Submit};
use crate::ring::{Consumer, RingError};
use crate::sync::backoff;

/// How a proxy runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// What descriptors are checked against.
    pub limits: Limits,
    /// Largest merged transfer ([`Coalescer::new`]; 0 disables merging).
    pub max_run_bytes: u64,
    /// Operations waiting for the executor before the proxy stops taking from the ring (≥ 1).
    pub max_pending: usize,
    /// Longest an operation may stay in the executor.
    pub op_timeout: Duration,
    /// CPU to pin the proxy thread to ([`Proxy::spawn`]); `None` leaves it to the OS.
    pub cpu: Option<usize>,
}

impl ProxyConfig {
    /// Defaults: merges up to 1 MiB, 1024 waiting operations, a 10 s operation timeout, not
    /// pinned.
    pub fn new(limits: Limits) -> ProxyConfig {
        ProxyConfig {
            limits,
            max_run_bytes: 1 << 20,
            max_pending: 1024,
            op_timeout: Duration::from_secs(10),
            cpu: None,
        }
    }
}

/// What a proxy did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyReport {
    /// Descriptors taken from the ring (and completed).
    pub descriptors: u64,
    /// Operations the executor ran (fewer than descriptors when transfers merged).
    pub ops: u64,
    /// Transfer operations.
    pub transfers: u64,
    /// Signal operations.
    pub signals: u64,
    /// Write operations (inline 4- or 8-byte stores; never merged).
    pub writes: u64,
    /// Bytes moved by transfer operations (writes and signals not counted).
    pub bytes: u64,
    /// Times the executor answered [`Submit::Busy`].
    pub busy: u64,
    /// Rounds of the loop (take, submit, poll) that moved something: took a descriptor,
    /// submitted an operation or completed one.
    pub working_rounds: u64,
    /// Rounds that moved nothing (each followed by a spin or a yield).
    pub idle_rounds: u64,
    /// Nanoseconds spent in working rounds: how busy the proxy thread was. Close to the
    /// loop's time under load ([`ProxyReport::loop_ns`]) means the proxy, not the GPU, sets
    /// the pace.
    pub working_ns: u64,
    /// Nanoseconds from the loop's start to its end.
    pub loop_ns: u64,
}

/// Everything a proxy can fail with; each names the descriptor (ring number) and, where there
/// is one, the peer.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A descriptor broke a rule.
    #[error("ring descriptor {position} ({raw:?}) is invalid: {source}")]
    Decode {
        /// Its ring number.
        position: u64,
        /// What the ring held.
        raw: RawDescriptor,
        /// The rule broken.
        source: DescriptorError,
    },
    /// The executor failed an operation.
    #[error(
        "{executor} executor failed {work:?} to peer {peer} (ring descriptors {positions:?}): \
         {source}"
    )]
    Executor {
        /// [`Executor::name`].
        executor: String,
        /// The destination rank.
        peer: u32,
        /// The (possibly merged) operation.
        work: Descriptor,
        /// The ring numbers it covers.
        positions: Vec<u64>,
        /// The executor's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An operation did not complete within [`ProxyConfig::op_timeout`].
    #[error(
        "{executor} executor: {work:?} to peer {peer} (ring descriptors {positions:?}) did not \
         complete within {waited:?}"
    )]
    CompletionTimeout {
        /// [`Executor::name`].
        executor: String,
        /// The destination rank.
        peer: u32,
        /// The operation.
        work: Descriptor,
        /// The ring numbers it covers.
        positions: Vec<u64>,
        /// How long it had been in the executor.
        waited: Duration,
    },
    /// The executor reported an operation the proxy did not give it.
    #[error("{executor} executor reported operation {op}, which it was not given")]
    UnknownOp {
        /// [`Executor::name`].
        executor: String,
        /// The number reported.
        op: OpId,
    },
    /// The executor could not mirror the ring's progress ([`Executor::progress`]).
    #[error("{executor} executor could not mirror the ring's progress: {source}")]
    Progress {
        /// [`Executor::name`].
        executor: String,
        /// The executor's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The ring failed.
    #[error(transparent)]
    Ring(#[from] RingError),
    /// Pinning the thread failed.
    #[error("pinning the proxy thread to CPU {cpu}: {source}")]
    Pin {
        /// The CPU asked for.
        cpu: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// The thread could not be started.
    #[error("starting the proxy thread: {0}")]
    Spawn(std::io::Error),
    /// The thread ended by panicking (in an executor).
    #[error("the proxy thread panicked: {0}")]
    Panicked(String),
}

/// The state of one proxy run.
struct Loop<'a, E: Executor> {
    consumer: &'a mut Consumer,
    executor: &'a mut E,
    config: &'a ProxyConfig,
    coalescer: Coalescer,
    completions: Completions,
    pending: VecDeque<Op>,
    in_flight: BTreeMap<OpId, (Op, Instant)>,
    next_op: OpId,
    done: Vec<OpId>,
    report: ProxyReport,
}

impl<E: Executor> Loop<'_, E> {
    /// Step 1; returns (descriptors taken, whether the ring looked empty).
    fn take(&mut self) -> Result<(usize, bool), ProxyError> {
        let mut taken = 0;
        let mut empty = false;
        let mut ready = Vec::new();
        while self.pending.len() + ready.len() < self.config.max_pending.max(1) {
            let Some((position, raw)) = self.consumer.try_pop()? else {
                empty = true;
                break;
            };
            let work = raw
                .decode(&self.config.limits)
                .map_err(|source| ProxyError::Decode {
                    position,
                    raw,
                    source,
                })?;
            let numbered = self.completions.taken();
            debug_assert_eq!(numbered, position);
            self.coalescer.push(position, work, &mut ready);
            taken += 1;
        }
        self.coalescer.flush(&mut ready);
        self.pending.extend(ready);
        Ok((taken, empty))
    }

    /// Step 2; returns the operations submitted.
    fn submit(&mut self) -> Result<usize, ProxyError> {
        let mut submitted = 0;
        while let Some(op) = self.pending.pop_front() {
            let id = self.next_op;
            let answer = match &op.work {
                Descriptor::Transfer(t) => self.executor.submit_transfer(id, t),
                Descriptor::Signal(s) => self.executor.submit_signal(id, s),
                Descriptor::Write(w) => self.executor.submit_write(id, w),
            };
            match answer {
                Ok(Submit::Busy) => {
                    self.report.busy += 1;
                    self.pending.push_front(op);
                    break;
                }
                Ok(Submit::Accepted) => {
                    self.next_op += 1;
                    self.in_flight.insert(id, (op, Instant::now()));
                    submitted += 1;
                }
                Err(failure) => return Err(self.executor_error(op, failure)),
            }
        }
        Ok(submitted)
    }

    /// Step 3; returns the operations completed.
    fn poll(&mut self) -> Result<usize, ProxyError> {
        self.done.clear();
        let polled = self.executor.poll(&mut self.done);
        let count = self.done.len();
        for i in 0..count {
            let id = self.done[i];
            let Some((op, _)) = self.in_flight.remove(&id) else {
                return Err(ProxyError::UnknownOp {
                    executor: self.executor.name().to_string(),
                    op: id,
                });
            };
            self.completions.complete(&op.positions);
            self.report.descriptors += op.positions.len() as u64;
            self.report.ops += 1;
            match op.work {
                Descriptor::Transfer(t) => {
                    self.report.transfers += 1;
                    self.report.bytes += t.bytes;
                }
                Descriptor::Signal(_) => self.report.signals += 1,
                Descriptor::Write(_) => self.report.writes += 1,
            }
        }
        self.consumer.publish_completed(self.completions.prefix());
        let taken = self.completions.prefix() + self.completions.pending() as u64;
        let mirrored = self.executor.progress(
            taken,
            self.completions.prefix(),
            self.next_op.saturating_sub(1),
        );
        if let Err(failure) = polled {
            let Some((op, _)) = self.in_flight.remove(&failure.op) else {
                return Err(ProxyError::UnknownOp {
                    executor: self.executor.name().to_string(),
                    op: failure.op,
                });
            };
            return Err(self.executor_error(op, failure));
        }
        if let Err(failure) = mirrored {
            return Err(ProxyError::Progress {
                executor: self.executor.name().to_string(),
                source: failure.reason,
            });
        }
        Ok(count)
    }

    /// Step 4.
    fn check_timeouts(&self) -> Result<(), ProxyError> {
        if let Some((_, (op, since))) = self.in_flight.first_key_value() {
            let waited = since.elapsed();
            if waited > self.config.op_timeout {
                return Err(ProxyError::CompletionTimeout {
                    executor: self.executor.name().to_string(),
                    peer: op.work.peer(),
                    work: op.work,
                    positions: op.positions.clone(),
                    waited,
                });
            }
        }
        Ok(())
    }

    fn executor_error(&self, op: Op, failure: OpFailure) -> ProxyError {
        ProxyError::Executor {
            executor: self.executor.name().to_string(),
            peer: op.work.peer(),
            work: op.work,
            positions: op.positions,
            source: failure.reason,
        }
    }
}

/// Runs the proxy loop on the calling thread until `stop` is set and everything published
/// before the ring was closed has completed (see the [module docs](self)).
///
/// # Errors
/// The first [`ProxyError`]; the ring is then marked failed.
pub fn run<E: Executor>(
    consumer: &mut Consumer,
    executor: &mut E,
    config: &ProxyConfig,
    stop: &AtomicBool,
) -> Result<ProxyReport, ProxyError> {
    let mut state = Loop {
        consumer,
        executor,
        config,
        coalescer: Coalescer::new(config.max_run_bytes),
        completions: Completions::new(),
        pending: VecDeque::new(),
        in_flight: BTreeMap::new(),
        next_op: 0,
        done: Vec::new(),
        report: ProxyReport::default(),
    };
    let result = drive(&mut state, stop);
    match &result {
        Ok(_) => state.consumer.close(),
        Err(_) => state.consumer.fail(),
    }
    result
}

fn drive<E: Executor>(
    state: &mut Loop<'_, E>,
    stop: &AtomicBool,
) -> Result<ProxyReport, ProxyError> {
    let mut closed = false;
    let mut idle: u32 = 0;
    let start = Instant::now();
    loop {
        if !closed && stop.load(Ordering::Acquire) {
            // From here on the producer's waits end with `Closed`; what it already published
            // is still taken below.
            state.consumer.close();
            closed = true;
        }
        let round = Instant::now();
        let (taken, empty) = state.take()?;
        let submitted = state.submit()?;
        let completed = state.poll()?;
        state.check_timeouts()?;
        if taken + submitted + completed == 0 {
            state.report.idle_rounds += 1;
        } else {
            state.report.working_rounds += 1;
            state.report.working_ns += round.elapsed().as_nanos() as u64;
        }
        if closed && empty && state.pending.is_empty() && state.in_flight.is_empty() {
            state.report.loop_ns = start.elapsed().as_nanos() as u64;
            return Ok(state.report);
        }
        if taken + submitted + completed == 0 {
            backoff(idle);
            idle = idle.saturating_add(1);
        } else {
            idle = 0;
        }
    }
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) -> Result<(), ProxyError> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(ProxyError::Pin {
            cpu,
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    // SAFETY: `cpu_set_t` is a plain bit array for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu < CPU_SETSIZE` (checked above), so the bit is inside `set`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid, initialised `cpu_set_t` of the size passed; pid 0 is the
    // calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(ProxyError::Pin {
            cpu,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// A proxy thread; stopped (cleanly) by [`Proxy::shutdown`] or on drop.
#[derive(Debug)]
pub struct Proxy {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<ProxyReport, ProxyError>>>,
}

impl Proxy {
    /// Starts a thread named `epcomm-proxy` (pinned to [`ProxyConfig::cpu`] when set) running
    /// [`run`] on `consumer` and `executor`.
    ///
    /// # Errors
    /// [`ProxyError::Spawn`]. A pinning failure ([`ProxyError::Pin`]) ends the thread at once:
    /// it is returned by [`Proxy::shutdown`], and the ring is marked failed.
    pub fn spawn<E: Executor>(
        mut consumer: Consumer,
        mut executor: E,
        config: ProxyConfig,
    ) -> Result<Proxy, ProxyError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("epcomm-proxy".to_string())
            .spawn(move || {
                if let Some(cpu) = config.cpu
                    && let Err(e) = pin_to(cpu)
                {
                    consumer.fail();
                    return Err(e);
                }
                run(&mut consumer, &mut executor, &config, &flag)
            })
            .map_err(ProxyError::Spawn)?;
        Ok(Proxy {
            stop,
            thread: Some(thread),
        })
    }

    /// Whether the thread has ended (stopped or failed).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops the proxy cleanly (see the [module docs](self)) and waits for its thread.
    ///
    /// # Errors
    /// The error the proxy stopped on, or [`ProxyError::Panicked`].
    pub fn shutdown(mut self) -> Result<ProxyReport, ProxyError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<ProxyReport, ProxyError> {
        self.stop.store(true, Ordering::Release);
        let Some(thread) = self.thread.take() else {
            return Ok(ProxyReport::default());
        };
        thread.join().unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".to_string());
            Err(ProxyError::Panicked(message))
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The result has nowhere to go; `shutdown` is the way to see it.
        let _ = self.stop_and_join();
    }
}
