"""The host wait of proxy-ce Buffers (``epcomm._streams``): a synchronous op on a registered
comm stream ends with the Buffer's wait, an asynchronous one waits at its event's
``current_stream_wait()``; one inside a capture, and one on another stream do not. Runs without torch: the module is imported over a stand-in torch
that records what the op asked of it (the real one is restored afterwards)."""

import importlib
import types

import pytest

import epcomm  # noqa: F401  (the package first, as it is: its own torch check sees the real state)
from stand_in import over_fake_torch


class _Stream:
    def __init__(self, handle, log):
        self.cuda_stream = handle
        self.device = 0
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

    def wait_event(self, event):
        self.log.append(("wait_event", self.cuda_stream))


class _Event:
    def record(self, stream):
        pass


@pytest.fixture
def streams():
    """``(module, state)``: epcomm._streams imported over a stand-in torch; ``state`` holds
    the capture flag and the log of stream calls."""
    state = types.SimpleNamespace(capturing=False, log=[])
    current = _Stream(1, state.log)
    fake = types.ModuleType("torch")
    fake._C = types.SimpleNamespace()
    fake.cuda = types.SimpleNamespace(
        current_stream=lambda device=None: current,
        is_current_stream_capturing=lambda: state.capturing,
        Event=_Event,
    )
    with over_fake_torch(fake, ("epcomm._streams",)):
        module = importlib.import_module("epcomm._streams")
        state.comm = _Stream(42, state.log)
        yield module, state


def _op(module, state, async_finish=False):
    op = module.StreamOp(state.comm, None, async_finish, False)
    op.begin()
    return op.finish()


def test_a_synchronous_op_on_a_registered_stream_ends_with_its_wait(streams):
    module, state = streams
    waits = []
    module.register_host_wait(42, lambda: waits.append("waited"))
    try:
        ev = _op(module, state)
        assert ev.event is None
        assert waits == ["waited"]
        # The current stream was joined to the comm stream before the wait.
        assert ("wait_stream", 1, 42) in state.log
        # Asynchronous: the caller holds the event; no host wait.
        assert _op(module, state, async_finish=True).event is not None
        assert waits == ["waited"]
        # Inside a capture nothing may wait on the host.
        state.capturing = True
        _op(module, state)
        module.host_wait(42)
        assert waits == ["waited"]
        state.capturing = False
        module.host_wait(42)
        assert waits == ["waited", "waited"]
    finally:
        module.unregister_host_wait(42)


def test_other_streams_and_unregistered_buffers_do_not_wait(streams):
    module, state = streams
    waits = []
    module.register_host_wait(7, lambda: waits.append(7))
    _op(module, state)  # comm stream 42: not registered
    module.host_wait(42)
    assert waits == []
    module.unregister_host_wait(7)
    module.host_wait(7)
    assert waits == []
    module.unregister_host_wait(7)  # twice: harmless


def test_an_asynchronous_op_waits_at_current_stream_wait(streams):
    module, state = streams
    waits = []
    module.register_host_wait(42, lambda: waits.append("waited"))
    try:
        ev = _op(module, state, async_finish=True)
        assert waits == []  # returned at once: the caller overlaps
        ev.current_stream_wait()
        # The current stream waits for the event, then the host for the comm stream.
        assert state.log[-1] == ("wait_event", 1)
        assert waits == ["waited"]
        with ev:
            pass
        assert waits == ["waited", "waited"]
        # Events made for other paths of the layer (deep_ep's reorders, the low-latency ops).
        module.async_event(_Event(), state.comm).current_stream_wait()
        assert waits == ["waited"] * 3
        # Inside a capture: the stream wait only.
        state.capturing = True
        ev.current_stream_wait()
        assert waits == ["waited"] * 3
    finally:
        module.unregister_host_wait(42)
    # Made on an unregistered stream (or after the Buffer is gone): no host wait.
    state.capturing = False
    _op(module, state, async_finish=True).current_stream_wait()
    module.async_event(_Event(), state.comm).current_stream_wait()
    assert waits == ["waited"] * 3
