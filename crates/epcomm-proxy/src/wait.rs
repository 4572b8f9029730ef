//! Bounded waits: poll a condition until it holds or a timeout passes.
//!
//! Every wait of this crate goes through [`wait_until`], so none of them can hang: the caller
//! turns `Ok(None)` (the time ran out) into a typed error naming what it waited for. Under loom
//! time is not modelled: the wait only yields to the other threads, and a schedule where the
//! condition can never become true is reported by loom as a deadlock.

use std::time::Duration;

use crate::sync::backoff;

/// Polls `poll` until it returns `Ok(Some(_))`, returns an error, or `timeout` has passed
/// (then `Ok(None)`). `poll` runs at least once, so a zero timeout is a single try.
pub(crate) fn wait_until<T, E>(
    timeout: Duration,
    mut poll: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    #[cfg(not(loom))]
    let start = std::time::Instant::now();
    let mut iteration: u32 = 0;
    loop {
        if let Some(value) = poll()? {
            return Ok(Some(value));
        }
        #[cfg(not(loom))]
        if start.elapsed() >= timeout {
            return Ok(None);
        }
        #[cfg(loom)]
        let _ = timeout;
        backoff(iteration);
        iteration = iteration.saturating_add(1);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::time::Instant;

    #[test]
    fn returns_the_value_once_the_condition_holds() {
        let mut n = 0;
        let got = wait_until(Duration::from_secs(5), || {
            n += 1;
            Ok::<_, Infallible>((n == 3).then_some(n))
        });
        assert_eq!(got, Ok(Some(3)));
    }

    #[test]
    fn gives_up_after_the_timeout() {
        let start = Instant::now();
        let got = wait_until(Duration::from_millis(20), || {
            Ok::<Option<()>, Infallible>(None)
        });
        assert_eq!(got, Ok(None));
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn zero_timeout_tries_once_and_errors_pass_through() {
        let mut tries = 0;
        let got = wait_until(Duration::ZERO, || {
            tries += 1;
            Ok::<Option<()>, Infallible>(None)
        });
        assert_eq!((got, tries), (Ok(None), 1));
        assert_eq!(
            wait_until(Duration::from_secs(1), || Err::<Option<()>, _>("boom")),
            Err("boom")
        );
    }
}
