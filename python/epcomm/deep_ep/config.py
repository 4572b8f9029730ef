"""DeepEP's ``Config`` and the sizing helpers of the ``deep_ep`` layer, without torch.

epcomm sizes its memory per token (every received row has its own slot, in two alternating
regions), where DeepEP sizes a ring of staging chunks. A DeepEP byte budget therefore becomes a
token limit here: :func:`fit_tokens` finds the most tokens per rank whose epcomm memory fits
``num_nvl_bytes``, and the size hints below plan for a stated shape (see each one)."""

from .. import _native
from .._args import check_int, fail
from ..config import Config as _CoreConfig
from ..config import low_latency_size_hint, size_hint
from ..errors import InvalidArgumentError

__all__ = [
    "Config",
    "DEFAULT_NUM_SMS",
    "LL_MAX_TOPK",
    "PLAN_TOKENS_PER_RANK",
    "PLAN_TOPK",
    "PLAN_EXPERTS",
    "nvl_size_hint",
    "ll_size_hint",
    "dispatch_config",
    "combine_config",
    "fit_tokens",
]

#: DeepEP's ``Buffer.num_sms`` default (epcomm's own is :data:`epcomm.DEFAULT_NUM_SMS`).
DEFAULT_NUM_SMS = 20

#: The most top-k entries DeepEP's low-latency kernels take (its ``kNumMaxTopK`` of both
#: low-latency kernels). epcomm plans its low-latency memory per (token, k), so the 4-argument
#: ``get_low_latency_rdma_size_hint`` plans for this many.
LL_MAX_TOPK = 11

#: The shape :meth:`Config.get_nvl_buffer_size_hint` plans for (DeepEP's hint has no token count):
#: this many tokens per rank, top-k up to :data:`PLAN_TOPK`, up to :data:`PLAN_EXPERTS` experts.
PLAN_TOKENS_PER_RANK = 4096
PLAN_TOPK = 16
PLAN_EXPERTS = 512

# DeepEP's tuned chunk sizes per rank count (nvl send, nvl recv, rdma send, rdma recv), kept so
# that code reading them finds DeepEP's numbers; epcomm has no staging chunks and ignores them.
_DISPATCH_CHUNKS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CHUNKS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


