//! Checks of `epcomm bench`'s flags, run by the launcher before any worker is spawned.
//!
//! Every error names the flag as the user typed it (`--tokens`, not `max_tokens_per_rank`).
//! Transport, schedule and routes are checked by the library itself, without a GPU: the spec's
//! `capabilities()`, its `world_layout(...)` and `RoutePlan::new` ([`TransportChoice`]); row
//! sizes by `RowFormat`, buffer sizes by `BufferPlan`. What remains here are the CLI's own
//! limits (kernel table sizes, 32-bit indices, the machine's GPUs and memory), so that a bad
//! flag fails in milliseconds with one clear message instead of once per rank.
//!
//! One idea per module: [`errors`] (the errors, naming flags), [`shape`] (the shape and capacity
//! rules of each flag group), [`transport`] (transport choice and route plans, by the library),
//! [`machine`] (what the host offers: GPUs, memory, the file system), [`hier`] (the rules of
//! `--hierarchical`). [`validate_bench`] runs them in a fixed order, which is the order its
//! errors are printed in.

mod errors;
mod hier;
mod machine;
mod shape;
mod transport;

pub use errors::{FlagError, FlagErrors};
pub use machine::Machine;
pub use shape::world_rule;
pub use transport::TransportChoice;

use crate::cli::BenchArgs;

/// The validated run: what the workers do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchPlan {
    /// Ranks, when known (from --world or the GPU count).
    pub world: Option<usize>,
    /// SM counts to time, in order (one entry without --sweep-sms).
    pub sweep: Vec<u32>,
    /// Whether this is a sweep.
    pub is_sweep: bool,
    /// Skew demo: (late rank, delay in microseconds).
    pub delay: Option<(usize, u64)>,
    /// Whether FP8 dispatch is verified and timed (`RowFormat` admits FP8 rows).
    pub fp8: bool,
    /// The transport, schedule and route policy.
    pub transport: TransportChoice,
    /// With `--hierarchical`, once the world is known: its logical nodes x local ranks.
    pub tiers: Option<epcomm_topology::Tiers>,
    /// Things worth telling the user (stderr).
    pub notes: Vec<String>,
}

/// Checks every flag of `epcomm bench`. `world_hint` is the world when --world is not given
/// (the GPU count, or the bootstrap's world in a worker); `machine` what is known of the
/// device (limits that need it are skipped when it is unknown).
///
/// # Errors
/// Every rule broken, each naming its flag.
pub fn validate_bench(
    args: &BenchArgs,
    world_hint: Option<usize>,
    machine: &Machine,
) -> Result<BenchPlan, FlagErrors> {
    let mut errs = Vec::new();
    let mut notes = args.comm.deprecations();

    let world = shape::world(
        args,
        world_hint,
        machine.gpus.as_deref(),
        &mut errs,
        &mut notes,
    );
    let (min_sms, min_mem) = machine.smallest_used(world);
    shape::iters(args, &mut errs);
    let tokens_ok = shape::tokens(args, world, &mut errs);
    let (hidden_ok, fp8) = shape::hidden(args, &mut errs, &mut notes);
    let experts_ok = shape::experts(args, world, &mut errs);
    if tokens_ok {
        shape::low_latency_tokens(args, world, experts_ok, &mut errs);
    }
    let top_k_ok = shape::top_k(args, &mut errs);
    let sm_limit = shape::sm_limit(machine, world, min_sms);
    let (sweep, is_sweep) = shape::sms(args, sm_limit, &mut errs);

    // --transport, --schedule, --routes (and their aliases): the library decides, for every
    // rank of a local launch (one host).
    let transport = match TransportChoice::for_local_launch(&args.comm, world) {
        Ok(t) => Some(t),
        Err(e) => {
            errs.push(e);
            None
        }
    };

    let delay_us = shape::delay(args, world, &mut errs);
    let errs_before = errs.len();
    let tiers = hier::hierarchical(args, world, transport.as_ref(), &mut errs);
    let hier_ok = errs.len() == errs_before;

    // Memory, when everything it depends on is valid and the machine is known.
    if let Some(w) = world
        && tokens_ok
        && hidden_ok
        && experts_ok
        && top_k_ok
        && hier_ok
    {
        let (t, h, k, e) = (args.tokens(), args.hidden, args.top_k, args.experts);
        let per_rank = match tiers {
            Some(tiers) => machine::hier_device_bytes_estimate(tiers, t, h, k, e),
            None => machine::device_bytes_estimate(w, t, h, k, e),
        };
        let ranks_per_gpu = machine
            .gpus
            .as_ref()
            .map_or(1, |g| w.div_ceil(g.len().max(1)));
        errs.extend(machine::memory_errors(
            args,
            w,
            per_rank,
            ranks_per_gpu,
            min_mem,
            machine.host_memory_bytes,
        ));
    }

    if let Some(p) = &args.plot
        && let Some(e) = machine::plot_path_error(p)
    {
        errs.push(e);
    }

    match transport {
        Some(transport) if errs.is_empty() => Ok(BenchPlan {
            world,
            sweep,
            is_sweep,
            delay: args.delay_rank.map(|r| (r, delay_us)),
            fp8,
            transport,
            tiers,
            notes,
        }),
        _ => Err(FlagErrors(errs)),
    }
}

