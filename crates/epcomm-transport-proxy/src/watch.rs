//! [`CallWatch`]: what the copy-engine executor's driver calls cost, readable from other
//! threads while the proxy runs (the failure report, `EPCOMM_PROXY_TRACE`).

/// Which driver call the executor is inside, and since when: lets a stalled op name a driver
/// call that does not return (e.g. blocked behind another thread of the process).
#[derive(Debug, Default)]
pub struct CallWatch {
    state: std::sync::Mutex<WatchState>,
}

/// What [`CallWatch`] keeps: the call in progress, the longest call, and per-call totals.
#[derive(Debug, Default)]
struct WatchState {
    current: Option<(&'static str, std::time::Instant)>,
    longest: Option<(&'static str, std::time::Duration)>,
    totals: Vec<(&'static str, u64, std::time::Duration)>,
    /// Operations in the copy engines after the last poll, and when the oldest incomplete
    /// event was recorded.
    in_flight: (usize, Option<std::time::Instant>),
    /// Calls of `poll` so far (the proxy's rounds).
    polls: u64,
    /// Hand-overs of pending copies to the driver, and the copies they held.
    handed: (u64, u64),
    /// What the handed copies were, and how many copies merged before they went out.
    kinds: CopyKinds,
    /// Events seen complete, the total and the longest time from an event's record to the
    /// poll that saw it complete (copy-engine time plus the proxy's polling delay).
    completed: (u64, std::time::Duration, std::time::Duration),
}

/// What the copies handed to the driver were: signal copies, small copies of data (under
/// [`CopyKinds::SMALL`] bytes: metadata, indices, weights) and the rest (rows); and how many
/// copies merged into a pending one instead of going out on their own, when pushed and in the
/// pass before a hand-over. `EPCOMM_PROXY_TRACE` prints it: it says whether the runs the
/// kernels send meet and merge in the executor, or go out one driver call each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyKinds {
    /// Copies of signal words.
    pub signal: u64,
    /// Copies of data under [`CopyKinds::SMALL`] bytes.
    pub small: u64,
    /// Copies of data of at least [`CopyKinds::SMALL`] bytes.
    pub large: u64,
    /// Copies merged into a pending copy when pushed.
    pub merged_at_push: u64,
    /// Copies merged into another by the pass before a hand-over.
    pub merged_at_hand_over: u64,
}

impl CopyKinds {
    /// The size under which a copy of data counts as small.
    pub const SMALL: usize = 4096;
}

impl CallWatch {
    pub(crate) fn call<T>(&self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let since = std::time::Instant::now();
        if let Ok(mut w) = self.state.lock() {
            w.current = Some((name, since));
        }
        let out = f();
        let took = since.elapsed();
        if let Ok(mut w) = self.state.lock() {
            w.current = None;
            if w.longest.is_none_or(|(_, d)| took > d) {
                w.longest = Some((name, took));
            }
            match w.totals.iter_mut().find(|(n, _, _)| *n == name) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += took;
                }
                None => w.totals.push((name, 1, took)),
            }
        }
        out
    }

    /// Per driver call: how many were made and their total time.
    pub fn totals(&self) -> Vec<(&'static str, u64, std::time::Duration)> {
        self.state
            .lock()
            .map(|w| w.totals.clone())
            .unwrap_or_default()
    }

    /// The longest driver call so far and how long it took.
    pub fn longest(&self) -> Option<(&'static str, std::time::Duration)> {
        self.state.lock().ok()?.longest
    }

    /// Operations in the copy engines after the last poll, and how long the oldest incomplete
    /// one has waited (since its event was recorded).
    pub fn in_flight(&self) -> (usize, Option<std::time::Duration>) {
        self.state
            .lock()
            .map(|w| (w.in_flight.0, w.in_flight.1.map(|t| t.elapsed())))
            .unwrap_or_default()
    }

    pub(crate) fn set_in_flight(&self, n: usize, oldest: Option<std::time::Instant>) {
        if let Ok(mut w) = self.state.lock() {
            w.in_flight = (n, oldest);
            w.polls += 1;
        }
    }

    /// One hand-over to the driver: its copies by kind, and the merges before it ([`CopyKinds`]:
    /// the copies it held are `signal + small + large`). One lock per hand-over; the executor
    /// counts its merges at push itself.
    pub(crate) fn handed(&self, h: &CopyKinds) {
        if let Ok(mut w) = self.state.lock() {
            w.handed.0 += 1;
            w.handed.1 += h.signal + h.small + h.large;
            w.kinds.signal += h.signal;
            w.kinds.small += h.small;
            w.kinds.large += h.large;
            w.kinds.merged_at_push += h.merged_at_push;
            w.kinds.merged_at_hand_over += h.merged_at_hand_over;
        }
    }

    /// What the copies handed so far were, and how many merged ([`CopyKinds`]).
    pub fn copy_kinds(&self) -> CopyKinds {
        self.state.lock().map(|w| w.kinds).unwrap_or_default()
    }

    /// An event seen complete `after` its record.
    pub(crate) fn completed(&self, after: std::time::Duration) {
        if let Ok(mut w) = self.state.lock() {
            w.completed.0 += 1;
            w.completed.1 += after;
            w.completed.2 = w.completed.2.max(after);
        }
    }

    /// Hand-overs of copies so far and the copies they held.
    pub fn hand_overs(&self) -> (u64, u64) {
        self.state.lock().map(|w| w.handed).unwrap_or_default()
    }

    /// Events seen complete so far, their total and longest time from record to seen.
    pub fn completions(&self) -> (u64, std::time::Duration, std::time::Duration) {
        self.state.lock().map(|w| w.completed).unwrap_or_default()
    }

    /// Rounds of the proxy so far (calls of the executor's `poll`).
    pub fn polls(&self) -> u64 {
        self.state.lock().map(|w| w.polls).unwrap_or(0)
    }

    /// The driver call in progress and how long it has been running, if any.
    pub fn in_call(&self) -> Option<(&'static str, std::time::Duration)> {
        let w = self.state.lock().ok()?;
        w.current.map(|(name, since)| (name, since.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn hand_overs_and_completions_add_up() {
        let w = CallWatch::default();
        assert_eq!(w.hand_overs(), (0, 0));
        let one = CopyKinds {
            signal: 1,
            small: 2,
            large: 5,
            merged_at_push: 3,
            merged_at_hand_over: 4,
        };
        w.handed(&one);
        w.handed(&CopyKinds {
            large: 1,
            ..CopyKinds::default()
        });
        assert_eq!(w.hand_overs(), (2, 9));
        assert_eq!(w.copy_kinds(), CopyKinds { large: 6, ..one });
        w.completed(Duration::from_micros(10));
        w.completed(Duration::from_micros(30));
        assert_eq!(
            w.completions(),
            (2, Duration::from_micros(40), Duration::from_micros(30))
        );
    }
}
