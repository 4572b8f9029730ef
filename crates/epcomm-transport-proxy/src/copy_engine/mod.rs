//! The copy-engine executor: the proxy's operations become stream-ordered driver work on one
//! CUDA stream per peer, executed by the GPU's copy engines between GPUs (no SM moves a byte;
//! within one GPU the driver moves the bytes with SMs, see "Ranks of one GPU" below).
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
//! touches its bytes, so the stream's result is unchanged; before a batch goes out, chains of
//! independent copies (no other copy of the batch touches their bytes) merge across the whole
//! batch, and one more pass merges the copies that earlier merges made adjacent
//! ([`merge::compact`]). Then one
//! `cuMemcpyAsync` each (the default), or, with
//! [`CopyEngineExecutor::set_batch_copies`], one `cuMemcpyBatchAsync` (source read in stream
//! order, with the hint to use the copy engines rather than SMs; a copy that depends on a
//! pending one starts a new batch, since a batch runs in no particular order), falling back to
//! single copies where the driver refuses it. Batches are off by default: they lost copies in a
//! measured case (a 16 384-token dispatch; docs/proxy.md, "Status").

//! **Ranks of one GPU.** Between two ranks sharing a GPU a copy is device-to-device within
//! it, which the driver runs as a kernel of its own on the SMs, not in the copy engines
//! (batched or not; about 5 us per copy of the issuing thread and of the GPU, measured in
//! docs/benchmarks.md, "Where a `proxy-ce` op's time goes on one GPU"). Between GPUs the
//! copies run in the copy engines.
//!
//! **Streams.** One per mapped peer (none for ranks reached by stores), plus the progress
//! mirror's. A stream the driver puts on the same hardware queue as the stream of a kernel
//! that waits for this executor's copies would deadlock: see
//! [`crate::check_copy_stream_queues`].
//!
//! **Copy streams.** With [`CopyEngineExecutor::set_copy_streams`] `n > 1`, each peer's lane
//! has `n - 1` side streams, so that one batch's large copies run in several copy engines
//! side by side: the batch's independent copies of data of at least [`STRIPE_MIN_BYTES`]
//! (no other copy of the batch touches their bytes, [`merge::stripes`]) go first, dealt over
//! the lane's stream and its side streams after an event that makes the side streams wait for
//! everything the lane's stream holds; then the lane's stream waits for each side stream's
//! event and takes the rest of the batch in order. So every copy and signal of earlier
//! batches is complete before a side stream starts, every later one (and the event that
//! marks the batch complete) waits for the side streams, and within the batch only the
//! independent copies move ahead, which changes nothing but when they land.
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
//! a batch goes out ([`merge::regroup_fills`]): they stay after everything before them, only their
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
use epcomm_proxy::descriptor::{Signal, SignalOp, Source, Transfer, Write};
use epcomm_proxy::{Executor, OpFailure, OpId, Submit};
use epcomm_transport::{MappedHostBuffer, TransportError};

use crate::fifo::Fifo;
use crate::watch::{CallWatch, CopyKinds, Moment};

mod merge;
mod mirror;
mod streams;
use merge::{
    COMPACT_WINDOW, COUNTING_ELEMS, MERGE_WINDOW, Pending, compact, counted_source, depends_on_any,
    kinds_of, merged_into, stripes,
};
use mirror::Mirror;

/// Bytes of each lane's pinned staging arena.
const ARENA_BYTES: usize = 4 << 20;

/// Events made per mapped peer when the executor is created (the only events it uses).
const EVENTS_PER_LANE: usize = 64;

/// Most copies handed to the driver in one batch.
const MAX_BATCH: usize = 1024;

/// Batches a lane keeps in the copy engines before it holds new copies back
/// ([`CopyEngineExecutor::set_queue_depth`]).
pub const DEFAULT_QUEUE_DEPTH: usize = 2;

/// The largest queue depth: a lane never has more batches running than it has events.
pub const MAX_QUEUE_DEPTH: usize = EVENTS_PER_LANE;

/// The longest interval between looks for completions while work arrives
/// ([`CopyEngineExecutor::set_query_interval`]).
pub const MAX_QUERY_INTERVAL: std::time::Duration = std::time::Duration::from_millis(1);

/// The most streams a lane spreads a batch's copies over
/// ([`CopyEngineExecutor::set_copy_streams`]).
pub const MAX_COPY_STREAMS: usize = 4;

/// The smallest copy a lane hands to a side stream ([`CopyEngineExecutor::set_copy_streams`]):
/// smaller ones cost more in driver calls than running beside others gains.
pub const STRIPE_MIN_BYTES: usize = 256 << 10;

