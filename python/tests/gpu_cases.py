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
    """zero_copy views equal the copies; combine_in_place over the views matches combine."""
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
    buf.destroy()
    ctx.log("zero copy + in-place combine: ok")


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
        assert rank == late and e.origin != late, (rank, str(e))
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
