//! `cargo xtask test`: build the kernels, then run every test of the workspace; on a machine
//! with a working `nvidia-smi`, the GPU tests too.

use std::process::Command;

use crate::error::Result;
use crate::kernels::{self, BuildOptions, Layout};
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
pub fn run(layout: &Layout, env: &ToolchainEnv, cargo_args: &[String]) -> Result<()> {
    kernels::build(layout, env, BuildOptions::default())?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(&layout.workspace)
        .args(["test", "--workspace"])
        .args(cargo_args)
        .env("EPCOMM_KERNEL_DIR", &layout.out_dir);
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

/// Runs `build-kernels`, then `cargo run --release -p epcomm-cli -- bench [args...]`.
pub fn bench(layout: &Layout, env: &ToolchainEnv, args: &[String]) -> Result<()> {
    kernels::build(layout, env, BuildOptions::default())?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(&layout.workspace)
        .args(["run", "--release", "-p", "epcomm-cli", "--", "bench"])
        .args(args)
        .env("EPCOMM_KERNEL_DIR", &layout.out_dir)
        .env("NVSHMEM_DISABLE_NVLS", "1")
        .env("NCCL_NVLS_ENABLE", "0");
    println!("bench: $ {}", command_line(&cmd));
    util::run_inherited(&mut cmd)
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
}
