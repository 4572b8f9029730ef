"""Tensors viewing device memory that epcomm owns (the receive regions, a layout's counts),
made through the ``__cuda_array_interface__``: no copy, no ownership. A view keeps the object
given as `owner` alive; it is valid only as long as the memory is (see each caller).

A view of memory its owner frees before the owner itself goes (an epcomm ``Buffer``: its receive
regions go at ``destroy()``) is registered with the owner's :class:`ViewGuard` (the owner's
``_view_guard``), and the owner's ``destroy()`` refuses while any such view is alive
(:func:`refuse_destroy`). A tensor's storage holds the view's :class:`_DeviceArray` until the
last tensor sharing that storage (the view, its slices, its ``.view()``s) is gone, so the
guard, holding the arrays weakly, sees exactly the views still readable."""

import gc
import weakref

import torch

from ._args import fail

#: The array-interface type of each dtype (bf16 and fp8 go through same-size integers).
_TYPESTR = {
    torch.int32: ("<i4", None),
    torch.int64: ("<i8", None),
    torch.float32: ("<f4", None),
    torch.uint8: ("|u1", None),
    torch.bool: ("|b1", None),
    torch.bfloat16: ("<i2", torch.bfloat16),
}
if hasattr(torch, "float8_e4m3fn"):
    _TYPESTR[torch.float8_e4m3fn] = ("|u1", torch.float8_e4m3fn)


class _DeviceArray:
    """The array interface of `shape` elements at `ptr` (byte `strides`, None: dense).
    `kind` and `dtype` (the tensor's) name it in a refused ``destroy()``."""

    def __init__(self, ptr, shape, typestr, strides, owner, kind=None, dtype=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (int(ptr), False),
            "strides": None if strides is None else tuple(strides),
            "version": 2,
        }
        self._owner = owner
        # Private names: torch's as_tensor may look for protocol attributes (dtype, shape).
        self._kind = kind
        self._dtype = dtype

    def describe(self, default_kind):
        """``(kind, "[shape] dtype")``."""
        shape = ", ".join(str(d) for d in self.__cuda_array_interface__["shape"])
        return self._kind or default_kind, f"[{shape}] {str(self._dtype).replace('torch.', '')}"


class ViewGuard:
    """The views alive of memory that one owner frees itself (held weakly: registering keeps
    nothing alive). ``default_kind`` names the views registered without a kind."""

    def __init__(self, default_kind="view"):
        self._arrays = weakref.WeakSet()
        self.default_kind = default_kind

    def add(self, array):
        self._arrays.add(array)

    def live(self):
        """``[(kind, what)]`` of every view alive now. When some are, garbage that only a
        reference cycle keeps (an exception's traceback, a closure) is collected first and
        they are counted again, so that only views someone can still read count."""
        found = self._count()
        if found:
            gc.collect()
            found = self._count()
        return found

    def _count(self):
        return [a.describe(self.default_kind) for a in list(self._arrays)]


def view(ptr, shape, dtype, device, owner, strides=None, kind=None, shown_dtype=None, keep=None):
    """A tensor of `dtype` and `shape` over the device memory at `ptr` (byte `strides`).
    When `owner` has a ``_view_guard`` (it frees this memory itself, e.g. at ``destroy()``)
    the view is registered there, as `kind` (e.g. ``"zero-copy dispatch recv_x"``) of
    `shown_dtype` (default `dtype`: the dtype the caller gets, where it views this one).
    The view keeps `keep` alive (default `owner`): the object whose lifetime is the memory's.
    A view that `owner` itself caches must not keep `owner`: torch's storage holds its array
    where the garbage collector cannot see it, so the cycle would keep both forever."""
    typestr, reinterpret = _TYPESTR[dtype]
    array = _DeviceArray(ptr, shape, typestr, strides, owner if keep is None else keep, kind, shown_dtype or dtype)
    guard = getattr(owner, "_view_guard", None)
    if guard is not None:
        guard.add(array)
    t = torch.as_tensor(array, device=device)
    return t.view(reinterpret) if reinterpret is not None else t


#: At most this many different views are listed in a refusal (the rest are counted).
_LISTED = 8


def refuse_destroy(live, note=None):
    """Raises :class:`~epcomm.errors.InvalidArgumentError` naming ``destroy`` when `live`
    (``[(kind, what)]``, :meth:`ViewGuard.live`) is not empty: a destroy would free memory
    those tensors still read. Says which views and what to do (and `note`, when given);
    returns otherwise."""
    if not live:
        return
    groups = {}
    for item in live:
        groups[item] = groups.get(item, 0) + 1
    parts = [f"{kind} {what}".rstrip() + (f" (x{n})" if n > 1 else "") for (kind, what), n in groups.items()]
    if len(parts) > _LISTED:
        parts = parts[:_LISTED] + [f"{len(parts) - _LISTED} more"]
    n = len(live)
    views = "1 view" if n == 1 else f"{n} views"
    fail(
        "destroy",
        f"{views} of memory that destroy() frees {'is' if n == 1 else 'are'} still alive: {'; '.join(parts)} "
        "(a view lives while any tensor sharing its memory does, slices and .view()s included; a low-latency "
        "handle holds two: src_info and layout_range). Reading one after destroy() would read freed memory: drop "
        "them (del) or keep .clone()s of what you need, then call destroy() again"
        + (f" ({note})" if note else "")
        + ". Nothing was destroyed on this rank; a rank whose destroy() went ahead waits for this one's at its "
        "barrier (up to the bootstrap timeout)",
    )
