//! The Python classes over [`Session`]: `Session`, `Layout`, `Handle` and `Dispatch`.
//!
//! Arrays cross as `(address, element count)` tuples. The caller is the `epcomm` package
//! (`epcomm/buffer.py`), which passes the `data_ptr()` and `numel()` of contiguous CUDA
//! tensors on the session's GPU and keeps each tensor referenced until the buffer's stream is
//! done with it (a synchronous op makes torch's stream wait for the buffer's; an asynchronous
//! one calls `record_stream`). That is the contract of every `unsafe` call below.
//!
//! Every method that may block (the rendezvous, the HostSync wait, synchronize, destroy,
//! statistics) runs without the GIL.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use epcomm::{DeviceBytes, Handle, Layout, LlFormat, LlScalesLayout, OpStats, RecvArray};
use epcomm_bootstrap::BootstrapConfig;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::{detached, to_pyerr};
use crate::borrowed::RawArray;
use crate::error::BindError;
use crate::options::{BufferOptions, seconds};
use crate::session::{DispatchOut, LlDispatchOut, Rows, Session, XArrays};

/// An array argument: `(address, element count)`.
type Arr = (u64, usize);

fn raw(a: Arr) -> RawArray {
    RawArray::new(a.0, a.1)
}

/// One rank's buffer (see the crate docs of `epcomm-py`).
#[pyclass(module = "epcomm._native", name = "Session")]
pub(crate) struct PySession {
    inner: Mutex<Session>,
    /// What never changes, readable while an op holds the lock.
    facts: Facts,
}

/// The session's fixed properties.
struct Facts {
    stream_handle: u64,
    device: usize,
    rank: usize,
    world_size: usize,
    capacity: usize,
    symmetric_bytes: usize,
    transport: String,
    /// `(schedule, routes, num_sms, timeout_s)`.
    config: (String, String, u32, f64),
    /// `ll_max_tokens_per_rank` (0: no low-latency memory).
    ll_max_tokens: usize,
}

impl Facts {
    fn of(s: &Session) -> Result<Self, BindError> {
        let c = s.config()?;
        Ok(Self {
            stream_handle: s.stream_handle(),
            device: s.device(),
            rank: s.rank()?,
            world_size: s.world_size()?,
            capacity: s.capacity(),
            symmetric_bytes: s.symmetric_bytes(),
            transport: s.spec().to_string(),
            config: (
                c.schedule.to_string(),
                c.routes.to_string(),
                c.num_sms,
                c.timeout.as_secs_f64(),
            ),
            ll_max_tokens: c.ll_max_tokens_per_rank,
        })
    }
}

/// A layout: the routing statistics of one batch (device memory of the session).
#[pyclass(module = "epcomm._native", name = "Layout", frozen)]
pub(crate) struct PyLayout {
    inner: Layout,
}

/// The routing one dispatch left, for cached dispatch and combine.
#[pyclass(module = "epcomm._native", name = "Handle", frozen)]
pub(crate) struct PyHandle {
    inner: Handle,
}

/// Where a low-latency dispatch's receive arrays lie.
#[pyclass(module = "epcomm._native", name = "LlDispatch", frozen)]
pub(crate) struct PyLlDispatch {
    out: LlDispatchOut,
}

/// What a dispatch returned.
#[pyclass(module = "epcomm._native", name = "Dispatch", frozen)]
pub(crate) struct PyDispatch {
    out: DispatchOut,
}

