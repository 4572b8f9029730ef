//! In-process tests: every rank is a thread with its own `Bootstrap` over 127.0.0.1.

use std::io::Write;
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use epcomm_bootstrap::launch::free_port;
use epcomm_bootstrap::{
    Bootstrap, BootstrapConfig, BootstrapError, Identity, Liveness, OpKind, PROTOCOL_VERSION,
};

const TIMEOUT: Duration = Duration::from_millis(1000);

fn cfg(port: u16, rank: usize, world_size: usize) -> BootstrapConfig {
    BootstrapConfig::single_host(port, rank, world_size, TIMEOUT)
}

/// Runs `f(rank, connect result)` on one thread per entry of `ranks` and returns the results in
/// the same order.
fn run<T: Send + 'static>(
    world_size: usize,
    ranks: &[usize],
    f: impl Fn(usize, Result<Bootstrap, BootstrapError>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port().unwrap();
    let handles: Vec<_> = ranks
        .iter()
        .map(|&rank| {
            let f = f.clone();
            thread::spawn(move || f(rank, Bootstrap::connect(cfg(port, rank, world_size))))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

#[test]
fn bootstrap_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Bootstrap>();
}

#[test]
fn single_rank_group_works() {
    let out = run(1, &[0], |_, bs| {
        let bs = bs.unwrap();
        assert_eq!(bs.all_gather("a", b"xyz").unwrap(), vec![b"xyz".to_vec()]);
        assert_eq!(bs.broadcast("b", 0, Some(b"q")).unwrap(), b"q");
        bs.barrier("c").unwrap();
        // Local argument errors consume no round: the next call still works.
        assert!(matches!(
            bs.broadcast("d", 1, Some(b"q")),
            Err(BootstrapError::InvalidArgument {
                argument: "root",
                ..
            })
        ));
        assert!(matches!(
            bs.broadcast("d", 0, None),
            Err(BootstrapError::InvalidArgument {
                argument: "data",
                ..
            })
        ));
        assert!(matches!(
            bs.barrier(&"t".repeat(5000)),
            Err(BootstrapError::InvalidArgument {
                op: OpKind::Barrier,
                argument: "tag",
                ..
            })
        ));
        assert_eq!(bs.all_gather("e", &[]).unwrap(), vec![Vec::<u8>::new()]);
        true
    });
    assert_eq!(out, vec![true]);
}

#[test]
fn all_gather_with_large_and_empty_contributions() {
    let out = run(3, &[0, 1, 2], |rank, bs| {
        let bs = bs.unwrap();
        let mine = if rank == 1 {
            Vec::new()
        } else {
            vec![rank as u8; 300_000 * (rank + 1)]
        };
        let all = bs.all_gather("big", &mine).unwrap();
        all.iter().map(Vec::len).collect::<Vec<_>>()
    });
    for lens in out {
        assert_eq!(lens, vec![300_000, 0, 900_000]);
    }
}

#[test]
fn mismatched_calls_fail_the_round_on_every_rank() {
    let out = run(2, &[0, 1], |rank, bs| {
        let bs = bs.unwrap();
        let err = if rank == 0 {
            bs.barrier("x").unwrap_err()
        } else {
            bs.all_gather("y", b"1").unwrap_err()
        };
        match err {
            BootstrapError::OpMismatch {
                round: 1,
                rank_a,
                rank_b,
                call_a,
                call_b,
            } => {
                assert_ne!(rank_a, rank_b);
                let calls = [call_a, call_b].join(" ");
                assert!(
                    calls.contains("barrier") && calls.contains("all_gather"),
                    "{calls}"
                );
            }
            other => panic!("expected OpMismatch, got {other}"),
        }
        // The group continues with the next round.
        bs.barrier("after").unwrap();
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn op_timeout_names_late_rank_and_late_rank_gets_same_error() {
    let out = run(3, &[0, 1, 2], |rank, bs| {
        let bs = bs.unwrap();
        if rank == 2 {
            thread::sleep(TIMEOUT + Duration::from_millis(300));
        }
        let start = Instant::now();
        let err = bs.barrier("slow").unwrap_err();
        match err {
            BootstrapError::Timeout {
                op: OpKind::Barrier,
                tag,
                round: 1,
                missing_ranks,
                ..
            } => {
                assert_eq!(tag, "slow");
                assert_eq!(missing_ranks, vec![2]);
            }
            other => panic!("rank {rank}: expected Timeout naming rank 2, got {other}"),
        }
        let waited = start.elapsed();
        if rank == 2 {
            assert!(
                waited < Duration::from_millis(300),
                "late rank not told at once: {waited:?}"
            );
        } else {
            assert!(waited >= TIMEOUT - Duration::from_millis(50), "{waited:?}");
            assert!(waited < TIMEOUT + Duration::from_millis(500), "{waited:?}");
        }
        // Rounds stay aligned after a failed round.
        let all = bs.all_gather("next", &[rank as u8]).unwrap();
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
    });
    assert_eq!(out.len(), 3);
}

#[test]
fn peer_that_leaves_is_reported_as_left() {
    let out = run(2, &[0, 1], |rank, bs| {
        let bs = bs.unwrap();
        bs.barrier("both").unwrap();
        if rank == 1 {
            drop(bs);
            return;
        }
        match bs.barrier("alone").unwrap_err() {
            BootstrapError::PeerLeft {
                rank: 1,
                op: OpKind::Barrier,
                ..
            } => {}
            other => panic!("expected PeerLeft naming rank 1, got {other}"),
        }
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn coordinator_leaving_is_reported_to_others() {
    let out = run(2, &[0, 1], |rank, bs| {
        let bs = bs.unwrap();
        bs.barrier("both").unwrap();
        if rank == 0 {
            drop(bs);
            return;
        }
        thread::sleep(Duration::from_millis(100));
        match bs.all_gather("alone", b"z").unwrap_err() {
            BootstrapError::PeerLeft { rank: 0, .. } | BootstrapError::PeerDied { rank: 0, .. } => {
            }
            other => panic!("expected rank 0 gone, got {other}"),
        }
        // The connection is unusable from now on.
        assert!(matches!(
            bs.barrier("again"),
            Err(BootstrapError::ConnectionBroken { .. })
        ));
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn duplicate_rank_fails_the_rendezvous_for_everyone() {
    let out = run(3, &[0, 1, 1], |_, bs| match bs.unwrap_err() {
        BootstrapError::DuplicateRank {
            rank: 1,
            first,
            second,
        } => {
            assert!(first.starts_with("127.0.0.1:") && second.starts_with("127.0.0.1:"));
            assert_ne!(first, second);
        }
        other => panic!("expected DuplicateRank 1, got {other}"),
    });
    assert_eq!(out.len(), 3);
}

#[test]
fn protocol_version_mismatch_names_both_versions() {
    let port = free_port().unwrap();
    let peer = thread::spawn(move || {
        let identity = Identity {
            protocol_version: PROTOCOL_VERSION + 1,
            ..Identity::current()
        };
        Bootstrap::connect_with_identity(cfg(port, 1, 2), identity).unwrap_err()
    });
    let coordinator_err = Bootstrap::connect(cfg(port, 0, 2)).unwrap_err();
    for err in [coordinator_err, peer.join().unwrap()] {
        match err {
            BootstrapError::ProtocolVersionMismatch {
                coordinator,
                peer,
                peer_rank: 1,
            } => {
                assert_eq!(
                    (coordinator, peer),
                    (PROTOCOL_VERSION, PROTOCOL_VERSION + 1)
                );
            }
            other => panic!("expected ProtocolVersionMismatch, got {other}"),
        }
    }
}

#[test]
fn strangers_do_not_disturb_the_group() {
    let port = free_port().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|rank| thread::spawn(move || Bootstrap::connect(cfg(port, rank, 2))))
        .collect();
    // Connect a few non-epcomm clients while the group forms.
    let deadline = Instant::now() + TIMEOUT;
    let mut strangers = Vec::new();
    while strangers.len() < 3 && Instant::now() < deadline {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n");
            strangers.push(s);
        } else {
            thread::sleep(Duration::from_millis(5));
        }
    }
    let group: Vec<Bootstrap> = ranks
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let both = thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|b| s.spawn(|| b.barrier("ok"))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(both.iter().all(Result::is_ok), "{both:?}");
}

#[test]
fn connect_without_coordinator_times_out() {
    let port = free_port().unwrap();
    let start = Instant::now();
    match Bootstrap::connect(cfg(port, 1, 2)).unwrap_err() {
        BootstrapError::ConnectTimeout {
            addr, last_error, ..
        } => {
            assert_eq!(addr, format!("127.0.0.1:{port}"));
            assert!(!last_error.is_empty());
        }
        other => panic!("expected ConnectTimeout, got {other}"),
    }
    assert!(start.elapsed() < TIMEOUT + Duration::from_millis(500));
}

#[test]
fn invalid_config_is_rejected_before_connecting() {
    let mut c = cfg(1, 2, 2);
    assert!(matches!(
        Bootstrap::connect(c.clone()),
        Err(BootstrapError::InvalidConfig { field: "rank", .. })
    ));
    c.rank = 0;
    c.local_rank = 0;
    c.timeout = Duration::ZERO;
    assert!(matches!(
        Bootstrap::connect(c),
        Err(BootstrapError::InvalidConfig {
            field: "timeout",
            ..
        })
    ));
}

#[test]
fn busy_rank_that_keeps_heartbeating_is_not_declared_dead() {
    // Rank 1 computes for 2.5 peer timeouts before joining the barrier. Its heartbeat thread
    // keeps it alive for the coordinator, and the coordinator's heartbeats keep the waiting
    // ranks patient: the barrier completes (it is bounded only by the 5 s op timeout).
    let liveness = Liveness {
        heartbeat_interval: Duration::from_millis(200),
        peer_timeout: Duration::from_millis(800),
        ..Liveness::default()
    };
    let port = free_port().unwrap();
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            thread::spawn(move || {
                let mut c = cfg(port, rank, 3);
                c.timeout = Duration::from_secs(5);
                let bs = Bootstrap::connect_with_liveness(c, liveness)?;
                if rank == 1 {
                    thread::sleep(Duration::from_millis(2000));
                }
                let start = Instant::now();
                bs.barrier("after-compute")?;
                let waited = start.elapsed();
                let all = bs.all_gather("ids", &[rank as u8])?;
                Ok::<_, BootstrapError>((waited, all))
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (waited, all) = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        if rank != 1 {
            assert!(
                waited >= Duration::from_millis(1000),
                "rank {rank}: {waited:?}"
            );
        }
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
    }
}

#[test]
fn invalid_liveness_is_rejected_before_connecting() {
    let bad = Liveness {
        heartbeat_interval: Duration::from_secs(3),
        peer_timeout: Duration::from_secs(5),
        ..Liveness::default()
    };
    assert!(matches!(
        Bootstrap::connect_with_liveness(cfg(1, 0, 1), bad),
        Err(BootstrapError::InvalidConfig {
            field: "liveness.heartbeat_interval",
            ..
        })
    ));
}
