//! Coalescing: contiguous transfers to the same peer become one operation.
//!
//! Transfer `B` extends the peer's open run `A` when both read from the same source space
//! (both [`Source::Heap`](crate::descriptor::Source::Heap) offsets, or both
//! [`Source::Address`](crate::descriptor::Source::Address) addresses), `B.src = A.src +
//! A.bytes`, `B.dst_offset = A.dst_offset + A.bytes`, and the merged size stays within
//! [`Coalescer::max_run_bytes`]. Each peer has at most one open run. Ordering (the contract in
//! [`crate::descriptor`]):
//!
//! * a transfer that does not extend its peer's run closes that run first (emitted before it),
//!   so transfers to one peer leave in ring order;
//! * a **write** is emitted at once and merges with nothing; it does **not** close open runs, so
//!   it may leave before a transfer that came earlier in the ring. That is allowed: transfers
//!   and writes to one peer need no order among themselves;
//! * a **signal** closes every open run (in the order they were opened) and is emitted after
//!   them, so a signal never overtakes a transfer or write that came before it in the ring;
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
            Descriptor::Write(_) => out.push(Op {
                work,
                positions: vec![position],
            }),
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

/// `next` continues `run` in the same source space, in source and destination, and the merge
/// fits in `max`.
fn extends(run: &Transfer, next: &Transfer, max: u64) -> bool {
    // `Source::checked_add` keeps the variant, so a heap source never continues an address.
    run.src.checked_add(run.bytes) == Some(next.src)
        && run.dst_offset.checked_add(run.bytes) == Some(next.dst_offset)
        && run.bytes.checked_add(next.bytes).is_some_and(|b| b <= max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{Signal, SignalOp, Source, Write, WriteWidth};

    fn t(peer: u32, src: u64, dst: u64, bytes: u64) -> Descriptor {
        Descriptor::Transfer(Transfer {
            peer,
            src: Source::Heap(src),
            dst_offset: dst,
            bytes,
        })
    }

    fn ta(peer: u32, address: u64, dst: u64, bytes: u64) -> Descriptor {
        Descriptor::Transfer(Transfer {
            peer,
            src: Source::Address(address),
            dst_offset: dst,
            bytes,
        })
    }

    fn w(peer: u32, offset: u64) -> Descriptor {
        Descriptor::Write(Write {
            peer,
            offset,
            value: 1,
            width: WriteWidth::Four,
            count: 1,
        })
    }

    fn s(peer: u32) -> Descriptor {
        Descriptor::Signal(Signal {
            peer,
            offset: 0,
            value: 1,
            op: SignalOp::Add,
            words: 1,
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

    #[test]
    fn writes_between_contiguous_transfers_do_not_split_the_run() {
        // Dispatch with a scale per row: row, scale, row, scale to one peer.
        let items = [
            t(1, 0, 1000, 100),
            w(1, 8),
            t(1, 100, 1100, 100),
            w(1, 12),
            w(2, 12),
            t(1, 200, 1200, 100),
        ];
        let mut c = Coalescer::new(1 << 20);
        let mut out = Vec::new();
        for (i, d) in items.iter().enumerate() {
            c.push(i as u64, *d, &mut out);
        }
        // The writes leave at once; the run stays open.
        assert_eq!(
            out,
            vec![op(w(1, 8), &[1]), op(w(1, 12), &[3]), op(w(2, 12), &[4])]
        );
        assert_eq!(c.open_runs(), 1);
        c.flush(&mut out);
        assert_eq!(out[3], op(t(1, 0, 1000, 300), &[0, 2, 5]));
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn a_signal_after_writes_and_a_run_follows_the_run() {
        let items = [
            t(1, 0, 0, 8),
            w(1, 64),
            t(1, 8, 8, 8),
            w(1, 68),
            s(1),
            w(1, 72),
        ];
        let out = run(&mut Coalescer::new(1 << 20), &items);
        assert_eq!(
            out,
            vec![
                op(w(1, 64), &[1]),
                op(w(1, 68), &[3]),
                op(t(1, 0, 0, 16), &[0, 2]),
                op(s(1), &[4]),
                op(w(1, 72), &[5]),
            ]
        );
        // Whatever the merges, the signal leaves after every earlier transfer and write.
        let signal_at = out.iter().position(|o| o.work == s(1)).expect("signal");
        let before: Vec<u64> = out[..signal_at]
            .iter()
            .flat_map(|o| o.positions.iter().copied())
            .collect();
        assert!([0, 1, 2, 3].iter().all(|p| before.contains(p)));
    }

    #[test]
    fn address_and_heap_sources_never_merge() {
        let items = [
            ta(1, 0x1000, 0, 100),
            ta(1, 0x1064, 100, 100), // contiguous address: merges
            t(1, 0x10c8, 200, 100),  // same numbers, heap space: does not
            t(1, 0x112c, 300, 100),  // contiguous heap: merges with the one before
            ta(1, 0x1190, 400, 100), // contiguous numbers, address space: does not
        ];
        let out = run(&mut Coalescer::new(1 << 20), &items);
        assert_eq!(
            out,
            vec![
                op(ta(1, 0x1000, 0, 200), &[0, 1]),
                op(t(1, 0x10c8, 200, 200), &[2, 3]),
                op(ta(1, 0x1190, 400, 100), &[4]),
            ]
        );
    }
}
