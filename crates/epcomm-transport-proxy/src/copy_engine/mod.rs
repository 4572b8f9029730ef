//! The copy-engine executor: the proxy's operations become stream-ordered driver work on one
//! CUDA stream per peer, executed by the GPU's copy engines (no SM moves a byte).
//!
//! | operation | driver work on the peer's stream |
//! |---|---|
//! | transfer | a copy from the source (caller memory or this rank's buffer) to the peer's buffer through its CUDA-IPC mapping |
//! | write (4/8-byte elements, one or a sequence) | 4-byte values below 2^18: a copy from the counting table (pinned, holding 0, 1, 2, ...), so consecutive sequences merge like rows; others: the elements staged in the peer lane's pinned host arena, writes to contiguous destination bytes merging into one copy |
//! | signal set (one word or several) | the value staged in the arena once per word, then one copy of them after every earlier copy of the lane; signals to consecutive words with nothing between them merge into one copy |
//! | signal add | the same, writing a running sum kept here (see below) |
//!
//! **Copies**: a lane collects its copies and hands them to its stream when 1024 are pending,
//! and at a poll when fewer than [`CopyEngineExecutor::set_queue_depth`] of its handed-over
//! batches are still running (default [`DEFAULT_QUEUE_DEPTH`]): while the copy engines are busy
//! with earlier batches, new copies wait here, where they merge, instead of queueing behind
//! them on the stream one driver call each. A copy whose source and destination both continue
//! where a pending copy of the lane ends, or end where one starts, is merged into it
//! (consecutive rows to consecutive slots become one copy), when no copy between the two
//! touches its bytes, so the stream's result is unchanged; before a batch goes out, one more
//! pass merges the copies that earlier merges made adjacent ([`compact`]). Then one
//! `cuMemcpyAsync` each (the default), or, with
//! [`CopyEngineExecutor::set_batch_copies`], one `cuMemcpyBatchAsync` (source read in stream
//! order, with the hint to use the copy engines rather than SMs; a copy that depends on a
//! pending one starts a new batch, since a batch runs in no particular order), falling back to
//! single copies where the driver refuses it. Batches are off by default: they lost copies in a
//! measured case (a 16 384-token dispatch; docs/proxy.md, "Status").

//! **Streams.** One per mapped peer (none for ranks reached by stores), plus the progress
//! mirror's. A stream the driver puts on the same hardware queue as the stream of a kernel
//! that waits for this executor's copies would deadlock: see
//! [`crate::check_copy_stream_queues`].
//!
//! **Ordering.** One stream per peer and submission order kept on it: a signal's copy starts
//! after every earlier copy and write to that peer has completed — the contract of
//! [`epcomm_proxy::Executor`]. A pending run of writes is handed to its stream before any later
//! copy or signal on that stream. A copy may merge into an earlier pending copy that it
//! continues or that continues it (it then lands sooner, never later than the signals after
//! it); a signal merges only into the lane's last
//! pending copy, and only when that copy holds nothing but signals, so it never lands before
//! anything that came before it. Consecutive signal copies that set words to one value (a
//! combine's runs of flags, staged in arrival order) are laid out anew by destination before
//! a batch goes out ([`regroup_fills`]): they stay after everything before them, only their
//! order among themselves changes. (A signal used to be a `cuStreamWriteValue64` each: one
//! driver call per word, which made a combine over this executor take one call per row.)
//!
//! **Arena.** Each lane stages write values in its own pinned host arena, used first in, first
//! out: the bytes of a run stay until the event after its copy completes (events complete in
//! stream order). A full arena answers [`Submit::Busy`] until completions free it.
//!
//! **Adds.** The driver has no stream-ordered atomic add, so an add is a store of the word's
//! new value, computed here: the word's running sum per (peer, offset). That is exact because
//! in epcomm's protocol every word a rank adds to in a peer's buffer is written by this rank
//! only (a per-source slot: `done[src]`, `barrier[src]`), starts at zero when the buffer is
//! allocated, and only this executor (one thread, in ring order) adds to it.
//!
//! **Completion.** Each poll records one event per stream that received work since the last
//! poll; the operations before an event are complete once the event is.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use epcomm_proxy::descriptor::{Signal, SignalOp, Source, Transfer, Write, WriteWidth};
use epcomm_proxy::{Executor, OpFailure, OpId, Submit};
use epcomm_transport::{MappedHostBuffer, TransportError};

use crate::fifo::Fifo;
use crate::watch::CallWatch;

mod mirror;
use mirror::Mirror;

/// Bytes of each lane's pinned staging arena.
const ARENA_BYTES: usize = 4 << 20;

/// Events made per mapped peer when the executor is created (the only events it uses).
const EVENTS_PER_LANE: usize = 64;

/// Elements of the counting table (`u32` 0, 1, 2, ...): a 4-byte write whose values all lie
/// below it is a copy from the table instead of staged bytes.
const COUNTING_ELEMS: u64 = 1 << 18;

/// Most copies handed to the driver in one batch.
const MAX_BATCH: usize = 1024;

/// How far back in a lane's pending copies a new copy looks for one it continues.
const MERGE_WINDOW: usize = 32;

/// How far back [`compact`] looks, once per batch (each copy of a batch that merges with
/// nothing costs that many comparisons: about 5% of its `cuMemcpyAsync` at 64).
const COMPACT_WINDOW: usize = 64;

/// Batches a lane keeps in the copy engines before it holds new copies back
/// ([`CopyEngineExecutor::set_queue_depth`]).
pub const DEFAULT_QUEUE_DEPTH: usize = 2;

/// The largest queue depth: a lane never has more batches running than it has events.
pub const MAX_QUEUE_DEPTH: usize = EVENTS_PER_LANE;

/// Why a copy-engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyEngineError {
    /// A driver call failed.
    #[error("{what} for rank {peer}: {source}")]
    Driver {
        /// The call.
        what: &'static str,
        /// The peer.
        peer: u32,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The operation names a rank this executor has no mapping of.
    #[error(
        "rank {peer} is not reachable by this copy-engine executor (ranks {world}, mapped: {mapped})"
    )]
    Unmapped {
        /// The peer.
        peer: u32,
        /// World size.
        world: usize,
        /// Whether the rank is in range but unmapped.
        mapped: bool,
    },
    /// A write or signal whose staged bytes exceed the lane's whole staging arena.
    #[error("a {what} of {bytes} bytes does not fit in the {arena}-byte staging arena")]
    TooLarge {
        /// `write` or `signal`.
        what: &'static str,
        /// Bytes it stores.
        bytes: usize,
        /// The arena's capacity.
        arena: usize,
    },
}

/// An open run of staged write bytes: `len` bytes at arena offset `at`, bound for destination
/// offset `dst`.
#[derive(Clone, Copy)]
struct Run {
    at: usize,
    dst: u64,
    len: usize,
}

