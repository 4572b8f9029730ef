//! Rail traffic of DeepEP's normal-mode workload on EP16 / EP32 / EP64 (and with `--max-nodes
//! 32` EP128 / EP256; 8 GPUs per node), computed on the CPU: rows and bytes per rank over the
//! rail, NVLink forwarding, and the lower-bound time and DeepEP-style "RDMA GB/s" at a given NIC
//! bandwidth.
//!
//! Then the fused design as a pipeline of chunks: for each per-chunk cost of `--chunk-us`, the
//! chunk count (up to `--max-chunks`) with the least time, that time, the rail GB/s and the
//! forwarder's memory for two chunks in flight per source node. Last, the rail rings a memory
//! budget of 0.25 and 1 GiB per rank allows ([`epcomm_topology::RingShape::for_budget`]).
//!
//! `cargo run --release -p epcomm-reference --example rail_model -- [--nic-gbps 50]
//! [--overhead-us 0] [--nvlink-gbps 275] [--max-nodes 8] [--chunk-us 2,5,10] [--max-chunks 64]`

use std::time::Instant;

use epcomm_reference::rail_model::{OpEstimate, RailLink, RailModel, summarize};
use epcomm_reference::{RailPrecision, Tiers, gen_deepep_workload};
use epcomm_topology::RingShape;

