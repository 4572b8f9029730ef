"""The low-latency (decode) ops of :class:`epcomm.Buffer`, DeepEP's ``low_latency_dispatch`` /
``low_latency_combine``, on the native layer's low-latency session methods.

How it maps:

* The native session owns two sets of receive arrays and low-latency dispatches alternate
  between them: the tensors a dispatch returns are **views** of one set, valid until the
  second-next low-latency dispatch (the next one writes the other set), as in DeepEP.
* Without a hook both phases run on the comm stream, ordered against torch's current stream
  like every other op (``async_finish`` returns an event instead of waiting). Such ops may be
  captured into a CUDA graph (``torch.cuda.graph``): each replay is a new op (the kernels keep
  their sequence on the device) writing the receive set the capture used.
* ``return_recv_hook=True`` issues only the send phase; the current stream then waits for the
  comm stream (so work queued after it cannot overwrite the inputs while the send reads
  them), and the returned ``hook()`` issues the receive phase on the comm stream and makes the
  then current stream wait for it. The Buffer keeps the op's input and output tensors
  referenced until the hook ran; no other op of the Buffer may run in between.
"""

import torch

from ._args import check, check_bool, describe, fail
from ._ll_args import FP8_BLOCK as _FP8_BLOCK
from ._ll_args import check_combine, check_dispatch
from ._streams import EventOverlap, async_event, current_raw_stream, host_wait, torch_function_off
from ._views import view

_FP8 = getattr(torch, "float8_e4m3fn", None)


class LowLatencyHandle:
    """The routing of one low-latency dispatch, for :meth:`Buffer.low_latency_combine`.
    Valid with the Buffer that made it until the second-next low-latency dispatch.

    ``num_tokens``: this rank's tokens of the dispatch; ``src_info``
    (``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`` int32): the source
    token index of each received row; ``layout_range`` (``[num_local_experts, num_ranks]``
    int64): ``(first row << 32) | rows`` received from each rank. Both are views of the same
    receive set as the dispatch's ``recv_x``."""

    def __init__(self, buffer, seq, num_tokens, use_fp8, src_info, layout_range):
        self._buffer_id = id(buffer)
        self._seq = seq
        self.num_tokens = num_tokens
        self.use_fp8 = use_fp8
        self.src_info = src_info
        self.layout_range = layout_range

    def __repr__(self):
        return f"LowLatencyHandle(dispatch={self._seq}, num_tokens={self.num_tokens}, use_fp8={self.use_fp8})"


class _Hook:
    """The receive phase of a low-latency op whose send phase was issued (call it once)."""

    def __init__(self, buffer, op):
        self._buffer = buffer
        self._op = op

    def __call__(self):
        b = self._buffer
        with torch_function_off():
            # The receive phase writes the outputs (and reads the receive set) after whatever
            # the caller queued on its current stream since the send phase, as if it ran
            # there: the comm stream waits for that stream, which then waits for the phase.
            b._session.ll_receive(self._op, current_raw_stream(b.device), True)
            b._ll_keep = None

    def __repr__(self):
        return f"<epcomm low-latency receive hook of op #{self._op}>"


def _tensor(buf, argument, t, dtypes, shape, names):
    d = describe(argument, t)
    check(argument, d, dtypes=dtypes, shape=shape, device=buf.device, shape_names=names)
    return d


def _array(buf, argument, t, dtype, shape, spec, names):
    """``(address, numel)`` of tensor `t` of `dtype` (a torch dtype) and `shape` on the
    Buffer's GPU, contiguous. The common case costs a few attribute reads; anything else goes
    through :func:`check` against `spec` (`shape` with None for a free dimension), which
    raises the error naming `argument` and the rule."""
    try:
        if t.dtype is dtype and t.shape == shape and t.get_device() == buf.device and t.is_contiguous():
            return t.data_ptr(), t.numel()
    except AttributeError:
        pass
    d = _tensor(buf, argument, t, (str(dtype).replace("torch.", ""),), spec, names)
    return d.ptr, d.numel


