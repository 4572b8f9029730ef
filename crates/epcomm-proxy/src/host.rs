//! The host executor: symmetric buffers in host memory, one per rank, and an [`Executor`] that
//! copies between them. A real executor for host memory (the proxy's tests run on it), with a
//! bounded queue so the proxy's flow control is exercised: submissions queue up to `depth`
//! operations, and [`Executor::poll`] carries out the queue in order (so per-peer submission
//! order is kept). Transfers read only heap offsets ([`Source::Heap`]): a transfer from a device
//! address ([`Source::Address`]) is refused at submission with [`HostError::AddressSource`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::descriptor::{Signal, SignalOp, Source, Transfer, Write};
use crate::executor::{Executor, OpFailure, OpId, Submit};

/// What the host heap rejects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No such rank.
    #[error("rank {rank}: the host heap has {world} ranks")]
    RankOutOfRange {
        /// The rank asked for.
        rank: u32,
        /// Ranks in the heap.
        world: u32,
    },
    /// A range outside a rank's buffer.
    #[error("rank {rank}: [{offset}, {offset} + {bytes}) is outside its {heap_bytes}-byte buffer")]
    OutOfBounds {
        /// The rank.
        rank: u32,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        bytes: u64,
        /// Size of every rank's buffer.
        heap_bytes: u64,
    },
    /// A transfer whose source is a device address: the host executor reads only offsets in
    /// the host heap.
    #[error(
        "transfer source is device address {address:#x}: the host executor reads only offsets \
         in the host heap (a heap source), not device addresses"
    )]
    AddressSource {
        /// The address given.
        address: u64,
    },
    /// A thread panicked while holding the rank's buffer.
    #[error("rank {rank}: its buffer's lock is poisoned")]
    Poisoned {
        /// The rank.
        rank: u32,
    },
}

/// One symmetric buffer per rank, in host memory, each behind its own lock.
#[derive(Debug)]
pub struct HostHeap {
    ranks: Vec<Mutex<Vec<u8>>>,
    heap_bytes: u64,
}

impl HostHeap {
    /// `world` zeroed buffers of `heap_bytes` bytes each.
    pub fn new(world: u32, heap_bytes: usize) -> Arc<HostHeap> {
        Arc::new(HostHeap {
            ranks: (0..world)
                .map(|_| Mutex::new(vec![0; heap_bytes]))
                .collect(),
            heap_bytes: heap_bytes as u64,
        })
    }

    /// Ranks.
    pub fn world(&self) -> u32 {
        self.ranks.len() as u32
    }

    fn lock(&self, rank: u32) -> Result<MutexGuard<'_, Vec<u8>>, HostError> {
        let m = self
            .ranks
            .get(rank as usize)
            .ok_or(HostError::RankOutOfRange {
                rank,
                world: self.world(),
            })?;
        m.lock().map_err(|_| HostError::Poisoned { rank })
    }

    fn range(
        &self,
        rank: u32,
        offset: u64,
        bytes: u64,
    ) -> Result<std::ops::Range<usize>, HostError> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.heap_bytes => Ok(offset as usize..end as usize),
            _ => Err(HostError::OutOfBounds {
                rank,
                offset,
                bytes,
                heap_bytes: self.heap_bytes,
            }),
        }
    }

    /// A copy of `bytes` bytes of `rank`'s buffer at `offset`.
    ///
    /// # Errors
    /// [`HostError`] naming the rank.
    pub fn read(&self, rank: u32, offset: u64, bytes: u64) -> Result<Vec<u8>, HostError> {
        let r = self.range(rank, offset, bytes)?;
        Ok(self.lock(rank)?[r].to_vec())
    }

    /// Writes `data` into `rank`'s buffer at `offset`.
    ///
    /// # Errors
    /// [`HostError`] naming the rank.
    pub fn write(&self, rank: u32, offset: u64, data: &[u8]) -> Result<(), HostError> {
        let r = self.range(rank, offset, data.len() as u64)?;
        self.lock(rank)?[r].copy_from_slice(data);
        Ok(())
    }

    /// The little-endian 64-bit word of `rank`'s buffer at `offset`.
    ///
    /// # Errors
    /// [`HostError`] naming the rank.
    pub fn word(&self, rank: u32, offset: u64) -> Result<u64, HostError> {
        let r = self.range(rank, offset, 8)?;
        let g = self.lock(rank)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(&g[r]);
        Ok(u64::from_le_bytes(b))
    }

    /// Copies `t.bytes` bytes from `from`'s buffer to `t.peer`'s.
    fn transfer(&self, from: u32, t: &Transfer) -> Result<(), HostError> {
        let src_offset = match t.src {
            Source::Heap(offset) => offset,
            Source::Address(address) => return Err(HostError::AddressSource { address }),
        };
        let src = self.range(from, src_offset, t.bytes)?;
        let dst = self.range(t.peer, t.dst_offset, t.bytes)?;
        if from == t.peer {
            self.lock(from)?.copy_within(src, dst.start);
            return Ok(());
        }
        // One lock at a time: no lock order between ranks to get wrong.
        let data = self.lock(from)?[src].to_vec();
        self.lock(t.peer)?[dst].copy_from_slice(&data);
        Ok(())
    }

    /// Applies `s` to its words (an add: its one word).
    fn signal(&self, s: &Signal) -> Result<(), HostError> {
        let r = self.range(s.peer, s.offset, s.bytes())?;
        let mut g = self.lock(s.peer)?;
        for word in g[r].chunks_exact_mut(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(word);
            let new = match s.op {
                SignalOp::Set => s.value,
                SignalOp::Add => u64::from_le_bytes(b).wrapping_add(s.value),
            };
            word.copy_from_slice(&new.to_le_bytes());
        }
        Ok(())
    }

    /// Stores `w`'s elements (each the low `w.width` bytes of its value, little-endian) from
    /// `w.offset` of `w.peer`'s buffer on.
    fn store(&self, w: &Write) -> Result<(), HostError> {
        let r = self.range(w.peer, w.offset, w.bytes())?;
        for (to, b) in self.lock(w.peer)?[r].iter_mut().zip(w.le_bytes()) {
            *to = b;
        }
        Ok(())
    }
}