impl PySession {
    fn lock(&self) -> MutexGuard<'_, Session> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The bootstrap of an explicit rendezvous: `(master_addr, master_port, rank, world_size,
/// local_rank, local_world_size, timeout_s)`.
type BootstrapArgs = (String, u16, usize, usize, usize, usize, f64);

fn bootstrap_config(b: BootstrapArgs) -> Result<BootstrapConfig, BindError> {
    let (master_addr, master_port, rank, world_size, local_rank, local_world_size, t) = b;
    Ok(BootstrapConfig {
        master_addr,
        master_port,
        rank,
        world_size,
        local_rank,
        local_world_size,
        timeout: seconds("bootstrap_timeout", t)?,
    })
}

fn rows(mode: &str, bound: usize, handle: Option<&PyHandle>) -> Result<Rows, BindError> {
    match (mode, handle) {
        ("host_sync", None) => Ok(Rows::HostSync),
        ("bounded", None) => Ok(Rows::Bounded(bound)),
        ("into", Some(h)) => Ok(Rows::Into(h.inner.clone())),
        _ => Err(BindError::InvalidArgument {
            argument: "mode",
            rule: format!(
                "must be host_sync or bounded without a handle, or into with one (got {mode:?}, \
                 handle {})",
                if handle.is_some() { "given" } else { "absent" }
            ),
        }),
    }
}

fn region(name: &str) -> Result<RecvArray, BindError> {
    match name {
        "x" => Ok(RecvArray::X),
        "scales" => Ok(RecvArray::Scales),
        "topk_idx" => Ok(RecvArray::TopkIdx),
        "topk_weights" => Ok(RecvArray::TopkWeights),
        other => Err(BindError::InvalidArgument {
            argument: "region",
            rule: format!("must be x, scales, topk_idx or topk_weights (got {other:?})"),
        }),
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &OpStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("op", s.op)?;
    d.set_item("op_seq", s.op_seq)?;
    d.set_item("rank", s.rank)?;
    d.set_item("total", s.total.as_secs_f64())?;
    d.set_item("sending", s.sending.as_secs_f64())?;
    let waits: Vec<Vec<f64>> = s
        .waits
        .iter()
        .map(|row| row.iter().map(Duration::as_secs_f64).collect())
        .collect();
    d.set_item("waits", waits)?;
    d.set_item("late_rank", s.late_rank())?;
    d.set_item("skew", s.skew().as_secs_f64())?;
    d.set_item("text", s.to_string())?;
    Ok(d)
}

#[pymethods]
impl PySession {
    /// Joins the group and creates this rank's buffer on GPU `device` (collective).
    /// `bootstrap`: `(master_addr, master_port, rank, world_size, local_rank,
    /// local_world_size, timeout_s)`, or None to read the launcher's environment variables.
    #[new]
    #[pyo3(signature = (device, max_tokens_per_rank, hidden, top_k, num_experts, num_sms,
                        transport, schedule, routes, timeout, bootstrap=None,
                        ll_max_tokens_per_rank=0, ll_masking=false, two_tier=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: usize,
        max_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        num_experts: usize,
        num_sms: u32,
        transport: String,
        schedule: String,
        routes: String,
        timeout: f64,
        bootstrap: Option<BootstrapArgs>,
        ll_max_tokens_per_rank: usize,
        ll_masking: bool,
        two_tier: bool,
    ) -> PyResult<Self> {
        let options = BufferOptions {
            max_tokens_per_rank,
            hidden,
            top_k,
            num_experts,
            num_sms,
            transport,
            schedule,
            routes,
            timeout_s: timeout,
            ll_max_tokens_per_rank,
            ll_masking,
            two_tier,
        };
        let (session, facts) = detached(py, move || {
            let boot = bootstrap.map(bootstrap_config).transpose()?;
            let session = Session::new(device, boot, &options)?;
            let facts = Facts::of(&session)?;
            Ok((session, facts))
        })?;
        Ok(Self {
            inner: Mutex::new(session),
            facts,
        })
    }

    /// The buffer's CUDA stream (`CUstream`) as an int.
    #[getter]
    fn stream_handle(&self) -> u64 {
        self.facts.stream_handle
    }

    /// The GPU ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.facts.device
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.facts.rank
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.facts.world_size
    }

    /// Rows a dispatch can receive at most.
    #[getter]
    fn capacity(&self) -> usize {
        self.facts.capacity
    }

    /// Bytes of symmetric memory per rank.
    #[getter]
    fn symmetric_bytes(&self) -> usize {
        self.facts.symmetric_bytes
    }

    /// The transport spec.
    #[getter]
    fn transport(&self) -> String {
        self.facts.transport.clone()
    }

    /// `(schedule, routes, num_sms, timeout_s)` of the buffer's config.
    fn config(&self) -> (String, String, u32, f64) {
        self.facts.config.clone()
    }

    /// Most tokens per rank of one low-latency dispatch (0: no low-latency memory).
    #[getter]
    fn ll_max_tokens_per_rank(&self) -> usize {
        self.facts.ll_max_tokens
    }

    /// The op number of the low-latency op whose receive phase is pending, else None.
    #[getter]
    fn ll_pending(&self) -> Option<u64> {
        self.lock().ll_status().1
    }

