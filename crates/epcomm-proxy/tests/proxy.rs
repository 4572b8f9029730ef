//! The proxy end to end on the host executor: rows, writes and signals from a producer thread
//! land in the peers' host buffers in order; coalescing, flow control, shutdown, typed failures,
//! and a ring written by many producers that claim positions from a shared counter (as GPU
//! threads do).
#![cfg(not(loom))]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use epcomm_proxy::{
    Descriptor, DescriptorError, Executor, HostError, HostExecutor, HostHeap, Limits, OpFailure,
    OpId, Proxy, ProxyConfig, ProxyError, RawDescriptor, RingError, RingMemory, Signal, SignalOp,
    Source, Submit, Transfer, Write, WriteWidth, ring,
};

const LONG: Duration = Duration::from_secs(20);
const ROW: u64 = 64;
const TOKENS: u64 = 256;
const WORLD: u32 = 4;
const HEAP: usize = 1 << 16;
/// Where the `done` counters live in every buffer: one word per source rank.
const DONE: u64 = 60_000;

fn limits() -> Limits {
    Limits {
        world: WORLD,
        heap_bytes: HEAP as u64,
    }
}

fn transfer(peer: u32, src: u64, dst: u64, bytes: u64) -> Descriptor {
    Descriptor::Transfer(Transfer {
        peer,
        src: Source::Heap(src),
        dst_offset: dst,
        bytes,
    })
}

fn write(peer: u32, offset: u64, value: u64, width: WriteWidth) -> Descriptor {
    Descriptor::Write(Write {
        peer,
        offset,
        value,
        width,
        count: 1,
    })
}

fn add(peer: u32, offset: u64, value: u64) -> Descriptor {
    Descriptor::Signal(Signal {
        peer,
        offset,
        value,
        op: SignalOp::Add,
        words: 1,
    })
}

/// A ring of `slots` and a proxy for rank 0 on `heap` whose executor queues at most `depth`
/// operations, with the default configuration.
fn host_proxy(heap: Arc<HostHeap>, slots: u64, depth: usize) -> (ring::Producer, Proxy) {
    let (producer, consumer) = ring::split(RingMemory::allocate(slots).expect("ring"));
    let proxy = Proxy::spawn(
        consumer,
        HostExecutor::new(heap, 0, depth),
        ProxyConfig::new(limits()),
    )
    .expect("spawn");
    (producer, proxy)
}

/// Rank 0's token rows (token `t`, byte `i` = `t * 7 + i`), and the descriptors of a dispatch:
/// every token to every other rank, row-interleaved across peers, then one `done` add each.
fn dispatch(heap: &HostHeap) -> Vec<Descriptor> {
    for t in 0..TOKENS {
        let row: Vec<u8> = (0..ROW).map(|i| (t * 7 + i) as u8).collect();
        heap.write(0, t * ROW, &row).expect("row");
    }
    let mut out = Vec::new();
    for t in 0..TOKENS {
        for peer in 1..WORLD {
            out.push(transfer(peer, t * ROW, 20_000 + t * ROW, ROW));
        }
    }
    for peer in 1..WORLD {
        out.push(add(peer, DONE, 1));
    }
    out
}

fn check_dispatch(heap: &HostHeap) {
    let sent = heap.read(0, 0, TOKENS * ROW).expect("source");
    for peer in 1..WORLD {
        assert_eq!(heap.word(peer, DONE), Ok(1), "done at {peer}");
        assert_eq!(heap.read(peer, 20_000, TOKENS * ROW).expect("rows"), sent);
    }
}

