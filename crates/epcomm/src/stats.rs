//! Per-op wait attribution (who was late), read from the stats block the kernels fill.

use std::fmt;
use std::time::Duration;

/// Word indices of the stats block (mirrors `kStat*` in intranode.cu).
pub(crate) mod word {
    pub const OP_SEQ: usize = 0;
    pub const START: usize = 1;
    pub const SENT: usize = 3;
    pub const END: usize = 4;
    pub const KIND: usize = 5;
    pub const WORLD: usize = 6;
    pub const PEERS: usize = 8;
}

/// Timing of the last op on this rank, per peer. Timestamps are `%globaltimer` nanoseconds of
/// each GPU; on one host they share a time base, so start stamps compare across ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpStats {
    /// Op name.
    pub op: &'static str,
    /// Op sequence number.
    pub op_seq: u64,
    /// This rank.
    pub rank: usize,
    /// When this rank's kernel started.
    pub start_ns: u64,
    /// When block 0 finished sending.
    pub sent_ns: u64,
    /// When block 0 finished.
    pub end_ns: u64,
    /// When each rank (this one included) started the same op.
    pub peer_start_ns: Vec<u64>,
    /// When each peer's count row was seen here (0: not waited for in this op).
    pub count_arrival_ns: Vec<u64>,
    /// When each peer's data was complete here (0: not waited for).
    pub data_arrival_ns: Vec<u64>,
}

impl OpStats {
    pub(crate) fn from_words(w: &[u64], rank: usize) -> Option<Self> {
        let world = usize::try_from(*w.get(word::WORLD)?).ok()?;
        let peers = w.get(word::PEERS..word::PEERS + 3 * world)?;
        let op = match w[word::KIND] {
            2 => "dispatch",
            3 => "cached dispatch",
            4 => "combine",
            _ => return None,
        };
        Some(Self {
            op,
            op_seq: w[word::OP_SEQ],
            rank,
            start_ns: w[word::START],
            sent_ns: w[word::SENT],
            end_ns: w[word::END],
            peer_start_ns: peers[..world].to_vec(),
            count_arrival_ns: peers[world..2 * world].to_vec(),
            data_arrival_ns: peers[2 * world..].to_vec(),
        })
    }

    /// The rank that started this op last (the one everybody waited for).
    pub fn late_rank(&self) -> usize {
        (0..self.peer_start_ns.len())
            .max_by_key(|&r| self.peer_start_ns[r])
            .unwrap_or(self.rank)
    }

    /// How much later the late rank started than the earliest one.
    pub fn skew(&self) -> Duration {
        let max = self.peer_start_ns.iter().copied().max().unwrap_or(0);
        let min = self.peer_start_ns.iter().copied().min().unwrap_or(0);
        Duration::from_nanos(max - min)
    }

    /// Time from this rank's start until everything it needed from `peer` in this op (counts
    /// and data) had arrived; zero if it waited for nothing from `peer`.
    pub fn waited_for(&self, peer: usize) -> Duration {
        let counts = self.count_arrival_ns.get(peer).copied().unwrap_or(0);
        let data = self.data_arrival_ns.get(peer).copied().unwrap_or(0);
        Duration::from_nanos(counts.max(data).saturating_sub(self.start_ns))
    }

    /// Kernel time on this rank.
    pub fn total(&self) -> Duration {
        Duration::from_nanos(self.end_ns.saturating_sub(self.start_ns))
    }
}

impl fmt::Display for OpStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} #{} on rank {}: {:?} total, late rank {} (skew {:?})",
            self.op,
            self.op_seq,
            self.rank,
            self.total(),
            self.late_rank(),
            self.skew()
        )?;
        let min = self.peer_start_ns.iter().copied().min().unwrap_or(0);
        for p in 0..self.peer_start_ns.len() {
            writeln!(
                f,
                "  rank {p}: started +{:?}, its counts/data complete here after {:?}",
                Duration::from_nanos(self.peer_start_ns[p] - min),
                self.waited_for(p)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_rank_that_started_last() {
        let mut w = vec![0u64; 8 + 9];
        w[word::OP_SEQ] = 5;
        w[word::START] = 1_000;
        w[word::SENT] = 2_000;
        w[word::END] = 300_000;
        w[word::KIND] = 2;
        w[word::WORLD] = 3;
        w[8..11].copy_from_slice(&[1_000, 201_000, 1_500]);
        w[14..17].copy_from_slice(&[2_100, 250_000, 2_200]);
        let s = OpStats::from_words(&w, 0).unwrap();
        assert_eq!(s.late_rank(), 1);
        assert_eq!(s.skew(), Duration::from_micros(200));
        assert_eq!(s.waited_for(1), Duration::from_nanos(249_000));
        assert_eq!(s.waited_for(0), Duration::from_nanos(1_100));
        assert!(s.to_string().contains("late rank 1"));
        w[word::KIND] = 99;
        assert!(OpStats::from_words(&w, 0).is_none());
    }
}
