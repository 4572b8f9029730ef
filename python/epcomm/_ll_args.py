"""Argument rules of the low-latency ops (``Buffer.low_latency_dispatch`` /
``low_latency_combine``) that need no tensor: the Buffer's low-latency capacity, the flags
DeepEP's API has and epcomm refuses, and the flag combinations. Torch-free, so that they are
tested without a GPU. Every rule that fails raises
:class:`~epcomm.errors.InvalidArgumentError` naming the argument."""

from . import _native
from ._args import check_bool, fail

#: Channels per FP8 scale: the native layer's row format (``RowFormat::FP8_BLOCK`` of
#: epcomm-topology, the block the buffer plans and kernels use), not a copy of it.
FP8_BLOCK = _native.FP8_BLOCK


def check_ready(buffer_max, given=None):
    """The Buffer has low-latency memory (`buffer_max` > 0) and `given` (when not None) is its
    ``num_max_dispatch_tokens_per_rank``."""
    if buffer_max == 0:
        fail(
            "num_max_dispatch_tokens_per_rank",
            "this Buffer has no low-latency memory: create it with num_max_dispatch_tokens_per_rank > 0 (the most "
            "tokens a rank passes to one low-latency dispatch) to use the low-latency ops",
        )
    if given is not None and (isinstance(given, bool) or given != buffer_max):
        fail(
            "num_max_dispatch_tokens_per_rank",
            f"must be this Buffer's num_max_dispatch_tokens_per_rank = {buffer_max} (got {given!r})",
        )


def check_dispatch(
    *,
    buffer_max,
    given_max,
    buffer_experts,
    num_experts,
    hidden,
    use_fp8,
    round_scale,
    use_ue8m0,
    async_finish,
    return_recv_hook,
    dispatch_wait_recv_cost_stats,
):
    """The tensor-free rules of a low-latency dispatch."""
    check_ready(buffer_max, given_max)
    for name, value in (
        ("use_fp8", use_fp8),
        ("round_scale", round_scale),
        ("use_ue8m0", use_ue8m0),
        ("async_finish", async_finish),
        ("return_recv_hook", return_recv_hook),
    ):
        check_bool(name, value)
    if isinstance(num_experts, bool) or num_experts != buffer_experts:
        fail("num_experts", f"must be this Buffer's num_experts = {buffer_experts} (got {num_experts!r})")
    if use_ue8m0:
        fail(
            "use_ue8m0",
            "packed UE8M0 scales are not implemented: epcomm's scales are f32 (round_scale=True makes them powers "
            "of two, the values UE8M0 can hold, still stored as f32); pass use_ue8m0=False",
        )
    if round_scale and not use_fp8:
        fail("round_scale", "applies to FP8 dispatches only (use_fp8=True)")
    if use_fp8 and hidden % FP8_BLOCK != 0:
        fail("use_fp8", f"an FP8 dispatch needs hidden % {FP8_BLOCK} == 0 (hidden = {hidden})")
    _hook_and_async(async_finish, return_recv_hook)
    if dispatch_wait_recv_cost_stats is not None:
        fail("dispatch_wait_recv_cost_stats", "is not implemented (pass None): Buffer.last_op_stats() reports the waits")


def check_combine(*, buffer_max, use_logfmt, zero_copy, async_finish, return_recv_hook, combine_wait_recv_cost_stats):
    """The tensor-free rules of a low-latency combine."""
    check_ready(buffer_max)
    for name, value in (
        ("use_logfmt", use_logfmt),
        ("zero_copy", zero_copy),
        ("async_finish", async_finish),
        ("return_recv_hook", return_recv_hook),
    ):
        check_bool(name, value)
    if use_logfmt:
        fail("use_logfmt", "LogFMT-compressed combine is not implemented: epcomm sends bf16 rows (pass use_logfmt=False)")
    if zero_copy:
        fail(
            "zero_copy",
            "epcomm.Buffer has no get_next_low_latency_combine_buffer (epcomm.deep_ep.Buffer has one, for "
            "DeepEP's code): pass zero_copy=False; the combine reads x once and writes the peers' rows directly",
        )
    _hook_and_async(async_finish, return_recv_hook)
    if combine_wait_recv_cost_stats is not None:
        fail("combine_wait_recv_cost_stats", "is not implemented (pass None): Buffer.last_op_stats() reports the waits")


def _hook_and_async(async_finish, return_recv_hook):
    if async_finish and return_recv_hook:
        fail(
            "return_recv_hook",
            "cannot be combined with async_finish=True (as in DeepEP): the hook orders the receive phase",
        )


def check_options(num_max_dispatch_tokens_per_rank, low_latency_mode, num_rdma_bytes):
    """The Buffer constructor's low-latency arguments."""
    ll = num_max_dispatch_tokens_per_rank
    check_bool("low_latency_mode", low_latency_mode)
    if num_rdma_bytes != 0 and ll == 0:
        fail(
            "num_rdma_bytes",
            "must be 0 without low-latency memory: epcomm's normal mode has no RDMA buffer (use "
            "transport='nvshmem' for put/signal; num_max_dispatch_tokens_per_rank > 0 plans low-latency memory)",
        )
    if low_latency_mode and ll == 0:
        fail(
            "low_latency_mode",
            "needs num_max_dispatch_tokens_per_rank > 0 (the most tokens a rank passes to one "
            "low_latency_dispatch), which plans the low-latency memory",
        )
