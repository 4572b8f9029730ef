//! Concurrency primitives of the ring: `loom`'s under `--cfg loom`, `std`'s otherwise.
//!
//! Every shared word of the ring is an [`AtomicU64`]. In a normal build the words live in a raw
//! memory region (host memory that a GPU can map), read through `&AtomicU64` views of it; under
//! loom they live in boxed loom atomics so that the model checker sees every access.

#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// One iteration of a wait loop.
///
/// Under loom this is `loom::thread::yield_now`, which tells the model checker that the thread
/// cannot progress until another one does (so waits stay finite and a schedule in which nobody
/// can progress is reported as a deadlock). Otherwise: a short spin, then a yield to the OS.
#[inline]
pub(crate) fn backoff(iteration: u32) {
    #[cfg(loom)]
    {
        let _ = iteration;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if iteration < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}
