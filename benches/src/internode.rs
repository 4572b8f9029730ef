//! The criterion driver of the hierarchical (internode) ops: [`epcomm::HierarchicalBuffer`]
//! dispatch (BF16, FP8), cached dispatch and combine on a transport with several logical
//! nodes, same workload, launch and lockstep protocol as [`crate::run`].
//!
//! Unlike the flat targets it never skips: no usable GPU, fewer than 2 ranks, or a spec that
//! gives one logical node is an [`InternodeError`] (the target prints it and exits 1) before
//! any rank starts. Ranks may share GPUs (`EPCOMM_BENCH_WORLD` above the GPU count: rank `r`
//! on GPU `r % GPUs`), which measures correctness and relative cost, not the speed of one GPU
//! per rank.

use cudarc::driver::CudaContext;
use epcomm::{BufferConfig, ExpertParallel, HierarchicalBuffer};
use epcomm_backends::TransportSpec;
use epcomm_check::hier_bench::{HierOp, hier_rows};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs};
use epcomm_check::procs::gpu_count;
use epcomm_check::timing::Timer;
use epcomm_check::verify::{RoundOptions, verified_round};
use epcomm_topology::Tiers;

use crate::{Res, Timed, drive, schedule_and_routes, start_ranks, workload};
#[cfg(test)]
use crate::{decode_step, encode_step};

/// The variable naming the transport spec.
pub const TRANSPORT_ENV: &str = "EPCOMM_BENCH_TRANSPORT";
/// The spec when [`TRANSPORT_ENV`] is unset or empty.
pub const DEFAULT_SPEC: &str = "nvshmem:vnodes=2";
/// The variable naming the number of ranks.
pub const WORLD_ENV: &str = "EPCOMM_BENCH_WORLD";

/// Why the internode bench cannot run (before any rank starts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InternodeError {
    /// No CUDA driver or no GPU.
    #[error("{0}")]
    NoGpu(String),
    /// An environment variable has a value the bench cannot use.
    #[error("{var}={value:?}: {rule}")]
    BadVariable {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// Fewer than two ranks.
    #[error(
        "it needs at least 2 ranks and would start {world} (this \
         machine has {gpus} GPU(s)); set {WORLD_ENV}=2 or more (ranks may share GPUs)"
    )]
    TooFewRanks {
        /// Ranks it would start.
        world: usize,
        /// GPUs visible.
        gpus: usize,
    },
    /// The spec puts the whole world in one logical node.
    #[error(
        "{TRANSPORT_ENV}={spec} puts the {world} ranks in one logical \
         node; give a spec with several, e.g. nvshmem:vnodes=2 or proxy-ce:vnodes=2"
    )]
    OneNode {
        /// The spec.
        spec: String,
        /// Ranks.
        world: usize,
    },
}

/// The spec from `value` ([`TRANSPORT_ENV`]'s value; [`DEFAULT_SPEC`] when `None` or empty).
///
/// # Errors
/// [`InternodeError::BadVariable`] with the library's rule.
pub fn spec_from(value: Option<&str>) -> Result<TransportSpec, InternodeError> {
    let text = value.filter(|v| !v.is_empty()).unwrap_or(DEFAULT_SPEC);
    text.parse().map_err(
        |e: epcomm_backends::TransportError| InternodeError::BadVariable {
            var: TRANSPORT_ENV,
            value: text.into(),
            rule: e.to_string(),
        },
    )
}

/// The ranks to start: `value` ([`WORLD_ENV`]'s value) or one per GPU; at least `min`.
///
/// # Errors
/// [`InternodeError::BadVariable`] when `value` is not a positive integer;
/// [`InternodeError::TooFewRanks`] below `min` (2 for the internode bench, 1 for the flat one).
pub fn world_from(value: Option<&str>, gpus: usize, min: usize) -> Result<usize, InternodeError> {
    let world = match value.filter(|v| !v.is_empty()) {
        None => gpus,
        Some(v) => v.parse::<usize>().ok().filter(|&w| w > 0).ok_or_else(|| {
            InternodeError::BadVariable {
                var: WORLD_ENV,
                value: v.into(),
                rule: "must be a positive integer (ranks)".into(),
            }
        })?,
    };
    if world < min {
        return Err(InternodeError::TooFewRanks { world, gpus });
    }
    Ok(world)
}

/// The logical nodes `spec` forms from `world` ranks on this host: more than one.
///
/// # Errors
/// [`InternodeError::BadVariable`] when the library refuses the layout (e.g. `vnodes` not
/// dividing the world), [`InternodeError::OneNode`] when it is one node.
pub fn tiers_of(spec: TransportSpec, world: usize) -> Result<Tiers, InternodeError> {
    let layout = spec
        .world_layout(world, 0, world)
        .map_err(|e| InternodeError::BadVariable {
            var: TRANSPORT_ENV,
            value: spec.to_string(),
            rule: format!("with {world} ranks: {e}"),
        })?;
    let tiers = Tiers::from(&layout);
    if tiers.nodes() < 2 {
        return Err(InternodeError::OneNode {
            spec: spec.to_string(),
            world,
        });
    }
    Ok(tiers)
}

