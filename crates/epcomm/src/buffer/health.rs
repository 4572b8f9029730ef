//! Health and failure: the failed state, the device error record, the host's one bounded wait
//! (HostSync receive counts), and the diagnostics read back from the stats block.
//!
//! Contract: a kernel that fails records `{op, wait, peer, ...}` into mapped host memory
//! (`err_record`) and every block leaves. The host learns it at its next check — before every
//! op, after every synchronize, and while it waits for receive counts — turns the record into a
//! typed [`Error`], and marks the buffer failed; from then on every op returns
//! [`Error::Failed`] and the way out is a new `Buffer`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream, sys};
use epcomm_kernels::Op;
use epcomm_kernels::abi::{self, ErrorRecord};
use epcomm_topology::{Parity, RegionKind};
use epcomm_transport::memory::copy_dtoh;
use epcomm_transport::{DeviceBuffer, MappedHostBuffer};

use super::Buffer;
use super::driver::stream_idle;
use crate::stats::{LocalStats, OpStats};
use crate::{Error, Result, WaitKind};

/// The buffer's health: why it refuses ops, the device error record every kernel of it may
/// write, its last launch (what failure handling and teardown wait for), and how its teardown
/// went.
#[derive(Debug)]
pub(crate) struct Health {
    /// Device u32 the first failing thread claims.
    pub(crate) err_claim: Arc<DeviceBuffer>,
    /// Mapped host `ErrorRecord`, written by the failing thread, read by `Buffer::check`.
    pub(crate) err_record: Arc<MappedHostBuffer>,
    /// Why the buffer refuses new ops (a device failure or an expired host wait).
    pub(crate) failed: Option<String>,
    /// The name of the latest op issued (for teardown's error).
    pub(crate) last_op: Option<&'static str>,
    /// Recorded on the stream after every epcomm launch (`note_launch`): failure handling and
    /// teardown wait for it, bounded, instead of for the whole stream. The tiers of a
    /// hierarchical buffer share it with their stream (the node tier's kernels read the rail
    /// tier's memory, so either tier's teardown waits for both tiers' launches).
    pub(crate) last_launch: Arc<CudaEvent>,
    /// `teardown` ran.
    pub(crate) torn_down: bool,
    /// Teardown could not see this rank's last kernel finish: the kernels, their module and
    /// every block they address stay allocated until the process exits.
    pub(crate) leaked: bool,
}

/// What a HostSync dispatch publishes to mapped host memory once the counts are exchanged.
#[derive(Debug)]
pub(super) struct HostCounts {
    /// Rows received.
    pub(super) rows: usize,
    /// Rows per local expert.
    pub(super) per_expert: Vec<usize>,
    /// The received rows this rank sent itself.
    pub(super) own_rows: std::ops::Range<usize>,
}

/// Records `mark` on `stream` right after an epcomm launch there, so the host can wait for
/// epcomm's own work without waiting for what the caller queues later
/// ([`Buffer::wait_launched`]). Not while a recording is made (nothing runs then; a replay
/// marks its launch). Best effort: a mark that fails to record leaves the previous one, and
/// the wait stays bounded either way.
pub(in crate::buffer) fn note_launch(mark: &CudaEvent, stream: &CudaStream, recording: bool) {
    if !recording {
        let _ = mark.record(stream);
    }
}

impl Buffer {
    /// Reports a failure recorded by a kernel (cheap: one read of mapped host memory). After a
    /// failure the buffer refuses new ops: destroy it and create a new one.
    pub fn check(&mut self) -> Result<()> {
        if let Some(why) = &self.health.failed {
            return Err(Error::Failed(why.clone()));
        }
        if self.health.err_record.load_u64_acquire(0).unwrap_or(0) as u32 == abi::code::OK {
            return Ok(());
        }
        // The record is complete once the failing kernel has exited: wait for this rank's
        // launches (bounded), not for caller work queued on the stream after them.
        self.wait_launched(self.launch_wait_limit());
        let record: ErrorRecord = self.health.err_record.read_struct().unwrap_or_default();
        if record.code != abi::code::PEER_FAILED {
            self.announce_failure();
        }
        // The kernels record world ranks (group ranks mapped on the device).
        let mut e = Error::from_record(&record);
        // A rank that learned of a peer's failure while it waited for the proxy reports that
        // peer's failure (the proxy did not stall); a wait that expired there says what the
        // proxy was doing.
        if record.wait_id == abi::wait::PROXY
            && record.code != abi::code::PEER_FAILED
            && let Some(why) = self.memory.mem.backend_failure()
        {
            e = Error::BackendStalled {
                cause: Box::new(e),
                backend: why,
            };
        }
        Err(self.fail(e))
    }

