//! [`HierarchicalBuffer`]: dispatch and combine across nodes, in two tiers.
//!
//! It has a flat [`Buffer`]'s surface ([`crate::ExpertParallel`]): the same inputs, a
//! [`Layout`] from its own [`HierarchicalBuffer::layout`] (the rail tier's), the same
//! [`Dispatched`] rows and [`Handle`]s (a two-tier handle holds both tiers' routings) and the
//! same [`crate::EpGraph`]s.
//!
//! A world of `N` nodes × `L` local ranks ([`Tiers`]; virtual nodes count as nodes) runs two
//! buffers on one stream:
//!
//! * the **rail** buffer over this rank's rail group (the rank with its local rank in every
//!   node, [`RankGroup::rail`]), whose "ranks" are nodes: each node holds `E / N` experts;
//! * the **node** buffer over this rank's node group ([`RankGroup::node`]), with the `E / N`
//!   experts of the node, `E / (N L)` per rank.
//!
//! **Dispatch** = a rail dispatch (each token crosses the rail **once per destination node**,
//! to the rank there with the source's local rank, its top-k ids turned into node-local ids and
//! the weights of other nodes' experts zeroed), then a node dispatch of what arrived (forwarded
//! over NVLink to the ranks of the node holding its experts). The node stage's token count is
//! the rail stage's receive count, read **on the device**: no host wait between the stages, no
//! global barrier under the Epoch schedule (each stage exchanges its counts with epoch-tagged
//! words among its group only). The rows a rank ends up with, their local top-k ids and
//! weights are the flat dispatch's (only their order differs: grouped by forwarding rank).
//!
//! **Combine** = a node combine (each forwarder sums its node's contributions to every token it
//! forwarded, in f32 in local-rank order, into one bf16 partial), then a rail combine (the
//! source sums the partials of every node in node order, f32, one rounding). The order and
//! precision are `epcomm_reference::hierarchical_combine_staged`'s with a bf16 rail.
//!
//! What a rank's own node receives also takes the two stages (a copy into its own rail receive
//! region, then the node stage): one extra local copy per token, in exchange for one code path.
//!
//! # Example
//!
//! One rank of a job over several hosts (or one host split into logical nodes with a spec
//! like `nvshmem:vnodes=2`):
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use epcomm::{
//!     BufferConfig, CombineInput, CombineOutput, DispatchInput, ExpertParallel, HierarchicalBuffer,
//!     RecvMode, XInput,
//! };
//! use epcomm_backends::TransportSpec;
//! use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
//! use half::bf16;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (num_tokens, hidden, top_k, num_experts) = (128, 7168, 8, 256);
//! let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
//! let ctx = CudaContext::new(boot.local_rank())?;
//! let transport = "nvshmem".parse::<TransportSpec>()?.build(ctx.clone(), boot)?;
//! let cfg = BufferConfig::new(4096, hidden, top_k, num_experts);
//! let mut buf = HierarchicalBuffer::new(ctx, transport, cfg)?;
//!
//! let stream = buf.stream().clone();
//! let x = stream.alloc_zeros::<bf16>(num_tokens * hidden)?;
//! let topk_idx = stream.clone_htod(&vec![0_i64; num_tokens * top_k])?;
//! let input = DispatchInput { x: XInput::Bf16(&x), topk_idx: &topk_idx, topk_weights: None };
//! // The same calls as a flat Buffer's (both implement epcomm::ExpertParallel).
//! let layout = buf.layout(&topk_idx, num_tokens)?;
//! let (rows, handle) = {
//!     let d = buf.dispatch(&input, &layout, RecvMode::HostSync)?;
//!     // ... the experts read d.recv_x_ptr() and write `y`, one row per received row ...
//!     (d.num_recv().expect("HostSync reports the count"), d.into_handle())
//! };
//! let y = stream.alloc_zeros::<bf16>(rows.max(1) * hidden)?;
//! let mut out = stream.alloc_zeros::<bf16>(num_tokens * hidden)?;
//! buf.combine(&CombineInput::new(&y), &handle, CombineOutput::new(&mut out))?;
//! buf.synchronize()?;
//! # Ok(())
//! # }
//! ```

mod graph;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use epcomm_topology::{RankGroup, Tiers};
use epcomm_transport::DynTransport;
use half::bf16;

use crate::buffer::{CombineInput, CombineOutput, DispatchInput, TierParts, XInput};
use crate::error::DriverContext;
use crate::handle::{Dispatched, Handle};
use crate::layout::{DeviceTokens, Layout};
use crate::stats::OpStats;

use crate::view::{DeviceArray, DeviceView};
use crate::{Buffer, BufferConfig, Error, ExpertParallel, RecvMode, Result, Tiering};

/// Per-tier wait attribution of one hierarchical op ([`HierarchicalBuffer::last_op_stats`]).
#[derive(Clone, Debug)]
pub struct HierStats {
    /// The rail tier (ranks of this rank's rail group, one per node).
    pub rail: OpStats,
    /// The node tier (the ranks of this rank's node).
    pub node: OpStats,
}

impl std::fmt::Display for HierStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rank, tier, skew) = crate::TierStats::late(self);
        writeln!(
            f,
            "late rank {rank} (on the {tier} tier, others waited up to {skew:?})"
        )?;
        write!(f, "rail tier: {}node tier: {}", self.rail, self.node)
    }
}

