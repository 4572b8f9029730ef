//! [`Buffer`]: one per process (per GPU); owns the transport, the symmetric buffer, the stream,
//! the loaded kernels and the op sequence numbers that every rank keeps in step.
//!
//! This file holds the state and its life cycle (accessors, stream events, teardown); the
//! methods live by idea in the child modules:
//!
//! | module | what |
//! |---|---|
//! | `setup` | [`Buffer::new`]: checks, kernel load, config agreement, symmetric memory, peer bases |
//! | `sequence` | the host mirror of the device `SeqState` |
//! | `health` | failure state, the device error record, the HostSync wait, diagnostics |
//! | `validate` | caller inputs (shapes, ownership) and `pointers`: caller addresses |
//! | `args` | kernel argument blocks from the plan, the config and the inputs |
//! | `ops` | op families: `ops::layout`, `ops::normal` (dispatch, combine), `ops::low_latency` |
//! | `graph` | CUDA-graph capture and replay ([`EpGraph`]) |
//!
//! The state is a handful of parts, each owning its data: [`Place`] (rank, group, routes,
//! plan), [`Launcher`] (context, stream, loaded image and its binding), `health::Health`
//! (failure state, error record, last launch, teardown outcome), the sequence mirror,
//! `graph::CaptureState`, the latest dispatch, `ops::LowLatencyState` and [`Memory`] (the
//! symmetric buffer, the device words, the transport, dropped last).
//!
//! Memory contract: the symmetric buffer (`memory.mem`) is written by the kernels of every rank
//! (peers through their mappings or put/signal) and read on the host only after a synchronize
//! (diagnostics); `health.err_record` and `memory.host_counts` are mapped host memory that
//! kernels write and the host polls; `health.err_claim`, `memory.seq_state` and
//! `memory.peer_bases` are device memory only the kernels touch after setup. Every op is
//! stream-ordered on `launcher.stream`.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use epcomm_kernels::OpModule;
use epcomm_topology::{BufferPlan, RankGroup, RoutePlan};
use epcomm_transport::{DeviceBuffer, DynTransport, MappedHostBuffer, SymmetricMemory};

use crate::error::DriverContext;
use crate::{BufferConfig, Error, Result};

mod args;
pub(crate) mod driver;
pub(crate) mod graph;
mod health;
mod inputs;
mod ops;
mod pointers;
mod sequence;
mod setup;
mod sharing;

pub(crate) use setup::TierParts;
mod validate;

pub use graph::EpGraph;
pub use ops::{
    CombineInput, CombineOutput, CountedRows, DeviceBytes, DispatchInput, LlDispatchInput,
    LlFormat, LlPending, LlRecv, LlScalesLayout, RecvArray, XInput,
};

use ops::LatestDispatch;
pub(crate) use sequence::Sequence;

/// One rank's epcomm state: see the crate docs. A handful of parts, each owning its data.
#[derive(Debug)]
pub struct Buffer {
    /// Process-unique: layouts, handles and graphs remember the buffer that made them.
    id: u64,
    cfg: BufferConfig,
    /// Who this rank is among whom, how it reaches them, and where every region lies.
    place: Place,
    /// The stream, the loaded kernel image and what binds it to the transport.
    launcher: Launcher,
    /// Failure state, the device error record, the last launch, teardown's outcome.
    health: health::Health,
    /// The host mirror of the device `SeqState`.
    seq: Sequence,
    /// CUDA-graph recording state.
    capture: graph::CaptureState,
    /// Routing, element type and weights of the latest (cached) dispatch (in-place combine).
    latest_dispatch: Option<LatestDispatch>,
    /// Low-latency state: the outstanding receive phase and the kernels' launch shape.
    ll: ops::LowLatencyState,
    /// The symmetric buffer, the device words the kernels keep, and the transport (dropped
    /// last).
    memory: Memory,
}

/// Who this rank is among whom and where the regions lie (fixed at creation).
#[derive(Debug)]
pub(crate) struct Place {
    /// This rank's index in `group` (the whole world unless the buffer is one tier's).
    pub(crate) rank: usize,
    /// Ranks in `group`.
    pub(crate) world: usize,
    /// The world ranks the buffer spans; kernels number them `0..world`.
    pub(crate) group: RankGroup,
    /// How every peer is reached (computed once, from the world layout and the transport).
    pub(crate) routes: RoutePlan,
    /// Bit d: rank d is reached with the transport's put/signal (`routes`' mask).
    pub(crate) remote_mask: u64,
    pub(crate) plan: BufferPlan,
    /// Bytes between the two parity copies of every per-parity region.
    pub(crate) parity_stride: u64,
}

