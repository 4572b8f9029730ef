//! Criterion bench of the NVSHMEM transport (symmetric heap; `nvshmem_ptr` peers by stores,
//! others by device put/signal) on all local GPUs, same workload and metric as `nvlink_ipc`.
//! `cargo bench -p epcomm-benches --bench nvshmem`; `EPCOMM_BENCH_BARRIER=peer-signal` picks
//! the strategy, `EPCOMM_BENCH_VIRTUAL_NODES=<n>` splits the host into n virtual nodes (traffic
//! between them through put/signal).

use epcomm_transport_nvshmem::{NvshmemOptions, NvshmemTransport};

fn main() {
    // Defaults for one host without an RDMA NIC; multicast stays off. Workers inherit them.
    for (key, value) in [
        ("NVSHMEM_REMOTE_TRANSPORT", "none"),
        ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ] {
        if std::env::var_os(key).is_none() {
            // SAFETY: first thing in main, before any thread exists.
            unsafe { std::env::set_var(key, value) };
        }
    }
    let virtual_nodes = match std::env::var("EPCOMM_BENCH_VIRTUAL_NODES") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) => n,
            Err(e) => {
                eprintln!("EPCOMM_BENCH_VIRTUAL_NODES={v:?}: {e}");
                std::process::exit(2);
            }
        },
        Err(_) => 1,
    };
    let name = if virtual_nodes > 1 {
        "nvshmem-vnodes"
    } else {
        "nvshmem"
    };
    let options = NvshmemOptions { virtual_nodes };
    let make = move |ctx, boot| NvshmemTransport::with_options(ctx, boot, options);
    if let Err(e) = epcomm_benches::run(name, make) {
        eprintln!("nvshmem bench failed: {e}");
        std::process::exit(1);
    }
}
