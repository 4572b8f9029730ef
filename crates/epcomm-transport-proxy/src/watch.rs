//! [`CallWatch`]: what the copy-engine executor's driver calls cost, readable from other
//! threads while the proxy runs (the failure report, `EPCOMM_PROXY_TRACE`).

/// Which driver call the executor is inside, and since when: lets a stalled op name a driver
/// call that does not return (e.g. blocked behind another thread of the process).
#[derive(Debug, Default)]
pub struct CallWatch {
    state: std::sync::Mutex<WatchState>,
    /// Whether a timeline is kept: read without the lock, so a poll without one takes none.
    timeline_on: std::sync::atomic::AtomicBool,
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
    /// The timeline, when kept ([`CallWatch::keep_timeline`]): its start and its moments.
    timeline: Option<(std::time::Instant, Vec<(std::time::Duration, Moment)>)>,
}

/// One moment of the copy-engine executor's timeline ([`CallWatch::keep_timeline`]): what a
/// round of the proxy did, so that an op's time can be split into the kernels posting work, the
/// driver calls, and the copy engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// A poll after `ops` operations were accepted since the previous poll.
    Took {
        /// Operations accepted.
        ops: u32,
    },
    /// Lane `lane`'s pending copies handed to the driver: `copies` copies, `bytes` in all.
    Handed {
        /// The lane (the peer rank).
        lane: u32,
        /// Copies handed over.
        copies: u32,
        /// Their bytes.
        bytes: u64,
    },
    /// An event of lane `lane` seen complete, completing `ops` operations, `after` its record.
    Completed {
        /// The lane (the peer rank).
        lane: u32,
        /// Operations it completed.
        ops: u32,
        /// From its record to the poll that saw it complete.
        after: std::time::Duration,
    },
}

impl Moment {
    /// The moment as tab-separated fields: kind, lane, count, and bytes or microseconds.
    pub fn fields(&self) -> String {
        match *self {
            Moment::Took { ops } => format!("took\t-\t{ops}\t-"),
            Moment::Handed {
                lane,
                copies,
                bytes,
            } => format!("handed\t{lane}\t{copies}\t{bytes}"),
            Moment::Completed { lane, ops, after } => {
                format!("completed\t{lane}\t{ops}\t{:.1}", after.as_secs_f64() * 1e6)
            }
        }
    }
}

/// The most moments a timeline keeps (later ones are dropped).
pub const TIMELINE_CAPACITY: usize = 1 << 20;

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

impl WatchState {
    fn note(&mut self, m: Moment) {
        if let Some((start, moments)) = &mut self.timeline
            && moments.len() < TIMELINE_CAPACITY
        {
            moments.push((start.elapsed(), m));
        }
    }
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

    /// One hand-over of lane `lane`'s copies (`bytes` in all) to the driver: its copies by kind,
    /// and the merges before it ([`CopyKinds`]: the copies it held are `signal + small +
    /// large`). One lock per hand-over; the executor counts its merges at push itself.
    pub(crate) fn handed(&self, lane: u32, bytes: u64, h: &CopyKinds) {
        if let Ok(mut w) = self.state.lock() {
            let copies = h.signal + h.small + h.large;
            w.note(Moment::Handed {
                lane,
                copies: u32::try_from(copies).unwrap_or(u32::MAX),
                bytes,
            });
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

    /// An event of lane `lane` seen complete `after` its record, completing `ops` operations.
    pub(crate) fn completed(&self, lane: u32, ops: u32, after: std::time::Duration) {
        if let Ok(mut w) = self.state.lock() {
            w.completed.0 += 1;
            w.completed.1 += after;
            w.completed.2 = w.completed.2.max(after);
            w.note(Moment::Completed { lane, ops, after });
        }
    }

    /// From now on, keep a timeline of the executor's rounds (at most [`TIMELINE_CAPACITY`]
    /// moments; `ProxyOptions::trace` 3).
    pub fn keep_timeline(&self) {
        if let Ok(mut w) = self.state.lock() {
            w.timeline
                .get_or_insert_with(|| (std::time::Instant::now(), Vec::new()));
            self.timeline_on
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Records `m` in the timeline, if one is kept (no lock taken otherwise).
    pub(crate) fn note(&self, m: Moment) {
        if !self.timeline_on.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Ok(mut w) = self.state.lock() {
            w.note(m);
        }
    }

    /// The timeline so far: each moment with its time since [`Self::keep_timeline`] (empty
    /// when none is kept).
    pub fn timeline(&self) -> Vec<(std::time::Duration, Moment)> {
        self.state
            .lock()
            .ok()
            .and_then(|w| w.timeline.as_ref().map(|(_, v)| v.clone()))
            .unwrap_or_default()
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
        w.handed(0, 100, &one);
        w.handed(
            1,
            7,
            &CopyKinds {
                large: 1,
                ..CopyKinds::default()
            },
        );
        assert_eq!(w.hand_overs(), (2, 9));
        assert_eq!(w.copy_kinds(), CopyKinds { large: 6, ..one });
        w.completed(0, 3, Duration::from_micros(10));
        w.completed(1, 1, Duration::from_micros(30));
        assert_eq!(
            w.completions(),
            (2, Duration::from_micros(40), Duration::from_micros(30))
        );
        assert!(w.timeline().is_empty(), "no timeline unless asked for");
    }

    #[test]
    fn a_kept_timeline_holds_each_moment_in_order() {
        let w = CallWatch::default();
        w.note(Moment::Took { ops: 9 });
        w.keep_timeline();
        w.note(Moment::Took { ops: 4 });
        let h = CopyKinds {
            signal: 1,
            large: 2,
            ..CopyKinds::default()
        };
        w.handed(1, 4096, &h);
        w.completed(1, 4, Duration::from_micros(25));
        let t = w.timeline();
        let moments: Vec<Moment> = t.iter().map(|(_, m)| *m).collect();
        assert_eq!(
            moments,
            [
                Moment::Took { ops: 4 },
                Moment::Handed {
                    lane: 1,
                    copies: 3,
                    bytes: 4096
                },
                Moment::Completed {
                    lane: 1,
                    ops: 4,
                    after: Duration::from_micros(25)
                },
            ],
            "the moment before the timeline was kept is not in it"
        );
        assert!(t.windows(2).all(|p| p[0].0 <= p[1].0), "times in order");
        assert_eq!(moments[1].fields(), "handed\t1\t3\t4096");
        assert_eq!(moments[2].fields(), "completed\t1\t4\t25.0");
    }
}