/// What the tests of every rule module share: parsed flags, the plan or the error they give.
#[cfg(test)]
mod test_support {
    use super::*;
    use crate::cli::Command;
    use crate::cli::tests::parse;
    use crate::gpu::GpuInfo;

    /// `epcomm bench extra...`, parsed.
    pub(super) fn args(extra: &[&str]) -> BenchArgs {
        match parse(&[&["bench"], extra].concat()) {
            Command::Bench(a) => a,
            other => panic!("not bench: {other:?}"),
        }
    }

    /// Validates `extra` with no machine facts; it must pass.
    pub(super) fn valid(extra: &[&str]) -> BenchPlan {
        validate_bench(&args(extra), None, &Machine::default()).unwrap()
    }

    /// `n` GPUs with `sms` SMs and `mem_gib` GiB each.
    pub(super) fn gpus(n: usize, sms: u32, mem_gib: u64) -> Vec<GpuInfo> {
        (0..n)
            .map(|i| GpuInfo {
                ordinal: i,
                name: "test GPU".into(),
                sms,
                memory_bytes: mem_gib << 30,
                compute_capability: (9, 0),
                pci_bus_id: None,
                mps: false,
            })
            .collect()
    }

    /// Validates `extra` (no machine facts) and returns the error about `flag`.
    pub(super) fn error_about(extra: &[&str], flag: &str) -> FlagError {
        let err =
            validate_bench(&args(extra), None, &Machine::default()).expect_err("expected an error");
        let e = err
            .about(flag)
            .unwrap_or_else(|| panic!("no error about {flag}: {err}"))
            .clone();
        assert!(e.to_string().contains(flag), "{e}");
        assert!(err.to_string().contains(flag), "{err}");
        e
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::test_support::{args, valid};
    use super::*;
    use crate::cli::Cli;

    #[test]
    fn defaults_are_valid() {
        let plan = valid(&["--world", "8"]);
        assert_eq!(plan.world, Some(8));
        assert_eq!(plan.sweep, vec![24]);
        assert!(plan.fp8 && !plan.is_sweep && plan.delay.is_none());
        // Without --world nor a machine, world-dependent rules wait for the GPU count.
        let plan = valid(&[]);
        assert_eq!(plan.world, None);
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let err = validate_bench(
            &args(&["--iters", "0", "--sms", "0", "--hidden", "12"]),
            None,
            &Machine::default(),
        )
        .unwrap_err();
        for flag in ["--iters", "--sms", "--hidden"] {
            assert!(err.about(flag).is_some(), "{err}");
        }
        assert_eq!(err.to_string().lines().count(), 3);
    }

    #[test]
    fn clap_rules_name_the_flags() {
        for (argv, flag) in [
            (vec!["--transport", "tcp"], "--transport"),
            (vec!["--transport", "nvshmem:vnodes=0"], "--transport"),
            (vec!["--schedule", "peer-signal"], "--schedule"),
            (vec!["--routes", "store"], "--routes"),
            (vec!["--barrier", "fast"], "--barrier"),
            (
                vec!["--barrier", "global", "--schedule", "epoch"],
                "--schedule",
            ),
            (vec!["--sweep-sms", "16,x"], "--sweep-sms"),
            (vec!["--plot", "a.svg"], "--sweep-sms"),
            (vec!["--json", "--csv"], "--csv"),
            (vec!["--sms", "8", "--sweep-sms", "16"], "--sweep-sms"),
            (vec!["--tokens", "-1"], "--tokens"),
        ] {
            let mut full = vec!["epcomm", "bench"];
            full.extend(argv.iter().copied());
            let err = Cli::try_parse_from(&full).expect_err("clap should reject");
            assert!(err.to_string().contains(flag), "{argv:?}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }
}