def _rows(t):
    """The first dimension of `t` when it has two, else -1 (its checks then name the rule)."""
    try:
        s = t.shape
        return s[0] if len(s) == 2 else -1
    except AttributeError:
        return -1


def _capturable(return_recv_hook):
    """A low-latency op may be captured into a CUDA graph (``torch.cuda.graph``), without a hook:
    its kernels read their sequence numbers and region parity on the device, so every replay
    runs as a new op; the captured op writes (and its combine reads) the receive set it was
    captured with at every replay."""
    if return_recv_hook and torch.cuda.is_current_stream_capturing():
        fail(
            "return_recv_hook",
            "a low-latency op with a receive hook cannot be captured into a CUDA graph (the hook is a "
            "host call): capture it without the hook",
        )


def _asynchronous(buf, *tensors):
    """The EventOverlap of an ``async_finish`` op: an event recorded on the comm stream; the
    tensors the op read or wrote are kept from reuse until the comm stream is done with them."""
    event = torch.cuda.Event()
    event.record(buf._comm)
    for t in tensors:
        if t is not None:
            t.record_stream(buf._comm)
    return async_event(event, buf._comm)


def _views(buf, out, use_fp8, column_major):
    """``(recv_x, recv_scales or None, recv_count, src_info, layout_range)``: views of the
    receive set `out` names (made once per set, format and scales layout, and cached in
    `buf`). Each keeps `buf`'s session (the memory's owner) alive, not `buf`: a cached view
    holding `buf` would make a cycle the garbage collector cannot see, and `buf` would never
    be freed without ``destroy()``."""
    key = (out.set, use_fp8, column_major)
    v = buf._ll_views.get(key)
    if v is None:
        e, cap, h = out.num_local_experts, out.capacity, buf.hidden
        dev, keep = buf.device, buf._session
        x = view(out.x, (e, cap, h), _FP8 if use_fp8 else torch.bfloat16, dev, buf, kind="low-latency recv_x", keep=keep)
        s = h // _FP8_BLOCK
        # Column-major: each expert's [cap, s] matrix stored [s][cap] (byte strides).
        strides = (s * cap * 4, 4, cap * 4) if column_major else None
        scales = (
            view(out.scales, (e, cap, s), torch.float32, dev, buf, strides, kind="low-latency recv_x scales", keep=keep)
            if use_fp8
            else None
        )
        count = view(out.count, (e,), torch.int32, dev, buf, kind="low-latency recv_count", keep=keep)
        src = view(out.src_info, (e, cap), torch.int32, dev, buf, kind="low-latency handle src_info", keep=keep)
        rng = view(
            out.layout_range, (e, buf.group_size), torch.int64, dev, buf, kind="low-latency handle layout_range", keep=keep
        )
        v = (x, scales, count, src, rng)
        buf._ll_views[key] = v
    return v


def dispatch(buf, *args):
    """:meth:`Buffer.low_latency_dispatch` (its arguments in order)."""
    with torch_function_off():
        return _dispatch(buf, *args)


