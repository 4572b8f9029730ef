"""The torch side of ``deep_ep.Buffer`` (:mod:`epcomm.deep_ep.buffer` documents the mapping).

Stream rules, as in epcomm: an op's extra work that follows the epcomm op (the rank prefix
matrix, the bias, the DeepEP layout of low-latency scales) runs where the op's results become
visible: on the current stream after a synchronous op (the current stream already waits for
the comm stream), on the core's comm stream followed by a new event for ``async_finish=True``
(the returned event then covers it), and inside the hook for ``return_recv_hook=True``.
Nothing here relies on torch's default dtype or device: every tensor gets both explicitly.
"""

import os
import socket

import torch

from .. import _ll_args
from .. import buffer as _core
from .._args import check, check_bool, check_int, describe, fail
from .._streams import EventOverlap, StreamOp, async_event, torch_function_off
from .._views import view
from ..config import Config as _CoreConfig
from ..config import low_latency_size_hint
from ..errors import BufferFailedError
from . import config as _config
from . import nodes as _nodes
from .handles import IntranodeHandle, LowLatencyHandle

_FP8_BLOCK = _ll_args.FP8_BLOCK
_UE8M0_BLOCK = 4 * _FP8_BLOCK


# ----------------------------------------------------------------------------------------------
# Creation, facts


def init(buf, group, comm):
    """Rank, world and device of `buf`, and its split into nodes (:mod:`.nodes`; collective over
    the group: every rank's hostname)."""
    if not torch.cuda.is_available():
        fail("device", "deep_ep.Buffer needs a CUDA GPU, and torch.cuda.is_available() is False")
    import torch.distributed as dist

    from .._rendezvous import local_ranks

    buf.device = torch.cuda.current_device()
    distributed = group is not None or (dist.is_available() and dist.is_initialized())
    if distributed:
        if not (dist.is_available() and dist.is_initialized()):
            fail("group", "is given but torch.distributed is not initialised (call init_process_group first)")
        try:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        except (RuntimeError, ValueError, TypeError) as e:
            fail("group", f"must be a torch.distributed process group this rank belongs to ({e})")
        if rank < 0:
            fail("group", "this rank is not a member of the group")
        if comm is not None:
            try:
                same = comm.Get_size() == world and comm.Get_rank() == rank
            except AttributeError:
                fail("comm", f"must be an mpi4py communicator or None (got {type(comm).__name__})")
            if not same:
                fail(
                    "comm",
                    f"names rank {comm.Get_rank()} of {comm.Get_size()}, but the torch.distributed group (epcomm's "
                    f"rendezvous) has this rank as {rank} of {world}: pass the group matching the communicator",
                )
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        per_host = local_ranks(hosts, rank)[1]
    else:
        if comm is not None:
            fail(
                "comm",
                "an mpi4py communicator cannot be epcomm's rendezvous: pass a torch.distributed group (or initialise "
                "torch.distributed, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
            )
        env = os.environ
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            per_host = int(env.get("LOCAL_WORLD_SIZE", world))
        except (KeyError, ValueError) as e:
            fail(
                "group",
                f"is None, torch.distributed is not initialised, and the launcher variables are incomplete ({e})",
            )
        if per_host < 1 or world % per_host != 0:
            fail("group", f"LOCAL_WORLD_SIZE={per_host} must divide WORLD_SIZE={world} (as many ranks on every host)")
    plan = _nodes.plan(world, per_host, buf._options["transport"], os.environ)
    if plan.internode and not distributed:
        fail(
            "group",
            f"spans {plan.num_nodes} nodes of {plan.node_size} ranks, and the internode path exchanges each "
            "dispatch's counts through a torch.distributed group: initialise torch.distributed (or pass its group)",
        )
    buf.group = group
    buf.rank = rank
    buf.group_size = world
    buf._plan = plan


def capture():
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)


