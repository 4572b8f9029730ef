//! What the bench workers (flat and hierarchical) share: where rank 0's results go, the error
//! type, rank 0's progress messages and the all-gather of each rank's median.

use std::io::IsTerminal as _;

use epcomm_bootstrap::Bootstrap;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Environment variable (set by the launcher for its workers) naming the file rank 0 writes
/// its results to.
pub const RESULTS_ENV: &str = "EPCOMM_CLI_RESULTS";

/// A worker's result.
pub(crate) type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Rank 0's messages on stderr, above the progress bar.
pub(crate) struct Progress {
    rank: usize,
    pub(crate) bar: ProgressBar,
}

impl Progress {
    pub(crate) fn new(rank: usize, steps: u64, sweep: bool) -> Self {
        let draw = rank == 0 && sweep && std::io::stderr().is_terminal();
        let bar = if draw {
            let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} [{bar:32}] {pos}/{len} {msg} ({elapsed})")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        Self { rank, bar }
    }

    pub(crate) fn say(&self, msg: impl std::fmt::Display) {
        if self.rank == 0 {
            self.bar.suspend(|| eprintln!("{msg}"));
        }
    }
}

/// Every rank's value of `t` (a median time), in rank order (NaN where a rank sent garbage).
pub(crate) fn every_rank(boot: &Bootstrap, tag: &str, t: f64) -> Res<Vec<f64>> {
    let all = boot.all_gather(tag, &t.to_le_bytes())?;
    Ok(all
        .iter()
        .map(|b| {
            b.get(..8)
                .and_then(|b| b.try_into().ok())
                .map_or(f64::NAN, f64::from_le_bytes)
        })
        .collect())
}