    /// `(peer, tier, route)` for every rank.
    fn route_plan(&self, py: Python<'_>) -> PyResult<Vec<(usize, String, String)>> {
        self.lock().route_plan().map_err(|e| to_pyerr(py, e))
    }

    /// Whether an earlier failure (or destroy) made the buffer unusable.
    #[getter]
    fn is_failed(&self) -> bool {
        self.lock().is_failed()
    }

    /// Dispatches launched so far.
    #[getter]
    fn dispatches(&self) -> u64 {
        self.lock().dispatches()
    }

    /// A layout for `num_tokens` tokens (uncomputed: see `layout_into`).
    fn alloc_layout(&self, py: Python<'_>, num_tokens: usize) -> PyResult<PyLayout> {
        let inner = detached(py, || self.lock().alloc_layout(num_tokens))?;
        Ok(PyLayout { inner })
    }

    /// Computes `layout` from `topk_idx` (`[T][top_k]` int64).
    fn layout_into(&self, py: Python<'_>, topk_idx: Arr, layout: &PyLayout) -> PyResult<()> {
        let layout = layout.inner.clone();
        // SAFETY: the module's contract (see the module docs): a live tensor's address and
        // length, kept referenced until the stream work is done.
        detached(py, || unsafe {
            self.lock().layout_into(raw(topk_idx), &layout)
        })
    }

    /// Computes `layout` from a routing given by ranks: `in_rank` (`[T][world]` bytes, a bool
    /// tensor) and `tokens_per_expert` (`[E]` int32).
    fn layout_from_ranks_into(
        &self,
        py: Python<'_>,
        in_rank: Arr,
        tokens_per_expert: Arr,
        layout: &PyLayout,
    ) -> PyResult<()> {
        let layout = layout.inner.clone();
        // SAFETY: the module's contract (see the module docs): live tensors' addresses and
        // lengths, kept referenced until the stream work is done.
        detached(py, || unsafe {
            self.lock()
                .layout_from_ranks_into(raw(in_rank), raw(tokens_per_expert), &layout)
        })
    }

    /// A capacity-sized handle for `dispatch(mode="into")`.
    fn alloc_handle(&self, py: Python<'_>, layout: &PyLayout) -> PyResult<PyHandle> {
        let layout = layout.inner.clone();
        let inner = detached(py, || self.lock().alloc_handle(&layout))?;
        Ok(PyHandle { inner })
    }

