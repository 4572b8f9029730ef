"""epcomm: expert-parallel (MoE) dispatch and combine on NVIDIA GPUs, for PyTorch.

:class:`Buffer` has DeepEP's normal-mode API (``get_dispatch_layout``, ``dispatch``, cached
dispatch, ``combine``, :class:`EventOverlap`, :class:`Config`) and its low-latency ops
(``low_latency_dispatch``, ``low_latency_combine``) on epcomm's kernels and transports. Importing this package needs no torch and no GPU (configuration checks, size hints
and the error classes work anywhere); :class:`Buffer` needs PyTorch with CUDA.
"""

import importlib.util

from . import _native
from .config import DEFAULT_NUM_SMS, Config, check_options, low_latency_size_hint, size_hint
from .errors import (
    BootstrapError,
    BootstrapTimeoutError,
    BufferFailedError,
    ConfigMismatchError,
    OpMismatchError,
    CudaError,
    EpcommError,
    InvalidArgumentError,
    InvalidExpertError,
    KernelError,
    PeerFailedError,
    PeerLostError,
    ReceiveOverflowError,
    TimeoutError,
    TransportError,
)
from .stats import OpStats

__version__ = _native.version()

__all__ = [
    "Buffer",
    "DispatchHandle",
    "LowLatencyHandle",
    "EventOverlap",
    "Config",
    "OpStats",
    "DEFAULT_NUM_SMS",
    "check_options",
    "size_hint",
    "low_latency_size_hint",
    "build_info",
    "kernels_embedded",
    "parse_transport",
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

_TORCH_NAMES = ("Buffer", "DispatchHandle", "EventOverlap", "LowLatencyHandle")

# `from epcomm import *` imports every name of __all__: the torch classes only where torch is
# installed (found without importing it), so that it works without torch too.
if importlib.util.find_spec("torch") is None:
    __all__ = [n for n in __all__ if n not in _TORCH_NAMES]


def __getattr__(name):
    # The classes that need torch are imported on first use, so that `import epcomm` works
    # without it.
    if name in _TORCH_NAMES:
        try:
            from . import buffer
        except ImportError as e:
            raise ImportError(f"epcomm.{name} needs PyTorch with CUDA support ({e})") from e
        return getattr(buffer, name)
    raise AttributeError(f"module 'epcomm' has no attribute {name!r}")


def build_info():
    """What this build carries: ``{"version", "kernels": [(name, artifact, embedded)],
    "transports": [spec forms], "schedules", "routes", "cuda_driver": bool}``."""
    return {
        "version": __version__,
        "kernels": [tuple(k) for k in _native.kernel_images()],
        "transports": list(_native.transport_forms()),
        "schedules": list(_native.schedules()),
        "routes": list(_native.route_policies()),
        "cuda_driver": _native.driver_present(),
    }


def kernels_embedded():
    """True when every kernel image is inside this build (a wheel from ``cargo xtask wheel``)."""
    return all(embedded for _, _, embedded in _native.kernel_images())


def parse_transport(spec):
    """The canonical form of transport spec `spec` (``"ipc"``, ``"nvshmem"``,
    ``"nvshmem:vnodes=N"``, ``"nvshmem:vnodes=max"``, ``"proxy-ce[:vnodes=N]"``,
    ``"proxy-verbs[:vnodes=N]"``); raises :class:`InvalidArgumentError`
    naming ``transport`` otherwise."""
    return _native.parse_transport(spec)
