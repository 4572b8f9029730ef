//! The layout op: routing statistics of `topk_idx` on the GPU ([`Layout`]).
//!
//! The layout kernel is local (no peer memory, no sequence number): it writes only the
//! layout's own arrays, and records an invalid expert id into the error record, which the next
//! op reports ([`crate::Error::InvalidExpert`]). A layout is tied to the buffer that made it
//! and carries a generation, bumped at every launch, that handles compare against.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::DevicePtr;

use crate::Result;
use crate::buffer::Buffer;
use crate::buffer::health::note_launch;
use crate::buffer::pointers::check_device_ptr;
use crate::buffer::validate::exact_len;
use crate::error::DriverContext;
use crate::layout::{DeviceTokens, Layout, LayoutInner};

impl Buffer {
    /// Computes the routing of `topk_idx` (`[num_tokens][top_k]`, -1 = none) on the GPU.
    /// Invalid ids are reported by the next op ([`crate::Error::InvalidExpert`]).
    pub fn layout(&mut self, topk_idx: &dyn DevicePtr<i64>, num_tokens: usize) -> Result<Layout> {
        self.check_ready()?;
        let layout = self.alloc_layout(num_tokens)?;
        self.layout_into(topk_idx, &layout)?;
        Ok(layout)
    }

    /// Allocates the device arrays of a layout for `num_tokens` tokens (for [`Self::layout_into`],
    /// e.g. before a CUDA-graph capture, which must not allocate).
    pub fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout> {
        self.alloc_layout_counted(num_tokens, None)
    }

    /// [`Self::alloc_layout`] for at most `num_tokens` tokens, the batch's own count being
    /// `device_tokens` (when given): the layout kernel and every op along the layout read it
    /// on the device.
    pub(crate) fn alloc_layout_counted(
        &mut self,
        num_tokens: usize,
        device_tokens: Option<DeviceTokens>,
    ) -> Result<Layout> {
        self.check_tokens(num_tokens)?;
        let (world, e) = (self.place.world, self.cfg.num_experts);
        // One node, or the rail forwarding's nodes (whose per-token node slots it keeps).
        let nodes = world / self.gpus_per_node();
        // SAFETY: every element is written by the layout kernel before anything reads it.
        let counts = unsafe { self.launcher.stream.alloc::<u32>(world + e + nodes) }
            .context("allocating layout counts")?;
        // SAFETY: as above.
        let token_slot = unsafe {
            self.launcher
                .stream
                .alloc::<i32>((num_tokens * world).max(1))
        }
        .context("allocating token slots")?;
        // SAFETY: as above.
        let status =
            unsafe { self.launcher.stream.alloc::<u32>(1) }.context("allocating layout status")?;
        let token_node_slot = match self.place.plan.forwarding() {
            // SAFETY: as above.
            Some(_) => Some(
                unsafe {
                    self.launcher
                        .stream
                        .alloc::<i32>((num_tokens * nodes).max(1))
                }
                .context("allocating token node slots")?,
            ),
            None => None,
        };
        Ok(Layout {
            inner: Arc::new(LayoutInner {
                counts,
                token_slot,
                token_node_slot,
                status,
                num_tokens,
                device_tokens,
                world,
                num_experts: e,
                nodes,
                buffer_id: self.id,
                generation: AtomicU64::new(0),
            }),
        })
    }

