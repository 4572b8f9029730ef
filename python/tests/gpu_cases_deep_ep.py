"""GPU cases of the drop-in ``deep_ep`` layer (``epcomm.deep_ep``), run by every rank in its own
process (`gpu_worker.py`, launched by `test_gpu_deep_ep.py`).

They issue the call sequences of DeepEP's own tests/test_intranode.py and
tests/test_low_latency.py (same keyword arguments, same tuple unpacking, ``Buffer.capture()``
as ``previous_event``, hooks, ``get_next_low_latency_combine_buffer``, ...) and check every
result bit for bit against the plain-torch references of `reference.py` (normal mode) and
`gpu_cases.py` (low latency), with DeepEP's layouts (column-major scales, packed UE8M0, the
6- and 5-element handles). The DeepEP ops run under DeepEP's test defaults
(``torch.set_default_dtype(torch.bfloat16)``, ``torch.set_default_device('cuda')``), so that
nothing in the layer may rely on torch's defaults. Each case counts its checks and fails when
it made none."""

import contextlib
import json
import os
import tempfile

import torch
import torch.distributed as dist

import epcomm
import epcomm.deep_ep as deep_ep
import reference as ref
from gpu_cases import LlRound, _busy, expect_raises, ll_cast, ll_combined, ll_inputs, ll_reference, ll_y, same

I = epcomm.InvalidArgumentError  # noqa: E741

_CHECKS = [0]


def check(name, got, want):
    """`same` (bit for bit), counted."""
    same(name, got, want)
    _CHECKS[0] += 1


def truth(name, cond):
    if not cond:
        raise AssertionError(name)
    _CHECKS[0] += 1


def refused(fn, argument, *words):
    """`fn()` raises InvalidArgumentError naming `argument` whose message has every one of
    `words` (counted)."""
    e = expect_raises(I, fn, argument)
    for w in words:
        if w not in str(e):
            raise AssertionError(f"{argument}: {w!r} not in {str(e)!r}")
    _CHECKS[0] += 1
    return e


def done(ctx, case, at_least):
    if _CHECKS[0] < at_least:
        raise AssertionError(f"{case}: only {_CHECKS[0]} checks ran (at least {at_least} expected)")
    ctx.log(f"{case}: {_CHECKS[0]} checks passed")


@contextlib.contextmanager
def torch_defaults(dtype, device):
    """torch's default dtype and device set to these around the block, restored after it."""
    old_dtype, old_device = torch.get_default_dtype(), torch.tensor([]).device
    torch.set_default_dtype(dtype)
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        torch.set_default_device(old_device)


def deepep_defaults():
    """DeepEP's test defaults (tests/utils.py init_dist) around the layer's calls."""
    return torch_defaults(torch.bfloat16, "cuda")


def plain_defaults():
    """torch's own defaults (float32, CPU) for building references inside `deepep_defaults`
    (seeded CPU generators refuse a CUDA default device)."""
    return torch_defaults(torch.float32, "cpu")


def group():
    return dist.group.WORLD


def column_major(t):
    """DeepEP's FP8 input scales: the same values, column-major (tests/test_intranode.py)."""
    return t.T.contiguous().T


# ----------------------------------------------------------------------------------------------
# Normal mode (tests/test_intranode.py)


class Normal:
    """One round of every rank's inputs and what this rank must receive and combine."""

    def __init__(self, ctx, tokens, hidden, top_k, experts, seed):
        world = ctx.world
        self.inputs = [
            ref.make_inputs(r, tokens[r], hidden, top_k, experts, world, seed, mask=0.1) for r in range(world)
        ]
        self.received = [ref.dispatch(self.inputs, r, experts) for r in range(world)]
        self.mine, self.want = self.inputs[ctx.rank], self.received[ctx.rank]
        self.layout = ref.layout(self.mine.topk_idx, experts, world)
        self.ys = [ref.expert_output(rec.x, r) for r, rec in enumerate(self.received)]
        self.yws = [rec.topk_weights for rec in self.received]
        self.combined = ref.combine(self.received, self.ys, self.yws, ctx.rank, tokens[ctx.rank], hidden, top_k)
        self.combined_no_w = ref.combine(self.received, self.ys, None, ctx.rank, tokens[ctx.rank], hidden, top_k)[0]
        # End row (exclusive) of each source rank's rows in this rank's receive order.
        counts = torch.bincount(self.want.src_rank, minlength=world)
        self.ends = torch.cumsum(counts, 0).to(torch.int32)
        self.n = self.want.x.shape[0]

    def x(self, dev, fp8):
        if fp8:
            return self.mine.x_fp8.to(dev), column_major(self.mine.scales.to(dev))
        return self.mine.x.to(dev)


def check_recv_x(what, recv_x, want, n, fp8, rows):
    if fp8:
        truth(f"{what}: FP8 recv_x is a (rows, scales) tuple", isinstance(recv_x, tuple) and len(recv_x) == 2)
        truth(f"{what}: {rows} rows", recv_x[0].shape[0] == rows and recv_x[1].shape[0] == rows)
        check(f"{what} recv_x (e4m3)", recv_x[0][:n], want.x_fp8)
        check(f"{what} recv_x scales", recv_x[1][:n], want.scales)
    else:
        truth(f"{what}: {rows} rows", recv_x.shape[0] == rows)
        check(f"{what} recv_x", recv_x[:n], want.x)


def check_handle(ctx, what, handle, rnd, in_rank):
    truth(f"{what}: the handle is a 6-tuple", isinstance(handle, tuple) and len(handle) == 6)
    rank_prefix_matrix = handle[0]
    truth(
        f"{what}: rank_prefix_matrix [world, world] int32",
        rank_prefix_matrix.dtype == torch.int32 and tuple(rank_prefix_matrix.shape) == (ctx.world, ctx.world),
    )
    check(f"{what} rank_prefix_matrix[:, rank]", rank_prefix_matrix[:, ctx.rank], rnd.ends)
    others = [r for r in range(ctx.world) if r != ctx.rank]
    if others:
        check(
            f"{what} rank_prefix_matrix other columns",
            rank_prefix_matrix[:, others],
            torch.full((ctx.world, len(others)), -1, dtype=torch.int32, device="cpu"),
        )
    truth(f"{what}: handle[1], [2], [5] are None", all(handle[i] is None for i in (1, 2, 5)))
    recv_src_idx = handle[3]
    n = rnd.want.src_token.shape[0]
    truth(f"{what}: handle[3] (recv_src_idx) int32, a row each", recv_src_idx.dtype == torch.int32 and recv_src_idx.shape[0] >= n)
    check(f"{what} handle[3] (recv_src_idx)", recv_src_idx[:n], rnd.want.src_token.to(torch.int32))
    check(f"{what} handle[4] (is_token_in_rank)", handle[4], in_rank)
    # DeepEP's check_data: rows of source rank i end at rank_prefix_matrix[i][rank].
    start = 0
    for i in range(ctx.world):
        end = rank_prefix_matrix[i][ctx.rank].item()
        truth(f"{what}: rows [{start}, {end}) come from rank {i}", bool((rnd.want.src_rank[start:end] == i).all()))
        start = end


