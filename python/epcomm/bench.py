"""``python -m epcomm.bench``: the dispatch/combine benchmark of ``epcomm bench`` through the
Python API, with DeepEP's workload and metric, and the same report (table, ``--json`` with
schema ``epcomm-bench/2``, or ``--csv``).

Workload: ``--tokens`` (4096) tokens per rank, hidden 7168, top-8 of 256 experts by
``|randn| + 1`` scores; the very rows and routing ``epcomm bench`` uses (the native layer
generates them with the same generator and seed). Metric: bytes received per rank, its own
rows included (BF16: ``rows * hidden * 2``; FP8: ``rows * hidden * (1 + 4 / 128)``), divided by
the median of ``--iters`` CUDA-event timings, each after an L2 flush (a 256 MB write). As in
``epcomm bench``, dispatches are timed without a host wait (``num_worst_tokens``, zero-copy
views: the op itself, no copy out), combine from the rows of a host-synchronised dispatch, and
a GPU spin before each timed call keeps the host's Python work out of the measurement.

Launch: one process per GPU is started here (``--world``, default every GPU); under torchrun
(``RANK`` set) each process is one rank. Rank 0 prints the report on stdout; everything else
goes to stderr.

Exit status: 0 success; 1 a worker failed; 2 invalid flags; 3 the machine cannot run it (no
PyTorch with CUDA, no CUDA driver, no GPU), said in one line before any worker starts, as
``epcomm bench`` does.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

SCHEMA = "epcomm-bench/2"
SEED = 2025
FLUSH_BYTES = 256 << 20
OPS = [
    ("dispatch_fp8", "dispatch FP8"),
    ("dispatch_bf16", "dispatch BF16"),
    ("cached_dispatch_bf16", "cached dispatch BF16"),
    ("combine_bf16", "combine BF16"),
    ("combine_bf16_in_place", "combine BF16 in place"),
]
RESULTS_ENV = "EPCOMM_BENCH_RESULTS"


#: Exit status when the machine cannot run the benchmark (no torch, no CUDA driver, no GPU):
#: the code ``epcomm bench`` uses for the same cases (docs/cli.md).
EXIT_ENVIRONMENT = 3
#: Exit status of invalid flags (argparse's, as ``epcomm bench``).
EXIT_USAGE = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m epcomm.bench",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--world", type=int, help="ranks (processes, round-robin over the GPUs); default: every GPU")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=7168, help="elements per token row (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default: %(default)s)")
    p.add_argument(
        "--experts", type=int, default=256, help="experts in total, a multiple of the world size (default: %(default)s)"
    )
    p.add_argument("--sms", type=int, default=24, help="SMs (blocks) per op (default: %(default)s)")
    p.add_argument(
        "--transport",
        default="ipc",
        help="transport spec: ipc, nvshmem, nvshmem:vnodes=N, nvshmem:vnodes=max, proxy-ce[:vnodes=N], "
        "proxy-verbs[:vnodes=N] (default: %(default)s)",
    )
    p.add_argument("--schedule", default="epoch", help="epoch or global (default: %(default)s)")
    p.add_argument("--routes", default="auto", help="auto or put-signal (default: %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per op (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per op first (default: %(default)s)")
    p.add_argument("--no-verify", action="store_true", help="skip checking one round against a torch reference")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the results as JSON")
    out.add_argument("--csv", action="store_true", help="print the results as CSV")
    a = p.parse_args(argv)
    for name in ("tokens", "hidden", "top_k", "experts", "sms", "iters"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if a.warmup < 0 or (a.world is not None and a.world <= 0):
        p.error("--warmup must be >= 0 and --world > 0")
    return a


def environment_problem():
    """Why this machine cannot run the benchmark (one line), or None: PyTorch missing or
    without CUDA, no CUDA driver, no GPU. Checked before any worker starts."""
    from . import _native

    try:
        import torch
    except ImportError as e:
        return f"needs PyTorch with CUDA support, which does not import here ({e})"
    if not _native.driver_present():
        return "no CUDA driver: the driver library (libcuda.so.1) is not found by the dynamic loader"
    try:
        count = torch.cuda.device_count()
    except Exception as e:  # a broken CUDA install: say so in one line
        return f"torch cannot count the GPUs ({e})"
    if count < 1:
        return "no GPU: torch.cuda.device_count() is 0 (is CUDA_VISIBLE_DEVICES hiding them?)"
    return None


def cannot_run(why):
    """Exits with :data:`EXIT_ENVIRONMENT` after one line on stderr, as ``epcomm bench``."""
    print(f"python -m epcomm.bench: cannot run here: {why}", file=sys.stderr)
    sys.exit(EXIT_ENVIRONMENT)


# ----------------------------------------------------------------------------------------------
# Launcher


def launch(args, argv):
    """Starts one worker per rank, waits, prints rank 0's report. Exits with
    :data:`EXIT_ENVIRONMENT` (one line) when the machine cannot run it, before any worker."""
    why = environment_problem()
    if why:
        cannot_run(why)
    import torch

    world = args.world or torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, results = tempfile.mkstemp(prefix="epcomm-bench-", suffix=".json")
    os.close(fd)
    try:
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            env[RESULTS_ENV] = results
            # The copy-engine proxy needs a hardware queue per stream it waits on (the library
            # refuses too few, under MPS an unset value): what the Rust launchers set too.
            env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
            procs.append(subprocess.Popen([sys.executable, "-m", "epcomm.bench", *argv], env=env, stdout=sys.stderr))
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"epcomm.bench: worker(s) {[r for r, c in enumerate(codes) if c]} failed")
        with open(results) as f:
            report = json.load(f)
    finally:
        os.unlink(results)
    sys.stdout.write(render(report, args))


def render(report, args):
    """The report as `epcomm bench` prints it."""
    c, rows = report["config"], report["results"]
    if args.json:
        return json.dumps(report, indent=2) + "\n"
    if args.csv:
        head = "op,sms,time_us,gbps,recv_rows,world,transport,schedule,routes,tokens,hidden,top_k,experts,iters,warmup\n"
        return head + "".join(
            f"{r['op']},{r['sms']},{r['time_us']:.3f},{r['gbps']:.3f},{r['recv_rows']},{c['world']},{c['transport']},"
            f"{c['schedule']},{c['routes']},{c['tokens']},{c['hidden']},{c['top_k']},{c['experts']},{c['iters']},"
            f"{c['warmup']}\n"
            for r in rows
        )
    names = dict(OPS)
    lines = [
        f"epcomm bench (Python API): {c['world']} x {c['gpu_name']} ({c['gpu_sms']} SMs each), {c['transport']} "
        f"transport, {c['schedule']} schedule, {c['routes']} routes",
        f"{c['tokens']} tokens/rank, hidden {c['hidden']}, top-{c['top_k']} of {c['experts']} experts; median of "
        f"{c['iters']} calls after {c['warmup']} warm-up, L2 flushed between calls",
        "GB/s: DeepEP's metric on rank 0 (received bytes incl. self / time)",
        f"{'op':<22} {'SMs':>5} {'us':>10} {'GB/s':>10} {'us per rank':>24}",
    ]
    for r in rows:
        per = " / ".join(f"{v:.1f}" for v in r["rank_time_us"])
        lines.append(f"{names.get(r['op'], r['op']):<22} {r['sms']:>5} {r['time_us']:>10.1f} {r['gbps']:>10.1f} {per:>24}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Worker


def metric_bytes(op, rows, hidden):
    """DeepEP's bytes for `rows` received rows (as `epcomm bench`)."""
    bf16 = rows * hidden * 2
    return bf16 * (1 + 4 / 128) / 2 if op == "dispatch_fp8" else bf16


