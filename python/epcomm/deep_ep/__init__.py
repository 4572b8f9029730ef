"""A drop-in ``deep_ep``: DeepEP V1's public Python API (``Buffer``, ``Config``,
``EventOverlap``, ``topk_idx_t``) on epcomm, for code written against DeepEP.

``import epcomm.deep_ep as deep_ep`` works as it is; ``import deep_ep`` resolves here with the
companion distribution ``epcomm-deep-ep`` installed, or with ``python/compat`` on
``PYTHONPATH`` (docs/python.md, "Drop-in deep_ep", lists every API element and its status).

Importing this package needs no torch and no GPU (``Config``, the size hints and
``Buffer``'s static helpers work anywhere); ``EventOverlap`` and ``topk_idx_t`` are loaded on
first use and need PyTorch; creating a :class:`Buffer` needs PyTorch with CUDA.
"""

import importlib.util

from . import utils  # noqa: F401 (deep_ep.utils, as in DeepEP)
from .buffer import Buffer
from .config import Config

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

_TORCH_NAMES = ("EventOverlap", "topk_idx_t")

# `from epcomm.deep_ep import *` takes the torch names only where torch is installed.
if importlib.util.find_spec("torch") is None:
    __all__ = [n for n in __all__ if n not in _TORCH_NAMES]


def __getattr__(name):
    if name in _TORCH_NAMES:
        try:
            import torch

            from .._streams import EventOverlap
        except ImportError as e:
            raise ImportError(f"deep_ep.{name} needs PyTorch ({e})") from e
        # DeepEP's top-k index dtype (int64 in its default build, and epcomm's).
        return EventOverlap if name == "EventOverlap" else torch.int64
    raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")
