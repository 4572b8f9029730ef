//! The rail ring of the normal dispatch's forwarding as the kernel builds it (one put per
//! entry, kernels/intranode/forward.cuh), checked by exploring every interleaving of one
//! sender and one forwarder over several ops.
//!
//! The chunk-level model ([`crate::model`], `internode_ring.rs`) signals once per chunk and
//! starts every op on a fresh chunk. The kernel does neither:
//! * an entry lands by its own put, whose signal adds 1 to its slot's `landed` count;
//! * entries are numbered since setup, so an op may end inside a chunk and the next op
//!   continues it;
//! * a forwarder block takes a chunk (one slot's entries of one lap, cut at the op's ends) once
//!   the slot's count reaches the chunk's last entry, reads the entries, and **sets** the
//!   slot's `freed` word to the entries freed there.
//!
//! The count says how many entries landed, not which ones, so a forwarder that reads a chunk
//! must be sure that no entry of a later lap of the slot landed in its place: which depends on
//! how long a sender waits before putting an entry ([`SenderRule`]). [`explore`] tries every
//! order in which the sender may put an op's entries and the forwarder's blocks may take
//! their chunks, and reports a read of an entry that has not landed yet, or a state from which
//! nothing can move.

use std::collections::HashSet;

/// How long the sender of the entry at index `k` of its slot (entries ever placed there)
/// waits, on the slot's `freed` word, before putting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenderRule {
    /// Until the entry that held its position a lap earlier (`k - C`) is freed: the first
    /// build's rule, unsound once an op ends inside a chunk.
    PositionFreed,
    /// Until the slot's whole chunk of the previous lap is freed (`freed >= k / C * C`): the
    /// kernel's rule.
    ChunkFreed,
}

/// One explored configuration: a ring of `slots` slots of `chunk` entries, a forwarder of
/// `blocks` blocks (block `b` takes the op's chunks `b`, `b + blocks`, ... in order), and the
/// entries the sender puts in each op, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingCase {
    /// Slots of the ring (`R`).
    pub slots: u64,
    /// Entries per slot (`C`).
    pub chunk: u64,
    /// Forwarder blocks.
    pub blocks: u64,
    /// Entries of each op (each at most 64).
    pub ops: Vec<u64>,
}

/// What [`explore`] found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingFault {
    /// A forwarder block read the chunk holding entry `entry` (of op `op`) while its position
    /// held entry `found` (`None`: nothing yet).
    EarlyRead {
        /// The op.
        op: usize,
        /// The entry the chunk needs (numbered since setup).
        entry: u64,
        /// What its position held.
        found: Option<u64>,
    },
    /// No action can run and the ops are not finished.
    Stuck {
        /// The sender's op.
        sender_op: usize,
        /// The forwarder's op.
        forwarder_op: usize,
    },
}

/// The explored states (distinct), when nothing was wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Explored {
    /// Distinct states visited.
    pub states: usize,
}

/// Where entry `g` lives: (position, slot, index among the entries ever placed in the slot),
/// as the kernel's `RingPos`.
fn ring_pos(g: u64, slots: u64, chunk: u64) -> (usize, usize, u64) {
    let rc = slots * chunk;
    let pos = g % rc;
    (
        pos as usize,
        (pos / chunk) as usize,
        g / rc * chunk + pos % chunk,
    )
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    /// The op the sender puts, and its entries not yet put (bit j: entry j of the op).
    sender_op: usize,
    unsent: u64,
    /// The op the forwarder takes, and each block's next chunk (absolute chunk number).
    forwarder_op: usize,
    next_chunk: Vec<u64>,
    landed: Vec<u64>,
    freed: Vec<u64>,
    /// The entry each position holds.
    content: Vec<Option<u64>>,
}

struct Ops {
    first: Vec<u64>,
    count: Vec<u64>,
}

impl RingCase {
    fn ops(&self) -> Ops {
        let mut first = Vec::with_capacity(self.ops.len());
        let mut g = 0;
        for &n in &self.ops {
            first.push(g);
            g += n;
        }
        Ops {
            first,
            count: self.ops.clone(),
        }
    }

