//! Criterion bench of the NVSHMEM transport (symmetric heap; `nvshmem_ptr` peers by stores,
//! others by device put/signal) on all local GPUs, same workload and metric as `nvlink_ipc`.
//! `cargo bench -p epcomm-benches --bench nvshmem`; `EPCOMM_BENCH_ROUTES=put-signal` sends to
//! every peer by put/signal, `EPCOMM_BENCH_VIRTUAL_NODES=<n|max>` splits the host into logical
//! nodes (traffic between them by put/signal).

use epcomm_backends::TransportSpec;

fn main() {
    // SAFETY: first thing in main, before any thread exists.
    // One rank per GPU, the bench's layout (ranks sharing GPUs under MPS, more than two per GPU:
    // set CUDA_DEVICE_MAX_CONNECTIONS yourself, docs/troubleshooting.md).
    unsafe { epcomm_backends::apply_single_host_env_defaults(1, 1) };
    let spec = match std::env::var("EPCOMM_BENCH_VIRTUAL_NODES") {
        Ok(n) => format!("nvshmem:vnodes={n}").parse::<TransportSpec>(),
        Err(_) => "nvshmem".parse::<TransportSpec>(),
    };
    let result = match spec {
        Ok(spec) => epcomm_benches::run(spec),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = result {
        eprintln!("nvshmem bench failed: {e}");
        std::process::exit(1);
    }
}
