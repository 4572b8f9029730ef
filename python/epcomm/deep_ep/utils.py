"""DeepEP's ``deep_ep.utils``: ``EventOverlap`` (epcomm's, loaded on first use: it needs torch)
and ``check_nvlink_connections``."""

__all__ = ["EventOverlap", "check_nvlink_connections"]  # noqa: F822 (EventOverlap: module __getattr__)


def check_nvlink_connections(group):
    """Accepted, no check: epcomm plans every peer route itself when a Buffer is created (and
    ``Buffer.route_plan()`` shows it); nothing here needs NVML. Returns None."""
    del group


def __getattr__(name):
    if name == "EventOverlap":
        try:
            from .._streams import EventOverlap
        except ImportError as e:
            raise ImportError(f"deep_ep.utils.EventOverlap needs PyTorch ({e})") from e
        return EventOverlap
    raise AttributeError(f"module 'deep_ep.utils' has no attribute {name!r}")