    /// The forwarder's chunk numbers of op `i`: `c0 ..= c1` (empty when it has no entries).
    fn chunks(&self, ops: &Ops, i: usize) -> Option<(u64, u64)> {
        let (g0, n) = (ops.first[i], ops.count[i]);
        (n > 0).then(|| (g0 / self.chunk, (g0 + n - 1) / self.chunk))
    }

    fn start_forwarder_op(&self, ops: &Ops, s: &mut State) {
        let c0 = self.chunks(ops, s.forwarder_op).map_or(0, |(c0, _)| c0);
        s.next_chunk = (0..self.blocks).map(|b| c0 + b).collect();
    }

    fn forwarder_op_done(&self, ops: &Ops, s: &State) -> bool {
        match self.chunks(ops, s.forwarder_op) {
            None => true,
            Some((_, c1)) => s.next_chunk.iter().all(|&c| c > c1),
        }
    }
}

fn full_mask(n: u64) -> u64 {
    if n == 64 { u64::MAX } else { (1u64 << n) - 1 }
}

/// Once the sender's op has nothing left to put, it moves to the next op with entries (its
/// kernel ends once its puts completed; an op without entries puts nothing).
fn next_sender_op(case: &RingCase, s: &mut State) {
    while s.unsent == 0 && s.sender_op < case.ops.len() {
        s.sender_op += 1;
        s.unsent = case.ops.get(s.sender_op).map_or(0, |&n| full_mask(n));
    }
}

