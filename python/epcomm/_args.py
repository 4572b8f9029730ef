"""Argument rules for tensors, written against a plain description of a tensor
(:class:`TensorDesc`) so that they need no torch to be tested. Every rule that fails raises
:class:`~epcomm.errors.InvalidArgumentError` naming the argument and the rule."""

from typing import NamedTuple, Optional, Sequence, Tuple

from .errors import InvalidArgumentError


class TensorDesc(NamedTuple):
    """What the rules look at: shape, dtype name (``"bfloat16"``), CUDA device index (None
    off the GPU), contiguity, and the device address."""

    shape: Tuple[int, ...]
    dtype: str
    device: Optional[int]
    contiguous: bool
    ptr: int = 0

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


def fail(argument, rule):
    """Raises the error for `argument` breaking `rule`."""
    raise InvalidArgumentError(f"invalid {argument}: {rule}", argument=argument, rule=rule)


_DTYPE_NAMES = {}


def _dtype_name(dtype):
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def describe(argument, t):
    """The description of tensor `t` (anything else: an error naming `argument`). On every
    op's path: kept to a few attribute reads."""
    try:
        return TensorDesc(
            tuple(t.shape),
            _dtype_name(t.dtype),
            t.get_device() if t.is_cuda else None,
            t.is_contiguous(),
            t.data_ptr(),
        )
    except AttributeError:
        fail(argument, f"must be a torch.Tensor (got {type(t).__name__})")


def check(
    argument: str,
    desc: TensorDesc,
    *,
    dtypes: Sequence[str],
    shape: Sequence[Optional[int]],
    device: int,
    shape_names: Sequence[str] = (),
):
    """Checks `desc` against the rules: one of `dtypes`; on CUDA device `device`; contiguous;
    `len(shape)` dimensions, each equal to the given size (None: any). `shape_names` names the
    dimensions in the message (e.g. ``("num_tokens", "hidden")``)."""
    if desc.dtype not in dtypes:
        fail(argument, f"must have dtype {' or '.join('torch.' + d for d in dtypes)} (got torch.{desc.dtype})")
    if desc.device is None:
        fail(argument, f"must be on the GPU (cuda:{device}), not on the CPU")
    if desc.device != device:
        fail(argument, f"must be on cuda:{device}, this Buffer's GPU (got cuda:{desc.device})")
    if len(desc.shape) != len(shape):
        fail(argument, f"must have {len(shape)} dimensions {_dims(shape, shape_names)} (got shape {list(desc.shape)})")
    for i, (got, want) in enumerate(zip(desc.shape, shape)):
        if want is not None and got != want:
            fail(argument, f"must have shape {_dims(shape, shape_names)} (got {list(desc.shape)}; dimension {i} must be {want})")
    if not desc.contiguous:
        fail(argument, "must be contiguous (call .contiguous() first)")


def _dims(shape, names):
    parts = []
    for i, size in enumerate(shape):
        name = names[i] if i < len(names) else None
        if size is None:
            parts.append(name or "any")
        elif name:
            parts.append(f"{name}={size}")
        else:
            parts.append(str(size))
    return "[" + ", ".join(parts) + "]"


def check_int(argument, value, *, minimum=0):
    """`value` must be an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(argument, f"must be an int (got {value!r})")
    if value < minimum:
        fail(argument, f"must be at least {minimum} (got {value})")
    return value


def check_bool(argument, value):
    """`value` must be a bool."""
    if not isinstance(value, bool):
        fail(argument, f"must be True or False (got {value!r})")
    return value


def aligned_counts(counts, alignment):
    """DeepEP's ``num_recv_tokens_per_expert_list``: each count rounded up to a multiple of
    `alignment`."""
    return [(c + alignment - 1) // alignment * alignment for c in counts]
