//! The routing a dispatch leaves behind ([`Handle`]) and the view of its received rows
//! ([`Dispatched`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use epcomm_topology::RowFormat;
use epcomm_transport::memory::copy_dtoh;

use crate::Result;
use crate::buffer::driver::copy_async;
use crate::error::DriverContext;
use crate::layout::LayoutInner;

/// Routing of one dispatch, reused by combine and cached dispatch (device memory; cheap to
/// clone). Valid only with the buffer that produced it: a [`crate::Buffer`] (one tier) or a
/// [`crate::HierarchicalBuffer`] (two tiers; the handle then holds both tiers' routings).
///
/// The receive side (`num_recv`, `capacity`, the receive prefix, the source indices, the rows
/// per local expert) is always the tier that delivered this rank's rows: the only tier of a
/// flat buffer, the node tier of a two-tier one (whose sources are the ranks of this node that
/// forwarded the rows). [`Self::num_tokens`] is the batch the dispatch sent.
#[derive(Clone, Debug)]
pub struct Handle {
    /// The routing of the tier that delivered this rank's rows.
    pub(crate) inner: Arc<HandleInner>,
    /// A two-tier handle's first (rail) tier routing; `None` for a flat handle.
    pub(crate) rail: Option<Arc<HandleInner>>,
}

#[derive(Debug)]
pub(crate) struct HandleInner {
    pub(crate) layout: Arc<LayoutInner>,
    /// `[world]` first row of this rank's tokens in every destination.
    pub(crate) send_offsets: CudaSlice<i32>,
    /// `[world + 1]` first received row from every source; `[world]` = rows received.
    pub(crate) recv_prefix: CudaSlice<i32>,
    /// `[max_rows]` source token index of every received row.
    pub(crate) recv_src_idx: CudaSlice<i32>,
    /// `[experts_per_rank]` rows per local expert.
    pub(crate) recv_expert_counts: CudaSlice<i32>,
    /// With rail forwarding: `[nodes]` tokens each source node's rail peer sent through this
    /// rank (a cached dispatch forwards as many).
    pub(crate) recv_node_counts: Option<CudaSlice<i32>>,
    /// Rows received, when the host knows it (HostSync).
    pub(crate) num_recv: Option<usize>,
    /// The received rows this rank sent itself, when the host knows them (HostSync).
    pub(crate) own_rows: Option<std::ops::Range<usize>>,
    /// Upper bound of rows received (the capacity the dispatch ran with).
    pub(crate) max_rows: usize,
    pub(crate) buffer_id: u64,
    /// The layout generation the latest non-cached dispatch into this handle routed with
    /// ([`HandleInner::NOT_DISPATCHED`] before the first).
    pub(crate) routing: std::sync::atomic::AtomicU64,
}

impl HandleInner {
    /// `routing` of a handle no dispatch wrote yet.
    pub(crate) const NOT_DISPATCHED: u64 = u64::MAX;

    /// The most rows the handle's dispatch received: the count if the host knows it
    /// (HostSync), the capacity the dispatch ran with otherwise.
    pub(crate) fn rows_bound(&self) -> usize {
        self.num_recv.unwrap_or(self.max_rows)
    }

    /// Fails unless a dispatch wrote this handle with its layout's current routing: a cached
    /// dispatch or combine along a handle whose layout was recomputed since would mix new
    /// token slots with old offsets.
    pub(crate) fn check_routing(&self) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let routing = self.routing.load(Relaxed);
        let rule = if routing == Self::NOT_DISPATCHED {
            "no dispatch wrote this handle yet: dispatch with it first"
        } else if routing != self.layout.generation.load(Relaxed) {
            "its layout was recomputed (layout_into) after the dispatch that wrote it: dispatch \
             again with the new routing before a cached dispatch or combine"
        } else {
            return Ok(());
        };
        Err(crate::Error::InvalidArgument {
            argument: "handle",
            rule: rule.into(),
        })
    }
}

impl Handle {
    /// A flat (one-tier) handle over `inner`.
    pub(crate) fn flat(inner: Arc<HandleInner>) -> Self {
        Self { inner, rail: None }
    }

    /// A two-tier handle: the rail tier's routing, then the node tier's.
    pub(crate) fn two_tier(rail: &Handle, node: &Handle) -> Self {
        Self {
            inner: node.inner.clone(),
            rail: Some(rail.inner.clone()),
        }
    }

    /// A two-tier handle's tiers as flat handles (rail, node); `None` for a flat handle.
    pub(crate) fn tiers(&self) -> Option<(Handle, Handle)> {
        let rail = self.rail.clone()?;
        Some((Self::flat(rail), Self::flat(self.inner.clone())))
    }

    /// Whether it holds two tiers' routings (it came from a [`crate::HierarchicalBuffer`]).
    pub fn is_two_tier(&self) -> bool {
        self.rail.is_some()
    }

    /// Tokens of the batch the handle routes (the batch the dispatch sent).
    pub fn num_tokens(&self) -> usize {
        self.rail.as_ref().unwrap_or(&self.inner).layout.num_tokens
    }

