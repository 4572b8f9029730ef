//! Tests of the `proxy-verbs` transport that need no RDMA device (and, where one is present,
//! say so and skip).

use super::*;

fn lookup(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn variables_set_the_device_port_gid_and_registration() {
    let o = VerbsOptions::from_lookup(
        4,
        lookup(&[
            ("EPCOMM_VERBS_DEVICE", " mlx5_1 "),
            ("EPCOMM_VERBS_PORT", "2"),
            ("EPCOMM_VERBS_GID_INDEX", "3"),
            ("EPCOMM_VERBS_REGISTRATION", "peermem"),
        ]),
    )
    .unwrap();
    assert_eq!(o.device, DeviceSelector::Name("mlx5_1".into()));
    assert_eq!(o.port, Some(2));
    assert_eq!(o.gid, GidSelector::Index(3));
    assert_eq!(o.registration, GpuRegistration::PeerMemory);
    assert_eq!(o.proxy.virtual_nodes, 4);
    assert!(o.validate().is_ok());
    let d = VerbsOptions::from_lookup(2, lookup(&[])).unwrap();
    assert_eq!(d.registration, GpuRegistration::Auto);
    assert_eq!(d.device, DeviceSelector::FirstActive);
    assert!(d.nearest_to_gpu, "the GPU's nearest device by default");
    assert_eq!((d.port, d.gid), (None, GidSelector::RoceV2));
}

#[test]
fn bad_variables_and_options_are_named() {
    for (vars, name) in [
        (&[("EPCOMM_VERBS_PORT", "0")][..], "EPCOMM_VERBS_PORT"),
        (&[("EPCOMM_VERBS_PORT", "x")][..], "EPCOMM_VERBS_PORT"),
        (
            &[("EPCOMM_VERBS_GID_INDEX", "256")][..],
            "EPCOMM_VERBS_GID_INDEX",
        ),
        (&[("EPCOMM_VERBS_DEVICE", "  ")][..], "EPCOMM_VERBS_DEVICE"),
        (
            &[("EPCOMM_VERBS_REGISTRATION", "rdma")][..],
            "EPCOMM_VERBS_REGISTRATION",
        ),
    ] {
        let vars: &'static [(&'static str, &'static str)] = vars;
        match VerbsOptions::from_lookup(1, lookup(vars)) {
            Err(TransportError::InvalidArgument { argument, rule }) => {
                assert_eq!(argument, name, "{rule}")
            }
            other => panic!("{name}: expected InvalidArgument, got {other:?}"),
        }
    }
    let ok = VerbsOptions::one_node_per_rank(2);
    let zero_depth = VerbsOptions {
        send_queue_depth: 0,
        ..ok.clone()
    };
    let err = zero_depth.validate().unwrap_err().to_string();
    assert!(err.contains("send_queue_depth"), "{err}");
    let port0 = VerbsOptions {
        port: Some(0),
        ..ok.clone()
    };
    assert!(port0.validate().unwrap_err().to_string().contains("port"));
    let bad_ring = VerbsOptions {
        proxy: ProxyOptions {
            ring_slots: 3,
            ..ok.proxy
        },
        ..ok
    };
    let err = bad_ring.validate().unwrap_err().to_string();
    assert!(err.contains("ring_slots"), "{err}");
}

#[test]
fn layouts_span_hosts_and_split_them() {
    // Two hosts of four GPUs, two logical nodes each: rank 5's node is 4..6.
    let w = VerbsTransport::world_layout(8, 5, 4, 2).unwrap();
    assert_eq!(w.nvlink_domain(), 4..6);
    // One logical node per GPU.
    let w = VerbsTransport::world_layout(8, 5, 4, 4).unwrap();
    assert_eq!(w.nvlink_domain(), 5..6);
    let err = VerbsTransport::world_layout(8, 0, 4, 3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vnodes=3"), "{err}");
}

/// Whether the kernel exposes any RDMA device (`/sys/class/infiniband/<dev>`).
fn kernel_lists_rdma_devices() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// The constructor's first step on this machine: without libibverbs or without an RDMA
/// device it is `Unavailable` naming the transport and the reason.
#[test]
fn probe_without_a_device_is_unavailable() {
    match probe_rdma(&VerbsOptions::one_node_per_rank(1)) {
        Ok(probe) => eprintln!(
            "SKIP: an RDMA device is present ({} port {}, {}): the no-device path cannot \
             be checked here",
            probe.device, probe.port, probe.link_layer
        ),
        Err(TransportError::Unavailable { what, why }) => {
            assert_eq!(what, "proxy-verbs");
            if !kernel_lists_rdma_devices() {
                assert!(
                    why.starts_with("no RDMA device: ") || why.contains("was not found"),
                    "{why}"
                );
            }
            let msg = unavailable(why).to_string();
            assert!(
                msg.starts_with("proxy-verbs is unavailable on this machine: "),
                "{msg}"
            );
            eprintln!("{msg}");
        }
        Err(other) => panic!("expected Unavailable, got {other}"),
    }
}

/// Without libibverbs (here: a search of an empty directory only) the probe is
/// `Unavailable`, listing where it looked.
#[test]
fn probe_without_libibverbs_is_unavailable() {
    let dir = std::env::temp_dir().join(format!("epcomm-no-ibverbs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let options = VerbsOptions {
        library: LibrarySearch::only(&dir),
        ..VerbsOptions::one_node_per_rank(1)
    };
    match probe_rdma(&options) {
        Err(TransportError::Unavailable { what, why }) => {
            assert_eq!(what, "proxy-verbs");
            assert!(why.contains("libibverbs.so.1"), "{why}");
            assert!(why.contains(&dir.display().to_string()), "{why}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bootstraps of `world` ranks over 127.0.0.1, one thread each, running `f(bootstrap)`.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Bootstrap) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    epcomm_bootstrap::launch::on_threads(world, std::time::Duration::from_secs(20), f)
        .expect("a free port")
        .into_iter()
        .map(|r| r.expect("bootstrap"))
        .collect()
}

/// A rank whose local step failed still takes part in the agreement: the others get an
/// error naming it instead of waiting for it, and it gets its own error.
#[test]
fn agreement_names_the_rank_that_failed() {
    let out = on_ranks(3, |b| {
        let local = if b.rank() == 1 {
            Err(unavailable("no RDMA device: (test)".into()))
        } else {
            Ok((b.rank(), vec![b.rank() as u8]))
        };
        agree(&b, "test-agree", local, |peer, why| {
            unavailable(format!("rank {peer}: {why}"))
        })
        .map_err(|e| e.to_string())
    });
    for (rank, r) in out.iter().enumerate() {
        let err = r.as_ref().expect_err("someone failed");
        if rank == 1 {
            assert_eq!(
                err,
                "proxy-verbs is unavailable on this machine: no RDMA device: (test)"
            );
        } else {
            assert!(
                err.contains("rank 1: proxy-verbs is unavailable on this machine: no RDMA"),
                "{err}"
            );
        }
    }
    // All succeed: every rank's payload comes back, in rank order.
    let out = on_ranks(2, |b| {
        let local = Ok((b.rank(), vec![10 + b.rank() as u8]));
        agree(&b, "test-agree-ok", local, |_, why| unavailable(why)).map_err(|e| e.to_string())
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (value, payloads) = r.expect("every rank succeeded");
        assert_eq!(value, rank);
        assert_eq!(payloads, vec![vec![10], vec![11]]);
    }
}

/// The collective probe the constructor runs first, on two ranks of this machine: where
/// neither has a device, both get `Unavailable` (no rank waits for the other).
#[test]
fn collective_probe_without_a_device_fails_on_every_rank() {
    let out = on_ranks(2, |b| check_rdma(&b, &VerbsOptions::one_node_per_rank(2)));
    match &out[..] {
        [Ok(p), Ok(_)] => eprintln!(
            "SKIP: an RDMA device is present ({}): the no-device path cannot be checked here",
            p.device
        ),
        results => {
            for r in results {
                assert!(
                    matches!(
                        r,
                        Err(TransportError::Unavailable {
                            what: "proxy-verbs",
                            ..
                        })
                    ),
                    "{r:?}"
                );
            }
        }
    }
}

#[test]
fn registration_names_round_trip() {
    for (i, r) in [
        GpuRegistration::Auto,
        GpuRegistration::DmaBuf,
        GpuRegistration::PeerMemory,
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(r.name(), GpuRegistration::NAMES[i]);
    }
}
