//! [`Buffer::new`]: the collective setup of one rank's buffer.
//!
//! Order (every rank runs it with the same config): local checks (config, world, SMs, schedule,
//! routes), kernel load and residency check, the config agreement over the bootstrap (before any
//! peer memory is touched), the check of ranks sharing a GPU (`sharing`), module binding, symmetric allocation and peer bases, the small
//! device/mapped-host blocks, and a final barrier: nobody writes into a peer's buffer before
//! that peer has zeroed and mapped it.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaStream, sys};
use epcomm_kernels::abi::{self, ErrorRecord};
use epcomm_kernels::{Image, OpModule};
use epcomm_topology::{BufferPlan, Parity, RankGroup, RegionKind, Route, RoutePlan};
use epcomm_transport::{DeviceBuffer, DynTransport, MappedHostBuffer, SymmetricMemory};

use super::graph::CaptureState;
use super::health::Health;
use super::ops::LowLatencyState;
use super::sharing::{GpuPlacement, check_shared_gpus, ll_blocks};
use super::{Buffer, Launcher, Memory, Place, Sequence};
use crate::agreement::Fingerprint;
use crate::error::DriverContext;
use crate::{BufferConfig, Error, Result};

/// Source of [`Buffer`] ids (process-unique, never reused).
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

impl Buffer {
    /// Creates this rank's buffer over `transport` (e.g. from `epcomm_backends::TransportSpec`;
    /// one transport can serve several buffers, one after another or side by side).
    /// Collective: every rank must call it with the same config and the same kind of transport
    /// (checked: [`Error::ConfigMismatch`]).
    pub fn new(
        ctx: Arc<CudaContext>,
        transport: Arc<dyn DynTransport>,
        cfg: BufferConfig,
    ) -> Result<Self> {
        Self::create(ctx, transport, cfg, None)
    }

    /// [`Self::new`] as one tier of a hierarchical buffer ([`TierParts`]).
    pub(crate) fn new_tier(
        ctx: Arc<CudaContext>,
        transport: Arc<dyn DynTransport>,
        cfg: BufferConfig,
        parts: TierParts<'_>,
    ) -> Result<Self> {
        Self::create(ctx, transport, cfg, Some(parts))
    }

