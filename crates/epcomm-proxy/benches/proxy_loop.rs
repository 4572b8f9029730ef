//! The proxy thread's own cost per descriptor, on the CPU: a producer thread pushes the
//! descriptors of one 4096-token op on two ranks through a ring into a running proxy whose
//! executor does no work (every operation completes at the next poll), and each iteration ends
//! when the proxy has completed them all. What is timed is the ring, the decoding, the
//! coalescing and the proxy's bookkeeping (with the host producer beside it), not a copy.
//!
//! Two forms of each op, as the CUDA side sends its runs (`kernels/common/net_proxy.cuh`):
//! `per token` (a dispatch run's source indices as one WRITE per token, a combine run's flags
//! as one SIGNAL per row) and `per run` (one sequence WRITE, one SIGNAL over the run's words).
//!
//! `cargo bench -p epcomm-proxy --bench proxy_loop`

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use epcomm_proxy::{
    Descriptor, Executor, Limits, OpFailure, OpId, Proxy, ProxyConfig, RingMemory, Signal,
    SignalOp, Source, Submit, Transfer, Write, WriteWidth, ring,
};

const TOKENS: u64 = 4096;
const ROW: u64 = 7168 * 2;
const TOP_K: u64 = 8;
/// Tokens per run: the kernels' limit of 1 MiB of rows.
const RUN: u64 = (1 << 20) / ROW;
const HEAP: u64 = 1 << 30;
const LONG: Duration = Duration::from_secs(30);

/// Accepts everything; every operation completes at the next poll.
struct Null {
    pending: Vec<OpId>,
}

impl Executor for Null {
    fn name(&self) -> &str {
        "null"
    }
    fn submit_transfer(&mut self, op: OpId, _: &Transfer) -> Result<Submit, OpFailure> {
        self.pending.push(op);
        Ok(Submit::Accepted)
    }
    fn submit_write(&mut self, op: OpId, _: &Write) -> Result<Submit, OpFailure> {
        self.pending.push(op);
        Ok(Submit::Accepted)
    }
    fn submit_signal(&mut self, op: OpId, _: &Signal) -> Result<Submit, OpFailure> {
        self.pending.push(op);
        Ok(Submit::Accepted)
    }
    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        done.append(&mut self.pending);
        Ok(())
    }
}

fn transfer(src: u64, dst: u64, bytes: u64) -> Descriptor {
    Descriptor::Transfer(Transfer {
        peer: 1,
        src: Source::Address(0x7f00_0000_0000 + src),
        dst_offset: dst,
        bytes,
    })
}

/// A BF16 dispatch with weights to the other rank: per run its rows, ids and weights as one
/// transfer each, then its source indices; one done add at the end.
fn dispatch(sequence: bool) -> Vec<Descriptor> {
    let mut out = Vec::new();
    for t0 in (0..TOKENS).step_by(RUN as usize) {
        let len = RUN.min(TOKENS - t0);
        out.push(transfer(t0 * ROW, t0 * ROW, len * ROW));
        out.push(transfer(
            (1 << 28) + t0 * TOP_K * 8,
            (1 << 28) + t0 * TOP_K * 8,
            len * TOP_K * 8,
        ));
        out.push(transfer(
            (1 << 29) + t0 * TOP_K * 4,
            (1 << 29) + t0 * TOP_K * 4,
            len * TOP_K * 4,
        ));
        let idx = (1 << 29) + (1 << 25) + t0 * 4;
        if sequence {
            out.push(Descriptor::Write(Write {
                count: len as u32,
                ..Write::one(1, idx, t0, WriteWidth::Four)
            }));
        } else {
            for j in 0..len {
                out.push(Descriptor::Write(Write::one(
                    1,
                    idx + 4 * j,
                    t0 + j,
                    WriteWidth::Four,
                )));
            }
        }
    }
    out.push(Descriptor::Signal(Signal::word(1, 0, 1, SignalOp::Add)));
    out
}

/// A combine to the other rank: per run its weights and rows as one transfer each, then its
/// flags; one done add at the end.
fn combine(words: bool) -> Vec<Descriptor> {
    let mut out = Vec::new();
    for t0 in (0..TOKENS).step_by(RUN as usize) {
        let len = RUN.min(TOKENS - t0);
        out.push(transfer(
            (1 << 29) + t0 * TOP_K * 4,
            (1 << 29) + t0 * TOP_K * 4,
            len * TOP_K * 4,
        ));
        out.push(transfer(t0 * ROW, t0 * ROW, len * ROW));
        let flags = (1 << 29) + (1 << 26) + t0 * 8;
        if words {
            out.push(Descriptor::Signal(Signal {
                words: len as u32,
                ..Signal::word(1, flags, 3, SignalOp::Set)
            }));
        } else {
            for j in 0..len {
                out.push(Descriptor::Signal(Signal::word(
                    1,
                    flags + 8 * j,
                    3,
                    SignalOp::Set,
                )));
            }
        }
    }
    out.push(Descriptor::Signal(Signal::word(1, 8, 1, SignalOp::Add)));
    out
}

fn bench(c: &mut Criterion) {
    let limits = Limits {
        world: 2,
        heap_bytes: HEAP,
    };
    let mut group = c.benchmark_group("proxy-loop/ep2/4096 tokens");
    for (name, work) in [
        ("dispatch BF16, index per token", dispatch(false)),
        ("dispatch BF16, index per run", dispatch(true)),
        ("combine, flag per row", combine(false)),
        ("combine, flags per run", combine(true)),
    ] {
        let (mut producer, consumer) = ring::split(RingMemory::allocate(65_536).expect("ring"));
        let proxy = Proxy::spawn(
            consumer,
            Null {
                pending: Vec::new(),
            },
            ProxyConfig::new(limits),
        )
        .expect("proxy");
        let mut pushed = 0u64;
        group.throughput(Throughput::Elements(work.len() as u64));
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    for d in &work {
                        producer.push(d, &limits, LONG).expect("push");
                    }
                    pushed += work.len() as u64;
                    producer.wait_completed(pushed, LONG).expect("completed");
                }
                start.elapsed()
            })
        });
        proxy.shutdown().expect("clean shutdown");
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
