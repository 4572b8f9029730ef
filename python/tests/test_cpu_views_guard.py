"""``destroy()`` refuses while a tensor still views memory it frees (``epcomm._views``'
``ViewGuard``): a view of a Buffer's own memory is registered until the last tensor sharing its
storage is gone (slices and ``.view()``s count, a ``.clone()`` does not), views of memory the
Buffer does not free are not, the refusal names the views and what to do, and both
``epcomm.Buffer.destroy`` and ``deep_ep.Buffer.destroy`` (both cores) refuse before any
collective step, changing nothing. Runs without torch or a GPU: the modules are imported over a
stand-in torch whose tensors keep their array as a storage would (the real modules are restored
afterwards)."""

import gc
import importlib
import sys
import types
import weakref

import pytest

import epcomm  # noqa: F401  (the package first, as it is)
import epcomm.deep_ep  # noqa: F401
from stand_in import over_fake_torch

_MODULES = ("epcomm._views", "epcomm._streams", "epcomm._low_latency", "epcomm.buffer", "epcomm.deep_ep._impl")


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"

    __repr__ = __str__


class _Tensor:
    """A stand-in tensor: ``storage`` is what torch's storage holds (the array of a view, a
    plain object for memory of its own), shared by its slices and ``.view()``s."""

    def __init__(self, storage, dtype):
        self.storage = storage
        self.dtype = dtype

    def view(self, dtype):
        return _Tensor(self.storage, dtype)

    def __getitem__(self, index):
        return _Tensor(self.storage, self.dtype)

    def clone(self):
        return _Tensor(object(), self.dtype)


def _fake_torch():
    fake = types.ModuleType("torch")
    for name in ("int32", "int64", "float32", "uint8", "bool", "bfloat16", "float8_e4m3fn", "int16"):
        setattr(fake, name, _Dtype(name))
    fake._C = types.SimpleNamespace()
    fake.cuda = types.SimpleNamespace()
    fake.as_tensor = lambda array, device=None: _Tensor(array, None)
    return fake


@pytest.fixture
def mods():
    """``(views, buffer, impl)``: epcomm._views, epcomm.buffer and epcomm.deep_ep._impl
    imported over a stand-in torch."""
    with over_fake_torch(_fake_torch(), _MODULES):
        views = importlib.import_module("epcomm._views")
        buffer = importlib.import_module("epcomm.buffer")
        impl = importlib.import_module("epcomm.deep_ep._impl")
        yield views, buffer, impl


class _Owner:
    """Something that frees the memory it lends views of (as a Buffer does at destroy)."""

    def __init__(self, views):
        self._view_guard = views.ViewGuard("low-latency receive")


class _Session:
    def __init__(self, log, name, handle):
        self.log = log
        self.name = name
        self.stream_handle = handle

    def destroy(self):
        self.log.append(("destroy", self.name))


def _core(views, buffer, log, name, handle):
    """An epcomm.Buffer as destroy() sees it, without a GPU: its session records destroy."""
    b = buffer.Buffer.__new__(buffer.Buffer)
    b._session = _Session(log, name, handle)
    b._views = {}
    b._ll_views = {}
    b._ll_keep = None
    b._view_guard = views.ViewGuard("low-latency receive")
    return b


def test_a_view_is_registered_until_the_last_tensor_sharing_it_goes(mods):
    views, _, _ = mods
    torch = sys.modules["torch"]
    owner = _Owner(views)
    t = views.view(0x1000, (4, 8), torch.bfloat16, 0, owner)
    assert owner._view_guard.live() == [("low-latency receive", "[4, 8] bfloat16")]
    part = t[1:]
    as_int = t.view(torch.int16)
    del t
    assert len(owner._view_guard.live()) == 1  # a slice still reads the memory
    del part
    assert len(owner._view_guard.live()) == 1  # and so does a .view()
    del as_int
    assert owner._view_guard.live() == []
    # A kind given by the caller names it.
    t = views.view(0x2000, (3, 2), torch.int64, 0, owner, kind="zero-copy dispatch recv_topk_idx")
    assert owner._view_guard.live() == [("zero-copy dispatch recv_topk_idx", "[3, 2] int64")]
    del t