    /// Rows received, if known on the host (HostSync dispatch).
    pub fn num_recv(&self) -> Option<usize> {
        self.inner.num_recv
    }

    /// The most rows a dispatch into this handle can receive: size `y` of a combine with it
    /// (`capacity() * hidden` values) when the receive count is not known on the host
    /// (WorstCase / Bounded dispatch, graph capture).
    pub fn capacity(&self) -> usize {
        self.inner.max_rows
    }

    /// Device address of the `[group + 1]` i32 receive prefix (first received row per source
    /// rank of the delivering tier; the last element is the number of rows received; a flat
    /// buffer's group is its world), written by the handle's dispatch
    /// on the buffer's stream: for bindings that use the count on the device (e.g. to mask
    /// padding rows) without a host wait.
    pub fn recv_prefix_ptr(&self) -> u64 {
        let prefix = &self.inner.recv_prefix;
        prefix.device_ptr(prefix.stream()).0
    }

    /// Device address of the i32 count of rows the handle's dispatch received (the receive
    /// prefix's last element), for bindings that read it on the device.
    pub fn recv_count_ptr(&self) -> u64 {
        let groups = self.inner.recv_prefix.len().saturating_sub(1);
        self.recv_prefix_ptr() + 4 * groups as u64
    }

    /// Device address of the `[max_rows]` int32 source token index of each received row (the
    /// dispatch writes the first `num_recv` of them on the buffer's stream): for bindings that
    /// view it as an array of their own, stream-ordered after the dispatch.
    pub fn recv_src_idx_ptr(&self) -> u64 {
        let idx = &self.inner.recv_src_idx;
        idx.device_ptr(idx.stream()).0
    }

    /// Reads the number of received rows from the device (waits for the dispatch).
    pub fn num_recv_from_device(&self) -> Result<usize> {
        let s = self.inner.recv_prefix.stream().clone();
        let p = s
            .clone_dtoh(&self.inner.recv_prefix)
            .context("reading recv_prefix")?;
        Ok(p.last().copied().unwrap_or(0).max(0) as usize)
    }

    /// `[world + 1]` first received row per source rank (waits for the dispatch).
    pub fn recv_prefix_to_host(&self) -> Result<Vec<i32>> {
        let s = self.inner.recv_prefix.stream().clone();
        s.clone_dtoh(&self.inner.recv_prefix)
            .context("reading recv_prefix")
    }

    /// Source token index of every received row (waits for the dispatch).
    pub fn recv_src_idx_to_host(&self) -> Result<Vec<i32>> {
        let n = self.num_recv_from_device()?;
        let s = self.inner.recv_src_idx.stream().clone();
        let mut v = s
            .clone_dtoh(&self.inner.recv_src_idx)
            .context("reading recv_src_idx")?;
        v.truncate(n);
        Ok(v)
    }

    /// Rows per local expert (waits for the dispatch).
    pub fn num_recv_per_local_expert(&self) -> Result<Vec<i32>> {
        let s = self.inner.recv_expert_counts.stream().clone();
        s.clone_dtoh(&self.inner.recv_expert_counts)
            .context("reading expert counts")
    }
}

/// Element type of received rows: the row type of `epcomm_topology` (`Bf16`, or `Fp8` e4m3
/// with one f32 scale per 128 channels), under the name this crate has always used.
pub use epcomm_topology::RowDtype as RecvDtype;

/// The result of a dispatch: views of the received rows in this rank's symmetric buffer plus
/// the [`Handle`]. It borrows the `Buffer`, so no other op can be issued while it lives; copy
/// what must outlive it, or keep only the handle ([`Dispatched::into_handle`]). The rows stay
/// until the next dispatch, or until a combine that stages `y` over them: a
/// [`crate::CombineInput::consuming`] combine, or any combine under an explicit
/// [`crate::CombineStaging::CopyEngine`] config.
///
/// Row order: by source rank, then source token index (deterministic).
#[derive(Debug)]
pub struct Dispatched<'b> {
    pub(crate) stream: &'b Arc<CudaStream>,
    /// The buffer's launch mark (None while a graph is recorded): a copy into the receive rows
    /// is epcomm's work on the stream, which failure handling and teardown wait for.
    pub(crate) launch_mark: Option<&'b cudarc::driver::CudaEvent>,
    pub(crate) handle: Handle,
    /// Format of the received rows (hidden size and element type).
    pub(crate) row: RowFormat,
    pub(crate) top_k: usize,
    pub(crate) recv_x: u64,
    pub(crate) recv_scales: u64,
    pub(crate) recv_topk_idx: Option<u64>,
    pub(crate) recv_topk_weights: Option<u64>,
    pub(crate) num_recv_per_local_expert: Option<Vec<usize>>,
}

