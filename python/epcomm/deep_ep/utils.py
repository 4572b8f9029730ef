"""DeepEP's ``deep_ep.utils``: ``EventOverlap`` (epcomm's), ``EventHandle`` (both loaded on
first use: they need torch) and ``check_nvlink_connections``."""

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]  # noqa: F822 (module __getattr__)

_EVENT_HANDLE = None


def _event_handle():
    """DeepEP's ``EventHandle``, made once: a CUDA event recorded on the current stream when
    created; ``EventOverlap(EventHandle())`` is a ``previous_event`` (code such as Megatron's
    builds it so)."""
    global _EVENT_HANDLE
    if _EVENT_HANDLE is None:
        import torch

        class EventHandle(torch.cuda.Event):
            """A CUDA event recorded on the current stream at creation (DeepEP's ``EventHandle``)."""

            def __init__(self):
                super().__init__()
                self.record(torch.cuda.current_stream())

            def current_stream_wait(self):
                """Makes the current stream wait for the event."""
                torch.cuda.current_stream().wait_event(self)

        _EVENT_HANDLE = EventHandle
    return _EVENT_HANDLE


def check_nvlink_connections(group):
    """Accepted, no check: epcomm plans every peer route itself when a Buffer is created (and
    ``Buffer.route_plan()`` shows it); nothing here needs NVML. Returns None."""
    del group


def __getattr__(name):
    if name == "EventHandle":
        try:
            return _event_handle()
        except ImportError as e:
            raise ImportError(f"deep_ep.utils.EventHandle needs PyTorch ({e})") from e
    if name == "EventOverlap":
        try:
            from .._streams import EventOverlap
        except ImportError as e:
            raise ImportError(f"deep_ep.utils.EventOverlap needs PyTorch ({e})") from e
        return EventOverlap
    raise AttributeError(f"module 'deep_ep.utils' has no attribute {name!r}")
