//! `cargo xtask test`: build the kernels, then run every test of the workspace; on a machine
//! with a working `nvidia-smi`, the GPU tests too.

use std::process::Command;

use crate::error::Result;
use crate::kernels::{self, BuildOptions, Layout};
use crate::toolchain::ToolchainEnv;
use crate::util::{self, command_line};

/// Whether `nvidia-smi -L` (run through `nvidia_smi`) works and lists at least one GPU.
pub fn gpu_present(nvidia_smi: &str) -> bool {
    Command::new(nvidia_smi)
        .arg("-L")
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU "))
        .unwrap_or(false)
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
    if gpu_present("nvidia-smi") {
        println!("test: GPU found (nvidia-smi -L); GPU tests enabled (EPCOMM_GPU_TESTS=1)");
        cmd.env("EPCOMM_GPU_TESTS", "1")
            .env("NVSHMEM_DISABLE_NVLS", "1")
            .env("NCCL_NVLS_ENABLE", "0");
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
    fn gpu_detection_needs_success_and_a_gpu_line() {
        let t = TempDir::new("smi");
        let yes = t.write_script("yes", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'");
        let none = t.write_script("none", "echo 'No devices were found'");
        let broken = t.write_script("broken", "echo 'GPU 0: x'; exit 9");
        assert!(gpu_present(&yes.to_string_lossy()));
        assert!(!gpu_present(&none.to_string_lossy()));
        assert!(!gpu_present(&broken.to_string_lossy()));
        assert!(!gpu_present("/nonexistent/nvidia-smi"));
    }
}
