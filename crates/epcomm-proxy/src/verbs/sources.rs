//! [`SourceRegistry`]: memory regions that [`Source::Address`](crate::descriptor::Source)
//! transfers may read, registered from any thread while the executor runs on the proxy's.
//!
//! The executor is moved into the proxy thread when the proxy starts, but the memory its
//! transfers read from (the caller's arrays an op puts from) is only known op by op, on the
//! thread that launches the op. The registry shares the executor's protection domain: that
//! thread registers a region ([`SourceRegistry::register`], or
//! [`SourceRegistry::register_dmabuf`]) before it launches the kernel whose descriptors read
//! it, and the executor picks the change up before it resolves its next address source (a
//! generation counter, read with acquire, tells it to take a new snapshot).
//!
//! A removed region stays registered until the executor has dropped its snapshot of it (it
//! holds an `Arc`); work requests already posted from it then complete, and none is posted
//! from it after the executor's next refresh.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::VerbsError;
use super::resources::{MemoryRegion, ProtectionDomain};

/// One registered region, with the dma-buf it was registered from (kept open while the
/// region is registered; declared after the region, so closed after it is deregistered).
#[derive(Debug)]
pub struct SourceRegion {
    mr: MemoryRegion,
    _dmabuf: Option<OwnedFd>,
}

impl SourceRegion {
    /// The registered region.
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }
}

/// Names one registration, for [`SourceRegistry::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceKey(u64);

#[derive(Debug)]
struct Shared {
    pd: Arc<ProtectionDomain>,
    /// Bumped (release) after every change of `regions`.
    generation: AtomicU64,
    next_key: AtomicU64,
    regions: Mutex<Vec<(SourceKey, Arc<SourceRegion>)>>,
}

/// Regions [`Source::Address`](crate::descriptor::Source) transfers may read, shared between
/// the executor and the threads that register them (see the [module docs](self)). Cloning
/// shares the same registry.
#[derive(Debug, Clone)]
pub struct SourceRegistry {
    shared: Arc<Shared>,
}

impl SourceRegistry {
    /// An empty registry over `pd` (the executor's protection domain).
    pub(crate) fn new(pd: Arc<ProtectionDomain>) -> SourceRegistry {
        SourceRegistry {
            shared: Arc::new(Shared {
                pd,
                generation: AtomicU64::new(0),
                next_key: AtomicU64::new(0),
                regions: Mutex::new(Vec::new()),
            }),
        }
    }

    fn insert(&self, region: SourceRegion) -> SourceKey {
        let key = SourceKey(self.shared.next_key.fetch_add(1, Ordering::Relaxed));
        let mut regions = self
            .shared
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        regions.push((key, Arc::new(region)));
        self.shared.generation.fetch_add(1, Ordering::Release);
        key
    }

    /// Registers `[addr, addr + bytes)` (`ibv_reg_mr`: host memory, or GPU memory where the
    /// peer-memory module `nvidia-peermem` is loaded).
    ///
    /// # Safety
    /// As [`MemoryRegion::register`]: the range stays mapped while it is registered (until
    /// [`SourceRegistry::remove`] and the executor's next refresh, or the executor's end).
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_reg_mr`.
    pub unsafe fn register(&self, addr: u64, bytes: u64) -> Result<SourceKey, VerbsError> {
        // SAFETY: forwarded from this function's contract.
        let mr = unsafe { MemoryRegion::register(&self.shared.pd, addr, bytes)? };
        Ok(self.insert(SourceRegion { mr, _dmabuf: None }))
    }

    /// Registers `bytes` bytes at `offset` of the dma-buf `fd` (`ibv_reg_dmabuf_mr`), addressed
    /// by work requests at `iova` (the device address of its first byte, so that
    /// [`Source::Address`](crate::descriptor::Source) sources inside it resolve). The registry
    /// keeps `fd` open while the region is registered.
    ///
    /// # Safety
    /// As [`MemoryRegion::register_dmabuf`].
    ///
    /// # Errors
    /// [`VerbsError::DmabufUnsupported`] when libibverbs lacks the call; [`VerbsError::Call`].
    pub unsafe fn register_dmabuf(
        &self,
        fd: OwnedFd,
        offset: u64,
        bytes: u64,
        iova: u64,
    ) -> Result<SourceKey, VerbsError> {
        // SAFETY: forwarded from this function's contract; `fd` is open (owned here).
        let mr = unsafe {
            MemoryRegion::register_dmabuf(&self.shared.pd, fd.as_raw_fd(), offset, bytes, iova)?
        };
        Ok(self.insert(SourceRegion {
            mr,
            _dmabuf: Some(fd),
        }))
    }

    /// Removes a registration; `false` when `key` is not (or no longer) registered. The region
    /// is deregistered once the executor's snapshot no longer holds it.
    pub fn remove(&self, key: SourceKey) -> bool {
        let mut regions = self
            .shared
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let before = regions.len();
        regions.retain(|(k, _)| *k != key);
        let removed = regions.len() != before;
        if removed {
            self.shared.generation.fetch_add(1, Ordering::Release);
        }
        removed
    }

    /// The registered regions as `(start, bytes)`.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.shared
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(_, r)| (r.mr.base(), r.mr.bytes()))
            .collect()
    }

    /// The number of changes so far (acquire: a reader that sees a value also sees the
    /// regions as of that change).
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// The generation and the regions as of it.
    pub(crate) fn snapshot(&self) -> (u64, Vec<Arc<SourceRegion>>) {
        let regions = self
            .shared
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Read under the lock: every change bumps the generation while holding it.
        let generation = self.shared.generation.load(Ordering::Acquire);
        (
            generation,
            regions.iter().map(|(_, r)| Arc::clone(r)).collect(),
        )
    }
}
