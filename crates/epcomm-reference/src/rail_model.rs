//! A traffic model of the hierarchical (internode) path: what every rank moves over the rail
//! for one routing, turned into bytes and a lower-bound time at a given NIC bandwidth.
//!
//! Nothing here is measured: rows come from [`rail_traffic`], row bytes from
//! `epcomm_topology`'s [`dispatch_row_bytes`] and [`combine_partial_row_bytes`], and the time
//! is `bytes / bandwidth + overhead`, the overhead a fixed per-op term measured elsewhere.
//!
//! **Stages.** [`OpEstimate::staged`] adds the node stage (the rows a rank moves over NVLink:
//! those it forwards for other nodes and its own tokens' rows for its node, at an NVLink rate) two ways: after the rail stage, as the implementation runs them
//! (two ops on one stream), and overlapped with it, as a fused design would.
//!
//! **Pipelined.** [`OpEstimate::pipelined`] models the fused design as a two-stage pipeline of
//! `chunks` chunks per op: chunk `i + 1` crosses the rail while the node stage forwards chunk
//! `i`, so the op takes `max(rail, node) + min(rail, node) / chunks` (the slower stage, plus
//! the faster stage's share of the first or last chunk), plus `chunks * chunk_us` (what each
//! chunk adds on the critical path: its signal and the forwarder's wait for it) and the
//! per-op overhead. [`OpEstimate::best_pipeline`] picks the chunk count that minimises it.
//! The forwarder's memory is then two chunks in flight per source node (one landing, one
//! being forwarded): `2 * busiest rows * row bytes / chunks` ([`Pipelined::ring_bytes`]).
//!
//! **Bytes counted.** A dispatch row on the rail is the token payload plus its metadata:
//! * BF16: `hidden * 2` + top-k ids (`top_k * 8`) + top-k weights (`top_k * 4`) + source index
//!   (4) — [`dispatch_row_bytes`] without its FP8 scales;
//! * FP8: `hidden` + scales (`hidden / 128 * 4`) + the same metadata —
//!   [`dispatch_row_bytes`] with the x payload at one byte per value instead of the BF16
//!   pitch.
//!
//! A combine partial is [`combine_partial_row_bytes`] (`hidden` values of the
//! [`RailPrecision`] plus `top_k` f32 weights).
//!
//! **DeepEP's "RDMA GB/s"** (`tests/test_internode.py`) divides
//! `num_rdma_token_sent * hidden * 2` (BF16; FP8 multiplies by `(1 + 4/128) / 2`) by the op's
//! time, where `num_rdma_token_sent` counts every (token, node holding one of its experts)
//! pair **including the source's own node**, whose rows never cross the rail. Combine uses the
//! same byte count. [`RailModel::deepep_rows`] is that count; the `deepep_*` figures use it.

use epcomm_topology::{
    RailPrecision, RowDtype, RowFormat, Tiers, combine_partial_row_bytes, dispatch_row_bytes,
};

use crate::hierarchical::rail_traffic;
use crate::{RefError, Result};

/// Mean and maximum over ranks of one per-rank count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Mean over ranks.
    pub mean: f64,
    /// Maximum over ranks.
    pub max: u64,
}

impl Spread {
    /// The spread of `values` (mean 0 and max 0 when empty).
    pub fn of(values: impl IntoIterator<Item = u64>) -> Self {
        let (mut n, mut sum, mut max) = (0u64, 0u128, 0u64);
        for v in values {
            n += 1;
            sum += u128::from(v);
            max = max.max(v);
        }
        let mean = if n == 0 { 0.0 } else { sum as f64 / n as f64 };
        Self { mean, max }
    }

    /// Both figures times `factor` (row counts to bytes).
    pub fn scaled(self, factor: u64) -> (f64, u64) {
        (self.mean * factor as f64, self.max * factor)
    }
}

/// The link a [`RailModel`] is timed on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RailLink {
    /// NIC bandwidth per GPU per direction, GB/s (10^9 bytes/s); 50 = 400 Gb/s.
    pub nic_gbps: f64,
    /// Fixed time added to every op, microseconds (0 until measured).
    pub overhead_us: f64,
    /// NVLink rate of the node stage (forwarding), GB/s per GPU: what the node tier's stores
    /// reach with the op's SMs.
    pub nvlink_gbps: f64,
}

impl RailLink {
    /// Lower-bound time of moving `bytes` through one NIC direction, microseconds:
    /// `bytes / (nic_gbps * 1e3) + overhead_us`.
    pub fn time_us(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.nic_gbps * 1e3) + self.overhead_us
    }
}

