//! [`ExpertParallel`]: the one surface of a flat [`Buffer`] and a two-tier
//! [`crate::HierarchicalBuffer`].
//!
//! Both take the same inputs ([`DispatchInput`], a [`Layout`] from their own `layout`), return
//! the same [`Dispatched`] rows and [`Handle`]s, capture the same [`EpGraph`]s and fail with
//! the same [`Error`]s; code written against the trait (a bench, a test, a binding) serves
//! either tiering. What only one of them has stays on its type: the low-latency ops and the
//! in-place combine on [`Buffer`] (reach them through [`ExpertParallel::as_flat`]), the tiers'
//! own buffers on [`crate::HierarchicalBuffer`].

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use epcomm_topology::Tiers;

use crate::buffer::graph;
use crate::{
    Buffer, BufferConfig, CombineInput, CombineOutput, DeviceBytes, DispatchInput, Dispatched,
    EpGraph, Handle, HierStats, Layout, OpStats, RecvArray, RecvMode, Result, XInput,
};

/// How a buffer spans the world: one tier, or a rail tier between nodes and a node tier inside
/// each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiering {
    /// One all-to-all over the whole world ([`Buffer`]).
    Flat,
    /// Rail then node ([`crate::HierarchicalBuffer`]), over this world of nodes × local ranks.
    TwoTier(Tiers),
}

/// Who waited for whom in one op, per tier ([`ExpertParallel::last_op_stats`]).
pub trait TierStats: std::fmt::Display + std::fmt::Debug {
    /// Each tier's statistics, named (`"world"` for a flat buffer; `"rail"` then `"node"`).
    fn tiers(&self) -> Vec<(&'static str, &OpStats)>;

    /// The world rank the others waited for longest on any tier, the tier, and how long.
    fn late(&self) -> (usize, &'static str, Duration) {
        self.tiers()
            .into_iter()
            .map(|(tier, s)| (s.world_rank(s.late_rank()), tier, s.skew()))
            .reduce(|a, b| if b.2 > a.2 { b } else { a })
            .unwrap_or((0, "world", Duration::ZERO))
    }
}

impl TierStats for OpStats {
    fn tiers(&self) -> Vec<(&'static str, &OpStats)> {
        vec![("world", self)]
    }
}

impl TierStats for HierStats {
    fn tiers(&self) -> Vec<(&'static str, &OpStats)> {
        vec![("rail", &self.rail), ("node", &self.node)]
    }

    /// The longest wait of either tier, followed back across the tiers: the node stage of a
    /// rank starts when its rail stage ends, so a rank its node waited for while it waited (at
    /// least half as long) for a rail peer is late because of that peer, and the rail's late
    /// rank is named.
    fn late(&self) -> (usize, &'static str, Duration) {
        let of = |s: &OpStats| (s.world_rank(s.late_rank()), s.skew());
        let ((rail_rank, rail_skew), (node_rank, node_skew)) = (of(&self.rail), of(&self.node));
        if rail_skew >= node_skew {
            return (rail_rank, "rail", rail_skew);
        }
        let rail = &self.rail;
        let held_on_rail = (0..rail.ranks.len())
            .find(|&i| rail.world_rank(i) == node_rank)
            .and_then(|i| rail.waits.get(i))
            .and_then(|row| row.iter().max().copied())
            .unwrap_or_default();
        if held_on_rail * 2 >= node_skew {
            (rail_rank, "rail", node_skew)
        } else {
            (node_rank, "node", node_skew)
        }
    }
}

/// The expert-parallel all-to-all, flat or two-tier: see the module docs. Every method has the
/// contract of the [`Buffer`] method of the same name; [`crate::HierarchicalBuffer`] documents where
/// its two stages add to it.
pub trait ExpertParallel: graph::Tiers {
    /// What [`Self::last_op_stats`] reports.
    type Stats: TierStats;

    /// The configuration (`num_experts` over the whole world).
    fn config(&self) -> &BufferConfig;
    /// The CUDA context.
    fn context(&self) -> &Arc<CudaContext>;
    /// The stream every op runs on.
    fn stream(&self) -> &Arc<CudaStream>;
    /// This rank's world rank.
    fn world_rank(&self) -> usize;
    /// The ranks of the world.
    fn world_size(&self) -> usize;
    /// The most rows one dispatch can deliver to this rank (what a handle's
    /// [`Handle::capacity`] is sized for).
    fn capacity(&self) -> usize;
    /// Bytes of symmetric memory this rank holds (every tier's).
    fn symmetric_bytes(&self) -> usize;
    /// Whether an earlier failure made it unusable (any tier's).
    fn is_failed(&self) -> bool;
    /// How it spans the world (the order of the rows it delivers and of its reduction follow:
    /// see [`crate::HierarchicalBuffer`]).
    fn tiering(&self) -> Tiering;
    /// The flat buffer, when this is one (its low-latency and in-place ops).
    fn as_flat(&mut self) -> Option<&mut Buffer>;