/// Explores every interleaving of `case` under `rule`.
///
/// # Errors
/// The first [`RingFault`] found.
///
/// # Panics
/// When an op has more than 64 entries or a size is 0 (a test's mistake).
pub fn explore(case: &RingCase, rule: SenderRule) -> Result<Explored, RingFault> {
    assert!(case.slots > 0 && case.chunk > 0 && case.blocks > 0);
    assert!(case.ops.iter().all(|&n| n <= 64));
    let ops = case.ops();
    let nops = case.ops.len();
    let positions = (case.slots * case.chunk) as usize;
    let mut start = State {
        sender_op: 0,
        unsent: case.ops.first().map_or(0, |&n| full_mask(n)),
        forwarder_op: 0,
        next_chunk: Vec::new(),
        landed: vec![0; case.slots as usize],
        freed: vec![0; case.slots as usize],
        content: vec![None; positions],
    };
    next_sender_op(case, &mut start);
    if nops > 0 {
        case.start_forwarder_op(&ops, &mut start);
    }
    let mut seen = HashSet::new();
    let mut todo = vec![start];
    while let Some(s) = todo.pop() {
        if !seen.insert(s.clone()) {
            continue;
        }
        if s.sender_op == nops && s.forwarder_op == nops {
            continue;
        }
        let mut moved = false;
        // The sender puts any entry of its op that its rule lets go.
        if s.sender_op < nops {
            for j in 0..case.ops[s.sender_op] {
                if s.unsent & (1 << j) == 0 {
                    continue;
                }
                let g = ops.first[s.sender_op] + j;
                let (pos, slot, k) = ring_pos(g, case.slots, case.chunk);
                let needed = match rule {
                    SenderRule::PositionFreed => (k + 1).saturating_sub(case.chunk),
                    SenderRule::ChunkFreed => k / case.chunk * case.chunk,
                };
                if s.freed[slot] < needed {
                    continue;
                }
                let mut t = s.clone();
                t.content[pos] = Some(g);
                t.landed[slot] += 1;
                t.unsent &= !(1 << j);
                next_sender_op(case, &mut t);
                todo.push(t);
                moved = true;
            }
        }
        // A forwarder block takes its next chunk once the slot's count reaches it; it may take
        // an op only once the sender began it (the op's node count comes with it).
        if s.forwarder_op < nops && s.forwarder_op <= s.sender_op {
            let i = s.forwarder_op;
            let (g0, g1) = (ops.first[i], ops.first[i] + ops.count[i]);
            if let Some((_, c1)) = case.chunks(&ops, i) {
                for b in 0..case.blocks as usize {
                    let c = s.next_chunk[b];
                    if c > c1 {
                        continue;
                    }
                    let (lo, hi) = (g0.max(c * case.chunk), g1.min((c + 1) * case.chunk));
                    let (_, slot, last_k) = ring_pos(hi - 1, case.slots, case.chunk);
                    if s.landed[slot] < last_k + 1 {
                        continue;
                    }
                    for g in lo..hi {
                        let (pos, _, _) = ring_pos(g, case.slots, case.chunk);
                        if s.content[pos] != Some(g) {
                            return Err(RingFault::EarlyRead {
                                op: i,
                                entry: g,
                                found: s.content[pos],
                            });
                        }
                    }
                    let mut t = s.clone();
                    t.freed[slot] = last_k + 1;
                    t.next_chunk[b] = c + case.blocks;
                    if case.forwarder_op_done(&ops, &t) {
                        t.forwarder_op += 1;
                        if t.forwarder_op < nops {
                            case.start_forwarder_op(&ops, &mut t);
                        }
                    }
                    todo.push(t);
                    moved = true;
                }
            } else {
                let mut t = s.clone();
                t.forwarder_op += 1;
                if t.forwarder_op < nops {
                    case.start_forwarder_op(&ops, &mut t);
                }
                todo.push(t);
                moved = true;
            }
        }
        if !moved {
            return Err(RingFault::Stuck {
                sender_op: s.sender_op,
                forwarder_op: s.forwarder_op,
            });
        }
    }
    Ok(Explored { states: seen.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(slots: u64, chunk: u64, blocks: u64, ops: &[u64]) -> RingCase {
        RingCase {
            slots,
            chunk,
            blocks,
            ops: ops.to_vec(),
        }
    }

    /// The first build's rule: an op of 3 entries in a ring of 2 × 2 ends inside a chunk of
    /// slot 1 (entries 2 and 3), and the next op's entry 6 (slot 1, next lap, its position
    /// freed) completes that chunk's count before entry 3 landed.
    #[test]
    fn waiting_for_the_position_alone_lets_a_forwarder_read_early() {
        let e = explore(&case(2, 2, 1, &[3, 5]), SenderRule::PositionFreed).unwrap_err();
        assert_eq!(
            e,
            RingFault::EarlyRead {
                op: 1,
                entry: 3,
                found: None
            }
        );
        // The kernel's rule on the same case.
        assert!(explore(&case(2, 2, 1, &[3, 5]), SenderRule::ChunkFreed).is_ok());
    }

    /// The kernel's rule, over every ring of up to 3 × 3, 1 to 3 blocks, and runs of ops that
    /// end inside chunks, on chunk ends, empty ops and ops longer than the ring: no early read,
    /// never stuck.
    #[test]
    fn waiting_for_the_whole_chunk_is_sound_and_never_stuck() {
        let runs: [&[u64]; 7] = [
            &[3, 3, 3],
            &[1, 2, 3, 1],
            &[5, 0, 4],
            &[2, 2, 2, 2],
            &[7, 1, 6],
            &[4, 4, 1],
            &[1, 1, 1, 1, 1],
        ];
        let (mut states, mut old_rule_faults) = (0, 0);
        for slots in 1..=3 {
            for chunk in 1..=3 {
                for blocks in 1..=3 {
                    for ops in runs {
                        let c = case(slots, chunk, blocks, ops);
                        match explore(&c, SenderRule::ChunkFreed) {
                            Ok(x) => states += x.states,
                            Err(e) => panic!("{c:?}: {e:?}"),
                        }
                        if explore(&c, SenderRule::PositionFreed).is_err() {
                            old_rule_faults += 1;
                        }
                    }
                }
            }
        }
        assert!(states > 10_000, "{states}");
        // The same sweep finds the first build's rule wrong in many of these cases.
        assert!(old_rule_faults > 20, "{old_rule_faults}");
    }

    /// With one entry per chunk the two rules are the same wait.
    #[test]
    fn with_chunks_of_one_entry_both_rules_are_sound() {
        for rule in [SenderRule::PositionFreed, SenderRule::ChunkFreed] {
            for blocks in 1..=2 {
                assert!(explore(&case(2, 1, blocks, &[3, 2, 3]), rule).is_ok());
            }
        }
    }
}
