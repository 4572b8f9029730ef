//! Criterion bench of the CPU-proxy transport with the RDMA verbs executor (`proxy-verbs`):
//! every peer's bytes move as RDMA WRITEs through the NIC, driven by one proxy thread per rank;
//! same workload and metric as `nvlink_ipc`. `cargo bench -p epcomm-benches --bench verbs`;
//! `EPCOMM_BENCH_VIRTUAL_NODES=<n>` keeps stores inside each of `n` logical nodes;
//! `EPCOMM_VERBS_DEVICE`, `EPCOMM_VERBS_GID_INDEX` and `EPCOMM_VERBS_REGISTRATION` pick the
//! device, GID and memory registration (docs/proxy-verbs.md). Needs an RDMA device with an
//! active port: without one (or without libibverbs) it prints why on one line and exits with
//! status 1 before it starts any rank, having measured nothing. The bench verifies a round
//! before it times anything, so a wrong result stops it.

use epcomm_backends::TransportSpec;

/// `msg` on one line.
fn one_line(msg: &str) -> String {
    msg.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    let spec = match std::env::var("EPCOMM_BENCH_VIRTUAL_NODES") {
        Ok(n) => format!("proxy-verbs:vnodes={n}").parse::<TransportSpec>(),
        Err(_) => "proxy-verbs".parse::<TransportSpec>(),
    };
    let result = spec.map_err(Into::into).and_then(|spec| {
        // Before the GPU and before any follower: a machine without an RDMA device stops here.
        if let Err(e) = spec.probe_here() {
            eprintln!("verbs bench not run: {}", one_line(&e.to_string()));
            std::process::exit(1);
        }
        epcomm_benches::run(spec)
    });
    if let Err(e) = result {
        eprintln!("verbs bench failed: {e}");
        std::process::exit(1);
    }
}
