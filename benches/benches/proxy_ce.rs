//! Criterion bench of the CPU-proxy transport with the copy-engine executor (`proxy-ce`): every
//! peer's bytes move on the copy engines, driven by one proxy thread per rank; same workload and
//! metric as `nvlink_ipc`. `cargo bench -p epcomm-benches --bench proxy_ce`;
//! `EPCOMM_BENCH_VIRTUAL_NODES=<n>` keeps stores inside each of `n` logical nodes. Experimental:
//! docs/proxy.md ("Status") lists what does not pass yet; the bench verifies a round before it
//! times anything, so a wrong result stops it.

use epcomm_backends::TransportSpec;

fn main() {
    // SAFETY: first thing in main, before any other thread exists.
    // One rank per GPU, the bench's layout (ranks sharing GPUs under MPS, more than two per GPU:
    // set CUDA_DEVICE_MAX_CONNECTIONS yourself, docs/troubleshooting.md).
    unsafe { epcomm_backends::apply_single_host_env_defaults(1, 1) };
    let spec = match std::env::var("EPCOMM_BENCH_VIRTUAL_NODES") {
        Ok(n) => format!("proxy-ce:vnodes={n}").parse::<TransportSpec>(),
        Err(_) => "proxy-ce".parse::<TransportSpec>(),
    };
    let result = match spec {
        Ok(spec) => epcomm_benches::run(spec),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = result {
        eprintln!("proxy_ce bench failed: {e}");
        std::process::exit(1);
    }
}
