//! Criterion bench of the NVSHMEM transport (symmetric heap + `nvshmem_ptr` peers) on all local
//! GPUs, same workload and metric as `nvlink_ipc`.
//! `cargo bench -p epcomm-benches --bench nvshmem`

use epcomm_transport_nvshmem::NvshmemTransport;

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
    if let Err(e) = epcomm_benches::run("nvshmem", NvshmemTransport::new) {
        eprintln!("nvshmem bench failed: {e}");
        std::process::exit(1);
    }
}
