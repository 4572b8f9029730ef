"""DeepEP's internode normal ops on a group of several nodes (:mod:`.nodes`): the normal core
is a two-tier :class:`epcomm.Buffer` (``two_tier=True``), and this module gives its results
DeepEP's internode shapes and order.

**Row order.** The two-tier core returns this rank's rows grouped by forwarding local rank
(the source's local rank), then by source node, each source's rows in token order; DeepEP
returns them by global source rank, each source's rows in token order. With ``c[s]`` the rows
this rank receives from source ``s`` and ``L`` ranks per node, source ``s`` (local rank ``s %
L``, node ``s // L``) is block number ``(s % L) * num_nodes + s // L`` of the core's order and
block ``s`` of DeepEP's, so DeepEP row ``i`` of source ``s`` is core row ``i - start[s] +
core_start[s]`` (:func:`receive_order`: ``perm``, and its inverse ``inv``). A dispatch returns
``recv.index_select(0, perm)`` of each received tensor; a combine hands the core
``x.index_select(0, inv)``, so every row reaches the token it came from, and the core's sums
(each node's rows in fp32 in local-rank order, rounded to one bf16 partial, the partials
summed in fp32 in node order, rounded once) are untouched.

**Counts.** ``c`` comes from every rank's per-rank token counts: each non-cached dispatch
all-gathers, over the Buffer's ``torch.distributed`` group, every rank's tokens per rank, per
node and per expert (and, routed by ``is_token_in_rank``, the most ranks one token goes to):
DeepEP's notify step exchanges the same counts. They arrive on the host (on an NCCL group
through a GPU tensor), a host wait like the receive count the two-tier dispatch waits for
anyway (and like DeepEP's own, which waits for its counts before it allocates the outputs).
The permutation itself is computed on the GPU from them, on the op's stream.

**Routing without ``topk_idx``.** The two-tier core routes by ``topk_idx`` only. A dispatch
given ``is_token_in_rank`` (and ``num_tokens_per_expert``) instead sends token ``t`` with the
ids ``r * experts_per_rank`` of the ranks ``r`` it goes to (in rank order, ``-1`` after them):
the same destinations, hence the same rows; the ids themselves are not returned (``None``, as
in DeepEP) and the per-expert counts come from the gathered ``num_tokens_per_expert``. A token
going to more ranks than ``num_topk`` (fixed by the first dispatch) cannot be sent so: refused
naming ``is_token_in_rank`` on every rank alike (the gathered maximum decides).
"""

import torch

from .._args import aligned_counts, check, check_int, describe, fail
from .._streams import StreamOp, torch_function_off
from ..errors import EpcommError
from . import _impl
from .handles import InternodeHandle, ReceiveOrder

_FP8 = getattr(torch, "float8_e4m3fn", None)


# ----------------------------------------------------------------------------------------------
# Pure helpers (any device; tested on the CPU)


def node_counts(in_rank, node_size):
    """``[num_nodes]`` int32: the tokens that go to at least one rank of each node (DeepEP's
    ``num_tokens_per_rdma_rank``) from ``is_token_in_rank`` ``[T, world]``."""
    t, world = in_rank.shape
    per_node = in_rank.reshape(t, world // node_size, node_size).any(dim=2)
    return per_node.sum(dim=0, dtype=torch.int32)


def route_ids(in_rank, experts_per_rank, num_topk):
    """``[T, num_topk]`` int64 ids that send each token to exactly the ranks ``in_rank`` names:
    ``r * experts_per_rank`` for each such rank ``r`` in increasing order, then ``-1``.
    Tokens going to more than ``num_topk`` ranks keep their first ``num_topk`` (callers refuse
    them first)."""
    t, world = in_rank.shape
    dev = in_rank.device
    # Stable sort of the flags, descending: each token's ranks first, in rank order.
    order = torch.sort(in_rank.to(torch.int8), dim=1, descending=True, stable=True).indices
    flags = torch.gather(in_rank, 1, order)
    ids = torch.where(flags, order * experts_per_rank, torch.full_like(order, -1))
    if world >= num_topk:
        return ids[:, :num_topk].contiguous()
    pad = torch.full((t, num_topk - world), -1, dtype=torch.int64, device=dev)
    return torch.cat((ids, pad), dim=1)


def receive_order(counts, node_size, device):
    """The row order of a two-tier dispatch against DeepEP's (module docs), from `counts`
    (CPU int64 ``[world]``: rows this rank receives from each source rank). Returns
    ``(recv_gbl_rank_prefix_sum, perm, inv)``: int32 ``[world]`` inclusive prefix sums of
    `counts` (CPU), and int64 ``[sum(counts)]`` on `device`: DeepEP row ``i`` is core row
    ``perm[i]``, core row ``k`` is DeepEP row ``inv[k]``."""
    world = counts.shape[0]
    nodes = world // node_size
    n = int(counts.sum())
    src = torch.arange(world, dtype=torch.int64, device="cpu")
    # Source s is block `key[s]` of the core's order: by local rank, then node.
    key = (src % node_size) * nodes + src // node_size
    by_key = torch.argsort(key)
    core_counts = counts[by_key]
    core_start = torch.empty_like(counts)
    core_start[by_key] = torch.cumsum(core_counts, 0) - core_counts
    gbl_end = torch.cumsum(counts, 0)
    shift = core_start - (gbl_end - counts)
    small = torch.stack((counts, shift)).to(device)
    row_src = torch.repeat_interleave(torch.arange(world, dtype=torch.int64, device=device), small[0], output_size=n)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    perm = rows + small[1].index_select(0, row_src)
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, rows)
    return gbl_end.to(torch.int32), perm, inv