/// Queued work of the host executor.
#[derive(Debug)]
enum Work {
    Transfer(Transfer),
    Signal(Signal),
    Write(Write),
}

/// Executes transfers from rank `me` and signals on a [`HostHeap`] (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct HostExecutor {
    heap: Arc<HostHeap>,
    me: u32,
    depth: usize,
    queue: VecDeque<(OpId, Work)>,
}

impl HostExecutor {
    /// Rank `me`'s executor on `heap`, queueing at most `depth` operations (at least 1).
    pub fn new(heap: Arc<HostHeap>, me: u32, depth: usize) -> HostExecutor {
        HostExecutor {
            heap,
            me,
            depth: depth.max(1),
            queue: VecDeque::new(),
        }
    }

    fn enqueue(&mut self, op: OpId, work: Work) -> Submit {
        if self.queue.len() >= self.depth {
            return Submit::Busy;
        }
        self.queue.push_back((op, work));
        Submit::Accepted
    }
}

impl Executor for HostExecutor {
    fn name(&self) -> &str {
        "host"
    }

    /// Queues `transfer`; one from a device address is refused with
    /// [`HostError::AddressSource`].
    fn submit_transfer(&mut self, op: OpId, transfer: &Transfer) -> Result<Submit, OpFailure> {
        if let Source::Address(address) = transfer.src {
            return Err(OpFailure::new(op, HostError::AddressSource { address }));
        }
        Ok(self.enqueue(op, Work::Transfer(*transfer)))
    }

    fn submit_write(&mut self, op: OpId, write: &Write) -> Result<Submit, OpFailure> {
        Ok(self.enqueue(op, Work::Write(*write)))
    }

