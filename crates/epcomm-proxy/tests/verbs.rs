//! The verbs executor: what runs anywhere (configuration rules, the typed "no RDMA device"
//! error on a machine without one), and, ignored, a loopback over a real device.
//!
//! The ignored tests need an RDMA device with an active port (a NIC, or Soft-RoCE on any
//! Ethernet interface: `sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev
//! <if>`), then:
//!
//! ```sh
//! EPCOMM_VERBS_DEVICE=rxe0 cargo test -p epcomm-proxy --features verbs --test verbs -- --ignored
//! ```
//!
//! `EPCOMM_VERBS_DEVICE` picks the device (default: the first with an active port);
//! `EPCOMM_VERBS_GID_INDEX` a GID index (default: the first RoCE v2 GID). See
//! docs/proxy-verbs.md.
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use epcomm_proxy::verbs::{
    DeviceSelector, GidSelector, HeapMemory, LoadError, PreparedVerbs, VerbsConfig, VerbsError,
    VerbsExecutor, VerbsOpError,
};
use epcomm_proxy::{Executor, OpId, Signal, SignalOp, Source, Submit, Transfer, Write, WriteWidth};

/// A host buffer of `bytes` bytes (8-byte aligned, zeroed).
fn buffer(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes / 8]
}

fn heap_of(buf: &mut [u64]) -> HeapMemory {
    HeapMemory::Address {
        addr: buf.as_mut_ptr() as u64,
        bytes: (buf.len() * 8) as u64,
    }
}

#[test]
fn configuration_rules_name_the_argument() {
    let mut buf = buffer(4096);
    let good = VerbsConfig::new(0, 2, heap_of(&mut buf));
    assert!(good.validate().is_ok());
    let cases: Vec<(VerbsConfig, &str)> = vec![
        (
            VerbsConfig {
                world: 0,
                ..good.clone()
            },
            "world",
        ),
        (
            VerbsConfig {
                rank: 2,
                ..good.clone()
            },
            "rank",
        ),
        (
            VerbsConfig {
                heap: HeapMemory::Address { addr: 0, bytes: 64 },
                ..good.clone()
            },
            "heap",
        ),
        (
            VerbsConfig {
                heap: HeapMemory::Address { addr: 64, bytes: 0 },
                ..good.clone()
            },
            "heap",
        ),
        (
            VerbsConfig {
                send_queue_depth: 0,
                ..good.clone()
            },
            "send_queue_depth",
        ),
        (
            VerbsConfig {
                signal_every: 0,
                ..good.clone()
            },
            "signal_every",
        ),
        (
            VerbsConfig {
                max_inline: 4,
                ..good.clone()
            },
            "max_inline",
        ),
        (
            VerbsConfig {
                mtu: Some(6),
                ..good.clone()
            },
            "mtu",
        ),
        (
            VerbsConfig {
                timeout: 32,
                ..good.clone()
            },
            "timeout",
        ),
        (
            VerbsConfig {
                retry_cnt: 8,
                ..good.clone()
            },
            "retry_cnt",
        ),
    ];
    for (config, argument) in cases {
        // SAFETY: validation fails before anything is registered.
        match unsafe { PreparedVerbs::prepare(config) } {
            Err(VerbsError::Config { argument: a, .. }) => assert_eq!(a, argument),
            other => panic!("{argument}: expected Config, got {other:?}"),
        }
    }
    let msg = VerbsConfig { rank: 5, ..good }
        .validate()
        .expect_err("rank")
        .to_string();
    assert_eq!(
        msg,
        "verbs executor argument `rank` is 5: must be less than world"
    );
}

/// On a machine without an RDMA device the executor is the typed `NoDevice` error (and on one
/// without libibverbs, the loader's `NotFound`); with a device it builds (the all-gather of a
/// world of one is this rank's record).
#[test]
fn building_without_a_device_is_no_device() {
    let mut buf = buffer(4096);
    let config = VerbsConfig::new(0, 1, heap_of(&mut buf));
    // SAFETY: `buf` outlives the executor (dropped at the end of this function, before `buf`).
    let built =
        unsafe { VerbsExecutor::new(config, |mine| Ok::<_, VerbsError>(vec![mine.to_vec()])) };
    expect_no_device(built);
}

/// `built` is the typed `NoDevice` error (or libibverbs is missing, or a device is present:
/// said, not checked).
fn expect_no_device(built: Result<VerbsExecutor, VerbsError>) {
    match built {
        Err(e @ VerbsError::NoDevice { .. }) => {
            let msg = e.to_string();
            assert!(msg.starts_with("no RDMA device: "), "{msg}");
            eprintln!("{msg}");
        }
        Err(VerbsError::Load(LoadError::NotFound { .. })) => {
            eprintln!("libibverbs is not installed: nothing else to check here");
        }
        Ok(executor) => eprintln!(
            "an RDMA device is present ({}): run the ignored tests",
            executor.device()
        ),
        Err(other) => panic!("expected NoDevice, got {other}"),
    }
}