/// One op's rail bytes and lower-bound time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpEstimate {
    /// Bytes of one row on the rail.
    pub row_bytes: u64,
    /// Bytes a rank sends over the rail: mean over ranks.
    pub sent_mean: f64,
    /// The busiest NIC direction of any rank: `max over ranks of max(sent, received)` bytes.
    pub busiest: u64,
    /// [`RailLink::time_us`] of `busiest`: no rank can finish earlier.
    pub time_us: f64,
    /// DeepEP's payload bytes per rank (own node included, see the module docs): mean.
    pub deepep_bytes_mean: f64,
    /// `deepep_bytes_mean / time_us`, GB/s: the "RDMA GB/s" DeepEP would print.
    pub deepep_gbps: f64,
    /// The time with the node stage counted too.
    pub staged: StagedTime,
}

/// An op's time with its node stage: the busiest rank's NVLink rows ([`RailModel::node_rows`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StagedTime {
    /// The rail stage alone: the busiest NIC direction at the NIC rate, no overhead.
    pub rail_us: f64,
    /// The node stage alone: `max over ranks of node rows * row bytes` at the NVLink rate.
    pub node_us: f64,
    /// `rail_us + node_us + overhead`: the stages one after the other.
    pub sequential_us: f64,
    /// `max(rail_us, node_us) + overhead`: the stages overlapped.
    pub overlapped_us: f64,
    /// Mean rail bytes sent per rank / `sequential_us`, GB/s.
    pub sequential_rail_gbps: f64,
    /// Mean rail bytes sent per rank / `overlapped_us`, GB/s.
    pub overlapped_rail_gbps: f64,
}

/// An op run as a pipeline of chunks ([`OpEstimate::pipelined`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pipelined {
    /// Chunks per op.
    pub chunks: u32,
    /// What each chunk adds on the critical path, microseconds.
    pub chunk_us: f64,
    /// `max(rail, node) + min(rail, node) / chunks + chunks * chunk_us + overhead`, us.
    pub time_us: f64,
    /// Mean rail bytes sent per rank / `time_us`, GB/s.
    pub rail_gbps: f64,
    /// The forwarder's memory for two chunks in flight per source node:
    /// `2 * busiest rows * row bytes / chunks` (rounded up to whole rows per chunk).
    pub ring_bytes: u64,
}

impl OpEstimate {
    /// The per-op overhead the estimate was made with, microseconds.
    pub fn overhead_us(&self) -> f64 {
        self.time_us - self.staged.rail_us
    }

    /// The op as a pipeline of `chunks` chunks, each adding `chunk_us` on the critical path
    /// (see the module docs).
    ///
    /// # Errors
    /// [`RefError::OutOfRange`] unless `chunks >= 1` and `chunk_us` is finite and `>= 0`.
    pub fn pipelined(&self, chunks: u32, chunk_us: f64) -> Result<Pipelined> {
        if chunks == 0 {
            return Err(RefError::OutOfRange {
                arg: "chunks",
                value: 0.0,
                min: 1.0,
                max: f64::from(u32::MAX),
            });
        }
        if !(chunk_us >= 0.0 && chunk_us.is_finite()) {
            return Err(RefError::OutOfRange {
                arg: "chunk_us",
                value: chunk_us,
                min: 0.0,
                max: f64::MAX,
            });
        }
        let (rail, node) = (self.staged.rail_us, self.staged.node_us);
        let c = f64::from(chunks);
        let time_us = rail.max(node) + rail.min(node) / c + c * chunk_us + self.overhead_us();
        let rows = self.busiest / self.row_bytes.max(1);
        let chunk_rows = rows.div_ceil(u64::from(chunks));
        Ok(Pipelined {
            chunks,
            chunk_us,
            time_us,
            rail_gbps: if time_us > 0.0 {
                self.sent_mean / (time_us * 1e3)
            } else {
                0.0
            },
            ring_bytes: 2 * chunk_rows * self.row_bytes,
        })
    }

    /// [`Self::pipelined`] with the chunk count in `1..=max_chunks` that takes the least time
    /// (the fewest chunks among equals).
    ///
    /// # Errors
    /// As [`Self::pipelined`], and [`RefError::OutOfRange`] naming `max_chunks` when it is 0.
    pub fn best_pipeline(&self, chunk_us: f64, max_chunks: u32) -> Result<Pipelined> {
        if max_chunks == 0 {
            return Err(RefError::OutOfRange {
                arg: "max_chunks",
                value: 0.0,
                min: 1.0,
                max: f64::from(u32::MAX),
            });
        }
        let mut best = self.pipelined(1, chunk_us)?;
        for chunks in 2..=max_chunks {
            let p = self.pipelined(chunks, chunk_us)?;
            if p.time_us < best.time_us {
                best = p;
            }
        }
        Ok(best)
    }