/// A copy not yet handed to its lane's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    dst: u64,
    src: u64,
    bytes: usize,
    /// The first operation it carries (named when the driver refuses the copy).
    op: OpId,
    /// It carries signal words only: it lands after every copy before it, so it never moves
    /// ahead of one, and copies of data never merge into it.
    signal: bool,
    /// A signal copy of set words that all hold this value (`None`: data, an add's running
    /// sum, or words of several values): such copies may be laid out anew ([`regroup_fills`]).
    fill: Option<u64>,
}

impl Pending {
    fn data(dst: u64, src: u64, bytes: usize, op: OpId) -> Self {
        Self {
            dst,
            src,
            bytes,
            op,
            signal: false,
            fill: None,
        }
    }

    fn signal(dst: u64, src: u64, bytes: usize, op: OpId, fill: Option<u64>) -> Self {
        Self {
            signal: true,
            fill,
            ..Self::data(dst, src, bytes, op)
        }
    }

    /// Appends signal copy `next` (which continues this one) to it.
    fn extend_signal(&mut self, next: &Pending) {
        self.bytes += next.bytes;
        if self.fill != next.fill {
            self.fill = None;
        }
    }
}

/// One peer's lane: its stream, its mapping, its arena, and what was submitted since the last
/// poll.
struct Lane {
    /// The lane's stream (`None` for a peer this executor has no mapping of).
    stream: Option<Arc<CudaStream>>,
    /// Base of the peer's buffer in this process (0: not mapped).
    base: u64,
    /// Pinned staging for write values, allocated first in, first out by `fifo`.
    arena: MappedHostBuffer,
    fifo: Fifo,
    /// The writes not yet added to the batch.
    run: Option<Run>,
    /// Copies not yet handed to the stream, issued together by `flush_batch` (one
    /// `cuMemcpyBatchAsync` call with batched copies).
    batch: Vec<Pending>,
    /// Operations submitted since the last event.
    unmarked: Vec<OpId>,
    /// Events in record order, each with the operations it completes, the arena total it
    /// frees up to, and when it was recorded.
    marks: VecDeque<(CudaEvent, Vec<OpId>, usize, std::time::Instant)>,
}

/// Executes proxy operations with `cuMemcpyAsync` and stream memory operations (see the
/// module docs).
pub struct CopyEngineExecutor {
    ctx: Arc<CudaContext>,
    local_base: u64,
    lanes: Vec<Lane>,
    shadow: HashMap<(u32, u64), u64>,
    free_events: Vec<CudaEvent>,
    in_flight: usize,
    max_in_flight: usize,
    /// Copies go out as batches (`cuMemcpyBatchAsync`, preferring the copy engines); cleared
    /// when the driver refuses a batch (then one `cuMemcpyAsync` per copy).
    batched: bool,
    /// A lane hands its pending copies over only while fewer of its batches are running.
    queue_depth: usize,
    /// Where the ring's progress is mirrored in device memory ([`Self::mirror_progress`]).
    mirror: Option<Mirror>,
    /// Pinned, `COUNTING_ELEMS` little-endian `u32`s holding their own index; never written
    /// after construction, so a copy may read it at any time ([`counted_source`]).
    counting: MappedHostBuffer,
    watch: Arc<CallWatch>,
}

