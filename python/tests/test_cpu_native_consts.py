"""Constants the Python side takes from the native layer (one source of truth), without torch
and without a GPU."""

import ast
import pathlib

import pytest

import epcomm
from epcomm import _ll_args, _native


def test_fp8_block_is_the_native_row_formats():
    # RowFormat::FP8_BLOCK of epcomm-topology: one f32 scale per 128 values.
    assert type(_native.FP8_BLOCK) is int
    assert _native.FP8_BLOCK == 128
    assert _ll_args.FP8_BLOCK == _native.FP8_BLOCK


def test_ll_args_binds_the_native_value_not_a_literal():
    source = pathlib.Path(_ll_args.__file__).read_text()
    bound = [
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FP8_BLOCK" for t in node.targets)
    ]
    assert [ast.unparse(v) for v in bound] == ["_native.FP8_BLOCK"]


def test_the_fp8_rule_follows_the_native_block():
    args = dict(
        buffer_max=128,
        given_max=128,
        buffer_experts=256,
        num_experts=256,
        hidden=_native.FP8_BLOCK * 3,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
        dispatch_wait_recv_cost_stats=None,
    )
    _ll_args.check_dispatch(**args)
    args["hidden"] = _native.FP8_BLOCK * 3 + 8
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        _ll_args.check_dispatch(**args)
    assert e.value.argument == "use_fp8"
    assert f"hidden % {_native.FP8_BLOCK} == 0" in str(e.value)
