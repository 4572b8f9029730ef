"""The GPU test cases, each run by every rank in its own process (`gpu_worker.py`, launched by
`test_gpu.py`). A case raises on any mismatch; every comparison is exact (bit for bit) against
the plain-torch reference (`reference.py`)."""

import os
import time

import torch
import torch.distributed as dist

import epcomm
import reference as ref


class Ctx:
    """The worker's rank, world, GPU and the transport configuration under test."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.cuda.current_device()
        self.transport = os.environ.get("EPCOMM_TEST_TRANSPORT", "ipc")
        self.schedule = os.environ.get("EPCOMM_TEST_SCHEDULE", "epoch")
        self.routes = os.environ.get("EPCOMM_TEST_ROUTES", "auto")
        self.small = os.environ.get("EPCOMM_TEST_SMALL") == "1"

    def buffer(self, max_tokens, hidden, top_k, experts, **kw):
        kw.setdefault("timeout", 20.0)
        return epcomm.Buffer(
            None,
            max_tokens_per_rank=max_tokens,
            hidden=hidden,
            num_topk=top_k,
            num_experts=experts,
            transport=self.transport,
            schedule=self.schedule,
            routes=self.routes,
            **kw,
        )

    def log(self, msg):
        if self.rank == 0:
            print(f"[rank 0] {msg}", flush=True)


def same(name, got, want):
    """Exact equality (bitwise for floats of the same dtype), with a readable failure."""
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    if got.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        g, w = got.view(torch.uint8 if got.element_size() == 1 else torch.int16), want.view(
            torch.uint8 if want.element_size() == 1 else torch.int16
        )
    elif got.dtype == torch.float32:
        g, w = got.view(torch.int32), want.view(torch.int32)
        # 0.0 and -0.0 are the same weight.
        g, w = torch.where(got == 0, 0, g), torch.where(want == 0, 0, w)
    else:
        g, w = got, want
    if not torch.equal(g, w):
        bad = torch.nonzero(g != w)
        raise AssertionError(f"{name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}")


def expect_raises(cls, fn, argument=None):
    """`fn()` must raise `cls` (naming `argument`, when given); returns the exception."""
    try:
        fn()
    except cls as e:
        if argument is not None and getattr(e, "argument", None) != argument:
            raise AssertionError(f"{cls.__name__} names {getattr(e, 'argument', None)!r}, expected {argument!r}: {e}")
        return e
    raise AssertionError(f"expected {cls.__name__}" + (f" naming {argument}" if argument else ""))


# ----------------------------------------------------------------------------------------------
# The shapes of the Rust suite (crates/epcomm-check/tests/gpu.rs)


def groups(world):
    """``(hidden, top_k, experts_per_rank, max_tokens, cases)``; a case is ``(tokens per rank,
    mask, skew_to, fp8, weights, num_worst_tokens or None (host sync), expert_alignment)``."""
    cap = lambda m: m * world  # noqa: E731
    return [
        (
            7168,
            8,
            256 // min(world, 256),
            4096,
            [
                ([4096] * world, 0.0, None, False, True, None, 1),
                ([4096] * world, 0.0, None, True, True, None, 1),
                ([1 if r == 0 else 0 for r in range(world)], 0.0, None, False, True, None, 1),
                ([777 + 100 * r for r in range(world)], 0.1, None, False, True, cap(4096), 1),
                ([0] * world, 0.0, None, False, True, None, 1),
            ],
        ),
        (
            128,
            1,
            1,
            64,
            [
                ([0] * world, 0.0, None, False, True, None, 1),
                ([1] * world, 0.0, None, True, True, None, 1),
                ([3 + 14 * r for r in range(world)], 0.3, None, False, True, None, 4),
                ([64] * world, 0.0, None, True, False, None, 1),
            ],
        ),
        (
            2056,
            9,
            144,
            512,
            [
                ([333 + r for r in range(world)], 0.2, None, False, True, None, 1),
                # Bounded below the capacity: the most any rank can receive.
                ([511 - r for r in range(world)], 0.0, None, False, True, sum(511 - r for r in range(world)), 1),
            ],
        ),
        (
            512,
            4,
            8,
            1024,
            [
                ([1000 + 7 * r for r in range(world)], 0.0, 0, False, True, None, 1),
                ([1000 - 3 * r for r in range(world)], 0.0, world - 1, True, True, cap(1024), 1),
            ],
        ),
        (
            256,
            3,
            3,
            16384,
            [
                ([16384] * world, 0.05, None, False, True, None, 1),
                ([16384] * world, 0.0, None, True, True, cap(16384), 1),
            ],
        ),
    ]


def check_round(ctx, buf, all_inputs, experts, fp8, weights, worst, alignment, pass_layout):
    """One verified round on `buf`: layout, dispatch, cached dispatch, combine."""
    rank, world, dev = ctx.rank, ctx.world, ctx.device
    mine = all_inputs[rank]
    hidden, top_k = mine.x.shape[1], mine.topk_idx.shape[1]
    received = [ref.dispatch(all_inputs, r, experts) for r in range(world)]
    want = received[rank]
    idx = mine.topk_idx.to(dev)
    w = mine.topk_weights.to(dev) if weights else None
    x = (mine.x_fp8.to(dev), mine.scales.to(dev)) if fp8 else mine.x.to(dev)

    per_rank, rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, experts)
    assert rdma is None and ev.event is None
    want_rank, want_expert, want_in = ref.layout(mine.topk_idx, experts, world)
    same("num_tokens_per_rank", per_rank, want_rank)
    same("num_tokens_per_expert", per_expert, want_expert)
    same("is_token_in_rank", in_rank, want_in)

    kwargs = dict(topk_idx=idx, topk_weights=w, expert_alignment=alignment, num_worst_tokens=worst or 0)
    if pass_layout:
        kwargs.update(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, recv_idx, recv_w, per_expert_list, handle, ev = buf.dispatch(x, **kwargs)
    n = want.topk_idx.shape[0]
    rows = n if worst is None else worst
    if fp8:
        rx, rs = recv_x
        assert rx.shape == (rows, hidden) and rs.shape == (rows, hidden // 128)
        same("recv_x (fp8)", rx[:n], want.x_fp8)
        same("recv_x scales", rs[:n], want.scales)
    else:
        assert recv_x.shape == (rows, hidden)
        same("recv_x", recv_x[:n], want.x)
    same("recv_topk_idx", recv_idx[:n], want.topk_idx)
    if worst is not None:
        assert handle.num_recv_tokens is None and per_expert_list == []
        same("recv_topk_idx padding", recv_idx[n:], torch.full((rows - n, top_k), -1, dtype=torch.int64))
    else:
        assert handle.num_recv_tokens == n
        aligned = [(c + alignment - 1) // alignment * alignment for c in want.per_expert]
        assert per_expert_list == aligned, (per_expert_list, aligned)
    if weights:
        same("recv_topk_weights", recv_w[:n], want.topk_weights)
        if worst is not None:
            same("recv_topk_weights padding", recv_w[n:], torch.zeros((rows - n, top_k)))
    else:
        assert recv_w is None

    # Cached dispatch: new rows along the same routing.
    x2 = mine.x.neg()
    got2, i2, w2, l2, h2, _ = buf.dispatch(x2.to(dev), handle=handle)
    assert (i2, w2, l2, h2) == (None, None, None, None)
    want2 = ref.dispatch([ref.RankInputs(i.x.neg(), i.topk_idx, i.topk_weights) for i in all_inputs], rank, experts)
    same("cached recv_x", got2[:n], want2.x)

    # Combine of every rank's expert output (and weights), against the reference sums.
    ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
    yws = [rec.topk_weights * 0.5 for rec in received] if weights else None
    y = torch.zeros((rows, hidden), dtype=torch.bfloat16)
    y[:n] = ys[rank]
    yw = None
    if weights:
        yw = torch.zeros((rows, top_k), dtype=torch.float32)
        yw[:n] = yws[rank]
        yw = yw.to(dev)
    out, out_w, ev = buf.combine(y.to(dev), handle, topk_weights=yw)
    want_x, want_w = ref.combine(received, ys, yws, rank, mine.x.shape[0], hidden, top_k)
    same("combined x", out, want_x)
    if weights:
        same("combined topk_weights", out_w, want_w)
    else:
        assert out_w is None


def suite(ctx):
    """Every shape of the Rust suite, several calls in a row on each Buffer."""
    for gi, (hidden, top_k, epr, max_tokens, cases) in enumerate(groups(ctx.world)):
        if ctx.small and hidden * max_tokens > 1 << 20:
            continue
        experts = epr * ctx.world
        buf = ctx.buffer(max_tokens, hidden, top_k, experts)
        for ci, (tokens, mask, skew, fp8, weights, worst, alignment) in enumerate(cases):
            fp8 = fp8 and hidden % 128 == 0
            all_inputs = [
                ref.make_inputs(r, tokens[r], hidden, top_k, experts, ctx.world, gi * 100 + ci, mask, skew)
                for r in range(ctx.world)
            ]
            t0 = time.time()
            check_round(ctx, buf, all_inputs, experts, fp8, weights, worst, alignment, pass_layout=ci % 2 == 0)
            ctx.log(
                f"{ctx.transport} {ctx.schedule} H={hidden} K={top_k} E={experts} tokens={tokens} mask={mask} "
                f"skew={skew} fp8={fp8} worst={worst}: ok ({time.time() - t0:.1f}s)"
            )
        buf.destroy()


# ----------------------------------------------------------------------------------------------
# Streams, events, CUDA graphs


def events(ctx):
    """async_finish / previous_event / allocate_on_comm_stream, ops issued from a side stream,
    and the EventOverlap context manager."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 256, 4, 8 * world, 96
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    all_inputs = [ref.make_inputs(r, tokens, hidden, top_k, experts, world, 7) for r in range(world)]
    received = [ref.dispatch(all_inputs, r, experts) for r in range(world)]
    mine, want = all_inputs[rank], received[rank]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Inputs produced on the side stream, consumed after an event.
        idx = mine.topk_idx.to(dev, non_blocking=False)
        x = mine.x.to(dev)
        before = epcomm.EventOverlap(torch.cuda.Event())
        before.event.record()
        per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(
            idx, experts, previous_event=before, async_finish=True, allocate_on_comm_stream=True
        )
        assert ev.event is not None
        recv_x, recv_idx, _, _, handle, ev = buf.dispatch(
            x,
            topk_idx=idx,
            is_token_in_rank=in_rank,
            num_tokens_per_rank=per_rank,
            num_tokens_per_expert=per_expert,
            previous_event=ev,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        ev.current_stream_wait()
        y = ref.expert_output(recv_x, rank)
        with buf.combine(y, handle, async_finish=True)[2] as done:
            pass
        out = buf.combine(y, handle, previous_event=done, async_finish=False)[0]
    side.synchronize()
    same("async recv_x", recv_x, want.x)
    same("async recv_topk_idx", recv_idx, want.topk_idx)
    ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
    same("async combine", out, ref.combine(received, ys, None, rank, tokens, hidden, top_k)[0])
    # A synchronous op has no event to wait for.
    ev = buf.combine(y, handle)[2]
    expect_raises(epcomm.InvalidArgumentError, ev.current_stream_wait, "event")
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.get_dispatch_layout(idx, experts, allocate_on_comm_stream=True),
        "allocate_on_comm_stream",
    )
    buf.destroy()
    ctx.log("events and streams: ok")


