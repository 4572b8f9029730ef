//! What every executor of this crate shares: the descriptor ring in host-mapped memory, the
//! device counters of the proxy image, the proxy thread that drains the ring into an
//! executor, and its diagnostics (the report when it stops, the live trace, the failure text
//! the frontend adds to a stalled op's error).
//!
//! Set-up in two steps, because an executor may need the counters before it is built (the
//! copy-engine executor mirrors the ring's progress into them): [`RingParts::new`], then
//! [`RingParts::spawn`] with the executor, which starts the proxy thread and returns the
//! [`ProxyCore`] a symmetric memory keeps.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use epcomm_abi::{self as abi, ProxyChannel};
use epcomm_proxy::ring::Consumer;
use epcomm_proxy::{
    Executor, Limits, Proxy, ProxyConfig, ProxyError, ProxyReport, RingMemory, ring,
};
use epcomm_transport::{DeviceBuffer, MappedHostBuffer, TransportError};

use crate::ProxyOptions;
use crate::trace;
use crate::watch::CallWatch;

/// `TransportError::Backend` of `backend` while doing `what`.
pub(crate) fn backend_error<E: std::error::Error + Send + Sync + 'static>(
    backend: &'static str,
    what: &'static str,
) -> impl FnOnce(E) -> TransportError {
    move |e| TransportError::Backend {
        backend,
        context: what.to_string(),
        source: Box::new(e),
    }
}

/// The ring and the counters, before the proxy starts.
pub(crate) struct RingParts {
    backend: &'static str,
    slots: u64,
    consumer: Consumer,
    counters: DeviceBuffer,
    ring_host: MappedHostBuffer,
}

impl RingParts {
    /// A zeroed ring of `options.ring_slots` slots in pinned, device-mapped host memory, and
    /// the zeroed device counters.
    ///
    /// # Errors
    /// [`TransportError::Driver`] for the allocations; [`TransportError::Backend`] for the
    /// ring's layout.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        options: &ProxyOptions,
        backend: &'static str,
    ) -> Result<RingParts, TransportError> {
        let slots = options.ring_slots;
        let region =
            ring::region_bytes(slots).map_err(backend_error(backend, "sizing the ring"))?;
        let ring_host = MappedHostBuffer::zeroed(ctx, region)?;
        // SAFETY: `ring_host` is `region` bytes of pinned, page-aligned host memory owned by
        // the `ProxyCore` this becomes, which stops the proxy (the only host user) before it
        // drops `ring_host`; the device touches it only through the ring protocol.
        let ring = unsafe { RingMemory::from_raw(ring_host.host_ptr(), ring_host.len(), slots) }
            .map_err(backend_error(backend, "laying out the ring"))?;
        let (_, consumer) = ring::split(ring);
        let counters = DeviceBuffer::zeroed(ctx, abi::PROXY_COUNTER_WORDS as usize * 8)?;
        Ok(RingParts {
            backend,
            slots,
            consumer,
            counters,
            ring_host,
        })
    }

    /// Device address of the counter `index` (`abi::PROXY_COUNTER_*`).
    pub(crate) fn counter(&self, index: u64) -> u64 {
        self.counters.ptr() + index * 8
    }

    /// Starts the proxy thread over the ring with `executor`, for a symmetric buffer of
    /// `heap_bytes` bytes at `local_base` in a world of `world` ranks. `watch`: the executor's
    /// driver-call watch, if it has one (diagnostics).
    ///
    /// # Errors
    /// [`TransportError::Backend`] when the thread cannot start.
    pub(crate) fn spawn<E: Executor>(
        self,
        executor: E,
        options: &ProxyOptions,
        world: usize,
        heap_bytes: usize,
        local_base: u64,
        watch: Option<Arc<CallWatch>>,
    ) -> Result<ProxyCore, TransportError> {
        let RingParts {
            backend,
            slots,
            consumer,
            counters,
            ring_host,
        } = self;
        if options.trace >= 3
            && let Some(w) = &watch
        {
            w.keep_timeline();
        }
        let tracer = (options.trace == 2)
            .then(|| {
                trace::Tracer::start(backend, ring_host.host_ptr() as usize, slots, watch.clone())
            })
            .flatten();
        let mut config = ProxyConfig::new(Limits {
            world: world as u32,
            heap_bytes: heap_bytes as u64,
        });
        // Small take rounds: completions are polled and published between them.
        config.max_pending = options.max_in_flight.min(1024);
        config.op_timeout = options.op_timeout;
        config.cpu = options.cpu;
        let proxy =
            Proxy::spawn(consumer, executor, config).map_err(backend_error(backend, "starting"))?;
        let channel = ProxyChannel {
            ring: ring_host.device_ptr(),
            counters: counters.ptr(),
            capacity: slots,
            local_base,
            timeout_ns: u64::try_from(options.slot_timeout.as_nanos()).unwrap_or(u64::MAX),
        };
        Ok(ProxyCore {
            backend,
            heap_bytes,
            channel,
            watch,
            proxy: Mutex::new(Some(proxy)),
            tracer: Mutex::new(tracer),
            trace: options.trace,
            last_report: Mutex::new(None),
            _counters: counters,
            ring_host,
        })
    }
}

