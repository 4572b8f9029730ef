//! Std-only step hooks for the stress and negative tests.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use epcomm_protocol::{OpKind, Step, StepHook};

/// Forces one interleaving: rank `rank` stops right before `(op, step)` until rank `peer` has
/// arrived at `(peer_op, peer_step)` (or `give_up` passes, then it continues).
#[derive(Debug)]
pub struct Pause {
    pub rank: usize,
    pub op: usize,
    pub step: Step,
    pub peer: usize,
    pub peer_op: usize,
    pub peer_step: Step,
    pub give_up: Duration,
    reached: Mutex<HashSet<(usize, usize, Step)>>,
    pub gave_up: std::sync::atomic::AtomicBool,
}

impl Pause {
    pub fn new(rank: usize, at: (usize, Step), peer: usize, until: (usize, Step)) -> Self {
        Self {
            rank,
            op: at.0,
            step: at.1,
            peer,
            peer_op: until.0,
            peer_step: until.1,
            give_up: Duration::from_secs(3),
            reached: Mutex::new(HashSet::new()),
            gave_up: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl Pause {
    /// The same pause with another give-up delay (for schedules the protocol must prevent).
    pub fn giving_up_after(mut self, give_up: Duration) -> Self {
        self.give_up = give_up;
        self
    }
}

impl StepHook for Pause {
    fn at(&self, rank: usize, op: usize, _kind: OpKind, step: Step) {
        self.reached.lock().unwrap().insert((rank, op, step));
        if (rank, op, step) != (self.rank, self.op, self.step) {
            return;
        }
        let start = Instant::now();
        let target = (self.peer, self.peer_op, self.peer_step);
        while !self.reached.lock().unwrap().contains(&target) {
            if start.elapsed() > self.give_up {
                self.gave_up.store(true, Ordering::SeqCst);
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Let the peer run on past the step it just announced.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Random delays at every step: most steps run at once, some yield, a few sleep.
#[derive(Debug)]
pub struct Jitter {
    state: AtomicU64,
}

impl Jitter {
    pub fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed | 1),
        }
    }
}

impl StepHook for Jitter {
    fn at(&self, rank: usize, op: usize, _kind: OpKind, _step: Step) {
        let mut x = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            ^ ((rank as u64) << 40)
            ^ ((op as u64) << 20);
        x ^= x >> 33;
        x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        x ^= x >> 33;
        match x % 100 {
            0..=64 => {}
            65..=94 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(x % 300)),
        }
    }
}

/// Small deterministic PRNG for picking configurations.
#[derive(Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