const TOKENS: usize = 4096;
const HIDDEN: usize = 7168;
const TOP_K: usize = 8;
const EXPERTS: usize = 256;
const LOCAL: usize = 8;
/// `epcomm bench`'s seed; rank `r` uses `SEED + r * 7919`, as `epcomm-check`'s inputs do.
const SEED: u64 = 2025;
/// The node counts modelled (EP = nodes × [`LOCAL`]), up to `--max-nodes`.
const NODES: [usize; 5] = [2, 4, 8, 16, 32];
/// Slots per ring in the budget table: two chunks in flight per other node.
const RING_SLOTS: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut link = RailLink {
        nic_gbps: 50.0,
        overhead_us: 0.0,
        nvlink_gbps: 275.0,
    };
    let mut max_nodes: usize = 8;
    let mut chunk_us: Vec<f64> = vec![2.0, 5.0, 10.0];
    let mut max_chunks: u32 = 64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = |v: Option<String>| -> Result<f64, Box<dyn std::error::Error>> {
            Ok(v.ok_or(format!("{a} needs a value"))?.parse()?)
        };
        match a.as_str() {
            "--nic-gbps" => link.nic_gbps = value(args.next())?,
            "--overhead-us" => link.overhead_us = value(args.next())?,
            "--nvlink-gbps" => link.nvlink_gbps = value(args.next())?,
            "--max-nodes" => max_nodes = args.next().ok_or("--max-nodes needs a value")?.parse()?,
            "--chunk-us" => {
                chunk_us = args
                    .next()
                    .ok_or("--chunk-us needs a value")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            "--max-chunks" => {
                max_chunks = args.next().ok_or("--max-chunks needs a value")?.parse()?;
            }
            _ => {
                return Err(format!(
                    "unknown argument {a} (--nic-gbps, --overhead-us, --nvlink-gbps, \
                     --max-nodes, --chunk-us, --max-chunks)"
                )
                .into());
            }
        }
    }

    let nodes_list: Vec<usize> = NODES.into_iter().filter(|&n| n <= max_nodes).collect();
    let max_world = nodes_list.last().ok_or("--max-nodes must be at least 2")? * LOCAL;

    // Rank r's routing does not depend on the world size: generate the largest world once.
    let start = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut routing: Vec<Vec<i64>> = vec![Vec::new(); max_world];
    std::thread::scope(|s| {
        let chunk = max_world.div_ceil(threads);
        for (c, out) in routing.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                for (i, idx) in out.iter_mut().enumerate() {
                    let r = (c * chunk + i) as u64;
                    let seed = SEED.wrapping_add(r * 7919);
                    *idx = gen_deepep_workload(TOKENS, HIDDEN, TOP_K, EXPERTS, seed)
                        .expect("valid shape")
                        .topk_idx;
                }
            });
        }
    });
    println!(
        "DeepEP workload: {TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOP_K} of {EXPERTS} \
         experts, seed {SEED} + rank * 7919, {LOCAL} GPUs/node; generated {max_world} ranks \
         in {:.1} s on {threads} threads",
        start.elapsed().as_secs_f64()
    );
    println!(
        "NIC {} GB/s per GPU per direction, per-op overhead {} us, node stage (NVLink \
         forwarding) {} GB/s\n",
        link.nic_gbps, link.overhead_us, link.nvlink_gbps
    );

    let mut models = Vec::new();
    for &nodes in &nodes_list {
        let tiers = Tiers::new(nodes, LOCAL)?;
        let world = tiers.world_size();
        models.push(summarize(
            &routing[..world],
            TOP_K,
            EXPERTS,
            HIDDEN,
            tiers,
            link,
        )?);
    }

    println!("Rows per rank (mean / max over ranks):\n");
    println!(
        "| EP | nodes | rail rows sent | rail rows received | NVLink forwarded | \
         DeepEP node rows (own node incl.) | rail rows / (T*K) | rail rows / per-rank transfers |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in &models {
        println!(
            "| {} | {} | {:.0} / {} | {:.0} / {} | {:.0} / {} | {:.0} / {} | {:.3} | {:.3} |",
            m.tiers.world_size(),
            m.tiers.nodes(),
            m.rail_sent.mean,
            m.rail_sent.max,
            m.rail_received.mean,
            m.rail_received.max,
            m.forwarded.mean,
            m.forwarded.max,
            m.deepep_rows.mean,
            m.deepep_rows.max,
            m.rows_per_slot(),
            m.rows_per_rank_transfer(),
        );
    }

    println!(
        "\nBytes per rank and lower-bound time (busiest NIC direction of any rank / bandwidth \
         + overhead):\n"
    );
    println!(
        "| EP | op | row B | rail MB sent (mean) | busiest MB | time us | \
         DeepEP MB (mean) | DeepEP \"RDMA GB/s\" |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in &models {
        let ops: [(&str, &OpEstimate); 4] = [
            ("dispatch BF16", &m.dispatch_bf16),
            ("dispatch FP8", &m.dispatch_fp8),
            ("combine BF16 partials", &m.combine_bf16),
            ("combine F32 partials", &m.combine_f32),
        ];
        for (name, op) in ops {
            println!(
                "| {} | {name} | {} | {:.2} | {:.2} | {:.1} | {:.2} | {:.1} |",
                m.tiers.world_size(),
                op.row_bytes,
                op.sent_mean / 1e6,
                op.busiest as f64 / 1e6,
                op.time_us,
                op.deepep_bytes_mean / 1e6,
                op.deepep_gbps,
            );
        }
    }

    println!(
        "\nWith the node stage (the busiest rank's NVLink rows, forwarded and its own node's, at \
         the NVLink rate): after the rail stage (two stages) or overlapped with it (fused); \
         rail GB/s = mean rail bytes sent / time:\n"
    );
    println!(
        "| EP | op | rail us | node us | two stages us | rail GB/s | fused us | fused rail GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in &models {
        for (name, op) in staged_ops(m) {
            let st = op.staged;
            println!(
                "| {} | {name} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.1} |",
                m.tiers.world_size(),
                st.rail_us,
                st.node_us,
                st.sequential_us,
                st.sequential_rail_gbps,
                st.overlapped_us,
                st.overlapped_rail_gbps,
            );
        }
    }

    println!(
        "\nFused as a pipeline of chunks (max(rail, node) + min(rail, node) / chunks + chunks * \
         chunk cost + overhead), the best chunk count up to {max_chunks} per chunk cost; ring MB: \
         the forwarder's memory for two chunks in flight per source node:\n"
    );
    println!("| EP | op | chunk us | chunks | time us | rail GB/s | ring MB |");
    println!("|---|---|---|---|---|---|---|");
    for m in &models {
        for (name, op) in staged_ops(m) {
            for &c in &chunk_us {
                let p = op.best_pipeline(c, max_chunks)?;
                println!(
                    "| {} | {name} | {c} | {} | {:.0} | {:.1} | {:.1} |",
                    m.tiers.world_size(),
                    p.chunks,
                    p.time_us,
                    p.rail_gbps,
                    p.ring_bytes as f64 / 1e6,
                );
            }
        }
    }

    println!(
        "\nRings a memory budget allows (epcomm_topology::RingShape::for_budget: {RING_SLOTS} \
         slots per other node, dispatch rows and bf16 partials, chunks of at most {TOKENS} \
         rows):\n"
    );
    println!("| EP | budget GiB | chunk rows | rings MB |");
    println!("|---|---|---|---|");
    for m in &models {
        for gib in [0.25, 1.0] {
            let budget = (gib * (1u64 << 30) as f64) as u64;
            let shape = (HIDDEN, TOP_K, RailPrecision::Bf16);
            let ring = RingShape::for_budget(m.tiers, RING_SLOTS, TOKENS, shape, budget)?;
            let bytes = ring.bytes(m.tiers, HIDDEN, TOP_K, RailPrecision::Bf16)?;
            println!(
                "| {} | {gib} | {} | {:.1} |",
                m.tiers.world_size(),
                ring.chunk_rows(),
                bytes as f64 / 1e6
            );
        }
    }
    Ok(())
}

/// The ops the staged and pipelined tables show (the f32 combine only has the byte table).
fn staged_ops(m: &RailModel) -> [(&'static str, &OpEstimate); 3] {
    [
        ("dispatch BF16", &m.dispatch_bf16),
        ("dispatch FP8", &m.dispatch_fp8),
        ("combine BF16 partials", &m.combine_bf16),
    ]
}
