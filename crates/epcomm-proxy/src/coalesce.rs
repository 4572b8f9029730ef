//! Coalescing: contiguous transfers to the same peer become one operation.
//!
//! Transfer `B` extends the peer's open run `A` when `B.src_offset = A.src_offset + A.bytes`
//! and `B.dst_offset = A.dst_offset + A.bytes` and the merged size stays within
//! [`Coalescer::max_run_bytes`]. Each peer has at most one open run. Ordering:
//!
//! * a transfer that does not extend its peer's run closes that run first (emitted before it),
//!   so operations to one peer leave in ring order;
//! * a **signal** closes every open run (in the order they were opened) and is emitted after
//!   them, so a signal never overtakes a transfer that came before it in the ring;
//! * [`Coalescer::flush`] closes every run (the proxy calls it when the ring has nothing more
//!   to give right now).
//!
//! Each [`Op`] lists the ring numbers of the descriptors it covers, so completions can be
//! credited to every one of them.

use crate::descriptor::{Descriptor, Transfer};

/// One operation for an executor: a (possibly merged) descriptor and the ring numbers it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// What to do.
    pub work: Descriptor,
    /// The ring numbers of the descriptors merged into it, ascending.
    pub positions: Vec<u64>,
}

/// Merges contiguous transfers per peer (see the [module docs](self)).
#[derive(Debug)]
pub struct Coalescer {
    max_run_bytes: u64,
    /// Open runs, in the order they were opened.
    runs: Vec<Op>,
}

impl Coalescer {
    /// A coalescer whose merged transfers stay within `max_run_bytes` (a transfer larger than
    /// that on its own passes through unmerged; 0 disables merging).
    pub fn new(max_run_bytes: u64) -> Coalescer {
        Coalescer {
            max_run_bytes,
            runs: Vec::new(),
        }
    }

    /// The merge limit.
    pub fn max_run_bytes(&self) -> u64 {
        self.max_run_bytes
    }

    /// Open runs.
    pub fn open_runs(&self) -> usize {
        self.runs.len()
    }

    /// Adds descriptor number `position`; operations that are ready go to `out`, in order.
    pub fn push(&mut self, position: u64, work: Descriptor, out: &mut Vec<Op>) {
        match work {
            Descriptor::Signal(_) => {
                self.flush(out);
                out.push(Op {
                    work,
                    positions: vec![position],
                });
            }
            Descriptor::Transfer(t) => {
                if let Some(i) = self.runs.iter().position(|r| r.work.peer() == t.peer) {
                    if let Descriptor::Transfer(run) = &mut self.runs[i].work
                        && extends(run, &t, self.max_run_bytes)
                    {
                        run.bytes += t.bytes;
                        self.runs[i].positions.push(position);
                        return;
                    }
                    out.push(self.runs.remove(i));
                }
                self.runs.push(Op {
                    work,
                    positions: vec![position],
                });
            }
        }
    }

    /// Emits every open run to `out`, in the order they were opened.
    pub fn flush(&mut self, out: &mut Vec<Op>) {
        out.append(&mut self.runs);
    }
}

/// `next` continues `run` in source and destination and the merge fits in `max`.
fn extends(run: &Transfer, next: &Transfer, max: u64) -> bool {
    let end = |offset: u64| offset.checked_add(run.bytes);
    end(run.src_offset) == Some(next.src_offset)
        && end(run.dst_offset) == Some(next.dst_offset)
        && run.bytes.checked_add(next.bytes).is_some_and(|b| b <= max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{Signal, SignalOp};

    fn t(peer: u32, src: u64, dst: u64, bytes: u64) -> Descriptor {
        Descriptor::Transfer(Transfer {
            peer,
            src_offset: src,
            dst_offset: dst,
            bytes,
        })
    }

    fn s(peer: u32) -> Descriptor {
        Descriptor::Signal(Signal {
            peer,
            offset: 0,
            value: 1,
            op: SignalOp::Add,
        })
    }

    fn run(c: &mut Coalescer, items: &[Descriptor]) -> Vec<Op> {
        let mut out = Vec::new();
        for (i, d) in items.iter().enumerate() {
            c.push(i as u64, *d, &mut out);
        }
        c.flush(&mut out);
        out
    }

    fn op(work: Descriptor, positions: &[u64]) -> Op {
        Op {
            work,
            positions: positions.to_vec(),
        }
    }

    #[test]
    fn interleaved_rows_merge_per_peer() {
        // Tokens 0..3 each to peers 1 and 2, rows of 100 bytes: what dispatch produces.
        let items = [
            t(1, 0, 1000, 100),
            t(2, 0, 2000, 100),
            t(1, 100, 1100, 100),
            t(2, 100, 2100, 100),
            t(1, 200, 1200, 100),
            t(2, 200, 2200, 100),
        ];
        let out = run(&mut Coalescer::new(1 << 20), &items);
        assert_eq!(
            out,
            vec![
                op(t(1, 0, 1000, 300), &[0, 2, 4]),
                op(t(2, 0, 2000, 300), &[1, 3, 5])
            ]
        );
    }

    #[test]
    fn a_gap_or_the_limit_closes_a_run_in_order() {
        let items = [
            t(1, 0, 0, 100),
            t(1, 100, 100, 100),
            t(1, 300, 200, 100), // source gap
            t(1, 400, 300, 100),
            t(1, 500, 400, 100), // would exceed 200
        ];
        let out = run(&mut Coalescer::new(200), &items);
        assert_eq!(
            out,
            vec![
                op(t(1, 0, 0, 200), &[0, 1]),
                op(t(1, 300, 200, 200), &[2, 3]),
                op(t(1, 500, 400, 100), &[4]),
            ]
        );
        // 0 disables merging.
        assert_eq!(run(&mut Coalescer::new(0), &items).len(), 5);
    }

    #[test]
    fn a_signal_follows_every_earlier_transfer() {
        let items = [
            t(2, 0, 0, 8),
            t(1, 0, 0, 8),
            s(1),
            t(1, 8, 8, 8),
            t(2, 8, 8, 8),
        ];
        let mut c = Coalescer::new(1 << 20);
        let out = run(&mut c, &items);
        assert_eq!(
            out,
            vec![
                op(t(2, 0, 0, 8), &[0]),
                op(t(1, 0, 0, 8), &[1]),
                op(s(1), &[2]),
                op(t(1, 8, 8, 8), &[3]),
                op(t(2, 8, 8, 8), &[4]),
            ]
        );
        assert_eq!(c.open_runs(), 0);
    }
}