def _intranode(ctx, fp8_modes, with_topk_modes, case):
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, epr = 2048, 8, 16
    experts = epr * world
    tokens = [300 + 17 * r for r in range(world)]
    worst_rows = max(tokens) * world
    rnd = Normal(ctx, tokens, hidden, top_k, experts, 31)
    rnd2 = Normal(ctx, tokens, hidden, top_k, experts, 32)  # rows for the cached dispatch
    want_rank, want_expert, want_in = rnd.layout
    # The second round's rows along the first round's routing: what a cached dispatch receives.
    cached_inputs = [
        ref.RankInputs(i2.x, i.topk_idx, i.topk_weights, i2.x_fp8, i2.scales) for i, i2 in zip(rnd.inputs, rnd2.inputs)
    ]
    want_cached = ref.dispatch(cached_inputs, rank, experts)
    saved_num_sms = deep_ep.Buffer.num_sms
    with deepep_defaults():
        buffer = deep_ep.Buffer(
            group(),
            int(2e9) // world,
            0,
            low_latency_mode=False,
            num_qps_per_rank=1,
            explicitly_destroy=True,
            allow_mnnvl=False,
            use_fabric=False,
        )
        truth("rank and group_size", (buffer.rank, buffer.group_size) == (rank, world))
        truth("no epcomm Buffer before the first op", buffer.runtime is None)
        topk_idx = rnd.mine.topk_idx.to(dev).to(deep_ep.topk_idx_t)
        topk_weights = rnd.mine.topk_weights.to(dev)
        layout = buffer.get_dispatch_layout(topk_idx, experts)
        truth("get_dispatch_layout: a 5-tuple, None second", len(layout) == 5 and layout[1] is None)
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = layout
        check("num_tokens_per_rank (torch path)", num_tokens_per_rank, want_rank)
        check("num_tokens_per_expert (torch path)", num_tokens_per_expert, want_expert)
        check("is_token_in_rank (torch path)", is_token_in_rank, want_in)
        num_sms = 24
        config = deep_ep.Config(num_sms, 8, 256)
        for previous_mode in (False, True):
            for async_mode in (False, True):
                for fp8 in fp8_modes:
                    for with_topk in with_topk_modes:
                        what = f"fp8={fp8} topk={with_topk} async={async_mode} previous={previous_mode}"
                        current_x = rnd.x(dev, fp8)
                        dispatch_args = {
                            "x": current_x,
                            "num_tokens_per_rank": num_tokens_per_rank,
                            "is_token_in_rank": is_token_in_rank,
                            "num_tokens_per_expert": num_tokens_per_expert,
                            "config": config,
                            "async_finish": async_mode,
                        }
                        if with_topk:
                            dispatch_args.update({"topk_idx": topk_idx, "topk_weights": topk_weights})
                        if previous_mode:
                            dispatch_args.update({"previous_event": buffer.capture()})
                            # The current stream runs on: only the event orders the op after its
                            # inputs (and after the copy of column-major FP8 scales it needs).
                            _busy(dev)
                        elif not async_mode:
                            # SGLang passes the layout's event on, also the empty one of a
                            # synchronous layout (DeepEP waits for nothing then).
                            dispatch_args.update({"previous_event": layout[4]})
                        recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(
                            **dispatch_args
                        )
                        truth(f"{what}: event iff async", (event.event is not None) == async_mode)
                        event.current_stream_wait() if async_mode else ()
                        check_recv_x(what, recv_x, rnd.want, rnd.n, fp8, rnd.n)
                        truth(f"{what}: per-expert list", recv_list == rnd.want.per_expert)
                        check_handle(ctx, what, handle, rnd, want_in)
                        if with_topk:
                            check(f"{what} recv_topk_idx", recv_topk_idx, rnd.want.topk_idx)
                            check(f"{what} recv_topk_weights", recv_topk_weights, rnd.want.topk_weights)
                            # num_worst_tokens != 0
                            dispatch_args.update({"num_worst_tokens": worst_rows})
                            wx, wi, ww, empty_list, _, event = buffer.dispatch(**dispatch_args)
                            event.current_stream_wait() if async_mode else ()
                            truth(f"{what} worst: empty list", len(empty_list) == 0)
                            check_recv_x(f"{what} worst", wx, rnd.want, rnd.n, fp8, worst_rows)
                            check(f"{what} worst topk_idx", wi[: rnd.n], rnd.want.topk_idx)
                            check(
                                f"{what} worst topk_idx padding",
                                wi[rnd.n :],
                                torch.full((worst_rows - rnd.n, top_k), -1, dtype=torch.int64, device="cpu"),
                            )
                            check(f"{what} worst topk_weights", ww[: rnd.n], rnd.want.topk_weights)
                        else:
                            truth(
                                f"{what}: no ids or weights without topk_idx",
                                recv_topk_idx is None and recv_topk_weights is None,
                            )
                            # Cached dispatch (DeepEP tests it without top-k).
                            cached_args = {
                                "x": rnd2.x(dev, fp8),
                                "handle": handle,
                                "config": config,
                                "async_finish": async_mode,
                            }
                            if previous_mode:
                                cached_args.update({"previous_event": buffer.capture()})
                            out = buffer.dispatch(**cached_args)
                            truth(
                                f"{what} cached: (recv_x, None, None, None, None, event)",
                                out[1:5] == (None, None, None, None),
                            )
                            out[5].current_stream_wait() if async_mode else ()
                            check_recv_x(f"{what} cached", out[0], want_cached, rnd.n, fp8, rnd.n)
                        combine_args = {
                            "x": rnd.ys[rank].to(dev),
                            "handle": handle,
                            "config": config,
                            "async_finish": async_mode,
                        }
                        if with_topk:
                            combine_args.update({"topk_weights": recv_topk_weights})
                        if previous_mode:
                            combine_args.update({"previous_event": buffer.capture()})
                        combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                        event.current_stream_wait() if async_mode else ()
                        check(f"{what} combined_x", combined_x, rnd.combined[0] if with_topk else rnd.combined_no_w)
                        if with_topk:
                            check(f"{what} combined_topk_weights", combined_topk_weights, rnd.combined[1])
                        else:
                            truth(f"{what}: no combined weights", combined_topk_weights is None)
                        ctx.log(f"{case} {what}: ok")
        core = buffer.runtime
        truth("the normal core runs with config.num_sms", core.get_num_sms() == num_sms)
        truth(
            "max_tokens_per_rank from num_nvl_bytes",
            epcomm.size_hint(world, core.max_tokens_per_rank, hidden, top_k, experts) <= int(2e9) // world,
        )
        # The layout on the core's kernel: the same numbers.
        per_rank2, _, per_expert2, in_rank2, _ = buffer.get_dispatch_layout(topk_idx, experts)
        check("num_tokens_per_rank (core path)", per_rank2, want_rank)
        check("num_tokens_per_expert (core path)", per_expert2, want_expert)
        check("is_token_in_rank (core path)", in_rank2, want_in)
        # Tuning as DeepEP's test does it: chunk sizes vary, the SMs may not.
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            rnd.x(dev, False),
            num_tokens_per_rank=per_rank2,
            is_token_in_rank=in_rank2,
            num_tokens_per_expert=per_expert2,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            config=config,
        )
        check("dispatch after the core's layout", recv_x, rnd.want.x)
        for fp8 in (False, True):
            got = buffer.dispatch(rnd2.x(dev, fp8), handle=handle, config=config)[0]
            check_recv_x(f"cached dispatch after a top-k dispatch (fp8={fp8})", got, want_cached, rnd.n, fp8, rnd.n)
        for chunk in (4, 16, 32):
            got = buffer.dispatch(rnd.x(dev, False), handle=handle, config=deep_ep.Config(num_sms, chunk, 256))[0]
            check(f"cached dispatch with nvl chunk {chunk}", got, rnd.want.x)
        refused(
            lambda: buffer.dispatch(rnd.x(dev, False), handle=handle, config=deep_ep.Buffer.get_dispatch_config(world)),
            "config",
            "24",
        )
        deep_ep.Buffer.set_num_sms(num_sms)
        got = buffer.dispatch(rnd.x(dev, False), handle=handle, config=deep_ep.Buffer.get_dispatch_config(world))[0]
        check("cached dispatch with get_dispatch_config", got, rnd.want.x)
        got = buffer.combine(rnd.ys[rank].to(dev), handle, config=deep_ep.Buffer.get_combine_config(world))[0]
        check("combine with get_combine_config", got, rnd.combined_no_w)
        # bias: one tensor, or two, added after the sum (one more bf16 rounding than DeepEP).
        g = torch.Generator(device="cpu").manual_seed(77 + rank)
        b0 = torch.randn((tokens[rank], hidden), generator=g, device="cpu", dtype=torch.float32).to(torch.bfloat16)
        b1 = torch.randn((tokens[rank], hidden), generator=g, device="cpu", dtype=torch.float32).to(torch.bfloat16)
        for bias, want_bias in (
            (b0.to(dev), b0.float()),
            ((b0.to(dev), b1.to(dev)), b0.float() + b1.float()),
            ((None, b1.to(dev)), b1.float()),
        ):
            for async_mode in (False, True):
                got, _, event = buffer.combine(rnd.ys[rank].to(dev), handle, bias=bias, async_finish=async_mode)
                event.current_stream_wait() if async_mode else ()
                check(
                    f"combine with bias (async={async_mode})",
                    got,
                    (want_bias + rnd.combined_no_w.float()).to(torch.bfloat16),
                )
        truth("the layer did not change Buffer.num_sms", deep_ep.Buffer.num_sms == num_sms)
        buffer.destroy()
        expect_raises(epcomm.BufferFailedError, lambda: buffer.dispatch(rnd.x(dev, False), handle=handle))
    deep_ep.Buffer.num_sms = saved_num_sms
    torch.cuda.synchronize()
    dist.barrier()


