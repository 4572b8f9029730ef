//! `--hierarchical`: the internode bench's rules. The transport must split the world into more
//! than one logical node (the library's `world_layout`), the node stage must hold `--top-k`
//! distinct experts, and the flags that time a flat `Buffer` (`--sweep-sms`, `--low-latency`,
//! `--delay-rank`) are refused with it.
//!
//! Contract: nothing here runs without `--hierarchical`; every error names a flag as typed.

use epcomm_topology::Tiers;

use super::{FlagError, TransportChoice};
use crate::cli::BenchArgs;

/// The flags `--hierarchical` refuses, with why.
fn conflicts(args: &BenchArgs) -> Vec<FlagError> {
    let refuse = |flag: &'static str, why: &str| FlagError::Invalid {
        flag,
        why: format!("not with --hierarchical: {why}"),
    };
    let mut errs = Vec::new();
    if args.sweep_sms.is_some() {
        errs.push(refuse(
            "--sweep-sms",
            "the hierarchical bench times one SM count; give it with --sms",
        ));
    }
    if args.low_latency {
        errs.push(refuse(
            "--low-latency",
            "the low-latency ops run on a flat Buffer over the whole world; time them without \
             --hierarchical",
        ));
    }
    if args.delay_rank.is_some() {
        errs.push(refuse(
            "--delay-rank",
            "the skew demo runs on a flat Buffer; run it without --hierarchical",
        ));
    }
    errs
}