def test_clones_and_views_of_memory_the_owner_does_not_free_are_not_guarded(mods):
    views, _, _ = mods
    torch = sys.modules["torch"]
    owner = _Owner(views)
    kept = views.view(0x1000, (4,), torch.int32, 0, owner).clone()
    assert owner._view_guard.live() == []
    # A native layout or handle owns its arrays itself (they outlive destroy): no guard.
    native = types.SimpleNamespace()
    counts = views.view(0x3000, (8,), torch.int32, 0, native)
    assert owner._view_guard.live() == []
    assert counts.storage._owner is native and kept is not None


def test_views_only_garbage_keeps_do_not_count(mods):
    views, _, _ = mods
    torch = sys.modules["torch"]
    owner = _Owner(views)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cycle = [views.view(0x1000, (2, 2), torch.float32, 0, owner)]
        cycle.append(cycle)
        del cycle
        assert len(owner._view_guard._count()) == 1  # unreachable, not yet collected
        assert owner._view_guard.live() == []
    finally:
        if was_enabled:
            gc.enable()


def test_the_refusal_names_the_views_and_what_to_do(mods):
    views, _, _ = mods
    assert views.refuse_destroy([]) is None
    live = [("zero-copy dispatch recv_x", "[200, 512] bfloat16")] * 2 + [("low-latency receive", "[4] int32")]
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        views.refuse_destroy(live)
    assert e.value.argument == "destroy"
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    for words in (
        "3 views",
        "zero-copy dispatch recv_x [200, 512] bfloat16 (x2)",
        "low-latency receive [4] int32",
        "del",
        ".clone()",
        "call destroy() again",
        "Nothing was destroyed",
    ):
        assert words in msg, (words, msg)
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        views.refuse_destroy([("low-latency receive", f"[{i}] int32") for i in range(20)])
    assert "20 views" in str(e.value) and "12 more" in str(e.value) and "[19] int32" not in str(e.value)
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        views.refuse_destroy([("low-latency receive", "[4] int32")])
    assert "1 view of memory that destroy() frees is still alive" in str(e.value)


def test_buffer_destroy_refuses_while_a_view_lives_and_changes_nothing(mods):
    views, buffer, _ = mods
    torch = sys.modules["torch"]
    streams = sys.modules["epcomm._streams"]
    log = []
    b = _core(views, buffer, log, "core", 4242)
    streams.register_host_wait(4242, lambda: None)
    try:
        rx = views.view(0x1000, (3, 4), torch.bfloat16, 0, b, kind="zero-copy dispatch recv_x")
        row = rx[0]
        del rx
        with pytest.raises(epcomm.InvalidArgumentError) as e:
            b.destroy()
        assert e.value.argument == "destroy" and "zero-copy dispatch recv_x [3, 4] bfloat16" in str(e.value)
        del e  # its traceback holds nothing of the view
        # Before any collective step: the session is not destroyed, the host wait still there.
        assert log == [] and 4242 in streams._host_waits
        del row
        b.destroy()
        assert log == [("destroy", "core")] and 4242 not in streams._host_waits
    finally:
        streams.unregister_host_wait(4242)


def test_the_low_latency_cache_alone_does_not_block_destroy_and_survives_a_refusal(mods):
    views, buffer, _ = mods
    torch = sys.modules["torch"]
    log = []
    b = _core(views, buffer, log, "core", 7)

    def receive_set(key):
        b._ll_views[key] = tuple(
            None if shape is None else views.view(0x1000 * (i + 1), shape, dtype, 0, b)
            for i, (shape, dtype) in enumerate(
                [((2, 8, 16), torch.bfloat16), (None, None), ((2,), torch.int32), ((2, 8), torch.int32), ((2, 4), torch.int64)]
            )
        )

    receive_set((0, False, False))
    receive_set((1, False, False))
    # What low_latency_dispatch returned: recv_x, recv_count, and the handle's two views.
    recv_x, _, count, src_info, layout_range = returned = b._ll_views[(0, False, False)]
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        b.destroy()
    assert "4 views" in str(e.value) and "low-latency receive [2, 8, 16] bfloat16" in str(e.value), str(e.value)
    del e
    assert log == []
    # The cache entry still held is back (the same tensors); the other one is made again on use.
    assert list(b._ll_views) == [(0, False, False)] and b._ll_views[(0, False, False)] == returned
    # Only recv_x held: refused again; the entry, no longer whole, is not kept.
    del returned, count, src_info, layout_range
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        b.destroy()
    assert "1 view of" in str(e.value)
    del e
    assert b._ll_views == {} and log == []
    del recv_x
    b.destroy()
    assert log == [("destroy", "core")] and b._ll_views == {}