def deep_ep_intranode(ctx):
    """tests/test_intranode.py's sequence with top-k, BF16 and FP8 (column-major input
    scales): layout (torch and core paths), dispatch with previous events and async, handles,
    num_worst_tokens, combine, chunk-size tuning with one SM count, bias."""
    _intranode(ctx, (False, True), (True,), "deep_ep_intranode")
    done(ctx, "deep_ep_intranode", 80)


def deep_ep_intranode_fp8(ctx):
    """The FP8 dispatches alone (DeepEP's column-major scales in, row-major scales out), with
    top-k and num_worst_tokens."""
    _intranode(ctx, (True,), (True,), "deep_ep_intranode_fp8")
    done(ctx, "deep_ep_intranode_fp8", 40)


def deep_ep_intranode_no_topk(ctx):
    """test_intranode.py's dispatches without top-k first (routing by is_token_in_rank and
    num_tokens_per_expert; the core is created by such a dispatch, num_topk from the earlier
    get_dispatch_layout), cached dispatch and combine, then with top-k."""
    _intranode(ctx, (False, True), (False, True), "deep_ep_intranode_no_topk")
    done(ctx, "deep_ep_intranode_no_topk", 120)


# ----------------------------------------------------------------------------------------------
# Internode (tests/test_internode.py) over logical nodes: EPCOMM_DEEP_EP_NODE_SIZE ranks per node


def _node_size(ctx):
    size = int(os.environ.get("EPCOMM_DEEP_EP_NODE_SIZE", "0") or "0")
    if size < 1 or ctx.world % size or ctx.world // size < 2:
        raise AssertionError(
            f"deep_ep_internode needs EPCOMM_DEEP_EP_NODE_SIZE splitting the {ctx.world} ranks into at least two "
            f"nodes (got {size})"
        )
    return size