#[test]
fn a_dispatch_lands_in_order_and_coalesces() {
    let heap = HostHeap::new(WORLD, HEAP);
    let work = dispatch(&heap);
    let (mut producer, consumer) = ring::split(RingMemory::allocate(16).expect("ring"));
    let mut config = ProxyConfig::new(limits());
    config.max_pending = 4; // small: the ring fills and the producer waits
    let proxy =
        Proxy::spawn(consumer, HostExecutor::new(Arc::clone(&heap), 0, 2), config).expect("spawn");
    for d in &work {
        producer.push(d, &limits(), LONG).expect("push");
    }
    producer
        .wait_completed(work.len() as u64, LONG)
        .expect("completed");
    check_dispatch(&heap);
    let report = proxy.shutdown().expect("clean");
    assert_eq!(report.descriptors, work.len() as u64);
    assert_eq!(report.signals, 3);
    assert_eq!(report.bytes, TOKENS * ROW * 3);
    assert!(report.ops < report.descriptors, "{report:?}");
    // Every descriptor was taken in a working round, each of which is timed.
    assert!(
        report.working_rounds > 0 && report.working_ns > 0 && report.loop_ns >= report.working_ns,
        "no working round counted: {report:?}"
    );
    assert!(
        report.working_rounds <= report.descriptors + 2 * report.ops,
        "a working round takes a descriptor, submits an operation or completes one: {report:?}"
    );
    assert!(
        report.busy > 0,
        "the executor's queue of 2 never filled: {report:?}"
    );
}

#[test]
fn a_run_lands_with_one_sequence_write_and_one_signal_over_its_flags() {
    // As a dispatch run and a combine run send them: the rows as one transfer, the source
    // indices t0 .. t0 + len - 1 as one sequence write, the per-row flags as one set over
    // `len` words, which lands after both.
    const LEN: u32 = 40;
    const T0: u64 = 1_000;
    let heap = HostHeap::new(WORLD, HEAP);
    let rows: Vec<u8> = (0..u64::from(LEN) * ROW).map(|i| (i * 3) as u8).collect();
    heap.write(0, 0, &rows).expect("rows");
    let work = [
        transfer(2, 0, 20_000, u64::from(LEN) * ROW),
        Descriptor::Write(Write {
            count: LEN,
            ..Write::one(2, 40_000, T0, WriteWidth::Four)
        }),
        Descriptor::Signal(Signal {
            words: LEN,
            ..Signal::word(2, 50_000, 9, SignalOp::Set)
        }),
    ];
    let (mut producer, proxy) = host_proxy(Arc::clone(&heap), 8, 4);
    for d in &work {
        producer.push(d, &limits(), LONG).expect("push");
    }
    producer.wait_completed(3, LONG).expect("completed");
    assert_eq!(heap.read(2, 20_000, u64::from(LEN) * ROW), Ok(rows));
    let want: Vec<u8> = (T0..T0 + u64::from(LEN))
        .flat_map(|t| (t as u32).to_le_bytes())
        .collect();
    assert_eq!(heap.read(2, 40_000, u64::from(LEN) * 4), Ok(want));
    for j in 0..u64::from(LEN) {
        assert_eq!(heap.word(2, 50_000 + 8 * j), Ok(9), "flag {j}");
    }
    assert_eq!(heap.word(2, 50_000 + 8 * u64::from(LEN)), Ok(0));
    let report = proxy.shutdown().expect("clean");
    assert_eq!(
        (report.descriptors, report.writes, report.signals),
        (3, 1, 1)
    );
}

#[test]
fn a_signal_is_seen_only_after_its_rows() {
    // The reader polls rank 1's `done` word; once it is 1, every row must be there.
    let heap = HostHeap::new(WORLD, HEAP);
    let work = dispatch(&heap);
    let (mut producer, proxy) = host_proxy(Arc::clone(&heap), 64, 8);
    let watcher = {
        let heap = Arc::clone(&heap);
        thread::spawn(move || {
            while heap.word(1, DONE).expect("word") == 0 {
                thread::yield_now();
            }
            let sent = heap.read(0, 0, TOKENS * ROW).expect("source");
            assert_eq!(heap.read(1, 20_000, TOKENS * ROW).expect("rows"), sent);
        })
    };
    for d in &work {
        producer.push(d, &limits(), LONG).expect("push");
    }
    watcher.join().expect("rows before signal");
    proxy.shutdown().expect("clean");
}