impl std::fmt::Debug for CopyEngineExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngineExecutor")
            .field("peers", &self.lanes.len())
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl CopyEngineExecutor {
    /// An executor for the peers whose buffers are mapped at `peer_bases` (0: not reachable);
    /// `local_base` is this rank's own buffer (heap-offset sources). At most `max_in_flight`
    /// operations are outstanding before submissions answer [`Submit::Busy`].
    ///
    /// # Errors
    /// The driver's error creating a stream or allocating an arena.
    pub fn new(
        ctx: Arc<CudaContext>,
        local_base: u64,
        peer_bases: &[u64],
        max_in_flight: usize,
    ) -> Result<Self, TransportError> {
        let lanes = peer_bases
            .iter()
            .map(|&base| {
                let stream =
                    (base != 0)
                        .then(|| ctx.new_stream())
                        .transpose()
                        .map_err(|source| TransportError::Driver {
                            context: "creating a copy-engine stream".into(),
                            source,
                        })?;
                Ok(Lane {
                    stream,
                    base,
                    arena: MappedHostBuffer::zeroed(&ctx, if base == 0 { 8 } else { ARENA_BYTES })?,
                    fifo: Fifo::new(if base == 0 { 8 } else { ARENA_BYTES }),
                    run: None,
                    batch: Vec::new(),
                    unmarked: Vec::new(),
                    marks: VecDeque::new(),
                })
            })
            .collect::<Result<_, TransportError>>()?;
        let mapped = peer_bases.iter().filter(|&&b| b != 0).count();
        let counting = MappedHostBuffer::zeroed(&ctx, 4 * COUNTING_ELEMS as usize)?;
        for j in 0..COUNTING_ELEMS / 2 {
            // Elements 2j and 2j + 1 of the table, little-endian.
            counting.store_u64(j as usize, (2 * j) | ((2 * j + 1) << 32));
        }
        let free_events = (0..EVENTS_PER_LANE * mapped)
            .map(|_| ctx.new_event(None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| TransportError::Driver {
                context: "creating the copy-engine executor's events".into(),
                source,
            })?;
        Ok(Self {
            ctx,
            local_base,
            lanes,
            shadow: HashMap::new(),
            free_events,
            in_flight: 0,
            max_in_flight: max_in_flight.max(1),
            batched: false,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            mirror: None,
            counting,
            watch: Arc::new(CallWatch::default()),
        })
    }

    /// Whether copies go out in batches or one `cuMemcpyAsync` each (the transport's default:
    /// batches lost copies in a measured case, see `ProxyOptions::batch_copies`).
    pub fn set_batch_copies(&mut self, on: bool) {
        self.batched = on;
    }

    /// How many of a lane's handed-over batches may run in the copy engines before the lane
    /// holds its new copies back until one completes (clamped to `1..=`[`MAX_QUEUE_DEPTH`]).
    /// Held copies merge with the ones that follow; a small depth trades a short gap in the
    /// copy engines between batches for fewer, larger copies. Holding never stalls: the
    /// running batches complete on their own.
    pub fn set_queue_depth(&mut self, depth: usize) {
        self.queue_depth = depth.clamp(1, MAX_QUEUE_DEPTH);
    }

    /// The executor's driver-call watch (shared: readable while the proxy thread runs).
    pub fn watch(&self) -> Arc<CallWatch> {
        Arc::clone(&self.watch)
    }

    fn lane(&mut self, op: OpId, peer: u32) -> Result<usize, OpFailure> {
        let world = self.lanes.len();
        match self.lanes.get(peer as usize) {
            Some(l) if l.base != 0 => Ok(peer as usize),
            found => Err(OpFailure::new(
                op,
                CopyEngineError::Unmapped {
                    peer,
                    world,
                    mapped: found.is_some(),
                },
            )),
        }
    }

    fn driver(op: OpId, peer: u32, what: &'static str) -> impl FnOnce(DriverError) -> OpFailure {
        move |source| OpFailure::new(op, CopyEngineError::Driver { what, peer, source })
    }

    /// Lane `i`'s stream; a lane without a mapping has none (never reached: [`Self::lane`]
    /// refuses such peers first).
    fn stream(&self, i: usize, op: OpId) -> Result<&Arc<CudaStream>, OpFailure> {
        self.lanes[i].stream.as_ref().ok_or_else(|| {
            OpFailure::new(
                op,
                CopyEngineError::Unmapped {
                    peer: i as u32,
                    world: self.lanes.len(),
                    mapped: true,
                },
            )
        })
    }

    fn bind(&self, op: OpId, peer: u32) -> Result<(), OpFailure> {
        let ctx = &self.ctx;
        self.watch
            .call("cuCtxSetCurrent", || ctx.bind_to_thread())
            .map_err(Self::driver(op, peer, "binding the CUDA context"))
    }

    /// Hands lane `i`'s pending copies to its stream: one `cuMemcpyBatchAsync` with source
    /// access in stream order and the hint to overlap with compute (the copy engines, not
    /// SMs), or, where the driver refuses batches, one `cuMemcpyAsync` each.
    fn flush_batch(&mut self, i: usize) -> Result<(), OpFailure> {
        if self.lanes[i].batch.is_empty() {
            return Ok(());
        }
        compact(&mut self.lanes[i].batch, COMPACT_WINDOW);
        let first = self.lanes[i].batch[0].op;
        self.bind(first, i as u32)?;
        let stream = self.stream(i, first)?.cu_stream();
        if self.batched {
            let batch = &self.lanes[i].batch;
            let mut dsts: Vec<u64> = batch.iter().map(|c| c.dst).collect();
            let mut srcs: Vec<u64> = batch.iter().map(|c| c.src).collect();
            let mut sizes: Vec<usize> = batch.iter().map(|c| c.bytes).collect();
            // SAFETY: an all-zero CUmemcpyAttributes is a valid value (no location hints);
            // the fields that matter are set below.
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            attrs.flags = sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32;
            let mut attr_idx: usize = 0;
            let count = dsts.len();
            let res = self.watch.call("cuMemcpyBatchAsync", || {
                // SAFETY: the three arrays hold `count` entries each; every destination lies in
                // the peer's mapped buffer (bounds-checked by the decoder), every source is a
                // device address the producing kernel named in this process (kept valid until
                // the operation completes) or bytes of the lane's pinned arena (kept until the
                // event after this batch completes); one attribute applies from index 0.
                unsafe {
                    sys::cuMemcpyBatchAsync_v2(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        count,
                        &mut attrs,
                        &mut attr_idx,
                        1,
                        stream,
                    )
                }
            });
            match res {
                sys::CUresult::CUDA_SUCCESS => {
                    self.lanes[i].batch.clear();
                    return Ok(());
                }
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                    // This driver cannot batch these copies: one call each from now on.
                    self.batched = false;
                }
                err => {
                    return Err(Self::driver(first, i as u32, "cuMemcpyBatchAsync")(
                        DriverError(err),
                    ));
                }
            }
        }
        for k in 0..self.lanes[i].batch.len() {
            let Pending {
                dst,
                src,
                bytes,
                op,
                ..
            } = self.lanes[i].batch[k];
            self.watch
                .call("cuMemcpyAsync", || {
                    // SAFETY: as for the batch above: the destination lies in the peer's mapped
                    // buffer, the source stays valid until the operation completes.
                    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }
                })
                .result()
                .map_err(Self::driver(op, i as u32, "cuMemcpyAsync"))?;
        }
        self.lanes[i].batch.clear();
        Ok(())
    }

    /// Adds a copy to lane `i`'s batch, merged into a pending copy it continues where that is
    /// safe (issued when the batch is full and at the next poll). With batched copies, a copy that depends on a pending one (see
    /// [`depends_on_any`]) first sends the pending ones off: the driver runs a batch's copies
    /// in no particular order, and dependent copies in one batch are undefined.
    fn push_copy(
        &mut self,
        i: usize,
        op: OpId,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), OpFailure> {
        if self.batched && depends_on_any(&self.lanes[i].batch, dst, src, bytes) {
            self.flush_batch(i)?;
        }
        let lane = &mut self.lanes[i];
        let copy = Pending::data(dst, src, bytes, op);
        if let Some((k, side)) = joined_copy(&lane.batch, &copy, MERGE_WINDOW) {
            join(&mut lane.batch[k], &copy, side);
            return Ok(());
        }
        lane.batch.push(copy);
        if lane.batch.len() >= MAX_BATCH {
            self.flush_batch(i)?;
        }
        Ok(())
    }

    /// Adds the copy of a signal's `bytes` (from the arena at `src` to `dst`) to lane `i`'s
    /// batch, after everything pending there: merged into the lane's last copy when that one
    /// holds signals only and this continues it ([`signal_continued`]); otherwise a new copy (with batched copies, in
    /// a new batch: a batch runs its copies in no particular order).
    fn push_signal_copy(
        &mut self,
        i: usize,
        op: OpId,
        dst: u64,
        src: u64,
        bytes: usize,
        fill: Option<u64>,
    ) -> Result<(), OpFailure> {
        let lane = &mut self.lanes[i];
        let copy = Pending::signal(dst, src, bytes, op, fill);
        if let Some(k) = signal_continued(&lane.batch, dst, src) {
            lane.batch[k].extend_signal(&copy);
            return Ok(());
        }
        if self.batched {
            self.flush_batch(i)?;
        }
        let lane = &mut self.lanes[i];
        lane.batch.push(copy);
        if lane.batch.len() >= MAX_BATCH {
            self.flush_batch(i)?;
        }
        Ok(())
    }

    /// Adds lane `i`'s open run of writes to its batch.
    fn flush_run(&mut self, i: usize, op: OpId) -> Result<(), OpFailure> {
        if let Some(run) = self.lanes[i].run.take() {
            let lane = &self.lanes[i];
            // The arena's host address: pinned memory, a valid copy source under unified
            // addressing.
            let src = lane.arena.host_ptr() as u64 + run.at as u64;
            let dst = lane.base + run.dst;
            self.push_copy(i, op, dst, src, run.len)?;
        }
        Ok(())
    }

    fn accept(&mut self, i: usize, op: OpId) -> Submit {
        self.lanes[i].unmarked.push(op);
        self.in_flight += 1;
        Submit::Accepted
    }

    /// `TooLarge` when `bytes` staged bytes could never fit in lane `i`'s arena (anything up to
    /// its capacity fits once the arena is empty, so a smaller one only waits: `Busy`).
    fn fits_arena(
        &self,
        i: usize,
        op: OpId,
        what: &'static str,
        bytes: usize,
    ) -> Result<(), OpFailure> {
        let arena = self.lanes[i].fifo.capacity();
        if bytes > arena {
            return Err(OpFailure::new(
                op,
                CopyEngineError::TooLarge { what, bytes, arena },
            ));
        }
        Ok(())
    }

    /// Stores `value` into `words` consecutive words from the peer's `offset` on, ordered after
    /// everything before it on the lane (`set`: a signal set, whose copy may be laid out anew
    /// with others of its value, [`regroup_fills`]); `Ok(false)` when the arena has no room
    /// now (retry later).
    fn write_words(
        &mut self,
        i: usize,
        op: OpId,
        offset: u64,
        value: u64,
        words: usize,
        set: bool,
    ) -> Result<bool, OpFailure> {
        self.flush_run(i, op)?;
        let bytes = 8 * words;
        let Some(at) = self.lanes[i].fifo.reserve(bytes) else {
            return Ok(false);
        };
        let lane = &self.lanes[i];
        let le = value.to_le_bytes();
        for k in 0..bytes {
            let b = le[k % 8];
            // SAFETY: `at + k < at + bytes`, inside the arena just reserved.
            unsafe { std::ptr::write_volatile(lane.arena.host_ptr().add(at + k), b) };
        }
        let (dst, src) = (lane.base + offset, lane.arena.host_ptr() as u64 + at as u64);
        self.push_signal_copy(i, op, dst, src, bytes, set.then_some(value))?;
        Ok(true)
    }
}

