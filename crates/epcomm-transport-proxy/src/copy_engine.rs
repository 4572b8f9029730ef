//! The copy-engine executor: the proxy's operations become stream-ordered driver work on one
//! CUDA stream per peer, executed by the GPU's copy engines (no SM moves a byte).
//!
//! | operation | driver work on the peer's stream |
//! |---|---|
//! | transfer | `cuMemcpyDtoDAsync` from the source (caller memory or this rank's buffer) to the peer's buffer through its CUDA-IPC mapping |
//! | write (4/8 bytes) | a `CU_STREAM_MEM_OP_WRITE_VALUE_32/64` entry, without memory barrier, batched per stream with `cuStreamBatchMemOp` |
//! | signal set | `cuStreamWriteValue64` (with its default memory barrier) |
//! | signal add | the same, writing a running sum kept here (see below) |
//!
//! **Ordering.** One stream per peer and submission order kept on it: a signal is written after
//! every earlier copy and write to that peer has completed, with a memory barrier before it —
//! the contract of [`epcomm_proxy::Executor`]. Pending writes of a stream are flushed into it
//! before any later copy or signal on that stream.
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

use cudarc::driver::sys::{self, CUstreamBatchMemOpParams};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use epcomm_proxy::descriptor::{Signal, SignalOp, Source, Transfer, Write, WriteWidth};
use epcomm_proxy::{Executor, OpFailure, OpId, Submit};

/// Entries per `cuStreamBatchMemOp` call.
const BATCH: usize = 128;

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
}

