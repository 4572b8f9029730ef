//! The ring's memory: the header words and the slots, over a raw region (normal build) or boxed
//! loom atomics (`--cfg loom`), behind one accessor API.

use super::{HEADER_BYTES, MAX_CAPACITY, RingError, SLOT_BYTES};
#[cfg(not(loom))]
use super::{OFFSET_COMPLETED, OFFSET_HEAD, OFFSET_STATUS, OFFSET_TAIL, REGION_ALIGN, RING_MAGIC};
use crate::sync::AtomicU64;

/// A header word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Word {
    Head,
    Tail,
    Completed,
    Status,
}

impl Word {
    #[cfg(not(loom))]
    fn offset(self) -> usize {
        match self {
            Word::Head => OFFSET_HEAD,
            Word::Tail => OFFSET_TAIL,
            Word::Completed => OFFSET_COMPLETED,
            Word::Status => OFFSET_STATUS,
        }
    }

    #[cfg(loom)]
    fn index(self) -> usize {
        match self {
            Word::Head => 0,
            Word::Tail => 1,
            Word::Completed => 2,
            Word::Status => 3,
        }
    }
}

/// Bytes a ring of `capacity` slots occupies: [`HEADER_BYTES`] + `capacity` × [`SLOT_BYTES`].
///
/// # Errors
/// [`RingError::InvalidCapacity`] unless `capacity` is a power of two in `1..=MAX_CAPACITY`.
pub fn region_bytes(capacity: u64) -> Result<usize, RingError> {
    if !capacity.is_power_of_two() || capacity > MAX_CAPACITY {
        return Err(RingError::InvalidCapacity { capacity });
    }
    // capacity <= 2^24, so this fits in usize on every supported target.
    Ok(HEADER_BYTES + capacity as usize * SLOT_BYTES)
}

/// The memory of one ring (see the layout in the [`ring`](crate::ring) docs).
pub struct RingMemory {
    capacity: u64,
    #[cfg(not(loom))]
    ptr: std::ptr::NonNull<u8>,
    /// The layout to free with, when this value allocated the region.
    #[cfg(not(loom))]
    owned: Option<std::alloc::Layout>,
    #[cfg(loom)]
    header: [AtomicU64; 4],
    #[cfg(loom)]
    slots: Box<[AtomicU64]>,
}

impl std::fmt::Debug for RingMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMemory")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

// SAFETY: the region is only accessed through `&AtomicU64` views (see `word_at`), which are
// safe to share and send between threads; the pointer itself is never handed out mutably.
#[cfg(not(loom))]
unsafe impl Send for RingMemory {}
// SAFETY: as for `Send`: every access to the shared region is atomic.
#[cfg(not(loom))]
unsafe impl Sync for RingMemory {}

impl RingMemory {
    /// Slots in the ring.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The `Word` header word.
    pub(crate) fn word(&self, word: Word) -> &AtomicU64 {
        #[cfg(not(loom))]
        {
            self.word_at(word.offset())
        }
        #[cfg(loom)]
        {
            &self.header[word.index()]
        }
    }

    /// Word `index` of slot `slot`: 0 is `seq`, 1..=4 the descriptor. `slot < capacity`,
    /// `index <= 4` (callers derive both from the ring's own arithmetic).
    pub(crate) fn slot_word(&self, slot: u64, index: usize) -> &AtomicU64 {
        #[cfg(not(loom))]
        {
            self.word_at(HEADER_BYTES + slot as usize * SLOT_BYTES + 8 * index)
        }
        #[cfg(loom)]
        {
            &self.slots[slot as usize * 5 + index]
        }
    }
}

#[cfg(loom)]
impl RingMemory {
    /// A fresh, empty ring of `capacity` slots (loom atomics).
    ///
    /// # Errors
    /// [`RingError::InvalidCapacity`].
    pub fn allocate(capacity: u64) -> Result<RingMemory, RingError> {
        region_bytes(capacity)?;
        Ok(RingMemory {
            capacity,
            header: [
                AtomicU64::new(0),
                AtomicU64::new(0),
                AtomicU64::new(0),
                AtomicU64::new(0),
            ],
            slots: (0..capacity * 5).map(|_| AtomicU64::new(0)).collect(),
        })
    }
}