def graphs(ctx):
    """torch.cuda.graph capture of layout + dispatch (num_worst_tokens) + cached dispatch +
    combine, replayed with new inputs: every replay matches the reference, at either region
    parity, with eager dispatches between replays; host-synchronised dispatch is refused
    afterwards."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 256, 4, 8 * world, 96
    cap = world * tokens
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    static_x = torch.zeros((tokens, hidden), dtype=torch.bfloat16, device=dev)
    static_idx = torch.zeros((tokens, top_k), dtype=torch.int64, device=dev)
    static_w = torch.zeros((tokens, top_k), dtype=torch.float32, device=dev)

    def step(cached):
        _, _, _, in_rank, _ = buf.get_dispatch_layout(static_idx, experts)
        rx, ri, rw, _, h, _ = buf.dispatch(
            static_x, topk_idx=static_idx, topk_weights=static_w, is_token_in_rank=in_rank, num_worst_tokens=cap
        )
        outs = [rx, ri, rw]
        if cached:
            outs.append(buf.dispatch(static_x.neg(), handle=h)[0])
        y = (rx.float() * (rank + 1)).to(torch.bfloat16)
        outs.append(buf.combine(y, h)[0])
        return outs

    def load(seed):
        inputs = [ref.make_inputs(r, tokens, hidden, top_k, experts, world, seed, mask=0.1) for r in range(world)]
        static_x.copy_(inputs[rank].x)
        static_idx.copy_(inputs[rank].topk_idx)
        static_w.copy_(inputs[rank].topk_weights)
        return inputs

    def verify(inputs, outs, cached, what):
        received = [ref.dispatch(inputs, r, experts) for r in range(world)]
        want = received[rank]
        n = want.x.shape[0]
        same(f"{what} recv_x", outs[0][:n], want.x)
        same(f"{what} recv_topk_idx", outs[1][:n], want.topk_idx)
        same(f"{what} recv_topk_idx padding", outs[1][n:], torch.full((cap - n, top_k), -1, dtype=torch.int64))
        same(f"{what} recv_topk_weights", outs[2][:n], want.topk_weights)
        if cached:
            same(f"{what} cached recv_x", outs[3][:n], want.x.neg())
        ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
        same(f"{what} combine", outs[-1], ref.combine(received, ys, None, rank, tokens, hidden, top_k)[0])

    for cached in (False, True):
        # Warm-up (eager) on a side stream, as torch recommends: it also leaves the routing
        # state the capture reuses.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            inputs = load(300)
            verify(inputs, step(cached), cached, "warm-up")
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step(cached)
        for i in range(8):
            inputs = load(400 + i)
            g.replay()
            torch.cuda.synchronize()
            verify(inputs, outs, cached, f"graph ({'dispatch + cached' if cached else 'dispatch'}) replay {i}")
            if i % 3 == 1:
                # An eager dispatch between replays shifts the device's region parity.
                eager_inputs = load(500 + i)
                verify(eager_inputs, step(False), False, f"eager between replays {i}")
        ctx.log(f"graph with {'dispatch + cached dispatch' if cached else 'one dispatch'}: 8 replays verified")
        del g, outs
    e = expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.dispatch(static_x, topk_idx=static_idx),
        "num_worst_tokens",
    )
    assert "captured" in str(e), e
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.dispatch(static_x, topk_idx=static_idx, num_worst_tokens=cap, zero_copy=True),
        "zero_copy",
    )
    torch.cuda.synchronize()
    buf.destroy()


# ----------------------------------------------------------------------------------------------
# Extras: zero copy, in-place combine, stats


def zero_copy(ctx):
    """zero_copy views equal the copies; combine_in_place over the views matches combine;
    destroy() refuses while a view (or a slice of one) is alive, and works once they are
    dropped."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 512, 4, 8 * world, 200
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    inputs = [ref.make_inputs(r, tokens, hidden, top_k, experts, world, 11, mask=0.2) for r in range(world)]
    received = [ref.dispatch(inputs, r, experts) for r in range(world)]
    mine, want = inputs[rank], received[rank]
    rx, ri, rw, lst, h, _ = buf.dispatch(
        mine.x.to(dev), topk_idx=mine.topk_idx.to(dev), topk_weights=mine.topk_weights.to(dev), zero_copy=True
    )
    same("zero-copy recv_x", rx, want.x)
    same("zero-copy recv_topk_idx", ri, want.topk_idx)
    same("zero-copy recv_topk_weights", rw, want.topk_weights)
    assert lst == want.per_expert
    rx.copy_(ref.expert_output(rx, rank))
    rw.mul_(0.5)
    torch.cuda.synchronize()
    dist.barrier()
    out, out_w, _ = buf.combine_in_place(h, reduce_weights=True)
    ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
    yws = [rec.topk_weights * 0.5 for rec in received]
    want_x, want_w = ref.combine(received, ys, yws, rank, tokens, hidden, top_k)
    same("combine_in_place x", out, want_x)
    same("combine_in_place weights", out_w, want_w)
    # destroy() frees the receive rows the views read: refused on each rank (before any
    # collective step, so nothing is freed or waited for) while a tensor made from them lives.
    part = rx[:1]
    e = expect_raises(epcomm.InvalidArgumentError, buf.destroy, "destroy")
    assert "3 views" in str(e) and "zero-copy dispatch recv_topk_weights" in str(e) and ".clone()" in str(e), e
    del e, rx, ri, rw
    e = expect_raises(epcomm.InvalidArgumentError, buf.destroy, "destroy")
    assert "1 view of" in str(e) and "zero-copy dispatch recv_x" in str(e), e
    del e, part
    assert not buf.is_failed()
    buf.destroy()
    ctx.log("zero copy + in-place combine: ok; destroy refused while a view lived")


