//! The intranode (NVLink domain) kernel module: layout, dispatch, combine.
//!
//! Two images are built from the same kernel bodies (`kernels/intranode/`), one per Net
//! policy: [`KernelFamily::NvlinkStore`] reaches every peer through a mapping of its buffer;
//! [`KernelFamily::NvshmemDevice`] is device-linked with `libnvshmem_device` and reaches the peers
//! flagged in `OpArgs::remote_mask` with NVSHMEM put/signal. The NVSHMEM module must be bound to
//! the NVSHMEM runtime (`nvshmemx_cumodule_init`, see [`OpModule::cu_module`]) before
//! a dispatch or combine launch.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;

use crate::abi::{EXPECTED_PROBE, KernelFamily, LayoutArgs, OpArgs};
use crate::{DriverContext, Image, KernelError};

/// Threads per block of every intranode kernel (`kThreads` in kernels/intranode/shared.cuh).
pub const THREADS: u32 = 512;
/// Experts per histogram block of the layout kernel (`kHistChunk` in layout.cuh).
const HIST_CHUNK: u32 = 4096;

fn grid(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of one thread (the probe and the delay kernel).
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// The op kernels of an image that take an [`OpArgs`] block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `epcomm_dispatch` (also cached dispatch, per `OpArgs::flags`).
    Dispatch,
    /// `epcomm_combine` (also in-place combine, per `OpArgs::flags`).
    Combine,
    /// The send phase of a low-latency dispatch: `epcomm::ll::dispatch` when
    /// `flags::FUSED` (the receive phase follows in the same kernel), else
    /// `epcomm::ll::hook::dispatch`.
    LlDispatchSend,
    /// `epcomm::ll::hook::dispatch` with `flags::RECV_PHASE`: the receive phase of a
    /// low-latency dispatch (a hook's).
    LlDispatchRecv,
    /// The send phase of a low-latency combine: `epcomm::ll::combine` when `flags::FUSED`, else
    /// `epcomm::ll::hook::combine`.
    LlCombineSend,
    /// `epcomm::ll::hook::combine` with `flags::RECV_PHASE`: the receive phase of a low-latency
    /// combine (a hook's).
    LlCombineRecv,
}

impl Op {
    /// Every op kernel.
    pub const ALL: [Op; 6] = [
        Op::Dispatch,
        Op::Combine,
        Op::LlDispatchSend,
        Op::LlDispatchRecv,
        Op::LlCombineSend,
        Op::LlCombineRecv,
    ];

    /// The kernel's symbol in the image. A low-latency op has two kernels, each listed by
    /// profilers under the op's name: the one-kernel form (`epcomm::ll::dispatch(epcomm::OpArgs)`,
    /// `epcomm::ll::combine(..)`, [`Op::one_kernel_symbol`]) and the hook's, whose send and
    /// receive phases are one kernel (`epcomm::ll::hook::dispatch(..)`, `..::combine(..)`).
    pub fn symbol(self) -> &'static str {
        match self {
            Op::Dispatch => "epcomm_dispatch",
            Op::Combine => "epcomm_combine",
            Op::LlDispatchSend | Op::LlDispatchRecv => "_ZN6epcomm2ll4hook8dispatchENS_6OpArgsE",
            Op::LlCombineSend | Op::LlCombineRecv => "_ZN6epcomm2ll4hook7combineENS_6OpArgsE",
        }
    }

    /// The kernel a send phase with `flags::FUSED` launches instead (it runs the receive phase
    /// too), for the low-latency send phases.
    pub fn one_kernel_symbol(self) -> Option<&'static str> {
        match self {
            Op::LlDispatchSend => Some("_ZN6epcomm2ll8dispatchENS_6OpArgsE"),
            Op::LlCombineSend => Some("_ZN6epcomm2ll7combineENS_6OpArgsE"),
            _ => None,
        }
    }

    /// What launching it is called in errors.
    fn launching(self) -> &'static str {
        match self {
            Op::Dispatch => "launching epcomm_dispatch",
            Op::Combine => "launching epcomm_combine",
            Op::LlDispatchSend => "launching epcomm::ll::dispatch (send and receive phase)",
            Op::LlDispatchRecv => "launching epcomm::ll::hook::dispatch (receive phase)",
            Op::LlCombineSend => "launching epcomm::ll::combine (send and receive phase)",
            Op::LlCombineRecv => "launching epcomm::ll::hook::combine (receive phase)",
        }
    }

    /// What launching the hook's kernel for a send phase is called in errors.
    fn launching_hook(self) -> &'static str {
        match self {
            Op::LlDispatchSend => "launching epcomm::ll::hook::dispatch (send phase)",
            Op::LlCombineSend => "launching epcomm::ll::hook::combine (send phase)",
            other => other.launching(),
        }
    }

    /// Whether it is a low-latency receive phase (its kernel runs with `flags::RECV_PHASE`).
    fn is_receive_phase(self) -> bool {
        matches!(self, Op::LlDispatchRecv | Op::LlCombineRecv)
    }

    /// Whether the kernel takes `OpArgs::ll_smem_words` words of dynamic shared memory.
    fn is_low_latency(self) -> bool {
        !matches!(self, Op::Dispatch | Op::Combine)
    }
}