def rdma_prefix(gathered_nodes, rank, node_size):
    """DeepEP's ``recv_rdma_rank_prefix_sum`` (int32 ``[num_nodes]``, CPU) of `rank` from
    every rank's tokens per node (``[world, num_nodes]``): the tokens of node ``m``'s rank with
    this rank's local rank that go to this rank's node cross the rail to this rank."""
    local, node = rank % node_size, rank // node_size
    world = gathered_nodes.shape[0]
    sources = torch.arange(local, world, node_size, dtype=torch.int64, device="cpu")
    return torch.cumsum(gathered_nodes[sources, node], 0).to(torch.int32)


def reorder(t, perm, rows, fill):
    """`t`'s rows in the order `perm` (``out[i] = t[perm[i]]``), padded to `rows` rows of
    `fill` (None: `t` is None)."""
    if t is None:
        return None
    fp8 = _FP8 is not None and t.dtype == _FP8
    src = t.view(torch.uint8) if fp8 else t
    n = perm.shape[0]
    if rows == n:
        out = src.index_select(0, perm)
    else:
        out = torch.empty((rows,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
        torch.index_select(src, 0, perm, out=out[:n])
        out[n:].fill_(fill)
    return out.view(_FP8) if fp8 else out


# ----------------------------------------------------------------------------------------------
# The counts exchange


def gather(buf, vec):
    """Every rank's `vec` (CPU int64 ``[W]``) as a CPU ``[world, W]`` tensor, through the
    Buffer's ``torch.distributed`` group (collective; an NCCL group exchanges GPU tensors)."""
    import torch.distributed as dist

    world = buf.group_size
    if dist.get_backend(buf.group) == "nccl":
        dev = torch.device("cuda", buf.device)
        out = torch.empty((world * vec.shape[0],), dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(out, vec.to(dev), group=buf.group)
        return out.view(world, vec.shape[0]).cpu()
    parts = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(parts, vec, group=buf.group)
    return torch.stack(parts)


# ----------------------------------------------------------------------------------------------
# Ops


def _not_captured(what):
    if torch.cuda.is_current_stream_capturing():
        fail(
            "graph capture",
            f"an internode {what} waits on the host (for the exchanged counts and the receive count): it cannot be "
            "captured into a CUDA graph",
        )


def get_dispatch_layout(buf, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
    """get_dispatch_layout of a group of several nodes: the checks of the one-node form, then
    torch ops on the comm stream, with ``num_tokens_per_rdma_rank``."""
    _impl.check_layout(buf, topk_idx, num_experts)
    with torch_function_off():
        op = StreamOp(_impl.comm_stream(buf), previous_event, async_finish, allocate_on_comm_stream)
        op.use(topk_idx)
        op.begin()
        with torch.cuda.stream(op.comm):
            per_rank, per_expert, in_rank = _impl.layout_tensors(topk_idx, num_experts, buf.group_size)
            per_node = node_counts(in_rank, buf._plan.node_size)
        for t in (per_rank, per_node, per_expert, in_rank):
            t.record_stream(op.compute)
        return per_rank, per_node, per_expert, in_rank, op.finish()


def _handle(buf, handle):
    if not isinstance(handle, InternodeHandle):
        fail(
            "handle",
            f"must be the handle of this Buffer's dispatch (an internode 10-tuple; got {type(handle).__name__})",
        )
    if buf._normal is None:
        fail("handle", "was produced by another Buffer (this one has dispatched nothing)")
    return handle


def dispatch(
    buf,
    x,
    handle,
    num_tokens_per_rank,
    num_tokens_per_rdma_rank,
    is_token_in_rank,
    num_tokens_per_expert,
    topk_idx,
    topk_weights,
    expert_alignment,
    num_worst_tokens,
    config,
    previous_event,
    async_finish,
    allocate_on_comm_stream,
):
    _impl._alive(buf)
    del num_tokens_per_rank, num_tokens_per_rdma_rank  # recomputed from the routing (module docs)
    check_int("expert_alignment", expert_alignment, minimum=1)
    check_int("num_worst_tokens", num_worst_tokens)
    _not_captured("dispatch")
    with torch_function_off():
        if handle is not None:
            return _cached(buf, x, _handle(buf, handle), topk_idx, topk_weights, config, previous_event,
                           async_finish, allocate_on_comm_stream)
        world, rank, dev = buf.group_size, buf.rank, buf.device
        node_size, nodes = buf._plan.node_size, buf._plan.num_nodes
        x, rows = _impl._x(x)
        d = _impl._shape("x", rows, 2, ("num_tokens", "hidden"))
        num_tokens, hidden = d.shape
        num_topk, num_experts = _impl.first_shape(buf, topk_idx, num_tokens_per_expert)
        if topk_idx is None:
            if topk_weights is not None:
                fail("topk_weights", "weights travel only with topk_idx: a dispatch without topk_idx takes none")
            for name, value in (("is_token_in_rank", is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    fail(
                        name,
                        "a dispatch without topk_idx (and without handle) routes by is_token_in_rank and "
                        "num_tokens_per_expert: pass both",
                    )
            check(
                "is_token_in_rank",
                describe("is_token_in_rank", is_token_in_rank),
                dtypes=("bool",),
                shape=(num_tokens, world),
                device=dev,
                shape_names=("num_tokens", "num_ranks"),
            )
            check(
                "num_tokens_per_expert",
                describe("num_tokens_per_expert", num_tokens_per_expert),
                dtypes=("int32",),
                shape=(num_experts,),
                device=dev,
                shape_names=("num_experts",),
            )
        else:
            check(
                "topk_idx",
                describe("topk_idx", topk_idx),
                dtypes=("int64",),
                shape=(num_tokens, num_topk),
                device=dev,
                shape_names=("num_tokens", "num_topk"),
            )
        if num_experts % world != 0:
            fail("num_experts", f"must be a multiple of the {world} ranks (got {num_experts})")
        # Before the creation: the type (the creation reads config.num_sms), or the core's SMs.
        _impl._check_config(buf, config)
        core = _impl._normal_core(buf, hidden, num_topk, num_experts, num_tokens, config)
        epr = num_experts // world

        # This rank's counts, on the comm stream after the op's inputs, then exchanged.
        op = StreamOp(core.get_comm_stream(), previous_event, async_finish, allocate_on_comm_stream)
        op.begin()
        with torch.cuda.stream(op.comm):
            if topk_idx is not None:
                per_rank, per_expert, in_rank = _impl.layout_tensors(topk_idx, num_experts, world)
                route = topk_idx
                most = torch.zeros((1,), dtype=torch.int64, device=dev)
            else:
                in_rank = is_token_in_rank
                per_rank = in_rank.sum(dim=0, dtype=torch.int64)
                per_expert = num_tokens_per_expert
                if num_tokens:
                    most = in_rank.sum(dim=1, dtype=torch.int64).amax().view(1)
                else:
                    most = torch.zeros((1,), dtype=torch.int64, device=dev)
                route = route_ids(in_rank, epr, num_topk)
            per_node = node_counts(in_rank, node_size)
            mine = torch.cat((per_rank.long(), per_node.long(), per_expert.long(), most)).cpu()
        if topk_idx is not None and is_token_in_rank is None:
            in_rank.record_stream(op.compute)  # returned in the handle, made on the comm stream
        gathered = gather(buf, mine)
        to_me = gathered[:, rank].clone()
        gathered_nodes = gathered[:, world : world + nodes]
        if topk_idx is None:
            widest = int(gathered[:, -1].max())
            if widest > num_topk:
                fail(
                    "is_token_in_rank",
                    f"a token goes to {widest} ranks, more than num_topk = {num_topk}: an internode dispatch without "
                    "topk_idx sends each token with one id per destination rank, at most num_topk of them (num_topk "
                    "is fixed by the first dispatch or get_dispatch_layout)",
                )

        recv_x, recv_idx, recv_w, per_expert_list, h, event = core.dispatch(
            _impl._contiguous_scales(core, x, previous_event),
            topk_idx=route,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
            num_worst_tokens=0,
            config=config,
            previous_event=previous_event,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        n = h.num_recv_tokens
        if n != int(to_me.sum()):
            raise EpcommError(
                f"internode dispatch: the two-tier core received {n} rows on rank {rank}, but the exchanged counts say "
                f"{int(to_me.sum())} ({to_me.tolist()}): the ranks' routing and counts disagree"
            )
        rows_out = n
        if num_worst_tokens:
            if num_worst_tokens < n:
                fail(
                    "num_worst_tokens",
                    f"rank {rank} received {n} rows, more than num_worst_tokens = {num_worst_tokens} (it must bound "
                    "every rank's received rows)",
                )
            rows_out = num_worst_tokens
        if topk_idx is None:
            first = world + nodes + rank * epr
            counts = gathered[:, first : first + epr].sum(dim=0).tolist()
            per_expert_list = aligned_counts(counts, expert_alignment)
            recv_idx = recv_w = None
        if num_worst_tokens:
            per_expert_list = []
        rdma = rdma_prefix(gathered_nodes, rank, node_size)
        made = {}

        def tail():
            cuda = torch.device("cuda", dev)
            gbl, perm, inv = receive_order(to_me, node_size, cuda)
            made["order"] = ReceiveOrder(perm, inv, n, rows_out)
            made["gbl"] = gbl.to(cuda)
            made["rdma"] = rdma.to(cuda)
            parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
            made["x"] = [reorder(t, perm, rows_out, 0) for t in parts]
            made["idx"] = reorder(recv_idx, perm, rows_out, -1)
            made["w"] = reorder(recv_w, perm, rows_out, 0)
            return tuple(
                t for t in (perm, inv, made["gbl"], made["rdma"], *made["x"], made["idx"], made["w"]) if t is not None
            )

        event = _impl._then(core, event, tail)
        out_x = tuple(made["x"]) if isinstance(recv_x, tuple) else made["x"][0]
        handle_in_rank = in_rank if is_token_in_rank is None else is_token_in_rank
        items = (handle_in_rank, None, None, None, made["rdma"], None, made["gbl"], None, None, None)
        handle = InternodeHandle(items, h, made["order"])
        return out_x, made["idx"], made["w"], per_expert_list, handle, event


def _cached(buf, x, handle, topk_idx, topk_weights, config, previous_event, async_finish, allocate_on_comm_stream):
    core = buf._normal
    _impl._check_config(buf, config)
    x, rows = _impl._x(x)
    d = _impl._shape("x", rows, 2, ("num_tokens", "hidden"))
    _impl._fixed("x", "hidden", core.hidden, d.shape[1], "dispatch")
    recv_x, _, _, _, _, event = core.dispatch(
        _impl._contiguous_scales(core, x, previous_event),
        handle=handle.epcomm_handle,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        config=config,
        previous_event=previous_event,
        async_finish=async_finish,
        allocate_on_comm_stream=allocate_on_comm_stream,
    )
    order = handle.order
    made = []

    def tail():
        parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
        made.extend(reorder(t, order.perm, order.num_rows, 0) for t in parts)
        return tuple(made)

    event = _impl._then(core, event, tail)
    out = tuple(made) if isinstance(recv_x, tuple) else made[0]
    return out, None, None, None, None, event


def combine(buf, x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream):
    _impl._alive(buf)
    handle = _handle(buf, handle)
    core = buf._normal
    h, order = handle.epcomm_handle, handle.order
    with torch_function_off():
        _not_captured("combine")
        b0, b1 = _impl._bias(core, bias, h.num_tokens)
        _impl._check_config(buf, config)
        # Checked here with the dispatch's row count (the core checks the reordered copies).
        check(
            "x",
            describe("x", x),
            dtypes=("bfloat16",),
            shape=(order.num_rows, core.hidden),
            device=buf.device,
            shape_names=("num_recv_tokens", "hidden"),
        )
        if topk_weights is not None:
            check(
                "topk_weights",
                describe("topk_weights", topk_weights),
                dtypes=("float32",),
                shape=(order.num_rows, core.num_topk),
                device=buf.device,
                shape_names=("num_recv_tokens", "num_topk"),
            )
        # Validates previous_event and the flags before anything is issued.
        StreamOp(core.get_comm_stream(), previous_event, async_finish, allocate_on_comm_stream)

        def to_core():
            w = None if topk_weights is None else topk_weights.index_select(0, order.inv)
            return x.index_select(0, order.inv), w

        if previous_event is None:
            # On the current stream, which the op waits for.
            core_x, core_w = to_core()
        else:
            # The inputs are ready at previous_event: reordered on the comm stream after it.
            comm = core.get_comm_stream()
            comm.wait_event(previous_event.event)
            with torch.cuda.stream(comm):
                core_x, core_w = to_core()
            for t in (x, topk_weights):
                if t is not None:
                    t.record_stream(comm)
        out, out_w, event = core.combine(
            core_x,
            h,
            topk_weights=core_w,
            config=config,
            previous_event=previous_event,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        return _impl.add_bias(core, out, out_w, event, b0, b1)