/// One rank's two-tier state: see the module docs.
#[derive(Debug)]
pub struct HierarchicalBuffer {
    tiers: Tiers,
    rail: Buffer,
    node: Buffer,
    /// `[rail receive rows][hidden]` bf16: the node stage's combine output (one partial per
    /// token this rank forwarded), the rail stage's combine input, which its kernels put from
    /// (so `cuMemAlloc` memory, which a NIC can register). Declared after the buffers: their
    /// memories drop their registrations of it first.
    partial_x: DeviceArray<bf16>,
    /// `[rail receive rows][top_k]` f32: the same for the weights.
    partial_w: DeviceArray<f32>,
}

impl HierarchicalBuffer {
    /// Creates this rank's two buffers over `transport`'s world split into its logical nodes
    /// (`cfg` as for [`Buffer::new`]: `num_experts` over the whole world). Collective: every
    /// rank of the world calls it with the same config.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `num_experts` (not a multiple of the world size) or
    /// `ll_max_tokens_per_rank` (low-latency ops run on a [`Buffer`] over the whole world);
    /// whatever [`Buffer::new`] returns for either stage.
    pub fn new(
        ctx: Arc<CudaContext>,
        transport: Arc<dyn DynTransport>,
        cfg: BufferConfig,
    ) -> Result<Self> {
        let world = transport.world();
        let tiers = Tiers::from(&world);
        let rank = world.rank();
        if !cfg.num_experts.is_multiple_of(tiers.world_size()) {
            return Err(Error::InvalidArgument {
                argument: "num_experts",
                rule: format!(
                    "must be a multiple of the world size {} (got {})",
                    tiers.world_size(),
                    cfg.num_experts
                ),
            });
        }
        let stream: Arc<CudaStream> = ctx.new_stream().context("creating the comm stream")?;
        let rail = Buffer::new_tier(
            ctx.clone(),
            transport.clone(),
            cfg.clone(),
            TierParts {
                group: RankGroup::rail(&tiers, rank)?,
                stream: stream.clone(),
                share_errors_with: None,
            },
        )?;
        let rows = rail.recv_capacity_rows();
        let mut node_cfg = cfg.clone();
        node_cfg.num_experts = cfg.num_experts / tiers.nodes();
        node_cfg.max_tokens_per_rank = rows;
        let node = Buffer::new_tier(
            ctx.clone(),
            transport,
            node_cfg,
            TierParts {
                group: RankGroup::node(&tiers, rank)?,
                stream: stream.clone(),
                share_errors_with: Some(&rail),
            },
        )?;
        let partial_x = DeviceArray::zeroed(&ctx, &stream, (rows * cfg.hidden).max(1))?;
        let partial_w = DeviceArray::zeroed(&ctx, &stream, (rows * cfg.top_k).max(1))?;
        Ok(Self {
            tiers,
            rail,
            node,
            partial_x,
            partial_w,
        })
    }