    /// Recomputes `layout` in place from `topk_idx` (same number of tokens). A handle that an
    /// earlier dispatch wrote with this layout is stale from here on: a cached dispatch or
    /// combine with it fails with [`crate::Error::InvalidArgument`] until a dispatch writes it
    /// again.
    pub fn layout_into(&mut self, topk_idx: &dyn DevicePtr<i64>, layout: &Layout) -> Result<()> {
        self.check_ready()?;
        let l = self.own_layout(&layout.inner)?;
        // A recording replays into the layout's arrays: the graph owns them.
        self.keep_alive(layout.inner.clone());
        let (num_tokens, k) = (l.num_tokens, self.cfg.top_k);
        exact_len(
            "topk_idx",
            topk_idx.len(),
            "must hold num_tokens * top_k",
            num_tokens * k,
            "ids",
        )?;
        let s = &self.launcher.stream;
        let (idx_ptr, _g0) = topk_idx.device_ptr(s);
        let (counts_ptr, _g1) = l.counts.device_ptr(s);
        let (slot_ptr, _g2) = l.token_slot.device_ptr(s);
        let (status_ptr, _g3) = l.status.device_ptr(s);
        let node_slot = l.token_node_slot.as_ref().map(|n| n.device_ptr(s));
        let mut args = self.layout_args(num_tokens, idx_ptr, counts_ptr, slot_ptr, status_ptr);
        args.num_tokens_ptr = l.device_tokens.as_ref().map_or(0, |d| d.ptr);
        args.token_node_slot = node_slot.as_ref().map_or(0, |p| p.0);
        // SAFETY: all addresses are live allocations of the sizes the kernel expects for this
        // shape (counts: world + E + nodes, token_slot: T * world, token_node_slot: T * nodes
        // or null, status: 1, topk_idx: T * K);
        // the layout's arrays are owned by `layout`, which outlives the launch (stream order).
        unsafe { self.launcher.kernels.launch_layout(s, &args) }?;
        note_launch(&self.health.last_launch, s, self.capture.recording);
        l.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Computes `layout` in place from a routing given by ranks (DeepEP's dispatch without
    /// `topk_idx`): `in_rank` (`[num_tokens][world]` bytes, nonzero: the token goes to that
    /// rank; a torch bool tensor's bytes) and `tokens_per_expert` (`[num_experts]` i32, the
    /// top-k entries per expert, reported to the receivers as they are: their per-expert
    /// receive counts). Slots are assigned as [`Self::layout_into`] does (token order per
    /// rank). Dispatch along it with [`Self::dispatch_rows`]. Stale handles as for
    /// [`Self::layout_into`].
    pub fn layout_from_ranks_into(
        &mut self,
        in_rank: &dyn DevicePtr<u8>,
        tokens_per_expert: &dyn DevicePtr<i32>,
        layout: &Layout,
    ) -> Result<()> {
        self.check_ready()?;
        let l = self.own_layout(&layout.inner)?;
        self.keep_alive(layout.inner.clone());
        let num_tokens = l.num_tokens;
        exact_len(
            "is_token_in_rank",
            in_rank.len(),
            "must hold num_tokens * world",
            num_tokens * self.place.world,
            "flags",
        )?;
        exact_len(
            "num_tokens_per_expert",
            tokens_per_expert.len(),
            "must hold num_experts",
            self.cfg.num_experts,
            "counts",
        )?;
        let s = &self.launcher.stream;
        let (in_ptr, _g0) = in_rank.device_ptr(s);
        let (per_expert_ptr, _g1) = tokens_per_expert.device_ptr(s);
        let (counts_ptr, _g2) = l.counts.device_ptr(s);
        let (slot_ptr, _g3) = l.token_slot.device_ptr(s);
        let (status_ptr, _g4) = l.status.device_ptr(s);
        let dev = self.launcher.ctx.ordinal();
        check_device_ptr(
            "is_token_in_rank",
            in_ptr,
            num_tokens * self.place.world,
            1,
            dev,
        )?;
        check_device_ptr(
            "num_tokens_per_expert",
            per_expert_ptr,
            self.cfg.num_experts * 4,
            4,
            dev,
        )?;
        for (argument, ptr, len) in [
            ("is_token_in_rank", in_ptr, num_tokens * self.place.world),
            (
                "num_tokens_per_expert",
                per_expert_ptr,
                self.cfg.num_experts,
            ),
        ] {
            if ptr == 0 && len > 0 {
                return Err(crate::Error::InvalidArgument {
                    argument,
                    rule: format!("holds {len} elements at the null device address"),
                });
            }
        }
        let mut args = self.layout_args(num_tokens, 0, counts_ptr, slot_ptr, status_ptr);
        // The kernel takes the given routing when `in_rank` is not null: with no tokens (an
        // empty array may have no address) it gets the layout's own slots, never read.
        args.in_rank = if in_ptr == 0 { slot_ptr } else { in_ptr };
        args.expert_counts = per_expert_ptr;
        args.num_tokens_ptr = l.device_tokens.as_ref().map_or(0, |d| d.ptr);
        let node_slot = l.token_node_slot.as_ref().map(|n| n.device_ptr(s));
        args.token_node_slot = node_slot.as_ref().map_or(0, |p| p.0);
        // SAFETY: all addresses are live allocations of the sizes the kernel expects for this
        // shape (counts: world + E + nodes, token_slot: T * world, token_node_slot: T * nodes
        // or null, status: 1, in_rank: T *
        // world, expert_counts: E; lengths and addresses checked above, in_rank never null);
        // with in_rank set the kernel never reads topk_idx. The layout's arrays are owned by
        // `layout`, which outlives the launch.
        unsafe { self.launcher.kernels.launch_layout(s, &args) }?;
        note_launch(&self.health.last_launch, s, self.capture.recording);
        l.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
