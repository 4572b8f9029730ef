//! The rail rings of the fused internode op (`docs/protocol.md`, "Chunked forwarding"): their
//! shape, their bytes, and the shape a memory budget allows.
//!
//! Each rank holds, per other node, a ring of `slots` slots of `chunk_rows` dispatch rows (the
//! rows its rail peer there sends it to forward) and a ring as large of combine partials (the
//! partials that node's forwarder returns). Chunks are recycled as they are taken, so the rings
//! bound the rows in transit whatever a dispatch sends: an op of any size streams through
//! them, and a budget is refused only when it cannot hold a ring of one-row chunks.

use crate::{
    RailPrecision, Result, Tiers, TopologyError, combine_partial_row_bytes, dispatch_row_bytes,
};

/// Most slots of a ring the kernels keep (their `kMaxRingSlots`).
pub const MAX_RING_SLOTS: usize = 8;

/// Bytes of one entry of a forwarding ring (the kernels' `RingEntry`,
/// kernels/intranode/forward.cuh): a header of `1 + gpus_per_node` i32 (the token index, then
/// its row in each rank of the destination node) padded to 16 bytes, the row (`hidden * 2`
/// bytes, BF16 or FP8), `hidden / 128` f32 scales, then, 8-aligned, `top_k` i64 ids and
/// `top_k` f32 weights, the whole padded to 16 bytes.
pub fn ring_entry_bytes(gpus_per_node: usize, hidden: usize, top_k: usize) -> u64 {
    let up = |v: u64, m: u64| v.div_ceil(m) * m;
    let row = up(4 * (1 + gpus_per_node as u64), 16);
    let scales = row + 2 * hidden as u64;
    let ids = up(scales + 4 * (hidden as u64 / 128), 8);
    let weights = ids + 8 * top_k as u64;
    up(weights + 4 * top_k as u64, 16)
}

/// The shape of one rank's rail rings: per other node, `slots` slots of `chunk_rows` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RingShape {
    slots: usize,
    chunk_rows: usize,
}

impl RingShape {
    /// A ring of `slots` slots (2 or more to overlap a chunk's landing with the forwarding of
    /// the one before) of `chunk_rows` rows.
    ///
    /// # Errors
    /// [`TopologyError::Zero`] naming `slots` or `chunk_rows`.
    pub fn new(slots: usize, chunk_rows: usize) -> Result<Self> {
        TopologyError::zero_check("slots", slots)?;
        TopologyError::zero_check("chunk_rows", chunk_rows)?;
        Ok(Self { slots, chunk_rows })
    }

    /// Slots per ring.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Rows per chunk (an op's last chunk to a peer may hold fewer).
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    /// Rows of one rank's dispatch rings, `(nodes - 1) * slots * chunk_rows` (its partial
    /// rings hold as many partials).
    ///
    /// # Errors
    /// [`TopologyError::Overflow`].
    pub fn rows(&self, tiers: Tiers) -> Result<u64> {
        let what = "ring rows ((nodes - 1) * slots * chunk_rows)";
        [tiers.other_nodes(), self.slots, self.chunk_rows]
            .iter()
            .try_fold(1u64, |acc, &f| {
                acc.checked_mul(f as u64)
                    .ok_or(TopologyError::Overflow { what })
            })
    }

    /// Bytes of one rank's rings: [`Self::rows`] dispatch rows of [`dispatch_row_bytes`] and as
    /// many partials of [`combine_partial_row_bytes`].
    ///
    /// # Errors
    /// As those functions; [`TopologyError::Overflow`].
    pub fn bytes(
        &self,
        tiers: Tiers,
        hidden: usize,
        top_k: usize,
        precision: RailPrecision,
    ) -> Result<u64> {
        let per_row = row_pair_bytes(hidden, top_k, precision)?;
        self.rows(tiers)?
            .checked_mul(per_row)
            .ok_or(TopologyError::Overflow {
                what: "ring bytes (rows * (dispatch row + partial row))",
            })
    }

    /// The shape of `slots` slots with the largest chunk whose rings fit `budget_bytes`, at
    /// most `max_tokens_per_rank` rows (no op sends one peer more). With one node there are no
    /// rings and the chunk is `max_tokens_per_rank`.
    ///
    /// # Errors
    /// [`TopologyError::Zero`] naming `slots` or `max_tokens_per_rank`; those of
    /// [`Self::bytes`]; [`TopologyError::OverLimit`] when even chunks of one row do not fit:
    /// the budget cannot stream a dispatch at all.
    pub fn for_budget(
        tiers: Tiers,
        slots: usize,
        max_tokens_per_rank: usize,
        (hidden, top_k, precision): (usize, usize, RailPrecision),
        budget_bytes: u64,
    ) -> Result<Self> {
        TopologyError::zero_check("max_tokens_per_rank", max_tokens_per_rank)?;
        let one_row = Self::new(slots, 1)?.bytes(tiers, hidden, top_k, precision)?;
        if one_row == 0 {
            return Self::new(slots, max_tokens_per_rank);
        }
        if one_row > budget_bytes {
            return Err(TopologyError::OverLimit {
                what: "the rail rings at one row per chunk",
                value: one_row,
                limit: budget_bytes,
                rule: "(nodes - 1) * slots rows of dispatch_row_bytes(hidden, top_k) and as many \
                       of combine_partial_row_bytes(hidden, top_k, precision)",
            });
        }
        let fits = usize::try_from(budget_bytes / one_row).unwrap_or(usize::MAX);
        Self::new(slots, fits.min(max_tokens_per_rank))
    }
}