/// The longest a lane keeps its pending copies back ([`CopyEngineExecutor::set_linger`]).
pub const MAX_LINGER: std::time::Duration = std::time::Duration::from_millis(1);

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
    /// When the first of `unmarked` was submitted (the linger counts from it).
    unmarked_since: Option<std::time::Instant>,
    /// Events in record order, each with the operations it completes, the arena total it
    /// frees up to, and when it was recorded.
    marks: VecDeque<(CudaEvent, Vec<OpId>, usize, std::time::Instant)>,
    /// Side streams with their join events, and the fork event they wait for
    /// ([`CopyEngineExecutor::set_copy_streams`]; none by default).
    sides: Vec<(Arc<CudaStream>, CudaEvent)>,
    fork: Option<CudaEvent>,
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
    /// ... and only once its oldest pending operation has waited this long.
    linger: std::time::Duration,
    /// While operations keep arriving, completions are looked for at most this often.
    query_interval: std::time::Duration,
    /// When completions were last looked for.
    last_query: std::time::Instant,
    /// Operations accepted since the last poll (a round that took work).
    accepted_since_poll: usize,
    /// Copies merged into a pending one when pushed, since the last hand-over (reported with
    /// it, [`CallWatch::copy_kinds`]).
    merged_at_push: u64,
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
                    unmarked_since: None,
                    marks: VecDeque::new(),
                    sides: Vec::new(),
                    fork: None,
                })
            })
            .collect::<Result<_, TransportError>>()?;
        let mapped = peer_bases.iter().filter(|&&b| b != 0).count();
        let counting = MappedHostBuffer::zeroed(&ctx, 4 * COUNTING_ELEMS as usize)?;
        for j in 0..COUNTING_ELEMS / 2 {
            counting.store_u64(j as usize, counting_word(j));
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
            linger: std::time::Duration::ZERO,
            query_interval: std::time::Duration::ZERO,
            last_query: std::time::Instant::now(),
            accepted_since_poll: 0,
            merged_at_push: 0,
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

    /// How long a lane keeps its first pending operation before handing copies over (at most
    /// [`MAX_LINGER`]; default zero): the descriptors that arrive meanwhile merge with it
    /// (the warps of one kernel post their runs within microseconds of each other, which
    /// a lane with idle copy engines would otherwise hand over one round at a time). A full
    /// batch goes out at once whatever the linger. Holding never stalls: the proxy polls
    /// every round, and the copies go out once the time has passed.
    pub fn set_linger(&mut self, linger: std::time::Duration) {
        self.linger = linger.min(MAX_LINGER);
    }

    /// How often, at most, a poll looks for completed copies (one `cuEventQuery` per lane with
    /// copies running) while new operations keep arriving (at most [`MAX_QUERY_INTERVAL`];
    /// default zero: at every poll). A poll after which nothing new arrived always looks, so
    /// the wait at the end of an op (when the kernel waits for its completions and posts
    /// nothing) is not lengthened; during a burst the proxy's time goes to new copies.
    pub fn set_query_interval(&mut self, interval: std::time::Duration) {
        self.query_interval = interval.min(MAX_QUERY_INTERVAL);
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
        let before = self.lanes[i].batch.len();
        compact(&mut self.lanes[i].batch, COMPACT_WINDOW);
        let (signal, small, large) = kinds_of(&self.lanes[i].batch, CopyKinds::SMALL);
        let handed = CopyKinds {
            signal: signal as u64,
            small: small as u64,
            large: large as u64,
            merged_at_push: std::mem::take(&mut self.merged_at_push),
            merged_at_hand_over: (before - self.lanes[i].batch.len()) as u64,
        };
        let bytes: u64 = self.lanes[i].batch.iter().map(|c| c.bytes as u64).sum();
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
                    self.watch.handed(i as u32, bytes, &handed);
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
        let striped = stripes(
            &self.lanes[i].batch,
            1 + self.lanes[i].sides.len(),
            STRIPE_MIN_BYTES,
        );
        match striped {
            Some(merge::Stripes { lead, rest }) => self.striped_copies(i, &lead, &rest)?,
            None => {
                for k in 0..self.lanes[i].batch.len() {
                    self.copy(i, k, stream)?;
                }
            }
        }
        self.watch.handed(i as u32, bytes, &handed);
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
        if merged_into(&mut lane.batch, &copy, MERGE_WINDOW) {
            self.merged_at_push += 1;
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
    /// holds signals only and this continues it ([`merge::merged_into`]); otherwise a new copy (with batched copies, in
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
        if merged_into(&mut lane.batch, &copy, MERGE_WINDOW) {
            self.merged_at_push += 1;
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
        if self.lanes[i].unmarked.is_empty() {
            self.lanes[i].unmarked_since = Some(std::time::Instant::now());
        }
        self.accepted_since_poll += 1;
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
    /// with others of its value, [`merge::regroup_fills`]); `Ok(false)` when the arena has no room
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
        let busy = self.accepted_since_poll > 0;
        if busy {
            self.watch.note(Moment::Took {
                ops: u32::try_from(self.accepted_since_poll).unwrap_or(u32::MAX),
            });
        }
        self.accepted_since_poll = 0;
        let query = queries_now(busy, self.last_query.elapsed(), self.query_interval);
        if query {
            self.last_query = std::time::Instant::now();
        }
        // Completions first: a lane whose batches completed may hand over its held copies below.
        for i in 0..self.lanes.len() {
            if !query {
                break;
            }
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
                let Some((event, ops, freed, recorded)) = self.lanes[i].marks.pop_front() else {
                    break;
                };
                self.watch.completed(
                    i as u32,
                    u32::try_from(ops.len()).unwrap_or(u32::MAX),
                    recorded.elapsed(),
                );
                self.lanes[i].fifo.free_to(freed);
                self.in_flight -= ops.len();
                done.extend(ops);
                self.free_events.push(event);
            }
        }
        for i in 0..self.lanes.len() {
            // Nothing new, or `queue_depth` batches still running: the copies wait here, where
            // the next ones merge with them (the running batches complete on their own).
            let lane = &self.lanes[i];
            let waited = lane
                .unmarked_since
                .map_or(std::time::Duration::ZERO, |t| t.elapsed());
            if !hands_over(
                !lane.unmarked.is_empty(),
                lane.marks.len(),
                self.queue_depth,
                waited,
                self.linger,
            ) {
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
            lane.unmarked_since = None;
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

/// Word `j` of the counting table: its elements 2j and 2j + 1 (`u32`, little-endian).
fn counting_word(j: u64) -> u64 {
    (2 * j) | ((2 * j + 1) << 32)
}

/// Whether a poll looks for completions: always after a round that brought nothing new
/// (`busy` false), else once `interval` has passed since it last looked.
fn queries_now(busy: bool, since_last: std::time::Duration, interval: std::time::Duration) -> bool {
    !busy || since_last >= interval
}

/// Whether a lane hands its pending copies to the driver at this poll: it has some, fewer
/// than `depth` of its batches are still running, and its oldest pending operation `waited`
/// at least `linger`.
fn hands_over(
    pending: bool,
    running: usize,
    depth: usize,
    waited: std::time::Duration,
    linger: std::time::Duration,
) -> bool {
    pending && running < depth && waited >= linger
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_counting_table_holds_each_index_at_its_place() {
        // The table's bytes, as the copy engines read them: element k is k.
        let bytes: Vec<u8> = (0..8)
            .flat_map(|j| counting_word(j).to_le_bytes())
            .collect();
        for k in 0..16u32 {
            let at = 4 * k as usize;
            assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), k);
        }
        let last = counting_word(COUNTING_ELEMS / 2 - 1);
        assert_eq!(last >> 32, COUNTING_ELEMS - 1);
    }

    #[test]
    fn a_lane_holds_its_copies_while_depth_batches_run() {
        let zero = Duration::ZERO;
        assert!(hands_over(true, 0, 2, zero, zero));
        assert!(hands_over(true, 1, 2, zero, zero));
        assert!(
            !hands_over(true, 2, 2, zero, zero),
            "two running at depth 2: hold"
        );
        assert!(!hands_over(false, 0, 2, zero, zero), "nothing pending");
        assert!(hands_over(true, 0, 1, zero, zero));
        assert!(!hands_over(true, 1, 1, zero, zero));
    }

    #[test]
    fn completions_are_looked_for_when_idle_or_after_the_interval() {
        let us = Duration::from_micros;
        assert!(
            queries_now(false, us(0), us(20)),
            "nothing new arrived: look"
        );
        assert!(
            !queries_now(true, us(5), us(20)),
            "busy, looked 5 us ago: skip"
        );
        assert!(
            queries_now(true, us(20), us(20)),
            "busy, interval passed: look"
        );
        assert!(
            queries_now(true, us(0), Duration::ZERO),
            "interval zero: every poll"
        );
    }

    #[test]
    fn a_lane_holds_its_copies_until_the_linger_has_passed() {
        let us = Duration::from_micros;
        assert!(
            !hands_over(true, 0, 2, us(3), us(10)),
            "waited 3 of 10 us: hold"
        );
        assert!(hands_over(true, 0, 2, us(10), us(10)));
        assert!(hands_over(true, 0, 2, us(50), us(10)));
        assert!(
            !hands_over(true, 2, 2, us(50), us(10)),
            "lingered, but depth batches run: hold"
        );
        assert!(!hands_over(false, 0, 2, us(50), us(10)), "nothing pending");
    }
}