    /// Dispatches `x` (`scales` given: FP8 rows) along `layout`, with `topk_idx` (and
    /// optional weights) or, `topk_idx` None, rows only. `mode`: `host_sync`, `bounded` (at
    /// most `bound` rows) or `into` (`handle` from `alloc_handle`).
    #[pyo3(signature = (layout, x, scales, topk_idx, topk_weights, mode, bound=0, handle=None))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        py: Python<'_>,
        layout: &PyLayout,
        x: Arr,
        scales: Option<Arr>,
        topk_idx: Option<Arr>,
        topk_weights: Option<Arr>,
        mode: &str,
        bound: usize,
        handle: Option<&PyHandle>,
    ) -> PyResult<PyDispatch> {
        let rows = rows(mode, bound, handle).map_err(|e| to_pyerr(py, e))?;
        let layout = layout.inner.clone();
        let x = XArrays {
            x: raw(x),
            scales: scales.map(raw),
        };
        let (idx, w) = (topk_idx.map(raw), topk_weights.map(raw));
        // SAFETY: the module's contract (see the module docs), for every array.
        let out = detached(py, || unsafe {
            self.lock().dispatch(x, idx, w, &layout, rows)
        })?;
        Ok(PyDispatch { out })
    }

    /// Sends `x` along `handle`'s routing (no count exchange, no host wait).
    fn cached_dispatch(
        &self,
        py: Python<'_>,
        handle: &PyHandle,
        x: Arr,
        scales: Option<Arr>,
    ) -> PyResult<PyDispatch> {
        let h = handle.inner.clone();
        let x = XArrays {
            x: raw(x),
            scales: scales.map(raw),
        };
        // SAFETY: the module's contract (see the module docs).
        let out = detached(py, || unsafe { self.lock().cached_dispatch(x, &h) })?;
        Ok(PyDispatch { out })
    }

    /// Sums the rows of `y` back to this rank's tokens into `out` (and the weights).
    #[pyo3(signature = (handle, y, y_weights, out, out_weights, consuming=false))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        py: Python<'_>,
        handle: &PyHandle,
        y: Arr,
        y_weights: Option<Arr>,
        out: Arr,
        out_weights: Option<Arr>,
        consuming: bool,
    ) -> PyResult<()> {
        let h = handle.inner.clone();
        let (y, yw, o, ow) = (raw(y), y_weights.map(raw), raw(out), out_weights.map(raw));
        // SAFETY: the module's contract (see the module docs), for every array.
        detached(py, || unsafe {
            self.lock().combine(&h, y, yw, o, ow, consuming)
        })
    }

    /// Combine pulling every rank's latest receive rows (written over in place).
    #[pyo3(signature = (handle, out, out_weights))]
    fn combine_in_place(
        &self,
        py: Python<'_>,
        handle: &PyHandle,
        out: Arr,
        out_weights: Option<Arr>,
    ) -> PyResult<()> {
        let h = handle.inner.clone();
        let (o, ow) = (raw(out), out_weights.map(raw));
        // SAFETY: the module's contract (see the module docs).
        detached(py, || unsafe { self.lock().combine_in_place(&h, o, ow) })
    }

    /// Copies receive array `name` (`x`, `scales`, `topk_idx`, `topk_weights`) of the latest
    /// dispatch (its handle: `handle`) into `dst` (device address, `dst_bytes` bytes), as many
    /// rows as the device counted, from the region copy the device's dispatch count names.
    /// Stream-ordered on the buffer's stream.
    fn copy_received(
        &self,
        py: Python<'_>,
        handle: &PyHandle,
        name: &str,
        dst: u64,
        dst_bytes: usize,
    ) -> PyResult<()> {
        let r = region(name).map_err(|e| to_pyerr(py, e))?;
        let h = handle.inner.clone();
        // SAFETY: the module's contract (see the module docs): the Python layer passes the
        // address of a live output tensor that it keeps alive on the buffer's stream.
        detached(py, || unsafe {
            self.lock().copy_received(
                &h,
                r,
                DeviceBytes {
                    ptr: dst,
                    len: dst_bytes,
                },
            )
        })
    }

    /// A low-latency dispatch of `num_tokens` bf16 rows `x` routed by `topk_idx`; `fp8`:
    /// cast to e4m3 with per-128-channel scales (`round_scale`: power-of-two scales); `hook`:
    /// issue only the send phase. Returns `(op, LlDispatch)`: the op number for `ll_receive`
    /// (the hook; None without `hook`) and where the receive arrays lie.
    ///
    /// `stream` (a raw `CUstream` of the framework, or None): the buffer's stream first waits
    /// for it, and with `join` it waits for the buffer's stream after the op (one native call
    /// instead of the framework's two event round trips; see `Session::ordered`).
    /// `column_major_scales`: FP8 scales stored per local expert column-major
    /// (`[local_expert][hidden / 128][capacity]`, DeepEP's layout) instead of row-major.
    /// `stats` (`[local_experts]` i32, or None): the receive phase adds the rows it received
    /// per local expert to it (DeepEP's `cumulative_local_expert_recv_stats`).
    #[pyo3(signature = (x, topk_idx, num_tokens, fp8, round_scale, hook, stream=None, join=false,
                        column_major_scales=false, stats=None))]
    #[allow(clippy::too_many_arguments)]
    fn ll_dispatch(
        &self,
        py: Python<'_>,
        x: Arr,
        topk_idx: Arr,
        num_tokens: usize,
        fp8: bool,
        round_scale: bool,
        hook: bool,
        stream: Option<u64>,
        join: bool,
        column_major_scales: bool,
        stats: Option<Arr>,
    ) -> PyResult<(Option<u64>, PyLlDispatch)> {
        let format = match (fp8, round_scale) {
            (true, round_scale) => LlFormat::Fp8 { round_scale },
            (false, false) => LlFormat::Bf16,
            (false, true) => {
                return Err(to_pyerr(
                    py,
                    BindError::InvalidArgument {
                        argument: "round_scale",
                        rule: "applies to FP8 dispatches only (use_fp8=True)".into(),
                    },
                ));
            }
        };
        let (x, idx, stats) = (raw(x), raw(topk_idx), stats.map(raw));
        let scales = if column_major_scales {
            LlScalesLayout::ColumnMajor
        } else {
            LlScalesLayout::RowMajor
        };
        // SAFETY: the module's contract (see the module docs): live tensors, which the Python
        // side keeps referenced until the receive phase (the hook) has run on the stream.
        // `stream`: a live stream of the framework on this GPU (the package passes torch's
        // current stream).
        let (op, out) = detached(py, || unsafe {
            self.lock().ordered(stream, join, |s| {
                s.ll_dispatch(x, idx, num_tokens, format, scales, stats, hook)
            })
        })?;
        Ok((op, PyLlDispatch { out }))
    }

    /// A low-latency combine of `y` (expert outputs at the rows of low-latency dispatch
    /// `seq`) into `out`, reduced with this rank's `topk_idx` and `topk_weights` of that
    /// dispatch; `hook`: issue only the send phase. Returns the op number for `ll_receive`
    /// (None without `hook`). `stream`, `join`: as for `ll_dispatch`.
    #[pyo3(signature = (seq, y, topk_idx, topk_weights, out, hook, stream=None, join=false))]
    #[allow(clippy::too_many_arguments)]
    fn ll_combine(
        &self,
        py: Python<'_>,
        seq: u64,
        y: Arr,
        topk_idx: Arr,
        topk_weights: Arr,
        out: Arr,
        hook: bool,
        stream: Option<u64>,
        join: bool,
    ) -> PyResult<Option<u64>> {
        let (y, idx, w, o) = (raw(y), raw(topk_idx), raw(topk_weights), raw(out));
        // SAFETY: the module's contract (see the module docs): live tensors, which the Python
        // side keeps referenced until the receive phase (the hook) has run on the stream.
        // `stream`: as in `ll_dispatch`.
        detached(py, || unsafe {
            self.lock()
                .ordered(stream, join, |s| s.ll_combine(seq, y, idx, w, o, hook))
        })
    }

    /// The hook: issues the receive phase of low-latency op `op`. `stream`, `join`: as for
    /// `ll_dispatch`.
    #[pyo3(signature = (op, stream=None, join=false))]
    fn ll_receive(&self, py: Python<'_>, op: u64, stream: Option<u64>, join: bool) -> PyResult<()> {
        // SAFETY: `stream` as in `ll_dispatch`.
        detached(py, || unsafe {
            self.lock().ordered(stream, join, |s| s.ll_receive(op))
        })
    }

    /// The framework's stream `stream` (a raw `CUstream` on this GPU) waits for the work
    /// queued on the buffer's stream so far.
    fn join(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        // SAFETY: the package passes torch's current stream of this GPU.
        detached(py, || unsafe { self.lock().join(stream) })
    }

    /// Masks (`masked`) or unmasks peer `rank` for the low-latency ops issued after this call
    /// (stream-ordered; the buffer needs `ll_masking`).
    fn ll_set_masked(&self, py: Python<'_>, rank: usize, masked: bool) -> PyResult<()> {
        detached(py, || self.lock().ll_set_masked(rank, masked))
    }

    /// Unmasks every rank (stream-ordered).
    fn ll_clear_mask(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.lock().ll_clear_mask())
    }

    /// Copies the mask into `status` (`[world_size]` int32 on the device, 1 = masked), in
    /// stream order.
    fn ll_mask_into(&self, py: Python<'_>, status: Arr) -> PyResult<()> {
        let status = raw(status);
        // SAFETY: the module's contract: a live tensor, which the Python side keeps referenced
        // until the copy has run on the stream.
        detached(py, || unsafe { self.lock().ll_mask_into(status) })
    }

    /// The masked ranks once every issued op has finished (waits for the stream).
    fn ll_masked_ranks(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        detached(py, || self.lock().ll_masked_ranks())
    }

    /// Waits for every issued op; raises a device failure.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.lock().synchronize())
    }

    /// Who waited for whom in the last op, as a dict (collective); None before any op.
    fn last_op_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let stats = detached(py, || self.lock().last_op_stats())?;
        stats.map(|s| stats_dict(py, &s)).transpose()
    }

    /// Delays the next ops on this rank's stream by `seconds` (diagnostics).
    fn inject_delay(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let delay = if seconds == 0.0 {
            Ok(Duration::ZERO)
        } else {
            crate::options::seconds("seconds", seconds)
        }
        .map_err(|e| to_pyerr(py, e))?;
        detached(py, || self.lock().inject_delay(delay))
    }

    /// Frees the buffer (collective); later ops raise.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || self.lock().destroy())
    }
}