def median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def workload(rank, args, device):
    """Rank `rank`'s inputs, as `epcomm bench` makes them."""
    import torch

    from . import _native

    w = _native.deepep_workload(args.tokens, args.hidden, args.top_k, args.experts, SEED, rank)

    def tensor(key, dtype, shape):
        return torch.frombuffer(bytearray(w[key]), dtype=dtype).view(*shape).to(device)

    t, h, k = args.tokens, args.hidden, args.top_k
    out = {
        "x": tensor("x", torch.bfloat16, (t, h)),
        "topk_idx": tensor("topk_idx", torch.int64, (t, k)),
        "topk_weights": tensor("topk_weights", torch.float32, (t, k)),
    }
    if h % 128 == 0:
        out["x_fp8"] = tensor("x_fp8", torch.uint8, (t, h)).view(torch.float8_e4m3fn)
        out["scales"] = tensor("scales", torch.float32, (t, h // 128))
    return out


def verify(buf, args, rank, world, mine):
    """One BF16 dispatch and combine against a torch reference of every rank's workload."""
    import torch

    epr = args.experts // world
    lo, hi = rank * epr, (rank + 1) * epr
    inputs = [workload(s, args, "cpu") for s in range(world)]
    want_rows = []
    for inp in inputs:
        local = (inp["topk_idx"] >= lo) & (inp["topk_idx"] < hi)
        want_rows.append(inp["x"][local.any(1)])
    recv_x, recv_idx, _, _, handle, _ = buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"])
    if not torch.equal(recv_x.cpu().view(torch.int16), torch.cat(want_rows).view(torch.int16)):
        raise SystemExit(f"rank {rank}: dispatched rows differ from the reference")
    out = buf.combine(recv_x, handle)[0]
    acc = torch.zeros((args.tokens, args.hidden), dtype=torch.float32)
    for r in range(world):
        sent = ((mine["topk_idx"].cpu() >= r * epr) & (mine["topk_idx"].cpu() < (r + 1) * epr)).any(1)
        acc[sent] += mine["x"].cpu()[sent].float()
    if not torch.equal(out.cpu().view(torch.int16), acc.to(torch.bfloat16).view(torch.int16)):
        raise SystemExit(f"rank {rank}: combined tokens differ from the reference")


def worker(args):
    # Under torchrun nothing checked the machine first.
    why = environment_problem()
    if why:
        cannot_run(why)
    import torch
    import torch.distributed as dist

    import epcomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    say(f"[1/4] DeepEP workload: {args.tokens} tokens/rank, hidden {args.hidden}, top-{args.top_k} of {args.experts} experts")
    buf = epcomm.Buffer(
        None,
        max_tokens_per_rank=args.tokens,
        hidden=args.hidden,
        num_topk=args.top_k,
        num_experts=args.experts,
        num_sms=args.sms,
        transport=args.transport,
        schedule=args.schedule,
        routes=args.routes,
        enable_cuda_graphs=False,
    )
    mine = workload(rank, args, device)
    if not args.no_verify:
        say("[2/4] verifying one BF16 dispatch + combine against a torch reference")
        verify(buf, args, rank, world, mine)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine["topk_idx"], args.experts)
    _, _, _, _, handle, _ = buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"])
    rows = handle.num_recv_tokens
    y = torch.full((rows, args.hidden), 0.5, dtype=torch.bfloat16, device=device)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    worst = buf.capacity
    fp8 = args.hidden % 128 == 0

    def run(op):
        if op in ("dispatch_bf16", "dispatch_fp8"):
            x = (mine["x_fp8"], mine["scales"]) if op == "dispatch_fp8" else mine["x"]
            buf.dispatch(
                x,
                topk_idx=mine["topk_idx"],
                topk_weights=mine["topk_weights"],
                is_token_in_rank=in_rank,
                num_worst_tokens=worst,
                zero_copy=True,
            )
        elif op == "cached_dispatch_bf16":
            buf.dispatch(mine["x"], handle=handle, zero_copy=True)
        elif op == "combine_bf16":
            buf.combine(y, handle)
        else:
            buf.combine_in_place(handle)

    def time_op(op, iters):
        if op == "combine_bf16_in_place":
            # In-place combine reads the latest dispatch's rows: make this handle's the latest.
            buf.dispatch(mine["x"], handle=handle, zero_copy=True)
        events = []
        for _ in range(iters):
            flush.zero_()
            torch.cuda._sleep(1_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(op)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in events]

    say(f"[3/4] timing with {args.sms} SMs ({args.warmup} warm-up + {args.iters} timed calls per op, L2 flushed between calls)")
    results = []
    for op, _ in OPS:
        if op == "dispatch_fp8" and not fp8:
            continue
        time_op(op, args.warmup)
        t = median(time_op(op, args.iters))
        times = [None] * world
        dist.all_gather_object(times, t)
        gbps = metric_bytes(op, rows, args.hidden) / (times[0] * 1e-6) / 1e9
        results.append(dict(op=op, sms=args.sms, time_us=times[0], gbps=gbps, recv_rows=rows, rank_time_us=times))
    say("[4/4] done")
    if rank == 0:
        props = torch.cuda.get_device_properties(device)
        report = dict(
            schema=SCHEMA,
            config=dict(
                world=world,
                transport=buf.transport,
                schedule=buf.schedule,
                routes=buf.routes,
                tokens=args.tokens,
                hidden=args.hidden,
                top_k=args.top_k,
                experts=args.experts,
                sms=[args.sms],
                iters=args.iters,
                warmup=args.warmup,
                fp8=fp8,
                gpu_sms=props.multi_processor_count,
                gpu_name=props.name,
            ),
            results=results,
        )
        path = os.environ.get(RESULTS_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(report, f)
        else:
            sys.stdout.write(render(report, args))
    buf.destroy()
    dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