/// Choosing the device nearest a GPU goes through the same enumeration: without an RDMA device
/// it is the same typed `NoDevice` error, whatever the bus id (one sysfs does not have).
#[test]
fn nearest_to_a_gpu_without_a_device_is_no_device() {
    let mut buf = buffer(4096);
    let mut config = VerbsConfig::new(0, 1, heap_of(&mut buf));
    config.device = DeviceSelector::NearestTo("0000:ff:1f.0".into());
    // SAFETY: `buf` outlives the executor (dropped at the end of this function, before `buf`).
    let built =
        unsafe { VerbsExecutor::new(config, |mine| Ok::<_, VerbsError>(vec![mine.to_vec()])) };
    expect_no_device(built);
}

/// The device and GID selectors from the environment (see the module docs).
fn device_config(rank: u32, world: u32, heap: HeapMemory) -> VerbsConfig {
    let mut config = VerbsConfig::new(rank, world, heap);
    if let Ok(name) = std::env::var("EPCOMM_VERBS_DEVICE") {
        config.device = DeviceSelector::Name(name);
    }
    if let Some(i) = std::env::var("EPCOMM_VERBS_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.gid = GidSelector::Index(i);
    }
    config
}

/// Two executors in one process, ranks 0 and 1 of a world of two, connected through their
/// records (what a bootstrap all-gather would return).
fn pair(
    heap0: HeapMemory,
    heap1: HeapMemory,
    depth: u32,
) -> Result<(VerbsExecutor, VerbsExecutor), VerbsError> {
    let mut c0 = device_config(0, 2, heap0);
    let mut c1 = device_config(1, 2, heap1);
    c0.send_queue_depth = depth;
    c1.send_queue_depth = depth;
    c0.signal_every = 4;
    c1.signal_every = 4;
    // SAFETY: the callers keep both buffers alive until the executors are dropped.
    let (p0, p1) = unsafe { (PreparedVerbs::prepare(c0)?, PreparedVerbs::prepare(c1)?) };
    let records = vec![p0.endpoint_bytes(), p1.endpoint_bytes()];
    Ok((p0.connect(&records)?, p1.connect(&records)?))
}

/// Polls until every op of `want` is reported, in this order, or 10 s pass.
fn wait_for(executor: &mut VerbsExecutor, want: &[OpId]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    while done.len() < want.len() {
        executor.poll(&mut done).expect("poll");
        assert!(
            Instant::now() < deadline,
            "only {done:?} of {want:?} completed in 10 s"
        );
        std::thread::yield_now();
    }
    assert_eq!(done, want);
}

fn read(buf: &[u64], byte: usize) -> u64 {
    // SAFETY: in bounds and aligned; volatile because the NIC wrote it behind the compiler.
    unsafe { std::ptr::read_volatile(buf.as_ptr().add(byte / 8)) }
}

#[test]
#[ignore = "needs an RDMA device (see docs/proxy-verbs.md)"]
fn verbs_loopback_transfer_write_signal() {
    let mut b0 = buffer(1 << 16);
    let mut b1 = buffer(1 << 16);
    for (i, w) in b0.iter_mut().enumerate().take(64) {
        *w = 0x0101_0101_0101_0101 * (i as u64 + 1);
    }
    let mut extra = buffer(4096);
    extra[0] = 0xfeed_face_cafe_beef;
    let (mut e0, _e1) = pair(heap_of(&mut b0), heap_of(&mut b1), 64).expect("device");
    // SAFETY: `extra` outlives `e0` (declared before it).
    unsafe { e0.register_source(extra.as_mut_ptr() as u64, 4096) }.expect("register");
    let t = Transfer {
        peer: 1,
        src: Source::Heap(0),
        dst_offset: 1024,
        bytes: 512,
    };
    assert_eq!(
        e0.submit_transfer(1, &t).expect("transfer"),
        Submit::Accepted
    );
    let w = Write {
        peer: 1,
        offset: 4096,
        value: 0xdead_beef,
        width: WriteWidth::Four,
        count: 1,
    };
    assert_eq!(e0.submit_write(2, &w).expect("write"), Submit::Accepted);
    let from_extra = Transfer {
        peer: 1,
        src: Source::Address(extra.as_ptr() as u64),
        dst_offset: 8192,
        bytes: 8,
    };
    assert_eq!(
        e0.submit_transfer(3, &from_extra).expect("address"),
        Submit::Accepted
    );
    let add = Signal {
        peer: 1,
        offset: 8,
        value: 5,
        op: SignalOp::Add,
        words: 1,
    };
    assert_eq!(e0.submit_signal(4, &add).expect("signal"), Submit::Accepted);
    assert_eq!(e0.submit_signal(5, &add).expect("signal"), Submit::Accepted);
    wait_for(&mut e0, &[1, 2, 3, 4, 5]);
    for i in 0..64 {
        assert_eq!(
            read(&b1, 1024 + i * 8),
            0x0101_0101_0101_0101 * (i as u64 + 1)
        );
    }
    assert_eq!(read(&b1, 4096) & 0xffff_ffff, 0xdead_beef);
    assert_eq!(read(&b1, 8192), 0xfeed_face_cafe_beef);
    assert_eq!(read(&b1, 8), 10, "two ADDs of 5");
    // A SET resets the shadow; the next ADD continues from it.
    let set = Signal {
        op: SignalOp::Set,
        value: 100,
        ..add
    };
    e0.submit_signal(6, &set).expect("set");
    e0.submit_signal(7, &add).expect("add");
    wait_for(&mut e0, &[6, 7]);
    assert_eq!(read(&b1, 8), 105);
    // An address outside every registered region is refused, naming peer and address.
    let outside = Transfer {
        src: Source::Address(0x10),
        ..from_extra
    };
    let err = e0.submit_transfer(8, &outside).expect_err("unregistered");
    let reason = err.reason.downcast_ref::<VerbsOpError>().expect("typed");
    assert!(
        matches!(
            reason,
            VerbsOpError::SourceNotRegistered {
                peer: 1,
                address: 0x10,
                ..
            }
        ),
        "{reason}"
    );
    drop(e0);
}

