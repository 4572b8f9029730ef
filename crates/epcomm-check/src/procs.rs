//! One process per GPU: the current binary re-executes itself as the workers.

use std::time::Duration;

use epcomm_bootstrap::launch::{LocalLaunch, Output};

use crate::{CheckError, Result};

/// Environment variable marking a worker process.
pub const WORKER_ENV: &str = "EPCOMM_WORKER";

/// True in a worker process.
pub fn is_worker() -> bool {
    std::env::var_os(WORKER_ENV).is_some()
}

/// Number of CUDA devices, or why there are none usable (no driver library, no device).
pub fn gpu_count() -> std::result::Result<usize, String> {
    // SAFETY: probing for the driver library has no preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda.so) on this machine".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("the CUDA driver reports no device".into()),
        Err(e) => Err(format!("the CUDA driver failed to initialise: {e}")),
    }
}

/// Whether contexts on GPU 0 are shared through MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`): ranks
/// on one GPU then run concurrently instead of taking turns. False without a driver, a GPU
/// or the attribute.
pub fn under_mps() -> bool {
    use cudarc::driver::{result, sys};
    gpu_count().is_ok()
        && result::init().is_ok()
        && result::device::get(0).is_ok_and(|dev| {
            // SAFETY: `dev` is a device handle the initialised driver just returned.
            unsafe {
                result::device::get_attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
                )
            }
            .is_ok_and(|v| v != 0)
        })
}

/// Runs `args` of the current executable as `world` worker processes (local rank `r`, which
/// uses GPU `r % GPUs`) with the library's defaults for one host
/// (`epcomm_backends::single_host_env_defaults` for that many ranks per GPU, each unless
/// already set) and `env` added,
/// and waits for all of them (at most `timeout`). Fails naming the ranks that failed.
pub fn run_workers(
    world: usize,
    args: &[&str],
    env: &[(&str, String)],
    timeout: Duration,
) -> Result<()> {
    let exe =
        std::env::current_exe().map_err(|e| CheckError::Other(format!("current_exe: {e}")))?;
    let mut launch = LocalLaunch::new(exe, args)
        .world_size(world)
        .env(WORKER_ENV, "1")
        .output(Output::Inherit);
    let ranks_per_gpu = world.div_ceil(gpu_count().unwrap_or(1).max(1));
    for (k, v) in epcomm_backends::single_host_env_defaults(ranks_per_gpu, world) {
        launch = launch.env(k, v);
    }
    for (k, v) in env {
        launch = launch.env(k, v);
    }
    let mut group = launch.spawn()?;
    group.wait(timeout)?;
    Ok(())
}