    /// Tells every peer that this rank failed, when the failure was found by the host before
    /// any op kernel could send it: the layout kernel has no peers, so an invalid expert id it
    /// records is otherwise sent only by the next op's prologue, and the host refuses to launch
    /// that op. Launches the dispatch kernel once, which (this rank's claim being set) only
    /// writes the abort word into every peer's buffer and leaves: it reads no input, writes no
    /// row and does not advance the sequence state. Idempotent with a kernel's own broadcast;
    /// best effort (the error this rank reports does not depend on it).
    fn announce_failure(&mut self) {
        let args = self.next_op_args();
        // SAFETY: the argument block holds this buffer's live peer bases, error words, stats
        // offsets and sequence state; with the claim set the prologue touches nothing else and
        // every block returns before the body (so no completion counter is involved).
        let launched = unsafe {
            self.launcher.kernels.launch_op(
                Op::Dispatch,
                &self.launcher.stream,
                &args,
                self.cfg.num_sms,
            )
        };
        // Not waited for here: it is stream-ordered before every later op, and a wait could
        // only wait for caller work queued ahead of it; teardown waits for it (bounded).
        if launched.is_ok() {
            note_launch(
                &self.health.last_launch,
                &self.launcher.stream,
                self.capture.recording,
            );
        }
    }

    /// [`note_launch`] after a launch on the buffer's stream (or a graph replay there).
    pub(crate) fn mark_launch(&self) {
        note_launch(
            &self.health.last_launch,
            &self.launcher.stream,
            self.capture.recording,
        );
    }

    /// How long the host waits for this rank's own launched ops to finish after a failure or
    /// at teardown: every device wait is bounded by the op timeout, and an op queued behind a
    /// failure leaves at once, so the op timeout plus a second covers them.
    pub(in crate::buffer) fn launch_wait_limit(&self) -> Duration {
        self.cfg.timeout + Duration::from_secs(1)
    }