class Internode(Normal):
    """A Normal round as a group of ``world / local`` nodes of ``local`` ranks sees it: the same
    rows in the same (DeepEP's) order, combined in two stages (reference.two_tier_combine),
    and DeepEP's per-node counts."""

    def __init__(self, ctx, tokens, hidden, top_k, experts, seed, local):
        super().__init__(ctx, tokens, hidden, top_k, experts, seed)
        world, rank = ctx.world, ctx.rank
        nodes = world // local
        me = tokens[rank]
        self.combined = ref.two_tier_combine(self.received, self.ys, self.yws, rank, me, hidden, top_k, local)
        self.combined_no_w = ref.two_tier_combine(self.received, self.ys, None, rank, me, hidden, top_k, local)[0]
        in_rank = self.layout[2]
        self.per_node = in_rank.view(me, nodes, local).any(dim=2).sum(dim=0).to(torch.int32)
        # Tokens of node m's rank with this rank's local rank that go to this rank's node.
        rail = []
        for m in range(nodes):
            src = m * local + rank % local
            theirs = ref.layout(self.inputs[src].topk_idx, experts, world)[2]
            rail.append(int(theirs.view(tokens[src], nodes, local)[:, rank // local].any(dim=1).sum()))
        self.rdma_prefix = torch.cumsum(torch.tensor(rail, dtype=torch.int64), 0).to(torch.int32)


def check_internode_handle(ctx, what, handle, rnd, in_rank):
    truth(
        f"{what}: the handle is DeepEP's internode 10-tuple",
        isinstance(handle, deep_ep.buffer.InternodeHandle) and len(handle) == 10,
    )
    check(f"{what} handle[0] (is_token_in_rank)", handle[0], in_rank)
    check(f"{what} handle[4] (recv_rdma_rank_prefix_sum)", handle[4], rnd.rdma_prefix)
    recv_gbl_rank_prefix_sum = handle[-4]
    check(f"{what} handle[6] (recv_gbl_rank_prefix_sum)", recv_gbl_rank_prefix_sum, rnd.ends)
    truth(f"{what}: handle[1, 2, 3, 5, 7, 8, 9] are None", all(handle[i] is None for i in (1, 2, 3, 5, 7, 8, 9)))
    # test_internode.py's check_data: rows of source rank i end at recv_gbl_rank_prefix_sum[i].
    start = 0
    for i in range(ctx.world):
        end = recv_gbl_rank_prefix_sum[i].item()
        truth(f"{what}: rows [{start}, {end}) come from rank {i}", bool((rnd.want.src_rank[start:end] == i).all()))
        start = end
    truth(f"{what}: every row counted", start == rnd.n)


def deep_ep_internode(ctx):
    """tests/test_internode.py's sequence on 2+ logical nodes (EPCOMM_DEEP_EP_NODE_SIZE ranks
    each; the two-tier core over EPCOMM_DEEP_EP_TRANSPORT): get_dispatch_layout with
    num_tokens_per_rdma_rank, dispatch BF16 and FP8 (column-major input scales) with and
    without top-k, previous events and async, rows in DeepEP's order checked through
    recv_gbl_rank_prefix_sum, the ids, weights and per-expert counts, num_worst_tokens, cached
    dispatch, combine with weights and both biases against the two-stage reference, bit for bit;
    internode_dispatch / internode_combine called directly; refusals."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    local = _node_size(ctx)
    nodes = world // local
    hidden, top_k, epr = 2048, 8, 16
    experts = epr * world
    tokens = [300 + 17 * r for r in range(world)]
    worst_rows = max(tokens) * world
    rnd = Internode(ctx, tokens, hidden, top_k, experts, 41, local)
    rnd2 = Normal(ctx, tokens, hidden, top_k, experts, 42)  # rows for the cached dispatch
    want_rank, want_expert, want_in = rnd.layout
    cached_inputs = [
        ref.RankInputs(i2.x, i.topk_idx, i.topk_weights, i2.x_fp8, i2.scales) for i, i2 in zip(rnd.inputs, rnd2.inputs)
    ]
    want_cached = ref.dispatch(cached_inputs, rank, experts)
    g = torch.Generator(device="cpu").manual_seed(91 + rank)
    b0 = torch.ones((tokens[rank], hidden), dtype=torch.bfloat16)
    b1 = torch.randn((tokens[rank], hidden), generator=g, dtype=torch.float32).to(torch.bfloat16)
    want_bias = b0.float() + b1.float()
    with deepep_defaults():
        # epcomm's own keyword: a stalled wait fails in 20 s naming op, wait and peer (the
        # default 100 s outlasts a time-limited run).
        buffer = deep_ep.Buffer(
            group(), int(2e9) // world, int(1e9) // world, num_qps_per_rank=24, explicitly_destroy=True, timeout=20.0
        )
        truth("rank and group_size", (buffer.rank, buffer.group_size) == (rank, world))
        topk_idx = rnd.mine.topk_idx.to(dev).to(deep_ep.topk_idx_t)
        topk_weights = rnd.mine.topk_weights.to(dev)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
            buffer.get_dispatch_layout(topk_idx, experts)
        )
        check("num_tokens_per_rank", num_tokens_per_rank, want_rank)
        check("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, rnd.per_node)
        check("num_tokens_per_expert", num_tokens_per_expert, want_expert)
        check("is_token_in_rank", is_token_in_rank, want_in)
        num_sms = 24
        config = deep_ep.Config(num_sms, 8, 512, 16, 128)
        for previous_mode in (False, True):
            for async_mode in (False, True):
                for fp8 in (False, True):
                    for with_topk in (False, True):
                        what = f"internode fp8={fp8} topk={with_topk} async={async_mode} previous={previous_mode}"
                        dispatch_args = {
                            "x": rnd.x(dev, fp8),
                            "num_tokens_per_rank": num_tokens_per_rank,
                            "num_tokens_per_rdma_rank": num_tokens_per_rdma_rank,
                            "is_token_in_rank": is_token_in_rank,
                            "num_tokens_per_expert": num_tokens_per_expert,
                            "config": config,
                            "async_finish": async_mode,
                        }
                        if with_topk:
                            dispatch_args.update({"topk_idx": topk_idx, "topk_weights": topk_weights})
                        if previous_mode:
                            dispatch_args.update({"previous_event": buffer.capture()})
                            _busy(dev)
                        recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(
                            **dispatch_args
                        )
                        truth(f"{what}: event iff async", (event.event is not None) == async_mode)
                        event.current_stream_wait() if async_mode else ()
                        check_recv_x(what, recv_x, rnd.want, rnd.n, fp8, rnd.n)
                        truth(f"{what}: per-expert list {recv_list}", recv_list == rnd.want.per_expert)
                        check_internode_handle(ctx, what, handle, rnd, want_in)
                        if with_topk:
                            check(f"{what} recv_topk_idx", recv_topk_idx, rnd.want.topk_idx)
                            check(f"{what} recv_topk_weights", recv_topk_weights, rnd.want.topk_weights)
                            for i, count in enumerate(recv_list):
                                truth(f"{what}: expert {i} count", recv_topk_idx.eq(i).sum().item() == count)
                            dispatch_args.update({"num_worst_tokens": worst_rows})
                            wx, wi, ww, empty_list, whandle, event = buffer.dispatch(**dispatch_args)
                            event.current_stream_wait() if async_mode else ()
                            truth(f"{what} worst: empty list", len(empty_list) == 0)
                            check_recv_x(f"{what} worst", wx, rnd.want, rnd.n, fp8, worst_rows)
                            check(f"{what} worst topk_idx", wi[: rnd.n], rnd.want.topk_idx)
                            check(
                                f"{what} worst topk_idx padding",
                                wi[rnd.n :],
                                torch.full((worst_rows - rnd.n, top_k), -1, dtype=torch.int64, device="cpu"),
                            )
                            check(f"{what} worst topk_weights", ww[: rnd.n], rnd.want.topk_weights)
                            # A combine along the padded handle takes the padded rows.
                            y = torch.zeros((worst_rows, hidden), dtype=torch.bfloat16, device="cuda")
                            y[: rnd.n] = rnd.ys[rank].to(dev)
                            got = buffer.combine(y, whandle, config=config)[0]
                            check(f"{what} worst combine", got, rnd.combined_no_w)
                        else:
                            truth(
                                f"{what}: no ids or weights without topk_idx",
                                recv_topk_idx is None and recv_topk_weights is None,
                            )
                            cached_args = {
                                "x": rnd2.x(dev, fp8),
                                "handle": handle,
                                "config": config,
                                "async_finish": async_mode,
                            }
                            if previous_mode:
                                cached_args.update({"previous_event": buffer.capture()})
                            out = buffer.dispatch(**cached_args)
                            truth(
                                f"{what} cached: (recv_x, None, None, None, None, event)",
                                out[1:5] == (None, None, None, None),
                            )
                            out[5].current_stream_wait() if async_mode else ()
                            check_recv_x(f"{what} cached", out[0], want_cached, rnd.n, fp8, rnd.n)
                        combine_args = {
                            "x": rnd.ys[rank].to(dev),
                            "bias": (b0.to(dev), b1.to(dev)),
                            "handle": handle,
                            "config": config,
                            "async_finish": async_mode,
                        }
                        if with_topk:
                            combine_args.update({"topk_weights": recv_topk_weights})
                        if previous_mode:
                            combine_args.update({"previous_event": buffer.capture()})
                        combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                        event.current_stream_wait() if async_mode else ()
                        want_x = rnd.combined[0] if with_topk else rnd.combined_no_w
                        check(f"{what} combined_x (with bias)", combined_x, (want_bias + want_x.float()).to(torch.bfloat16))
                        if with_topk:
                            check(f"{what} combined_topk_weights", combined_topk_weights, rnd.combined[1])
                        else:
                            truth(f"{what}: no combined weights", combined_topk_weights is None)
                        ctx.log(f"deep_ep_internode ({nodes} x {local}) {what}: ok")
        core = buffer.runtime
        truth("the normal core is two-tier", core.two_tier and core.get_num_sms() == num_sms)
        # The public internode ops, called directly (as DeepEP's dispatch does).
        recv_x, _, recv_w, _, handle, _ = buffer.internode_dispatch(
            rnd.x(dev, False),
            None,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            config=config,
        )
        check("internode_dispatch", recv_x, rnd.want.x)
        got_x, got_w, _ = buffer.internode_combine(rnd.ys[rank].to(dev), handle, recv_w, config=config)
        check("internode_combine", got_x, rnd.combined[0])
        check("internode_combine weights", got_w, rnd.combined[1])
        for fp8 in (False, True):
            got = buffer.dispatch(rnd2.x(dev, fp8), handle=handle, config=config)[0]
            check_recv_x(f"cached dispatch after a top-k dispatch (fp8={fp8})", got, want_cached, rnd.n, fp8, rnd.n)
        # get_dispatch_layout again, now that the (two-tier) core exists: the same numbers.
        layout = buffer.get_dispatch_layout(topk_idx, experts)
        check("num_tokens_per_rdma_rank after the core", layout[1], rnd.per_node)
        check("is_token_in_rank after the core", layout[3], want_in)
        # Refusals, the same on every rank.
        refused(lambda: buffer.dispatch(rnd.x(dev, False), handle=tuple(handle)), "handle")
        refused(lambda: buffer.combine(rnd.ys[rank][:-1].to(dev), handle), "x", "num_recv_tokens")
        refused(lambda: buffer.combine(rnd.ys[rank].to(dev), handle, topk_weights=recv_w[:, :2].contiguous()), "topk_weights")
        refused(
            lambda: buffer.dispatch(rnd.x(dev, False), topk_idx=topk_idx, config=deep_ep.Config(num_sms + 2)),
            "config",
            "SMs",
        )
        got = buffer.combine(rnd.ys[rank].to(dev), handle)[0]
        check("combine after the refusals", got, rnd.combined_no_w)
        buffer.destroy()
    torch.cuda.synchronize()
    dist.barrier()
    done(ctx, "deep_ep_internode", 200)


# ----------------------------------------------------------------------------------------------
# Low latency (tests/test_low_latency.py)


def _decode_ue8m0(packed):
    """f32 scales from DeepEP's packed UE8M0 int32 (the decoding of DeepEP's tests/utils.py
    per_token_cast_back, written out): one exponent byte per 128 channels, little-endian."""
    b = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (b << 23).view(torch.float32)


def check_ll(ctx, what, rnd, recv, count, handle, fmt, m, stats):
    world, rank = ctx.world, ctx.rank
    mine = rnd.rows[rank]
    counts = rnd.counts(rank).cpu()  # made under the default device
    check(f"{what} recv_count", count, counts)
    check(f"{what} cumulative_local_expert_recv_stats", stats, counts)
    truth(f"{what}: the handle is a 5-tuple", isinstance(handle, tuple) and len(handle) == 5)
    truth(f"{what}: handle[2:]", tuple(handle[2:]) == (m, rnd.hidden, rnd.epr * world))
    src, rng = handle[0].cpu(), handle[1].cpu()
    cap = world * m
    truth(
        f"{what}: src_info/layout_range shapes",
        tuple(src.shape) == (rnd.epr, cap) and tuple(rng.shape) == (rnd.epr, world),
    )
    if fmt == "bf16":
        truth(f"{what}: bf16 rows", recv.dtype == torch.bfloat16 and tuple(recv.shape) == (rnd.epr, cap, rnd.hidden))
    else:
        rows, scales = recv
        cols = rnd.hidden // (512 if fmt == "ue8m0" else 128)
        truth(
            f"{what}: e4m3 rows", rows.dtype == torch.float8_e4m3fn and tuple(rows.shape) == (rnd.epr, cap, rnd.hidden)
        )
        truth(
            f"{what}: scales [E, cap, {cols}] {scales.dtype}, column-major",
            scales.dtype == (torch.int32 if fmt == "ue8m0" else torch.float32)
            and tuple(scales.shape) == (rnd.epr, cap, cols)
            and scales.stride() == (cols * cap, 1, cap),
        )
    for le, rows_of in enumerate(mine):
        n = len(rows_of)
        if n:
            want = torch.stack([rnd.all_x[s][t] for s, t in rows_of])
        else:
            want = torch.empty((0, rnd.hidden), dtype=torch.bfloat16, device="cpu")
        if fmt == "bf16":
            check(f"{what} rows of local expert {le}", recv[le, :n], want)
        else:
            q, scales = ll_cast(want, fmt != "fp8")
            check(f"{what} e4m3 rows of local expert {le}", recv[0][le, :n], q)
            got = recv[1][le, :n]
            check(f"{what} scales of local expert {le}", _decode_ue8m0(got.cpu()) if fmt == "ue8m0" else got, scales)
        check(
            f"{what} src_info of local expert {le}",
            src[le, :n],
            torch.tensor([t for _, t in rows_of], dtype=torch.int32, device="cpu"),
        )
        first = 0
        for r in range(world):
            k = sum(1 for s, _ in rows_of if s == r)
            truth(f"{what} layout_range[{le}][{r}]", int(rng[le, r]) == (first << 32) | k)
            first += k


def _low_latency(ctx, hidden, top_k, epr, m, hooks, case):
    world, dev = ctx.world, ctx.device
    experts = epr * world
    tokens = [m - 3 * r if r % 2 else m for r in range(world)]
    rounds = []
    seed = 500
    for return_recv_hook in hooks:
        for use_fp8 in (False, True):
            for round_scale in (False, True) if use_fp8 else (False,):
                for use_ue8m0 in (False, True) if round_scale else (False,):
                    seed += 1
                    rounds.append(
                        (
                            return_recv_hook,
                            use_fp8,
                            round_scale,
                            use_ue8m0,
                            LlRound(ctx, tokens, hidden, top_k, experts, m, seed),
                        )
                    )
    with deepep_defaults():
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, experts)
        buffer = deep_ep.Buffer(
            group(),
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=experts // world,
            allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True,
            allow_mnnvl=False,
            enable_shrink=False,
        )
        buffer.clean_low_latency_buffer(m, hidden, experts)
        for return_recv_hook, use_fp8, round_scale, use_ue8m0, rnd in rounds:
            fmt = "bf16" if not use_fp8 else "ue8m0" if use_ue8m0 else "fp8-round" if round_scale else "fp8"
            what = f"H={hidden} K={top_k} {fmt} hook={return_recv_hook}"
            current_x, topk_idx, topk_weights = rnd.x.to(dev), rnd.idx.to(dev).to(deep_ep.topk_idx_t), rnd.w.to(dev)
            stats = torch.zeros((epr,), dtype=torch.int, device="cuda")
            packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                current_x,
                topk_idx,
                m,
                experts,
                use_fp8=use_fp8,
                round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=stats,
                async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook,
            )
            if return_recv_hook:
                truth(f"{what}: a hook, no event", hook is not None and event.event is None)
                _busy(dev)
                hook()
            else:
                truth(f"{what}: an event, no hook", hook is None and event.event is not None)
                event.current_stream_wait()
            check_ll(ctx, what, rnd, packed_recv_x, packed_recv_count, handle, fmt, m, stats)
            y = rnd.y(ctx)
            for zero_copy in (False, True):
                x_arg = y
                if zero_copy:
                    buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                    x_arg = torch.zeros_like(y)  # unused: the combine reads the combine buffer
                out = torch.empty((rnd.x.shape[0], hidden), dtype=torch.bfloat16, device="cuda")
                combined_x, event, hook = buffer.low_latency_combine(
                    x_arg,
                    topk_idx,
                    topk_weights,
                    handle,
                    use_logfmt=False,
                    async_finish=not return_recv_hook,
                    zero_copy=zero_copy,
                    return_recv_hook=return_recv_hook,
                    out=out,
                )
                hook() if return_recv_hook else event.current_stream_wait()
                truth(f"{what}: combine wrote out", combined_x is out)
                check(f"{what} combine (zero_copy={zero_copy})", combined_x, rnd.want_out)
            ctx.log(f"{case} {what}: ok")
        # The last dispatch's rows, counts and handle (src_info, layout_range) view the receive
        # set that destroy() frees (it refuses while they live); DeepEP's test drops them when
        # its test_main returns.
        del packed_recv_x, packed_recv_count, handle
        buffer.destroy()
    torch.cuda.synchronize()
    dist.barrier()


def deep_ep_low_latency(ctx):
    """tests/test_low_latency.py's loop (BF16, FP8, FP8 with power-of-two scales, packed UE8M0;
    async and hook calls; combine with and without zero copy) against the reference, in DeepEP's
    layouts."""
    _low_latency(ctx, 2048, 8, 8, 32, (False, True), "deep_ep_low_latency")
    _low_latency(ctx, 7168, 9, 16, 16, (False,), "deep_ep_low_latency")
    done(ctx, "deep_ep_low_latency", 100)


def deep_ep_ll_hook(ctx):
    """The hook path alone: the FP8 scales (and UE8M0 packing) are filled inside the hook, after
    torch work queued between the send phase and the hook."""
    _low_latency(ctx, 2048, 8, 8, 32, (True,), "deep_ep_ll_hook")
    done(ctx, "deep_ep_ll_hook", 50)


def deep_ep_ll_kernel_names(ctx):
    """DeepEP's bench_kineto conditions on the low-latency ops: in the profiler's table exactly one
    row names 'dispatch' and one 'combine' (the layer launches no other kernel with those words),
    and with hooks the trace's '::dispatch' / '::combine' events come in pairs (send and receive
    phase of one kernel each)."""
    world, dev = ctx.world, ctx.device
    hidden, top_k, epr, m = 2048, 8, 8, 32
    experts = epr * world
    rnd = LlRound(ctx, [m] * world, hidden, top_k, experts, m, 900)
    with deepep_defaults():
        buffer = deep_ep.Buffer(
            group(),
            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, experts),
            low_latency_mode=True,
            explicitly_destroy=True,
        )
        x, idx, w, y = rnd.x.to(dev), rnd.idx.to(dev), rnd.w.to(dev), rnd.y(ctx)
        stats = torch.zeros((epr,), dtype=torch.int, device="cuda")

        def test_func(return_recv_hook):
            _, _, handle, _, hook = buffer.low_latency_dispatch(
                x,
                idx,
                m,
                experts,
                cumulative_local_expert_recv_stats=stats,
                use_fp8=True,
                async_finish=False,
                return_recv_hook=return_recv_hook,
            )
            hook() if return_recv_hook else None
            _, _, hook = buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else None

        for return_recv_hook in (False, True):
            test_func(return_recv_hook)
            torch.cuda.synchronize()
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    test_func(return_recv_hook)
                torch.cuda.synchronize()
            lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
            for name in ("dispatch", "combine"):
                rows = [line for line in lines if name in line]
                truth(f"hook={return_recv_hook}: one profiler row names {name!r}: {rows}", len(rows) == 1)
            if return_recv_hook:
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "trace.json")
                    prof.export_chrome_trace(path)
                    with open(path) as f:
                        events = json.load(f)["traceEvents"]
                for name in ("dispatch", "combine"):
                    n = sum(1 for e in events if f"::{name}" in e.get("name", ""))
                    truth(f"hook: '::{name}' trace events come in pairs (got {n})", n > 0 and n % 2 == 0)
            dist.barrier()
        buffer.destroy()
    done(ctx, "deep_ep_ll_kernel_names", 6)


# ----------------------------------------------------------------------------------------------
# Refusals


def deep_ep_refusals(ctx):
    """What the layer refuses, each an InvalidArgumentError naming the argument (and the fixed
    value where a shape is fixed), on every rank alike before anything is launched; good calls
    work afterwards."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, epr, tokens = 512, 4, 4, 64
    experts = epr * world
    rnd = Normal(ctx, [tokens] * world, hidden, top_k, experts, 61)
    x, idx, w = rnd.mine.x.to(dev), rnd.mine.topk_idx.to(dev), rnd.mine.topk_weights.to(dev)
    per_rank, per_expert, in_rank = (t.to(dev) for t in rnd.layout)
    g = group()
    with deepep_defaults():
        # Budgets.
        small = deep_ep.Buffer(g, 1000, explicitly_destroy=True)
        refused(
            lambda: small.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert),
            "num_nvl_bytes",
            "1000",
            "1 token per rank",  # the limit comes from the budget alone, the same on every rank
        )
        refused(
            lambda: small.low_latency_dispatch(x, idx, tokens, experts),
            "num_rdma_bytes",
            "get_low_latency_rdma_size_hint",
        )
        refused(
            lambda: deep_ep.Buffer(g, 0).dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert),
            "num_nvl_bytes",
            "is 0",
        )
        # What the first dispatch needs to know.
        fresh = deep_ep.Buffer(g, int(1e9), explicitly_destroy=True)
        refused(
            lambda: fresh.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert),
            "topk_idx",
            "num_topk",
        )
        refused(lambda: fresh.dispatch(x, topk_idx=idx), "num_tokens_per_expert", "num_experts")
        refused(lambda: fresh.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert, config="24"), "config")
        refused(lambda: fresh.combine(x, (None,) * 6), "handle")
        # A core: the shape and the SMs are fixed.
        recv_x, _, _, _, handle, _ = fresh.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        check("first dispatch", recv_x, rnd.want.x)
        truth("num_sms from Buffer.num_sms", fresh.runtime.get_num_sms() == deep_ep.Buffer.num_sms)
        wide = torch.zeros((tokens, hidden * 2), dtype=torch.bfloat16, device="cuda")
        refused(
            lambda: fresh.dispatch(wide, topk_idx=idx),
            "x",
            f"hidden is fixed at the first dispatch of this Buffer: {hidden}",
        )
        refused(
            lambda: fresh.dispatch(x, topk_idx=idx[:, :2].contiguous()), "topk_idx", "num_topk is fixed", str(top_k)
        )
        refused(
            lambda: fresh.dispatch(x, topk_idx=idx, config=deep_ep.Config(deep_ep.Buffer.num_sms + 2)), "config", "SMs"
        )
        refused(lambda: fresh.dispatch(x, handle=tuple(handle)), "handle")
        refused(lambda: fresh.combine(recv_x, handle, bias=x[:, :8].contiguous()), "bias")
        refused(lambda: fresh.combine(recv_x, handle, bias=(x, x, x)), "bias", "two")
        refused(lambda: fresh.get_local_buffer_tensor(torch.bfloat16), "get_local_buffer_tensor")
        out = fresh.combine(ref.expert_output(recv_x, rank), handle)[0]
        check("combine after the refusals", out, rnd.combined_no_w)
        fresh.destroy()
        expect_raises(epcomm.BufferFailedError, lambda: fresh.get_dispatch_layout(idx, experts))
        refused(lambda: deep_ep.Buffer(g, int(1e9)).destroy(), "explicitly_destroy")
        # Low latency.
        m = tokens
        ll = deep_ep.Buffer(
            g,
            0,
            deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, experts),
            True,
            explicitly_destroy=True,
        )
        refused(lambda: ll.low_latency_dispatch(x, idx, m, experts, use_ue8m0=True), "use_ue8m0", "round_scale")
        x640 = torch.zeros((tokens, 640), dtype=torch.bfloat16, device="cuda")
        refused(
            lambda: ll.low_latency_dispatch(x640, idx, m, experts, round_scale=True, use_ue8m0=True), "use_ue8m0", "512"
        )
        refused(
            lambda: ll.low_latency_dispatch(
                x,
                idx,
                m,
                experts,
                dispatch_wait_recv_cost_stats=torch.zeros((world,), dtype=torch.int64, device="cuda"),
            ),
            "dispatch_wait_recv_cost_stats",
        )
        recv, count, ll_handle, _, _ = ll.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
        truth("a low-latency dispatch after the refusals", tuple(recv.shape) == (epr, world * m, hidden))
        refused(lambda: ll.low_latency_dispatch(x, idx, m + 1, experts), "num_max_dispatch_tokens_per_rank", str(m))
        refused(lambda: ll.low_latency_dispatch(wide, idx, m, experts), "x", str(hidden))
        refused(lambda: ll.low_latency_dispatch(x, idx[:, :2].contiguous(), m, experts), "topk_idx", str(top_k))
        refused(lambda: ll.clean_low_latency_buffer(m, hidden * 2, experts), "hidden", str(hidden))
        y = torch.zeros((epr, world * m, hidden), dtype=torch.bfloat16, device="cuda")
        refused(lambda: ll.low_latency_combine(y, idx, w, ll_handle, use_logfmt=True), "use_logfmt")
        refused(
            lambda: ll.low_latency_combine(y, idx, w, ll_handle, zero_copy=True),
            "zero_copy",
            "get_next_low_latency_combine_buffer",
        )
        refused(lambda: ll.low_latency_combine(y, idx, w, tuple(ll_handle)), "handle")
        refused(
            lambda: ll.low_latency_combine(
                y,
                idx,
                w,
                ll_handle,
                combine_wait_recv_cost_stats=torch.zeros((world,), dtype=torch.int64, device="cuda"),
            ),
            "combine_wait_recv_cost_stats",
        )
        for fn in (
            lambda: ll.low_latency_update_mask_buffer(0, True),
            lambda: ll.low_latency_query_mask_buffer(count),
            ll.low_latency_clean_mask_buffer,
        ):
            refused(fn, "enable_shrink", "enable_shrink=True")
        refused(lambda: ll.internode_dispatch(x), "group", "internode")
        combined = ll.low_latency_combine(y, idx, w, ll_handle)[0]
        check(
            "a low-latency combine of zeros after the refusals",
            combined,
            torch.zeros((tokens, hidden), dtype=torch.bfloat16, device="cpu"),
        )
        del recv, count, ll_handle  # views of the receive set destroy() frees
        ll.destroy()
    torch.cuda.synchronize()
    dist.barrier()
    done(ctx, "deep_ep_refusals", 30)