def test_a_buffer_caching_low_latency_views_is_freed_without_destroy(mods):
    """The low-latency views a Buffer caches keep its session (the memory's owner) alive, not
    the Buffer: dropped without ``destroy()``, the Buffer goes by reference counting alone (a
    cycle through the cache would need the collector, which cannot see into torch's storage),
    and a view the caller still holds keeps the session until it goes."""
    views, buffer, _ = mods
    low_latency = importlib.import_module("epcomm._low_latency")
    log = []
    b = _core(views, buffer, log, "core", 7)
    b.hidden, b.device, b.group_size = 256, 0, 2
    out = types.SimpleNamespace(
        set=0, num_local_experts=2, capacity=8, x=0x1000, scales=0x2000, count=0x3000, src_info=0x4000, layout_range=0x5000
    )
    recv_x, scales, count, src_info, layout_range = low_latency._views(b, out, True, False)
    assert b._ll_views[(0, True, False)][0] is recv_x and scales is not None
    session, buf = weakref.ref(b._session), weakref.ref(b)
    gc.collect()
    gc.disable()
    try:
        del scales, count, src_info, layout_range, b
        assert buf() is None, "the Buffer outlived its last reference: a cycle through its view cache"
        assert session() is not None, "recv_x still reads the session's memory"
        del recv_x
        assert session() is None
    finally:
        gc.enable()
    assert log == []  # released, not destroyed (destroy() is the collective step)


def test_deep_ep_destroy_checks_both_cores_before_destroying_either(mods):
    views, buffer, impl = mods
    torch = sys.modules["torch"]
    log = []
    normal, ll = _core(views, buffer, log, "normal", 1), _core(views, buffer, log, "ll", 2)
    buf = types.SimpleNamespace(
        explicitly_destroy=True, _destroyed=False, _normal=normal, _ll=ll, _combine_buffer=None
    )
    src_info = views.view(0x1000, (2, 8), torch.int32, 0, ll)  # a low-latency handle's
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        impl.destroy(buf)
    assert e.value.argument == "destroy" and "low-latency receive [2, 8] int32" in str(e.value)
    del e
    assert log == [] and not buf._destroyed and buf._normal is normal and buf._ll is ll
    # A live view of the normal core refuses as well (the low-latency core is not destroyed).
    del src_info
    rows = views.view(0x2000, (5, 4), torch.bfloat16, 0, normal, kind="zero-copy dispatch recv_x")
    with pytest.raises(epcomm.InvalidArgumentError):
        impl.destroy(buf)
    assert log == [] and not buf._destroyed
    del rows
    impl.destroy(buf)
    assert log == [("destroy", "normal"), ("destroy", "ll")] and buf._destroyed
    assert buf._normal is None and buf._ll is None


def test_a_pending_hook_is_named_in_the_refusal(mods):
    views, buffer, _ = mods
    torch = sys.modules["torch"]
    log = []
    b = _core(views, buffer, log, "core", 9)
    rx = views.view(0x1000, (3, 4), torch.bfloat16, 0, b, kind="low-latency recv_x")
    b._ll_keep = (rx,)  # a hook combine of recv_x, its hook not called yet
    del rx
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        b.destroy()
    assert "low-latency recv_x" in str(e.value) and "hook not yet called" in str(e.value), e.value
    del e
    b._ll_keep = None  # what calling the hook does
    b.destroy()
    assert log == [("destroy", "core")]