/// Checks `--hierarchical` for a local launch of `world` ranks (when known) on `transport`
/// (when valid). Returns the world as nodes x local ranks, when known and valid.
pub(super) fn hierarchical(
    args: &BenchArgs,
    world: Option<usize>,
    transport: Option<&TransportChoice>,
    errs: &mut Vec<FlagError>,
) -> Option<Tiers> {
    if !args.hierarchical {
        return None;
    }
    errs.extend(conflicts(args));
    let (w, t) = (world?, transport?);
    // A local launch: every rank on this host. A layout the library refuses was reported by
    // the transport rules already.
    let layout = t.spec.world_layout(w, 0, w).ok()?;
    let tiers = Tiers::from(&layout);
    if tiers.nodes() < 2 {
        errs.push(FlagError::SingleNode {
            transport: t.spec.to_string(),
            world: w,
        });
        return None;
    }
    if args.experts.is_multiple_of(w) && args.experts > 0 {
        let per_node = args.experts / tiers.nodes();
        if let Some(e) = FlagError::at_most(
            "--top-k",
            args.top_k as u64,
            per_node as u64,
            format!(
                "with --hierarchical a node's stage holds --experts {} / {} nodes = {per_node} \
                 experts, and a token picks --top-k distinct ones",
                args.experts,
                tiers.nodes()
            ),
        ) {
            errs.push(e);
        }
    }
    Some(tiers)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{args, error_about, gpus, valid};
    use super::super::{Machine, validate_bench};
    use super::*;

    #[test]
    fn one_logical_node_is_refused_naming_the_fix() {
        for (spec, world) in [("ipc", "2"), ("nvshmem", "4"), ("nvshmem:vnodes=1", "2")] {
            let e = error_about(
                &["--hierarchical", "--transport", spec, "--world", world],
                "--hierarchical",
            );
            assert_eq!(
                e,
                FlagError::SingleNode {
                    transport: spec.replace(":vnodes=1", ""),
                    world: world.parse().unwrap()
                },
                "{e}"
            );
            let text = e.to_string();
            assert!(text.contains(":vnodes=N"), "{text}");
            assert!(text.contains("several hosts"), "{text}");
        }
        // One rank: one node whatever the spec asks.
        let e = error_about(
            &[
                "--hierarchical",
                "--transport",
                "nvshmem:vnodes=max",
                "--world",
                "1",
            ],
            "--hierarchical",
        );
        assert!(matches!(e, FlagError::SingleNode { world: 1, .. }), "{e}");
        assert!(e.to_string().contains("give --world 2 or more"), "{e}");
    }

    #[test]
    fn several_logical_nodes_pass_with_their_tiers() {
        let plan = valid(&[
            "--hierarchical",
            "--transport",
            "nvshmem:vnodes=2",
            "--world",
            "4",
        ]);
        assert_eq!(plan.tiers, Some(Tiers::new(2, 2).unwrap()));
        let plan = valid(&[
            "--hierarchical",
            "--transport",
            "proxy-ce:vnodes=2",
            "--world",
            "2",
        ]);
        assert_eq!(plan.tiers, Some(Tiers::new(2, 1).unwrap()));
        // The flat bench never has tiers.
        let plan = valid(&["--transport", "nvshmem:vnodes=2", "--world", "4"]);
        assert_eq!(plan.tiers, None);
        // World unknown (no --world, no machine yet): checked once the GPUs are counted.
        let plan = valid(&["--hierarchical", "--transport", "nvshmem:vnodes=2"]);
        assert_eq!(plan.tiers, None);
        let a = args(&["--hierarchical", "--transport", "nvshmem:vnodes=2"]);
        let plan = validate_bench(&a, Some(2), &Machine::default()).unwrap();
        assert_eq!(plan.tiers, Some(Tiers::new(2, 1).unwrap()));
    }

    #[test]
    fn flat_only_flags_are_refused() {
        let base = ["--hierarchical", "--transport", "nvshmem:vnodes=2"];
        for (extra, flag) in [
            (&["--sweep-sms", "16,24"][..], "--sweep-sms"),
            (&["--low-latency"], "--low-latency"),
            (&["--delay-rank", "1", "--world", "2"], "--delay-rank"),
        ] {
            let e = error_about(&[&base[..], extra].concat(), flag);
            assert!(e.to_string().contains("not with --hierarchical"), "{e}");
        }
    }

    #[test]
    fn top_k_must_fit_a_nodes_experts() {
        // 16 experts over 2 nodes: 8 per node.
        let e = error_about(
            &[
                "--hierarchical",
                "--transport",
                "nvshmem:vnodes=2",
                "--world",
                "2",
                "--experts",
                "16",
                "--top-k",
                "9",
            ],
            "--top-k",
        );
        assert!(matches!(e, FlagError::TooLarge { max: 8, .. }), "{e}");
        // The flat bench takes it.
        valid(&["--world", "2", "--experts", "16", "--top-k", "9"]);
    }

    #[test]
    fn ranks_may_share_gpus() {
        let m = Machine {
            gpus: Some(gpus(1, 132, 141)),
            host_memory_bytes: None,
        };
        let shared = args(&[
            "--hierarchical",
            "--transport",
            "nvshmem:vnodes=2",
            "--world",
            "2",
        ]);
        let plan = validate_bench(&shared, None, &m).unwrap();
        assert_eq!(plan.world, Some(2));
        assert!(
            plan.notes.iter().any(|n| n.contains("share GPUs")),
            "{:?}",
            plan.notes
        );
        // The GPU's SM count still bounds --sms.
        let mut too_many = shared.clone();
        too_many.sms = 200;
        let err = validate_bench(&too_many, None, &m).unwrap_err();
        assert!(err.about("--sms").is_some(), "{err}");
        // The flat bench shares GPUs the same way.
        let flat = args(&["--transport", "nvshmem:vnodes=2", "--world", "2"]);
        let plan = validate_bench(&flat, None, &m).unwrap();
        assert!(plan.notes.iter().any(|n| n.contains("share GPUs")));
    }

    #[test]
    fn shared_gpus_must_hold_every_ranks_memory() {
        // 1.5 to 3 GiB per rank at the default shape (two buffers, partials, inputs,
        // timing): a 3 GiB GPU holds one rank, not two.
        let one = super::super::machine::hier_device_bytes_estimate(
            Tiers::new(2, 1).unwrap(),
            4096,
            7168,
            8,
            256,
        )
        .unwrap();
        assert!(one > 3 << 29 && one < 3 << 30, "{one}");
        let m = |n| Machine {
            gpus: Some(gpus(n, 132, 3)),
            host_memory_bytes: None,
        };
        let a = args(&[
            "--hierarchical",
            "--transport",
            "nvshmem:vnodes=2",
            "--world",
            "2",
        ]);
        let err = validate_bench(&a, None, &m(1)).unwrap_err();
        let e = err.about("--tokens").expect("memory error");
        assert!(e.to_string().contains("2 ranks share each GPU"), "{e}");
        validate_bench(&a, None, &m(2)).unwrap();
    }
}