def rows_only(ctx):
    """A dispatch without topk_idx routes by is_token_in_rank and num_tokens_per_expert
    (DeepEP's form): the same rows, per-expert counts and combine as the dispatch with ids, no
    ids or weights received; BF16 and FP8, host-synchronised and worst-case counts, cached
    dispatch; missing routing or weights without ids raise naming them."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 256, 3, 4 * world, 97
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    bounded = sum(tokens - 13 * r for r in range(world))  # every token of round 3, below the capacity
    for rnd, (fp8, worst) in enumerate([(False, None), (True, None), (False, world * tokens), (True, bounded)]):
        inputs = [
            ref.make_inputs(
                r, tokens - 13 * r * (rnd % 2), hidden, top_k, experts, world, 40 + rnd, mask=0.25, skew_to=0 if rnd == 2 else None
            )
            for r in range(world)
        ]
        received = [ref.dispatch(inputs, r, experts) for r in range(world)]
        mine, want = inputs[rank], received[rank]
        want_rank, want_expert, want_in = ref.layout(mine.topk_idx, experts, world)
        x = (mine.x_fp8.to(dev), mine.scales.to(dev)) if fp8 else mine.x.to(dev)
        recv_x, ri, rw, lst, handle, _ = buf.dispatch(
            x,
            num_tokens_per_rank=want_rank.to(dev),
            is_token_in_rank=want_in.to(dev),
            num_tokens_per_expert=want_expert.to(dev),
            num_worst_tokens=worst or 0,
        )
        assert ri is None and rw is None, (ri, rw)
        n = want.topk_idx.shape[0]
        if fp8:
            same("rows-only recv_x (fp8)", recv_x[0][:n], want.x_fp8)
            same("rows-only recv_x scales", recv_x[1][:n], want.scales)
        else:
            same("rows-only recv_x", recv_x[:n], want.x)
        if worst is None:
            assert lst == want.per_expert, (lst, want.per_expert)
            assert handle.num_recv_tokens == n
        else:
            assert lst == [] and recv_x[0 if fp8 else slice(None)].shape[0] == worst
        x2 = mine.x.neg()
        got2, *_ = buf.dispatch(x2.to(dev), handle=handle)
        want2 = ref.dispatch([ref.RankInputs(i.x.neg(), i.topk_idx, i.topk_weights) for i in inputs], rank, experts)
        same("rows-only cached recv_x", got2[:n], want2.x)
        ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
        rows = n if worst is None else worst
        y = torch.zeros((rows, hidden), dtype=torch.bfloat16)
        y[:n] = ys[rank]
        out, out_w, _ = buf.combine(y.to(dev), handle)
        want_x, _ = ref.combine(received, ys, None, rank, mine.x.shape[0], hidden, top_k)
        same("rows-only combined x", out, want_x)
        assert out_w is None
        ctx.log(f"rows only fp8={fp8} worst={worst}: ok")
    mine = inputs[rank]
    _, want_expert, want_in = ref.layout(mine.topk_idx, experts, world)
    x = mine.x.to(dev)
    expect_raises(epcomm.InvalidArgumentError, lambda: buf.dispatch(x, is_token_in_rank=want_in.to(dev)), "num_tokens_per_expert")
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.dispatch(x, num_tokens_per_expert=want_expert.to(dev), is_token_in_rank=want_in.to(dev), topk_weights=mine.topk_weights.to(dev)),
        "topk_weights",
    )
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.dispatch(x, num_tokens_per_expert=want_expert.to(dev), is_token_in_rank=want_in.int().to(dev)),
        "is_token_in_rank",
    )
    buf.destroy()


def outputs_kept(ctx):
    """A combine leaves the dispatch's outputs as they are: zero-copy views of the receive rows
    (and their weights) read after a combine still hold what the dispatch delivered, with the
    default Buffer (host-synchronised counts, every peer mapped, the default SMs)."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 512, 4, 8 * world, 200
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    inputs = [ref.make_inputs(r, tokens, hidden, top_k, experts, world, 13, mask=0.2) for r in range(world)]
    received = [ref.dispatch(inputs, r, experts) for r in range(world)]
    mine, want = inputs[rank], received[rank]
    for zero_copy in (True, False):
        rx, ri, rw, _, h, _ = buf.dispatch(
            mine.x.to(dev), topk_idx=mine.topk_idx.to(dev), topk_weights=mine.topk_weights.to(dev), zero_copy=zero_copy
        )
        y = ref.expert_output(rx, rank)
        out, out_w, _ = buf.combine(y, h, topk_weights=rw * 0.5)
        torch.cuda.synchronize()
        same(f"recv_x after combine (zero_copy={zero_copy})", rx, want.x)
        same(f"recv_topk_weights after combine (zero_copy={zero_copy})", rw, want.topk_weights)
        ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
        yws = [rec.topk_weights * 0.5 for rec in received]
        want_x, want_w = ref.combine(received, ys, yws, rank, tokens, hidden, top_k)
        same(f"combine x (zero_copy={zero_copy})", out, want_x)
        same(f"combine weights (zero_copy={zero_copy})", out_w, want_w)
        dist.barrier()
    buf.destroy()
    ctx.log("dispatch outputs kept by combine: ok")


