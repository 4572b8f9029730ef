"""``import deep_ep`` resolved to epcomm's DeepEP-compatible layer, :mod:`epcomm.deep_ep`.

This package holds no code of its own: importing it makes ``deep_ep``, ``deep_ep.buffer`` and
``deep_ep.utils`` the very module objects of ``epcomm.deep_ep`` (one ``Buffer`` class, whichever
name imported it)."""

import sys

import epcomm.deep_ep as _layer
from epcomm.deep_ep import buffer as _buffer
from epcomm.deep_ep import utils as _utils

sys.modules[__name__ + ".buffer"] = _buffer
sys.modules[__name__ + ".utils"] = _utils
sys.modules[__name__] = _layer