def comm_stream(buf):
    core = buf._normal if buf._normal is not None else buf._ll
    if core is not None:
        return core.get_comm_stream()
    if buf._side is None:
        buf._side = torch.cuda.Stream(device=buf.device)
    return buf._side


def destroy(buf):
    if not buf.explicitly_destroy:
        fail(
            "explicitly_destroy",
            "destroy() needs a Buffer created with explicitly_destroy=True (as in DeepEP); without it the epcomm "
            "Buffers are freed when this Buffer is garbage-collected",
        )
    _alive(buf)
    # Both cores checked before either is destroyed: a refusal (a tensor still views memory one
    # of them frees) destroys nothing.
    _core.check_no_live_views([core for core in (buf._normal, buf._ll) if core is not None])
    for core in (buf._normal, buf._ll):
        if core is not None:
            core.destroy()
    buf._normal = buf._ll = None
    buf._combine_buffer = None
    buf._destroyed = True


def _alive(buf):
    if buf._destroyed:
        raise BufferFailedError("this deep_ep.Buffer was destroyed: create a new one", reason="destroyed")


def _shape(argument, t, dims, names):
    """The shape of tensor `t` (an error naming `argument` unless it has `dims` dimensions)."""
    d = describe(argument, t)
    if len(d.shape) != dims:
        fail(argument, f"must have {dims} dimensions [{', '.join(names)}] (got shape {list(d.shape)})")
    return d


def _dim(argument, t, dims, names, i):
    """Dimension `i` of tensor `t` (an error naming `argument` unless it has `dims`
    dimensions), in a few attribute reads when it has them."""
    try:
        shape = t.shape
        if len(shape) == dims:
            return shape[i]
    except AttributeError:
        pass
    return _shape(argument, t, dims, names).shape[i]


def _fixed(argument, what, fixed, got, first):
    if got != fixed:
        fail(argument, f"{what} is fixed at the first {first} of this Buffer: {fixed} (got {got})")


# ----------------------------------------------------------------------------------------------
# The cores


def _core_kwargs(buf, transport):
    o = buf._options
    return dict(transport=transport, schedule=o["schedule"], routes=o["routes"], timeout=o["timeout"])


def _normal_core(buf, hidden, num_topk, num_experts, num_tokens, config):
    """The normal core, created for this shape when there is none; else checked against it."""
    core = buf._normal
    if core is not None:
        _fixed("x", "hidden", core.hidden, hidden, "dispatch")
        _fixed("topk_idx", "num_topk", core.num_topk, num_topk, "dispatch")
        _fixed("num_tokens_per_expert", "num_experts", core.num_experts, num_experts, "dispatch")
        return core
    num_sms = config.num_sms if config is not None else type(buf).num_sms
    world = buf.group_size
    m = buf._max_tokens_per_rank
    if m is None:
        # From the budget alone, the same on every rank (a rank-dependent refusal here would leave
        # the others waiting in the collective creation); a dispatch over it is refused there.
        m = _config.fit_tokens(buf.num_nvl_bytes, world, hidden, num_topk, num_experts, 1)
    with torch.cuda.device(buf.device):
        buf._normal = _core.Buffer(
            buf.group,
            buf.num_nvl_bytes,
            0,
            False,
            max_tokens_per_rank=m,
            hidden=hidden,
            num_topk=num_topk,
            num_experts=num_experts,
            num_sms=num_sms,
            explicitly_destroy=True,
            # A group of several nodes: two tiers (a rail between nodes, then NVLink inside one).
            two_tier=buf._plan.internode,
            **_core_kwargs(buf, buf._plan.transport),
        )
    return buf._normal