    /// The world as nodes × local ranks.
    pub fn tiers(&self) -> Tiers {
        self.tiers
    }

    /// The rail stage's buffer (its group: one rank per node).
    pub fn rail(&mut self) -> &mut Buffer {
        &mut self.rail
    }

    /// The node stage's buffer (its group: the ranks of this node).
    pub fn node(&mut self) -> &mut Buffer {
        &mut self.node
    }

    /// The node tier's token count: the rail handle's receive count, on the device.
    fn count_of(&self, rail: &Handle) -> DeviceTokens {
        DeviceTokens {
            ptr: rail.recv_prefix_ptr() + 4 * self.tiers.nodes() as u64,
            _owner: rail.inner.clone(),
        }
    }
}

impl ExpertParallel for HierarchicalBuffer {
    type Stats = HierStats;

    fn world_size(&self) -> usize {
        self.tiers.world_size()
    }

    fn capacity(&self) -> usize {
        self.node.recv_capacity_rows()
    }

    fn symmetric_bytes(&self) -> usize {
        self.rail.symmetric_bytes() + self.node.symmetric_bytes()
    }

    fn is_failed(&self) -> bool {
        self.rail.is_failed() || self.node.is_failed()
    }

    fn tiering(&self) -> Tiering {
        Tiering::TwoTier(self.tiers)
    }

    fn as_flat(&mut self) -> Option<&mut Buffer> {
        None
    }

    /// This rank's world rank.
    fn world_rank(&self) -> usize {
        self.rail.transport().world().rank()
    }

    /// The configuration it was created with (`num_experts` over the whole world; the rail
    /// tier runs with it as given).
    fn config(&self) -> &BufferConfig {
        self.rail.config()
    }

    /// The CUDA context both tiers run in.
    fn context(&self) -> &Arc<CudaContext> {
        self.rail.context()
    }

    /// The stream both stages run on.
    fn stream(&self) -> &Arc<CudaStream> {
        self.rail.stream()
    }

    /// The routing of `num_tokens` tokens (`topk_idx`: `[num_tokens][top_k]`, ids over all
    /// experts) for [`Self::dispatch`]: the rail tier's layout (which node gets each token); the
    /// node tier's is computed on the device from the forwarded rows during the dispatch.
    ///
    /// # Errors
    /// As [`Buffer::layout`].
    fn layout(&mut self, topk_idx: &dyn DevicePtr<i64>, num_tokens: usize) -> Result<Layout> {
        self.rail.layout(topk_idx, num_tokens)
    }

    /// A layout for [`Self::layout_into`] and [`Self::alloc_handle`], for batches of
    /// `num_tokens` tokens (as [`Buffer::alloc_layout`]).
    ///
    /// # Errors
    /// As [`Buffer::alloc_layout`].
    fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout> {
        self.rail.alloc_layout(num_tokens)
    }

    /// Recomputes `layout` (from [`Self::alloc_layout`]) in place from `topk_idx`, on the
    /// stream (as [`Buffer::layout_into`]).
    ///
    /// # Errors
    /// As [`Buffer::layout_into`].
    fn layout_into(&mut self, topk_idx: &dyn DevicePtr<i64>, layout: &Layout) -> Result<()> {
        self.rail.layout_into(topk_idx, layout)
    }

