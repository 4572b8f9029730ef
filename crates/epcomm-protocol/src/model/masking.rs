//! Rank masking of the low-latency ops (`kFlagMasking`, `docs/low-latency.md` "Masking
//! ranks"), and the stopped rank ([`crate::config::StoppedRank`]) that makes it matter.
//!
//! Contract: each rank has a mask word per peer (1 = masked), written only by its own waits
//! here: a wait of a low-latency op with masking ([`Rank::masks`]) ends at once for a masked
//! peer, and a wait that expires on a peer masks it instead of failing the op
//! ([`Rank::wait_or_masked`]). A wait expires only on a rank that stopped: under std after
//! the configured timeout (a live peer that does not answer within it is a
//! [`crate::Violation::Timeout`], as before), under loom as soon as the peer stopped (loom has
//! no time; a live peer is waited for, and a schedule where nobody can progress is a
//! deadlock). This is the kernels' premise: masking is for ranks that stopped, with a timeout
//! longer than any live rank's delay. The steps that use the mask are in `low_latency.rs`
//! (`[L2]`, `[L3]`, `[L6]`, `[L7]`, `[L8]`, `[L9]`), `wait.rs` (`[G1]`, `[G2]`, `[L5]`) and
//! `agreement.rs` (`[A2]`).
//!
//! The model runs a rank's sender blocks one after another, so they always agree on the mask;
//! the kernels' blocks keep their own copy (loaded in the prologue, refreshed after the
//! receive phase's waits) and may disagree about a peer that is late by about the timeout.

use super::Rank;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Whether the current op masks: a low-latency op with masking on.
    pub(super) fn masks(&self) -> bool {
        self.cfg.ll_masking() && self.kind.is_low_latency()
    }

    /// The mask words as this op sees them now: bit `d` = peer `d` masked (0 when the op does
    /// not mask). The kernels' block copy: read at the op's start for the send phase, and again
    /// after `[L5]` for the receive phase.
    pub(super) fn mask_bits(&self) -> u64 {
        if self.masks() { self.mask.get() } else { 0 }
    }

    /// Whether the current op treats `peer` as masked (never this rank itself).
    pub(super) fn is_masked(&self, peer: usize) -> bool {
        peer != self.me && (self.mask_bits() >> peer) & 1 == 1
    }

    /// A wait for `peer` expired: mask it (this rank's own mask word; the kernels'
    /// `mask_on_timeout`).
    pub(super) fn mask_peer(&self, peer: usize) {
        self.mask.set(self.mask.get() | 1 << peer);
    }

    /// Whether `peer` reached its configured stop point (false without a stopped rank, and
    /// then no shared word is read). Acquire: whatever `peer` stored before it stopped is
    /// visible to this rank's next loads.
    pub(super) fn peer_stopped(&self, peer: usize) -> bool {
        self.cfg.stopped_rank().is_some_and(|s| s.rank == peer)
            && self.w.stopped[peer].load(Ordering::Acquire) != 0
    }

    /// This rank reached its stop point: it runs nothing more. Publishes the model's
    /// "stopped" word (release, after everything it stored), which lets its peers' waits for
    /// it expire.
    pub(super) fn halt(&self) {
        self.w.stopped[self.me].store(1, Ordering::Release);
    }
}