impl Dispatched<'_> {
    /// The routing, for combine and cached dispatch.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Drops the views, keeps the routing.
    pub fn into_handle(self) -> Handle {
        self.handle
    }

    /// Rows received, if known on the host (HostSync).
    pub fn num_recv(&self) -> Option<usize> {
        self.handle.inner.num_recv
    }

    /// Rows per local expert, if known on the host (HostSync).
    pub fn num_recv_per_local_expert(&self) -> Option<&[usize]> {
        self.num_recv_per_local_expert.as_deref()
    }

    /// Element type of the rows.
    pub fn dtype(&self) -> RecvDtype {
        self.row.dtype()
    }

    /// Device address of the received rows (`[rows][hidden]`, bf16 or e4m3 bytes).
    pub fn recv_x_ptr(&self) -> u64 {
        self.recv_x
    }

    /// Device address of the received FP8 scales (`[rows][hidden / 128]` f32), if FP8.
    pub fn recv_scales_ptr(&self) -> Option<u64> {
        (self.dtype() == RecvDtype::Fp8).then_some(self.recv_scales)
    }

    /// Device address of the received local top-k ids (`[rows][top_k]` i64, -1 where the expert
    /// is elsewhere), if they travelled (not for cached dispatch).
    pub fn recv_topk_idx_ptr(&self) -> Option<u64> {
        self.recv_topk_idx
    }

    /// Device address of the received top-k weights (`[rows][top_k]` f32, 0 where the expert is
    /// elsewhere), if they travelled.
    pub fn recv_topk_weights_ptr(&self) -> Option<u64> {
        self.recv_topk_weights
    }

    fn rows(&self) -> Result<usize> {
        match self.num_recv() {
            Some(n) => Ok(n),
            None => self.handle.num_recv_from_device(),
        }
    }

    /// Copies `y` (`[rows][hidden]` bf16, device) over the received rows, stream-ordered, for
    /// [`crate::Buffer::combine_in_place`] (BF16 dispatch only). Writing the expert output
    /// straight to [`Self::recv_x_ptr`] avoids even this copy.
    pub fn copy_into_recv_x(&self, y: &dyn cudarc::driver::DevicePtr<half::bf16>) -> Result<()> {
        let (rows_cap, hidden) = (self.handle.inner.max_rows, self.row.hidden());
        if self.dtype() != RecvDtype::Bf16 || y.len() > rows_cap * hidden {
            return Err(crate::Error::InvalidArgument {
                argument: "y",
                rule: format!(
                    "needs a BF16 dispatch and at most {} values (got {})",
                    rows_cap * hidden,
                    y.len()
                ),
            });
        }
        if y.is_empty() {
            return Ok(());
        }
        let (src, _g) = y.device_ptr(self.stream);
        // SAFETY: the destination is this rank's receive region, which holds max_rows rows of
        // hidden bf16 values (checked above) and is kept alive by the borrowed Buffer; the copy
        // is ordered on the buffer's stream after the dispatch that filled it.
        unsafe { copy_async(self.recv_x, src, y.len() * 2, self.stream) }
            .context("copying y into the receive rows")?;
        if let Some(mark) = self.launch_mark {
            // Best effort, as for the kernels (`Buffer::wait_launched` stays bounded).
            let _ = mark.record(self.stream);
        }
        Ok(())
    }

    /// Copies the received rows' raw bytes to the host (waits for the dispatch).
    pub fn recv_x_bytes_to_host(&self) -> Result<Vec<u8>> {
        let n = self.rows()? * self.row.x_bytes();
        // SAFETY: the rows lie in this rank's symmetric buffer (capacity checked by the kernel),
        // which the borrowed Buffer keeps alive.
        Ok(unsafe { copy_dtoh::<u8>(self.stream, self.recv_x, n) }?)
    }

    /// Copies the received rows as bf16 (Bf16 dispatch only).
    pub fn recv_x_bf16_to_host(&self) -> Result<Vec<half::bf16>> {
        let bytes = self.recv_x_bytes_to_host()?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    /// Copies the received scales (FP8 only; empty otherwise).
    pub fn recv_scales_to_host(&self) -> Result<Vec<f32>> {
        let Some(p) = self.recv_scales_ptr() else {
            return Ok(Vec::new());
        };
        let n = self.rows()? * self.row.num_scales();
        // SAFETY: as for recv_x.
        Ok(unsafe { copy_dtoh::<f32>(self.stream, p, n) }?)
    }

    /// Copies the received local top-k ids (empty if they did not travel).
    pub fn recv_topk_idx_to_host(&self) -> Result<Vec<i64>> {
        let Some(p) = self.recv_topk_idx else {
            return Ok(Vec::new());
        };
        let n = self.rows()? * self.top_k;
        // SAFETY: as for recv_x.
        Ok(unsafe { copy_dtoh::<i64>(self.stream, p, n) }?)
    }

    /// Copies the received top-k weights (empty if they did not travel).
    pub fn recv_topk_weights_to_host(&self) -> Result<Vec<f32>> {
        let Some(p) = self.recv_topk_weights else {
            return Ok(Vec::new());
        };
        let n = self.rows()? * self.top_k;
        // SAFETY: as for recv_x.
        Ok(unsafe { copy_dtoh::<f32>(self.stream, p, n) }?)
    }
}