/// Most dynamic shared memory a low-latency kernel may take, in bytes (the kernels' static
/// shared memory and this stay within the 48 KiB a kernel gets without opting in).
pub const LL_MAX_SMEM_BYTES: usize = 32 * 1024;

/// An op kernel and what launching it is called in errors.
#[derive(Debug)]
struct OpKernel {
    f: CudaFunction,
    /// The one-kernel form a send phase with `flags::FUSED` launches ([`Op::one_kernel_symbol`]).
    one_kernel: Option<CudaFunction>,
    op: Op,
}

impl OpKernel {
    /// Launches the kernel cooperatively with `blocks` blocks: the driver starts the grid only
    /// with every block co-resident, which the cross-block and cross-rank waits need, or fails
    /// the launch.
    ///
    /// # Safety
    /// As for [`OpModule::launch_dispatch`].
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        args: &OpArgs,
        blocks: u32,
    ) -> Result<(), KernelError> {
        let mut cfg = grid(blocks);
        let (f, what) = match &self.one_kernel {
            Some(f) if args.flags & crate::abi::flags::FUSED != 0 => (f, self.op.launching()),
            Some(_) => (&self.f, self.op.launching_hook()),
            None => (&self.f, self.op.launching()),
        };
        let phase;
        let args = if self.op.is_receive_phase() {
            phase = OpArgs {
                flags: args.flags | crate::abi::flags::RECV_PHASE,
                ..*args
            };
            &phase
        } else {
            args
        };
        if self.op.is_low_latency() {
            let bytes = args.ll_smem_words.max(0) as usize * 4;
            if bytes > LL_MAX_SMEM_BYTES {
                return Err(KernelError::Launch {
                    what,
                    reason: format!(
                        "{bytes} bytes of dynamic shared memory, more than {LL_MAX_SMEM_BYTES}"
                    ),
                });
            }
            cfg.shared_mem_bytes = bytes as u32;
        }
        // SAFETY: upheld by the caller (see above).
        unsafe { stream.launch_builder(f).arg(args).launch_cooperative(cfg) }.context(what)?;
        Ok(())
    }
}

/// Arguments of `epcomm_copy_counted_rows` (kernels/common/copy_rows.cuh): copies rows
/// `[0, min(*count, max_rows))` of `row_bytes` each from `even` (or `odd` when `parity` is not 0
/// and the `i64` there is odd) to `dst`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyCountedRows {
    /// Destination, `max_rows * row_bytes` bytes.
    pub dst: u64,
    /// Source at even parity.
    pub even: u64,
    /// Source at odd parity.
    pub odd: u64,
    /// Device `i64` whose low bit picks the source, or 0 for `even`.
    pub parity: u64,
    /// Device `i32`: rows to copy (clamped to `0..=max_rows`).
    pub count: u64,
    /// Bytes per row, a multiple of 4.
    pub row_bytes: u64,
    /// Rows `dst` holds.
    pub max_rows: u64,
}

/// One kernel image loaded into a CUDA context (the image of the transport's
/// [`KernelFamily`](crate::KernelFamily)): every op's kernel, and their launches.
#[derive(Debug)]
pub struct OpModule {
    _module: Arc<CudaModule>,
    image_digest: u64,
    layout: CudaFunction,
    copy_counted_rows: CudaFunction,
    /// In [`Op::ALL`] order.
    ops: Vec<OpKernel>,
    delay: CudaFunction,
}

impl OpModule {
    /// Loads the embedded image of `family` ([`Image::of`]) into `ctx` and checks the
    /// argument-block ABI on the device.
    pub fn load(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        family: KernelFamily,
    ) -> Result<Self, KernelError> {
        Self::load_image(ctx, stream, Image::of(family))
    }

