//! The consuming end of the ring (steps of the consumer in the [`ring`](crate::ring) docs).

use std::time::Duration;

use super::memory::{RingMemory, Word};
use super::{RingError, STATUS_CLOSED, STATUS_FAILED, slot_of};
use crate::descriptor::RawDescriptor;
use crate::sync::{Arc, Ordering};
use crate::wait::wait_until;

/// Takes descriptors from the ring in order and publishes completions. There is one per ring.
#[derive(Debug)]
pub struct Consumer {
    memory: Arc<RingMemory>,
    /// Next descriptor number to take (mirror of `tail`, which only this end writes).
    tail: u64,
}

impl Consumer {
    pub(super) fn new(memory: Arc<RingMemory>) -> Consumer {
        Consumer { memory, tail: 0 }
    }

    /// Descriptors taken so far (the number of the next one).
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> u64 {
        self.memory.capacity()
    }

    /// Takes the next descriptor if it is published: `Ok(Some((number, descriptor)))`, or
    /// `Ok(None)` when it is not (yet).
    ///
    /// # Errors
    /// [`RingError::CorruptSlot`] when the slot holds a tag the protocol cannot produce.
    pub fn try_pop(&mut self) -> Result<Option<(u64, RawDescriptor)>, RingError> {
        let p = self.tail;
        let capacity = self.memory.capacity();
        let slot = slot_of(p, capacity);
        // Acquire: pairs with the producer's release of the tag; the words are complete.
        let tag = self.memory.slot_word(slot, 0).load(Ordering::Acquire);
        if tag != p + 1 {
            let older = tag == 0 || (tag <= p && slot_of(tag - 1, capacity) == slot);
            return if older {
                Ok(None)
            } else {
                Err(RingError::CorruptSlot {
                    position: p,
                    slot,
                    found: tag,
                })
            };
        }
        let mut words = [0u64; 4];
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.memory.slot_word(slot, 1 + i).load(Ordering::Relaxed);
        }
        self.tail = p + 1;
        // Release: our reads of the slot happen before the producer reuses it.
        self.memory.word(Word::Tail).store(p + 1, Ordering::Release);
        Ok(Some((p, RawDescriptor::from_words(words))))
    }

    /// Takes the next descriptor, waiting up to `timeout` for it.
    ///
    /// # Errors
    /// [`RingError::Empty`] when none was published in time; [`RingError::CorruptSlot`].
    pub fn pop(&mut self, timeout: Duration) -> Result<(u64, RawDescriptor), RingError> {
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        wait_until(timeout, || self.try_pop())?.ok_or(RingError::Empty {
            position: self.tail,
            #[cfg(not(loom))]
            waited: start.elapsed(),
            #[cfg(loom)]
            waited: timeout,
        })
    }

    /// Publishes that the first `count` descriptors (in ring order) are complete. Counts only
    /// grow: a smaller `count` than already published is ignored.
    pub fn publish_completed(&self, count: u64) {
        self.memory
            .word(Word::Completed)
            .fetch_max(count, Ordering::AcqRel);
    }

    /// The published count of completed descriptors.
    pub fn completed(&self) -> u64 {
        self.memory.word(Word::Completed).load(Ordering::Acquire)
    }

    /// Marks the ring closed (clean stop): the producer's waits end with
    /// [`RingError::Closed`].
    pub fn close(&self) {
        self.memory
            .word(Word::Status)
            .store(STATUS_CLOSED, Ordering::Release);
    }

    /// Marks the ring failed: the producer's waits end with [`RingError::ProxyFailed`].
    pub fn fail(&self) {
        self.memory
            .word(Word::Status)
            .store(STATUS_FAILED, Ordering::Release);
    }
}