    fn new(
        row_bytes: u64,
        sent: Spread,
        busiest_rows: u64,
        node_rows: Spread,
        deepep_rows: Spread,
        deepep_row_bytes: f64,
        link: RailLink,
    ) -> Self {
        let busiest = busiest_rows * row_bytes;
        let time_us = link.time_us(busiest);
        let deepep_bytes_mean = deepep_rows.mean * deepep_row_bytes;
        let sent_mean = sent.mean * row_bytes as f64;
        let rail_us = time_us - link.overhead_us;
        let node_us = (node_rows.max * row_bytes) as f64 / (link.nvlink_gbps * 1e3);
        let sequential_us = rail_us + node_us + link.overhead_us;
        let overlapped_us = rail_us.max(node_us) + link.overhead_us;
        let gbps = |us: f64| {
            if us > 0.0 {
                sent_mean / (us * 1e3)
            } else {
                0.0
            }
        };
        Self {
            row_bytes,
            sent_mean,
            busiest,
            time_us,
            deepep_bytes_mean,
            deepep_gbps: deepep_bytes_mean / (time_us * 1e3),
            staged: StagedTime {
                rail_us,
                node_us,
                sequential_us,
                overlapped_us,
                sequential_rail_gbps: gbps(sequential_us),
                overlapped_rail_gbps: gbps(overlapped_us),
            },
        }
    }
}

/// The rail traffic of one routing over a [`Tiers`] world, and its bytes and lower-bound
/// times: what [`summarize`] returns. Counts are per rank (spread over ranks).
#[derive(Debug, Clone, PartialEq)]
pub struct RailModel {
    /// The world.
    pub tiers: Tiers,
    /// Tokens of all ranks.
    pub tokens: u64,
    /// Experts per token.
    pub top_k: usize,
    /// Dispatch rows sent over the rail (one per (token, other node it goes to)).
    pub rail_sent: Spread,
    /// Dispatch rows received over the rail.
    pub rail_received: Spread,
    /// Rail-received rows forwarded over NVLink (copies to other ranks of the node).
    pub forwarded: Spread,
    /// Rows the node stage moves over NVLink: the forwarded rows and the rank's own tokens'
    /// rows for the other ranks of its node (which also go through the node stage).
    pub node_rows: Spread,
    /// Combine partials sent back over the rail (= rows received over the rail in dispatch).
    pub combine_sent: Spread,
    /// DeepEP's `num_rdma_token_sent`: (token, node) pairs, own node included.
    pub deepep_rows: Spread,
    /// Rows a flat scheme (one transfer per (token, rank of another node)) would put on the
    /// rail, summed over ranks.
    pub per_rank_rail_rows: u64,
    /// Sum over ranks of [`rail_sent`](Self::rail_sent).
    pub rail_rows: u64,
    /// Dispatch, BF16 x.
    pub dispatch_bf16: OpEstimate,
    /// Dispatch, FP8 x with per-128 scales.
    pub dispatch_fp8: OpEstimate,
    /// Combine, partials in bf16 (DeepEP's choice).
    pub combine_bf16: OpEstimate,
    /// Combine, partials in f32.
    pub combine_f32: OpEstimate,
}

impl RailModel {
    /// `rail_rows / (tokens * top_k)`: rail rows per routed (token, expert) slot.
    pub fn rows_per_slot(&self) -> f64 {
        self.rail_rows as f64 / (self.tokens as f64 * self.top_k as f64)
    }

    /// `rail_rows / per_rank_rail_rows`: the rail rows one transfer per node needs, as a
    /// fraction of one transfer per destination rank.
    pub fn rows_per_rank_transfer(&self) -> f64 {
        self.rail_rows as f64 / self.per_rank_rail_rows as f64
    }
}