    fn create(
        ctx: Arc<CudaContext>,
        transport: Arc<dyn DynTransport>,
        cfg: BufferConfig,
        parts: Option<TierParts<'_>>,
    ) -> Result<Self> {
        let (group, stream, errors_of) = match parts {
            Some(p) => (Some(p.group), Some(p.stream), p.share_errors_with),
            None => (None, None, None),
        };
        cfg.validate()?;
        let layout = transport.world();
        let caps = transport.capabilities();
        let invalid = |argument, rule: String| Err(Error::InvalidArgument { argument, rule });
        let group = match group {
            Some(g) => g,
            None => RankGroup::whole(layout.world_size(), layout.rank())?,
        };
        group.check_within(layout.world_size())?;
        if group.member(group.rank())? != layout.rank() {
            return invalid(
                "group",
                format!(
                    "must contain this rank ({}) at its group rank {}",
                    layout.rank(),
                    group.rank()
                ),
            );
        }
        let whole = group.is_whole(layout.world_size());
        if !whole && cfg.ll_max_tokens_per_rank != 0 {
            return invalid(
                "ll_max_tokens_per_rank",
                "must be 0 for a buffer over a group of the world (low-latency ops run on \
                 buffers over the whole world)"
                    .into(),
            );
        }
        let (world, rank) = (group.size(), group.rank());
        // Every rule that needs no device (crate::rules, shared with the tools that check a
        // config without a GPU).
        let crate::rules::Checked {
            routes,
            plan,
            ll_smem_words,
        } = crate::rules::check(&cfg, world, &layout, &caps)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .context("reading the SM count")? as u32;
        if cfg.num_sms > sms {
            return invalid(
                "num_sms",
                format!("the device has {sms} SMs (asked for {})", cfg.num_sms),
            );
        }
        let stream = match stream {
            Some(s) => s,
            None => ctx.new_stream().context("creating the comm stream")?,
        };
        // The family's image; NVSHMEM's built against the release its host library is.
        let image = Image::for_runtime(caps.kernel_family, transport.device_library_dyn())?;
        let kernels = OpModule::load_image(&ctx, &stream, image)?;
        // Waits across blocks and ranks need every block resident (kernels also launch
        // cooperatively, so a grid that cannot be co-resident fails instead of hanging).
        let fit = kernels.max_coresident_blocks(sms, ll_smem_words * 4)?;
        // The low-latency SMs matter only where low-latency memory is planned.
        let ll_num_sms = if cfg.ll_max_tokens_per_rank > 0 {
            cfg.ll_num_sms
        } else {
            0
        };
        if ll_num_sms > 0
            && caps.kernel_family == epcomm_kernels::KernelFamily::CpuProxy
            && ll_num_sms > cfg.num_sms
        {
            return invalid(
                "ll_num_sms",
                format!(
                    "at most num_sms = {} on a CPU-proxy transport (asked for {ll_num_sms}): \
                     the proxy's copies may need SMs beside the kernels that wait for them",
                    cfg.num_sms
                ),
            );
        }
        if ll_num_sms > sms.min(fit) {
            return invalid(
                "ll_num_sms",
                format!(
                    "at most {} blocks of the low-latency kernels fit on this GPU at once \
                     (asked for {}; 0 takes every SM this rank may use)",
                    sms.min(fit),
                    ll_num_sms
                ),
            );
        }
        if cfg.num_sms > fit {
            return invalid(
                "num_sms",
                format!(
                    "at most {fit} blocks of the dispatch/combine kernels fit on this GPU at once \
                     (asked for {})",
                    cfg.num_sms
                ),
            );
        }
        // Every rank must agree on everything that shapes the protocol, before any peer
        // memory is touched (docs/troubleshooting.md).
        let fingerprint = fingerprint(&cfg, &kernels, caps.name, world, layout.gpus_per_node())
            .with(
                "group",
                format!("{world} ranks {} apart", group.pe_stride()),
            );
        let all = transport
            .bootstrap()
            .all_gather("epcomm-buffer-config", &fingerprint.encode())?;
        fingerprint.agree(&all)?;
        // Ranks sharing a GPU under MPS must fit there together (`sharing`): checked over every
        // rank's placement, so every rank refuses together, before any allocation.
        let placement = GpuPlacement {
            uuid: ctx
                .uuid()
                .context("reading the GPU's UUID")?
                .bytes
                .map(|b| b as u8),
            mps: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
                .is_ok_and(|v| v != 0),
            sms,
            fit,
            num_sms: cfg.num_sms,
            ll_num_sms,
        };
        let placements = transport
            .bootstrap()
            .all_gather("epcomm-buffer-gpus", &placement.encode())?
            .iter()
            .enumerate()
            .map(|(r, b)| GpuPlacement::decode(r, b))
            .collect::<Result<Vec<_>>>()?;
        check_shared_gpus(&placements)?;
        // The CPU proxy's copies may need SMs of their own (a copy within one GPU can run as a
        // kernel): its low-latency kernels, which wait for those copies, keep to num_sms.
        let ll_blocks =
            if ll_num_sms == 0 && caps.kernel_family == epcomm_kernels::KernelFamily::CpuProxy {
                cfg.num_sms
            } else {
                ll_blocks(&placements, ll_num_sms)
            };
        // SAFETY: the module was loaded in `ctx` from the image of the transport's family and
        // `kernels` keeps it loaded; the binding is declared before `kernels` in `Buffer`, so it
        // is dropped first.
        let module_binding = unsafe { transport.bind_module_dyn(kernels.cu_module()?) }?;
        // World-wide symmetric memory; the backend sets up its machinery (the CPU proxy's copy
        // streams) only for the ranks this buffer's ops reach.
        let members: Vec<usize> = group.members().collect();
        let mem = transport.alloc_symmetric_for_dyn(plan.total_bytes() as usize, &members)?;
        // SAFETY: the module is live (as above) and was loaded in `ctx`, `stream`'s context;
        // the channel's machinery belongs to `mem`, which the buffer keeps until its teardown,
        // after the last launch.
        let bound = unsafe { mem.bind_device_channel(kernels.cu_module()?, &stream) }?;
        if caps.kernel_family.needs_device_channel() && !bound {
            return invalid(
                "transport",
                format!(
                    "{} declares the {:?} kernel family, whose kernels need a device channel, but \
                     its memory bound none (SymmetricMemory::bind_device_channel)",
                    caps.name, caps.kernel_family
                ),
            );
        }
        let all_bases = peer_bases(&routes, mem.as_ref())?;
        let (bases, remote_mask) = group_view(&all_bases, routes.put_signal_mask(), &group)?;
        let peer_bases = DeviceBuffer::zeroed(&ctx, world * 8)?;
        peer_bases.write(&stream, 0, &bases)?;
        let (err_claim, err_record) = match errors_of {
            Some(b) => (b.health.err_claim.clone(), b.health.err_record.clone()),
            None => (
                Arc::new(DeviceBuffer::zeroed(&ctx, 8)?),
                Arc::new(MappedHostBuffer::zeroed(&ctx, size_of::<ErrorRecord>())?),
            ),
        };
        let host_counts = MappedHostBuffer::zeroed(&ctx, (4 + cfg.num_experts / world) * 8)?;
        let seq_state = DeviceBuffer::zeroed(&ctx, size_of::<abi::SeqState>())?;
        let parity_stride = parity_stride(&plan)?;
        let last_launch = match errors_of {
            Some(b) => b.health.last_launch.clone(),
            None => Arc::new(
                ctx.new_event(None)
                    .context("creating the launch-mark event")?,
            ),
        };
        let buffer = Self {
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            place: Place {
                rank,
                world,
                group,
                routes,
                remote_mask,
                plan,
                parity_stride,
            },
            launcher: Launcher {
                ctx,
                stream,
                module_binding: ManuallyDrop::new(module_binding),
                kernels: ManuallyDrop::new(kernels),
            },
            health: Health {
                err_claim,
                err_record,
                failed: None,
                last_op: None,
                last_launch,
                torn_down: false,
                leaked: false,
            },
            seq: Sequence::default(),
            capture: CaptureState::default(),
            latest_dispatch: None,
            ll: LowLatencyState {
                pending: None,
                smem_words: ll_smem_words,
                blocks: ll_blocks,
            },
            memory: Memory {
                mem: ManuallyDrop::new(mem),
                peer_bases: ManuallyDrop::new(peer_bases),
                host_counts: ManuallyDrop::new(host_counts),
                seq_state: ManuallyDrop::new(seq_state),
                transport,
            },
        };
        // The setup's own stream work (peer bases, proxy channel): what teardown waits for
        // before the first op.
        buffer.mark_launch();
        // Nobody may write into a peer's buffer before that peer has zeroed and mapped it.
        buffer
            .memory
            .transport
            .bootstrap()
            .barrier("epcomm-buffer-ready")?;
        Ok(buffer)
    }
}

