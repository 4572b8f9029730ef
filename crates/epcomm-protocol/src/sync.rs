//! Concurrency primitives of the model: `loom`'s under `--cfg loom`, `std`'s otherwise.
//!
//! Every shared word of the model is an [`AtomicU64`]: GPU memory written by remote stores is
//! modelled as atomics, with `Relaxed` for plain data stores and `Release`/`Acquire` exactly where
//! the CUDA kernels use `st.release`/`ld.acquire` (or a fence around a relaxed access).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// One iteration of a spin-wait: hands the processor to another rank.
///
/// Under loom this is `loom::thread::yield_now`, which tells the model checker that the thread
/// cannot make progress until another thread does (so spin loops stay finite and a schedule in
/// which nobody can progress is reported as a deadlock).
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
