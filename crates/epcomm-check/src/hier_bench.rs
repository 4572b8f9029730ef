//! DeepEP's internode metrics for the two-tier ops ([`epcomm::HierarchicalBuffer`], timed by
//! [`crate::timing::Timer`] as a flat buffer is).
//!
//! DeepEP's internode benchmark reports two bandwidths per op: **RDMA** (the bytes a rank
//! puts on the inter-node network) and **NVL** (the bytes that move inside a node). Here:
//!
//! * **rail** bytes: the rows this rank sends over the rail (one per token and *other* node
//!   holding one of its experts, [`epcomm_reference::rail_traffic`]) × the row's bytes; for
//!   combine, the partial rows it sends back over the rail (bf16 rows);
//! * **NVLink** bytes: the rows this rank sends to the *other* ranks of its node × the row's
//!   bytes. In dispatch these are the rail-received rows it forwards plus its own tokens for
//!   the other ranks of its node (the hierarchical path forwards those too: the source is its
//!   own node's rail peer); in combine, the rows it returns to their forwarders (one per row it
//!   received over NVLink in dispatch);
//! * **flat** bytes: the flat bench's metric, the rows this rank receives (self included) ×
//!   the row's bytes.
//!
//! Row bytes are DeepEP's: `hidden * 2` for BF16 rows, `hidden * (1 + 4/128)` for FP8 rows
//! ([`BenchOp::metric_bytes`]); top-k ids, weights and source indices are not counted.

use epcomm_reference::{Tiers, layout, rail_traffic};

use crate::Result;
use crate::timing::BenchOp;

/// A hierarchical op to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HierOp {
    /// Hierarchical BF16 dispatch (both tiers' layouts and count exchanges included).
    DispatchBf16,
    /// Hierarchical FP8 dispatch.
    DispatchFp8,
    /// Hierarchical cached BF16 dispatch (no count exchange in either tier).
    CachedDispatchBf16,
    /// Hierarchical BF16 combine (node combine into bf16 partials, then rail combine).
    Combine,
}

impl HierOp {
    /// Every op, in report order.
    pub const ALL: [HierOp; 4] = [
        Self::DispatchFp8,
        Self::DispatchBf16,
        Self::CachedDispatchBf16,
        Self::Combine,
    ];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::DispatchBf16 => "hier dispatch BF16",
            Self::DispatchFp8 => "hier dispatch FP8",
            Self::CachedDispatchBf16 => "hier cached dispatch BF16",
            Self::Combine => "hier combine BF16",
        }
    }

    /// Stable id (JSON / CSV).
    pub fn id(self) -> &'static str {
        match self {
            Self::DispatchBf16 => "hier_dispatch_bf16",
            Self::DispatchFp8 => "hier_dispatch_fp8",
            Self::CachedDispatchBf16 => "hier_cached_dispatch_bf16",
            Self::Combine => "hier_combine_bf16",
        }
    }

    /// The op of [`Self::id`], if any.
    pub fn from_id(id: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.id() == id)
    }

    /// The flat op moving the same rows (its row bytes are this op's).
    pub fn flat(self) -> BenchOp {
        match self {
            Self::DispatchBf16 => BenchOp::DispatchBf16,
            Self::DispatchFp8 => BenchOp::DispatchFp8,
            Self::CachedDispatchBf16 => BenchOp::CachedDispatchBf16,
            Self::Combine => BenchOp::Combine,
        }
    }

    /// Whether it moves FP8 rows.
    pub fn is_fp8(self) -> bool {
        self == Self::DispatchFp8
    }
}

/// The rows one rank moves on each tier in one hierarchical dispatch (and back in combine).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HierRows {
    /// Rows this rank receives in all (self included): the flat metric's rows.
    pub recv: u64,
    /// Dispatch: rows this rank sends over the rail.
    pub rail_sent: u64,
    /// Dispatch: rows this rank sends over NVLink to the other ranks of its node (forwarded
    /// rail rows and its own tokens).
    pub nvlink_sent: u64,
    /// Dispatch: rows this rank receives over NVLink from the other ranks of its node (it
    /// returns as many in combine).
    pub nvlink_received: u64,
    /// Combine: partial rows this rank sends back over the rail.
    pub combine_rail_sent: u64,
    /// Dispatch: rows this rank's rail stage writes, one per (token, node holding one of its
    /// experts), its own node included (a copy inside its own memory, which then goes
    /// through the node stage like a forwarded row). The combine's rail stage writes as many
    /// partials back.
    pub rail_stage: u64,
}

/// The rows a two-tier op writes over the rows the flat op writes, all ranks together: the
/// rail stage's ([`HierRows::rail_stage`]) plus the node stage's (every rank's received
/// rows, written once more), over the flat op's (every rank's received rows). Dispatch and
/// combine move the same rows in opposite directions, so one ratio serves both. Where all
/// ranks share one GPU's memory this is the floor of the two-tier op's time over the flat
/// op's for an op bound by memory bandwidth. `None` when no rank receives a row.
pub fn rows_written_ratio(rows: &[HierRows]) -> Option<f64> {
    let recv: u64 = rows.iter().map(|r| r.recv).sum();
    let rail: u64 = rows.iter().map(|r| r.rail_stage).sum();
    (recv > 0).then(|| (rail + recv) as f64 / recv as f64)
}