    /// Sends every token (`input`, routed by `layout` from [`Self::layout`]) to every rank
    /// holding one of its experts, through the rail and the node. Returns this rank's rows (the
    /// node stage's receive region) and a two-tier [`Handle`]. `mode` is the node stage's (the
    /// rail stage never waits on the host). Collective.
    ///
    /// Each call allocates the node tier's layout and handle (device arrays, once per call);
    /// a hot loop or a CUDA-graph capture allocates them once with [`Self::alloc_handle`] and
    /// dispatches with [`Self::dispatch_into`], which allocates no device memory.
    ///
    /// # Errors
    /// As [`Buffer::dispatch`], from either stage.
    fn dispatch(
        &mut self,
        input: &DispatchInput<'_>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>> {
        let weights = input.topk_weights.is_some();
        let (rail_handle, forwarded) = {
            let d = self.rail.dispatch(input, layout, RecvMode::WorstCase)?;
            let forwarded = Forwarded::of(&d, weights);
            (d.into_handle(), forwarded)
        };
        let count = self.count_of(&rail_handle);
        let rows = self.rail.recv_capacity_rows();
        let node_layout = self.node.alloc_layout_counted(rows, Some(count))?;
        let views = forwarded.views(rows, self.rail.config(), self.rail.stream());
        self.node.layout_into(&views.topk_idx, &node_layout)?;
        let input2 = views.input();
        let mut d = self.node.dispatch(&input2, &node_layout, mode)?;
        d.handle = Handle::two_tier(&rail_handle, &d.handle);
        Ok(d)
    }

    /// Allocates a two-tier handle for [`Self::dispatch_into`] over `layout` (from
    /// [`Self::alloc_layout`]): both tiers' handles and the node tier's layout, sized for the
    /// worst case (no allocation and no host wait in the dispatch: what a CUDA-graph capture
    /// records).
    ///
    /// # Errors
    /// As [`Buffer::alloc_handle`].
    fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle> {
        let rail = self.rail.alloc_handle(layout)?;
        let node_layout = self
            .node
            .alloc_layout_counted(self.rail.recv_capacity_rows(), Some(self.count_of(&rail)))?;
        let node = self.node.alloc_handle(&node_layout)?;
        Ok(Handle::two_tier(&rail, &node))
    }