impl Executor for CopyEngineExecutor {
    fn name(&self) -> &str {
        "copy-engine"
    }

    fn submit_transfer(&mut self, op: OpId, t: &Transfer) -> Result<Submit, OpFailure> {
        if self.in_flight >= self.max_in_flight {
            return Ok(Submit::Busy);
        }
        let i = self.lane(op, t.peer)?;
        self.flush_run(i, op)?;
        let src = match t.src {
            Source::Heap(offset) => self.local_base + offset,
            Source::Address(addr) => addr,
        };
        let dst = self.lanes[i].base + t.dst_offset;
        self.push_copy(i, op, dst, src, t.bytes as usize)?;
        Ok(self.accept(i, op))
    }

    fn submit_write(&mut self, op: OpId, w: &Write) -> Result<Submit, OpFailure> {
        if self.in_flight >= self.max_in_flight {
            return Ok(Submit::Busy);
        }
        let i = self.lane(op, w.peer)?;
        if let Some(src) = counted_source(self.counting.host_ptr() as u64, w) {
            // After the open run of staged writes, in case they share bytes (the merge keeps
            // the order of copies that do).
            self.flush_run(i, op)?;
            let dst = self.lanes[i].base + w.offset;
            self.push_copy(i, op, dst, src, w.bytes() as usize)?;
            return Ok(self.accept(i, op));
        }
        let len = w.bytes() as usize;
        self.fits_arena(i, op, "write", len)?;
        let lane = &mut self.lanes[i];
        let extends = lane.run.is_some_and(|r| {
            r.dst + r.len as u64 == w.offset
                && r.at + r.len == lane.fifo.next_offset()
                && r.at + r.len + len <= lane.fifo.capacity()
        });
        if !extends {
            self.flush_run(i, op)?;
        }
        let lane = &mut self.lanes[i];
        let Some(at) = lane.fifo.reserve(len) else {
            self.flush_run(i, op)?;
            return Ok(Submit::Busy);
        };
        for (k, b) in w.le_bytes().enumerate() {
            // SAFETY: `at + k < at + len` (`le_bytes` yields `w.bytes()` = `len` bytes), inside
            // the arena just reserved.
            unsafe { std::ptr::write_volatile(lane.arena.host_ptr().add(at + k), b) };
        }
        lane.run = Some(match lane.run {
            Some(r) if extends => Run {
                len: r.len + len,
                ..r
            },
            _ => Run {
                at,
                dst: w.offset,
                len,
            },
        });
        Ok(self.accept(i, op))
    }

    fn submit_signal(&mut self, op: OpId, s: &Signal) -> Result<Submit, OpFailure> {
        if self.in_flight >= self.max_in_flight {
            return Ok(Submit::Busy);
        }
        let i = self.lane(op, s.peer)?;
        self.bind(op, s.peer)?;
        let key = (s.peer, s.offset);
        let value = match s.op {
            SignalOp::Set => s.value,
            SignalOp::Add => self
                .shadow
                .get(&key)
                .copied()
                .unwrap_or(0)
                .wrapping_add(s.value),
        };
        let words = s.words as usize;
        self.fits_arena(i, op, "signal", 8 * words)?;
        // An add has one word (the decoder refuses more).
        if !self.write_words(i, op, s.offset, value, words, s.op == SignalOp::Set)? {
            return Ok(Submit::Busy);
        }
        // Only an accepted add moves the running sum (a Busy answer is retried).
        if s.op == SignalOp::Add {
            self.shadow.insert(key, value);
        }
        Ok(self.accept(i, op))
    }

    fn progress(&mut self, taken: u64, completed: u64, op_hint: OpId) -> Result<(), OpFailure> {
        self.write_mirror(taken, completed, op_hint)
    }

    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        if self.in_flight == 0 {
            self.watch.set_in_flight(0, None);
            return Ok(());
        }
        self.bind(0, 0)?;
        // Completions first: a lane whose batches completed may hand over its held copies below.
        for i in 0..self.lanes.len() {
            while let Some((event, ops, _, _)) = self.lanes[i].marks.front() {
                // SAFETY: the event is live (owned here) and was recorded on this context.
                let status = self.watch.call("cuEventQuery", || {
                    // SAFETY: as stated above this call.
                    unsafe { sys::cuEventQuery(event.cu_event()) }
                });
                match status {
                    sys::CUresult::CUDA_SUCCESS => {}
                    sys::CUresult::CUDA_ERROR_NOT_READY => break,
                    err => {
                        return Err(OpFailure::new(
                            ops[0],
                            CopyEngineError::Driver {
                                what: "cuEventQuery (a copy or write failed)",
                                peer: i as u32,
                                source: DriverError(err),
                            },
                        ));
                    }
                }
                let Some((event, ops, freed, _)) = self.lanes[i].marks.pop_front() else {
                    break;
                };
                self.lanes[i].fifo.free_to(freed);
                self.in_flight -= ops.len();
                done.extend(ops);
                self.free_events.push(event);
            }
        }
        for i in 0..self.lanes.len() {
            // Nothing new, or `queue_depth` batches still running: the copies wait here, where
            // the next ones merge with them (the running batches complete on their own).
            if self.lanes[i].unmarked.is_empty() || self.lanes[i].marks.len() >= self.queue_depth {
                continue;
            }
            let first = self.lanes[i].unmarked[0];
            self.flush_run(i, first)?;
            self.flush_batch(i)?;
            // Events come only from the pool made at construction: creating one here can
            // block until this context's running kernels end (measured: `cuEventCreate` waited
            // for the whole kernel while the kernel waited for these very copies). Without a
            // free event the operations stay unmarked until a later poll frees one.
            let stream = Arc::clone(self.stream(i, first)?);
            let Some(event) = self.free_events.pop() else {
                continue;
            };
            let lane = &mut self.lanes[i];
            self.watch
                .call("cuEventRecord", || event.record(&stream))
                .map_err(Self::driver(first, i as u32, "cuEventRecord"))?;
            let ops = std::mem::take(&mut lane.unmarked);
            lane.marks
                .push_back((event, ops, lane.fifo.allocated(), std::time::Instant::now()));
        }
        let oldest = self
            .lanes
            .iter()
            .filter_map(|l| l.marks.front().map(|m| m.3))
            .min();
        self.watch.set_in_flight(self.in_flight, oldest);
        Ok(())
    }
}

