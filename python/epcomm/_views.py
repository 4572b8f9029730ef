"""Tensors viewing device memory that epcomm owns (the receive regions, a layout's counts),
made through the ``__cuda_array_interface__``: no copy, no ownership. A view keeps the object
given as `owner` alive; it is valid only as long as the memory is (see each caller)."""

import torch

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
    """The array interface of `shape` elements at `ptr` (byte `strides`, None: dense)."""

    def __init__(self, ptr, shape, typestr, strides, owner):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (int(ptr), False),
            "strides": None if strides is None else tuple(strides),
            "version": 2,
        }
        self._owner = owner


def view(ptr, shape, dtype, device, owner, strides=None):
    """A tensor of `dtype` and `shape` over the device memory at `ptr` (byte `strides`)."""
    typestr, reinterpret = _TYPESTR[dtype]
    t = torch.as_tensor(_DeviceArray(ptr, shape, typestr, strides, owner), device=device)
    return t.view(reinterpret) if reinterpret is not None else t