    /// Dispatch into a handle from [`Self::alloc_handle`] (WorstCase sizes), routed by its
    /// layout as [`Self::layout_into`] last left it (as [`Buffer::dispatch_into`]); the node
    /// tier's layout is recomputed in place from the forwarded rows. Collective.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `handle` for a flat handle; as
    /// [`Buffer::dispatch_into`], from either tier.
    fn dispatch_into(
        &mut self,
        input: &DispatchInput<'_>,
        handle: &Handle,
    ) -> Result<Dispatched<'_>> {
        let (rail, node) = tiers_of(handle)?;
        let node_layout = Layout {
            inner: node.inner.layout.clone(),
        };
        let forwarded = {
            let d = self.rail.dispatch_into(input, &rail)?;
            Forwarded::of(&d, input.topk_weights.is_some())
        };
        let rows = self.rail.recv_capacity_rows();
        let views = forwarded.views(rows, self.rail.config(), self.rail.stream());
        self.node.layout_into(&views.topk_idx, &node_layout)?;
        let input2 = views.input();
        let mut d = self.node.dispatch_into(&input2, &node)?;
        d.handle = handle.clone();
        Ok(d)
    }

    /// Who waited for whom in the last hierarchical op, per tier: the rail tier's stats (its
    /// group: one rank per node; waits there are rail waits) and the node tier's (NVLink
    /// waits), both naming world ranks. **Collective**: every rank calls it after the same op.
    ///
    /// # Errors
    /// As [`Buffer::last_op_stats`].
    fn last_op_stats(&mut self) -> Result<Option<HierStats>> {
        let rail = self.rail.last_op_stats()?;
        let node = self.node.last_op_stats()?;
        Ok(match (rail, node) {
            (Some(rail), Some(node)) => Some(HierStats { rail, node }),
            _ => None,
        })
    }

    /// Sends new rows (`num_tokens` of them, as the handle's dispatch) along `handle`'s
    /// routing: no count exchange in either stage, no host wait. Collective.
    ///
    /// # Errors
    /// As [`Buffer::cached_dispatch`], from either stage.
    fn cached_dispatch(&mut self, x: &XInput<'_>, handle: &Handle) -> Result<Dispatched<'_>> {
        let (rail, node) = tiers_of(handle)?;
        let forwarded = {
            let d = self.rail.cached_dispatch(x, &rail)?;
            Forwarded::of(&d, false)
        };
        let rows = self.rail.recv_capacity_rows();
        let views = forwarded.views(rows, self.rail.config(), self.rail.stream());
        let x2 = views.x();
        let mut d = self.node.cached_dispatch(&x2, &node)?;
        d.handle = handle.clone();
        Ok(d)
    }

    /// Sends expert outputs back and reduces them: `y.y` holds one `[hidden]` bf16 row per row
    /// this rank received (the node stage's order), `out.out` gets `[num_tokens][hidden]` bf16
    /// per `epcomm_reference::hierarchical_combine_staged` (bf16 rail). `y_weights` /
    /// `out_weights` (`[rows][top_k]` / `[num_tokens][top_k]` f32) are summed the same way, in
    /// f32 throughout. Collective. The dispatch's outputs stay as they are unless `y` is
    /// [`CombineInput::consuming`] (as [`Buffer::combine`]: then the node stage may stage `y`
    /// over them); the rail stage's receive rows, which only this buffer reads, may be staged
    /// over.
    ///
    /// # Errors
    /// As [`Buffer::combine`], from either stage.
    fn combine(&mut self, y: &CombineInput<'_>, h: &Handle, out: CombineOutput<'_>) -> Result<()> {
        let (rail, node) = tiers_of(h)?;
        let with_w = y.y_weights.is_some();
        if with_w != out.out_weights.is_some() {
            return Err(Error::InvalidArgument {
                argument: "out_weights",
                rule: "must be given exactly when y_weights is".into(),
            });
        }
        let partial = CombineOutput {
            out: &mut self.partial_x,
            out_weights: with_w.then_some(&mut self.partial_w as &mut dyn DevicePtrMut<f32>),
        };
        self.node.combine(y, &node, partial)?;
        let partial = CombineInput {
            y: &self.partial_x,
            y_weights: with_w.then_some(&self.partial_w as &dyn DevicePtr<f32>),
            // The rail stage's receive rows were read only by the node dispatch, long done.
            consume_recv: true,
        };
        self.rail.combine(&partial, &rail, out)
    }

    /// Reports a failure either stage's kernels recorded ([`Buffer::check`]).
    ///
    /// # Errors
    /// The first stage's failure found.
    fn check(&mut self) -> Result<()> {
        self.rail.check()?;
        self.node.check()
    }

    /// Tears both tiers down (collective, like [`Buffer::destroy`]: every rank calls it), the
    /// rail tier first, and reports the first error.
    ///
    /// # Errors
    /// As [`Buffer::destroy`].
    fn destroy(self) -> Result<()> {
        let rail = self.rail.destroy();
        let node = self.node.destroy();
        rail.and(node)
    }

    /// Waits for every issued op and reports failures ([`Buffer::synchronize`]).
    ///
    /// # Errors
    /// As [`Buffer::synchronize`].
    fn synchronize(&mut self) -> Result<()> {
        self.rail.synchronize()?;
        self.node.synchronize()
    }
}

/// A two-tier handle's tiers (rail, node), or the error naming a flat one.
fn tiers_of(handle: &Handle) -> Result<(Handle, Handle)> {
    handle.tiers().ok_or_else(|| Error::InvalidArgument {
        argument: "handle",
        rule: "is a flat handle (from a Buffer): pass a HierarchicalBuffer's own handle".into(),
    })
}

/// Where the rail stage left this rank's forwarded rows (device addresses).
struct Forwarded {
    fp8: bool,
    x: u64,
    scales: u64,
    topk_idx: Option<u64>,
    topk_weights: Option<u64>,
}

impl Forwarded {
    fn of(d: &Dispatched<'_>, weights: bool) -> Self {
        Self {
            fp8: d.recv_scales_ptr().is_some(),
            x: d.recv_x_ptr(),
            scales: d.recv_scales_ptr().unwrap_or(0),
            topk_idx: d.recv_topk_idx_ptr(),
            topk_weights: d.recv_topk_weights_ptr().filter(|_| weights),
        }
    }