def _ll_core(buf, hidden, num_topk, num_experts, m):
    """The low-latency core, created for this shape when there is none; else checked."""
    core = buf._ll
    if core is not None:
        _fixed(
            "num_max_dispatch_tokens_per_rank",
            "num_max_dispatch_tokens_per_rank",
            core.num_max_dispatch_tokens_per_rank,
            m,
            "low-latency op",
        )
        _fixed("x", "hidden", core.hidden, hidden, "low-latency op")
        _fixed("topk_idx", "num_topk", core.num_topk, num_topk, "low-latency op")
        _fixed("num_experts", "num_experts", core.num_experts, num_experts, "low-latency op")
        return core
    check_int("num_max_dispatch_tokens_per_rank", m, minimum=1)
    check_int("num_experts", num_experts, minimum=1)
    world = buf.group_size
    need = low_latency_size_hint(m, hidden, world, num_experts, num_topk)
    if need > buf.num_rdma_bytes:
        fail(
            "num_rdma_bytes",
            f"the low-latency ops of this shape (num_max_dispatch_tokens_per_rank={m}, hidden={hidden}, "
            f"num_topk={num_topk}, num_experts={num_experts}, {world} rank(s)) need {need} bytes per rank, more than "
            f"the {buf.num_rdma_bytes} given: size it with Buffer.get_low_latency_rdma_size_hint({m}, {hidden}, "
            f"{world}, {num_experts})",
        )
    with torch.cuda.device(buf.device):
        buf._ll = _core.Buffer(
            buf.group,
            0,
            buf.num_rdma_bytes,
            True,
            # The core's normal-mode region is not used: the smallest there is.
            max_tokens_per_rank=1,
            hidden=hidden,
            num_topk=num_topk,
            num_experts=num_experts,
            explicitly_destroy=True,
            num_max_dispatch_tokens_per_rank=m,
            ll_masking=buf.enable_shrink,
            **_core_kwargs(buf, buf._plan.ll_transport),
        )
    for rank, masked in buf._mask_before_core.items():
        buf._ll.low_latency_update_mask_buffer(rank, masked)
    buf._mask_before_core.clear()
    return buf._ll


def _check_config(buf, config):
    if config is None:
        return
    if not isinstance(config, _CoreConfig):
        fail("config", f"must be a deep_ep.Config (an epcomm.Config) or None (got {type(config).__name__})")
    core = buf._normal
    if core is not None and config.num_sms != core.get_num_sms():
        fail(
            "config",
            f"config.num_sms = {config.num_sms}, but this Buffer's normal ops run with {core.get_num_sms()} SMs, "
            "fixed at its first dispatch (epcomm launches every op of a Buffer with one SM count)",
        )


def _then(core, event, fn):
    """Runs `fn` (returns the tensors it made or filled) after the op whose EventOverlap is
    `event`: on the current stream when the op was synchronous, else on `core`'s comm stream,
    returning a new EventOverlap recorded after it."""
    if event.event is None:
        fn()
        return event
    comm = core.get_comm_stream()
    compute = torch.cuda.current_stream()
    with torch.cuda.stream(comm):
        made = fn()
    for t in made:
        # Allocated or written on the comm stream, used by the caller's stream.
        t.record_stream(comm)
        t.record_stream(compute)
    done = torch.cuda.Event()
    done.record(comm)
    return async_event(done, comm)


# ----------------------------------------------------------------------------------------------
# Normal mode


def layout_tensors(topk_idx, num_experts, world):
    """``(num_tokens_per_rank int32 [world], num_tokens_per_expert int32 [num_experts],
    is_token_in_rank bool [T, world])`` of `topk_idx` with torch ops (no host sync; ids outside
    ``[0, num_experts)`` count nowhere). Integer sums: deterministic."""
    dev = topk_idx.device
    epr = num_experts // world
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    owner = torch.where(valid, topk_idx // epr, torch.full_like(topk_idx, world))
    ranks = torch.arange(world, dtype=topk_idx.dtype, device=dev)
    in_rank = (owner.unsqueeze(-1) == ranks).any(dim=1)
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    ids = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts)).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    per_expert.scatter_add_(0, ids, torch.ones(ids.shape, dtype=torch.int32, device=dev))
    return per_rank, per_expert[:num_experts], in_rank