/// What makes a buffer one tier of a hierarchical buffer.
pub(crate) struct TierParts<'a> {
    /// The ranks it spans (every member creates it, in the same order relative to its other
    /// buffers; so does every other rank of the world, for its own group: symmetric allocation
    /// and the final barrier are world-wide). Kernels see them as `0..group.size()`.
    pub(crate) group: RankGroup,
    /// The stream its ops run on (shared with the other tier: one order for both).
    pub(crate) stream: Arc<CudaStream>,
    /// A buffer whose failure words it shares: a failure recorded by either one's kernels
    /// stops every later op of both (their prologues read the same claim word) and is
    /// reported by both. It also shares that buffer's launch mark (they share the stream):
    /// teardown of either waits for the launches of both.
    pub(crate) share_errors_with: Option<&'a Buffer>,
}

/// What every rank must agree on (see `agreement`): everything that shapes the protocol. The
/// timeout is per rank and not included. The ranks per logical node and the route policy fix
/// every rank's route plan, so the plans agree too: rank `a` reaches `b` by put/signal exactly
/// when `b` reaches `a` that way, which the CPU-proxy kernels rely on (a receiver finishes the
/// metadata of its put/signal sources, docs/proxy.md).
fn fingerprint(
    cfg: &BufferConfig,
    kernels: &OpModule,
    transport: &str,
    world: usize,
    ranks_per_node: usize,
) -> Fingerprint {
    Fingerprint::new()
        .with("abi_version", abi::ABI_VERSION)
        .with("kernel image", format!("{:016x}", kernels.image_digest()))
        .with("transport", transport)
        .with("world", world)
        .with("ranks_per_node", ranks_per_node)
        .with("num_sms", cfg.num_sms)
        // As Buffer::new uses it: without low-latency memory the value plays no part.
        .with(
            "ll_num_sms",
            if cfg.ll_max_tokens_per_rank > 0 {
                cfg.ll_num_sms
            } else {
                0
            },
        )
        .with("max_tokens_per_rank", cfg.max_tokens_per_rank)
        .with("hidden", cfg.hidden)
        .with("top_k", cfg.top_k)
        .with("num_experts", cfg.num_experts)
        .with("ll_max_tokens_per_rank", cfg.ll_max_tokens_per_rank)
        .with("schedule", cfg.schedule.name())
        .with("routes", cfg.routes.name())
        .with("combine_staging", cfg.combine_staging.name())
        .with("ll_masking", cfg.ll_masking)
        .with(
            "rail_ring",
            cfg.rail_ring.map_or("none".to_string(), |r| {
                format!("{} slots of {} entries", r.slots(), r.chunk_rows())
            }),
        )
        .with("rail_forward_sms", cfg.rail_forward_sms)
}