/// Bytes one op moves for one rank, by the three metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierBytes {
    /// Over the rail ("RDMA").
    pub rail: f64,
    /// Over NVLink inside the node.
    pub nvlink: f64,
    /// The flat metric: received bytes, self included.
    pub flat: f64,
}

impl HierRows {
    /// The rows `op` moves for this rank: (sent over the rail, sent over NVLink, received in
    /// all). Dispatch sends [`Self::rail_sent`] and [`Self::nvlink_sent`]; combine sends back
    /// [`Self::combine_rail_sent`] partials over the rail and [`Self::nvlink_received`] rows
    /// over NVLink.
    pub fn tier_rows(&self, op: HierOp) -> (u64, u64, u64) {
        match op {
            HierOp::Combine => (self.combine_rail_sent, self.nvlink_received, self.recv),
            _ => (self.rail_sent, self.nvlink_sent, self.recv),
        }
    }

    /// Bytes `op` moves for this rank with rows of `hidden` values (module docs).
    pub fn bytes(&self, op: HierOp, hidden: usize) -> TierBytes {
        let b = |rows: u64| op.flat().metric_bytes(rows as usize, hidden);
        let (rail, nvlink, recv) = self.tier_rows(op);
        TierBytes {
            rail: b(rail),
            nvlink: b(nvlink),
            flat: b(recv),
        }
    }
}