def _dispatch(
    buf,
    x,
    topk_idx,
    num_max_dispatch_tokens_per_rank,
    num_experts,
    use_fp8,
    round_scale,
    use_ue8m0,
    async_finish,
    return_recv_hook,
    cumulative_local_expert_recv_stats,
    dispatch_wait_recv_cost_stats,
    column_major_scales,
):
    check_bool("column_major_scales", column_major_scales)
    check_dispatch(
        buffer_max=buf.num_max_dispatch_tokens_per_rank,
        given_max=num_max_dispatch_tokens_per_rank,
        buffer_experts=buf.num_experts,
        num_experts=num_experts,
        hidden=buf.hidden,
        use_fp8=use_fp8,
        round_scale=round_scale,
        use_ue8m0=use_ue8m0,
        async_finish=async_finish,
        return_recv_hook=return_recv_hook,
        dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
    )
    m, hidden, top_k = buf.num_max_dispatch_tokens_per_rank, buf.hidden, buf.num_topk
    n = _rows(x)
    xa = _array(buf, "x", x, torch.bfloat16, (n, hidden), (None, hidden), ("num_tokens", "hidden"))
    n = xa[1] // hidden
    if n > m:
        fail("x", f"holds {n} tokens, more than num_max_dispatch_tokens_per_rank = {m}")
    ia = _array(buf, "topk_idx", topk_idx, torch.int64, (n, top_k), (n, top_k), ("num_tokens", "num_topk"))
    stats = cumulative_local_expert_recv_stats
    sa = None
    if stats is not None:
        epr = (buf.num_experts // buf.group_size,)
        sa = _array(buf, "cumulative_local_expert_recv_stats", stats, torch.int32, epr, epr, ("num_local_experts",))
    _capturable(return_recv_hook)
    # Ordered after the current stream; a synchronous op (and a hook's send phase) joined
    # back into it. The receive phase adds to the cumulative stats on the device.
    number, out = buf._session.ll_dispatch(
        xa,
        ia,
        n,
        use_fp8,
        round_scale,
        return_recv_hook,
        current_raw_stream(buf.device),
        not async_finish,
        column_major_scales,
        sa,
    )
    recv_x, recv_scales, count, src, rng = _views(buf, out, use_fp8, column_major_scales)
    handle = LowLatencyHandle(buf, out.seq, n, use_fp8, src, rng)
    recv = (recv_x, recv_scales) if use_fp8 else recv_x
    if return_recv_hook:
        # The inputs (and the stats the receive phase adds to) stay referenced until the
        # receive phase ran.
        buf._ll_keep = (x, topk_idx, stats)
        return recv, count, handle, EventOverlap(None), _Hook(buf, number)
    if async_finish:
        return recv, count, handle, _asynchronous(buf, x, topk_idx, stats), None
    host_wait(buf._session.stream_handle)
    return recv, count, handle, EventOverlap(None), None


def combine(buf, *args):
    """:meth:`Buffer.low_latency_combine` (its arguments in order)."""
    with torch_function_off():
        return _combine(buf, *args)


def _combine(
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
    check_combine(
        buffer_max=buf.num_max_dispatch_tokens_per_rank,
        use_logfmt=use_logfmt,
        zero_copy=zero_copy,
        async_finish=async_finish,
        return_recv_hook=return_recv_hook,
        combine_wait_recv_cost_stats=combine_wait_recv_cost_stats,
    )
    if not isinstance(handle, LowLatencyHandle):
        fail("handle", f"must be the LowLatencyHandle of this Buffer's low_latency_dispatch (got {type(handle).__name__})")
    if handle._buffer_id != id(buf):
        fail("handle", "was produced by another Buffer")
    hidden, top_k = buf.hidden, buf.num_topk
    shape = (buf.num_experts // buf.group_size, buf.group_size * buf.num_max_dispatch_tokens_per_rank, hidden)
    n = handle.num_tokens
    ya = _array(
        buf, "x", x, torch.bfloat16, shape, shape, ("num_local_experts", "num_ranks * num_max_dispatch_tokens_per_rank", "hidden")
    )
    ia = _array(buf, "topk_idx", topk_idx, torch.int64, (n, top_k), (n, top_k), ("num_tokens", "num_topk"))
    wa = _array(buf, "topk_weights", topk_weights, torch.float32, (n, top_k), (n, top_k), ("num_tokens", "num_topk"))
    _capturable(return_recv_hook)
    if out is None:
        out = torch.empty((n, hidden), dtype=torch.bfloat16, device=buf.device)
        oa = (out.data_ptr(), out.numel())
    else:
        oa = _array(buf, "out", out, torch.bfloat16, (n, hidden), (n, hidden), ("num_tokens", "hidden"))
    number = buf._session.ll_combine(
        handle._seq, ya, ia, wa, oa, return_recv_hook, current_raw_stream(buf.device), not async_finish
    )
    if return_recv_hook:
        buf._ll_keep = (x, topk_idx, topk_weights, out)
        return out, EventOverlap(None), _Hook(buf, number)
    if async_finish:
        return out, _asynchronous(buf, x, topk_idx, topk_weights, out), None
    host_wait(buf._session.stream_handle)
    return out, EventOverlap(None), None
