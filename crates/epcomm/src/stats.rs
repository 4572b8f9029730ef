//! Per-op wait attribution (who was late), from the stats block the kernels fill.
//!
//! Each GPU's `%globaltimer` has its own offset (we measured ~0.4–1.4 ms between the two GPUs
//! of one host), so start times are **not** compared across GPUs. Instead every rank measures,
//! on its own clock, how long after its start each peer's counts (or barrier arrival) and data
//! were complete; [`crate::Buffer::last_op_stats`] all-gathers these waits, and the late rank is
//! the one the others waited for longest.

use std::fmt;
use std::time::Duration;

use epcomm_kernels::abi;

/// Word indices of the stats block: the ABI's `kStat*` (`abi::STAT_*`, from
/// `kernels/common/abi.cuh`), as indices.
pub(crate) mod word {
    use epcomm_kernels::abi;

    /// An ABI word index as a slice index (a negative one fails to compile).
    const fn index(word: i32) -> usize {
        assert!(word >= 0, "a stats word index is not negative");
        word as usize
    }

    pub const OP_SEQ: usize = index(abi::STAT_OP_SEQ);
    pub const START: usize = index(abi::STAT_START);
    pub const COUNTS_READY: usize = index(abi::STAT_COUNTS_READY);
    pub const SENT: usize = index(abi::STAT_SENT);
    pub const END: usize = index(abi::STAT_END);
    pub const KIND: usize = index(abi::STAT_KIND);
    pub const WORLD: usize = index(abi::STAT_WORLD);
    pub const PEERS: usize = index(abi::STAT_PEERS);
}

/// One op kind of the ABI (`abi::op`): its name in errors and stats, and which words can hold
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpKind {
    /// The `abi::op` value.
    pub kind: u32,
    /// The op's name (the two phases of a low-latency op share their op's).
    pub name: &'static str,
    /// Its kernel ends by writing the stats block (`finish_stats` in
    /// `kernels/common/stats.cuh`), so the stats word [`word::KIND`] can hold it.
    pub in_stats: bool,
    /// An intent word (\[A1\]) can carry it: a receive phase publishes its send phase's kind,
    /// the layout kernel none.
    pub in_intent: bool,
}

/// Every op kind of the ABI. Its length is `abi::op::ALL`'s, so a kind added to the ABI does not
/// compile until it is named here (and the tests check each ABI kind has its entry).
pub(crate) const OP_KINDS: [OpKind; abi::op::ALL.len()] = {
    use abi::op;
    const fn named(kind: u32, name: &'static str, in_stats: bool, in_intent: bool) -> OpKind {
        OpKind {
            kind,
            name,
            in_stats,
            in_intent,
        }
    }
    [
        named(op::LAYOUT, "layout", false, false),
        named(op::DISPATCH, "dispatch", true, true),
        named(op::CACHED_DISPATCH, "cached dispatch", true, true),
        named(op::COMBINE, "combine", true, true),
        named(op::LL_DISPATCH, "low-latency dispatch", false, true),
        named(op::LL_DISPATCH_RECV, "low-latency dispatch", true, false),
        named(op::LL_COMBINE, "low-latency combine", false, true),
        named(op::LL_COMBINE_RECV, "low-latency combine", true, false),
    ]
};

impl OpKind {
    /// The entry of `kind`; `None` for a value the ABI does not define.
    pub(crate) fn of(kind: u32) -> Option<Self> {
        OP_KINDS.iter().copied().find(|o| o.kind == kind)
    }
}

/// Timing of the last op, as seen by every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpStats {
    /// Op name.
    pub op: &'static str,
    /// Op sequence number.
    pub op_seq: u64,
    /// This rank.
    pub rank: usize,
    /// This rank's kernel time.
    pub total: Duration,
    /// This rank's time until its own sends were done.
    pub sending: Duration,
    /// Dispatch only: this rank's time from its start until every peer's counts had arrived
    /// and its receive count was known (the count exchange, "notify"); `None` for other ops.
    pub counts_ready: Option<Duration>,
    /// `waits[q][p]`: how long after rank `q` started the op everything it needed from rank
    /// `p` (counts or barrier arrival, and data) was there (zero: nothing waited for).
    pub waits: Vec<Vec<Duration>>,
    /// The world rank of each index above (`rank`, `q`, `p` and [`Self::late_rank`] index the
    /// buffer's group: the world itself, or one tier's rail or node group).
    pub ranks: Vec<usize>,
}

/// What one rank measured, on its own clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LocalStats {
    pub op: &'static str,
    pub op_seq: u64,
    pub total: Duration,
    pub sending: Duration,
    pub counts_ready: Option<Duration>,
    pub waits: Vec<Duration>,
}

