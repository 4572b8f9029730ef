//! The descriptor ring: producers (the threads of a GPU kernel, many at once; or one host
//! [`Producer`]) hand [`RawDescriptor`](crate::RawDescriptor)s to one consumer (the proxy)
//! through a memory region both can reach (host memory mapped into the GPU).
//!
//! # Layout (bytes; every word a little-endian `u64` accessed atomically)
//!
//! | offset | word        | written by | meaning |
//! |--------|-------------|------------|---------|
//! | 0      | `magic`     | host, once | [`RING_MAGIC`] |
//! | 8      | `capacity`  | host, once | slots, a power of two |
//! | 64     | `head`      | host [`Producer`] only | descriptors published so far, for observers; the GPU producer never writes it and the consumer never reads it |
//! | 128    | `tail`      | consumer   | descriptors taken so far (their slots are free again) |
//! | 192    | `completed` | consumer   | descriptors whose effects are complete, a prefix of ring order |
//! | 256    | `status`    | consumer   | [`STATUS_RUNNING`], [`STATUS_CLOSED`] or [`STATUS_FAILED`] |
//! | 320 + 64·s | slot `s` | producer | `seq` (u64) at +0, the descriptor's four words at +8..+40 |
//!
//! Each header word has a 64-byte line of its own, and so has each slot. A zeroed region with
//! `magic` and `capacity` written is an empty, running ring ([`RingMemory::allocate`],
//! [`RingMemory::from_raw`]).
//!
//! # Protocol
//!
//! Descriptor number `p` (counting from 0) goes to slot `p mod capacity`.
//!
//! * **Producer**, for its position `p`: (0) claim `p` — the GPU producer is **multi-producer**:
//!   each thread takes `p` from an atomic counter in device memory, outside the ring, so
//!   positions are unique but published in any order; the host [`Producer`] is a single
//!   producer and uses `p = head`; (1) wait until `p - tail < capacity` (acquire load of
//!   `tail`: the consumer has finished reading the slot's previous descriptor) — the **ring
//!   full** back-pressure, bounded by a timeout; (2) store the four descriptor words (relaxed);
//!   (3) store `seq = p + 1` with **release**; (4) host [`Producer`] only: store `head = p + 1`
//!   (release; for observers). The GPU producer never writes `head` (it stays 0).
//! * **Consumer**, for `p = tail`: (1) load the slot's `seq` with **acquire**; `p + 1` means the
//!   descriptor is complete (the release of step 3 orders its words before the tag, so a
//!   half-written slot is never read); `0` or an older tag `q + 1` with `q ≡ p (mod capacity)`,
//!   `q < p`, means not yet written; anything else is [`RingError::CorruptSlot`]; (2) read the
//!   four words; (3) store `tail = p + 1` with **release**, handing the slot back. The consumer
//!   follows only the `seq` tags, in position order, and never reads `head`: a slot published
//!   ahead of an earlier position simply waits until that position is published and taken.
//!   Step (1) of the producer keeps two claimed positions from sharing a slot at once: `p +
//!   capacity` cannot be written before `tail > p`, i.e. before `p` was taken.
//! * **Completions**: the consumer publishes `completed` (release) as the count of descriptors,
//!   in ring order, whose effects are complete; the producer waits for a target with a bounded
//!   wait ([`Producer::wait_completed`]).
//! * **Status**: the consumer stores [`STATUS_CLOSED`] when it stops (clean shutdown) and
//!   [`STATUS_FAILED`] when it stopped on an error; the producer's waits end with
//!   [`RingError::Closed`] or [`RingError::ProxyFailed`] instead of timing out.
//!
//! On the GPU the same steps are an atomic add on the device counter for the claim,
//! `st.relaxed.sys` for the words, `st.release.sys` for `seq` and `ld.acquire.sys` for `tail`
//! and `completed`. Any number of GPU threads may produce into one ring; a host [`Producer`]
//! must be the ring's only producer (it is not `Clone`, and it numbers descriptors from its
//! own `head`).

mod consumer;
mod memory;
mod producer;

pub use consumer::Consumer;
pub use memory::{RingMemory, region_bytes};
pub use producer::Producer;

use std::time::Duration;

use crate::descriptor::DescriptorError;
use crate::sync::Arc;