#[test]
fn shutdown_while_busy_executes_what_was_published_and_closes_the_ring() {
    let heap = HostHeap::new(WORLD, HEAP);
    let (mut producer, proxy) = host_proxy(Arc::clone(&heap), 8, 1);
    let writer = thread::spawn(move || {
        let mut pushed = 0u64;
        loop {
            match producer.push(&add(1, 0, 1), &limits(), LONG) {
                Ok(_) => pushed += 1,
                Err(RingError::Closed { position }) => {
                    assert_eq!(position, pushed);
                    return (producer, pushed);
                }
                Err(e) => panic!("unexpected: {e}"),
            }
        }
    });
    thread::sleep(Duration::from_millis(50));
    let report = proxy.shutdown().expect("clean");
    let (producer, pushed) = writer.join().expect("writer");
    // Everything taken was executed and published; at most what raced the close is left.
    assert_eq!(heap.word(1, 0), Ok(report.descriptors));
    assert_eq!(producer.completed(), report.descriptors);
    assert!(
        report.descriptors > 0 && pushed - report.descriptors <= 8,
        "{report:?} {pushed}"
    );
}

#[test]
fn an_invalid_descriptor_fails_the_proxy_naming_it() {
    let heap = HostHeap::new(WORLD, HEAP);
    let (mut producer, proxy) = host_proxy(heap, 8, 4);
    let bad = RawDescriptor {
        kind: 1,
        flags: 0,
        peer: 9,
        arg0: 0,
        arg1: 0,
        arg2: 8,
    };
    producer.push_raw(&bad, LONG).expect("push");
    assert_eq!(
        producer.wait_completed(1, LONG),
        Err(RingError::ProxyFailed { position: 1 })
    );
    match proxy.shutdown() {
        Err(ProxyError::Decode {
            position: 0,
            raw,
            source: DescriptorError::PeerOutOfRange { peer: 9, world: 4 },
        }) => assert_eq!(raw, bad),
        other => panic!("expected Decode, got {other:?}"),
    }
}

#[test]
fn an_executor_failure_names_the_peer_and_the_descriptors() {
    // The proxy believes the buffers are 64 KiB; rank 2's host buffer is smaller.
    let heap = HostHeap::new(WORLD, 1024);
    let (mut producer, proxy) = host_proxy(heap, 8, 4);
    producer
        .push(&transfer(1, 0, 0, 8), &limits(), LONG)
        .expect("push");
    producer
        .push(&transfer(2, 0, 4096, 8), &limits(), LONG)
        .expect("push");
    assert!(producer.wait_completed(2, LONG).is_err());
    match proxy.shutdown() {
        Err(e @ ProxyError::Executor { peer: 2, .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("host executor failed"), "{msg}");
            assert!(msg.contains("to peer 2 (ring descriptors [1])"), "{msg}");
            assert!(msg.contains("rank 2: [4096, 4096 + 8) is outside"), "{msg}");
        }
        other => panic!("expected Executor, got {other:?}"),
    }
}

/// The host executor, recording every `progress` call (what an executor that mirrors the
/// ring's progress would write).
struct Recording {
    inner: HostExecutor,
    seen: Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
}

impl Executor for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn submit_transfer(&mut self, op: OpId, t: &Transfer) -> Result<Submit, OpFailure> {
        self.inner.submit_transfer(op, t)
    }
    fn submit_signal(&mut self, op: OpId, s: &Signal) -> Result<Submit, OpFailure> {
        self.inner.submit_signal(op, s)
    }
    fn submit_write(&mut self, op: OpId, w: &Write) -> Result<Submit, OpFailure> {
        self.inner.submit_write(op, w)
    }
    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        self.inner.poll(done)
    }
    fn progress(&mut self, taken: u64, completed: u64, _: OpId) -> Result<(), OpFailure> {
        self.seen.lock().expect("lock").push((taken, completed));
        Ok(())
    }
}

#[test]
fn progress_reports_taken_and_completed_as_they_grow() {
    let heap = HostHeap::new(WORLD, HEAP);
    let work = dispatch(&heap);
    let (mut producer, consumer) = ring::split(RingMemory::allocate(64).expect("ring"));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let executor = Recording {
        inner: HostExecutor::new(Arc::clone(&heap), 0, 4),
        seen: Arc::clone(&seen),
    };
    let proxy = Proxy::spawn(consumer, executor, ProxyConfig::new(limits())).expect("spawn");
    for d in &work {
        producer.push(d, &limits(), LONG).expect("push");
    }
    let n = work.len() as u64;
    producer.wait_completed(n, LONG).expect("completed");
    proxy.shutdown().expect("clean shutdown");
    check_dispatch(&heap);
    let seen = seen.lock().expect("lock");
    // Never more complete than taken, never more taken than pushed, both only grow, and the
    // last report covers everything.
    assert!(seen.iter().all(|&(t, c)| c <= t && t <= n), "{seen:?}");
    assert!(
        seen.windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1)
    );
    assert_eq!(seen.last(), Some(&(n, n)));
}