# Rank masking (tests/test_low_latency.py --shrink-test)


def _survivors_round(ctx, tokens, hidden, top_k, experts, m, seed, silent, dead):
    """An LlRound as the ranks still running see it: the tokens of `silent` ranks never sent,
    and the entries whose expert lives on a `dead` rank adding nothing to a combine."""
    with plain_defaults():
        return _survivors_reference(ctx, tokens, hidden, top_k, experts, m, seed, silent, dead)


def _survivors_reference(ctx, tokens, hidden, top_k, experts, m, seed, silent, dead):
    world = ctx.world
    epr = experts // world
    rnd = LlRound(ctx, tokens, hidden, top_k, experts, m, seed)
    ins = [ll_inputs(r, tokens[r], hidden, top_k, experts, world, seed)[1] for r in range(world)]
    sent = [torch.empty((0, top_k), dtype=torch.int64) if r in silent else idx for r, idx in enumerate(ins)]
    rnd.rows, rnd.where = ll_reference(sent, experts, world)
    rnd.ys = [ll_y(rnd.all_x, rnd.rows[r], epr, rnd.cap, hidden) for r in range(world)]
    owners = rnd.idx.clamp(min=0) // epr
    gone = torch.tensor([r in dead for r in range(world)])[owners] & (rnd.idx >= 0)
    rnd.want_out = ll_combined(ctx.rank, rnd.idx.masked_fill(gone, -1), rnd.w, rnd.where, rnd.ys, hidden)
    return rnd