/// Counts what one routing moves over the rail ([`rail_traffic`]) and turns it into bytes
/// (see the module docs for what is counted) and lower-bound times on `link`.
///
/// `topk_idx[r]` is rank `r`'s `[T_r][top_k]` routing (`-1` = no expert).
///
/// Times: each op is bounded by its busiest NIC direction, `max over ranks of max(rows sent,
/// rows received) * row bytes`; dispatch sends [`RailModel::rail_sent`] and receives
/// [`RailModel::rail_received`], combine the reverse. [`OpEstimate::staged`] adds the node
/// stage: [`RailModel::node_rows`] (combine: as many partials back) at `link.nvlink_gbps`.
///
/// # Errors
/// As [`rail_traffic`]; `hidden > 0`, `hidden % 128 == 0` (FP8 rows);
/// [`RefError::OutOfRange`] unless `link.nic_gbps > 0`, `link.nvlink_gbps > 0` and
/// `link.overhead_us >= 0`.
pub fn summarize<I: AsRef<[i64]>>(
    topk_idx: &[I],
    top_k: usize,
    num_experts: usize,
    hidden: usize,
    tiers: Tiers,
    link: RailLink,
) -> Result<RailModel> {
    let traffic = rail_traffic(topk_idx, top_k, num_experts, tiers)?;
    if !(link.nic_gbps > 0.0 && link.nic_gbps.is_finite()) {
        return Err(RefError::OutOfRange {
            arg: "nic_gbps",
            value: link.nic_gbps,
            min: f64::MIN_POSITIVE,
            max: f64::MAX,
        });
    }
    if !(link.nvlink_gbps > 0.0 && link.nvlink_gbps.is_finite()) {
        return Err(RefError::OutOfRange {
            arg: "nvlink_gbps",
            value: link.nvlink_gbps,
            min: f64::MIN_POSITIVE,
            max: f64::MAX,
        });
    }
    if !(link.overhead_us >= 0.0 && link.overhead_us.is_finite()) {
        return Err(RefError::OutOfRange {
            arg: "overhead_us",
            value: link.overhead_us,
            min: 0.0,
            max: f64::MAX,
        });
    }
    let fp8 = RowFormat::new(hidden, RowDtype::Fp8)?;
    let row = dispatch_row_bytes(hidden, top_k)?;
    let bf16_row = row - fp8.scale_bytes() as u64;
    let fp8_row = row - hidden as u64;

    // DeepEP's count: distinct nodes per token (rail_traffic validated the ids).
    let experts_per_node = num_experts / tiers.nodes();
    let mut seen = vec![false; tiers.nodes()];
    let deepep_rows = Spread::of(topk_idx.iter().map(|idx| {
        idx.as_ref()
            .chunks(top_k)
            .map(|token| {
                seen.fill(false);
                for &e in token.iter().filter(|&&e| e >= 0) {
                    seen[e as usize / experts_per_node] = true;
                }
                seen.iter().filter(|&&s| s).count() as u64
            })
            .sum::<u64>()
    }));

    let field = |f: fn(&crate::RailTraffic) -> u64| Spread::of(traffic.iter().map(f));
    let rail_sent = field(|t| t.dispatch_rail_sent);
    let rail_received = field(|t| t.dispatch_rail_received);
    let busiest_rows = traffic
        .iter()
        .map(|t| t.dispatch_rail_sent.max(t.dispatch_rail_received))
        .max()
        .unwrap_or(0);
    let combine_sent = field(|t| t.combine_rail_sent);
    let forwarded = field(|t| t.dispatch_forwarded);
    let node_rows = field(|t| t.dispatch_forwarded + t.dispatch_direct_nvlink);
    let bf16_payload = (hidden * 2) as f64;
    let fp8_payload = bf16_payload * (1.0 + 4.0 / 128.0) / 2.0;
    let combine = |p| -> Result<OpEstimate> {
        Ok(OpEstimate::new(
            combine_partial_row_bytes(hidden, top_k, p)?,
            combine_sent,
            busiest_rows,
            node_rows,
            deepep_rows,
            bf16_payload,
            link,
        ))
    };
    Ok(RailModel {
        tiers,
        tokens: topk_idx
            .iter()
            .map(|i| (i.as_ref().len() / top_k) as u64)
            .sum(),
        top_k,
        rail_sent,
        rail_received,
        forwarded,
        node_rows,
        combine_sent,
        deepep_rows,
        per_rank_rail_rows: traffic
            .iter()
            .map(|t| t.dispatch_forwarded + t.dispatch_forward_kept)
            .sum(),
        rail_rows: traffic.iter().map(|t| t.dispatch_rail_sent).sum(),
        dispatch_bf16: OpEstimate::new(
            bf16_row,
            rail_sent,
            busiest_rows,
            node_rows,
            deepep_rows,
            bf16_payload,
            link,
        ),
        dispatch_fp8: OpEstimate::new(
            fp8_row,
            rail_sent,
            busiest_rows,
            node_rows,
            deepep_rows,
            fp8_payload,
            link,
        ),
        combine_bf16: combine(RailPrecision::Bf16)?,
        combine_f32: combine(RailPrecision::F32)?,
    })
}