    /// Waits (at most `limit`) until every epcomm kernel launched on the stream so far has
    /// finished; true when they have. Work the caller queued on the stream after them is not
    /// waited for, so a caller's blocked work cannot hold the host here (work queued before
    /// them can, up to `limit`).
    pub(in crate::buffer) fn wait_launched(&self, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            let done = match self.health.last_launch.try_is_complete() {
                Ok(done) => done,
                // Recorded while someone else's graph capture ran on the stream: not a point
                // of the stream's work; wait for the stream itself instead (still bounded).
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_CAPTURED_EVENT => {
                    // Idle, or broken (nothing of it runs any more).
                    !matches!(stream_idle(&self.launcher.stream), Ok(false))
                }
                // A broken context: nothing of it runs any more.
                Err(_) => true,
            };
            if done {
                return true;
            }
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// True after a device failure.
    pub fn is_failed(&self) -> bool {
        self.health.failed.is_some()
    }

    /// The check every op makes before it issues anything.
    pub(crate) fn check_ready(&mut self) -> Result<()> {
        self.check()?;
        let Some(p) = &self.ll.pending else {
            return Ok(());
        };
        let op = p.op;
        if p.abandoned.load(std::sync::atomic::Ordering::Relaxed) {
            // Its receive phase can no longer be issued, and the peers wait for it.
            return Err(self.fail(Error::Failed(format!(
                "the LlPending of a low-latency {op} was dropped without Buffer::ll_receive"
            ))));
        }
        Err(Error::InvalidArgument {
            argument: "LlPending",
            rule: format!(
                "the receive phase of a low-latency {op} is still pending: pass its LlPending \
                 to Buffer::ll_receive before any other op"
            ),
        })
    }

    /// Marks the buffer failed because of `e` and returns `e`.
    fn fail(&mut self, e: Error) -> Error {
        self.health.failed = Some(e.to_string());
        e
    }

    /// HostSync: waits (bounded by the config's timeout plus one second) for the counts the
    /// dispatch kernel publishes to mapped memory with notify tag `tag`; returns the rows
    /// received, the rows per local expert (`epr` of them) and the rows this rank sent itself.
    pub(super) fn wait_host_counts(&mut self, tag: u64, epr: usize) -> Result<HostCounts> {
        let start = Instant::now();
        let limit = self.cfg.timeout + Duration::from_secs(1);
        // The stream is asked whether it went idle at most this often: a driver call on every
        // pass would contend with other threads' driver calls (a CPU proxy's copies) while the
        // tag, read every pass, is what ends the wait.
        const STREAM_QUERY_EVERY: Duration = Duration::from_micros(20);
        let mut next_query = start;
        loop {
            // The kernel stores the counts, fences, then the tag: the acquire read keeps the
            // count reads below from being satisfied before the tag's (Arm hosts reorder loads).
            if self.memory.host_counts.load_u64_acquire(0) == Some(tag) {
                let word = |i: usize| self.memory.host_counts.load_u64(i).unwrap_or(0) as usize;
                let own_first = word(2 + epr);
                return Ok(HostCounts {
                    rows: word(1),
                    per_expert: (0..epr).map(|i| word(2 + i)).collect(),
                    own_rows: own_first..own_first + word(3 + epr),
                });
            }
            self.check()?;
            let now = Instant::now();
            let idle = now >= next_query && matches!(stream_idle(&self.launcher.stream), Ok(true));
            if now >= next_query {
                next_query = now + STREAM_QUERY_EVERY;
            }
            if idle && self.memory.host_counts.load_u64(0) != Some(tag) {
                self.check()?;
                return Err(Error::Failed(
                    "dispatch finished without publishing its receive count".into(),
                ));
            }
            if start.elapsed() > limit {
                let e = Error::Timeout {
                    op: "dispatch",
                    rank: self.place.group.world_rank_or_self(self.place.rank),
                    wait: WaitKind::HostRecvCount,
                    peer: -1,
                    op_seq: self.seq.op,
                    expected: tag,
                    seen: self.memory.host_counts.load_u64(0).unwrap_or(0),
                    waited: start.elapsed(),
                };
                return Err(self.fail(e));
            }
            std::hint::spin_loop();
        }
    }

    /// Waits for the last op and returns who waited for whom in it. **Collective** (every rank
    /// must call it after the same op): the ranks all-gather their waits over the transport's
    /// host channel, since GPU clocks are not comparable across GPUs.
    pub fn last_op_stats(&mut self) -> Result<Option<OpStats>> {
        self.synchronize()?;
        if self.health.last_op.is_none() {
            return Ok(None);
        }
        let words = self.read_local_words(
            RegionKind::Stats,
            crate::stats::word::PEERS + 3 * self.place.world,
        )?;
        let Some(local) = LocalStats::from_words(&words) else {
            return Ok(None);
        };
        // The group in the tag: the two tiers of a hierarchical buffer gather one after the other.
        let tag = format!(
            "epcomm-stats-{}-{}x{}",
            local.op_seq,
            self.place.group.size(),
            self.place.group.pe_stride()
        );
        let all = self
            .memory
            .transport
            .bootstrap()
            .all_gather(&tag, &local.encode())?;
        // Every rank of the world answers (for its own group's buffer); keep this group's.
        let ranks: Vec<usize> = self.place.group.members().collect();
        let mut waits = Vec::with_capacity(ranks.len());
        for &peer in &ranks {
            let bytes = all.get(peer).map_or(&[][..], |b| &b[..]);
            let row = LocalStats::decode_waits(bytes, local.op_seq, self.place.world).ok_or_else(|| Error::InvalidArgument {
                argument: "last_op_stats",
                rule: format!("rank {peer} reported stats of another op (call it on every rank after the same op)"),
            })?;
            waits.push(row);
        }
        Ok(Some(OpStats {
            op: local.op,
            op_seq: local.op_seq,
            rank: self.place.rank,
            total: local.total,
            sending: local.sending,
            counts_ready: local.counts_ready,
            waits,
            ranks,
        }))
    }

    /// Diagnostics: delays the ops issued after this call by `delay` on this rank's stream (a
    /// GPU spin, so the delay is exact), to see skew attribution at work ([`OpStats`]). Allowed
    /// between a low-latency send phase and its [`Buffer::ll_receive`] (it touches no state of
    /// the buffer, only its stream: what other work between the phases does).
    pub fn inject_delay(&mut self, delay: Duration) -> Result<()> {
        if delay > Duration::from_secs(10) {
            return Err(Error::InvalidArgument {
                argument: "delay",
                rule: format!("at most 10 s (got {delay:?})"),
            });
        }
        self.check()?;
        self.launcher
            .kernels
            .launch_delay(&self.launcher.stream, delay.as_nanos() as u64)?;
        note_launch(
            &self.health.last_launch,
            &self.launcher.stream,
            self.capture.recording,
        );
        Ok(())
    }

    /// This rank's global-barrier counters (one per peer: barrier arrivals received). They stay
    /// 0 under the Epoch strategy, which issues no barrier; under Global each op adds
    /// `barriers * blocks` per peer (`num_sms`, or [`Buffer::ll_num_blocks`] for the
    /// low-latency ops). Waits for issued ops.
    pub fn barrier_counters(&mut self) -> Result<Vec<u64>> {
        self.synchronize()?;
        self.read_local_words(RegionKind::BarrierCounters, self.place.world)
    }

    /// Copies the first `n` u64 words of region `kind` (even parity) of this rank's symmetric
    /// buffer to the host, stream-ordered. Callers synchronize first, so no kernel of this rank
    /// is writing it; `n` words must fit the region (the stats block holds `8 + 3 * world`, the
    /// barrier counters `world`).
    fn read_local_words(&self, kind: RegionKind, n: usize) -> Result<Vec<u64>> {
        let off = self.place.plan.region(kind, Parity::Even).offset;
        // SAFETY: the region lies inside this rank's live symmetric buffer (plan offsets) and
        // holds at least `n` words (see above).
        Ok(unsafe {
            copy_dtoh::<u64>(&self.launcher.stream, self.memory.mem.local_base() + off, n)
        }?)
    }
}