#[cfg(not(loom))]
impl RingMemory {
    /// A fresh, empty ring of `capacity` slots in zeroed host memory this value owns (aligned
    /// to [`REGION_ALIGN`]).
    ///
    /// # Errors
    /// [`RingError::InvalidCapacity`].
    pub fn allocate(capacity: u64) -> Result<RingMemory, RingError> {
        let len = region_bytes(capacity)?;
        let layout = std::alloc::Layout::from_size_align(len, REGION_ALIGN)
            .map_err(|_| RingError::InvalidCapacity { capacity })?;
        // SAFETY: `layout` has a non-zero size (at least HEADER_BYTES).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        let memory = RingMemory {
            capacity,
            ptr,
            owned: Some(layout),
        };
        memory.init();
        Ok(memory)
    }

    /// Lays a fresh, empty ring of `capacity` slots over `len` bytes at `ptr` (e.g. host memory
    /// mapped into a GPU), zeroing it and writing `magic` and `capacity`.
    ///
    /// # Errors
    /// [`RingError::InvalidCapacity`], [`RingError::Misaligned`] (not on a [`REGION_ALIGN`]
    /// boundary), [`RingError::RegionTooSmall`] (`len < region_bytes(capacity)`).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as this value and
    /// the ring ends made from it live, and nothing else may access those bytes except through
    /// the ring protocol's atomic 64-bit accesses (a GPU kernel included) after this call.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        capacity: u64,
    ) -> Result<RingMemory, RingError> {
        let needed = region_bytes(capacity)?;
        if !(ptr as usize).is_multiple_of(REGION_ALIGN) {
            return Err(RingError::Misaligned { addr: ptr as usize });
        }
        if len < needed {
            return Err(RingError::RegionTooSmall {
                len,
                capacity,
                needed,
            });
        }
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            return Err(RingError::Misaligned { addr: 0 });
        };
        // SAFETY: the caller guarantees `needed <= len` bytes at `ptr` are writable and not
        // accessed by anyone else until the ring is handed out.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, needed) };
        let memory = RingMemory {
            capacity,
            ptr,
            owned: None,
        };
        memory.init();
        Ok(memory)
    }

    /// The region's first byte (what a GPU maps).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Writes `magic` and `capacity` into a zeroed region.
    fn init(&self) {
        use crate::sync::Ordering;
        self.word_at(0).store(RING_MAGIC, Ordering::Relaxed);
        self.word_at(8).store(self.capacity, Ordering::Release);
    }

    /// The atomic word at byte `offset` (8-aligned, inside the region).
    fn word_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(
            offset.is_multiple_of(8)
                && offset + 8 <= HEADER_BYTES + self.capacity as usize * SLOT_BYTES
        );
        // SAFETY: the region is valid for `region_bytes(capacity)` bytes for the lifetime of
        // `self` (allocated here, or promised by `from_raw`'s caller), starts on a 64-byte
        // boundary, and every caller passes an 8-aligned offset inside it, so the pointer is a
        // valid, aligned `AtomicU64` (same size and alignment as `u64`); every access to the
        // region after initialisation is atomic.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }
}

#[cfg(not(loom))]
impl Drop for RingMemory {
    fn drop(&mut self) {
        if let Some(layout) = self.owned {
            // SAFETY: allocated in `allocate` with exactly this layout; the last reference to
            // the region is going away (ring ends hold this value in an `Arc`).
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::Ordering;

    #[test]
    fn capacity_rules_and_sizes() {
        assert_eq!(region_bytes(1), Ok(HEADER_BYTES + SLOT_BYTES));
        assert_eq!(region_bytes(8), Ok(HEADER_BYTES + 8 * SLOT_BYTES));
        for bad in [0, 3, 6, MAX_CAPACITY * 2] {
            assert_eq!(
                region_bytes(bad),
                Err(RingError::InvalidCapacity { capacity: bad })
            );
        }
    }

    #[test]
    fn allocate_writes_magic_and_capacity_into_a_zeroed_region() {
        let m = RingMemory::allocate(4).expect("ring");
        assert_eq!(m.as_ptr() as usize % REGION_ALIGN, 0);
        assert_eq!(m.word_at(0).load(Ordering::Relaxed), RING_MAGIC);
        assert_eq!(m.word_at(8).load(Ordering::Relaxed), 4);
        for w in [Word::Head, Word::Tail, Word::Completed, Word::Status] {
            assert_eq!(m.word(w).load(Ordering::Relaxed), 0);
        }
        assert_eq!(m.slot_word(3, 4).load(Ordering::Relaxed), 0);
    }

    #[test]
    fn from_raw_checks_alignment_and_length() {
        #[repr(C, align(64))]
        struct Buf([u8; HEADER_BYTES + 2 * SLOT_BYTES + 64]);
        let mut buf = Buf([0xAB; HEADER_BYTES + 2 * SLOT_BYTES + 64]);
        let base = buf.0.as_mut_ptr();
        let len = buf.0.len();
        // SAFETY: `buf` outlives every ring made here and is used only through them.
        unsafe {
            assert_eq!(
                RingMemory::from_raw(base.add(8), len - 8, 2).map(|_| ()),
                Err(RingError::Misaligned {
                    addr: base as usize + 8
                })
            );
            assert_eq!(
                RingMemory::from_raw(base, HEADER_BYTES, 2).map(|_| ()),
                Err(RingError::RegionTooSmall {
                    len: HEADER_BYTES,
                    capacity: 2,
                    needed: HEADER_BYTES + 2 * SLOT_BYTES
                })
            );
            let m = RingMemory::from_raw(base, len, 2).expect("ring");
            assert_eq!(m.word(Word::Head).load(Ordering::Relaxed), 0);
            assert_eq!(m.slot_word(1, 0).load(Ordering::Relaxed), 0);
            assert_eq!(m.word_at(8).load(Ordering::Relaxed), 2);
        }
        // Bytes past the ring are left alone.
        assert_eq!(buf.0[HEADER_BYTES + 2 * SLOT_BYTES], 0xAB);
    }
}