/// The distance between the two parity copies of every per-parity region. Kernels find a
/// region's other copy at this one fixed distance, so the plan must agree for every region.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `buffer plan` when one region's copies are elsewhere.
fn parity_stride(plan: &BufferPlan) -> Result<u64> {
    let stride = |k| plan.region(k, Parity::Odd).offset - plan.region(k, Parity::Even).offset;
    let parity_stride = stride(RegionKind::DispatchX);
    if let Some(k) = RegionKind::PER_PARITY
        .iter()
        .find(|&&k| stride(k) != parity_stride)
    {
        return Err(Error::InvalidArgument {
            argument: "buffer plan",
            rule: format!("{k:?} parity copies are not {parity_stride} bytes apart"),
        });
    }
    Ok(parity_stride)
}

/// The group's share of the world's peer bases and put/signal mask, by group rank: entry `i`
/// and bit `i` are those of world rank `group.member(i)`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `group` when a member is not a rank of `bases`.
fn group_view(bases: &[u64], world_mask: u64, group: &RankGroup) -> Result<(Vec<u64>, u64)> {
    let mut view = Vec::with_capacity(group.size());
    let mut mask = 0u64;
    for (i, m) in group.members().enumerate() {
        let Some(&base) = bases.get(m) else {
            return Err(Error::InvalidArgument {
                argument: "group",
                rule: format!(
                    "member {m} is not a rank of this {}-rank world",
                    bases.len()
                ),
            });
        };
        view.push(base);
        if (world_mask >> m) & 1 != 0 {
            mask |= 1 << i;
        }
    }
    Ok((view, mask))
}