def ll_hook_order(ctx):
    """A low-latency receive hook runs after the work queued on the caller's current stream
    since its send phase (as if on that stream): an ``out`` tensor the caller fills there before
    calling the hook ends up holding the combine's result, not the fill."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, epr, max_tokens, tokens = 2048, 8, 4, 32, 32
    experts = epr * world
    buf = ctx.buffer(64, hidden, top_k, experts, num_max_dispatch_tokens_per_rank=max_tokens)
    rnd = LlRound(ctx, [tokens] * world, hidden, top_k, experts, max_tokens, 4242)
    x, idx, w = rnd.x.to(dev), rnd.idx.to(dev), rnd.w.to(dev)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, max_tokens, experts)
    given = torch.zeros((tokens, hidden), dtype=torch.bfloat16, device=dev)
    out, _, hook = buf.low_latency_combine(rnd.y(ctx), idx, w, handle, return_recv_hook=True, out=given)
    # Caller work on the current stream between the send phase and the hook: a long sleep, then
    # a write of `out` that the receive phase must come after.
    torch.cuda._sleep(200_000_000)
    given.fill_(float("nan"))
    hook()
    torch.cuda.synchronize()
    same("low-latency combine written after the caller's work", out, rnd.want_out)
    dist.barrier()
    del handle  # its src_info / layout_range view the receive set that destroy() frees
    buf.destroy()
    ctx.log("low-latency hook ordered after the current stream: ok")


def stats(ctx):
    """last_op_stats after a dispatch; with one GPU per rank, a delayed rank is named late."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 128, 2, 4 * world, 64
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    mine = ref.make_inputs(rank, tokens, hidden, top_k, experts, world, 5)
    x, idx = mine.x.to(dev), mine.topk_idx.to(dev)
    assert buf.last_op_stats() is None
    buf.dispatch(x, topk_idx=idx)
    st = buf.last_op_stats()
    assert st.op == "dispatch" and st.rank == rank and len(st.waits) == world, st
    assert 0 <= st.late_rank < world and st.total > 0, st
    if torch.cuda.device_count() >= world:
        late = world - 1
        dist.barrier()
        if rank == late:
            buf.inject_delay(0.002)
        buf.dispatch(x, topk_idx=idx)
        st = buf.last_op_stats()
        assert st.late_rank == late, str(st)
    buf.destroy()
    ctx.log("last_op_stats: ok")


# ----------------------------------------------------------------------------------------------
# Bad input and failures


def bad_inputs(ctx):
    """Every bad argument raises InvalidArgumentError naming it; nothing is launched."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 128, 2, 4 * world, 32
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    mine = ref.make_inputs(rank, tokens, hidden, top_k, experts, world, 3)
    x, idx, w = mine.x.to(dev), mine.topk_idx.to(dev), mine.topk_weights.to(dev)
    I = epcomm.InvalidArgumentError  # noqa: E741
    expect_raises(I, lambda: buf.get_dispatch_layout(idx.int(), experts), "topk_idx")
    expect_raises(I, lambda: buf.get_dispatch_layout(idx, experts + 1), "num_experts")
    expect_raises(I, lambda: buf.get_dispatch_layout(idx.cpu(), experts), "topk_idx")
    expect_raises(I, lambda: buf.get_dispatch_layout(idx[:, :1], experts), "topk_idx")
    expect_raises(I, lambda: buf.dispatch(x.float(), topk_idx=idx), "x")
    expect_raises(I, lambda: buf.dispatch(x[:, :64], topk_idx=idx), "x")
    expect_raises(I, lambda: buf.dispatch(x.t().contiguous().t(), topk_idx=idx), "x")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx[:-1]), "topk_idx")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double()), "topk_weights")
    expect_raises(I, lambda: buf.dispatch(x), "topk_idx")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx, config=epcomm.Config(buf.get_num_sms() + 1)), "config")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx, num_worst_tokens=-1), "num_worst_tokens")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx, expert_alignment=0), "expert_alignment")
    expect_raises(I, lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_rdma_rank=idx), "num_tokens_per_rdma_rank")
    big = torch.zeros((tokens + 1, hidden), dtype=torch.bfloat16, device=dev)
    big_idx = torch.zeros((tokens + 1, top_k), dtype=torch.int64, device=dev)
    expect_raises(I, lambda: buf.get_dispatch_layout(big_idx, experts), "num_tokens")
    expect_raises(I, lambda: buf.dispatch(big, topk_idx=big_idx), "num_tokens")
    # FP8 needs hidden % 128 == 0 (it is here) and scales of the right shape.
    x8 = x.to(torch.float8_e4m3fn)
    expect_raises(I, lambda: buf.dispatch((x8, torch.ones(tokens, 2, device=dev)), topk_idx=idx), "scales")
    expect_raises(I, lambda: buf.dispatch((x8,), topk_idx=idx), "x")
    # A good dispatch still works after all that, and its handle is checked by combine.
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx)
    expect_raises(I, lambda: buf.combine(recv_x, h, bias=recv_x), "bias")
    expect_raises(I, lambda: buf.combine(recv_x.float(), h), "x")
    expect_raises(I, lambda: buf.combine(torch.zeros((recv_x.shape[0] + 1, hidden), dtype=torch.bfloat16, device=dev), h), "x")
    expect_raises(I, lambda: buf.combine(recv_x, "handle"), "handle")
    expect_raises(I, lambda: buf.dispatch(x, handle=h, topk_idx=idx), "handle")
    out = buf.combine(recv_x, h)[0]
    assert out.shape == (tokens, hidden)
    other = ctx.buffer(tokens, hidden, top_k, experts)
    expect_raises(I, lambda: other.combine(recv_x, h), "handle")
    other.destroy()
    # Constructor arguments.
    expect_raises(I, lambda: epcomm.Buffer(None, 0, 1, max_tokens_per_rank=1, hidden=8, num_topk=1, num_experts=world), "num_rdma_bytes")
    expect_raises(I, lambda: epcomm.Buffer(None, 1, max_tokens_per_rank=tokens, hidden=hidden, num_topk=top_k, num_experts=experts), "num_nvl_bytes")
    expect_raises(I, lambda: epcomm.Buffer(None, max_tokens_per_rank=tokens, hidden=100, num_topk=top_k, num_experts=experts), "hidden")
    expect_raises(I, lambda: epcomm.Buffer(None, max_tokens_per_rank=tokens, hidden=hidden, num_topk=top_k, num_experts=experts, transport="tcp"), "transport")
    buf.destroy()
    expect_raises(epcomm.BufferFailedError, lambda: buf.dispatch(x, topk_idx=idx))
    ctx.log("bad inputs: every one refused, naming its argument")


def invalid_expert(ctx):
    """An expert id out of range is found on the device: InvalidExpertError on the rank that
    sent it, PeerFailedError (or the same error) on the others; the Buffer is failed
    everywhere and a new one works."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 128, 2, 4 * world, 16
    buf = ctx.buffer(tokens, hidden, top_k, experts, timeout=5.0)
    mine = ref.make_inputs(rank, tokens, hidden, top_k, experts, world, 9)
    x, idx = mine.x.to(dev), mine.topk_idx.to(dev)
    if rank == 0:
        idx[3, 1] = experts + 5
    try:
        buf.dispatch(x, topk_idx=idx)
        buf.synchronize()
    except epcomm.InvalidExpertError as e:
        assert rank == 0 and e.argument == "topk_idx" and e.value == experts + 5, e
    except epcomm.PeerFailedError as e:
        assert rank != 0 and e.origin == 0, e
    else:
        raise AssertionError(f"rank {rank}: a dispatch with an invalid expert id did not fail")
    assert buf.is_failed()
    expect_raises(epcomm.BufferFailedError, lambda: buf.dispatch(x, topk_idx=idx))
    buf.destroy()
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    idx = mine.topk_idx.to(dev)
    recv_x = buf.dispatch(x, topk_idx=idx)[0]
    all_inputs = [ref.make_inputs(r, tokens, hidden, top_k, experts, world, 9) for r in range(world)]
    same("recv_x on a new Buffer", recv_x, ref.dispatch(all_inputs, rank, experts).x)
    buf.destroy()
    ctx.log("invalid expert id: typed errors on every rank, a new Buffer works")