/// Every rank's [`HierRows`] for one routing: `topk_idx[r]` is rank `r`'s `[T_r][top_k]`
/// routing (`-1` = no expert), ranks `node * L + local` as in [`Tiers`].
///
/// A row reaches rank `r` from source `s` through the forwarder of `r`'s node with `s`'s local
/// rank (the source itself in its own node), so it crosses NVLink exactly when
/// `local(s) != local(r)`.
///
/// # Errors
/// As [`rail_traffic`] (empty routing, `top_k == 0`, tiers not matching the world, a routing
/// [`layout`] refuses), wrapped in [`crate::CheckError::Reference`].
pub fn hier_rows<I: AsRef<[i64]>>(
    topk_idx: &[I],
    top_k: usize,
    num_experts: usize,
    tiers: Tiers,
) -> Result<Vec<HierRows>> {
    let traffic = rail_traffic(topk_idx, top_k, num_experts, tiers)?;
    let (world, l) = (topk_idx.len(), tiers.local_ranks());
    let mut out: Vec<HierRows> = traffic
        .iter()
        .map(|t| HierRows {
            rail_sent: t.dispatch_rail_sent,
            nvlink_sent: t.dispatch_forwarded + t.dispatch_direct_nvlink,
            combine_rail_sent: t.combine_rail_sent,
            ..HierRows::default()
        })
        .collect();
    // rail_traffic checked this routing: experts divide over the ranks, ids are -1 or valid.
    let experts_per_node = num_experts / tiers.nodes();
    for (s, idx) in topk_idx.iter().enumerate() {
        let idx = idx.as_ref();
        let lay = layout(idx, idx.len() / top_k, top_k, num_experts, world, l)?;
        for (r, rows) in out.iter_mut().enumerate() {
            let n = u64::from(lay.tokens_per_rank[r]);
            rows.recv += n;
            if r % l != s % l {
                rows.nvlink_received += n;
            }
        }
        let mut nodes = Vec::with_capacity(top_k);
        for token in idx.chunks(top_k) {
            nodes.clear();
            nodes.extend(
                token
                    .iter()
                    .filter_map(|&e| usize::try_from(e).ok())
                    .map(|e| e / experts_per_node),
            );
            nodes.sort_unstable();
            nodes.dedup();
            out[s].rail_stage += nodes.len() as u64;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CheckError;

    /// The routing of epcomm-reference's rail-traffic tests (its doc says where each token goes).
    fn routing() -> Vec<Vec<i64>> {
        epcomm_reference::two_node_example_routing()
    }

    fn rows(recv: u64, rail: u64, nvl_sent: u64, nvl_recv: u64, back: u64) -> HierRows {
        HierRows {
            recv,
            rail_sent: rail,
            nvlink_sent: nvl_sent,
            nvlink_received: nvl_recv,
            combine_rail_sent: back,
            rail_stage: 0,
        }
    }

    /// `rows` with the rail stage's rows set.
    fn staged(rail_stage: u64, r: HierRows) -> HierRows {
        HierRows { rail_stage, ..r }
    }

    #[test]
    fn rows_per_tier_by_hand() {
        let got = hier_rows(&routing(), 3, 4, Tiers::new(2, 2).unwrap()).unwrap();
        // Rank 0 receives its tokens 0 and 2 (kept) and rank 3's token 0, forwarded by rank 1
        // (local rank 1 in node 0): one NVLink row. It sends 2 rows over the rail (to rank 2)
        // and token 1 to rank 1 over NVLink.
        // Rank 1 receives rank 0's token 1 (NVLink) and rank 3's token 0 over the rail (kept,
        // and forwarded to rank 0): it sends 1 NVLink row, 1 partial back over the rail.
        // Rank 2 receives rank 0's tokens 0 and 2 over the rail (kept, forwarded to rank 3).
        // Rank 3 receives those 2 (NVLink from rank 2) and its own token 0; it sends that
        // token over the rail once (to rank 1).
        assert_eq!(
            got,
            vec![
                // Rank 0's rail stage: tokens 0 and 2 to both nodes, token 1 to its own.
                staged(5, rows(3, 2, 1, 1, 0)),
                rows(2, 0, 1, 1, 1),
                rows(2, 0, 2, 0, 2),
                // Rank 3's token 0 reaches experts in both nodes.
                staged(2, rows(3, 1, 0, 2, 0)),
            ]
        );
        // The rail stage writes 7 rows, the node stage the 10 received ones; flat writes 10.
        assert_eq!(rows_written_ratio(&got), Some(1.7));
        // Every NVLink row sent is received once.
        let sent: u64 = got.iter().map(|r| r.nvlink_sent).sum();
        let received: u64 = got.iter().map(|r| r.nvlink_received).sum();
        assert_eq!(sent, received);
    }

    #[test]
    fn one_rank_per_node_has_no_nvlink_and_one_node_no_rail() {
        let rail_only = hier_rows(&routing(), 3, 4, Tiers::new(4, 1).unwrap()).unwrap();
        assert!(
            rail_only
                .iter()
                .all(|r| r.nvlink_sent == 0 && r.nvlink_received == 0)
        );
        // With one rank per node every row from another rank crosses the rail.
        assert_eq!(
            rail_only.iter().map(|r| r.rail_sent).sum::<u64>(),
            // rank 0: tokens 0, 2 to ranks 2, 3 and token 1 to rank 1; rank 3: to 0 and 1.
            2 * 2 + 1 + 2
        );
        // One rank per node: the rail stage writes what flat writes, and the node stage
        // writes every row once more (a copy inside each rank's memory).
        assert_eq!(
            rail_only.iter().map(|r| r.rail_stage).sum::<u64>(),
            rail_only.iter().map(|r| r.recv).sum::<u64>()
        );
        assert_eq!(rows_written_ratio(&rail_only), Some(2.0));
        assert_eq!(rows_written_ratio(&[HierRows::default()]), None);
        let one_node = hier_rows(&routing(), 3, 4, Tiers::new(1, 4).unwrap()).unwrap();
        assert!(
            one_node
                .iter()
                .all(|r| r.rail_sent == 0 && r.combine_rail_sent == 0)
        );
        // Flat receive counts do not depend on the tiers.
        let recv = |v: &[HierRows]| v.iter().map(|r| r.recv).collect::<Vec<_>>();
        assert_eq!(recv(&rail_only), recv(&one_node));
        assert_eq!(recv(&one_node), vec![3, 2, 2, 3]);
    }

    #[test]
    fn bytes_per_op() {
        let r = rows(10, 4, 3, 2, 5);
        let h = 128;
        let d = r.bytes(HierOp::DispatchBf16, h);
        assert_eq!((d.rail, d.nvlink, d.flat), (1024.0, 768.0, 2560.0));
        assert_eq!(r.bytes(HierOp::CachedDispatchBf16, h), d);
        // FP8: one byte per value plus a 4-byte scale per 128 values.
        let f = r.bytes(HierOp::DispatchFp8, h);
        assert_eq!(
            (f.rail, f.nvlink, f.flat),
            (4.0 * 132.0, 3.0 * 132.0, 1320.0)
        );
        // Combine: the partials sent back over the rail, the rows returned over NVLink.
        let c = r.bytes(HierOp::Combine, h);
        assert_eq!((c.rail, c.nvlink, c.flat), (1280.0, 512.0, 2560.0));
        assert_eq!(r.tier_rows(HierOp::Combine), (5, 2, 10));
        assert_eq!(r.tier_rows(HierOp::DispatchFp8), (4, 3, 10));
    }

    #[test]
    fn ids_round_trip() {
        for op in HierOp::ALL {
            assert_eq!(HierOp::from_id(op.id()), Some(op));
            assert!(op.name().starts_with("hier "));
        }
        assert_eq!(HierOp::from_id("dispatch_bf16"), None);
    }

    #[test]
    fn errors_are_the_references() {
        assert!(matches!(
            hier_rows(&routing(), 3, 4, Tiers::new(3, 2).unwrap()),
            Err(CheckError::Reference(_))
        ));
        let mut bad = routing();
        bad[3][1] = 4;
        assert!(matches!(
            hier_rows(&bad, 3, 4, Tiers::new(2, 2).unwrap()),
            Err(CheckError::Reference(_))
        ));
    }
}
