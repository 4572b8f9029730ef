//! The two tiers of an internode world and the worst-case sizes of the buffers the
//! hierarchical (rail + NVLink forwarding) kernels need.
//!
//! **The hierarchical algorithm.** A world of `N` nodes of `L` local ranks numbers its ranks
//! node-major: rank `r` is `(node r / L, local rank r % L)`. Dispatch sends a token of source
//! `(n_s, l_s)` **once per other node** `n` it goes to, over the *rail* (RDMA), to the rank
//! `(n, l_s)` with the source's local rank (its *rail peer* in `n`), which *forwards* it over
//! NVLink to every rank of `n` holding one of the token's experts, itself included. Ranks of
//! the source's own node get the token directly over NVLink. Combine runs the same path
//! backwards: the rail peer in `n` sums the contributions of `n`'s ranks into **one partial**
//! per token and sends it back over the rail, carried in f32 or bf16 ([`RailPrecision`]).
//! `epcomm_reference::hierarchical_combine` is the CPU oracle of the order and precision.
//!
//! **Worst-case sizes**, with `T = max_tokens_per_rank`:
//!
//! | buffer (per rank) | rows | row bytes |
//! |---|---|---|
//! | dispatch rail receive | [`rail_recv_rows`] `= (N - 1) * T` | [`dispatch_row_bytes`] |
//! | dispatch forward (copies) | [`forward_rows`] `= (N - 1) * L * T` | (final slots) |
//! | combine rail partials | [`combine_rail_partial_rows`] `= (N - 1) * T` | [`combine_partial_row_bytes`] |
//!
//! Forwarded rows land in their final slots of the dispatch receive region
//! ([`BufferPlan`](crate::BufferPlan), `N * L * T` rows: `L * T` from the own node,
//! [`forward_rows`] from the others), so forwarding needs no region of its own.

use crate::{Result, RowDtype, RowFormat, TopologyError, WorldLayout};

/// The shape of a world in tiers: `nodes` nodes (joined by the rail) of `local_ranks` ranks
/// each (joined by NVLink); rank `r` is `(node r / local_ranks, local rank r % local_ranks)`.
///
/// Virtual nodes count as nodes: [`Tiers::from`] a [`WorldLayout`] takes its logical nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiers {
    nodes: usize,
    local_ranks: usize,
}

impl Tiers {
    /// `nodes` nodes of `local_ranks` ranks.
    ///
    /// # Errors
    /// [`TopologyError::Zero`] naming `nodes` or `local_ranks`; [`TopologyError::Overflow`]
    /// when `nodes * local_ranks` does not fit in `usize`.
    pub fn new(nodes: usize, local_ranks: usize) -> Result<Self> {
        TopologyError::zero_check("nodes", nodes)?;
        TopologyError::zero_check("local_ranks", local_ranks)?;
        nodes
            .checked_mul(local_ranks)
            .ok_or(TopologyError::Overflow {
                what: "world size (nodes * local_ranks)",
            })?;
        Ok(Self { nodes, local_ranks })
    }

    /// Number of nodes (`N`).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Ranks per node (`L`).
    pub fn local_ranks(&self) -> usize {
        self.local_ranks
    }

    /// Number of ranks (`N * L`, checked to fit by [`Tiers::new`]).
    pub fn world_size(&self) -> usize {
        self.nodes * self.local_ranks
    }

    /// The rail peers of every rank (`N - 1`: one per other node).
    pub fn other_nodes(&self) -> usize {
        self.nodes - 1
    }

    /// The node of `rank`.
    ///
    /// # Errors
    /// `rank < world_size()`.
    pub fn node_of(&self, rank: usize) -> Result<usize> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size())?;
        Ok(rank / self.local_ranks)
    }

    /// The local rank of `rank` inside its node.
    ///
    /// # Errors
    /// `rank < world_size()`.
    pub fn local_rank_of(&self, rank: usize) -> Result<usize> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size())?;
        Ok(rank % self.local_ranks)
    }

    /// The rank of `node` with the same local rank as `rank`: where `rank`'s tokens for `node`
    /// cross the rail (`rank` itself when `node` is its own).
    ///
    /// # Errors
    /// `rank < world_size()`, `node < nodes()`.
    pub fn rail_peer(&self, rank: usize, node: usize) -> Result<usize> {
        TopologyError::index_check("node", node, "nodes", self.nodes)?;
        Ok(node * self.local_ranks + self.local_rank_of(rank)?)
    }
}