impl LocalStats {
    pub(crate) fn from_words(w: &[u64]) -> Option<Self> {
        let world = usize::try_from(*w.get(word::WORLD)?).ok()?;
        let peers = w.get(word::PEERS..word::PEERS + 3 * world)?;
        let kind = w[word::KIND];
        let op = u32::try_from(kind)
            .ok()
            .and_then(OpKind::of)
            .filter(|o| o.in_stats)?
            .name;
        let start = w[word::START];
        let since = |t: u64| Duration::from_nanos(t.saturating_sub(start));
        let waits = (0..world)
            .map(|p| since(peers[world + p].max(peers[2 * world + p])))
            .collect();
        // Only a normal dispatch writes the word; an older op's stamp (before this start, or
        // after this end) is not this op's.
        let ready = w[word::COUNTS_READY];
        let counts_ready =
            (kind == u64::from(abi::op::DISPATCH) && ready >= start && ready <= w[word::END])
                .then(|| since(ready));
        Some(Self {
            op,
            op_seq: w[word::OP_SEQ],
            total: since(w[word::END]),
            sending: since(w[word::SENT]),
            counts_ready,
            waits,
        })
    }

    /// Wire form for the all-gather: op_seq, then one u64 of nanoseconds per peer.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = self.op_seq.to_le_bytes().to_vec();
        for w in &self.waits {
            v.extend_from_slice(&(w.as_nanos() as u64).to_le_bytes());
        }
        v
    }

    /// Decodes a peer's wire form; None if malformed or from another op.
    pub(crate) fn decode_waits(bytes: &[u8], op_seq: u64, world: usize) -> Option<Vec<Duration>> {
        if bytes.len() != 8 * (world + 1) {
            return None;
        }
        let word =
            |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        (word(0) == op_seq).then(|| (1..=world).map(|i| Duration::from_nanos(word(i))).collect())
    }
}

impl OpStats {
    /// The rank the others waited for longest (this rank if nobody waited).
    pub fn late_rank(&self) -> usize {
        (0..self.waits.len())
            .max_by_key(|&p| (self.waited_on(p), std::cmp::Reverse(p)))
            .unwrap_or(self.rank)
    }

    /// How long the others waited for the late rank (the longest wait).
    pub fn skew(&self) -> Duration {
        self.waited_on(self.late_rank())
    }

    /// Longest time any other rank waited for `peer`.
    pub fn waited_on(&self, peer: usize) -> Duration {
        self.waits
            .iter()
            .enumerate()
            .filter(|(q, _)| *q != peer)
            .filter_map(|(_, row)| row.get(peer).copied())
            .max()
            .unwrap_or_default()
    }

    /// The world rank of group index `i` (`i` itself when out of range).
    pub fn world_rank(&self, i: usize) -> usize {
        self.ranks.get(i).copied().unwrap_or(i)
    }

    /// How long this rank waited for `peer`.
    pub fn waited_for(&self, peer: usize) -> Duration {
        self.waits
            .get(self.rank)
            .and_then(|r| r.get(peer))
            .copied()
            .unwrap_or_default()
    }
}