def check_layout(buf, topk_idx, num_experts):
    """The checks of ``get_dispatch_layout`` on any number of nodes; remembers ``num_topk``
    and ``num_experts`` for the first dispatch. Returns ``(num_tokens, num_topk)``."""
    _alive(buf)
    world = buf.group_size
    check_int("num_experts", num_experts, minimum=1)
    if num_experts % world != 0:
        fail("num_experts", f"must be a multiple of the {world} ranks (got {num_experts})")
    d = _shape("topk_idx", topk_idx, 2, ("num_tokens", "num_topk"))
    check(
        "topk_idx", d, dtypes=("int64",), shape=(None, None), device=buf.device, shape_names=("num_tokens", "num_topk")
    )
    n, k = d.shape
    if k < 1:
        fail("topk_idx", "must have at least one column (num_topk >= 1)")
    buf._layout_shape = (k, num_experts)
    return n, k


def get_dispatch_layout(buf, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
    n, k = check_layout(buf, topk_idx, num_experts)
    core = buf._normal
    if core is not None and (core.num_topk, core.num_experts) == (k, num_experts) and n <= core.max_tokens_per_rank:
        # epcomm's own kernel; its is_token_in_rank lets the next dispatch reuse the layout.
        return core.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream)
    op = StreamOp(comm_stream(buf), previous_event, async_finish, allocate_on_comm_stream)
    op.use(topk_idx)
    op.begin()
    with torch.cuda.stream(op.comm):
        per_rank, per_expert, in_rank = layout_tensors(topk_idx, num_experts, buf.group_size)
    # Made on the comm stream; the caller's stream uses them (and frees them) after the event.
    for t in (per_rank, per_expert, in_rank):
        t.record_stream(op.compute)
    return per_rank, None, per_expert, in_rank, op.finish()


def _x(x):
    """`x` checked to be a tensor or an ``(e4m3, scales)`` pair: ``(x, its rows)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            fail("x", f"an FP8 x is a tuple (x, scales) (got {len(x)} elements)")
        x8, scales = x
        describe("x", x8)
        describe("scales", scales)
        return (x8, scales), x8
    return x, x


def _contiguous_scales(core, x, previous_event):
    """`x` with contiguous scales for epcomm (DeepEP takes strided ones, e.g. column-major): a
    copy, made where the op will read it. Without `previous_event` the op's stream waits for the
    current stream, so the copy is made there; with it, the op's stream waits only for that
    event, so the copy is made on the op's stream after it (the source kept from reuse until
    then)."""
    if not isinstance(x, tuple) or x[1].is_contiguous():
        return x
    x8, scales = x
    if previous_event is None or previous_event.event is None:
        return x8, scales.contiguous()
    comm = core.get_comm_stream()
    comm.wait_event(previous_event.event)
    with torch.cuda.stream(comm):
        copy = scales.contiguous()
    scales.record_stream(comm)
    copy.record_stream(comm)
    return x8, copy


def _rank_prefix(core, handle):
    """DeepEP's ``rank_prefix_matrix`` ``[world, world]`` int32 of an epcomm dispatch handle:
    column ``rank`` from the handle's receive prefix (end row of each source), -1 elsewhere."""
    world, rank = core.group_size, core.rank
    slot = handle._slot
    prefix = getattr(slot, "deep_ep_prefix", None) if slot is not None else None
    if prefix is None:
        native = handle._native
        prefix = view(native.recv_prefix_ptr, (world + 1,), torch.int32, core.device, native)
        if slot is not None:
            # Kept with the reused handle slot, so that a CUDA-graph capture makes no view.
            slot.deep_ep_prefix = prefix
    rpm = torch.full((world, world), -1, dtype=torch.int32, device=core.device)
    rpm[:, rank] = prefix[1:]
    return rpm