/// One dispatch row and one combine partial, in bytes.
fn row_pair_bytes(hidden: usize, top_k: usize, precision: RailPrecision) -> Result<u64> {
    let d = dispatch_row_bytes(hidden, top_k)?;
    let c = combine_partial_row_bytes(hidden, top_k, precision)?;
    d.checked_add(c).ok_or(TopologyError::Overflow {
        what: "dispatch row + partial row bytes",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    /// DeepEP's shape: hidden 7168, top-8, bf16 partials.
    const SHAPE: (usize, usize, RailPrecision) = (7168, 8, RailPrecision::Bf16);

    #[test]
    fn bytes_are_rows_times_a_dispatch_row_and_a_partial() {
        // A dispatch row: 7168 * 2 + 224 (scales) + 64 (ids) + 32 (weights) + 4 (source)
        // = 14,660 bytes; a bf16 partial: 7168 * 2 + 32 = 14,368.
        let (hidden, top_k, precision) = SHAPE;
        assert_eq!(row_pair_bytes(hidden, top_k, precision).unwrap(), 29_028);
        let ring = RingShape::new(2, 4096).unwrap();
        let ep16 = Tiers::new(2, 8).unwrap();
        assert_eq!(ring.rows(ep16).unwrap(), 8192);
        assert_eq!(
            ring.bytes(ep16, hidden, top_k, precision).unwrap(),
            8192 * 29_028
        );
        // One node: no rings.
        let one = Tiers::new(1, 8).unwrap();
        assert_eq!(ring.bytes(one, hidden, top_k, precision).unwrap(), 0);
    }

    #[test]
    fn a_budget_sets_the_chunk() {
        // EP16 (2 x 8), 4096 tokens: a whole op's rows fit in 1 GiB (238 MB), so the chunk is
        // capped at the op's 4096 rows.
        let ep16 = Tiers::new(2, 8).unwrap();
        let r = RingShape::for_budget(ep16, 2, 4096, SHAPE, GIB).unwrap();
        assert_eq!((r.slots(), r.chunk_rows()), (2, 4096));
        // EP256 (32 x 8): 31 rings of 2 slots; 1 GiB / (62 * 29,028) = 596 rows per chunk.
        let ep256 = Tiers::new(32, 8).unwrap();
        let r = RingShape::for_budget(ep256, 2, 4096, SHAPE, GIB).unwrap();
        assert_eq!(r.chunk_rows(), 596);
        let (hidden, top_k, precision) = SHAPE;
        assert!(r.bytes(ep256, hidden, top_k, precision).unwrap() <= GIB);
        let over = RingShape::new(2, 597).unwrap();
        assert!(over.bytes(ep256, hidden, top_k, precision).unwrap() > GIB);
        // One node: nothing to hold, the whole op is one chunk.
        let one = Tiers::new(1, 8).unwrap();
        assert_eq!(
            RingShape::for_budget(one, 2, 4096, SHAPE, 0)
                .unwrap()
                .chunk_rows(),
            4096
        );
    }

    #[test]
    fn bad_shapes_and_budgets_are_typed_errors() {
        let ep256 = Tiers::new(32, 8).unwrap();
        let need = 62 * 29_028;
        match RingShape::for_budget(ep256, 2, 4096, SHAPE, need - 1) {
            Err(TopologyError::OverLimit { value, limit, .. }) => {
                assert_eq!((value, limit), (need, need - 1));
            }
            other => panic!("expected OverLimit, got {other:?}"),
        }
        assert_eq!(
            RingShape::for_budget(ep256, 2, 4096, SHAPE, need)
                .unwrap()
                .chunk_rows(),
            1
        );
        assert!(matches!(
            RingShape::new(0, 1),
            Err(TopologyError::Zero { arg: "slots" })
        ));
        assert!(matches!(
            RingShape::new(1, 0),
            Err(TopologyError::Zero { arg: "chunk_rows" })
        ));
        assert!(matches!(
            RingShape::for_budget(ep256, 2, 0, SHAPE, GIB),
            Err(TopologyError::Zero {
                arg: "max_tokens_per_rank"
            })
        ));
        assert!(matches!(
            RingShape::for_budget(ep256, 2, 4096, (7, 8, RailPrecision::Bf16), GIB),
            Err(TopologyError::NotMultiple { .. })
        ));
    }
}
