//! Criterion bench of the hierarchical (internode) path: `HierarchicalBuffer` dispatch BF16 and
//! FP8, cached dispatch and combine (a rail stage over one rank per logical node, then a node
//! stage over the ranks of each node), DeepEP's normal-mode workload, the same lockstep
//! protocol as the per-transport targets. `cargo bench -p epcomm-benches --bench internode`.
//!
//! `EPCOMM_BENCH_TRANSPORT` picks the spec (default `nvshmem:vnodes=2`: one host split into
//! two logical nodes, the rail between them carried by put/signal; any spec with more than
//! one logical node works); `EPCOMM_BENCH_WORLD` the ranks (default: one per GPU; more ranks
//! than GPUs share them round-robin); `EPCOMM_BENCH_SMS`, `EPCOMM_BENCH_TOKENS`,
//! `EPCOMM_BENCH_SCHEDULE` and `EPCOMM_BENCH_ROUTES` as for the other targets. Criterion's
//! throughput is rank 0's rail ("RDMA") bytes per op; the NVLink and received bytes are printed
//! before the first sample. It never skips: without a GPU, with fewer than 2 ranks, or with a
//! spec that forms one logical node it prints why on one line and exits with status 1 before it
//! starts any rank. It verifies a BF16 and an FP8 round before it times anything, so a wrong
//! result stops it.

use epcomm_benches::internode::{TRANSPORT_ENV, spec_from};

fn main() {
    // SAFETY: first thing in main, before any thread exists.
    // One rank per GPU, the bench's layout (ranks sharing GPUs under MPS, more than two per GPU:
    // set CUDA_DEVICE_MAX_CONNECTIONS yourself, docs/troubleshooting.md).
    unsafe { epcomm_backends::apply_single_host_env_defaults(1, 1) };
    let result = spec_from(std::env::var(TRANSPORT_ENV).ok().as_deref())
        .map_err(Into::into)
        .and_then(epcomm_benches::run_hierarchical);
    if let Err(e) = result {
        eprintln!("internode bench failed: {e}");
        std::process::exit(1);
    }
}