/// The proxy thread of one symmetric buffer with its ring, counters and diagnostics.
///
/// Field order is drop order: the proxy is stopped first (see `Drop`), then the counters and
/// the ring go.
#[derive(Debug)]
pub(crate) struct ProxyCore {
    backend: &'static str,
    heap_bytes: usize,
    channel: ProxyChannel,
    watch: Option<Arc<CallWatch>>,
    proxy: Mutex<Option<Proxy>>,
    tracer: Mutex<Option<trace::Tracer>>,
    /// `ProxyOptions::trace`.
    trace: u8,
    last_report: Mutex<Option<Result<ProxyReport, String>>>,
    _counters: DeviceBuffer,
    ring_host: MappedHostBuffer,
}

impl ProxyCore {
    /// Writes the channel (what the kernels need) into `module`'s `epcomm_proxy_channel`: the memory's
    /// `SymmetricMemory::bind_device_channel`.
    ///
    /// # Safety
    /// As `SymmetricMemory::bind_device_channel`: `module` is a live proxy-family module of
    /// `stream`'s context, launched only while this core's ring and counters are alive.
    pub(crate) unsafe fn bind_channel(
        &self,
        module: cudarc::driver::sys::CUmodule,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), TransportError> {
        let bytes = bytemuck::bytes_of(&self.channel);
        // SAFETY: the caller's contract is the helper's.
        unsafe {
            epcomm_transport::memory::write_module_global(
                module,
                abi::PROXY_CHANNEL_GLOBAL,
                bytes,
                stream,
            )
        }
    }

    /// Stops the proxy thread (what the kernels published is executed first) and keeps its
    /// report; idempotent.
    pub(crate) fn stop(&self) {
        if let Some(tracer) = self.tracer.lock().ok().and_then(|mut t| t.take()) {
            tracer.stop();
        }
        let proxy = self.proxy.lock().ok().and_then(|mut p| p.take());
        if let Some(proxy) = proxy {
            let report = proxy.shutdown().map_err(|e: ProxyError| e.to_string());
            if self.trace >= 1 {
                let timeline = if self.trace >= 3 {
                    self.write_timeline()
                } else {
                    String::new()
                };
                eprintln!(
                    "epcomm {}: buffer of {} bytes stopped: {report:?}; {}{timeline}",
                    self.backend,
                    self.heap_bytes,
                    self.driver_calls()
                );
            }
            if let Ok(mut slot) = self.last_report.lock() {
                *slot = Some(report);
            }
        }
    }