def _recv_src_idx(core, handle):
    """DeepEP's ``recv_src_idx``: the source token index of each returned row (``[num_rows]``
    int32; rows past the received ones, with ``num_worst_tokens``, hold no index), a copy of the
    epcomm handle's array, which a later dispatch along a reused handle slot overwrites."""
    native = handle._native
    rows = handle.num_rows
    if rows == 0:
        return torch.empty((0,), dtype=torch.int32, device=core.device)
    return view(native.recv_src_idx_ptr, (rows,), torch.int32, core.device, native).clone()


def first_shape(buf, topk_idx, num_tokens_per_expert):
    """``(num_topk, num_experts)`` of a non-cached dispatch: from its tensors, else the latest
    ``get_dispatch_layout``, else the normal core; a first dispatch without them is refused."""
    known = buf._normal
    if topk_idx is not None:
        num_topk = _shape("topk_idx", topk_idx, 2, ("num_tokens", "num_topk")).shape[1]
    elif buf._layout_shape is not None:
        num_topk = buf._layout_shape[0]
    elif known is not None:
        num_topk = known.num_topk
    else:
        fail(
            "topk_idx",
            "the first dispatch of a Buffer fixes num_topk: pass topk_idx, or call get_dispatch_layout before it",
        )
    if num_tokens_per_expert is not None:
        num_experts = _shape("num_tokens_per_expert", num_tokens_per_expert, 1, ("num_experts",)).shape[0]
    elif buf._layout_shape is not None:
        num_experts = buf._layout_shape[1]
    elif known is not None:
        num_experts = known.num_experts
    else:
        fail(
            "num_tokens_per_expert",
            "the first dispatch of a Buffer fixes num_experts: pass num_tokens_per_expert, or call "
            "get_dispatch_layout before it",
        )
    return num_topk, num_experts


def _normal_handle(buf, handle):
    if not isinstance(handle, IntranodeHandle):
        fail("handle", f"must be the handle of this Buffer's dispatch (got {type(handle).__name__})")
    if buf._normal is None:
        fail("handle", "was produced by another Buffer (this one has dispatched nothing)")
    return handle.epcomm_handle


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
    _alive(buf)
    del num_tokens_per_rdma_rank  # DeepEP's intranode dispatch ignores it too
    x, rows = _x(x)
    # What the core's dispatch takes as it is, cached or not.
    passed = dict(
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=expert_alignment,
        num_worst_tokens=num_worst_tokens,
        config=config,
        previous_event=previous_event,
        async_finish=async_finish,
        allocate_on_comm_stream=allocate_on_comm_stream,
    )
    if handle is not None:
        h = _normal_handle(buf, handle)
        core = buf._normal
        _check_config(buf, config)
        d = _shape("x", rows, 2, ("num_tokens", "hidden"))
        _fixed("x", "hidden", core.hidden, d.shape[1], "dispatch")
        recv_x, _, _, _, _, event = core.dispatch(_contiguous_scales(core, x, previous_event), handle=h, **passed)
        return recv_x, None, None, None, None, event
    d = _shape("x", rows, 2, ("num_tokens", "hidden"))
    num_tokens, hidden = d.shape
    num_topk, num_experts = first_shape(buf, topk_idx, num_tokens_per_expert)
    # Before the creation: the type (the creation reads config.num_sms), or the core's SMs.
    _check_config(buf, config)
    core = _normal_core(buf, hidden, num_topk, num_experts, num_tokens, config)
    recv_x, recv_idx, recv_w, per_expert, h, event = core.dispatch(
        _contiguous_scales(core, x, previous_event),
        num_tokens_per_rank=num_tokens_per_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        **passed,
    )
    made = []

    def tail():
        # rank_prefix_matrix, recv_src_idx, is_token_in_rank (computed when not given).
        made.extend((_rank_prefix(core, h), _recv_src_idx(core, h)))
        if is_token_in_rank is None:
            made.append(layout_tensors(topk_idx, core.num_experts, core.group_size)[2])
        return tuple(made)

    event = _then(core, event, tail)
    rpm, src = made[0], made[1]
    in_rank = made[2] if is_token_in_rank is None else is_token_in_rank
    items = (rpm, None, None, src, in_rank, None)
    return recv_x, recv_idx, recv_w, per_expert, IntranodeHandle(items, h), event