#[test]
#[ignore = "needs an RDMA device (see docs/proxy-verbs.md)"]
fn verbs_loopback_full_send_queue_is_busy_then_drains() {
    let mut b0 = buffer(1 << 16);
    let mut b1 = buffer(1 << 16);
    let (mut e0, _e1) = pair(heap_of(&mut b0), heap_of(&mut b1), 8).expect("device");
    let mut accepted = Vec::new();
    for op in 0..32u64 {
        let w = Write {
            peer: 1,
            offset: op * 8,
            value: op + 1,
            width: WriteWidth::Eight,
            count: 1,
        };
        match e0.submit_write(op, &w).expect("write") {
            Submit::Accepted => accepted.push(op),
            Submit::Busy => break,
        }
    }
    assert_eq!(accepted.len(), 8, "depth 8: the ninth is Busy");
    wait_for(&mut e0, &accepted);
    for (i, _) in accepted.iter().enumerate() {
        assert_eq!(read(&b1, i * 8), i as u64 + 1);
    }
    // Slots are free again.
    let w = Write {
        peer: 0,
        offset: 0,
        value: 7,
        width: WriteWidth::Eight,
        count: 1,
    };
    assert_eq!(e0.submit_write(100, &w).expect("self"), Submit::Accepted);
    wait_for(&mut e0, &[100]);
    assert_eq!(read(&b0, 0), 7, "rank 0's queue pair to itself");
}

/// A region registered through the executor's `SourceRegistry` from another thread (what the
/// transport does for the caller's arrays while the executor runs on the proxy's thread) is a
/// valid source for the next transfer; once removed, the next transfer from it is refused.
#[test]
#[ignore = "needs an RDMA device (see docs/proxy-verbs.md)"]
fn verbs_loopback_sources_registered_from_another_thread() {
    let mut b0 = buffer(1 << 16);
    let mut b1 = buffer(1 << 16);
    let mut caller = buffer(4096);
    caller[3] = 0x1234_5678_9abc_def0;
    let (mut e0, _e1) = pair(heap_of(&mut b0), heap_of(&mut b1), 64).expect("device");
    let registry = e0.source_registry();
    let (addr, bytes) = (caller.as_mut_ptr() as u64, 4096u64);
    let key = std::thread::spawn(move || {
        // SAFETY: `caller` outlives `e0` and the registry (declared before both).
        unsafe { registry.register(addr, bytes) }.expect("register")
    })
    .join()
    .expect("registering thread");
    assert!(e0.source_registry().regions().contains(&(addr, bytes)));
    let t = Transfer {
        peer: 1,
        src: Source::Address(addr + 24),
        dst_offset: 2048,
        bytes: 8,
    };
    assert_eq!(
        e0.submit_transfer(1, &t).expect("transfer"),
        Submit::Accepted
    );
    wait_for(&mut e0, &[1]);
    assert_eq!(read(&b1, 2048), 0x1234_5678_9abc_def0);
    assert!(e0.source_registry().remove(key));
    assert!(!e0.source_registry().remove(key), "removed once");
    let err = e0.submit_transfer(2, &t).expect_err("removed");
    let reason = err.reason.downcast_ref::<VerbsOpError>().expect("typed");
    assert!(
        matches!(reason, VerbsOpError::SourceNotRegistered { peer: 1, .. }),
        "{reason}"
    );
}