/// `magic` of an initialised ring: `"EPCRING1"` in little-endian bytes.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"EPCRING1");
/// Bytes before the first slot.
pub const HEADER_BYTES: usize = 320;
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 64;
/// Alignment the region needs (one cache line).
pub const REGION_ALIGN: usize = 64;
/// The largest capacity accepted.
pub const MAX_CAPACITY: u64 = 1 << 24;
/// `status`: the consumer is running.
pub const STATUS_RUNNING: u64 = 0;
/// `status`: the consumer stopped cleanly; nothing published after this is executed.
pub const STATUS_CLOSED: u64 = 1;
/// `status`: the consumer stopped on an error.
pub const STATUS_FAILED: u64 = 2;

/// Byte offset of the `head` word.
pub const OFFSET_HEAD: usize = 64;
/// Byte offset of the `tail` word.
pub const OFFSET_TAIL: usize = 128;
/// Byte offset of the `completed` word.
pub const OFFSET_COMPLETED: usize = 192;
/// Byte offset of the `status` word.
pub const OFFSET_STATUS: usize = 256;

/// Everything the ring can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The capacity is not a power of two in `1..=MAX_CAPACITY`.
    #[error("ring capacity {capacity}: must be a power of two between 1 and {MAX_CAPACITY}")]
    InvalidCapacity {
        /// The value given.
        capacity: u64,
    },
    /// The region is smaller than the layout needs.
    #[error("ring region of {len} bytes: capacity {capacity} needs {needed}")]
    RegionTooSmall {
        /// Bytes given.
        len: usize,
        /// Slots asked for.
        capacity: u64,
        /// Bytes needed ([`region_bytes`]).
        needed: usize,
    },
    /// The region does not start on a [`REGION_ALIGN`] boundary.
    #[error("ring region at {addr:#x}: must be aligned to {REGION_ALIGN} bytes")]
    Misaligned {
        /// The address given.
        addr: usize,
    },
    /// The producer waited `waited` for a free slot: the consumer did not take any.
    #[error(
        "ring full: {capacity} descriptors published (head {head}) and not taken (tail {tail}) \
         for {waited:?}"
    )]
    Full {
        /// Slots.
        capacity: u64,
        /// Descriptors published.
        head: u64,
        /// Descriptors taken.
        tail: u64,
        /// How long the producer waited.
        waited: Duration,
    },
    /// The consumer waited `waited` for descriptor `position`.
    #[error("ring empty: descriptor {position} not published within {waited:?}")]
    Empty {
        /// The descriptor waited for.
        position: u64,
        /// How long.
        waited: Duration,
    },
    /// A slot's tag is neither the awaited one nor an older one of that slot.
    #[error(
        "ring slot {slot} holds tag {found} while descriptor {position} was due: the ring's \
         memory was written outside the protocol"
    )]
    CorruptSlot {
        /// The descriptor due.
        position: u64,
        /// Its slot.
        slot: u64,
        /// The tag found.
        found: u64,
    },
    /// The consumer has stopped (clean shutdown).
    #[error("ring closed: the proxy stopped (descriptor {position} will not be executed)")]
    Closed {
        /// The descriptor concerned (next to publish, or awaited to complete).
        position: u64,
    },
    /// The consumer stopped on an error.
    #[error("the proxy failed: descriptor {position} will not be executed")]
    ProxyFailed {
        /// The descriptor concerned.
        position: u64,
    },
    /// The producer waited `waited` for `completed` to reach `target`.
    #[error("completions: waited {waited:?} for {target} completed descriptors, saw {completed}")]
    CompletionTimeout {
        /// The count awaited.
        target: u64,
        /// The count seen last.
        completed: u64,
        /// How long.
        waited: Duration,
    },
    /// The descriptor to publish is invalid.
    #[error(transparent)]
    Invalid(#[from] DescriptorError),
}

/// Creates the two ends of the ring over `memory`.
///
/// The memory must be fresh (as [`RingMemory::allocate`] and [`RingMemory::from_raw`] leave it):
/// each end keeps its position locally and starts from the region's words.
pub fn split(memory: RingMemory) -> (Producer, Consumer) {
    let memory = Arc::new(memory);
    (Producer::new(Arc::clone(&memory)), Consumer::new(memory))
}

/// The slot of descriptor `position`.
fn slot_of(position: u64, capacity: u64) -> u64 {
    position & (capacity - 1)
}
