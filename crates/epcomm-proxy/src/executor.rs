//! The executor role: what moves the bytes and delivers the signals the proxy takes from the
//! ring (a copy engine, RDMA verbs, or host memory in [`crate::host`]).
//!
//! # Contract
//!
//! * A **signal** to a peer takes effect after every transfer and write submitted to the same
//!   peer before it. The proxy submits operations in the order the [coalescer](crate::coalesce)
//!   emits them, which keeps every transfer and write ahead of the signals that follow it in
//!   the ring (the ordering contract of [`crate::descriptor`]).
//! * Transfers and writes to one peer need no order among themselves (they never target
//!   overlapping bytes within one kernel operation), and neither do signals that set distinct
//!   words to one value. Executors keep **per-peer submission order** as the simplest way to
//!   honour the signal rule (a CUDA stream per peer, an RC queue pair per peer, a FIFO in
//!   memory); the copy-engine executor merges pending copies where that leaves every signal
//!   behind what came before it and every two copies of shared bytes in order.
//! * [`Submit::Busy`] means nothing was queued (a full queue: send-queue depth, stream slots);
//!   the proxy polls completions and submits the same operation again later.
//! * Every accepted operation is reported exactly once by [`Executor::poll`], or named by an
//!   [`OpFailure`].
//! * Nothing blocks: `submit_*` and `poll` return at once.

use crate::descriptor::{Signal, Transfer, Write};

/// The proxy's number for one operation, unique within a proxy run.
pub type OpId = u64;

/// The answer to a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submit {
    /// Queued; [`Executor::poll`] will report it.
    Accepted,
    /// Not queued: the executor's queue is full. Submit again after polling.
    Busy,
}

/// An operation that failed, and why; the proxy adds the peer and the descriptor.
#[derive(Debug, thiserror::Error)]
#[error("operation {op}: {reason}")]
pub struct OpFailure {
    /// The operation.
    pub op: OpId,
    /// The executor's error.
    pub reason: Box<dyn std::error::Error + Send + Sync>,
}

impl OpFailure {
    /// Operation `op` failed with `reason`.
    pub fn new(op: OpId, reason: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> OpFailure {
        OpFailure {
            op,
            reason: reason.into(),
        }
    }
}

/// Moves bytes and delivers signals for the proxy (see the [module docs](self) for the
/// contract).
pub trait Executor: Send + 'static {
    /// A short name for errors (`host`, `copy-engine`, `verbs`).
    fn name(&self) -> &str;

    /// Starts moving `transfer.bytes` bytes from `transfer.src` — this rank's symmetric buffer
    /// at an offset ([`Source::Heap`](crate::descriptor::Source::Heap)) or a device address
    /// valid in the producing process ([`Source::Address`](crate::descriptor::Source::Address),
    /// not bounds-checked by the decoder) — to `transfer.peer`'s buffer at
    /// `transfer.dst_offset`.
    ///
    /// # Errors
    /// [`OpFailure`] naming `op` when the operation cannot be started (an executor that cannot
    /// read the source space refuses it here).
    fn submit_transfer(&mut self, op: OpId, transfer: &Transfer) -> Result<Submit, OpFailure>;

    /// Starts storing `write`'s `count` elements (`value`, `value + 1`, ...; each its low
    /// `width` bytes, little-endian) into `write.peer`'s symmetric buffer from `write.offset`
    /// on ([`Write::le_bytes`](crate::descriptor::Write::le_bytes)). One operation,
    /// reported complete once every element is stored.
    ///
    /// # Errors
    /// [`OpFailure`] naming `op` when the operation cannot be started.
    fn submit_write(&mut self, op: OpId, write: &Write) -> Result<Submit, OpFailure>;

    /// Starts delivering `signal` (a set: its value into each of its `words` words) after
    /// every transfer and write to the same peer submitted before it.
    ///
    /// # Errors
    /// [`OpFailure`] naming `op` when the operation cannot be started.
    fn submit_signal(&mut self, op: OpId, signal: &Signal) -> Result<Submit, OpFailure>;

    /// Appends the operations that completed since the last call to `done`.
    ///
    /// # Errors
    /// [`OpFailure`] naming the first operation that failed.
    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure>;

    /// Called by the proxy after each round with the descriptors taken from the ring so far
    /// (`taken`, the ring's `tail`) and the prefix complete (`completed`), both already
    /// published in the ring. An executor close to the producer may mirror them where the
    /// producer reads them more cheaply (the copy-engine executor writes them into device
    /// memory, stream-ordered). The default does nothing. Must not block.
    ///
    /// # Errors
    /// [`OpFailure`] naming operation `op_hint` (the newest operation submitted) when the
    /// mirror cannot be written.
    fn progress(&mut self, taken: u64, completed: u64, op_hint: OpId) -> Result<(), OpFailure> {
        let _ = (taken, completed, op_hint);
        Ok(())
    }
}
