//! GPU verification and measurement harness for epcomm.
//!
//! * [`inputs`]: deterministic per-rank workloads; every rank generates *all* ranks' inputs from
//!   the seed, so each can compute the CPU reference of the whole exchange by itself;
//! * [`verify`]: runs layout / dispatch / cached dispatch / combine on the GPU and compares every
//!   output with `epcomm-reference`, bit for bit;
//! * [`ll`]: low-latency rounds (inputs, expert outputs) checked against the reference;
//! * [`timing`]: CUDA-event timing with an L2 flush between calls, and DeepEP's bandwidth metric;
//! * [`hier`] / [`hier_bench`]: a verified hierarchical round; timing of the hierarchical ops
//!   and DeepEP's internode metrics (rail and NVLink bytes per rank);
//! * [`procs`]: one-process-per-GPU launching by re-executing the current binary.

pub mod hier;
pub mod hier_bench;
pub mod inputs;
pub mod ll;
pub mod order;
pub mod procs;
pub mod timing;
pub mod verify;

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// An epcomm op failed.
    #[error(transparent)]
    Epcomm(#[from] epcomm::Error),
    /// The reference rejected the inputs.
    #[error("reference: {0}")]
    Reference(#[from] epcomm_reference::RefError),
    /// CUDA driver error.
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// Bootstrap error.
    #[error(transparent)]
    Bootstrap(#[from] epcomm_bootstrap::BootstrapError),
    /// Launch error.
    #[error(transparent)]
    Launch(#[from] epcomm_bootstrap::launch::LaunchError),
    /// A device result differs from the reference.
    #[error("mismatch in {what} on rank {rank}: {detail}")]
    Mismatch {
        /// Which output.
        what: String,
        /// Rank that saw it.
        rank: usize,
        /// First difference.
        detail: String,
    },
    /// Something else went wrong.
    #[error("{0}")]
    Other(String),
}

/// Results of the harness.
pub type Result<T, E = CheckError> = std::result::Result<T, E>;
