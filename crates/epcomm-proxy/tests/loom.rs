//! The ring protocol under loom: every interleaving of one producer and one consumer (within
//! loom's bounds) delivers every descriptor once, in order, complete — across a wrap-around
//! and through a full ring.
//!
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p epcomm-proxy --release --test loom`
#![cfg(loom)]

use std::time::Duration;

use epcomm_proxy::{RawDescriptor, RingMemory, ring};

fn raw(n: u64) -> RawDescriptor {
    RawDescriptor {
        kind: 1,
        flags: 0,
        peer: n as u32,
        arg0: n + 100,
        arg1: n + 200,
        arg2: n + 300,
    }
}

/// Capacity 2, three descriptors: the third waits for a free slot and reuses slot 0.
#[test]
fn every_descriptor_once_in_order_through_a_full_ring() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::split(RingMemory::allocate(2).expect("ring"));
        let writer = loom::thread::spawn(move || {
            for n in 0..3 {
                assert_eq!(producer.push_raw(&raw(n), Duration::MAX), Ok(n));
            }
        });
        for n in 0..3 {
            assert_eq!(consumer.pop(Duration::MAX), Ok((n, raw(n))));
        }
        writer.join().expect("producer");
    });
}

/// Completions published by the consumer are seen by a waiting producer.
#[test]
fn completions_reach_the_producer() {
    loom::model(|| {
        let (mut producer, mut consumer) = ring::split(RingMemory::allocate(1).expect("ring"));
        let reader = loom::thread::spawn(move || {
            let got = consumer.pop(Duration::MAX).expect("pop");
            consumer.publish_completed(1);
            got
        });
        assert_eq!(producer.push_raw(&raw(7), Duration::MAX), Ok(0));
        assert_eq!(producer.wait_completed(1, Duration::MAX), Ok(()));
        assert_eq!(reader.join().expect("consumer"), (0, raw(7)));
    });
}
