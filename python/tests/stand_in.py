"""Imports a package module over a stand-in torch, for CPU tests of code that only orders
calls on torch's objects (streams, events, tensors' storage)."""

import contextlib
import sys


@contextlib.contextmanager
def over_fake_torch(fake_torch, modules):
    """Inside the block ``import torch`` gives `fake_torch` and each module named in `modules`
    is imported anew (over it); afterwards ``sys.modules`` holds what it held before."""
    names = ("torch",) + tuple(modules)
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules["torch"] = fake_torch
    for name in modules:
        sys.modules.pop(name, None)
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