#[pymethods]
impl PyLayout {
    /// Tokens of the batch.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }

    /// Address of the `[world + num_experts + nodes]` uint32 counts.
    #[getter]
    fn counts_ptr(&self) -> u64 {
        self.inner.counts_ptr()
    }

    /// Address of the `[num_tokens][world]` int32 token slots (-1: not sent).
    #[getter]
    fn token_slot_ptr(&self) -> u64 {
        self.inner.token_slot_ptr()
    }
}

#[pymethods]
impl PyHandle {
    /// Tokens of the batch the handle routes.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }

    /// Rows received, when the host knows it (HostSync dispatch).
    #[getter]
    fn num_recv(&self) -> Option<usize> {
        self.inner.num_recv()
    }

    /// The most rows a dispatch into it can receive.
    #[getter]
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// Address of the `[world + 1]` int32 receive prefix (element `world`: rows received).
    #[getter]
    fn recv_prefix_ptr(&self) -> u64 {
        self.inner.recv_prefix_ptr()
    }

    /// Address of the int32 count of rows the dispatch received (either tiering).
    #[getter]
    fn recv_count_ptr(&self) -> u64 {
        self.inner.recv_count_ptr()
    }

    /// Address of the int32 source token index of each received row (the first `rows
    /// received` of them are written by the dispatch).
    #[getter]
    fn recv_src_idx_ptr(&self) -> u64 {
        self.inner.recv_src_idx_ptr()
    }
}

