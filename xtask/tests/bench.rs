//! Runs the built `xtask` binary: `cargo xtask bench` on a machine without the CUDA driver says
//! so at once and exits 3 (as `epcomm bench` does), building nothing.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn bench_without_a_driver_exits_3_before_building() {
    // SAFETY: only tries to load the driver library; nothing of it is called.
    if unsafe { libloading::Library::new("libcuda.so.1") }.is_ok() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "--world", "1"])
        .output()
        .expect("run xtask");
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("no CUDA driver"), "{err}");
    // Nothing was built or started: no kernel build, no cargo run.
    assert!(!stdout.contains("bench: $"), "{stdout}");
    assert!(!stdout.contains("kernels"), "{stdout}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}
