"""The exceptions epcomm raises.

Every error of the native layer (the Rust library) arrives as one of these classes, with the
library's message unchanged and its typed fields as attributes: a timeout names the late rank
(``late_rank``), an invalid argument names the argument (``argument``) and the rule it broke
(``rule``). Classes that mean "bad input" also derive from :class:`ValueError`, timeouts from
the built-in :class:`TimeoutError`.

After a device-side failure (timeout, peer failure, overflow, invalid expert id) the Buffer is
failed on every rank: destroy it (``Buffer.destroy()``) and create a new one.
"""

import builtins

__all__ = [
    "EpcommError",
    "InvalidArgumentError",
    "InvalidExpertError",
    "TimeoutError",
    "BootstrapTimeoutError",
    "PeerFailedError",
    "PeerLostError",
    "ReceiveOverflowError",
    "ConfigMismatchError",
    "OpMismatchError",
    "BufferFailedError",
    "TransportError",
    "BootstrapError",
    "KernelError",
    "CudaError",
]


class EpcommError(Exception):
    """Base class of every epcomm error. ``str(e)`` is the library's message; the keyword
    details (different per class) are attributes."""

    def __init__(self, message, **details):
        super().__init__(message)
        self.message = message
        for key, value in details.items():
            setattr(self, key, value)


class InvalidArgumentError(EpcommError, ValueError):
    """An argument broke a rule. ``argument``: its name (None when the rule is about several);
    ``rule``: what it must satisfy. Nothing was launched."""

    argument = None
    rule = ""


class InvalidExpertError(InvalidArgumentError):
    """``topk_idx`` named an expert id outside ``[-1, num_experts)`` (found on the device).
    ``token``: the token, ``value``: the id. The Buffer is failed."""

    token = None
    value = None


class TimeoutError(EpcommError, builtins.TimeoutError):
    """A bounded wait expired. ``late_rank``: the rank that was waited for (None for the host's
    own wait); ``op``, ``wait`` (what was waited for), ``rank`` (this rank), ``op_seq``,
    ``expected``, ``seen``, ``waited`` (seconds). The Buffer is failed."""

    late_rank = None


class BootstrapTimeoutError(TimeoutError):
    """Not every rank arrived at a rendezvous or host collective in time. ``missing_ranks``:
    every rank that did not; ``late_rank``: the first of them."""

    missing_ranks = ()


class PeerFailedError(EpcommError):
    """Another rank failed first; this rank's op stopped when it learned of it. ``origin``:
    the rank that failed, ``cause``: what happened there, ``late_rank``: the rank the origin
    waited for when it timed out (None when the failure was the origin's own). The Buffer is
    failed."""

    origin = None
    late_rank = None


class PeerLostError(EpcommError):
    """A rank's process died or went silent during a host collective. ``rank``: that rank."""

    rank = None


class ReceiveOverflowError(EpcommError):
    """A dispatch would receive more rows than allowed (``capacity``); nothing was written.
    ``dest``: the receiving rank, ``requested``: the rows it would receive."""


class ConfigMismatchError(EpcommError, ValueError):
    """Ranks created their Buffer with different arguments. ``field``, ``values`` (every
    rank's value)."""


class OpMismatchError(EpcommError):
    """Ranks issued different ops at the same point of their sequence, or the same op with
    arguments every rank must share: another op kind, top-k weights on some ranks only, BF16
    against FP8, a staged or in-place combine against a pushed one. ``op``, ``rank`` (this
    rank), ``peer`` (the rank that disagrees), ``fields`` (what differs), ``detail`` (both
    ranks' ops), ``op_seq``. Every rank of the op gets it; the Buffer is failed."""

    peer = None


class BufferFailedError(EpcommError):
    """The Buffer is unusable after an earlier failure, or destroyed. ``reason``."""


class TransportError(EpcommError):
    """The transport (CUDA IPC, NVSHMEM) failed."""


class BootstrapError(EpcommError):
    """The rendezvous or a host collective failed."""


class KernelError(EpcommError):
    """Loading or launching a kernel failed (e.g. the kernels are not in this build)."""


class CudaError(EpcommError):
    """A CUDA driver call failed, or there is no CUDA driver."""
