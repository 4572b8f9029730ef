//! The ring with real threads: ordering across wrap-around, back-pressure when full, typed
//! timeouts, the status words, and many producers claiming positions from a shared counter
//! (the GPU producer's protocol) written through the raw layout.
#![cfg(not(loom))]

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use epcomm_proxy::{RawDescriptor, RingError, RingMemory, ring};

const LONG: Duration = Duration::from_secs(20);

fn raw(n: u64) -> RawDescriptor {
    RawDescriptor {
        kind: 1,
        flags: 0,
        peer: (n % 7) as u32,
        arg0: n,
        arg1: n.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        arg2: !n,
    }
}

#[test]
fn producer_and_consumer_threads_keep_order_across_many_wraps() {
    const N: u64 = 100_000;
    let (mut producer, mut consumer) = ring::split(RingMemory::allocate(8).expect("ring"));
    let writer = thread::spawn(move || {
        for n in 0..N {
            assert_eq!(producer.push_raw(&raw(n), LONG), Ok(n));
        }
        producer
    });
    for n in 0..N {
        let (position, got) = consumer.pop(LONG).expect("pop");
        assert_eq!((position, got), (n, raw(n)));
    }
    let producer = writer.join().expect("producer");
    assert_eq!((producer.head(), consumer.tail()), (N, N));
}

#[test]
fn a_full_ring_pushes_back_until_a_slot_is_taken() {
    let (mut producer, mut consumer) = ring::split(RingMemory::allocate(4).expect("ring"));
    for n in 0..4 {
        assert_eq!(producer.try_push_raw(&raw(n)), Ok(Some(n)));
    }
    assert_eq!(producer.try_push_raw(&raw(4)), Ok(None));
    match producer.push_raw(&raw(4), Duration::from_millis(20)) {
        Err(RingError::Full {
            capacity: 4,
            head: 4,
            tail: 0,
            waited,
        }) => assert!(waited >= Duration::from_millis(20)),
        other => panic!("expected Full, got {other:?}"),
    }
    // A consumer that frees one slot later unblocks a waiting producer.
    let reader = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        let first = consumer.pop(LONG).expect("pop");
        (consumer, first)
    });
    assert_eq!(producer.push_raw(&raw(4), LONG), Ok(4));
    let (mut consumer, first) = reader.join().expect("consumer");
    assert_eq!(first, (0, raw(0)));
    for n in 1..5 {
        assert_eq!(consumer.try_pop(), Ok(Some((n, raw(n)))));
    }
    assert_eq!(consumer.try_pop(), Ok(None));
}

#[test]
fn waits_are_bounded_and_typed() {
    let (producer, mut consumer) = ring::split(RingMemory::allocate(2).expect("ring"));
    assert!(matches!(
        consumer.pop(Duration::from_millis(10)),
        Err(RingError::Empty { position: 0, .. })
    ));
    assert!(matches!(
        producer.wait_completed(1, Duration::from_millis(10)),
        Err(RingError::CompletionTimeout {
            target: 1,
            completed: 0,
            ..
        })
    ));
    consumer.publish_completed(3);
    consumer.publish_completed(2); // counts never go back
    assert_eq!(producer.completed(), 3);
    assert_eq!(producer.wait_completed(3, Duration::ZERO), Ok(()));
}

#[test]
fn a_stopped_consumer_ends_the_producers_waits() {
    let (producer, consumer) = ring::split(RingMemory::allocate(2).expect("ring"));
    consumer.publish_completed(0);
    let waiter = thread::spawn(move || {
        let r = producer.wait_completed(1, LONG);
        (producer, r)
    });
    thread::sleep(Duration::from_millis(20));
    consumer.close();
    let (mut producer, r) = waiter.join().expect("waiter");
    assert_eq!(r, Err(RingError::Closed { position: 1 }));
    assert_eq!(
        producer.try_push_raw(&raw(0)),
        Err(RingError::Closed { position: 0 })
    );
    consumer.fail();
    assert_eq!(
        producer.push_raw(&raw(0), LONG),
        Err(RingError::ProxyFailed { position: 0 })
    );
}