/// Where in the counting table at `table` (holding `u32` 0, 1, 2, ... up to
/// `COUNTING_ELEMS`) the bytes of write `w` already lie: 4-byte elements whose values all lie
/// below the table's end. Consecutive sequences (a dispatch's source indices, run after run)
/// then continue each other in source and destination alike, and merge as rows do.
fn counted_source(table: u64, w: &Write) -> Option<u64> {
    let end = w.value.checked_add(u64::from(w.count))?;
    (w.width == WriteWidth::Four && end <= COUNTING_ELEMS).then(|| table + 4 * w.value)
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b.saturating_add(b_len as u64) && b < a.saturating_add(a_len as u64)
}

/// Whether the copy of `bytes` bytes from `src` to `dst` depends on a copy in `batch` or one
/// of them on it: it writes what one reads or writes, or reads what one writes. Such copies
/// may not share a `cuMemcpyBatchAsync` (it runs them in no particular order).
fn depends_on_any(batch: &[Pending], dst: u64, src: u64, bytes: usize) -> bool {
    batch.iter().any(|c| touches(c, dst, src, bytes))
}

/// Whether pending copy `c` and the copy of `bytes` bytes from `src` to `dst` conflict: one
/// writes what the other reads or writes.
fn touches(c: &Pending, dst: u64, src: u64, bytes: usize) -> bool {
    overlaps(c.dst, c.bytes, dst, bytes)
        || overlaps(c.src, c.bytes, dst, bytes)
        || overlaps(c.dst, c.bytes, src, bytes)
}

/// The index of `batch`'s last copy when it holds signals only and a signal's copy from `src`
/// to `dst` continues it: both its source and its destination start where that copy ends.
/// Only the last copy qualifies, so the merged signal still lands after every copy before it.
fn signal_continued(batch: &[Pending], dst: u64, src: u64) -> Option<usize> {
    let k = batch.len().checked_sub(1)?;
    let c = batch[k];
    (c.signal
        && c.dst.checked_add(c.bytes as u64) == Some(dst)
        && c.src.checked_add(c.bytes as u64) == Some(src))
    .then_some(k)
}

/// Where a new copy joins a pending one ([`joined_copy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Join {
    /// The new copy continues the pending one (both its source and its destination start
    /// where the pending copy's end).
    After,
    /// The new copy precedes the pending one (both end where the pending copy's start): the
    /// merged copy starts at the new one's addresses.
    Before,
}

/// Merges `copy` into `into` on `side` (as [`joined_copy`] found it).
fn join(into: &mut Pending, copy: &Pending, side: Join) {
    if side == Join::Before {
        into.dst = copy.dst;
        into.src = copy.src;
    }
    into.bytes += copy.bytes;
}

/// The index of the pending copy of data in `batch` that data copy `copy` joins (continues
/// it, or ends where it starts, in both its source and its destination), when merging them
/// leaves the stream's result unchanged: no copy issued between the two reads or writes the
/// new destination or writes the new source, and the merged copy's source and destination do
/// not overlap. A signal's copy is never joined (data merged into it could land with it, and
/// it must not move), though the copies between are checked against it too. Looks back at
/// most `window` copies. Both sides matter because warps hand the proxy adjacent runs in no
/// particular order: a run arriving before its neighbour to the left must still merge with it.
fn joined_copy(batch: &[Pending], copy: &Pending, window: usize) -> Option<(usize, Join)> {
    let (dst, src, bytes) = (copy.dst, copy.src, copy.bytes);
    let lo = batch.len().saturating_sub(window);
    for k in (lo..batch.len()).rev() {
        let c = &batch[k];
        if !c.signal {
            let (d, s, n) = (c.dst, c.src, c.bytes);
            let merged = n + bytes;
            if d.checked_add(n as u64) == Some(dst) && s.checked_add(n as u64) == Some(src) {
                return (!overlaps(d, merged, s, merged)).then_some((k, Join::After));
            }
            if dst.checked_add(bytes as u64) == Some(d) && src.checked_add(bytes as u64) == Some(s)
            {
                return (!overlaps(dst, merged, src, merged)).then_some((k, Join::Before));
            }
        }
        if touches(c, dst, src, bytes) {
            return None;
        }
    }
    None
}

/// Merges the copies of `batch` that earlier merges made adjacent, in one pass, under the rules
/// a new copy merges by: a copy of data joins an earlier one ([`joined_copy`], looking back
/// `window` copies), a signal's copy only the copy just before it when that is a signal's
/// ([`signal_continued`]). A batch `A, C, B` where `B` joined `A` leaves `AB, C` at push time
/// (`C` came first); here `C` joins `AB`.
fn compact(batch: &mut Vec<Pending>, window: usize) {
    if batch.len() < 2 {
        return;
    }
    let mut out: Vec<Pending> = Vec::with_capacity(batch.len());
    for c in batch.drain(..) {
        if !merged_into(&mut out, &c, window) {
            out.push(c);
        }
    }
    regroup_fills(&mut out);
    *batch = out;
}

/// Merges copy `c` into a copy of `batch` by the rules of a new copy (data joins an earlier
/// copy of data within `window`, [`joined_copy`]; a signal's copy only the last copy when
/// that holds signals, [`signal_continued`]); false when it merged into none.
fn merged_into(batch: &mut [Pending], c: &Pending, window: usize) -> bool {
    if c.signal {
        if let Some(k) = signal_continued(batch, c.dst, c.src) {
            batch[k].extend_signal(c);
            return true;
        }
    } else if let Some((k, side)) = joined_copy(batch, c, window) {
        join(&mut batch[k], c, side);
        return true;
    }
    false
}