def _bias(core, bias, num_tokens):
    """``(bias_0, bias_1)``, each None or a checked bf16 ``[num_tokens, hidden]`` tensor."""
    if bias is None:
        return None, None
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            fail("bias", f"a tuple of biases has two elements (bias_0, bias_1; None allowed) (got {len(bias)})")
        parts = tuple(bias)
    else:
        parts = (bias, None)
    for t in parts:
        if t is not None:
            check(
                "bias",
                describe("bias", t),
                dtypes=("bfloat16",),
                shape=(num_tokens, core.hidden),
                device=core.device,
                shape_names=("num_tokens", "hidden"),
            )
    return parts


def combine(buf, x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream):
    _alive(buf)
    h = _normal_handle(buf, handle)
    core = buf._normal
    b0, b1 = _bias(core, bias, h.num_tokens)
    _check_config(buf, config)
    out, out_w, event = core.combine(
        x,
        h,
        topk_weights=topk_weights,
        config=config,
        previous_event=previous_event,
        async_finish=async_finish,
        allocate_on_comm_stream=allocate_on_comm_stream,
    )
    return add_bias(core, out, out_w, event, b0, b1)


def add_bias(core, out, out_w, event, b0, b1):
    """``(out, out_w, event)`` of a combine with the biases (None allowed) added to ``out``
    after the op: ``bf16((f32(b0) + f32(b1)) + f32(out))``."""
    if b0 is None and b1 is None:
        return out, out_w, event

    def add():
        both = [t.float() for t in (b0, b1) if t is not None]
        acc = both[0] if len(both) == 1 else both[0] + both[1]
        out.copy_(acc + out.float())
        # The biases are read here too: kept from reuse until this ran.
        return (out, *(t for t in (b0, b1) if t is not None))

    return out, out_w, _then(core, event, add)


# ----------------------------------------------------------------------------------------------
# Low latency


def _ll_handle(buf, handle):
    if not isinstance(handle, LowLatencyHandle):
        fail("handle", f"must be the handle of this Buffer's low_latency_dispatch (got {type(handle).__name__})")
    if buf._ll is None:
        fail("handle", "was produced by another Buffer (this one has no low-latency op yet)")
    return handle.epcomm_handle


def clean_low_latency_buffer(buf, num_max_dispatch_tokens_per_rank, hidden, num_experts):
    _alive(buf)
    check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
    check_int("hidden", hidden, minimum=1)
    check_int("num_experts", num_experts, minimum=1)
    core = buf._ll
    if core is not None:
        first = "low-latency op"
        _fixed(
            "num_max_dispatch_tokens_per_rank",
            "num_max_dispatch_tokens_per_rank",
            core.num_max_dispatch_tokens_per_rank,
            num_max_dispatch_tokens_per_rank,
            first,
        )
        _fixed("hidden", "hidden", core.hidden, hidden, first)
        _fixed("num_experts", "num_experts", core.num_experts, num_experts, first)
        if buf.enable_shrink:
            _check_in(core)


def _check_in(core):
    """Shrink mode's clean: an empty low-latency dispatch, which every rank joins; a rank that
    does not arrive within the timeout is masked (its kernels do that)."""
    dev = core.device
    x = torch.empty((0, core.hidden), dtype=torch.bfloat16, device=dev)
    idx = torch.empty((0, core.num_topk), dtype=torch.int64, device=dev)
    core.low_latency_dispatch(x, idx, core.num_max_dispatch_tokens_per_rank, core.num_experts)