#[test]
fn a_ring_over_a_caller_region_and_a_corrupt_tag() {
    #[repr(C, align(64))]
    struct Region([u8; 320 + 4 * 64]);
    let mut region = Region([0xFF; 320 + 4 * 64]);
    let base = region.0.as_mut_ptr();
    // SAFETY: `region` outlives the ring ends (dropped at the end of this test, after them)
    // and is touched only through them, except for the deliberate corruption below, done
    // while no other thread uses the ring.
    let memory = unsafe { RingMemory::from_raw(base, 320 + 4 * 64, 4) }.expect("ring");
    let (mut producer, mut consumer) = ring::split(memory);
    assert_eq!(producer.try_push_raw(&raw(0)), Ok(Some(0)));
    assert_eq!(consumer.try_pop(), Ok(Some((0, raw(0)))));
    // Slot 1 gets a tag no producer can write for descriptor 1 (it would be 2).
    // SAFETY: slot 1's tag word is 8-aligned inside the region; no thread races this write.
    unsafe { base.add(320 + 64).cast::<u64>().write_volatile(7) };
    assert_eq!(
        consumer.try_pop(),
        Err(RingError::CorruptSlot {
            position: 1,
            slot: 1,
            found: 7
        })
    );
    drop((producer, consumer));
}

/// The GPU producer's protocol over the raw ring layout (what `abi.cuh` mirrors): a thread
/// claims position `p` from a counter outside the ring, waits until `p - tail < capacity`
/// (acquire), writes the four words (relaxed), stores `seq = p + 1` (release). `head` is never
/// written.
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
fn many_producers_claiming_positions_are_consumed_once_in_position_order() {
    const THREADS: u64 = 8;
    const PER_THREAD: u64 = 5_000;
    let memory = RingMemory::allocate(8).expect("ring");
    let raw = RawProducer {
        base: memory.as_ptr() as usize,
        capacity: memory.capacity(),
    };
    // The host producer end is never used to push; it keeps the region alive.
    let (host_end, mut consumer) = ring::split(memory);
    let next = AtomicU64::new(0);
    let total = THREADS * PER_THREAD;
    let seen = thread::scope(|s| {
        for t in 0..THREADS {
            let (raw, next) = (&raw, &next);
            s.spawn(move || {
                for k in 0..PER_THREAD {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    // Thread, its own count, and the position: every word checkable.
                    let d = RawDescriptor {
                        kind: 1,
                        flags: 0,
                        peer: t as u32,
                        arg0: k,
                        arg1: p,
                        arg2: !p,
                    };
                    if k % 5 == t % 5 {
                        thread::yield_now(); // publish out of position order now and then
                    }
                    raw.publish(p, &d);
                }
            });
        }
        let mut seen = HashSet::new();
        let mut last = vec![None::<u64>; THREADS as usize];
        for n in 0..total {
            let (position, d) = consumer.pop(LONG).expect("pop");
            assert_eq!(position, n);
            assert_eq!((d.arg1, d.arg2), (n, !n), "slot of {n} read torn or stale");
            // Each thread claims increasing positions, so its own count increases.
            let prev = &mut last[d.peer as usize];
            assert!(prev.is_none_or(|k| k < d.arg0), "{d:?} after {prev:?}");
            *prev = Some(d.arg0);
            assert!(seen.insert((d.peer, d.arg0)), "{d:?} seen twice");
        }
        seen
    });
    assert_eq!(seen.len() as u64, total);
    assert_eq!(consumer.try_pop(), Ok(None));
    assert_eq!(consumer.tail(), total);
    // Nothing wrote `head`, and the consumer never needed it.
    assert_eq!(raw.word(ring::OFFSET_HEAD).load(Ordering::Relaxed), 0);
    assert_eq!(host_end.head(), 0);
}
