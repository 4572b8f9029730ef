//! The executor role: what moves the bytes and delivers the signals the proxy takes from the
//! ring (a copy engine, RDMA verbs, or host memory in [`crate::host`]).
//!
//! # Contract
//!
//! * Operations to one peer take effect at that peer **in submission order**; in particular a
//!   signal takes effect after every transfer submitted to the same peer before it (a CUDA
//!   stream per peer, an RC queue pair per peer, a FIFO in memory).
//! * [`Submit::Busy`] means nothing was queued (a full queue: send-queue depth, stream slots);
//!   the proxy polls completions and submits the same operation again later.
//! * Every accepted operation is reported exactly once by [`Executor::poll`], or named by an
//!   [`OpFailure`].
//! * Nothing blocks: `submit_*` and `poll` return at once.

use crate::descriptor::{Signal, Transfer};

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

    /// Starts moving `transfer.bytes` bytes from this rank's symmetric buffer at
    /// `transfer.src_offset` to `transfer.peer`'s at `transfer.dst_offset`.
    ///
    /// # Errors
    /// [`OpFailure`] naming `op` when the operation cannot be started.
    fn submit_transfer(&mut self, op: OpId, transfer: &Transfer) -> Result<Submit, OpFailure>;

    /// Starts delivering `signal` after every transfer to the same peer submitted before it.
    ///
    /// # Errors
    /// [`OpFailure`] naming `op` when the operation cannot be started.
    fn submit_signal(&mut self, op: OpId, signal: &Signal) -> Result<Submit, OpFailure>;

    /// Appends the operations that completed since the last call to `done`.
    ///
    /// # Errors
    /// [`OpFailure`] naming the first operation that failed.
    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure>;
}
