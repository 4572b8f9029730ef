//! Criterion bench of the CUDA-IPC (NVLink) transport on all local GPUs: DeepEP's normal-mode
//! workload (4096 tokens/rank, hidden 7168, top-8 of 256, 24 SMs) and metric.
//! `cargo bench -p epcomm-benches --bench nvlink_ipc`; `EPCOMM_BENCH_SCHEDULE=global` picks the
//! schedule.

fn main() {
    let result = match "ipc".parse::<epcomm_backends::TransportSpec>() {
        Ok(spec) => epcomm_benches::run(spec),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = result {
        eprintln!("nvlink_ipc bench failed: {e}");
        std::process::exit(1);
    }
}