/// An executor that accepts work and never completes it: a device that stopped answering.
struct Unresponsive;

impl Executor for Unresponsive {
    fn name(&self) -> &str {
        "unresponsive"
    }
    fn submit_transfer(&mut self, _: OpId, _: &Transfer) -> Result<Submit, OpFailure> {
        Ok(Submit::Accepted)
    }
    fn submit_signal(&mut self, _: OpId, _: &Signal) -> Result<Submit, OpFailure> {
        Ok(Submit::Accepted)
    }
    fn submit_write(&mut self, _: OpId, _: &Write) -> Result<Submit, OpFailure> {
        Ok(Submit::Accepted)
    }
    fn poll(&mut self, _: &mut Vec<OpId>) -> Result<(), OpFailure> {
        Ok(())
    }
}

#[test]
fn an_operation_that_never_completes_is_a_typed_timeout() {
    let (mut producer, consumer) = ring::split(RingMemory::allocate(8).expect("ring"));
    let mut config = ProxyConfig::new(limits());
    config.op_timeout = Duration::from_millis(30);
    let proxy = Proxy::spawn(consumer, Unresponsive, config).expect("spawn");
    producer
        .push(&add(3, 16, 1), &limits(), LONG)
        .expect("push");
    assert_eq!(
        producer.wait_completed(1, LONG),
        Err(RingError::ProxyFailed { position: 1 })
    );
    match proxy.shutdown() {
        Err(ProxyError::CompletionTimeout {
            peer: 3,
            positions,
            waited,
            ..
        }) => {
            assert_eq!(positions, [0]);
            assert!(waited >= Duration::from_millis(30));
        }
        other => panic!("expected CompletionTimeout, got {other:?}"),
    }
}

#[test]
fn pinning_to_a_cpu_and_a_cpu_that_does_not_exist() {
    let heap = HostHeap::new(WORLD, HEAP);
    let (mut producer, consumer) = ring::split(RingMemory::allocate(8).expect("ring"));
    let mut config = ProxyConfig::new(limits());
    config.cpu = Some(0);
    let proxy =
        Proxy::spawn(consumer, HostExecutor::new(Arc::clone(&heap), 0, 4), config).expect("spawn");
    producer.push(&add(1, 0, 5), &limits(), LONG).expect("push");
    producer.wait_completed(1, LONG).expect("completed");
    proxy.shutdown().expect("clean");

    let (producer, consumer) = ring::split(RingMemory::allocate(8).expect("ring"));
    let mut config = ProxyConfig::new(limits());
    config.cpu = Some(1 << 20);
    let proxy = Proxy::spawn(consumer, HostExecutor::new(heap, 0, 4), config).expect("spawn");
    assert_eq!(
        producer.wait_completed(1, LONG),
        Err(RingError::ProxyFailed { position: 1 })
    );
    assert!(matches!(
        proxy.shutdown(),
        Err(ProxyError::Pin { cpu: 1_048_576, .. })
    ));
}

#[test]
fn dropping_the_proxy_stops_it_cleanly() {
    let heap = HostHeap::new(WORLD, HEAP);
    let (mut producer, proxy) = host_proxy(Arc::clone(&heap), 8, 4);
    producer.push(&add(2, 8, 1), &limits(), LONG).expect("push");
    drop(proxy);
    assert_eq!(heap.word(2, 8), Ok(1));
    assert_eq!(producer.completed(), 1);
    assert_eq!(
        producer.try_push_raw(&RawDescriptor::default()),
        Err(RingError::Closed { position: 1 })
    );
}

/// Where the per-token scales (4 bytes) and top-k ids (8 bytes) land in every buffer.
const SCALES: u64 = 40_000;
const IDS: u64 = 48_000;