/// Runs the hierarchical benchmark on `spec` (every rank calls it: rank 0 runs criterion,
/// the followers it starts run the same calls).
///
/// # Errors
/// [`InternodeError`] before any rank starts; afterwards any failure of the bootstrap, the
/// buffers, the verification or the timing.
pub fn run_hierarchical(spec: TransportSpec) -> Res {
    let transport = spec.to_string();
    let gpus = gpu_count().map_err(InternodeError::NoGpu)?;
    let world = world_from(std::env::var(WORLD_ENV).ok().as_deref(), gpus, 2)?;
    tiers_of(spec, world)?;
    let (followers, boot) = start_ranks(world)?;
    let rank = boot.rank();
    let world = boot.world_size();
    let ctx = CudaContext::new(boot.local_rank() % gpus)?;
    let (tokens, hidden, top_k, experts, sms) = workload()?;
    let mut cfg = BufferConfig::new(tokens, hidden, top_k, experts);
    cfg.num_sms = sms;
    (cfg.schedule, cfg.routes) = schedule_and_routes()?;
    let (schedule, routes) = (cfg.schedule, cfg.routes);
    let mut buf = HierarchicalBuffer::new(ctx.clone(), spec.build(ctx, boot.clone())?, cfg)?;
    let tiers = buf.tiers();
    let inputs = host_inputs(&Shape::uniform(world, tokens, hidden, top_k, experts, 2025))?;
    let dev = device_inputs(buf.stream(), &inputs, rank)?;
    let opts = RoundOptions {
        in_place: false,
        check_layout: false,
        ..RoundOptions::default()
    };
    verified_round(&mut buf, &inputs, &dev, opts)?;
    verified_round(&mut buf, &inputs, &dev, RoundOptions { fp8: true, ..opts })?;
    let timer = Timer::new(&mut buf, &dev)?;
    let idx: Vec<&[i64]> = inputs.bf16.iter().map(|i| i.topk_idx.as_slice()).collect();
    let rows = hier_rows(&idx, top_k, experts, tiers)?;
    let mine = rows.first().copied().unwrap_or_default();
    if rank == 0 {
        eprintln!(
            "internode bench: {world} ranks = {} node(s) x {} on {} GPU(s); criterion's \
             throughput is rank 0's rail (\"RDMA\") bytes per op",
            tiers.nodes(),
            tiers.local_ranks(),
            world.min(gpus)
        );
    }
    let ops: Vec<Timed> = HierOp::ALL
        .into_iter()
        .map(|op| {
            let bytes = mine.bytes(op, hidden);
            if rank == 0 {
                eprintln!(
                    "  {}: rank 0 moves {:.0} rail, {:.0} NVLink bytes, receives {:.0} bytes",
                    op.name(),
                    bytes.rail,
                    bytes.nvlink,
                    bytes.flat
                );
            }
            Timed {
                name: op.name(),
                op: op.flat(),
                bytes: bytes.rail as u64,
            }
        })
        .collect();
    let group = format!(
        "{transport}/ep{world}/{}x{}/{sms}sms/{schedule}/{routes}",
        tiers.nodes(),
        tiers.local_ranks()
    );
    drive(buf, timer, &dev, &boot, followers, &group, &ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_defaults_to_two_virtual_nodes() {
        assert_eq!(spec_from(None).unwrap().to_string(), DEFAULT_SPEC);
        assert_eq!(spec_from(Some("")).unwrap().to_string(), DEFAULT_SPEC);
        assert_eq!(
            spec_from(Some("proxy-ce:vnodes=2")).unwrap().to_string(),
            "proxy-ce:vnodes=2"
        );
        let e = spec_from(Some("tcp")).unwrap_err();
        assert!(
            matches!(
                &e,
                InternodeError::BadVariable {
                    var: TRANSPORT_ENV,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn fewer_than_two_ranks_fail() {
        assert_eq!(world_from(None, 4, 2), Ok(4));
        assert_eq!(world_from(Some("2"), 1, 2), Ok(2));
        assert_eq!(
            world_from(None, 1, 2),
            Err(InternodeError::TooFewRanks { world: 1, gpus: 1 })
        );
        let e = world_from(Some("1"), 8, 2).unwrap_err();
        assert!(e.to_string().contains("EPCOMM_BENCH_WORLD=2"), "{e}");
        // The flat bench takes one rank, and refuses the same bad values.
        assert_eq!(world_from(None, 1, 1), Ok(1));
        assert_eq!(world_from(Some("3"), 1, 1), Ok(3));
        for bad in ["0", "two", "-1"] {
            for min in [1, 2] {
                assert!(matches!(
                    world_from(Some(bad), 2, min),
                    Err(InternodeError::BadVariable { var: WORLD_ENV, .. })
                ));
            }
        }
    }

    #[test]
    fn one_logical_node_fails() {
        let spec = |s: &str| s.parse::<TransportSpec>().unwrap();
        assert_eq!(
            tiers_of(spec("nvshmem:vnodes=2"), 4),
            Ok(Tiers::new(2, 2).unwrap())
        );
        assert_eq!(
            tiers_of(spec("nvshmem"), 2),
            Err(InternodeError::OneNode {
                spec: "nvshmem".into(),
                world: 2
            })
        );
        assert!(matches!(
            tiers_of(spec("nvshmem:vnodes=3"), 4),
            Err(InternodeError::BadVariable { .. })
        ));
    }

    #[test]
    fn step_messages_round_trip() {
        for (i, op) in HierOp::ALL.into_iter().enumerate() {
            let (got, iters) = decode_step(&encode_step(i as u8, 7), &HierOp::ALL).unwrap();
            assert_eq!((got, iters), (Some(op), 7));
        }
        let ops = &HierOp::ALL;
        assert_eq!(decode_step(&encode_step(u8::MAX, 0), ops).unwrap().0, None);
        assert!(decode_step(&encode_step(9, 1), ops).is_err());
        assert!(decode_step(&[], ops).is_err());
        assert!(decode_step(&[0, 1, 2], ops).is_err());
    }
}
