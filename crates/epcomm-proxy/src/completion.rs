//! Completion tracking: which descriptors are complete, as the prefix count the ring publishes.
//!
//! Operations complete in any order (an executor may run several queues), but the ring's
//! `completed` word is a count of descriptors *in ring order*: descriptor `n` counts only once
//! every descriptor before it is complete too.

use std::collections::VecDeque;

/// The prefix of complete descriptors, over descriptors taken from the ring in order.
#[derive(Debug, Default)]
pub struct Completions {
    /// Descriptors `0..base` are complete.
    base: u64,
    /// `done[i]`: descriptor `base + i` is complete.
    done: VecDeque<bool>,
}

impl Completions {
    /// Nothing taken, nothing complete.
    pub fn new() -> Completions {
        Completions::default()
    }

    /// Records that descriptor `base + outstanding` was taken (ring order); returns its number.
    pub fn taken(&mut self) -> u64 {
        self.done.push_back(false);
        self.base + self.done.len() as u64 - 1
    }

    /// Marks `positions` complete. Numbers below the prefix, or not yet taken, are ignored.
    pub fn complete(&mut self, positions: &[u64]) {
        for &p in positions {
            if let Some(i) = p.checked_sub(self.base)
                && let Some(flag) = self.done.get_mut(i as usize)
            {
                *flag = true;
            }
        }
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.base += 1;
        }
    }

    /// Descriptors complete, as a prefix of ring order (what the ring publishes).
    pub fn prefix(&self) -> u64 {
        self.base
    }

    /// Descriptors taken beyond the complete prefix (complete or not).
    pub fn pending(&self) -> usize {
        self.done.len()
    }

    /// Descriptors taken and not complete.
    pub fn outstanding(&self) -> usize {
        self.done.iter().filter(|d| !**d).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_order_completions_publish_a_prefix() {
        let mut c = Completions::new();
        for want in 0..5 {
            assert_eq!(c.taken(), want);
        }
        c.complete(&[1, 3]);
        assert_eq!((c.prefix(), c.outstanding()), (0, 3));
        c.complete(&[0]);
        assert_eq!(c.prefix(), 2);
        c.complete(&[2, 4]);
        assert_eq!((c.prefix(), c.outstanding()), (5, 0));
        // Already complete, or never taken: ignored.
        c.complete(&[0, 99]);
        assert_eq!(c.prefix(), 5);
    }
}
