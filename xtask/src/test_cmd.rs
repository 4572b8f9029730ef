//! `cargo xtask test`: build the kernels, then run every test of the workspace; on a machine
//! with a working `nvidia-smi`, the GPU tests too.

use std::process::Command;

use crate::error::Result;
use crate::kernels::{self, BuildOptions, Paths};
use crate::toolchain::ToolchainEnv;
use crate::util::{self, command_line};

/// How many GPUs `nvidia-smi -L` (run through `nvidia_smi`) lists; 0 when it fails.
pub fn gpu_count(nvidia_smi: &str) -> usize {
    Command::new(nvidia_smi)
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

/// Runs `build-kernels`, then `cargo test --workspace [cargo_args...]` with `EPCOMM_KERNEL_DIR`
/// pointing at the built kernels, plus `EPCOMM_GPU_TESTS=1` (and NVLink multicast off) when a
/// GPU is present.
pub fn run(paths: &Paths, env: &ToolchainEnv, cargo_args: &[String]) -> Result<()> {
    kernels::build(paths, env, BuildOptions::default())?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(&paths.workspace)
        .args(["test", "--workspace"])
        .args(cargo_args)
        .env("EPCOMM_KERNEL_DIR", &paths.out_dir);
    let gpus = gpu_count("nvidia-smi");
    if gpus > 0 {
        println!(
            "test: {gpus} GPU(s) found (nvidia-smi -L); GPU tests enabled (EPCOMM_GPU_TESTS=1)"
        );
        cmd.env("EPCOMM_GPU_TESTS", "1")
            .env("NVSHMEM_DISABLE_NVLS", "1")
            .env("NCCL_NVLS_ENABLE", "0");
        // The multi-rank tests need two ranks: on one GPU, run two processes on it (checks
        // correctness; speed and skew need a GPU per rank and skip themselves).
        if gpus == 1 && std::env::var_os("EPCOMM_TEST_WORLD").is_none() {
            println!(
                "test: one GPU: EPCOMM_TEST_WORLD=2 (two ranks share it; they take turns on it \
                 unless the MPS daemon runs, `nvidia-cuda-mps-control -d`, and the skew test \
                 runs only under MPS)"
            );
            cmd.env("EPCOMM_TEST_WORLD", "2");
        }
        // Each GPU test starts one process per GPU: run them one at a time.
        if !cargo_args.iter().any(|a| a == "--") {
            cmd.args(["--", "--test-threads=1"]);
        }
    } else {
        println!("test: no GPU (nvidia-smi -L missing or failing); GPU tests will skip themselves");
    }
    println!("test: $ {}", command_line(&cmd));
    util::run_inherited(&mut cmd)
}

/// `epcomm bench`'s exit code when the machine cannot run it (docs/cli.md): also what
/// `cargo xtask bench` exits with when it finds no CUDA driver.
pub const EXIT_ENVIRONMENT: u8 = 3;

/// The driver library the CUDA driver API loads (what `epcomm` looks for).
const CUDA_DRIVER_LIBRARY: &str = "libcuda.so.1";

/// Whether the CUDA driver library loads here (the library is opened and closed; nothing of it
/// is called).
pub fn cuda_driver_present() -> bool {
    // SAFETY: loading the driver library runs only its initialisers, which have no
    // preconditions (the same load cudarc does); no symbol of it is used.
    unsafe { libloading::Library::new(CUDA_DRIVER_LIBRARY) }.is_ok()
}

/// Why `cargo xtask bench` cannot run here, said before anything is built: `None` when the
/// CUDA driver is present (`driver_present`), else the message and [`EXIT_ENVIRONMENT`].
pub fn bench_preflight(driver_present: bool) -> Option<(String, u8)> {
    (!driver_present).then(|| {
        (
            format!(
                "bench: cannot run here: no CUDA driver: the driver library ({CUDA_DRIVER_LIBRARY}) \
                 is not found by the dynamic loader; nothing was built (`epcomm bench` needs an \
                 NVIDIA GPU and its driver)"
            ),
            EXIT_ENVIRONMENT,
        )
    })
}

/// Checks for the CUDA driver (exit [`EXIT_ENVIRONMENT`] without building anything when it is
/// missing), runs `build-kernels`, then `cargo run --release -p epcomm-cli -- bench [args...]`.
/// Returns the exit code of `epcomm bench` (0 success, 1 a run failed, 2 invalid flags, 3
/// the machine cannot run it: docs/cli.md), so that `cargo xtask bench` exits with it.
///
/// # Errors
/// The kernel build's, or `cargo` could not be started.
pub fn bench(paths: &Paths, env: &ToolchainEnv, args: &[String]) -> Result<u8> {
    if let Some((why, code)) = bench_preflight(cuda_driver_present()) {
        eprintln!("{why}");
        return Ok(code);
    }
    kernels::build(paths, env, BuildOptions::default())?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(&paths.workspace)
        .args(["run", "--release", "-p", "epcomm-cli", "--", "bench"])
        .args(args)
        .env("EPCOMM_KERNEL_DIR", &paths.out_dir)
        .env("NVSHMEM_DISABLE_NVLS", "1")
        .env("NCCL_NVLS_ENABLE", "0");
    let line = command_line(&cmd);
    println!("bench: $ {line}");
    let status = cmd.status().map_err(|source| crate::error::Error::Spawn {
        command: line,
        source,
    })?;
    // epcomm's own codes pass through (a signal, or a code past u8, is a failed run).
    Ok(status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .unwrap_or(1))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::util::TempDir;

    #[test]
    fn gpu_count_needs_success_and_counts_gpu_lines() {
        let t = TempDir::new("smi");
        let yes = t.write_script("yes", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'");
        let none = t.write_script("none", "echo 'No devices were found'");
        let broken = t.write_script("broken", "echo 'GPU 0: x'; exit 9");
        assert_eq!(gpu_count(&yes.to_string_lossy()), 1);
        assert_eq!(gpu_count(&none.to_string_lossy()), 0);
        assert_eq!(gpu_count(&broken.to_string_lossy()), 0);
        assert_eq!(gpu_count("/nonexistent/nvidia-smi"), 0);
        let two = t.write_script("two", "echo 'GPU 0: a'; echo 'GPU 1: b'; echo 'MIG 1g: c'");
        assert_eq!(gpu_count(&two.to_string_lossy()), 2);
    }

    #[test]
    fn bench_without_a_driver_stops_before_building_with_exit_3() {
        let (why, code) = bench_preflight(false).expect("no driver: stop");
        assert_eq!(code, 3);
        assert!(
            why.contains("no CUDA driver") && why.contains("nothing was built"),
            "{why}"
        );
        assert!(bench_preflight(true).is_none());
    }
}