# ----------------------------------------------------------------------------------------------
# Rank masking (enable_shrink)


def update_mask(buf, rank, mask):
    _alive(buf)
    check_int("rank_to_mask", rank)
    check_bool("mask", mask)
    if buf._ll is not None:
        buf._ll.low_latency_update_mask_buffer(rank, mask)
        return
    if rank >= buf.group_size or rank == buf.rank:
        fail("rank_to_mask", f"must be a peer: in 0..{buf.group_size} and not this rank ({buf.rank}) (got {rank})")
    buf._mask_before_core[rank] = mask


def query_mask(buf, mask_status):
    _alive(buf)
    if buf._ll is not None:
        buf._ll.low_latency_query_mask_buffer(mask_status)
        return
    d = describe("mask_status", mask_status)
    check("mask_status", d, dtypes=("int32",), shape=(buf.group_size,), device=buf.device, shape_names=("num_ranks",))
    mask_status.zero_()
    for rank, masked in buf._mask_before_core.items():
        mask_status[rank] = int(masked)


def clean_mask(buf):
    _alive(buf)
    if buf._ll is not None:
        buf._ll.low_latency_clean_mask_buffer()
    buf._mask_before_core.clear()


def ue8m0_into(scales, out):
    """Fills `out` (``[E, S, cap]`` int32, contiguous; returned to the caller as its
    ``transpose(1, 2)``: DeepEP's column-major packed scales) from epcomm's row-major f32
    power-of-two `scales` ``[E, cap, hidden / 128]``: their exponent bytes packed four per
    int32, little-endian (channels ``[512 j, 512 j + 512)`` in int32 ``j``; a power of two's
    byte is its whole value: ``f32(byte << 23)``)."""
    exponents = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    out.copy_(exponents.view(torch.int32).transpose(1, 2))


def low_latency_dispatch(buf, *args):
    """Buffer.low_latency_dispatch (its arguments in order), with torch's function handling
    off (as the core's op: every allocation names its device and dtype)."""
    with torch_function_off():
        return _low_latency_dispatch(buf, *args)


