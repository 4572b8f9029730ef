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
    module.register_host_wait(42, lambda event=None: waits.append("waited"))
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
    module.register_host_wait(7, lambda event=None: waits.append(7))
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

    def wait(event=None):
        # Logged with the stream calls: the order of the two waits is checked.
        state.log.append(("host_wait", event))
        waits.append(event)

    module.register_host_wait(42, wait)
    try:
        ev = _op(module, state, async_finish=True)
        assert waits == []  # returned at once: the caller overlaps
        ev.current_stream_wait()
        # The current stream waits for the event, then the host for that event only (not for
        # ops issued on the comm stream after it).
        assert state.log[-2:] == [("wait_event", 1), ("host_wait", ev.event)]
        with ev:
            pass
        assert waits == [ev.event, ev.event]
        # Leaving the block by an exception: the stream wait only (no host wait whose own
        # error could replace the block's).
        with pytest.raises(KeyError):
            with ev:
                raise KeyError("the block's")
        assert waits == [ev.event, ev.event] and state.log[-1] == ("wait_event", 1)
        # Events made for other paths of the layer (deep_ep's reorders, the low-latency ops).
        other = module.async_event(_Event(), state.comm)
        other.current_stream_wait()
        assert waits[-1] is other.event
        # Inside a capture: the stream wait only.
        state.capturing = True
        ev.current_stream_wait()
        assert len(waits) == 3
        state.capturing = False
    finally:
        module.unregister_host_wait(42)
    # Made before its Buffer was destroyed, waited on after: no host wait, not even when a new
    # Buffer registered the same stream handle since.
    module.register_host_wait(42, lambda event=None: waits.append("new buffer"))
    try:
        ev.current_stream_wait()
        assert len(waits) == 3
    finally:
        module.unregister_host_wait(42)
    # Made on an unregistered stream: no host wait.
    _op(module, state, async_finish=True).current_stream_wait()
    module.async_event(_Event(), state.comm).current_stream_wait()
    assert len(waits) == 3