impl From<&WorldLayout> for Tiers {
    /// The logical nodes of `world` (virtual nodes included) and their size.
    fn from(world: &WorldLayout) -> Self {
        Self {
            nodes: world.num_nodes(),
            local_ranks: world.gpus_per_node(),
        }
    }
}

/// How a combine partial crosses the rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RailPrecision {
    /// The f32 partial as summed: exact, 4 bytes per value.
    F32,
    /// The partial rounded to bf16 before the rail (DeepEP's choice): 2 bytes per value.
    Bf16,
}

impl RailPrecision {
    /// Both precisions, in documentation order.
    pub const ALL: [RailPrecision; 2] = [RailPrecision::F32, RailPrecision::Bf16];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }

    /// Bytes of one partial value on the rail.
    pub fn value_bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// Rows of one rank's dispatch rail receive region: `(nodes - 1) * max_tokens_per_rank`.
///
/// Contract: rank `(n, l)` has one rail peer per other node (`(m, l)`, `m != n`), and each
/// sends it at most one row per token, so it receives at most this many rows over the rail.
/// The same number bounds the rows a rank *sends* over the rail (each token once per other
/// node) and the rows it forwards *from*.
///
/// # Errors
/// [`TopologyError::Overflow`] when the product does not fit in `u64`.
pub fn rail_recv_rows(tiers: Tiers, max_tokens_per_rank: usize) -> Result<u64> {
    product(
        "dispatch rail receive rows ((nodes - 1) * max_tokens_per_rank)",
        &[tiers.other_nodes(), max_tokens_per_rank],
    )
}

/// Row copies one rank makes when forwarding: `(nodes - 1) * local_ranks * max_tokens_per_rank`.
///
/// Contract: each of the [`rail_recv_rows`] rows a rank receives goes to at most every rank
/// of its node (itself included). The same number bounds the rows a rank *receives* through
/// forwarding (from its node's `local_ranks` forwarders, at most [`rail_recv_rows`] each), and,
/// in combine, the contributions a rail peer gathers over NVLink.
///
/// # Errors
/// [`TopologyError::Overflow`] when the product does not fit in `u64`.
pub fn forward_rows(tiers: Tiers, max_tokens_per_rank: usize) -> Result<u64> {
    product(
        "forward rows ((nodes - 1) * local_ranks * max_tokens_per_rank)",
        &[tiers.other_nodes(), tiers.local_ranks, max_tokens_per_rank],
    )
}

/// Rows of one rank's combine rail receive region: `(nodes - 1) * max_tokens_per_rank`.
///
/// Contract: for each of its tokens a source receives at most one partial from every other
/// node (from its rail peer there). The same number bounds the partials a rail peer sends
/// (one per token it received over the rail in dispatch).
///
/// # Errors
/// [`TopologyError::Overflow`] when the product does not fit in `u64`.
pub fn combine_rail_partial_rows(tiers: Tiers, max_tokens_per_rank: usize) -> Result<u64> {
    product(
        "combine rail partial rows ((nodes - 1) * max_tokens_per_rank)",
        &[tiers.other_nodes(), max_tokens_per_rank],
    )
}