def timeout(ctx):
    """A stalled rank: the others get TimeoutError naming it (late_rank); it gets
    PeerFailedError; a new Buffer works."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, experts, tokens = 128, 2, 4 * world, 40
    late = world - 1
    buf = ctx.buffer(tokens, hidden, top_k, experts, timeout=0.3)
    mine = ref.make_inputs(rank, tokens, hidden, top_k, experts, world, 21)
    x, idx = mine.x.to(dev), mine.topk_idx.to(dev)
    buf.dispatch(x, topk_idx=idx, num_worst_tokens=world * tokens)
    buf.synchronize()
    dist.barrier()
    if rank == late:
        buf.inject_delay(1.5)
    try:
        # Worst-case receive sizes: the device wait (not the host's wait for the counts, which
        # cannot know which peer is missing) expires and names the late rank.
        buf.dispatch(x, topk_idx=idx, num_worst_tokens=world * tokens)
        buf.synchronize()
    except epcomm.TimeoutError as e:
        assert rank != late and e.late_rank == late, (rank, e.late_rank, str(e))
        assert isinstance(e, TimeoutError) and e.waited > 0
    except epcomm.PeerFailedError as e:
        # The late rank learns that a rank gave up waiting for it; from three ranks on, a
        # waiting rank may learn of another's timeout before its own: both name the late rank.
        assert (rank == late or world > 2) and e.origin != late, (rank, str(e))
        assert e.late_rank == late, (rank, e.late_rank, str(e))
    else:
        raise AssertionError(f"rank {rank}: a dispatch with a stalled peer did not fail")
    assert buf.is_failed()
    buf.destroy()
    buf = ctx.buffer(tokens, hidden, top_k, experts)
    buf.dispatch(x, topk_idx=idx)
    buf.synchronize()
    buf.destroy()
    ctx.log(f"stalled rank {late}: TimeoutError naming it on the others, PeerFailedError on it; a new Buffer works")


def config_mismatch(ctx):
    """Ranks that create their Buffers with different arguments all get ConfigMismatchError."""
    world, rank = ctx.world, ctx.rank
    e = expect_raises(
        epcomm.ConfigMismatchError,
        lambda: ctx.buffer(16 + rank, 128, 2, 4 * world),
    )
    assert e.field == "max_tokens_per_rank", e
    ctx.log("config mismatch: every rank refused")


CASES = {
    f.__name__: f
    for f in (suite, events, graphs, zero_copy, stats, bad_inputs, invalid_expert, timeout, config_mismatch)
}


# ----------------------------------------------------------------------------------------------
# Low-latency ops (decode): a plain-torch reference written here from the contract in
# docs/low-latency.md, checked bit for bit.

FP8_MAX = 448.0


def ll_inputs(rank, tokens, hidden, top_k, experts, world, seed):
    """One rank's low-latency inputs: ``make_inputs``' rows at varied magnitudes (token ``t``
    times ``1.7 * 2^(t % 5 - 2)``), the first 128-channel group of token 0 all zero (the
    ``1e-4`` amax floor), and about 15% of the ids ``-1``."""
    i = ref.make_inputs(rank, tokens, hidden, top_k, experts, world, seed, mask=0.15)
    f = torch.tensor([1.7 * 2.0 ** (t % 5 - 2) for t in range(tokens)], dtype=torch.float32).reshape(tokens, 1)
    x = (i.x.float() * f).to(torch.bfloat16)
    if tokens > 0:
        x[0, :128] = 0
    return x.contiguous(), i.topk_idx, i.topk_weights


def ll_cast(x, round_scale):
    """DeepEP's per-128-channel e4m3 cast of bf16 rows ``[n, hidden]``: ``amax = max(max |x|,
    1e-4)``; ``scale = amax / 448`` and ``q = e4m3(x * (448 / amax))``, or (`round_scale`)
    ``scale`` = the next power of two >= ``amax / 448`` and ``q = e4m3(x * (1 / scale))``.
    Every step is one f32 op; torch's float8_e4m3fn conversion rounds to nearest even, and the
    products are at most 448 up to one rounding (below 464, which torch still rounds to 448)."""
    n, h = x.shape
    g = x.float().view(n, h // 128, 128)
    amax = g.abs().amax(dim=-1).clamp(min=1e-4)
    if round_scale:
        s = amax / FP8_MAX
        b = s.view(torch.int32)
        # The exponent field raised by one with the mantissa cleared (0xff800000 as an i32).
        up = ((b & -0x800000) + 0x800000).view(torch.float32)
        scale = torch.where((b & 0x7FFFFF) == 0, s, up)
        mul = torch.ones_like(scale).div(scale)
    else:
        scale = amax / FP8_MAX
        # A tensor divided by a tensor: `scalar / tensor` is computed by torch as
        # `tensor.reciprocal() * scalar` (two roundings), not as the kernel's one f32 division.
        mul = torch.full_like(amax, FP8_MAX).div(amax)
    q = (g * mul.unsqueeze(-1)).view(n, h).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def ll_reference(all_idx, experts, world):
    """``(rows, where)``: ``rows[rank][l]`` lists the ``(source rank, source token)`` of every
    packed row of local expert ``l`` in order (source rank, then source token: one row per
    (token, k) naming the expert); ``where[(src, t, k)] = (rank, l, row)``."""
    epr = experts // world
    rows = [[[] for _ in range(epr)] for _ in range(world)]
    where = {}
    for src in range(world):
        for t, ks in enumerate(all_idx[src].tolist()):
            for k, e in enumerate(ks):
                if e < 0:
                    continue
                owner, l = e // epr, e % epr
                where[(src, t, k)] = (owner, l, len(rows[owner][l]))
                rows[owner][l].append((src, t))
    return rows, where


def ll_y(all_x, rows_of_rank, epr, cap, hidden):
    """A rank's expert outputs ``[epr, cap, hidden]`` bf16: packed row ``i`` of local expert
    ``l`` is its bf16 source row times ``l % 3 + 1`` (an f32 product rounded to bf16); rows past
    the count are zero."""
    y = torch.zeros((epr, cap, hidden), dtype=torch.bfloat16)
    for l, rows in enumerate(rows_of_rank):
        for i, (src, t) in enumerate(rows):
            y[l, i] = (all_x[src][t].float() * float(l % 3 + 1)).to(torch.bfloat16)
    return y


def ll_combined(rank, idx, w, where, ys, hidden):
    """``out[t] = sum over k (increasing, ids != -1) of f32(w[t, k]) * f32(y_k)``: one f32
    product and one f32 sum per k, from 0, rounded to bf16 once."""
    n, top_k = idx.shape
    out = torch.zeros((n, hidden), dtype=torch.bfloat16)
    for t in range(n):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for k in range(top_k):
            if int(idx[t, k]) < 0:
                continue
            owner, l, i = where[(rank, t, k)]
            acc = acc + w[t, k].float() * ys[owner][l, i].float()
        out[t] = acc.to(torch.bfloat16)
    return out


class LlRound:
    """One low-latency dispatch + combine of every rank, and its reference."""

    def __init__(self, ctx, tokens, hidden, top_k, experts, max_tokens, seed):
        world = ctx.world
        self.epr, self.cap, self.hidden = experts // world, world * max_tokens, hidden
        ins = [ll_inputs(r, tokens[r], hidden, top_k, experts, world, seed) for r in range(world)]
        self.all_x = [i[0] for i in ins]
        self.x, self.idx, self.w = ins[ctx.rank]
        self.rows, self.where = ll_reference([i[1] for i in ins], experts, world)
        self.ys = [ll_y(self.all_x, self.rows[r], self.epr, self.cap, hidden) for r in range(world)]
        self.want_out = ll_combined(ctx.rank, self.idx, self.w, self.where, self.ys, hidden)

    def counts(self, rank):
        return torch.tensor([len(r) for r in self.rows[rank]], dtype=torch.int32)

    def check_dispatch(self, ctx, what, recv, count, handle, fmt):
        """This rank's packed rows (and scales), counts, source indices and ranges."""
        mine = self.rows[ctx.rank]
        same(f"{what} recv_count", count, self.counts(ctx.rank))
        rx = recv if fmt == "bf16" else recv[0]
        want_dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        assert rx.dtype == want_dtype and tuple(rx.shape) == (self.epr, self.cap, self.hidden), (what, rx.dtype, rx.shape)
        if fmt != "bf16":
            rs = recv[1]
            assert rs.dtype == torch.float32 and tuple(rs.shape) == (self.epr, self.cap, self.hidden // 128), (what, rs.shape)
        src, rng = handle.src_info.cpu(), handle.layout_range.cpu()
        for l, rows in enumerate(mine):
            n = len(rows)
            if n:
                want = torch.stack([self.all_x[s][t] for s, t in rows])
            else:
                want = torch.empty((0, self.hidden), dtype=torch.bfloat16)
            if fmt == "bf16":
                same(f"{what} rows of local expert {l}", recv[l, :n], want)
            else:
                q, scales = ll_cast(want, fmt == "fp8-round")
                same(f"{what} e4m3 rows of local expert {l}", recv[0][l, :n], q)
                same(f"{what} scales of local expert {l}", recv[1][l, :n], scales)
            same(f"{what} src_info of local expert {l}", src[l, :n], torch.tensor([t for _, t in rows], dtype=torch.int32))
            first = 0
            for r in range(ctx.world):
                k = sum(1 for s, _ in rows if s == r)
                assert int(rng[l, r]) == (first << 32) | k, (what, "layout_range", l, r, int(rng[l, r]), first, k)
                first += k

    def y(self, ctx):
        return self.ys[ctx.rank].to(ctx.device)


def _busy(dev):
    """Some torch work on the current stream (between a send phase and its hook)."""
    a = torch.randn((512, 512), device=dev)
    for _ in range(4):
        a = torch.tanh(a @ a.t() / 512)
    return a


def low_latency(ctx):
    """low_latency_dispatch / low_latency_combine against the reference above: tokens 0, 1, 7
    and 128 (different per rank), top-k 1, 8 and 9, hidden 2048 and 7168, -1 ids, BF16, FP8 and
    FP8 with power-of-two scales; synchronous, async_finish and hook calls (torch work between
    each send phase and its hook); eight calls per Buffer, so both receive sets are used, with
    the previous dispatch's outputs checked again (and combined) after the next dispatch and
    handles two dispatches old refused; then the API's refusals."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    I = epcomm.InvalidArgumentError  # noqa: E741
    groups = [(2048, 1, 4), (2048, 9, 16), (7168, 8, 16)]
    sizes = [0, 1, 7, 128]
    fmts = ["bf16", "fp8", "fp8-round"]
    max_tokens = 128
    for gi, (hidden, top_k, epr) in enumerate(groups):
        experts = epr * world
        buf = ctx.buffer(64, hidden, top_k, experts, num_max_dispatch_tokens_per_rank=max_tokens)
        assert buf.num_max_dispatch_tokens_per_rank == max_tokens
        stats = torch.zeros(epr, dtype=torch.int32, device=dev)
        want_stats = torch.zeros(epr, dtype=torch.int32)
        history = []
        for c in range(8):
            tokens = [sizes[(c + r + gi) % len(sizes)] for r in range(world)]
            fmt = fmts[(c + gi) % len(fmts)]
            mode = ("sync", "hook", "async")[(c + gi) % 3]
            rnd = LlRound(ctx, tokens, hidden, top_k, experts, max_tokens, 1000 * gi + c)
            x, idx, w = rnd.x.to(dev), rnd.idx.to(dev), rnd.w.to(dev)
            # Every other FP8 pair of calls takes DeepEP's column-major scales.
            col = fmt != "bf16" and (c // 2) % 2 == 1
            kw = dict(
                use_fp8=fmt != "bf16",
                round_scale=fmt == "fp8-round",
                cumulative_local_expert_recv_stats=stats,
                column_major_scales=col,
            )
            what = f"H={hidden} K={top_k} call {c} ({fmt}, {mode}, tokens {tokens}, column-major scales {col})"
            if mode == "hook":
                recv, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, max_tokens, experts, return_recv_hook=True, **kw)
                assert ev.event is None and callable(hook)
                _busy(dev)
                # Until the hook ran, every other op is refused (on every rank alike: nothing
                # is launched).
                expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, max_tokens, experts), "hook")
                hook()
                expect_raises(I, hook, "hook")
            elif mode == "async":
                recv, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, max_tokens, experts, async_finish=True, **kw)
                assert hook is None and ev.event is not None
                ev.current_stream_wait()
            else:
                recv, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, max_tokens, experts, **kw)
                assert hook is None and ev.event is None
            assert handle.num_tokens == rnd.x.shape[0]
            if fmt != "bf16":
                cap, ns = world * max_tokens, hidden // 128
                want_strides = (ns * cap, 1, cap) if col else (cap * ns, ns, 1)
                assert recv[1].stride() == want_strides, (what, recv[1].stride(), want_strides)
            want_stats += rnd.counts(rank)
            rnd.check_dispatch(ctx, what, recv, count, handle, fmt)
            same(f"{what} cumulative_local_expert_recv_stats", stats, want_stats)
            if len(history) >= 2:
                # Two dispatches old: its receive set was written again.
                o_rnd, _, _, o_handle, _, _ = history[-2]
                expect_raises(
                    I,
                    lambda: buf.low_latency_combine(o_rnd.y(ctx), o_rnd.idx.to(dev), o_rnd.w.to(dev), o_handle),
                    "handle",
                )
            if history:
                # One dispatch old: still valid (the other receive set).
                p_rnd, p_recv, p_count, p_handle, p_fmt, p_what = history[-1]
                p_rnd.check_dispatch(ctx, f"{p_what}, after the next dispatch", p_recv, p_count, p_handle, p_fmt)
                out = buf.low_latency_combine(p_rnd.y(ctx), p_rnd.idx.to(dev), p_rnd.w.to(dev), p_handle)[0]
                same(f"{p_what} combine after the next dispatch", out, p_rnd.want_out)
            if mode == "hook":
                given = torch.full((rnd.x.shape[0], hidden), 7, dtype=torch.bfloat16, device=dev)
                out, ev, hook = buf.low_latency_combine(rnd.y(ctx), idx, w, handle, return_recv_hook=True, out=given)
                assert out is given and ev.event is None and callable(hook)
                _busy(dev)
                expect_raises(I, lambda: buf.low_latency_combine(rnd.y(ctx), idx, w, handle), "hook")
                hook()
            elif mode == "async":
                out, ev, hook = buf.low_latency_combine(rnd.y(ctx), idx, w, handle, async_finish=True)
                assert hook is None
                ev.current_stream_wait()
            else:
                out, ev, hook = buf.low_latency_combine(rnd.y(ctx), idx, w, handle)
                assert hook is None and ev.event is None
            assert out.shape == (rnd.x.shape[0], hidden) and out.dtype == torch.bfloat16
            same(f"{what} combine", out, rnd.want_out)
            history.append((rnd, recv, count, handle, fmt, what))
            ctx.log(f"low latency {what}: ok")
        # Normal-mode ops still work on a Buffer with low-latency memory.
        ins = [ref.make_inputs(r, 64, hidden, top_k, experts, world, 77) for r in range(world)]
        got = buf.dispatch(ins[rank].x.to(dev), topk_idx=ins[rank].topk_idx.to(dev))[0]
        same(f"H={hidden} K={top_k} normal dispatch after low-latency ops", got, ref.dispatch(ins, rank, experts).x)
        # The outputs and handles view the receive sets, which destroy() frees (it refuses while
        # they live).
        del history, recv, count, handle, p_recv, p_count, p_handle, o_handle
        buf.destroy()
    low_latency_refusals(ctx)


def ll_graph(ctx):
    """low_latency_dispatch + low_latency_combine captured into a torch CUDA graph after a warm-up,
    replayed with new data copied into the captured inputs (other tokens, routing and expert
    outputs per replay), BF16 and FP8: every replay bit-exact against the reference (packed rows,
    counts, source indices, ranges, combined rows); eager calls in between still right; a hook
    inside a capture raises naming return_recv_hook."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, epr, m = 2048, 8, 8, 64
    experts = epr * world
    tokens = [m - 5 * r for r in range(world)]
    buf = ctx.buffer(64, hidden, top_k, experts, num_max_dispatch_tokens_per_rank=m)
    for fi, fmt in enumerate(["bf16", "fp8"]):
        use_fp8 = fmt != "bf16"
        r0 = LlRound(ctx, tokens, hidden, top_k, experts, m, 500 + fi)
        sx, sidx, sw, sy = r0.x.to(dev), r0.idx.to(dev), r0.w.to(dev), r0.y(ctx)
        # Warm-up outside the capture (torch's advice; it also makes the views the capture uses).
        recv, count, handle, _, _ = buf.low_latency_dispatch(sx, sidx, m, experts, use_fp8=use_fp8)
        out, _, _ = buf.low_latency_combine(sy, sidx, sw, handle)
        torch.cuda.synchronize()
        r0.check_dispatch(ctx, f"graph warm-up {fmt}", recv, count, handle, fmt)
        same(f"graph warm-up {fmt} combined", out, r0.want_out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            recv, count, handle, _, _ = buf.low_latency_dispatch(sx, sidx, m, experts, use_fp8=use_fp8)
            out, _, _ = buf.low_latency_combine(sy, sidx, sw, handle)
        for i in range(4):
            r = LlRound(ctx, tokens, hidden, top_k, experts, m, 510 + 10 * fi + i)
            sx.copy_(r.x)
            sidx.copy_(r.idx)
            sw.copy_(r.w)
            sy.copy_(r.y(ctx))
            g.replay()
            torch.cuda.synchronize()
            r.check_dispatch(ctx, f"graph replay {i} {fmt}", recv, count, handle, fmt)
            same(f"graph replay {i} {fmt} combined", out, r.want_out)
            if i == 1:
                # An eager pair between replays (it writes the other receive set).
                e = LlRound(ctx, tokens, hidden, top_k, experts, m, 590 + fi)
                ex, eidx, ew = e.x.to(dev), e.idx.to(dev), e.w.to(dev)
                erecv, ecount, ehandle, _, _ = buf.low_latency_dispatch(ex, eidx, m, experts, use_fp8=use_fp8)
                eout, _, _ = buf.low_latency_combine(e.y(ctx), eidx, ew, ehandle)
                torch.cuda.synchronize()
                e.check_dispatch(ctx, f"eager between replays {fmt}", erecv, ecount, ehandle, fmt)
                same(f"eager between replays {fmt} combined", eout, e.want_out)
        ctx.log(f"low-latency graph {fmt}: 4 replays ok")
        del g
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            expect_raises(
                epcomm.InvalidArgumentError,
                lambda: buf.low_latency_dispatch(sx, sidx, m, experts, return_recv_hook=True),
                "return_recv_hook",
            )
    except RuntimeError:
        pass  # torch may reject the empty capture; the refusal above is what counts
    torch.cuda.synchronize()
    dist.barrier()
    # The captured and eager outputs and handles view the receive sets destroy() frees.
    del recv, count, handle, erecv, ecount, ehandle
    buf.destroy()


def low_latency_refusals(ctx):
    """Bad low-latency arguments raise InvalidArgumentError naming them; nothing is launched,
    and a good call works afterwards."""
    world, dev = ctx.world, ctx.device
    I = epcomm.InvalidArgumentError  # noqa: E741
    hidden, top_k, epr, m = 2048, 4, 4, 16
    experts = epr * world
    plain = ctx.buffer(16, hidden, top_k, experts)
    x = torch.zeros((m, hidden), dtype=torch.bfloat16, device=dev)
    idx = torch.arange(m * top_k, device=dev).reshape(m, top_k) % experts
    expect_raises(I, lambda: plain.low_latency_dispatch(x, idx, m, experts), "num_max_dispatch_tokens_per_rank")
    plain.destroy()
    expect_raises(I, lambda: ctx.buffer(16, hidden, top_k, experts, low_latency_mode=True), "low_latency_mode")
    buf = ctx.buffer(16, hidden, top_k, experts, num_max_dispatch_tokens_per_rank=m)
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, m + 1, experts), "num_max_dispatch_tokens_per_rank")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, m, experts * 2), "num_experts")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, m, experts, use_ue8m0=True), "use_ue8m0")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, round_scale=True), "round_scale")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx, m, experts, async_finish=True, return_recv_hook=True), "return_recv_hook")
    expect_raises(I, lambda: buf.low_latency_dispatch(x.float(), idx, m, experts), "x")
    expect_raises(I, lambda: buf.low_latency_dispatch(torch.cat([x, x[:1]]), torch.cat([idx, idx[:1]]), m, experts), "x")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx[:-1], m, experts), "topk_idx")
    expect_raises(I, lambda: buf.low_latency_dispatch(x, idx.int(), m, experts), "topk_idx")
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
    y = torch.zeros((epr, world * m, hidden), dtype=torch.bfloat16, device=dev)
    w = torch.ones((m, top_k), dtype=torch.float32, device=dev)
    expect_raises(I, lambda: buf.low_latency_combine(y, idx, w, handle, use_logfmt=True), "use_logfmt")
    expect_raises(I, lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=True), "zero_copy")
    expect_raises(I, lambda: buf.low_latency_combine(y[:, :-1], idx, w, handle), "x")
    expect_raises(I, lambda: buf.low_latency_combine(y, idx, w.double(), handle), "topk_weights")
    expect_raises(I, lambda: buf.low_latency_combine(y, idx[:-1], w, handle), "topk_idx")
    expect_raises(I, lambda: buf.low_latency_combine(y, idx, w, "handle"), "handle")
    expect_raises(I, lambda: buf.low_latency_combine(y, idx, w, handle, out=torch.zeros((m, hidden), device=dev)), "out")
    assert not hasattr(buf, "get_next_low_latency_combine_buffer")
    out = buf.low_latency_combine(y, idx, w, handle)[0]
    same("combine of zero rows", out, torch.zeros((m, hidden), dtype=torch.bfloat16))
    del recv, count, handle  # views of the receive set destroy() frees
    buf.destroy()
    ctx.log("low-latency refusals: every one named its argument")


