//! First-in, first-out allocation of byte ranges in a fixed region (the copy-engine executor's
//! staging arena): reservations are contiguous (never wrap inside), and are freed in the order
//! they were made, by running totals.

/// A FIFO allocator over `capacity` bytes. `head` and `tail` are running totals of bytes
/// allocated and freed; the region offset of total `n` is `n % capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fifo {
    capacity: usize,
    head: usize,
    tail: usize,
}

impl Fifo {
    /// An empty FIFO over `capacity` (> 0) bytes.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            head: 0,
            tail: 0,
        }
    }

    /// Reserves `len` contiguous bytes and returns their region offset, or `None` when they do
    /// not fit now (or ever: `len > capacity`). A reservation that would cross the end starts
    /// at offset 0 instead; the skipped bytes stay allocated until freed in order. An empty
    /// FIFO starts over at offset 0, so anything up to `capacity` fits once everything is
    /// freed.
    pub(crate) fn reserve(&mut self, len: usize) -> Option<usize> {
        if self.head == self.tail && !self.head.is_multiple_of(self.capacity) {
            self.head += self.capacity - self.head % self.capacity;
            self.tail = self.head;
        }
        let offset = self.head % self.capacity;
        let skip = if offset + len > self.capacity {
            self.capacity - offset
        } else {
            0
        };
        if self.head + skip + len - self.tail > self.capacity {
            return None;
        }
        self.head += skip;
        let at = self.head % self.capacity;
        self.head += len;
        Some(at)
    }

    /// The running total allocated so far: pass it to [`Fifo::free_to`] once everything
    /// reserved before now is no longer in use.
    pub(crate) fn allocated(&self) -> usize {
        self.head
    }

    /// The region offset the next reservation starts at, unless it skips to 0.
    pub(crate) fn next_offset(&self) -> usize {
        self.head % self.capacity
    }

    /// Frees everything reserved before running total `total` (ignored when older than what
    /// is already freed or newer than what was allocated).
    pub(crate) fn free_to(&mut self, total: usize) {
        if total > self.tail && total <= self.head {
            self.tail = total;
        }
    }

    /// The region's size.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_contiguous_and_skip_the_end() {
        let mut f = Fifo::new(16);
        assert_eq!(f.reserve(6), Some(0));
        assert_eq!(f.reserve(6), Some(6));
        // 4 bytes left at the end, 8 wanted: skips to 0, which is still in use.
        assert_eq!(f.reserve(8), None);
        f.free_to(6);
        assert_eq!(f.reserve(8), None, "bytes 0..6 are free, 8 are not");
        f.free_to(12);
        assert_eq!(f.reserve(8), Some(0));
        assert_eq!(f.next_offset(), 8);
    }

    #[test]
    fn full_until_freed_in_order() {
        let mut f = Fifo::new(8);
        assert_eq!(f.reserve(8), Some(0));
        assert_eq!(f.reserve(1), None);
        let mark = f.allocated();
        f.free_to(mark);
        assert_eq!(f.reserve(4), Some(0));
        assert_eq!(f.reserve(4), Some(4));
        assert_eq!(f.reserve(4), None);
        // Stale or impossible totals change nothing.
        f.free_to(3);
        f.free_to(1000);
        assert_eq!(f.reserve(1), None);
    }

    #[test]
    fn an_empty_fifo_fits_its_whole_capacity_wherever_it_stood() {
        let mut f = Fifo::new(16);
        assert_eq!(f.reserve(10), Some(0));
        let mark = f.allocated();
        f.free_to(mark);
        // Without starting over, 12 bytes at offset 10 would skip to 0 and never fit.
        assert_eq!(f.reserve(12), Some(0));
        assert_eq!(f.reserve(4), Some(12));
        // A total from before the restart frees nothing now.
        f.free_to(mark);
        assert_eq!(f.reserve(1), None);
    }

    #[test]
    fn too_large_never_fits() {
        let mut f = Fifo::new(8);
        assert_eq!(f.reserve(9), None);
        assert_eq!(f.reserve(8), Some(0));
        assert_eq!(f.capacity(), 8);
    }

    #[test]
    fn no_reservation_overlaps_a_live_one() {
        // Random sizes, freeing the oldest half of the time: live ranges never overlap.
        let mut f = Fifo::new(64);
        let mut live: std::collections::VecDeque<(usize, usize, usize)> = Default::default();
        let mut x: u64 = 12345;
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (x >> 59) as usize; // 1..=32
            if (x >> 40) & 1 == 0
                && let Some((_, _, end)) = live.pop_front()
            {
                f.free_to(end);
            }
            if let Some(at) = f.reserve(len) {
                assert!(at + len <= 64);
                for &(a, l, _) in &live {
                    assert!(at + len <= a || a + l <= at, "{at}+{len} overlaps {a}+{l}");
                }
                live.push_back((at, len, f.allocated()));
            }
        }
    }
}
