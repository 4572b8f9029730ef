"""Kernel configuration (DeepEP's ``Config``) and buffer sizing, without a GPU."""

from . import _native
from .errors import InvalidArgumentError

__all__ = ["Config", "DEFAULT_NUM_SMS", "size_hint", "low_latency_size_hint", "check_options"]

# The Rust default, epcomm::BufferConfig::DEFAULT_NUM_SMS, written out (the native module does
# not export it); a test of the epcomm-cli crate fails when the two differ.
#: SMs (blocks) per op when neither the Buffer nor :meth:`Buffer.set_num_sms` says otherwise.
DEFAULT_NUM_SMS = 24


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(
            f"invalid {name}: must be a positive int (got {value!r})",
            argument=name,
            rule="must be a positive int",
        )
    return value


class Config:
    """The per-op configuration DeepEP's ``dispatch``/``combine`` take.

    epcomm launches every op of a Buffer with the Buffer's SM count (the completion counters of
    the kernels count blocks, and every rank must launch the same number), so ``num_sms`` must
    equal the Buffer's: an op given another value raises :class:`InvalidArgumentError`.

    The chunk sizes are DeepEP's staging-queue sizes. epcomm has no staging queues (each row
    is written once, straight into its final row on the receiving rank), so they are accepted
    for source compatibility with DeepEP code and have no effect; when given they must be
    positive ints, as in DeepEP.
    """

    def __init__(
        self,
        num_sms,
        num_max_nvl_chunked_send_tokens=None,
        num_max_nvl_chunked_recv_tokens=None,
        num_max_rdma_chunked_send_tokens=None,
        num_max_rdma_chunked_recv_tokens=None,
    ):
        self.num_sms = _positive_int("num_sms", num_sms)
        chunks = {
            "num_max_nvl_chunked_send_tokens": num_max_nvl_chunked_send_tokens,
            "num_max_nvl_chunked_recv_tokens": num_max_nvl_chunked_recv_tokens,
            "num_max_rdma_chunked_send_tokens": num_max_rdma_chunked_send_tokens,
            "num_max_rdma_chunked_recv_tokens": num_max_rdma_chunked_recv_tokens,
        }
        for name, value in chunks.items():
            setattr(self, name, None if value is None else _positive_int(name, value))

    def __repr__(self):
        return f"Config(num_sms={self.num_sms})"

    def __eq__(self, other):
        return isinstance(other, Config) and vars(self) == vars(other)


def check_options(
    *,
    world_size,
    max_tokens_per_rank,
    hidden,
    num_topk,
    num_experts,
    num_sms=DEFAULT_NUM_SMS,
    transport="ipc",
    schedule="epoch",
    routes="auto",
    timeout=100.0,
    rank=0,
    local_world_size=None,
    num_max_dispatch_tokens_per_rank=0,
    two_tier=False,
):
    """Checks a Buffer's arguments for ``world_size`` ranks without a GPU and returns ``{"symmetric_bytes", "capacity",
    "transport", "low_latency_bytes"}``: the symmetric memory each rank allocates, the most
    rows one dispatch can receive (``world_size * max_tokens_per_rank``), the canonical
    transport spec, and the part of ``symmetric_bytes`` the low-latency regions take (0 unless
    ``num_max_dispatch_tokens_per_rank > 0``). ``local_world_size`` (ranks per host) defaults
    to ``world_size`` (one host).

    The rules are the library's device-free rules, the very ones creating a Buffer runs before
    it touches the GPU (``epcomm::rules``): the argument types and ranges, at most 64 ranks,
    ``num_experts`` a multiple of ``world_size``, a schedule and routes the transport supports
    (``routes="put-signal"`` needs a transport with put/signal, not ``"ipc"``), a world layout
    the transport can form, and the low-latency token limit (the routing bitmaps must fit in
    shared memory: at most 992 ``num_max_dispatch_tokens_per_rank`` for 256 experts on up to
    8 ranks). What it accepts, Buffer accepts on a GPU with enough SMs and memory. Raises
    :class:`InvalidArgumentError` naming the first broken rule's argument; its message lists
    every broken rule. ``two_tier=True`` adds the two-tier rules (ranks on several nodes of the
    transport, no low-latency memory); ``symmetric_bytes`` and ``capacity`` are then the flat
    plan's (a two-tier Buffer reports its own once created)."""
    if not isinstance(two_tier, bool):
        raise InvalidArgumentError(
            f"invalid two_tier: must be a bool (got {two_tier!r})", argument="two_tier", rule="must be a bool"
        )
    for name, value in (
        ("world_size", world_size),
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("hidden", hidden),
        ("num_topk", num_topk),
        ("num_experts", num_experts),
        ("num_sms", num_sms),
    ):
        _positive_int(name, value)
    if isinstance(num_max_dispatch_tokens_per_rank, bool) or not isinstance(num_max_dispatch_tokens_per_rank, int) or (
        num_max_dispatch_tokens_per_rank < 0
    ):
        raise InvalidArgumentError(
            f"invalid num_max_dispatch_tokens_per_rank: must be an int >= 0 (got {num_max_dispatch_tokens_per_rank!r})",
            argument="num_max_dispatch_tokens_per_rank",
            rule="must be an int >= 0",
        )
    if num_max_dispatch_tokens_per_rank > 0xFFFF:
        raise InvalidArgumentError(
            f"invalid num_max_dispatch_tokens_per_rank: must be at most 65535 (got {num_max_dispatch_tokens_per_rank})",
            argument="num_max_dispatch_tokens_per_rank",
            rule="must be at most 65535",
        )
    local = world_size if local_world_size is None else _positive_int("local_world_size", local_world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"invalid rank: must be in 0..{world_size} (got {rank!r})", argument="rank", rule=f"must be in 0..{world_size}"
        )
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"invalid timeout: must be a number of seconds (got {timeout!r})",
            argument="timeout",
            rule="must be a number of seconds",
        ) from None
    for name, value in (("transport", transport), ("schedule", schedule), ("routes", routes)):
        if not isinstance(value, str):
            raise InvalidArgumentError(
                f"invalid {name}: must be a str (got {value!r})", argument=name, rule="must be a str"
            )
    return _native.check_options(
        max_tokens_per_rank,
        hidden,
        num_topk,
        num_experts,
        num_sms,
        transport,
        schedule,
        routes,
        timeout,
        world_size,
        rank,
        local,
        num_max_dispatch_tokens_per_rank,
        two_tier=bool(two_tier),
    )


def size_hint(num_ranks, max_tokens_per_rank, hidden, num_topk, num_experts):
    """Bytes of symmetric GPU memory each rank's Buffer allocates for this shape (what DeepEP
    users pass as ``num_nvl_bytes``; epcomm sizes the buffer from the shape itself)."""
    return check_options(
        world_size=num_ranks,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden=hidden,
        num_topk=num_topk,
        num_experts=num_experts,
    )["symmetric_bytes"]


def low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk):
    """Bytes of symmetric GPU memory per rank that the low-latency regions add for this shape
    (DeepEP's ``get_low_latency_rdma_size_hint``, plus ``num_topk``: epcomm plans the combine
    rows per (token, k)). The same number whatever ``max_tokens_per_rank`` the Buffer has."""
    _positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    return check_options(
        world_size=num_ranks,
        max_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        hidden=hidden,
        num_topk=num_topk,
        num_experts=num_experts,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
    )["low_latency_bytes"]