/// One peer's lane: its stream, its mapping, and what was submitted since the last poll.
struct Lane {
    stream: Arc<CudaStream>,
    /// Base of the peer's buffer in this process (0: not mapped).
    base: u64,
    /// Write entries not yet handed to the driver.
    writes: Vec<CUstreamBatchMemOpParams>,
    /// Operations submitted since the last event.
    unmarked: Vec<OpId>,
    /// Events in record order, each with the operations it completes.
    marks: VecDeque<(CudaEvent, Vec<OpId>)>,
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
    /// The driver's error creating a stream.
    pub fn new(
        ctx: Arc<CudaContext>,
        local_base: u64,
        peer_bases: &[u64],
        max_in_flight: usize,
    ) -> Result<Self, DriverError> {
        let lanes = peer_bases
            .iter()
            .map(|&base| {
                Ok(Lane {
                    stream: ctx.new_stream()?,
                    base,
                    writes: Vec::new(),
                    unmarked: Vec::new(),
                    marks: VecDeque::new(),
                })
            })
            .collect::<Result<_, DriverError>>()?;
        Ok(Self {
            ctx,
            local_base,
            lanes,
            shadow: HashMap::new(),
            free_events: Vec::new(),
            in_flight: 0,
            max_in_flight: max_in_flight.max(1),
        })
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

    /// Hands lane `i`'s pending writes to the driver.
    fn flush_writes(&mut self, i: usize, op: OpId) -> Result<(), OpFailure> {
        let lane = &mut self.lanes[i];
        for chunk in lane.writes.chunks_mut(BATCH) {
            // SAFETY: `chunk` holds `chunk.len()` initialised write-value entries whose
            // addresses lie in the peer's mapped buffer (checked at submission); the driver
            // copies the array before returning.
            unsafe {
                sys::cuStreamBatchMemOp_v2(
                    lane.stream.cu_stream(),
                    chunk.len() as u32,
                    chunk.as_mut_ptr(),
                    0,
                )
            }
            .result()
            .map_err(Self::driver(
                op,
                i as u32,
                "cuStreamBatchMemOp (inline writes)",
            ))?;
        }
        lane.writes.clear();
        Ok(())
    }

    fn accept(&mut self, i: usize, op: OpId) -> Submit {
        self.lanes[i].unmarked.push(op);
        self.in_flight += 1;
        Submit::Accepted
    }

    fn write_value64(
        &mut self,
        i: usize,
        op: OpId,
        offset: u64,
        value: u64,
    ) -> Result<(), OpFailure> {
        self.flush_writes(i, op)?;
        let lane = &self.lanes[i];
        // SAFETY: the address lies in the peer's mapped buffer (offsets are bounds-checked by
        // the descriptor decoder); the stream belongs to this executor's context.
        unsafe {
            sys::cuStreamWriteValue64_v2(
                lane.stream.cu_stream(),
                lane.base + offset,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .map_err(Self::driver(op, i as u32, "cuStreamWriteValue64 (signal)"))
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
        self.ctx
            .bind_to_thread()
            .map_err(Self::driver(op, t.peer, "binding the CUDA context"))?;
        self.flush_writes(i, op)?;
        let src = match t.src {
            Source::Heap(offset) => self.local_base + offset,
            Source::Address(addr) => addr,
        };
        let lane = &self.lanes[i];
        // SAFETY: the destination lies in the peer's mapped buffer (bounds-checked by the
        // decoder); the source is a device address the producing kernel named in this process,
        // which it keeps valid until this operation completes (it waits for the completion
        // count before its sources may be reused).
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                lane.base + t.dst_offset,
                src,
                t.bytes as usize,
                lane.stream.cu_stream(),
            )
        }
        .result()
        .map_err(Self::driver(op, t.peer, "cuMemcpyDtoDAsync (transfer)"))?;
        Ok(self.accept(i, op))
    }

    fn submit_write(&mut self, op: OpId, w: &Write) -> Result<Submit, OpFailure> {
        if self.in_flight >= self.max_in_flight {
            return Ok(Submit::Busy);
        }
        let i = self.lane(op, w.peer)?;
        let address = self.lanes[i].base + w.offset;
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER as u32;
        let mut value =
            sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 {
                value64: w.value,
            };
        let operation = match w.width {
            WriteWidth::Four => {
                value = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 {
                    value: w.value as u32,
                };
                sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32
            }
            WriteWidth::Eight => sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64,
        };
        // SAFETY: an all-zero parameter block is a valid value of this plain-data union (its
        // `pad` member spans it), so the bytes the write variant leaves are defined.
        let mut entry: CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        entry.writeValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st {
            operation,
            address,
            __bindgen_anon_1: value,
            flags,
            alias: 0,
        };
        self.lanes[i].writes.push(entry);
        Ok(self.accept(i, op))
    }

    fn submit_signal(&mut self, op: OpId, s: &Signal) -> Result<Submit, OpFailure> {
        if self.in_flight >= self.max_in_flight {
            return Ok(Submit::Busy);
        }
        let i = self.lane(op, s.peer)?;
        self.ctx
            .bind_to_thread()
            .map_err(Self::driver(op, s.peer, "binding the CUDA context"))?;
        let value = match s.op {
            SignalOp::Set => s.value,
            SignalOp::Add => {
                let word = self.shadow.entry((s.peer, s.offset)).or_insert(0);
                *word = word.wrapping_add(s.value);
                *word
            }
        };
        self.write_value64(i, op, s.offset, value)?;
        Ok(self.accept(i, op))
    }

    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        if self.in_flight == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|source| {
            OpFailure::new(
                0,
                CopyEngineError::Driver {
                    what: "binding the CUDA context",
                    peer: 0,
                    source,
                },
            )
        })?;
        for i in 0..self.lanes.len() {
            if self.lanes[i].unmarked.is_empty() {
                continue;
            }
            let first = self.lanes[i].unmarked[0];
            self.flush_writes(i, first)?;
            let event = match self.free_events.pop() {
                Some(e) => e,
                None => self.ctx.new_event(None).map_err(Self::driver(
                    first,
                    i as u32,
                    "cuEventCreate",
                ))?,
            };
            let lane = &mut self.lanes[i];
            event
                .record(&lane.stream)
                .map_err(Self::driver(first, i as u32, "cuEventRecord"))?;
            let ops = std::mem::take(&mut lane.unmarked);
            lane.marks.push_back((event, ops));
        }
        for i in 0..self.lanes.len() {
            while let Some((event, ops)) = self.lanes[i].marks.front() {
                // SAFETY: the event is live (owned here) and was recorded on this context.
                let status = unsafe { sys::cuEventQuery(event.cu_event()) };
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
                let Some((event, ops)) = self.lanes[i].marks.pop_front() else {
                    break;
                };
                self.in_flight -= ops.len();
                done.extend(ops);
                self.free_events.push(event);
            }
        }
        Ok(())
    }
}