    /// Loads `image` (one of a kernel family's images, e.g. from [`Image::for_runtime`]) into
    /// `ctx` and checks the argument-block ABI on the device.
    pub fn load_image(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        image: Image,
    ) -> Result<Self, KernelError> {
        let artifact = image.artifact();
        let image = image.bytes()?;
        let module = ctx
            .load_module(Ptx::from_binary(image.to_vec()))
            .map_err(|source| KernelError::Load { artifact, source })?;
        let f = |name| module.load_function(name).context("looking up a kernel");
        let probe = f("epcomm_abi_probe")?;
        let kernels = Self {
            layout: f("epcomm_layout")?,
            copy_counted_rows: f("epcomm_copy_counted_rows")?,
            ops: Op::ALL
                .iter()
                .map(|&op| {
                    Ok(OpKernel {
                        f: f(op.symbol())?,
                        one_kernel: op.one_kernel_symbol().map(&f).transpose()?,
                        op,
                    })
                })
                .collect::<Result<_, KernelError>>()?,
            delay: f("epcomm_delay")?,
            _module: module,
            image_digest: fnv1a64(image),
        };
        let mut out = stream
            .alloc_zeros::<u64>(EXPECTED_PROBE.len())
            .context("allocating the ABI probe")?;
        // SAFETY: the probe writes EXPECTED_PROBE.len() u64 values into `out`, which holds that many.
        unsafe {
            stream
                .launch_builder(&probe)
                .arg(&mut out)
                .launch(ONE_THREAD)
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

    /// The driver handle of the loaded module (for registering it with a device runtime such
    /// as NVSHMEM). Valid while `self` lives.
    pub fn cu_module(&self) -> Result<sys::CUmodule, KernelError> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `self.layout` is a live function of the module `self` keeps loaded, and
        // `module` is a valid out-pointer.
        unsafe { sys::cuFuncGetModule(&mut module, self.layout.cu_function()) }
            .result()
            .context("cuFuncGetModule on epcomm_layout")?;
        Ok(module)
    }

    /// Holds `stream` for `ns` nanoseconds (a one-thread spin on the GPU clock): makes this
    /// rank late by an exact amount, for skew diagnostics.
    pub fn launch_delay(&self, stream: &CudaStream, ns: u64) -> Result<(), KernelError> {
        // SAFETY: the kernel takes one integer and touches no memory.
        unsafe {
            stream
                .launch_builder(&self.delay)
                .arg(&ns)
                .launch(ONE_THREAD)
        }
        .context("launching epcomm_delay")?;
        Ok(())
    }

    /// Launches the counted copy-out on `stream`: one block per SM, each thread striding over
    /// the bytes to copy (the count is known only on the device).
    ///
    /// # Safety
    /// `a.dst` must hold `a.max_rows * a.row_bytes` bytes of device memory, `a.even` and `a.odd`
    /// as many readable bytes each, `a.count` an `i32` and `a.parity` (unless 0) an `i64` of
    /// device memory, all valid until the kernel finishes; `a.row_bytes` a multiple of 4.
    pub unsafe fn launch_copy_counted_rows(
        &self,
        stream: &Arc<CudaStream>,
        a: CopyCountedRows,
    ) -> Result<(), KernelError> {
        let sms = stream
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .context("reading the SM count")?;
        let cfg = grid(sms.max(1) as u32);
        // SAFETY: upheld by the caller (see above); the kernel takes seven scalars.
        unsafe {
            stream
                .launch_builder(&self.copy_counted_rows)
                .arg(&a.dst)
                .arg(&a.even)
                .arg(&a.odd)
                .arg(&a.parity)
                .arg(&a.count)
                .arg(&a.row_bytes)
                .arg(&a.max_rows)
                .launch(cfg)
        }
        .context("launching epcomm_copy_counted_rows")?;
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

    /// Launches `op` (dispatch — or cached dispatch, per `args.flags` — or combine) with
    /// `blocks` blocks.
    ///
    /// # Safety
    /// Every address in `args` must be valid for the documented sizes until the kernel
    /// finishes, the symmetric buffer must be mapped on every peer, and every rank must launch
    /// the same op with the same `blocks` (the completion counters count blocks).
    pub unsafe fn launch_op(
        &self,
        op: Op,
        stream: &CudaStream,
        args: &OpArgs,
        blocks: u32,
    ) -> Result<(), KernelError> {
        let kernel = &self.ops[Op::ALL.iter().position(|&o| o == op).unwrap_or(0)];
        // SAFETY: upheld by the caller (see above).
        unsafe { kernel.launch(stream, args, blocks) }
    }

    /// A digest of the loaded kernel image: ranks compare it, so that they never run
    /// different kernel builds against each other.
    pub fn image_digest(&self) -> u64 {
        self.image_digest
    }

    /// How many blocks of every op kernel fit on the device at once (the lowest of them, the
    /// low-latency kernels with `ll_smem_bytes` of dynamic shared memory): a `Buffer` may not
    /// use more, since its waits need every block resident.
    pub fn max_coresident_blocks(
        &self,
        sms: u32,
        ll_smem_bytes: usize,
    ) -> Result<u32, KernelError> {
        let mut fit = u32::MAX;
        for op in &self.ops {
            let smem = if op.op.is_low_latency() {
                ll_smem_bytes
            } else {
                0
            };
            for f in std::iter::once(&op.f).chain(&op.one_kernel) {
                let per_sm = f
                    .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
                    .context("querying kernel occupancy")?;
                fit = fit.min(per_sm * sms);
            }
        }
        Ok(fit)
    }
}

/// FNV-1a, 64 bits: a stable digest of a kernel image (not a security hash).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