/// What launches: the context, the stream every op runs on, and the loaded kernel image.
#[derive(Debug)]
pub(crate) struct Launcher {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Dropped (unbound) before the module unloads, by `Buffer`'s `Drop` (or leaked with it).
    pub(crate) module_binding: ManuallyDrop<Box<dyn std::fmt::Debug + Send + Sync>>,
    /// Unloaded by `Buffer`'s `Drop`, unless leaked.
    pub(crate) kernels: ManuallyDrop<OpModule>,
}

/// The memory the kernels address, and the transport that made the symmetric part of it.
#[derive(Debug)]
pub(crate) struct Memory {
    /// Freed by `teardown` (or leaked there when the free is collective and a peer is gone),
    /// never by the field's own drop.
    pub(crate) mem: ManuallyDrop<Box<dyn SymmetricMemory>>,
    /// `[world]` u64 base address the kernels use for every rank's buffer (freed by `Drop`
    /// unless leaked, as are `host_counts` and `seq_state`).
    pub(crate) peer_bases: ManuallyDrop<DeviceBuffer>,
    /// Mapped host `[tag, rows, per local expert...]` a HostSync dispatch publishes.
    pub(crate) host_counts: ManuallyDrop<MappedHostBuffer>,
    /// The device `SeqState` (authoritative; `Buffer::seq` mirrors it).
    pub(crate) seq_state: ManuallyDrop<DeviceBuffer>,
    pub(crate) transport: Arc<dyn DynTransport>,
}

impl Buffer {
    /// This rank (its index in [`Self::group`]: its world rank unless the buffer is one
    /// tier's).
    pub fn rank(&self) -> usize {
        self.place.rank
    }

    /// Rows the receive region holds (`world * max_tokens_per_rank`).
    pub(crate) fn recv_capacity_rows(&self) -> usize {
        self.place.plan.recv_rows() as usize
    }

    /// The world ranks this buffer spans.
    pub fn group(&self) -> &RankGroup {
        &self.place.group
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.place.world
    }

    /// The CUDA context of this rank's GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.launcher.ctx
    }

    /// The configuration.
    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    /// Blocks (SMs) every low-latency kernel of this buffer runs on: `ll_num_sms`, or when that
    /// is 0 every SM this rank may use (the same on every rank).
    pub fn ll_num_blocks(&self) -> u32 {
        self.ll.blocks
    }

    /// The transport.
    pub fn transport(&self) -> &dyn DynTransport {
        self.memory.transport.as_ref()
    }

    /// How this rank reaches every peer (tier and route per rank).
    pub fn route_plan(&self) -> &RoutePlan {
        &self.place.routes
    }

    /// The stream every op runs on. Make it wait for your producers ([`Self::wait_event`]) and
    /// make your consumers wait for it ([`Self::record_event`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.launcher.stream
    }

    /// Bytes of symmetric memory per rank.
    pub fn symmetric_bytes(&self) -> usize {
        self.memory.mem.len()
    }

    /// Orders the next op after `event` (e.g. the end of the kernel producing `x`).
    pub fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        self.launcher
            .stream
            .wait(event)
            .context("waiting on a caller's event")
    }

    /// Records an event after the ops issued so far (async mode: wait on it instead of the host).
    pub fn record_event(&self) -> Result<CudaEvent> {
        self.launcher
            .stream
            .record_event(None)
            .context("recording an event")
    }

    /// Waits for every issued op and reports any device failure.
    pub fn synchronize(&mut self) -> Result<()> {
        self.launcher
            .stream
            .synchronize()
            .context("synchronizing the comm stream")?;
        self.check()
    }

    /// Frees the buffer after the peers stopped touching it, and reports what went wrong on
    /// the way (dropping does the same and prints a warning instead). **Collective**: every
    /// rank destroys (or drops) its buffer.
    ///
    /// Order: wait for this rank's own launched ops (bounded by the op timeout plus a second;
    /// caller work queued on the stream after them is not waited for), release this rank's
    /// mappings of the peers' memory, then a host barrier (bounded by the bootstrap timeout; a
    /// dead peer is detected sooner), and only then free this rank's memory, so no peer can
    /// write into memory that is already freed and perhaps reused.
    ///
    /// What cannot be proven idle is leaked instead (it returns when the process exits): the
    /// symmetric memory when the barrier failed and the peer is not known to be gone (a slow
    /// peer's late kernel may still write through its mapping), or when freeing it is
    /// collective; everything the kernels address when this rank's own last op did not finish
    /// in time (reported as an error).
    pub fn destroy(mut self) -> Result<()> {
        self.teardown()
    }

    /// [`Self::destroy`]'s work; runs once (later calls, e.g. from `Drop`, return `Ok`).
    fn teardown(&mut self) -> Result<()> {
        if self.health.torn_down {
            return Ok(());
        }
        self.health.torn_down = true;
        let limit = self.launch_wait_limit();
        let finished = self.wait_launched(limit);
        // A device failure was already reported by the op that hit it; destroying a failed
        // buffer is the way out, so only driver and transport errors surface here.
        let checked = if finished { self.check() } else { Ok(()) };
        if finished {
            self.memory.mem.release_peer_mappings();
        }
        let barrier = self
            .memory
            .transport
            .bootstrap()
            .barrier("epcomm-buffer-unmapped");
        let free = finished
            && match &barrier {
                Ok(()) => true,
                // A collective free would wait for the missing peers forever.
                Err(_) if self.memory.mem.free_is_collective() => false,
                // A peer that may still run may still write through its mapping.
                Err(e) => peer_is_gone(e),
            };
        if free {
            // SAFETY: `mem` is taken exactly once (guarded by `torn_down`) and never used after.
            unsafe { ManuallyDrop::drop(&mut self.memory.mem) };
        }
        if !finished {
            self.health.leaked = true;
            return Err(Error::Failed(format!(
                "destroying the buffer: this rank's last {} did not finish within {limit:?} \
                 (work queued on the stream before it, e.g. a wait on a caller's event, still \
                 holds it); its memory, mappings and kernels are leaked so that no kernel can \
                 touch freed memory",
                self.health.last_op.unwrap_or("op")
            )));
        }
        barrier?;
        match checked {
            Err(e @ (Error::Driver { .. } | Error::Transport(_) | Error::Kernel(_))) => Err(e),
            _ => Ok(()),
        }
    }
}