fn scale(t: u64, peer: u32) -> u64 {
    u64::from((t as f32 * 0.5 + peer as f32).to_bits())
}

fn id(t: u64, peer: u32) -> u64 {
    (t << 32) | u64::from(peer) | 1 << 63
}

/// A dispatch with a scale and a top-k id per row, as single-element puts between the rows.
fn dispatch_with_writes(heap: &HostHeap) -> Vec<Descriptor> {
    let rows = dispatch(heap);
    let (rows, signals) = rows.split_at(rows.len() - (WORLD as usize - 1));
    let mut out = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        out.push(*row);
        let (t, peer) = (i as u64 / u64::from(WORLD - 1), row.peer());
        out.push(write(
            peer,
            SCALES + 4 * t,
            scale(t, peer),
            WriteWidth::Four,
        ));
        out.push(write(peer, IDS + 8 * t, id(t, peer), WriteWidth::Eight));
    }
    out.extend_from_slice(signals);
    out
}

fn check_writes(heap: &HostHeap, peer: u32) {
    for t in 0..TOKENS {
        let s = heap.read(peer, SCALES + 4 * t, 4).expect("scale");
        assert_eq!(
            s,
            (scale(t, peer) as u32).to_le_bytes(),
            "scale {t} at {peer}"
        );
        assert_eq!(heap.word(peer, IDS + 8 * t), Ok(id(t, peer)), "id {t}");
    }
}

#[test]
fn writes_between_rows_land_before_the_signal_and_rows_still_merge() {
    let heap = HostHeap::new(WORLD, HEAP);
    let work = dispatch_with_writes(&heap);
    let (mut producer, proxy) = host_proxy(Arc::clone(&heap), 64, 8);
    // Once rank 2's `done` is 1, its rows, scales and ids must all be there.
    let watcher = {
        let heap = Arc::clone(&heap);
        thread::spawn(move || {
            while heap.word(2, DONE).expect("word") == 0 {
                thread::yield_now();
            }
            let sent = heap.read(0, 0, TOKENS * ROW).expect("source");
            assert_eq!(heap.read(2, 20_000, TOKENS * ROW).expect("rows"), sent);
            check_writes(&heap, 2);
        })
    };
    for d in &work {
        producer.push(d, &limits(), LONG).expect("push");
    }
    producer
        .wait_completed(work.len() as u64, LONG)
        .expect("completed");
    watcher.join().expect("writes before signal");
    check_dispatch(&heap);
    for peer in 1..WORLD {
        check_writes(&heap, peer);
    }
    let report = proxy.shutdown().expect("clean");
    assert_eq!(report.descriptors, work.len() as u64);
    assert_eq!(report.writes, 2 * TOKENS * u64::from(WORLD - 1));
    assert_eq!(report.signals, 3);
    assert_eq!(report.bytes, TOKENS * ROW * 3);
    // The writes between rows did not keep the rows from merging.
    assert!(report.transfers < TOKENS * 3, "{report:?}");
}

#[test]
fn an_address_source_fails_the_host_proxy_naming_the_peer_and_descriptor() {
    let heap = HostHeap::new(WORLD, HEAP);
    let (mut producer, proxy) = host_proxy(heap, 8, 4);
    producer.push(&add(1, 0, 1), &limits(), LONG).expect("push");
    let from_device = Descriptor::Transfer(Transfer {
        peer: 3,
        src: Source::Address(0x7f12_3456_0000),
        dst_offset: 128,
        bytes: 64,
    });
    producer.push(&from_device, &limits(), LONG).expect("push");
    assert!(producer.wait_completed(2, LONG).is_err());
    let err = proxy
        .shutdown()
        .expect_err("an address source fails the host proxy");
    let msg = err.to_string();
    assert!(msg.contains("host executor failed"), "{msg}");
    assert!(msg.contains("to peer 3 (ring descriptors [1])"), "{msg}");
    assert!(msg.contains("device address 0x7f1234560000"), "{msg}");
    assert!(msg.contains("reads only offsets in the host heap"), "{msg}");
    match err {
        ProxyError::Executor {
            peer: 3,
            work,
            positions,
            source,
            ..
        } => {
            assert_eq!((work, positions.as_slice()), (from_device, &[1][..]));
            assert_eq!(
                source.downcast_ref::<HostError>(),
                Some(&HostError::AddressSource {
                    address: 0x7f12_3456_0000
                })
            );
        }
        other => panic!("expected Executor, got {other:?}"),
    }
}