/// Bytes of one dispatch row as it crosses the rail: the sum of the per-row strides of the
/// dispatch receive regions of a [`BufferPlan`](crate::BufferPlan) — x at the BF16 pitch
/// (`hidden * 2`, which also holds FP8 rows), FP8 scales (`hidden / 128 * 4` when
/// `hidden % 128 == 0`, else 0), top-k ids (`top_k * 8`), top-k weights (`top_k * 4`) and the
/// source index (4).
///
/// # Errors
/// `hidden > 0`, `hidden % 8 == 0` ([`RowFormat::new`]); `top_k > 0`.
pub fn dispatch_row_bytes(hidden: usize, top_k: usize) -> Result<u64> {
    let row = RowFormat::new(hidden, RowDtype::Bf16)?;
    TopologyError::zero_check("top_k", top_k)?;
    let scales = RowFormat::new(hidden, RowDtype::Fp8).map_or(0, |f| f.scale_bytes());
    let parts = [row.pitch(), scales, top_k * 8, top_k * 4, 4];
    parts.iter().try_fold(0u64, |sum, &p| {
        sum.checked_add(p as u64).ok_or(TopologyError::Overflow {
            what: "dispatch row bytes",
        })
    })
}

/// Bytes of one combine partial on the rail: `hidden` values of `precision`, then `top_k` f32
/// weights (the weights cross the rail in f32 under either precision).
///
/// # Errors
/// `hidden > 0`, `hidden % 8 == 0` ([`RowFormat::new`]); `top_k > 0`;
/// [`TopologyError::Overflow`].
pub fn combine_partial_row_bytes(
    hidden: usize,
    top_k: usize,
    precision: RailPrecision,
) -> Result<u64> {
    RowFormat::new(hidden, RowDtype::Bf16)?;
    TopologyError::zero_check("top_k", top_k)?;
    let what = "combine partial row bytes (hidden * value bytes + top_k * 4)";
    let x = product(what, &[hidden, precision.value_bytes() as usize])?;
    let w = product(what, &[top_k, 4])?;
    x.checked_add(w).ok_or(TopologyError::Overflow { what })
}

/// Bytes of one rank's dispatch rail receive region: [`rail_recv_rows`] rows of
/// [`dispatch_row_bytes`].
///
/// # Errors
/// As those two; [`TopologyError::Overflow`] when the product does not fit in `u64`;
/// [`TopologyError::OverLimit`] when it exceeds `limit_bytes`.
pub fn rail_recv_bytes(
    tiers: Tiers,
    max_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    limit_bytes: u64,
) -> Result<u64> {
    region_bytes(
        "the dispatch rail receive region",
        "(nodes - 1) * max_tokens_per_rank rows of dispatch_row_bytes(hidden, top_k)",
        rail_recv_rows(tiers, max_tokens_per_rank)?,
        dispatch_row_bytes(hidden, top_k)?,
        limit_bytes,
    )
}

/// Bytes of one rank's combine rail receive region: [`combine_rail_partial_rows`] rows of
/// [`combine_partial_row_bytes`].
///
/// # Errors
/// As those two; [`TopologyError::Overflow`] when the product does not fit in `u64`;
/// [`TopologyError::OverLimit`] when it exceeds `limit_bytes`.
pub fn combine_rail_partial_bytes(
    tiers: Tiers,
    max_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    precision: RailPrecision,
    limit_bytes: u64,
) -> Result<u64> {
    region_bytes(
        "the combine rail partial region",
        "(nodes - 1) * max_tokens_per_rank rows of combine_partial_row_bytes(..)",
        combine_rail_partial_rows(tiers, max_tokens_per_rank)?,
        combine_partial_row_bytes(hidden, top_k, precision)?,
        limit_bytes,
    )
}

fn region_bytes(
    what: &'static str,
    rule: &'static str,
    rows: u64,
    row_bytes: u64,
    limit: u64,
) -> Result<u64> {
    let value = rows
        .checked_mul(row_bytes)
        .ok_or(TopologyError::Overflow { what: rule })?;
    if value > limit {
        return Err(TopologyError::OverLimit {
            what,
            value,
            limit,
            rule,
        });
    }
    Ok(value)
}