class Config(_CoreConfig):
    """DeepEP's ``Config``: an :class:`epcomm.Config` with DeepEP's defaults
    (``Config(num_sms=20, 6, 256, 6, 256)``) and its two size hints.

    ``num_sms`` picks the SMs of the Buffer's normal ops when the Buffer's first dispatch gets
    it; afterwards it must be that number (epcomm launches every op of a Buffer with one SM
    count). The chunk sizes are accepted and have no effect (epcomm has no staging chunks; each
    must be a positive int)."""

    def __init__(
        self,
        num_sms=DEFAULT_NUM_SMS,
        num_max_nvl_chunked_send_tokens=6,
        num_max_nvl_chunked_recv_tokens=256,
        num_max_rdma_chunked_send_tokens=6,
        num_max_rdma_chunked_recv_tokens=256,
    ):
        super().__init__(
            num_sms,
            num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens,
            num_max_rdma_chunked_recv_tokens,
        )

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """A ``num_nvl_bytes`` for rows of ``hidden_bytes`` bytes on ``num_ranks`` ranks: see
        :func:`nvl_size_hint` (the same for every Config: epcomm's memory does not depend on
        the SMs or chunk sizes)."""
        return nvl_size_hint(hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: epcomm's normal-mode ops use no RDMA buffer (DeepEP's hint is 0 up to 8 ranks too;
        groups spanning hosts are refused by ``deep_ep.Buffer``)."""
        check_int("hidden_bytes", hidden_bytes, minimum=1)
        check_int("num_ranks", num_ranks, minimum=1)
        return 0

    def __repr__(self):
        return (
            f"deep_ep.Config(num_sms={self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
            f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
            f"{self.num_max_rdma_chunked_recv_tokens})"
        )


def nvl_size_hint(hidden_bytes, num_ranks):
    """Bytes of epcomm memory per rank for :data:`PLAN_TOKENS_PER_RANK` tokens per rank of
    ``ceil(hidden_bytes / 2)`` bf16 channels (rounded up to a multiple of 8), top-k
    :data:`PLAN_TOPK`, :data:`PLAN_EXPERTS` experts (rounded up to a multiple of
    ``num_ranks``). A Buffer given it as ``num_nvl_bytes`` takes dispatches of at least that
    many tokens per rank for any top-k and expert count up to those."""
    check_int("hidden_bytes", hidden_bytes, minimum=1)
    check_int("num_ranks", num_ranks, minimum=1)
    hidden = (hidden_bytes + 1) // 2
    hidden = (hidden + 7) // 8 * 8
    experts = (PLAN_EXPERTS + num_ranks - 1) // num_ranks * num_ranks
    return size_hint(num_ranks, PLAN_TOKENS_PER_RANK, hidden, PLAN_TOPK, experts)


def ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    """DeepEP's 4-argument ``get_low_latency_rdma_size_hint``: epcomm's low-latency memory for
    this shape with top-k :data:`LL_MAX_TOPK` (the most DeepEP's low-latency kernels take), so
    that it bounds every top-k DeepEP code can pass (at most ``num_experts``: a token names an
    expert once)."""
    top_k = LL_MAX_TOPK
    if isinstance(num_experts, int) and not isinstance(num_experts, bool) and 0 < num_experts < top_k:
        top_k = num_experts
    return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, top_k)


def _config(table, num_sms, num_ranks):
    check_int("num_ranks", num_ranks, minimum=1)
    chunks = table.get(num_ranks)
    return Config(num_sms) if chunks is None else Config(num_sms, *chunks)


def dispatch_config(num_sms, num_ranks):
    """DeepEP's recommended dispatch Config for ``num_ranks`` (its table's chunk sizes, DeepEP's
    defaults for rank counts the table lacks, such as 1) with ``num_sms`` SMs."""
    return _config(_DISPATCH_CHUNKS, num_sms, num_ranks)


def combine_config(num_sms, num_ranks):
    """DeepEP's recommended combine Config for ``num_ranks`` (as :func:`dispatch_config`)."""
    return _config(_COMBINE_CHUNKS, num_sms, num_ranks)


def fit_tokens(num_nvl_bytes, world, hidden, num_topk, num_experts, num_tokens):
    """The most tokens per rank whose epcomm memory (:func:`epcomm.size_hint`) fits
    ``num_nvl_bytes``, for a Buffer whose first dispatch sends ``num_tokens`` tokens. Raises
    :class:`InvalidArgumentError` naming ``num_nvl_bytes`` when even ``num_tokens`` does not
    fit (with the bytes that would), and the shape's own errors (naming ``hidden``, ...)."""
    check_int("num_nvl_bytes", num_nvl_bytes)
    lo = max(1, num_tokens)
    need = size_hint(world, lo, hidden, num_topk, num_experts)
    shape = f"hidden={hidden}, num_topk={num_topk}, num_experts={num_experts}, {world} rank(s)"
    if num_nvl_bytes == 0:
        fail(
            "num_nvl_bytes",
            f"is 0, and normal-mode ops need a budget (as in DeepEP): this dispatch of {num_tokens} tokens per rank "
            f"({shape}) needs {need} bytes per rank; pass Config.get_nvl_buffer_size_hint(...) or more, or the "
            "epcomm-only max_tokens_per_rank=",
        )
    if need > num_nvl_bytes:
        fail(
            "num_nvl_bytes",
            f"{num_nvl_bytes} bytes cannot hold a dispatch of {num_tokens} token{'' if num_tokens == 1 else 's'} "
            f"per rank: epcomm needs {need} bytes "
            f"per rank for it ({shape}; its memory is sized per token, see epcomm.size_hint)",
        )

    # The core's own sizing (epcomm.rules::max_tokens_for_budget): the largest count that fits.
    return _native.max_tokens_for_budget(num_nvl_bytes, world, hidden, num_topk, num_experts)