    /// Writes the executor's timeline (`ProxyOptions::trace` 3) to a file of its own in the
    /// temporary directory, one moment a line (microseconds since the proxy started, then
    /// [`crate::Moment::fields`]), and says where, or why not.
    fn write_timeline(&self) -> String {
        let Some(watch) = &self.watch else {
            return "; no timeline (this executor keeps none)".into();
        };
        static BUFFERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = BUFFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "epcomm-proxy-timeline-{}-{n}.tsv",
            std::process::id()
        ));
        let mut text = String::from("t_us\tmoment\tlane\tcount\tbytes_or_us\n");
        for (t, m) in watch.timeline() {
            text += &format!("{:.1}\t{}\n", t.as_secs_f64() * 1e6, m.fields());
        }
        match std::fs::write(&path, text) {
            Ok(()) => format!("; timeline in {}", path.display()),
            Err(e) => format!(
                "; the timeline could not be written to {}: {e}",
                path.display()
            ),
        }
    }

    /// What the executor's driver calls cost so far (an executor with a [`CallWatch`]): the
    /// call in progress, the longest call, and per call its count and total time.
    fn driver_calls(&self) -> String {
        let Some(watch) = &self.watch else {
            return String::new();
        };
        let mut out = String::new();
        match watch.in_flight() {
            (0, _) => out += "nothing in the copy engines; ",
            (n, Some(age)) => {
                out += &format!("{n} operations in the copy engines, the oldest for {age:?}; ");
                if age > std::time::Duration::from_secs(1) {
                    // Copies take microseconds; one queued this long waits for other work.
                    out += "copies this old wait behind other GPU work, as when a copy stream \
                            shares a hardware queue with the waiting kernel (raise \
                            CUDA_DEVICE_MAX_CONNECTIONS, up to 32); ";
                }
            }
            (n, None) => out += &format!("{n} operations in the copy engines; "),
        }
        let in_call = watch.in_call();
        let longest = watch.longest();
        if let Some((call, waited)) = in_call {
            out += &format!("its thread has been inside {call} for {waited:?}; ");
        }
        if let Some((call, took)) = longest {
            out += &format!("its longest driver call was {call} ({took:?})");
        }
        if let Some(hint) = blocked_copy_hint(in_call.into_iter().chain(longest)) {
            out += "; ";
            out += hint;
        }
        for (call, n, total) in watch.totals() {
            out += &format!("; {n} x {call} in {total:?}");
        }
        let (hand_overs, copies) = watch.hand_overs();
        if hand_overs > 0 {
            out += &format!("; {copies} copies handed to the driver in {hand_overs} hand-overs");
            let k = watch.copy_kinds();
            out += &format!(
                " ({} of signal words, {} of data under {} bytes, {} larger; {} copies merged \
                 into a pending one when pushed, {} before a hand-over)",
                k.signal,
                k.small,
                crate::CopyKinds::SMALL,
                k.large,
                k.merged_at_push,
                k.merged_at_hand_over
            );
        }
        let (seen, total, longest) = watch.completions();
        if seen > 0 {
            out += &format!(
                "; {seen} events seen complete {:?} after their record on average (longest \
                 {longest:?})",
                total / seen.min(u32::MAX as u64) as u32
            );
        }
        out
    }

    /// The proxy's report once it has stopped: its counts, or the error it stopped on.
    pub(crate) fn report(&self) -> Option<Result<ProxyReport, String>> {
        self.last_report.lock().ok().and_then(|r| r.clone())
    }

    /// `SymmetricMemory::backend_failure`: why the proxy thread stopped, with what it had
    /// taken and completed (a stopped thread is joined here to read its error).
    pub(crate) fn failure(&self) -> Option<String> {
        let finished = self
            .proxy
            .lock()
            .ok()
            .is_some_and(|p| p.as_ref().is_some_and(Proxy::is_finished));
        if finished {
            self.stop();
        }
        let word = |offset: usize| self.ring_host.load_u64(offset / 8).unwrap_or(0);
        let mut ring = format!(
            "the proxy had taken {} descriptors and completed {}",
            word(ring::OFFSET_TAIL),
            word(ring::OFFSET_COMPLETED),
        );
        let calls = self.driver_calls();
        if !calls.is_empty() {
            ring += "; ";
            ring += &calls;
        }
        match self.report() {
            Some(Err(e)) => Some(format!("the proxy thread stopped: {e} ({ring})")),
            Some(Ok(_)) if finished => Some(format!("the proxy thread stopped ({ring})")),
            _ => Some(format!("the proxy thread is running; {ring}")),
        }
    }
}

/// What a copy call of the proxy thread lasting over a second means (`calls`: the call in
/// progress and the longest one, with their durations), or None. A copy call returns in
/// microseconds unless another thread of the process holds the driver in a synchronous copy
/// that waits for the very op this proxy serves (measured: docs/proxy.md, "a blocking copy in
/// another thread stalls the proxy").
fn blocked_copy_hint(
    calls: impl IntoIterator<Item = (&'static str, std::time::Duration)>,
) -> Option<&'static str> {
    calls
        .into_iter()
        .any(|(call, took)| {
            call.starts_with("cuMemcpy") && took > std::time::Duration::from_secs(1)
        })
        .then_some(
            "a copy call this long waited inside the driver for another thread of this process, \
             one in a synchronous CUDA copy (to pageable host memory: tensor.cpu(), .item(), \
             cudaMemcpy) that waits for this op; let the op finish first (synchronize the \
             buffer or poll an event after it) before such a copy",
        )
}

impl Drop for ProxyCore {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::blocked_copy_hint;

    #[test]
    fn a_copy_call_over_a_second_names_the_blocking_copy_of_another_thread() {
        let ms = Duration::from_millis;
        // The measured stall: one cuMemcpyAsync as long as the op timeout.
        let hint = blocked_copy_hint([("cuMemcpyAsync", ms(20_000))]).unwrap();
        assert!(hint.contains("another thread") && hint.contains("tensor.cpu()"));
        // The batch call too, in progress rather than finished.
        assert!(blocked_copy_hint([("cuMemcpyBatchAsync", ms(1_500))]).is_some());
        // Copies of normal length, and other long calls (their own causes), say nothing.
        assert!(blocked_copy_hint([("cuMemcpyAsync", ms(3))]).is_none());
        assert!(blocked_copy_hint([("cuEventQuery", ms(5_000))]).is_none());
        assert!(blocked_copy_hint([]).is_none());
    }
}