/// The product of `factors` in `u64`, or [`TopologyError::Overflow`] naming `what`.
fn product(what: &'static str, factors: &[usize]) -> Result<u64> {
    factors.iter().try_fold(1u64, |acc, &f| {
        acc.checked_mul(f as u64)
            .ok_or(TopologyError::Overflow { what })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BufferPlan;
    use proptest::prelude::*;

    #[test]
    fn tiers_map_ranks_to_nodes_and_rail_peers() {
        let t = Tiers::new(3, 4).unwrap();
        assert_eq!((t.nodes(), t.local_ranks(), t.world_size()), (3, 4, 12));
        assert_eq!(t.other_nodes(), 2);
        assert_eq!((t.node_of(7).unwrap(), t.local_rank_of(7).unwrap()), (1, 3));
        assert_eq!(t.rail_peer(7, 0).unwrap(), 3);
        assert_eq!(t.rail_peer(7, 1).unwrap(), 7);
        assert_eq!(t.rail_peer(7, 2).unwrap(), 11);
        assert!(matches!(
            t.node_of(12),
            Err(TopologyError::IndexOutOfRange { arg: "rank", .. })
        ));
        assert!(matches!(
            t.rail_peer(0, 3),
            Err(TopologyError::IndexOutOfRange { arg: "node", .. })
        ));
        assert!(t.rail_peer(12, 0).is_err());
        assert!(t.local_rank_of(12).is_err());
    }

    #[test]
    fn tiers_errors_name_the_argument() {
        assert_eq!(Tiers::new(0, 4), Err(TopologyError::Zero { arg: "nodes" }));
        assert_eq!(
            Tiers::new(2, 0),
            Err(TopologyError::Zero { arg: "local_ranks" })
        );
        assert!(matches!(
            Tiers::new(usize::MAX, 2),
            Err(TopologyError::Overflow { .. })
        ));
    }

    #[test]
    fn tiers_of_a_world_layout_take_logical_nodes() {
        let w = WorldLayout::new(16, 3, 8).unwrap();
        assert_eq!(Tiers::from(&w), Tiers::new(2, 8).unwrap());
        let v = WorldLayout::with_virtual_nodes(8, 0, 8, 4).unwrap();
        assert_eq!(Tiers::from(&v), Tiers::new(4, 2).unwrap());
    }

    #[test]
    fn deepseek_v3_on_four_nodes_of_eight() {
        let t = Tiers::new(4, 8).unwrap();
        assert_eq!(rail_recv_rows(t, 4096).unwrap(), 3 * 4096);
        assert_eq!(forward_rows(t, 4096).unwrap(), 3 * 8 * 4096);
        assert_eq!(combine_rail_partial_rows(t, 4096).unwrap(), 3 * 4096);
        // 14336 x + 224 scales + 64 ids + 32 weights + 4 source index.
        assert_eq!(dispatch_row_bytes(7168, 8).unwrap(), 14_660);
        assert_eq!(
            combine_partial_row_bytes(7168, 8, RailPrecision::Bf16).unwrap(),
            14_336 + 32
        );
        assert_eq!(
            combine_partial_row_bytes(7168, 8, RailPrecision::F32).unwrap(),
            28_672 + 32
        );
        assert_eq!(
            rail_recv_bytes(t, 4096, 7168, 8, u64::MAX).unwrap(),
            3 * 4096 * 14_660
        );
        assert_eq!(
            combine_rail_partial_bytes(t, 4096, 7168, 8, RailPrecision::Bf16, u64::MAX).unwrap(),
            3 * 4096 * 14_368
        );
        // Own-node rows plus forwarded rows fill the flat receive region exactly.
        let plan = BufferPlan::new(32, 4096, 7168, 8, 256).unwrap();
        assert_eq!(8 * 4096 + forward_rows(t, 4096).unwrap(), plan.recv_rows());
    }

    #[test]
    fn one_node_needs_no_rail() {
        let t = Tiers::new(1, 8).unwrap();
        assert_eq!(rail_recv_rows(t, 4096).unwrap(), 0);
        assert_eq!(forward_rows(t, 4096).unwrap(), 0);
        assert_eq!(combine_rail_partial_rows(t, 4096).unwrap(), 0);
        assert_eq!(rail_recv_bytes(t, 4096, 7168, 8, 0).unwrap(), 0);
    }

    #[test]
    fn sizing_errors_name_the_rule() {
        let t = Tiers::new(2, 2).unwrap();
        let err = rail_recv_bytes(t, 10, 128, 2, 100).unwrap_err();
        assert!(matches!(
            err,
            TopologyError::OverLimit {
                value: 2880,
                limit: 100,
                ..
            }
        ));
        let msg = err.to_string();
        assert!(
            msg.contains("dispatch rail receive region") && msg.contains("max_tokens_per_rank"),
            "{msg}"
        );
        let err = combine_rail_partial_bytes(t, 10, 128, 2, RailPrecision::F32, 5119).unwrap_err();
        assert!(matches!(err, TopologyError::OverLimit { value: 5200, .. }));
        let huge = Tiers::new(usize::MAX / 2, 2).unwrap();
        let err = rail_recv_rows(huge, usize::MAX).unwrap_err();
        assert!(
            err.to_string()
                .contains("(nodes - 1) * max_tokens_per_rank")
        );
        assert!(matches!(
            forward_rows(huge, 3),
            Err(TopologyError::Overflow { .. })
        ));
        assert!(matches!(
            rail_recv_bytes(Tiers::new(2, 1).unwrap(), usize::MAX, 8, 1, u64::MAX),
            Err(TopologyError::Overflow { .. })
        ));
        assert!(matches!(
            dispatch_row_bytes(12, 1),
            Err(TopologyError::NotMultiple { arg: "hidden", .. })
        ));
        assert_eq!(
            dispatch_row_bytes(8, 0),
            Err(TopologyError::Zero { arg: "top_k" })
        );
        assert_eq!(
            combine_partial_row_bytes(0, 1, RailPrecision::Bf16),
            Err(TopologyError::Zero { arg: "hidden" })
        );
        assert_eq!(
            combine_partial_row_bytes(8, 0, RailPrecision::Bf16),
            Err(TopologyError::Zero { arg: "top_k" })
        );
        assert_eq!(RailPrecision::ALL.map(RailPrecision::name), ["f32", "bf16"]);
    }

    proptest! {
        #[test]
        fn sizes_follow_the_formulas(
            nodes in 1usize..9,
            local in 1usize..9,
            max_tokens in 0usize..5000,
            hidden8 in 1usize..1000,
            top_k in 1usize..10,
            limit in prop_oneof![any::<u64>(), 0u64..100_000_000],
        ) {
            let t = Tiers::new(nodes, local).unwrap();
            let hidden = hidden8 * 8;
            let m = max_tokens as u64;
            let other = nodes as u64 - 1;
            prop_assert_eq!(rail_recv_rows(t, max_tokens).unwrap(), other * m);
            prop_assert_eq!(forward_rows(t, max_tokens).unwrap(), other * local as u64 * m);
            prop_assert_eq!(combine_rail_partial_rows(t, max_tokens).unwrap(), other * m);
            // The rail row is the flat plan's dispatch row, stride by stride.
            let plan = BufferPlan::new(1, 1, hidden, top_k, top_k).unwrap();
            let strides = plan.x_row_bytes()
                + plan.scales_row_bytes()
                + plan.topk_idx_row_bytes()
                + plan.topk_weights_row_bytes()
                + plan.src_idx_row_bytes();
            prop_assert_eq!(dispatch_row_bytes(hidden, top_k).unwrap(), strides);
            for p in RailPrecision::ALL {
                let row = combine_partial_row_bytes(hidden, top_k, p).unwrap();
                prop_assert_eq!(row, hidden as u64 * p.value_bytes() + plan.combine_weights_row_bytes());
                let want = other * m * row;
                match combine_rail_partial_bytes(t, max_tokens, hidden, top_k, p, limit) {
                    Ok(b) => prop_assert!(b == want && b <= limit),
                    Err(TopologyError::OverLimit { value, .. }) => {
                        prop_assert!(value == want && value > limit)
                    }
                    Err(e) => prop_assert!(false, "{e}"),
                }
            }
            let want = other * m * strides;
            prop_assert_eq!(rail_recv_bytes(t, max_tokens, hidden, top_k, want), Ok(want));
        }
    }
}