impl fmt::Display for OpStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} #{} on rank {}: {:?} total ({:?} sending); late rank {} (others waited up to {:?} for it)",
            self.op,
            self.op_seq,
            self.world_rank(self.rank),
            self.total,
            self.sending,
            self.world_rank(self.late_rank()),
            self.skew()
        )?;
        for p in 0..self.waits.len() {
            writeln!(
                f,
                "  others waited up to {:?} for rank {}",
                self.waited_on(p),
                self.world_rank(p)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(world: usize, count: &[u64], data: &[u64]) -> Vec<u64> {
        let mut w = vec![0u64; word::PEERS + 3 * world];
        w[word::OP_SEQ] = 5;
        w[word::START] = 1_000;
        w[word::SENT] = 2_000;
        w[word::END] = 300_000;
        w[word::KIND] = abi::op::DISPATCH.into();
        w[word::WORLD] = world as u64;
        w[word::PEERS + world..word::PEERS + 2 * world].copy_from_slice(count);
        w[word::PEERS + 2 * world..].copy_from_slice(data);
        w
    }

    #[test]
    fn local_waits_use_only_this_gpus_clock() {
        let l = LocalStats::from_words(&words(3, &[1_100, 201_000, 0], &[2_100, 250_000, 2_200]))
            .unwrap();
        assert_eq!(
            l.waits,
            vec![
                Duration::from_nanos(1_100),
                Duration::from_nanos(249_000),
                Duration::from_nanos(1_200)
            ]
        );
        assert_eq!(l.total, Duration::from_nanos(299_000));
        // The word was never written (0, before the start): not this op's.
        assert_eq!(l.counts_ready, None);
        let mut w = words(3, &[0; 3], &[0; 3]);
        w[word::COUNTS_READY] = 51_000;
        let ready = LocalStats::from_words(&w).unwrap().counts_ready;
        assert_eq!(ready, Some(Duration::from_nanos(50_000)));
        // Stamped after the op ended (a later op's), or an op without a count exchange.
        w[word::COUNTS_READY] = 300_001;
        assert_eq!(LocalStats::from_words(&w).unwrap().counts_ready, None);
        w[word::COUNTS_READY] = 51_000;
        w[word::KIND] = abi::op::COMBINE.into();
        assert_eq!(LocalStats::from_words(&w).unwrap().counts_ready, None);
        let wire = l.encode();
        assert_eq!(LocalStats::decode_waits(&wire, 5, 3), Some(l.waits.clone()));
        assert_eq!(
            LocalStats::decode_waits(&wire, 6, 3),
            None,
            "another op's waits are refused"
        );
        assert_eq!(LocalStats::decode_waits(&wire[1..], 5, 3), None);
        let mut w = words(3, &[0; 3], &[0; 3]);
        w[word::KIND] = 99;
        assert!(LocalStats::from_words(&w).is_none());
    }

    /// Every op kind the ABI defines has exactly one entry (a name, and whether the stats and
    /// intent words can hold it), and the stats block decodes by it: a kind added to
    /// `kernels/common/abi.cuh` without an entry here fails (to compile, or here).
    #[test]
    fn every_abi_op_kind_is_named_and_decoded() {
        let kinds: Vec<u32> = OP_KINDS.iter().map(|o| o.kind).collect();
        assert_eq!(
            kinds,
            abi::op::ALL,
            "one entry per ABI op kind, in ABI order"
        );
        for kind in abi::op::ALL {
            let entry = OpKind::of(kind).unwrap_or_else(|| panic!("op kind {kind} has no name"));
            assert!(!entry.name.is_empty(), "op kind {kind}");
            let mut w = words(2, &[0; 2], &[0; 2]);
            w[word::KIND] = kind.into();
            let decoded = LocalStats::from_words(&w).map(|l| l.op);
            assert_eq!(
                decoded,
                entry.in_stats.then_some(entry.name),
                "stats of op kind {kind}"
            );
        }
        // A value no ABI kind has: no entry, no stats.
        let unknown = (0..).find(|k| !abi::op::ALL.contains(k)).unwrap_or(0);
        assert_eq!(OpKind::of(unknown), None);
        // The kinds the kernels write into the stats block (`finish_stats`) keep their names.
        let stats: Vec<(u32, &str)> = OP_KINDS
            .iter()
            .filter(|o| o.in_stats)
            .map(|o| (o.kind, o.name))
            .collect();
        assert_eq!(
            stats,
            [
                (abi::op::DISPATCH, "dispatch"),
                (abi::op::CACHED_DISPATCH, "cached dispatch"),
                (abi::op::COMBINE, "combine"),
                (abi::op::LL_DISPATCH_RECV, "low-latency dispatch"),
                (abi::op::LL_COMBINE_RECV, "low-latency combine")
            ]
        );
    }

    /// The word indices are the kernels' (`kStat*` of `kernels/common/abi.cuh`).
    #[test]
    fn stats_words_are_the_abi_ones() {
        let probe = |name: &str| {
            abi::EXPECTED_PROBE
                .iter()
                .find(|(n, _)| *n == name)
                .map(|&(_, v)| v as usize)
        };
        for (name, index) in [
            ("kStatOpSeq", word::OP_SEQ),
            ("kStatStart", word::START),
            ("kStatCountsReady", word::COUNTS_READY),
            ("kStatSent", word::SENT),
            ("kStatEnd", word::END),
            ("kStatKind", word::KIND),
            ("kStatWorld", word::WORLD),
            ("kStatPeers", word::PEERS),
        ] {
            assert_eq!(probe(name), Some(index), "{name}");
        }
        // The per-peer words fit below the intent words of the stats region.
        assert!(8 * (word::PEERS + 3 * abi::MAX_WORLD) <= abi::STATS_INTENT_OFFSET as usize);
    }

    #[test]
    fn names_the_rank_the_others_waited_for() {
        let us = Duration::from_micros;
        // Rank 1 was late: ranks 0 and 2 waited ~200 us for it; it waited for nobody.
        let s = OpStats {
            op: "dispatch",
            op_seq: 3,
            rank: 1,
            total: us(10),
            sending: us(5),
            counts_ready: Some(us(2)),
            waits: vec![
                vec![us(0), us(210), us(3)],
                vec![us(1), us(0), us(1)],
                vec![us(2), us(205), us(0)],
            ],
            ranks: vec![0, 1, 2],
        };
        assert_eq!(s.late_rank(), 1);
        assert_eq!(s.skew(), us(210));
        assert_eq!(s.waited_for(0), us(1));
        assert!(s.to_string().contains("late rank 1"));
    }
}
