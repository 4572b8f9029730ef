"""Imports a package module over a stand-in torch, for CPU tests of code that only orders
calls on torch's objects (streams, events, tensors' storage)."""

import contextlib
import sys

_MISSING = object()


@contextlib.contextmanager
def over_fake_torch(fake_torch, modules):
    """Inside the block ``import torch`` gives `fake_torch` and each module named in `modules`
    (dotted, inside an imported package) is imported anew over it. Afterwards ``sys.modules``
    and the packages' attributes (``epcomm._streams``, ...) hold what they held before."""
    names = ("torch",) + tuple(modules)
    saved = {name: sys.modules.get(name) for name in names}
    attrs = {}
    for name in modules:
        package, _, attr = name.rpartition(".")
        attrs[name] = (sys.modules[package], attr, vars(sys.modules[package]).get(attr, _MISSING))
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
        for package, attr, value in attrs.values():
            if value is _MISSING:
                vars(package).pop(attr, None)
            else:
                setattr(package, attr, value)