def deep_ep_shrink(ctx):
    """tests/test_low_latency.py --shrink-test's sequence: rank 1 stops at its first dispatch,
    rank 3 at its first combine, rank 5 at its first clean (those that exist); they stay alive
    but call nothing more. The others keep decoding: each stop is found by the op that waits for
    the stopped rank (one timeout), the mask query names exactly the stopped ranks after every
    stage, and every dispatch and combine is bit-exact against the reference without the stopped
    ranks' tokens and with their experts' entries as -1. A first round that every rank runs
    creates the layer's low-latency core (epcomm creates it at the first op, which shows the
    shape)."""
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    hidden, top_k, epr, m = 2048, 4, 4, 32
    experts = epr * world
    stop_at = {"dispatch": 1, "combine": 3, "clean": 5}
    stop_at = {stage: r for stage, r in stop_at.items() if r < world}
    timeout = 1.0
    tokens = [m - 2 * r if r % 2 else m for r in range(world)]
    stopped = set()  # ranks that stopped so far, as every rank still running knows
    me_stopped = False
    with deepep_defaults():
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, experts)
        buffer = deep_ep.Buffer(
            group(),
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            explicitly_destroy=True,
            enable_shrink=True,
            timeout=timeout,
        )
        mask_status = torch.zeros((world,), dtype=torch.int, device="cuda")

        def expect_mask(what):
            buffer.low_latency_query_mask_buffer(mask_status)
            got = set(mask_status.nonzero().squeeze(-1).tolist())
            truth(f"{what}: masked {sorted(got)} == stopped {sorted(stopped)}", got == stopped)

        def stage(name):
            """True when this rank stops here (and from now on)."""
            nonlocal me_stopped
            if stop_at.get(name) == rank:
                me_stopped = True
                return True
            return False

        formats = [(False, False), (True, False), (False, True), (True, True), (False, False)]
        for i, (use_fp8, hook) in enumerate(formats):
            fmt = "fp8" if use_fp8 else "bf16"
            what = f"round {i} {fmt} hook={hook}"
            first = i == 0  # every rank runs the first round whole: it creates the core
            if not first and stage("dispatch"):
                break
            if not first:
                stopped |= {r for s, r in stop_at.items() if s == "dispatch"}
            silent = set(stopped)
            rnd = _survivors_round(ctx, tokens, hidden, top_k, experts, m, 700 + i, silent, silent)
            x, idx, w = rnd.x.to(dev), rnd.idx.to(dev), rnd.w.to(dev)
            stats = torch.zeros((epr,), dtype=torch.int, device="cuda")
            recv, count, handle, event, hook_fn = buffer.low_latency_dispatch(
                x,
                idx,
                m,
                experts,
                use_fp8=use_fp8,
                cumulative_local_expert_recv_stats=stats,
                async_finish=not hook,
                return_recv_hook=hook,
            )
            hook_fn() if hook else event.current_stream_wait()
            expect_mask(f"{what} dispatch")
            check_ll(ctx, f"{what} dispatch", rnd, recv, count, handle, fmt, m, stats)
            if not first and stage("combine"):
                break
            if not first:
                stopped |= {r for s, r in stop_at.items() if s == "combine"}
            rnd = _survivors_round(ctx, tokens, hidden, top_k, experts, m, 700 + i, silent, set(stopped))
            out, event, hook_fn = buffer.low_latency_combine(
                rnd.y(ctx), idx, w, handle, async_finish=not hook, return_recv_hook=hook
            )
            hook_fn() if hook else event.current_stream_wait()
            expect_mask(f"{what} combine")
            check(f"{what} combine", out, rnd.want_out)
            if not first and stage("clean"):
                break
            if not first:
                stopped |= {r for s, r in stop_at.items() if s == "clean"}
            buffer.clean_low_latency_buffer(m, hidden, experts)
            expect_mask(f"{what} clean")
            ctx.log(f"deep_ep_shrink {what}: ok, masked {sorted(stopped)}")
        if not me_stopped:
            truth("every stop was found", stopped == set(stop_at.values()))
            # Cleared, the mask is empty again (and the stopped ranks would be waited for).
            buffer.low_latency_clean_mask_buffer()
            stopped = set()
            expect_mask("after low_latency_clean_mask_buffer")
        torch.cuda.synchronize()
        dist.barrier()
        del recv, count, handle  # views of the receive set destroy() frees
        buffer.destroy()
    torch.cuda.synchronize()
    dist.barrier()
    done(ctx, "deep_ep_shrink", 10 if me_stopped else 40)


CASES = {
    f.__name__: f
    for f in (
        deep_ep_intranode,
        deep_ep_intranode_fp8,
        deep_ep_intranode_no_topk,
        deep_ep_internode,
        deep_ep_low_latency,
        deep_ep_ll_hook,
        deep_ep_ll_kernel_names,
        deep_ep_refusals,
        deep_ep_shrink,
    )
}