    /// [`Buffer::layout`].
    fn layout(&mut self, topk_idx: &dyn DevicePtr<i64>, num_tokens: usize) -> Result<Layout>;
    /// [`Buffer::alloc_layout`].
    fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout>;
    /// [`Buffer::layout_into`].
    fn layout_into(&mut self, topk_idx: &dyn DevicePtr<i64>, layout: &Layout) -> Result<()>;
    /// [`Buffer::dispatch`].
    fn dispatch(
        &mut self,
        input: &DispatchInput<'_>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>>;
    /// [`Buffer::alloc_handle`].
    fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle>;
    /// [`Buffer::dispatch_into`].
    fn dispatch_into(
        &mut self,
        input: &DispatchInput<'_>,
        handle: &Handle,
    ) -> Result<Dispatched<'_>>;
    /// [`Buffer::cached_dispatch`].
    fn cached_dispatch(&mut self, x: &XInput<'_>, handle: &Handle) -> Result<Dispatched<'_>>;
    /// [`Buffer::combine`].
    fn combine(&mut self, y: &CombineInput<'_>, h: &Handle, out: CombineOutput<'_>) -> Result<()>;
    /// [`Buffer::copy_received`]: the latest dispatch's received `array` into `dst`, as many
    /// rows as the device counted, from the region copy the device's dispatch count names.
    ///
    /// # Safety
    /// As [`Buffer::copy_received`].
    unsafe fn copy_received(
        &mut self,
        h: &Handle,
        array: RecvArray,
        dst: DeviceBytes,
    ) -> Result<()> {
        let (tier, h) = self.receiving_tier(h)?;
        // SAFETY: the caller's contract is the tier's.
        unsafe { tier.copy_received(&h, array, dst) }
    }
    /// [`Buffer::capture`]: one graph of every tier's ops.
    fn capture<F>(&mut self, ops: F) -> Result<EpGraph>
    where
        Self: Sized,
        F: FnMut(&mut Self) -> Result<()>,
    {
        graph::capture(self, ops)
    }
    /// [`Buffer::replay`].
    fn replay(&mut self, graph: &EpGraph) -> Result<()>
    where
        Self: Sized,
    {
        graph::replay(self, graph)
    }
    /// [`Buffer::last_op_stats`], per tier.
    fn last_op_stats(&mut self) -> Result<Option<Self::Stats>>;
    /// [`Buffer::check`].
    fn check(&mut self) -> Result<()>;
    /// [`Buffer::synchronize`].
    fn synchronize(&mut self) -> Result<()>;
    /// [`Buffer::destroy`].
    fn destroy(self) -> Result<()>
    where
        Self: Sized;
}

/// Forwards the trait's op methods to [`Buffer`]'s inherent methods of the same name and
/// contract ([`crate::HierarchicalBuffer`] implements them in the trait itself).
macro_rules! forward_ops {
    () => {
        fn layout(&mut self, topk_idx: &dyn DevicePtr<i64>, num_tokens: usize) -> Result<Layout> {
            Self::layout(self, topk_idx, num_tokens)
        }
        fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout> {
            Self::alloc_layout(self, num_tokens)
        }
        fn layout_into(&mut self, topk_idx: &dyn DevicePtr<i64>, layout: &Layout) -> Result<()> {
            Self::layout_into(self, topk_idx, layout)
        }
        fn dispatch(
            &mut self,
            input: &DispatchInput<'_>,
            layout: &Layout,
            mode: RecvMode,
        ) -> Result<Dispatched<'_>> {
            Self::dispatch(self, input, layout, mode)
        }
        fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle> {
            Self::alloc_handle(self, layout)
        }
        fn dispatch_into(
            &mut self,
            input: &DispatchInput<'_>,
            handle: &Handle,
        ) -> Result<Dispatched<'_>> {
            Self::dispatch_into(self, input, handle)
        }
        fn cached_dispatch(&mut self, x: &XInput<'_>, handle: &Handle) -> Result<Dispatched<'_>> {
            Self::cached_dispatch(self, x, handle)
        }
        fn last_op_stats(&mut self) -> Result<Option<Self::Stats>> {
            Self::last_op_stats(self)
        }
        fn check(&mut self) -> Result<()> {
            Self::check(self)
        }
        fn synchronize(&mut self) -> Result<()> {
            Self::synchronize(self)
        }
        fn destroy(self) -> Result<()> {
            Self::destroy(self)
        }
    };
}

impl ExpertParallel for Buffer {
    type Stats = OpStats;

    fn config(&self) -> &BufferConfig {
        Buffer::config(self)
    }
    fn context(&self) -> &Arc<CudaContext> {
        Buffer::context(self)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        Buffer::stream(self)
    }
    fn world_rank(&self) -> usize {
        self.transport().world().rank()
    }
    fn world_size(&self) -> usize {
        self.transport().world().world_size()
    }
    fn capacity(&self) -> usize {
        self.recv_capacity_rows()
    }
    fn symmetric_bytes(&self) -> usize {
        Buffer::symmetric_bytes(self)
    }
    fn is_failed(&self) -> bool {
        Buffer::is_failed(self)
    }
    fn tiering(&self) -> Tiering {
        Tiering::Flat
    }
    fn as_flat(&mut self) -> Option<&mut Buffer> {
        Some(self)
    }

    forward_ops!();
    fn combine(&mut self, y: &CombineInput<'_>, h: &Handle, out: CombineOutput<'_>) -> Result<()> {
        Buffer::combine(self, y, h, out)
    }
}
