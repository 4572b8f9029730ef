"""The low-latency ops without a GPU: the size hint, the Buffer options, the tensor-free
argument rules (refused DeepEP options named), and DeepEP's signatures."""

import ast
import importlib.util

import pytest

import epcomm
from epcomm import _ll_args


def test_low_latency_memory_is_planned_only_when_asked_for():
    base = dict(world_size=2, max_tokens_per_rank=4096, hidden=7168, num_topk=8, num_experts=256)
    plain = epcomm.check_options(**base)
    assert plain["low_latency_bytes"] == 0
    ll = epcomm.check_options(**base, num_max_dispatch_tokens_per_rank=128)
    assert ll["low_latency_bytes"] > 0
    assert ll["symmetric_bytes"] == plain["symmetric_bytes"] + ll["low_latency_bytes"]
    assert ll["capacity"] == plain["capacity"]
    # The hint is the same whatever the normal-mode size is.
    hint = epcomm.low_latency_size_hint(128, 7168, 2, 256, 8)
    assert hint == ll["low_latency_bytes"]
    assert hint == epcomm.check_options(**dict(base, max_tokens_per_rank=64), num_max_dispatch_tokens_per_rank=128)[
        "low_latency_bytes"
    ]
    # Per parity at least the receive rows (world * M of hidden * 2 bytes) and the combine rows
    # (M * top_k of hidden * 2 bytes); more tokens, ranks or a wider row need more.
    assert hint >= 2 * (2 * 128 + 128 * 8) * 7168 * 2
    assert epcomm.low_latency_size_hint(256, 7168, 2, 256, 8) > hint
    assert epcomm.low_latency_size_hint(128, 7168, 4, 256, 8) > hint
    assert epcomm.low_latency_size_hint(128, 4096, 2, 256, 8) < hint


@pytest.mark.parametrize(
    "args,argument",
    [
        ((0, 7168, 2, 256, 8), "num_max_dispatch_tokens_per_rank"),
        ((65536, 7168, 2, 256, 8), "num_max_dispatch_tokens_per_rank"),
        ((True, 7168, 2, 256, 8), "num_max_dispatch_tokens_per_rank"),
        ((128, 100, 2, 256, 8), "hidden"),
        ((128, 7168, 3, 256, 8), "num_experts"),
        ((128, 7168, 2, 256, 0), "num_topk"),
    ],
)
def test_size_hint_arguments(args, argument):
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm.low_latency_size_hint(*args)
    assert e.value.argument == argument, str(e.value)


def test_check_options_names_the_python_argument():
    for bad in (-1, 65536, 1.5, True):
        with pytest.raises(epcomm.InvalidArgumentError) as e:
            epcomm.check_options(
                world_size=2, max_tokens_per_rank=16, hidden=128, num_topk=2, num_experts=4,
                num_max_dispatch_tokens_per_rank=bad,
            )
        assert e.value.argument == "num_max_dispatch_tokens_per_rank", bad


def test_buffer_options():
    _ll_args.check_options(0, False, 0)
    _ll_args.check_options(128, True, 0)
    _ll_args.check_options(128, False, 1 << 30)
    for args, argument in (
        ((0, True, 0), "low_latency_mode"),
        ((0, False, 1 << 20), "num_rdma_bytes"),
        ((128, 1, 0), "low_latency_mode"),
    ):
        with pytest.raises(epcomm.InvalidArgumentError) as e:
            _ll_args.check_options(*args)
        assert e.value.argument == argument


def dispatch_args(**over):
    args = dict(
        buffer_max=128,
        given_max=128,
        buffer_experts=16,
        num_experts=16,
        hidden=7168,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
        dispatch_wait_recv_cost_stats=None,
    )
    args.update(over)
    return args


def test_good_dispatch_flags_pass():
    _ll_args.check_dispatch(**dispatch_args())
    _ll_args.check_dispatch(**dispatch_args(round_scale=True, return_recv_hook=True))
    _ll_args.check_dispatch(**dispatch_args(use_fp8=False, hidden=2056, async_finish=True))


@pytest.mark.parametrize(
    "over,argument,words",
    [
        (dict(buffer_max=0), "num_max_dispatch_tokens_per_rank", "no low-latency memory"),
        (dict(given_max=64), "num_max_dispatch_tokens_per_rank", "= 128"),
        (dict(num_experts=32), "num_experts", "= 16"),
        (dict(use_ue8m0=True), "use_ue8m0", "not implemented"),
        (dict(use_fp8=False, round_scale=True), "round_scale", "FP8"),
        (dict(hidden=2056), "use_fp8", "hidden % 128"),
        (dict(async_finish=True, return_recv_hook=True), "return_recv_hook", "async_finish"),
        (dict(dispatch_wait_recv_cost_stats=object()), "dispatch_wait_recv_cost_stats", "not implemented"),
        (dict(use_fp8=1), "use_fp8", "True or False"),
        (dict(return_recv_hook=None), "return_recv_hook", "True or False"),
    ],
)
def test_refused_dispatch_flags_are_named(over, argument, words):
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        _ll_args.check_dispatch(**dispatch_args(**over))
    assert e.value.argument == argument, str(e.value)
    assert words in e.value.rule, e.value.rule


@pytest.mark.parametrize(
    "over,argument,words",
    [
        (dict(buffer_max=0), "num_max_dispatch_tokens_per_rank", "no low-latency memory"),
        (dict(use_logfmt=True), "use_logfmt", "not implemented"),
        (dict(zero_copy=True), "zero_copy", "get_next_low_latency_combine_buffer"),
        (dict(async_finish=True, return_recv_hook=True), "return_recv_hook", "async_finish"),
        (dict(combine_wait_recv_cost_stats=[]), "combine_wait_recv_cost_stats", "not implemented"),
        (dict(async_finish="yes"), "async_finish", "True or False"),
    ],
)
def test_refused_combine_flags_are_named(over, argument, words):
    args = dict(
        buffer_max=128,
        use_logfmt=False,
        zero_copy=False,
        async_finish=False,
        return_recv_hook=False,
        combine_wait_recv_cost_stats=None,
    )
    _ll_args.check_combine(**args)
    args.update(over)
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        _ll_args.check_combine(**args)
    assert e.value.argument == argument, str(e.value)
    assert words in e.value.rule, e.value.rule


def _signature(method):
    path = importlib.util.find_spec("epcomm.buffer").origin
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Buffer":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    a = f.args
                    return [x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs]
    raise AssertionError(f"Buffer.{method} not found")


def test_deepep_signatures():
    """DeepEP's parameter names; the cost statistics (refused unless None),
    cumulative_local_expert_recv_stats and epcomm's column_major_scales are keyword-only here."""
    positional, keyword = _signature("low_latency_dispatch")
    assert positional == [
        "self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8", "round_scale",
        "use_ue8m0", "async_finish", "return_recv_hook",
    ]
    assert keyword == ["cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "column_major_scales"]
    positional, keyword = _signature("low_latency_combine")
    assert positional == [
        "self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
        "return_recv_hook", "out",
    ]
    assert keyword == ["combine_wait_recv_cost_stats"]
    assert _signature("get_low_latency_rdma_size_hint")[0] == [
        "num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts", "num_topk",
    ]
    assert "num_max_dispatch_tokens_per_rank" in _signature("__init__")[1]
    # No zero-copy combine buffer: the method is absent, not a stub.
    with pytest.raises(AssertionError):
        _signature("get_next_low_latency_combine_buffer")