CASES["low_latency"] = low_latency
CASES["low_latency_refusals"] = low_latency_refusals
CASES["ll_graph"] = ll_graph
CASES["outputs_kept"] = outputs_kept
CASES["rows_only"] = rows_only
CASES["ll_hook_order"] = ll_hook_order


# ----------------------------------------------------------------------------------------------
# Two tiers through the same Buffer (two_tier=True)


def _local_ranks(transport, world):
    """Ranks per logical node of `transport` on one host (``vnodes=N``; ``max``: one rank)."""
    for part in transport.split(":")[1:]:
        for opt in part.split(","):
            key, _, value = opt.partition("=")
            if key.strip() == "vnodes":
                return 1 if value.strip() == "max" else world // int(value)
    raise AssertionError(f"two-tier tests need a spec with vnodes (got {transport!r})")


def two_tier(ctx):
    """The same Buffer API over two tiers: dispatch (BF16, FP8, 0/1/odd tokens, -1 ids, skew),
    cached dispatch and combine with and without weights, bit-exact against the two-stage
    reference, several rounds on one Buffer (both region parities); the flat-only calls and
    ``num_worst_tokens`` refused naming their argument."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    local = _local_ranks(ctx.transport, world)
    hidden, top_k, experts, max_tokens = 256, 4, 4 * world, 96
    buf = ctx.buffer(max_tokens, hidden, top_k, experts, two_tier=True)
    assert buf.two_tier
    cases = [
        # tokens per rank, -1 probability, skew target, fp8, weights
        ([96] * world, 0.0, None, False, True),
        ([96] * world, 0.0, None, True, True),
        ([17 + 5 * r for r in range(world)], 0.2, None, False, True),
        ([1 if r == 0 else 0 for r in range(world)], 0.0, None, False, False),
        ([0] * world, 0.0, None, False, True),
        ([90 - r for r in range(world)], 0.05, world - 1, True, False),
        ([64] * world, 0.1, 0, False, True),
    ]
    for ci, (tokens, mask, skew, fp8, weights) in enumerate(cases):
        inputs = [
            ref.make_inputs(r, tokens[r], hidden, top_k, experts, world, 700 + ci, mask, skew) for r in range(world)
        ]
        mine = inputs[rank]
        received = [ref.dispatch(inputs, r, experts) for r in range(world)]
        want = received[rank]
        order = ref.two_stage_order(want, local)
        n = want.topk_idx.shape[0]
        x = (mine.x_fp8.to(dev), mine.scales.to(dev)) if fp8 else mine.x.to(dev)
        w = mine.topk_weights.to(dev) if weights else None
        recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(x, topk_idx=mine.topk_idx.to(dev), topk_weights=w)
        what = f"two-tier case {ci}"
        if fp8:
            same(f"{what} recv_x (fp8)", recv_x[0], want.x_fp8[order])
            same(f"{what} recv_x scales", recv_x[1], want.scales[order])
        else:
            same(f"{what} recv_x", recv_x, want.x[order])
        same(f"{what} recv_topk_idx", recv_idx, want.topk_idx[order])
        assert handle.num_recv_tokens == n and per_expert == want.per_expert, (per_expert, want.per_expert)
        if weights:
            same(f"{what} recv_topk_weights", recv_w, want.topk_weights[order])
        got2 = buf.dispatch((mine.x.neg()).to(dev), handle=handle)[0]
        # A cached dispatch has no host wait: an op that failed on the device (a proxy wait that
        # timed out, a peer's abort) is not raised by the call, and its copy-out then reads the
        # receive rows of the other parity (the first dispatch's). Raise the device failure
        # itself before comparing rows.
        buf.synchronize()
        want2 = ref.dispatch([ref.RankInputs(i.x.neg(), i.topk_idx, i.topk_weights) for i in inputs], rank, experts)
        same(f"{what} cached recv_x", got2, want2.x[order])
        ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(received)]
        yws = [rec.topk_weights * 0.5 for rec in received] if weights else None
        yw = yws[rank][order].to(dev) if weights else None
        out, out_w, _ = buf.combine(ys[rank][order].to(dev), handle, topk_weights=yw)
        want_x, want_w = ref.two_tier_combine(received, ys, yws, rank, tokens[rank], hidden, top_k, local)
        same(f"{what} combined x", out, want_x)
        if weights:
            same(f"{what} combined topk_weights", out_w, want_w)
        ctx.log(f"{ctx.transport} two-tier ({world // local} x {local}) tokens={tokens} fp8={fp8}: ok")

    idx = torch.zeros((max_tokens, top_k), dtype=torch.int64, device=dev)
    x = torch.zeros((max_tokens, hidden), dtype=torch.bfloat16, device=dev)
    expect_raises(epcomm.InvalidArgumentError, lambda: buf.get_dispatch_layout(idx, experts), "two_tier")
    expect_raises(epcomm.InvalidArgumentError, lambda: buf.route_plan(), "two_tier")
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: buf.dispatch(x, topk_idx=idx, num_worst_tokens=buf.capacity),
        "num_worst_tokens",
    )
    torch.cuda.synchronize()
    buf.destroy()
    # Low-latency memory is refused with two tiers, before the rendezvous.
    expect_raises(
        epcomm.InvalidArgumentError,
        lambda: ctx.buffer(max_tokens, hidden, top_k, experts, two_tier=True, num_max_dispatch_tokens_per_rank=8),
        "num_max_dispatch_tokens_per_rank",
    )


CASES["two_tier"] = two_tier