def _low_latency_dispatch(
    buf,
    x,
    topk_idx,
    num_max_dispatch_tokens_per_rank,
    num_experts,
    cumulative_local_expert_recv_stats,
    dispatch_wait_recv_cost_stats,
    use_fp8,
    round_scale,
    use_ue8m0,
    async_finish,
    return_recv_hook,
):
    _alive(buf)
    check_bool("use_ue8m0", use_ue8m0)  # the other flags: _ll_args.check_dispatch below
    hidden = _dim("x", x, 2, ("num_tokens", "hidden"), 1)
    num_topk = _dim("topk_idx", topk_idx, 2, ("num_tokens", "num_topk"), 1)
    if use_ue8m0:
        if not use_fp8:
            fail("use_ue8m0", "applies to FP8 dispatches only (use_fp8=True)")
        if not round_scale:
            fail("use_ue8m0", "needs round_scale=True (as in DeepEP): UE8M0 holds powers of two only")
        if hidden % _UE8M0_BLOCK != 0:
            fail(
                "use_ue8m0",
                f"packed UE8M0 scales need hidden % {_UE8M0_BLOCK} == 0 (four 128-channel scales per int32; "
                f"hidden = {hidden})",
            )
    m = num_max_dispatch_tokens_per_rank
    # The core's tensor-free rules before its (collective) creation, which a refusal must not
    # follow, nor fix the core's shape. Once the core exists it checks them itself (once per
    # op, not twice).
    if buf._ll is None:
        check_int("num_max_dispatch_tokens_per_rank", m, minimum=1)
        _ll_args.check_dispatch(
            buffer_max=m,
            given_max=m,
            buffer_experts=num_experts,
            num_experts=num_experts,
            hidden=hidden,
            use_fp8=use_fp8,
            round_scale=round_scale,
            use_ue8m0=False,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
            dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
        )
    core = _ll_core(buf, hidden, num_topk, num_experts, m)
    # FP8 scales arrive in DeepEP's layout from the kernel itself (views of the receive set,
    # as DeepEP's); packed UE8M0 bytes are made from the f32 scales by a copy.
    column_major = use_fp8 and not use_ue8m0
    out_scales = None
    if use_ue8m0:
        # Allocated before the op, on the current stream (which the op's stream waits for).
        local, cap = num_experts // buf.group_size, buf.group_size * m
        out_scales = torch.empty((local, hidden // _UE8M0_BLOCK, cap), dtype=torch.int32, device=core.device)
    recv, count, h, event, hook = core.low_latency_dispatch(
        x,
        topk_idx,
        m,
        num_experts,
        use_fp8=use_fp8,
        round_scale=round_scale,
        use_ue8m0=False,
        async_finish=async_finish,
        return_recv_hook=return_recv_hook,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
        column_major_scales=column_major,
    )
    handle = LowLatencyHandle((h.src_info, h.layout_range, m, hidden, num_experts), h)
    if not use_ue8m0:
        return recv, count, handle, event, hook
    rows, scales = recv

    def convert():
        ue8m0_into(scales, out_scales)
        return (out_scales,)

    recv = (rows, out_scales.transpose(1, 2))
    if hook is not None:
        return recv, count, handle, event, _Hook(hook, convert)
    return recv, count, handle, _then(core, event, convert), None


class _Hook:
    """The receive phase of a low-latency dispatch, then the DeepEP layout of its scales (on
    the current stream, which the receive phase's end made wait for it)."""

    def __init__(self, receive, after):
        self._receive = receive
        self._after = after

    def __call__(self):
        self._receive()
        self._after()

    def __repr__(self):
        return f"<deep_ep receive hook: {self._receive!r} + scale layout>"


def low_latency_combine(buf, *args):
    """Buffer.low_latency_combine (its arguments in order), as low_latency_dispatch."""
    with torch_function_off():
        return _low_latency_combine(buf, *args)


def _low_latency_combine(
    buf,
    x,
    topk_idx,
    topk_weights,
    handle,
    use_logfmt,
    zero_copy,
    async_finish,
    return_recv_hook,
    out,
    combine_wait_recv_cost_stats,
):
    _alive(buf)
    check_bool("use_logfmt", use_logfmt)
    check_bool("zero_copy", zero_copy)
    if use_logfmt:
        fail(
            "use_logfmt", "LogFMT-compressed combine is not implemented: epcomm sends bf16 rows (pass use_logfmt=False)"
        )
    h = _ll_handle(buf, handle)
    if zero_copy:
        if buf._combine_buffer is None:
            fail(
                "zero_copy",
                "there is no combine buffer yet: fill get_next_low_latency_combine_buffer(handle) first (as in DeepEP)",
            )
        x = buf._combine_buffer
    return buf._ll.low_latency_combine(
        x,
        topk_idx,
        topk_weights,
        h,
        use_logfmt=False,
        zero_copy=False,
        async_finish=async_finish,
        return_recv_hook=return_recv_hook,
        out=out,
        combine_wait_recv_cost_stats=combine_wait_recv_cost_stats,
    )


def next_combine_buffer(buf, handle):
    _alive(buf)
    _ll_handle(buf, handle)
    core = buf._ll
    if buf._combine_buffer is None:
        local = core.num_experts // core.group_size
        cap = core.group_size * core.num_max_dispatch_tokens_per_rank
        buf._combine_buffer = torch.empty((local, cap, core.hidden), dtype=torch.bfloat16, device=core.device)
    # An earlier zero-copy combine may still read it on the comm stream.
    torch.cuda.current_stream().wait_stream(core.get_comm_stream())
    return buf._combine_buffer