    /// Views of `rows` rows (the rail receive capacity).
    fn views(&self, rows: usize, cfg: &BufferConfig, stream: &Arc<CudaStream>) -> ForwardViews {
        let (h, k) = (cfg.hidden, cfg.top_k);
        // SAFETY: every view addresses the rail buffer's receive region (current parity),
        // which holds `rows` rows of each array and lives as long as the HierarchicalBuffer;
        // the node stage's ops that read it are queued on the same stream before the rail
        // stage's next dispatch can write it.
        unsafe {
            ForwardViews {
                x: if self.fp8 {
                    XView::Fp8(
                        DeviceView::new(self.x, rows * h, stream),
                        DeviceView::new(self.scales, rows * (h / 128), stream),
                    )
                } else {
                    XView::Bf16(DeviceView::new(self.x, rows * h, stream))
                },
                topk_idx: DeviceView::new(self.topk_idx.unwrap_or(0), rows * k, stream),
                topk_weights: self
                    .topk_weights
                    .map(|w| DeviceView::new(w, rows * k, stream)),
            }
        }
    }
}

/// Forwarded rows: bf16, or e4m3 bytes with their scales.
enum XView {
    Bf16(DeviceView<bf16>),
    Fp8(DeviceView<u8>, DeviceView<f32>),
}

/// [`Forwarded`] as the node stage's inputs.
struct ForwardViews {
    x: XView,
    topk_idx: DeviceView<i64>,
    topk_weights: Option<DeviceView<f32>>,
}

impl ForwardViews {
    fn x(&self) -> XInput<'_> {
        match &self.x {
            XView::Bf16(x) => XInput::Bf16(x),
            XView::Fp8(x, scales) => XInput::Fp8 { x, scales },
        }
    }

    fn input(&self) -> DispatchInput<'_> {
        DispatchInput {
            x: self.x(),
            topk_idx: &self.topk_idx,
            topk_weights: self.topk_weights.as_ref().map(|w| w as &dyn DevicePtr<f32>),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::TierStats;

    fn stats(rank: usize, waits: Vec<Vec<u64>>, ranks: Vec<usize>) -> OpStats {
        OpStats {
            op: "dispatch",
            op_seq: 1,
            rank,
            total: Duration::from_micros(100),
            sending: Duration::from_micros(10),
            waits: waits
                .into_iter()
                .map(|r| r.into_iter().map(Duration::from_micros).collect())
                .collect(),
            ranks,
            counts_ready: None,
        }
    }

    #[test]
    fn late_names_the_world_rank_and_the_tier_with_the_longest_wait() {
        // 2 nodes x 2, seen from rank 1: rail group {1, 3}, node group {0, 1}.
        // Rail: rank 1 waited 900 us for rank 3. Node: rank 0 waited 50 us for rank 1.
        let h = HierStats {
            rail: stats(0, vec![vec![0, 900], vec![0, 0]], vec![1, 3]),
            node: stats(1, vec![vec![0, 50], vec![0, 0]], vec![0, 1]),
        };
        assert_eq!(h.late(), (3, "rail", Duration::from_micros(900)));
        let text = h.to_string();
        assert!(text.starts_with("late rank 3 (on the rail tier"), "{text}");
        // A longer NVLink wait wins.
        let h = HierStats {
            rail: stats(0, vec![vec![0, 10], vec![0, 0]], vec![1, 3]),
            node: stats(1, vec![vec![0, 0], vec![700, 0]], vec![0, 1]),
        };
        assert_eq!(h.late(), (0, "node", Duration::from_micros(700)));
        // Rank 0 waited 902 us in the node for rank 1, which spent 900 us of it waiting for
        // its rail peer 3: rank 3 is named.
        let h = HierStats {
            rail: stats(0, vec![vec![0, 900], vec![0, 0]], vec![1, 3]),
            node: stats(1, vec![vec![0, 902], vec![0, 0]], vec![0, 1]),
        };
        assert_eq!(h.late(), (3, "rail", Duration::from_micros(902)));
    }
}
