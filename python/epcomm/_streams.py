"""Stream ordering between torch's current stream and the Buffer's communication stream, with
DeepEP's semantics, and the event object ops return (:class:`EventOverlap`).

An op starts with the comm stream waiting for ``previous_event`` (or, without one, for the
current stream), runs on the comm stream, and ends either with the current stream waiting for
the comm stream (the default), or, with ``async_finish=True``, by returning an event recorded
on the comm stream; every tensor the op read or wrote is then ``record_stream``-ed on the comm
stream so that torch's allocator does not reuse it early. Outputs are allocated on the current
stream, or on the comm stream with ``allocate_on_comm_stream=True`` (which needs a
``previous_event``, as in DeepEP). All of it works inside a CUDA graph capture: the comm stream
joins the capture through the event waits.
"""

import contextlib

import torch

from ._args import check_bool, fail


def _raw_current_stream():
    """``f(device_index)``: the raw ``CUstream`` handle of torch's current stream on that GPU.
    torch's own accessor of the handle (what its compiled kernels use) where this torch has
    it, else the public stream object's ``cuda_stream``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


#: The raw handle of torch's current stream on a GPU (an int), for the native layer's stream
#: order (``Session.ll_dispatch(..., stream=, join=)``): one native call orders the comm
#: stream after it and, for a synchronous op, joins it back, instead of two ``wait_stream``s.
current_raw_stream = _raw_current_stream()

#: The hot path of an op runs with torch's ``__torch_function__`` handling off (modes such as
#: the one ``torch.set_default_device`` installs, and tensor subclasses' overrides): every
#: torch call of the layer then costs what it costs without them, and the layer names device
#: and dtype of everything it allocates, so no default applies. A no-op where torch lacks it.
torch_function_off = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)


class EventOverlap:
    """An event of an asynchronous op (``async_finish=True``), or None inside for a
    synchronous one. ``current_stream_wait()`` makes the current stream wait for it; as a
    context manager, the wait happens on exit. The event of a ``proxy-ce`` Buffer's op (made by
    :func:`async_event`) also waits on the host there, for this event only, outside a capture
    (``_host_waits`` says why)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        # (raw comm stream, its registered wait) whose wait `current_stream_wait` runs for this
        # event, while that registration stands (None: no host wait).
        self._host_wait = None

    def current_stream_wait(self):
        """Makes torch's current stream wait for the op (and, for a ``proxy-ce`` Buffer's op, the
        host too, until this event completes: the caller's next synchronous copy on the current
        stream would otherwise wait for the op while holding up the proxy that completes it)."""
        if self.event is None:
            fail("event", "this op was synchronous (async_finish=False): there is nothing to wait for")
        torch.cuda.current_stream().wait_event(self.event)
        if self._host_wait is not None:
            handle, wait = self._host_wait
            # The same registration only: a Buffer made later may reuse a destroyed one's stream.
            if _host_waits.get(handle) is wait and not torch.cuda.is_current_stream_capturing():
                wait(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self.event is not None:
            if exc_type is None:
                self.current_stream_wait()
            else:
                # Unwinding: order the stream as usual, but no host wait that could replace the
                # block's exception with its own.
                torch.cuda.current_stream().wait_event(self.event)


#: Comm streams (raw handles) of Buffers whose ops a host proxy completes with driver copies
#: (``proxy-ce``), each with its Buffer's host wait. Such an op must not be in flight when a
#: thread of the process enters a synchronous CUDA copy that waits for it (``tensor.cpu()``,
#: ``.item()``, ``.tolist()`` on the current stream after the op): the copy holds the driver
#: while it waits, and the proxy's next ``cuMemcpy*Async`` then waits for the copy, so neither
#: moves until the op times out. A synchronous op on such a Buffer therefore returns only once
#: the comm stream has finished it, and an asynchronous op's ``EventOverlap.current_stream_wait()``
#: (the point after which the caller reads the outputs) returns only once its event has
#: completed (docs/proxy.md, "a blocking copy in another thread stalls the proxy").
_host_waits = {}


def register_host_wait(comm_handle, wait):
    """Synchronous ops on the comm stream `comm_handle` end with `wait()`; an asynchronous
    op's ``current_stream_wait()`` calls `wait(event)` (see ``_host_waits``)."""
    _host_waits[comm_handle] = wait


def unregister_host_wait(comm_handle):
    _host_waits.pop(comm_handle, None)


def async_event(event, comm):
    """The :class:`EventOverlap` of an asynchronous op: `event`, recorded on the comm stream
    `comm` after the op; its ``current_stream_wait()`` runs `comm`'s host wait for `event` when
    one is registered (and still is then)."""
    overlap = EventOverlap(event)
    wait = _host_waits.get(comm.cuda_stream) if _host_waits else None
    if wait is not None:
        overlap._host_wait = (comm.cuda_stream, wait)
    return overlap


def host_wait(comm_handle):
    """Runs the host wait registered for `comm_handle`, if any (never inside a capture)."""
    if _host_waits:
        wait = _host_waits.get(comm_handle)
        if wait is not None and not torch.cuda.is_current_stream_capturing():
            wait()


class StreamOp:
    """One op's stream bracket (see the module docs)."""

    def __init__(self, comm, previous_event, async_finish, allocate_on_comm_stream):
        check_bool("async_finish", async_finish)
        check_bool("allocate_on_comm_stream", allocate_on_comm_stream)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            fail("previous_event", f"must be an EventOverlap or None (got {type(previous_event).__name__})")
        if previous_event is not None and previous_event.event is None:
            # A synchronous op's (empty) event: nothing to wait for beyond stream order, as in
            # DeepEP (SGLang passes get_dispatch_layout's on to dispatch).
            previous_event = None
        if allocate_on_comm_stream and previous_event is None:
            fail("allocate_on_comm_stream", "needs a previous_event (as in DeepEP): the comm stream must know what to wait for")
        self.comm = comm
        # The device given: torch's lookup of the current device costs more than the op's launch.
        self.compute = torch.cuda.current_stream(comm.device)
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.on_comm = allocate_on_comm_stream
        self.capturing = torch.cuda.is_current_stream_capturing()
        self.used = []
        self.outputs = []

    def begin(self):
        """The comm stream waits for the inputs."""
        if self.previous_event is not None:
            self.comm.wait_event(self.previous_event.event)
        else:
            self.comm.wait_stream(self.compute)

    def alloc_stream(self):
        """The stream outputs are allocated on."""
        return self.comm if self.on_comm else self.compute

    def use(self, *tensors):
        """Tensors the op reads (kept from reuse until the comm stream is done)."""
        self.used.extend(t for t in tensors if t is not None)

    def output(self, *tensors):
        """Tensors the op writes and returns."""
        self.outputs.extend(t for t in tensors if t is not None)

    def finish(self):
        """Ends the op: the EventOverlap to return."""
        if self.async_finish:
            event = torch.cuda.Event()
            event.record(self.comm)
            for t in self.used + self.outputs:
                t.record_stream(self.comm)
            if self.on_comm:
                for t in self.outputs:
                    t.record_stream(self.compute)
            return async_event(event, self.comm)
        self.compute.wait_stream(self.comm)
        if self.on_comm:
            for t in self.outputs:
                t.record_stream(self.compute)
        if _host_waits and not self.capturing:
            host_wait(self.comm.cuda_stream)
        return EventOverlap(None)
