//! The producing end of the ring (steps of the producer in the [`ring`](crate::ring) docs).

use std::time::Duration;

use super::memory::{RingMemory, Word};
use super::{RingError, STATUS_CLOSED, STATUS_FAILED, slot_of};
use crate::descriptor::{Descriptor, Limits, RawDescriptor};
use crate::sync::{Arc, Ordering};
use crate::wait::wait_until;

/// Publishes descriptors into the ring. There is one per ring (it is not `Clone`).
#[derive(Debug)]
pub struct Producer {
    memory: Arc<RingMemory>,
    /// Next descriptor number (mirror of `head`, which only this end writes).
    head: u64,
    /// The last `tail` read: slots below `tail + capacity` are known free without a read.
    tail_seen: u64,
}

impl Producer {
    pub(super) fn new(memory: Arc<RingMemory>) -> Producer {
        Producer {
            memory,
            head: 0,
            tail_seen: 0,
        }
    }

    /// Descriptors published so far (the number the next one gets).
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The consumer's published count of completed descriptors.
    pub fn completed(&self) -> u64 {
        self.memory.word(Word::Completed).load(Ordering::Acquire)
    }

    /// `Err` when the consumer has stopped, naming descriptor `position`.
    fn check_status(&self, position: u64) -> Result<(), RingError> {
        match self.memory.word(Word::Status).load(Ordering::Acquire) {
            STATUS_CLOSED => Err(RingError::Closed { position }),
            STATUS_FAILED => Err(RingError::ProxyFailed { position }),
            _ => Ok(()),
        }
    }

    /// Publishes `raw` if a slot is free: `Ok(Some(number))`, or `Ok(None)` when the ring is
    /// full. The descriptor is not validated (the consumer decodes it).
    ///
    /// # Errors
    /// [`RingError::Closed`] / [`RingError::ProxyFailed`] when the consumer has stopped.
    pub fn try_push_raw(&mut self, raw: &RawDescriptor) -> Result<Option<u64>, RingError> {
        let p = self.head;
        self.check_status(p)?;
        let capacity = self.memory.capacity();
        if p - self.tail_seen >= capacity {
            // Acquire: the consumer's reads of the slot happen before our overwrite.
            self.tail_seen = self.memory.word(Word::Tail).load(Ordering::Acquire);
            if p - self.tail_seen >= capacity {
                return Ok(None);
            }
        }
        let slot = slot_of(p, capacity);
        for (i, word) in raw.to_words().into_iter().enumerate() {
            self.memory
                .slot_word(slot, 1 + i)
                .store(word, Ordering::Relaxed);
        }
        // Release: the words above are visible to whoever sees this tag.
        self.memory
            .slot_word(slot, 0)
            .store(p + 1, Ordering::Release);
        self.head = p + 1;
        self.memory.word(Word::Head).store(p + 1, Ordering::Release);
        Ok(Some(p))
    }

    /// Publishes `raw`, waiting up to `timeout` for a free slot; returns its number.
    ///
    /// # Errors
    /// [`RingError::Full`] when no slot was freed in time; [`RingError::Closed`] /
    /// [`RingError::ProxyFailed`] when the consumer has stopped.
    pub fn push_raw(&mut self, raw: &RawDescriptor, timeout: Duration) -> Result<u64, RingError> {
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        match wait_until(timeout, || self.try_push_raw(raw))? {
            Some(p) => Ok(p),
            None => Err(RingError::Full {
                capacity: self.memory.capacity(),
                head: self.head,
                tail: self.tail_seen,
                #[cfg(not(loom))]
                waited: start.elapsed(),
                #[cfg(loom)]
                waited: timeout,
            }),
        }
    }

    /// Validates `descriptor` against `limits` and publishes it ([`Producer::push_raw`]).
    ///
    /// # Errors
    /// [`RingError::Invalid`] naming the field, and those of [`Producer::push_raw`].
    pub fn push(
        &mut self,
        descriptor: &Descriptor,
        limits: &Limits,
        timeout: Duration,
    ) -> Result<u64, RingError> {
        let raw = descriptor.encode(limits)?;
        self.push_raw(&raw, timeout)
    }

    /// Waits up to `timeout` until `completed >= target`.
    ///
    /// # Errors
    /// [`RingError::CompletionTimeout`]; [`RingError::Closed`] / [`RingError::ProxyFailed`]
    /// when the consumer stopped before reaching `target`.
    pub fn wait_completed(&self, target: u64, timeout: Duration) -> Result<(), RingError> {
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        let reached = wait_until(timeout, || {
            if self.completed() >= target {
                return Ok(Some(()));
            }
            // Stopped: one more look, since completions are published before the status.
            self.check_status(target).map(|()| None).or_else(|e| {
                if self.completed() >= target {
                    Ok(Some(()))
                } else {
                    Err(e)
                }
            })
        })?;
        reached.ok_or_else(|| RingError::CompletionTimeout {
            target,
            completed: self.completed(),
            #[cfg(not(loom))]
            waited: start.elapsed(),
            #[cfg(loom)]
            waited: timeout,
        })
    }
}
