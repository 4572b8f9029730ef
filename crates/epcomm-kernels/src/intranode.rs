//! The intranode (NVLink domain) kernel module: layout, dispatch, combine.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::abi::{EXPECTED_PROBE, LayoutArgs, OpArgs};
use crate::{DriverContext, KernelError, embedded};

/// Threads per block of every intranode kernel (`kThreads` in intranode.cu).
pub const THREADS: u32 = 512;
/// Experts per histogram block of the layout kernel (`kHistChunk`).
const HIST_CHUNK: u32 = 4096;

fn grid(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The loaded intranode module of one CUDA context.
#[derive(Debug)]
pub struct IntranodeKernels {
    _module: Arc<CudaModule>,
    layout: CudaFunction,
    dispatch: CudaFunction,
    combine: CudaFunction,
    delay: CudaFunction,
}

impl IntranodeKernels {
    /// Loads the embedded fatbin into `ctx` and checks the argument-block ABI on the device.
    pub fn load(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Self, KernelError> {
        let image = embedded::INTRANODE.ok_or(KernelError::Missing {
            artifact: "intranode.fatbin",
            path: embedded::INTRANODE_PATH,
        })?;
        let module = ctx
            .load_module(Ptx::from_binary(image.to_vec()))
            .context("loading intranode.fatbin")?;
        let f = |name| module.load_function(name).context("looking up a kernel");
        let probe = f("epcomm_abi_probe")?;
        let kernels = Self {
            layout: f("epcomm_layout")?,
            dispatch: f("epcomm_dispatch")?,
            combine: f("epcomm_combine")?,
            delay: f("epcomm_delay")?,
            _module: module,
        };
        let mut out = stream
            .alloc_zeros::<u64>(EXPECTED_PROBE.len())
            .context("allocating the ABI probe")?;
        // SAFETY: the probe writes EXPECTED_PROBE.len() u64 values into `out`, which holds that many.
        unsafe {
            stream
                .launch_builder(&probe)
                .arg(&mut out)
                .launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .context("launching the ABI probe")?;
        let device = stream.clone_dtoh(&out).context("reading the ABI probe")?;
        for ((field, host), device) in EXPECTED_PROBE.iter().zip(device) {
            if *host != device {
                return Err(KernelError::AbiMismatch {
                    field,
                    host: *host,
                    device,
                });
            }
        }
        Ok(kernels)
    }

    /// Holds `stream` for `ns` nanoseconds (a one-thread spin on the GPU clock): makes this
    /// rank late by an exact amount, for skew diagnostics.
    pub fn launch_delay(&self, stream: &CudaStream, ns: u64) -> Result<(), KernelError> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel takes one integer and touches no memory.
        unsafe { stream.launch_builder(&self.delay).arg(&ns).launch(cfg) }
            .context("launching epcomm_delay")?;
        Ok(())
    }

    /// Grid size of the layout kernel for this shape.
    pub fn layout_blocks(world: u32, gpus_per_node: u32, num_experts: u32) -> u32 {
        world + world / gpus_per_node + num_experts.div_ceil(HIST_CHUNK)
    }

    /// Launches the layout kernel on `stream`.
    ///
    /// # Safety
    /// Every address in `args` must be valid device memory of the sizes abi.cuh documents for
    /// the shape in `args`, alive until the kernel finishes; `world % gpus_per_node == 0`.
    pub unsafe fn launch_layout(
        &self,
        stream: &CudaStream,
        args: &LayoutArgs,
    ) -> Result<(), KernelError> {
        let blocks = Self::layout_blocks(
            args.world as u32,
            args.gpus_per_node as u32,
            args.num_experts as u32,
        );
        let cfg = grid(blocks);
        // SAFETY: upheld by the caller (see above).
        unsafe { stream.launch_builder(&self.layout).arg(args).launch(cfg) }
            .context("launching epcomm_layout")?;
        Ok(())
    }

    /// Launches dispatch (or cached dispatch, per `args.flags`) with `blocks` blocks.
    ///
    /// # Safety
    /// Every address in `args` must be valid for the documented sizes until the kernel
    /// finishes, the symmetric buffer must be mapped on every peer, and every rank must launch
    /// the same op with the same `blocks` (the completion counters count blocks).
    pub unsafe fn launch_dispatch(
        &self,
        stream: &CudaStream,
        args: &OpArgs,
        blocks: u32,
    ) -> Result<(), KernelError> {
        // SAFETY: upheld by the caller (see above).
        unsafe {
            Self::launch_op(
                &self.dispatch,
                "launching epcomm_dispatch",
                stream,
                args,
                blocks,
            )
        }
    }

    /// Launches combine with `blocks` blocks.
    ///
    /// # Safety
    /// As for [`Self::launch_dispatch`].
    pub unsafe fn launch_combine(
        &self,
        stream: &CudaStream,
        args: &OpArgs,
        blocks: u32,
    ) -> Result<(), KernelError> {
        // SAFETY: upheld by the caller (see above).
        unsafe {
            Self::launch_op(
                &self.combine,
                "launching epcomm_combine",
                stream,
                args,
                blocks,
            )
        }
    }

    /// # Safety
    /// As for [`Self::launch_dispatch`].
    unsafe fn launch_op(
        f: &CudaFunction,
        what: &'static str,
        stream: &CudaStream,
        args: &OpArgs,
        blocks: u32,
    ) -> Result<(), KernelError> {
        // SAFETY: upheld by the caller (see above).
        unsafe { stream.launch_builder(f).arg(args).launch(grid(blocks)) }.context(what)?;
        Ok(())
    }
}