/// The address kernels use for every rank's buffer: the mapping for a peer reached by stores,
/// this rank's own symmetric address for a peer reached by put/signal (NVSHMEM translates it
/// per PE).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `world` when the plan says stores but the transport did not
/// map the peer.
fn peer_bases(routes: &RoutePlan, mem: &dyn SymmetricMemory) -> Result<Vec<u64>> {
    let me = routes.world().rank();
    routes
        .peers()
        .iter()
        .map(|p| match p.route {
            _ if p.peer == me => Ok(mem.local_base()),
            Route::PutSignal => Ok(mem.local_base()),
            Route::Store => mem.peer_base(p.peer).ok_or_else(|| Error::InvalidArgument {
                argument: "world",
                rule: format!(
                    "rank {} ({}) is not mapped into rank {me}, so stores cannot reach it",
                    p.peer,
                    p.tier.name()
                ),
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use epcomm_topology::{RoutePolicy, WorldLayout};

    /// Addresses as a transport reports them (0: not mapped).
    #[derive(Debug)]
    struct Bases(Vec<u64>, u64);

    impl SymmetricMemory for Bases {
        fn len(&self) -> usize {
            1
        }
        fn local_base(&self) -> u64 {
            self.1
        }
        fn peer_base(&self, peer: usize) -> Option<u64> {
            self.0.get(peer).copied().filter(|&b| b != 0)
        }
    }

    #[test]
    fn a_group_sees_its_members_bases_and_routes() {
        use epcomm_topology::Tiers;
        // 2 nodes x 2 seen from rank 1: world bases 0x10..0x40, ranks 2 and 3 by put/signal.
        let bases = [0x10, 0x20, 0x30, 0x40];
        let tiers = Tiers::new(2, 2).unwrap();
        let rail = RankGroup::rail(&tiers, 1).unwrap(); // ranks 1, 3
        assert_eq!(
            group_view(&bases, 0b1100, &rail).unwrap(),
            (vec![0x20, 0x40], 0b10)
        );
        let node = RankGroup::node(&tiers, 1).unwrap(); // ranks 0, 1
        assert_eq!(
            group_view(&bases, 0b1100, &node).unwrap(),
            (vec![0x10, 0x20], 0)
        );
        let whole = RankGroup::whole(4, 1).unwrap();
        assert_eq!(
            group_view(&bases, 0b1100, &whole).unwrap(),
            (bases.to_vec(), 0b1100)
        );
        // A group reaching past the world is an error, not a panic.
        let big = RankGroup::rail(&Tiers::new(3, 2).unwrap(), 5).unwrap(); // ranks 1, 3, 5
        let e = group_view(&bases, 0, &big).unwrap_err().to_string();
        assert!(
            e.contains("member 5 is not a rank of this 4-rank world"),
            "{e}"
        );
    }

    #[test]
    fn plans_keep_one_parity_stride() {
        let plan = BufferPlan::new(8, 4096, 7168, 8, 256).unwrap();
        let stride = parity_stride(&plan).unwrap();
        let x = |p| plan.region(RegionKind::DispatchX, p).offset;
        assert_eq!(stride, x(Parity::Odd) - x(Parity::Even));
        assert!(stride > 0);
    }

    #[test]
    fn peer_bases_follow_the_route_plan() {
        use Route::*;
        let one_node = WorldLayout::new(3, 1, 3).unwrap();
        let all_mapped = Bases(vec![0x10, 0x20, 0x30], 0x20);
        let auto = RoutePlan::new(&one_node, &[Store], RoutePolicy::Auto).unwrap();
        assert_eq!(
            peer_bases(&auto, &all_mapped).unwrap(),
            vec![0x10, 0x20, 0x30]
        );
        // Put/signal everywhere: every peer addressed by my own base.
        let ps = RoutePlan::new(&one_node, &Route::ALL, RoutePolicy::PutSignal).unwrap();
        assert_eq!(peer_bases(&ps, &all_mapped).unwrap(), vec![0x20; 3]);
        assert_eq!(ps.put_signal_mask(), 0b101);
        // Another (virtual) node: the unmapped peers are planned as put/signal.
        let split = WorldLayout::with_virtual_nodes(4, 1, 4, 2).unwrap();
        let mem = Bases(vec![0x10, 0x20, 0, 0], 0x20);
        let plan = RoutePlan::new(&split, &Route::ALL, RoutePolicy::Auto).unwrap();
        assert_eq!(
            peer_bases(&plan, &mem).unwrap(),
            vec![0x10, 0x20, 0x20, 0x20]
        );
        assert_eq!(plan.put_signal_mask(), 0b1100);
        // A peer planned for stores that the transport did not map is an error.
        let unmapped = Bases(vec![0, 0x20, 0x30], 0x20);
        let err = peer_bases(&auto, &unmapped).unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 0 (NVLink domain) is not mapped"),
            "{err}"
        );
    }
}