#[pymethods]
impl PyDispatch {
    /// The routing.
    #[getter]
    fn handle(&self) -> PyHandle {
        PyHandle {
            inner: self.out.handle.clone(),
        }
    }

    /// Rows received (HostSync), else None.
    #[getter]
    fn num_recv(&self) -> Option<usize> {
        self.out.num_recv
    }

    /// Rows per local expert (HostSync), else None.
    #[getter]
    fn per_expert(&self) -> Option<Vec<usize>> {
        self.out.per_expert.clone()
    }

    /// Address of the received rows.
    #[getter]
    fn recv_x(&self) -> u64 {
        self.out.recv_x
    }

    /// Address of the received scales (FP8), else None.
    #[getter]
    fn recv_scales(&self) -> Option<u64> {
        self.out.recv_scales
    }

    /// Address of the received local top-k ids, else None (cached dispatch).
    #[getter]
    fn recv_topk_idx(&self) -> Option<u64> {
        self.out.recv_topk_idx
    }

    /// Address of the received top-k weights, else None.
    #[getter]
    fn recv_topk_weights(&self) -> Option<u64> {
        self.out.recv_topk_weights
    }
}

#[pymethods]
impl PyLlDispatch {
    /// 1-based number of this low-latency dispatch (what its combine names).
    #[getter]
    fn seq(&self) -> u64 {
        self.out.seq
    }

    /// The receive set it wrote (0 or 1).
    #[getter]
    fn set(&self) -> usize {
        self.out.set
    }

    /// Address of the `[local_experts][capacity][row_bytes]` rows.
    #[getter]
    fn x(&self) -> u64 {
        self.out.x
    }

    /// Address of the `[local_experts][capacity][hidden / 128]` f32 scales.
    #[getter]
    fn scales(&self) -> u64 {
        self.out.scales
    }

    /// Address of the `[local_experts]` i32 counts.
    #[getter]
    fn count(&self) -> u64 {
        self.out.count
    }

    /// Address of the `[local_experts][capacity]` i32 source token indices.
    #[getter]
    fn src_info(&self) -> u64 {
        self.out.src_info
    }

    /// Address of the `[local_experts][world]` i64 `(first row << 32) | rows` ranges.
    #[getter]
    fn layout_range(&self) -> u64 {
        self.out.layout_range
    }

    /// Local experts.
    #[getter]
    fn num_local_experts(&self) -> usize {
        self.out.num_local_experts
    }

    /// Rows per local expert.
    #[getter]
    fn capacity(&self) -> usize {
        self.out.capacity
    }

    /// Bytes per row.
    #[getter]
    fn row_bytes(&self) -> usize {
        self.out.row_bytes
    }
}