/// Whether a failed teardown barrier proves that the missing peer runs no kernel any more:
/// its process died, or it dropped its bootstrap (after its own teardown). A timeout or a
/// silent peer proves nothing (it may be slow, or frozen with its kernels still queued).
fn peer_is_gone(e: &epcomm_bootstrap::BootstrapError) -> bool {
    use epcomm_bootstrap::BootstrapError as B;
    matches!(e, B::PeerDied { .. } | B::PeerLeft { .. })
}

impl Drop for Buffer {
    /// Same order as [`Buffer::destroy`]; problems become a warning on stderr.
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!(
                "epcomm: warning: rank {} dropped its Buffer without every peer: {e}",
                self.place.rank
            );
        }
        if self.health.leaked {
            // A kernel of this rank may still run (or not have started): it addresses these.
            std::mem::forget(self.health.err_claim.clone());
            std::mem::forget(self.health.err_record.clone());
            return;
        }
        // SAFETY: each field is dropped exactly once, here, and never used after; the module
        // binding goes before the module it binds, and this rank's kernels are finished
        // (`teardown` saw its last launch complete).
        unsafe {
            ManuallyDrop::drop(&mut self.launcher.module_binding);
            ManuallyDrop::drop(&mut self.launcher.kernels);
            ManuallyDrop::drop(&mut self.memory.peer_bases);
            ManuallyDrop::drop(&mut self.memory.host_counts);
            ManuallyDrop::drop(&mut self.memory.seq_state);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use epcomm_bootstrap::{BootstrapError as B, OpKind};

    use super::peer_is_gone;

    #[test]
    fn only_a_dead_or_departed_peer_lets_teardown_free_after_a_failed_barrier() {
        let (op, tag) = (OpKind::Barrier, "epcomm-buffer-unmapped".to_string());
        let died = B::PeerDied {
            rank: 1,
            op,
            tag: tag.clone(),
        };
        let left = B::PeerLeft {
            rank: 1,
            op,
            tag: tag.clone(),
        };
        assert!(peer_is_gone(&died) && peer_is_gone(&left));
        // A slow peer (timeout) or a frozen one may still have kernels writing through its
        // mapping: leak.
        let slow = B::Timeout {
            op,
            tag: tag.clone(),
            round: 7,
            missing_ranks: vec![1],
            waited: Duration::from_secs(300),
        };
        let frozen = B::PeerUnresponsive {
            rank: 1,
            op,
            tag,
            silent_for: Duration::from_secs(30),
        };
        assert!(!peer_is_gone(&slow) && !peer_is_gone(&frozen));
    }
}