    fn submit_signal(&mut self, op: OpId, signal: &Signal) -> Result<Submit, OpFailure> {
        Ok(self.enqueue(op, Work::Signal(*signal)))
    }

    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        while let Some((op, work)) = self.queue.pop_front() {
            match &work {
                Work::Transfer(t) => self.heap.transfer(self.me, t),
                Work::Signal(s) => self.heap.signal(s),
                Work::Write(w) => self.heap.store(w),
            }
            .map_err(|e| OpFailure::new(op, e))?;
            done.push(op);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_signals_and_queue_depth() {
        let heap = HostHeap::new(2, 64);
        heap.write(0, 0, &[1, 2, 3, 4]).expect("write");
        let mut ex = HostExecutor::new(Arc::clone(&heap), 0, 2);
        let t = Transfer {
            peer: 1,
            src: Source::Heap(0),
            dst_offset: 8,
            bytes: 4,
        };
        let s = Signal {
            peer: 1,
            offset: 16,
            value: 5,
            op: SignalOp::Add,
            words: 1,
        };
        assert_eq!(ex.submit_transfer(1, &t).ok(), Some(Submit::Accepted));
        assert_eq!(ex.submit_signal(2, &s).ok(), Some(Submit::Accepted));
        assert_eq!(ex.submit_signal(3, &s).ok(), Some(Submit::Busy));
        let mut done = Vec::new();
        ex.poll(&mut done).expect("poll");
        assert_eq!(done, [1, 2]);
        assert_eq!(heap.read(1, 8, 4), Ok(vec![1, 2, 3, 4]));
        assert_eq!(heap.word(1, 16), Ok(5));
        // Same rank: an overlapping move within one buffer.
        let mut ex0 = HostExecutor::new(Arc::clone(&heap), 0, 4);
        let local = Transfer {
            peer: 0,
            src: Source::Heap(0),
            dst_offset: 2,
            bytes: 4,
        };
        assert!(ex0.submit_transfer(7, &local).is_ok());
        ex0.poll(&mut done).expect("poll");
        assert_eq!(heap.read(0, 0, 6), Ok(vec![1, 2, 1, 2, 3, 4]));
    }

    #[test]
    fn bounds_are_errors_naming_the_operation_and_rank() {
        let heap = HostHeap::new(2, 64);
        let mut ex = HostExecutor::new(Arc::clone(&heap), 0, 4);
        let t = Transfer {
            peer: 1,
            src: Source::Heap(0),
            dst_offset: 60,
            bytes: 8,
        };
        assert!(ex.submit_transfer(9, &t).is_ok());
        let err = ex.poll(&mut Vec::new()).expect_err("out of bounds");
        assert_eq!(err.op, 9);
        assert_eq!(
            err.reason.to_string(),
            "rank 1: [60, 60 + 8) is outside its 64-byte buffer"
        );
        assert_eq!(
            heap.word(5, 0),
            Err(HostError::RankOutOfRange { rank: 5, world: 2 })
        );
    }

    #[test]
    fn writes_store_four_or_eight_bytes_little_endian() {
        use crate::descriptor::WriteWidth;
        let heap = HostHeap::new(2, 64);
        heap.write(1, 0, &[0xEE; 16]).expect("fill");
        let mut ex = HostExecutor::new(Arc::clone(&heap), 0, 4);
        let four = Write {
            peer: 1,
            offset: 4,
            value: 0x1122_3344,
            width: WriteWidth::Four,
            count: 1,
        };
        let eight = Write {
            peer: 1,
            offset: 8,
            value: 0x0102_0304_0506_0708,
            width: WriteWidth::Eight,
            count: 1,
        };
        assert_eq!(ex.submit_write(1, &four).ok(), Some(Submit::Accepted));
        assert_eq!(ex.submit_write(2, &eight).ok(), Some(Submit::Accepted));
        let mut done = Vec::new();
        ex.poll(&mut done).expect("poll");
        assert_eq!(done, [1, 2]);
        let mut want = vec![0xEE; 4];
        want.extend_from_slice(&0x1122_3344u32.to_le_bytes());
        want.extend_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
        // Only the width's bytes change.
        assert_eq!(heap.read(1, 0, 16), Ok(want));
        let outside = Write { offset: 62, ..four };
        assert!(ex.submit_write(3, &outside).is_ok());
        let err = ex.poll(&mut done).expect_err("out of bounds");
        assert_eq!(err.op, 3);
        assert_eq!(
            err.reason.to_string(),
            "rank 1: [62, 62 + 4) is outside its 64-byte buffer"
        );
    }

    #[test]
    fn a_sequence_stores_consecutive_values_and_a_signal_sets_its_words() {
        use crate::descriptor::WriteWidth;
        let heap = HostHeap::new(2, 128);
        heap.write(1, 0, &[0xEE; 128]).expect("fill");
        let mut ex = HostExecutor::new(Arc::clone(&heap), 0, 4);
        let seq = Write {
            count: 5,
            ..Write::one(1, 4, 40, WriteWidth::Four)
        };
        let flags = Signal {
            words: 3,
            ..Signal::word(1, 64, 0x77, SignalOp::Set)
        };
        assert_eq!(ex.submit_write(1, &seq).ok(), Some(Submit::Accepted));
        assert_eq!(ex.submit_signal(2, &flags).ok(), Some(Submit::Accepted));
        let mut done = Vec::new();
        ex.poll(&mut done).expect("poll");
        assert_eq!(done, [1, 2]);
        let mut want = vec![0xEE; 4];
        for v in 40u32..45 {
            want.extend_from_slice(&v.to_le_bytes());
        }
        want.extend_from_slice(&[0xEE; 4]);
        assert_eq!(heap.read(1, 0, 28), Ok(want));
        for k in 0..3 {
            assert_eq!(heap.word(1, 64 + 8 * k), Ok(0x77));
        }
        // The word after the signal's is untouched.
        assert_eq!(heap.read(1, 88, 8), Ok(vec![0xEE; 8]));
        // A sequence that runs past the buffer fails as a whole, naming its range.
        let long = Write {
            count: 4,
            ..Write::one(1, 116, 0, WriteWidth::Four)
        };
        assert!(ex.submit_write(3, &long).is_ok());
        let err = ex.poll(&mut done).expect_err("out of bounds");
        assert_eq!(err.op, 3);
        assert_eq!(
            err.reason.to_string(),
            "rank 1: [116, 116 + 16) is outside its 128-byte buffer"
        );
        assert_eq!(heap.read(1, 116, 12), Ok(vec![0xEE; 12]));
    }

    #[test]
    fn an_address_source_is_refused_at_submission() {
        let heap = HostHeap::new(2, 64);
        let mut ex = HostExecutor::new(Arc::clone(&heap), 0, 4);
        let t = Transfer {
            peer: 1,
            src: Source::Address(0x7f00_0000_1000),
            dst_offset: 0,
            bytes: 8,
        };
        let err = ex.submit_transfer(5, &t).expect_err("refused");
        assert_eq!(err.op, 5);
        assert_eq!(
            err.reason.downcast_ref::<HostError>(),
            Some(&HostError::AddressSource {
                address: 0x7f00_0000_1000
            })
        );
        assert!(
            err.reason.to_string().contains("reads only offsets"),
            "{}",
            err.reason
        );
        // Nothing was queued.
        let mut done = Vec::new();
        ex.poll(&mut done).expect("poll");
        assert!(done.is_empty());
    }
}