/// The GPU producer's protocol over the raw ring layout: claim a position from a shared
/// counter, wait until `p - tail < capacity`, write the words, store `seq = p + 1` with
/// release. `head` is never written.
struct RawProducer {
    base: usize,
    capacity: u64,
}

impl RawProducer {
    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `base` is the start of a live ring region of `region_bytes(capacity)` bytes
        // (the test keeps a ring end alive while producers run), `offset` is 8-aligned inside
        // it, and every access to the region is atomic.
        unsafe { AtomicU64::from_ptr((self.base + offset) as *mut u64) }
    }

    fn publish(&self, p: u64, raw: &RawDescriptor) {
        let start = Instant::now();
        while p - self.word(ring::OFFSET_TAIL).load(Ordering::Acquire) >= self.capacity {
            assert!(start.elapsed() < LONG, "ring full for {LONG:?} at {p}");
            thread::yield_now();
        }
        let slot = ring::HEADER_BYTES + (p & (self.capacity - 1)) as usize * ring::SLOT_BYTES;
        for (i, w) in raw.to_words().into_iter().enumerate() {
            self.word(slot + 8 + 8 * i).store(w, Ordering::Relaxed);
        }
        self.word(slot).store(p + 1, Ordering::Release);
    }
}

#[test]
fn a_ring_written_by_many_producers_is_executed_exactly_once() {
    const THREADS: u64 = 8;
    const PER_THREAD: u64 = 500;
    let heap = HostHeap::new(WORLD, HEAP);
    let memory = RingMemory::allocate(16).expect("ring");
    let raw = RawProducer {
        base: memory.as_ptr() as usize,
        capacity: memory.capacity(),
    };
    // The host producer end only keeps the region alive and reads `completed`.
    let (host_end, consumer) = ring::split(memory);
    let mut config = ProxyConfig::new(limits());
    config.max_pending = 8;
    let proxy =
        Proxy::spawn(consumer, HostExecutor::new(Arc::clone(&heap), 0, 4), config).expect("spawn");
    let next = AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (raw, next) = (&raw, &next);
            s.spawn(move || {
                for k in 0..PER_THREAD {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    let peer = 1 + (k % u64::from(WORLD - 1)) as u32;
                    let d = write(peer, 8 * (t * PER_THREAD + k), p + 1, WriteWidth::Eight);
                    raw.publish(p, &d.encode(&limits()).expect("valid"));
                    if k % 7 == 0 {
                        thread::yield_now(); // publish out of position order now and then
                    }
                }
                // After its writes in ring order: one `done` add per peer.
                for peer in 1..WORLD {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    raw.publish(p, &add(peer, DONE, 1).encode(&limits()).expect("valid"));
                }
            });
        }
    });
    let total = THREADS * (PER_THREAD + u64::from(WORLD - 1));
    host_end.wait_completed(total, LONG).expect("completed");
    assert_eq!(raw.word(ring::OFFSET_HEAD).load(Ordering::Relaxed), 0);
    let mut seen = std::collections::HashSet::new();
    for t in 0..THREADS {
        for k in 0..PER_THREAD {
            let peer = 1 + (k % u64::from(WORLD - 1)) as u32;
            let v = heap.word(peer, 8 * (t * PER_THREAD + k)).expect("word");
            assert!((1..=total).contains(&v), "write {t}/{k}: {v}");
            assert!(seen.insert(v), "position {} written twice", v - 1);
        }
    }
    for peer in 1..WORLD {
        assert_eq!(heap.word(peer, DONE), Ok(THREADS));
    }
    let report = proxy.shutdown().expect("clean");
    assert_eq!(report.descriptors, total);
    assert_eq!(report.writes, THREADS * PER_THREAD);
    assert_eq!(report.signals, THREADS * u64::from(WORLD - 1));
}
