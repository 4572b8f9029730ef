//! The host mirror of the device `SeqState`.
//!
//! The kernels read the authoritative sequence numbers from device memory at their start and
//! the last block of each op advances them, so kernel arguments never carry per-op values (a
//! captured graph replays correctly). The host keeps this mirror only for what it must know
//! itself: the notify tag a HostSync dispatch waits for, and the dispatch parity that tells
//! which receive region a [`crate::Dispatched`] view points at.
//!
//! Contract: the mirror advances exactly when an op's kernel was launched (or captured), by the
//! same rules as the device `prologue`; a check that fails before the launch leaves it in step.
//! Every rank issues the same ops, so every rank's mirror holds the same values.

use epcomm_kernels::abi;

/// Op counts since the buffer was created (identical on every rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sequence {
    /// Ops of any kind.
    pub(crate) op: u64,
    /// Count exchanges (non-cached dispatches): the HostSync tag.
    pub(crate) notify: u64,
    /// Dispatches, cached or not: their parity picks the receive region.
    pub(crate) dispatch: u64,
    /// Combines.
    pub(crate) combine: u64,
    /// Low-latency dispatches (counted by their send phase).
    pub(crate) ll_dispatch: u64,
    /// Low-latency combines (counted by their send phase).
    pub(crate) ll_combine: u64,
}

impl Sequence {
    /// Counts one kernel of `kind` (an `abi::op` code). A low-latency receive phase belongs to
    /// the op its send phase counted and changes nothing.
    pub(super) fn advance(&mut self, kind: u32) {
        match kind {
            abi::op::LL_DISPATCH_RECV | abi::op::LL_COMBINE_RECV => return,
            abi::op::DISPATCH => {
                self.notify += 1;
                self.dispatch += 1;
            }
            abi::op::CACHED_DISPATCH => self.dispatch += 1,
            abi::op::LL_DISPATCH => self.ll_dispatch += 1,
            abi::op::LL_COMBINE => self.ll_combine += 1,
            _ => self.combine += 1,
        }
        self.op += 1;
    }

    /// The ops issued between `o` and `self` (`o` must be an earlier state).
    pub(crate) fn minus(&self, o: &Self) -> Self {
        Self {
            op: self.op - o.op,
            notify: self.notify - o.notify,
            dispatch: self.dispatch - o.dispatch,
            combine: self.combine - o.combine,
            ll_dispatch: self.ll_dispatch - o.ll_dispatch,
            ll_combine: self.ll_combine - o.ll_combine,
        }
    }

    /// Counts the ops of `d` (e.g. what a replayed graph holds).
    pub(crate) fn add(&mut self, d: &Self) {
        self.op += d.op;
        self.notify += d.notify;
        self.dispatch += d.dispatch;
        self.combine += d.combine;
        self.ll_dispatch += d.ll_dispatch;
        self.ll_combine += d.ll_combine;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_sequence_mirrors_the_device_rules() {
        let mut s = Sequence::default();
        s.advance(abi::op::DISPATCH);
        s.advance(abi::op::COMBINE);
        s.advance(abi::op::CACHED_DISPATCH);
        s.advance(abi::op::COMBINE);
        // Same increments as `prologue` in the kernels.
        assert_eq!(
            s,
            Sequence {
                op: 4,
                notify: 1,
                dispatch: 2,
                combine: 2,
                ..Sequence::default()
            }
        );
        // A low-latency op counts once, at its send phase.
        s.advance(abi::op::LL_DISPATCH);
        s.advance(abi::op::LL_DISPATCH_RECV);
        s.advance(abi::op::LL_COMBINE);
        s.advance(abi::op::LL_COMBINE_RECV);
        assert_eq!((s.op, s.ll_dispatch, s.ll_combine, s.combine), (6, 1, 1, 2));
        let before = s;
        s.advance(abi::op::DISPATCH);
        s.advance(abi::op::COMBINE);
        let delta = s.minus(&before);
        assert_eq!(
            delta,
            Sequence {
                op: 2,
                notify: 1,
                dispatch: 1,
                combine: 1,
                ..Sequence::default()
            }
        );
        // A graph replay advances the mirror by what the capture contained.
        let mut replayed = s;
        replayed.add(&delta);
        assert_eq!(
            replayed,
            Sequence {
                op: 10,
                notify: 3,
                dispatch: 4,
                combine: 4,
                ll_dispatch: 1,
                ll_combine: 1,
            }
        );
    }
}