/// Lays out anew each group of consecutive signal copies in `batch` that set words to one
/// value and read one contiguous stretch of staged bytes (a combine's runs of flags, staged
/// in arrival order, bound for slots in token order): sorted by destination, the copies whose
/// destinations touch become one, each reading its bytes from the stretch in turn (every word
/// of it holds the value). The group stays where it was, after every copy before it, so each
/// signal still lands after everything that came before it in the ring; only the order among
/// the group's words changes, and those are set words of one value at distinct places (a
/// group whose destinations overlap is left alone).
fn regroup_fills(batch: &mut Vec<Pending>) {
    let mut k = 0;
    while k < batch.len() {
        let Some(value) = batch[k].fill else {
            k += 1;
            continue;
        };
        let end = (k..batch.len())
            .find(|&j| batch[j].fill != Some(value))
            .unwrap_or(batch.len());
        match (end - k >= 2).then(|| regrouped(&batch[k..end])).flatten() {
            Some(merged) => {
                let n = merged.len();
                batch.splice(k..end, merged);
                k += n;
            }
            None => k = end,
        }
    }
}

/// The group `group` (set copies of one value, see [`regroup_fills`]) as fewer copies, or
/// `None` when its staged bytes are not one stretch, its destinations overlap, or nothing
/// would merge.
fn regrouped(group: &[Pending]) -> Option<Vec<Pending>> {
    let mut by_src: Vec<&Pending> = group.iter().collect();
    by_src.sort_by_key(|c| c.src);
    if by_src
        .windows(2)
        .any(|w| w[0].src.checked_add(w[0].bytes as u64) != Some(w[1].src))
    {
        return None;
    }
    let mut src = by_src[0].src;
    let mut by_dst: Vec<&Pending> = group.iter().collect();
    by_dst.sort_by_key(|c| c.dst);
    let mut out: Vec<Pending> = Vec::with_capacity(group.len());
    for c in by_dst {
        match out.last_mut() {
            Some(last) if last.dst.saturating_add(last.bytes as u64) > c.dst => return None,
            Some(last) if last.dst.saturating_add(last.bytes as u64) == c.dst => {
                last.bytes += c.bytes
            }
            _ => out.push(Pending { src, ..*c }),
        }
        src += c.bytes as u64;
    }
    (out.len() < group.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pending copy of data.
    fn d(dst: u64, src: u64, bytes: usize) -> Pending {
        Pending::data(dst, src, bytes, 0)
    }

    /// A pending copy of signal words (not a set of one value).
    fn sg(dst: u64, src: u64, bytes: usize) -> Pending {
        Pending::signal(dst, src, bytes, 0, None)
    }

    /// A pending copy of set words holding `value`.
    fn set(dst: u64, src: u64, bytes: usize, value: u64) -> Pending {
        Pending::signal(dst, src, bytes, 0, Some(value))
    }

    fn joined(b: &[Pending], dst: u64, src: u64, bytes: usize) -> Option<(usize, Join)> {
        joined_copy(b, &d(dst, src, bytes), MERGE_WINDOW)
    }

    #[test]
    fn consecutive_rows_to_consecutive_slots_merge() {
        let mut b = vec![d(1000, 50_000, 64)];
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
        // Interleaved copies of other kinds (metadata rows elsewhere) do not stop it.
        b.push(d(9000, 70_000, 8));
        b.push(d(9100, 71_000, 8));
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
        assert_eq!(joined(&b, 9008, 70_008, 8), Some((1, Join::After)));
    }

    #[test]
    fn only_both_sides_continuing_merge() {
        let b = vec![d(1000, 50_000, 64)];
        assert_eq!(joined(&b, 1064, 60_000, 64), None, "source jumps");
        assert_eq!(joined(&b, 2000, 50_064, 64), None, "destination jumps");
        assert_eq!(joined(&b, 1000, 50_000, 64), None, "the same copy again");
        assert_eq!(joined(&[], 1064, 50_064, 64), None);
    }

    #[test]
    fn a_run_that_arrives_before_its_left_neighbour_joins_it_from_the_front() {
        // Rows 64..128 came first; rows 0..64 (ending where they start) join in front.
        let mut b = vec![d(1064, 50_064, 64), d(9000, 70_000, 8)];
        assert_eq!(joined(&b, 1000, 50_000, 64), Some((0, Join::Before)));
        // Only when both sides end there.
        assert_eq!(joined(&b, 1000, 40_000, 64), None);
        assert_eq!(joined(&b, 900, 50_000, 64), None);
        // A copy in between that writes the new destination blocks it.
        b.push(d(1010, 80_000, 8));
        assert_eq!(joined(&b, 1000, 50_000, 64), None);
        // The merged copy must not overlap itself: destination just before the source.
        let b = vec![d(1064, 1128, 64)];
        assert_eq!(joined(&b, 1000, 1064, 64), None);
    }

    #[test]
    fn a_copy_in_between_that_touches_the_bytes_blocks_the_merge() {
        // Writes the new destination.
        let b = vec![d(1000, 50_000, 64), d(1070, 80_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // Reads the new destination.
        let b = vec![d(1000, 50_000, 64), d(5000, 1100, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // Writes the new source.
        let b = vec![d(1000, 50_000, 64), d(50_100, 90_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // A signal's copy in between counts as well.
        let b = vec![d(1000, 50_000, 64), sg(1070, 80_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
    }

    #[test]
    fn data_never_joins_a_signal_copy() {
        // Arena-staged words continuing a signal's words, on both sides: still two copies
        // (merged, the data could land with the signal instead of after the copies before).
        let b = vec![sg(9000, 70_000, 8)];
        assert_eq!(joined(&b, 9008, 70_008, 8), None);
        assert_eq!(joined(&b, 8992, 69_992, 8), None);
        // It may still move ahead of one to join data before it.
        let b = vec![d(1000, 50_000, 64), sg(9000, 70_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
    }

    #[test]
    fn four_byte_values_below_the_table_are_copied_from_it() {
        let w = |value: u64, count: u32, width| Write {
            peer: 1,
            offset: 4096,
            value,
            width,
            count,
        };
        assert_eq!(
            counted_source(1 << 20, &w(0, 1, WriteWidth::Four)),
            Some(1 << 20)
        );
        assert_eq!(
            counted_source(1 << 20, &w(100, 28, WriteWidth::Four)),
            Some((1 << 20) + 400)
        );
        // The last element is the table's last.
        let last = COUNTING_ELEMS - 5;
        assert!(counted_source(0, &w(last, 5, WriteWidth::Four)).is_some());
        // Past the table, 8-byte elements: staged instead.
        assert_eq!(counted_source(0, &w(last, 6, WriteWidth::Four)), None);
        assert_eq!(counted_source(0, &w(0, 1, WriteWidth::Eight)), None);
        assert_eq!(counted_source(0, &w(u64::MAX, 2, WriteWidth::Four)), None);
        // Two consecutive runs' source indices continue each other on both sides: one copy.
        let (a, b) = (w(0, 16, WriteWidth::Four), w(16, 16, WriteWidth::Four));
        let batch = vec![d(9000, counted_source(5000, &a).unwrap(), 64)];
        let next = d(9064, counted_source(5000, &b).unwrap(), 64);
        assert_eq!(
            joined_copy(&batch, &next, MERGE_WINDOW),
            Some((0, Join::After))
        );
    }

    #[test]
    fn merged_ranges_that_would_overlap_do_not_merge() {
        // Source and destination 64 bytes apart: the merged copy would overlap itself.
        let b = vec![d(1064, 1000, 64)];
        assert_eq!(joined(&b, 1128, 1064, 64), None);
    }

    #[test]
    fn dependent_copies_do_not_share_a_batch() {
        let b = vec![d(1000, 50_000, 64), d(9000, 70_000, 8)];
        // Independent: other bytes everywhere, or only a source shared (reads commute).
        assert!(!depends_on_any(&b, 2000, 60_000, 64));
        assert!(!depends_on_any(&b, 2000, 50_000, 64));
        // Writes what a pending copy writes or reads, or reads what one writes.
        assert!(depends_on_any(&b, 1032, 60_000, 64));
        assert!(depends_on_any(&b, 50_010, 60_000, 8));
        assert!(depends_on_any(&b, 2000, 9004, 8));
        // Touching ends do not overlap.
        assert!(!depends_on_any(&b, 1064, 50_064, 64));
        assert!(!depends_on_any(&[], 0, 0, 8));
    }

    #[test]
    fn signals_merge_only_into_the_last_copy_when_it_holds_signals() {
        // A row, then the flag of that row.
        let b = vec![d(1000, 50_000, 64), sg(9000, 70_000, 8)];
        assert_eq!(signal_continued(&b, 9008, 70_008), Some(1));
        // Not continuing: another word, or another arena place.
        assert_eq!(signal_continued(&b, 9016, 70_008), None);
        assert_eq!(signal_continued(&b, 9008, 70_016), None);
        // The last copy carries data.
        let b = vec![d(9000, 70_000, 8)];
        assert_eq!(signal_continued(&b, 9008, 70_008), None);
        // A copy after the signal copy: merging would land the new signal before it.
        let b = vec![sg(9000, 70_000, 8), d(1000, 50_000, 64)];
        assert_eq!(signal_continued(&b, 9008, 70_008), None);
        assert_eq!(signal_continued(&[], 9008, 70_008), None);
    }

    #[test]
    fn the_window_is_bounded() {
        let mut b = vec![d(1000, 50_000, 64)];
        for k in 0..MERGE_WINDOW as u64 {
            b.push(d(100_000 + 16 * k, 200_000 + 16 * k, 8));
        }
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // The compaction pass looks further back.
        b.push(d(1064, 50_064, 64));
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b.len(), MERGE_WINDOW + 1);
        assert_eq!(b[0], d(1000, 50_000, 128));
    }

    /// Runs of four warps, each `rows` (row, weights, flag) as a combine sends them, arriving
    /// in the order `order`: what the push-time merge leaves, and what the compaction leaves.
    fn combine_runs(order: &[u64], flags: fn(u64, u64, usize) -> Pending) -> (usize, Vec<Pending>) {
        const ROW: u64 = 1024;
        let mut b: Vec<Pending> = Vec::new();
        let mut push = |c: Pending| {
            if !merged_into(&mut b, &c, MERGE_WINDOW) {
                b.push(c);
            }
        };
        for (a, &w) in order.iter().enumerate() {
            let rows = 16;
            push(d(
                1_000_000 + w * rows * 32,
                5_000_000 + w * rows * 32,
                (rows * 32) as usize,
            ));
            push(d(
                2_000_000 + w * rows * ROW,
                6_000_000 + w * rows * ROW,
                (rows * ROW) as usize,
            ));
            // Flags of the run staged in the arena in arrival order.
            push(flags(
                3_000_000 + w * rows * 8,
                7_000_000 + a as u64 * rows * 8,
                (rows * 8) as usize,
            ));
        }
        let pushed = b.len();
        compact(&mut b, COMPACT_WINDOW);
        (pushed, b)
    }

    #[test]
    fn compaction_merges_what_earlier_merges_made_adjacent() {
        // In order, everything merges at push time: weights and rows join the first run's
        // (ahead of its flags), so the flags copy is last again when the next flags continue it.
        let (pushed, b) = combine_runs(&[0, 1, 2, 3], sg);
        assert_eq!(pushed, 3);
        assert_eq!(b.len(), 3, "{b:?}");
        // Out of order: run 2 first, then 0, then 3 (continues 2), then 1 (between 0 and 2).
        let (pushed, b) = combine_runs(&[2, 0, 3, 1], sg);
        assert!(
            pushed > b.len(),
            "{pushed} pushed, {} after: {b:?}",
            b.len()
        );
        let data: Vec<_> = b.iter().filter(|c| !c.signal).collect();
        assert_eq!(data.len(), 2, "weights and rows, one copy each: {b:?}");
        assert_eq!(data[0], &d(1_000_000, 5_000_000, 4 * 16 * 32));
        assert_eq!(data[1], &d(2_000_000, 6_000_000, 4 * 16 * 1024));
        // Every signal stays after the data copies that came before it in arrival order.
        // (Both data copies hold data from before some flags: they must come first.)
        assert!(b[..2].iter().all(|c| !c.signal), "{b:?}");
        assert_eq!(
            b.iter()
                .filter(|c| c.signal)
                .map(|c| c.bytes)
                .sum::<usize>(),
            4 * 16 * 8
        );
    }

    #[test]
    fn set_flags_of_one_value_become_one_copy_whatever_the_arrival_order() {
        let epoch = |dst, src, bytes| set(dst, src, bytes, 7);
        for order in [[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]] {
            let (_, b) = combine_runs(&order, epoch);
            assert_eq!(b.len(), 3, "{order:?}: {b:?}");
            // Data first, then the flags of every run as one copy from the staged stretch.
            assert!(!b[0].signal && !b[1].signal);
            assert_eq!(b[2], set(3_000_000, 7_000_000, 4 * 16 * 8, 7), "{order:?}");
        }
    }

    #[test]
    fn only_set_copies_of_one_value_over_one_staged_stretch_are_regrouped() {
        // Out of order, one value, one stretch: merged.
        let mut b = vec![
            set(1016, 508, 8, 3),
            set(1000, 500, 8, 3),
            set(1008, 516, 8, 3),
        ];
        regroup_fills(&mut b);
        assert_eq!(b, vec![set(1000, 500, 24, 3)]);
        // Two values: two groups, each left as it is (nothing touches within a group).
        let mut b = vec![set(1016, 500, 8, 3), set(1000, 508, 8, 4)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // A gap in the staged bytes (something else staged between): left alone.
        let mut b = vec![set(1008, 500, 8, 3), set(1000, 516, 8, 3)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // Overlapping destinations (one word set twice): left alone.
        let mut b = vec![set(1000, 500, 16, 3), set(1008, 516, 8, 3)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // An add (no fill) or data between splits the groups; each keeps its place.
        let mut b = vec![
            set(1008, 500, 8, 3),
            sg(2000, 508, 8),
            set(1000, 516, 8, 3),
            d(5000, 9000, 64),
            set(1024, 524, 8, 3),
            set(1016, 532, 8, 3),
        ];
        regroup_fills(&mut b);
        assert_eq!(
            b,
            vec![
                set(1008, 500, 8, 3),
                sg(2000, 508, 8),
                set(1000, 516, 8, 3),
                d(5000, 9000, 64),
                set(1016, 524, 16, 3),
            ]
        );
        // Words merged at push time from different values lose their fill.
        let mut a = set(1000, 500, 8, 3);
        a.extend_signal(&set(1008, 508, 8, 4));
        assert_eq!(a.fill, None);
    }

    /// Random mixes of data copies (continuing, random, staged, overlapping) and signal copies
    /// (sets of two values, adds), pushed by the executor's rules and issued in batches
    /// (compacted), leave memory exactly as the copies one by one in ring order do; with
    /// batched copies also when every batch runs backwards, and no batch holds two copies
    /// that touch the same bytes.
    #[test]
    fn merged_batches_leave_memory_as_the_copies_in_order() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut rand = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        let run = |mem: &mut Vec<u8>, c: &Pending| {
            let (d, s, n) = (c.dst as usize, c.src as usize, c.bytes);
            let bytes = mem[s..s + n].to_vec();
            mem[d..d + n].copy_from_slice(&bytes);
        };
        for case in 0..3000 {
            let mut mem = vec![0u8; 1 << 18];
            for b in mem[100_000..110_000].iter_mut() {
                *b = rand(256) as u8;
            }
            let batched = case % 2 == 0;
            let max = [4, 16, MAX_BATCH][rand(3) as usize];
            let (mut batch, mut issued): (Vec<Pending>, Vec<Vec<Pending>>) = (vec![], vec![]);
            let issue = |batch: &mut Vec<Pending>, issued: &mut Vec<Vec<Pending>>| {
                if !batch.is_empty() {
                    compact(batch, COMPACT_WINDOW);
                    issued.push(std::mem::take(batch));
                }
            };
            let (mut arena, mut cursor, span) =
                (200_000u64, 0u64, [16u64, 64, 256][rand(3) as usize]);
            let mut ops = vec![];
            for _ in 0..1 + rand(100) {
                let c = if rand(10) < 6 {
                    let slot = if rand(3) == 0 {
                        rand(span)
                    } else {
                        cursor = (cursor + 1 + rand(2)) % span;
                        cursor
                    };
                    let (dst, bytes) = (8 * slot, 8 * (1 + rand(3)));
                    let src = match rand(6) {
                        0 => {
                            let at = arena;
                            arena += bytes;
                            for k in at..at + bytes {
                                mem[k as usize] = rand(256) as u8;
                            }
                            at
                        }
                        1 => 8 * rand(span + 8),
                        _ => 100_000 + dst,
                    };
                    if src < dst + bytes && dst < src + bytes {
                        continue;
                    }
                    d(dst, src, bytes as usize)
                } else {
                    let words = 1 + rand(2);
                    let set_value = (rand(4) != 0).then(|| 1 + rand(2));
                    let value = set_value.unwrap_or(1000 + rand(1000));
                    arena += 8 * rand(2); // sometimes other staging between
                    let at = arena;
                    for w in 0..words {
                        let k = (at + 8 * w) as usize;
                        mem[k..k + 8].copy_from_slice(&value.to_le_bytes());
                    }
                    arena += 8 * words;
                    let dst = 4096 + 8 * rand(24);
                    Pending::signal(dst, at, 8 * words as usize, 0, set_value)
                };
                ops.push(c);
                if c.signal {
                    if let Some(k) = signal_continued(&batch, c.dst, c.src) {
                        batch[k].extend_signal(&c);
                        continue;
                    }
                    if batched {
                        issue(&mut batch, &mut issued);
                    }
                    batch.push(c);
                } else {
                    if batched && depends_on_any(&batch, c.dst, c.src, c.bytes) {
                        issue(&mut batch, &mut issued);
                    }
                    if let Some((k, side)) = joined_copy(&batch, &c, MERGE_WINDOW) {
                        join(&mut batch[k], &c, side);
                        continue;
                    }
                    batch.push(c);
                }
                if batch.len() >= max || rand(8) == 0 {
                    issue(&mut batch, &mut issued);
                }
            }
            issue(&mut batch, &mut issued);
            let mut expected = mem.clone();
            ops.iter().for_each(|c| run(&mut expected, c));
            let mut got = mem.clone();
            issued.iter().flatten().for_each(|c| run(&mut got, c));
            assert!(got == expected, "case {case}: {ops:?} issued as {issued:?}");
            if batched {
                let mut backwards = mem.clone();
                for b in &issued {
                    b.iter().rev().for_each(|c| run(&mut backwards, c));
                    for (x, c) in b.iter().enumerate() {
                        assert!(
                            !b[x + 1..].iter().any(|e| touches(c, e.dst, e.src, e.bytes)),
                            "case {case}: dependent copies in one batch {b:?}"
                        );
                    }
                }
                assert!(
                    backwards == expected,
                    "case {case}: {ops:?} issued as {issued:?}"
                );
            }
        }
    }

    #[test]
    fn compaction_keeps_each_signal_behind_the_copies_before_it() {
        // data A, signal S, data B that overlaps A's destination: B cannot move ahead of S's
        // predecessor (it touches A), so the order A, S, B stays.
        let mut b = vec![
            d(1000, 50_000, 64),
            sg(9000, 70_000, 8),
            d(1032, 60_000, 64),
        ];
        let before = b.clone();
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b, before);
        // Two signals with data between that moves ahead: the signals then merge, still after
        // every data copy.
        let mut b = vec![
            d(1000, 50_000, 64),
            sg(9000, 70_000, 8),
            d(1064, 50_064, 64),
            sg(9008, 70_008, 8),
        ];
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b, vec![d(1000, 50_000, 128), sg(9000, 70_000, 16)]);
    }
}
