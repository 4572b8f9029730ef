"""The drop-in ``deep_ep`` layer (``epcomm.deep_ep``) without a GPU: import without torch, the
companion ``deep_ep`` package, DeepEP V1's signatures (parameter names and defaults, written
down here from DeepEP's deep_ep/buffer.py at commit 567632dd), the static helpers and sizing,
and refusals as InvalidArgumentError naming their argument (never a TypeError)."""

import importlib.util
import inspect
import os
import sys

import pytest

import epcomm
import epcomm.deep_ep as deep_ep
from epcomm.deep_ep import buffer as dbuffer
from epcomm.deep_ep import config as dconfig

HAS_TORCH = importlib.util.find_spec("torch") is not None
COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "compat")

_ = inspect.Parameter.empty

# DeepEP's dispatch parameters (the same for intranode and internode dispatch).
_DISPATCH_PARAMS = [
    ("x", _),
    ("handle", None),
    ("num_tokens_per_rank", None),
    ("num_tokens_per_rdma_rank", None),
    ("is_token_in_rank", None),
    ("num_tokens_per_expert", None),
    ("topk_idx", None),
    ("topk_weights", None),
    ("expert_alignment", 1),
    ("num_worst_tokens", 0),
    ("config", None),
    ("previous_event", None),
    ("async_finish", False),
    ("allocate_on_comm_stream", False),
]

# DeepEP V1's Buffer: (method, [(parameter, default)]) without `self`; `_` = no default.
DEEPEP_METHODS = [
    (
        "__init__",
        [
            ("group", _),
            ("num_nvl_bytes", 0),
            ("num_rdma_bytes", 0),
            ("low_latency_mode", False),
            ("num_qps_per_rank", 24),
            ("allow_nvlink_for_low_latency_mode", True),
            ("allow_mnnvl", False),
            ("use_fabric", False),
            ("explicitly_destroy", False),
            ("enable_shrink", False),
            ("comm", None),
        ],
    ),
    ("destroy", []),
    ("get_comm_stream", []),
    ("get_local_buffer_tensor", [("dtype", _), ("size", None), ("offset", 0), ("use_rdma_buffer", False)]),
    (
        "get_dispatch_layout",
        [
            ("topk_idx", _),
            ("num_experts", _),
            ("previous_event", None),
            ("async_finish", False),
            ("allocate_on_comm_stream", False),
        ],
    ),
    (
        "dispatch",
        _DISPATCH_PARAMS,
    ),
    (
        "combine",
        [
            ("x", _),
            ("handle", _),
            ("topk_weights", None),
            ("bias", None),
            ("config", None),
            ("previous_event", None),
            ("async_finish", False),
            ("allocate_on_comm_stream", False),
        ],
    ),
    (
        "internode_dispatch",
        _DISPATCH_PARAMS,
    ),
    (
        "internode_combine",
        [
            ("x", _),
            ("handle", _),
            ("topk_weights", None),
            ("bias", None),
            ("config", None),
            ("previous_event", None),
            ("async_finish", False),
            ("allocate_on_comm_stream", False),
        ],
    ),
    ("clean_low_latency_buffer", [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_experts", _)]),
    (
        "low_latency_dispatch",
        [
            ("x", _),
            ("topk_idx", _),
            ("num_max_dispatch_tokens_per_rank", _),
            ("num_experts", _),
            ("cumulative_local_expert_recv_stats", None),
            ("dispatch_wait_recv_cost_stats", None),
            ("use_fp8", True),
            ("round_scale", False),
            ("use_ue8m0", False),
            ("async_finish", False),
            ("return_recv_hook", False),
        ],
    ),
    (
        "low_latency_combine",
        [
            ("x", _),
            ("topk_idx", _),
            ("topk_weights", _),
            ("handle", _),
            ("use_logfmt", False),
            ("zero_copy", False),
            ("async_finish", False),
            ("return_recv_hook", False),
            ("out", None),
            ("combine_wait_recv_cost_stats", None),
        ],
    ),
    ("low_latency_update_mask_buffer", [("rank_to_mask", _), ("mask", False)]),
    ("low_latency_query_mask_buffer", [("mask_status", _)]),
    ("low_latency_clean_mask_buffer", []),
    ("get_next_low_latency_combine_buffer", [("handle", _)]),
]

DEEPEP_STATIC = [
    ("is_sm90_compiled", []),
    ("set_num_sms", [("new_num_sms", _)]),
    ("capture", []),
    (
        "get_low_latency_rdma_size_hint",
        [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_ranks", _), ("num_experts", _)],
    ),
    ("get_dispatch_config", [("num_ranks", _)]),
    ("get_combine_config", [("num_ranks", _)]),
]

DEEPEP_CONFIG = [
    ("num_sms", 20),
    ("num_max_nvl_chunked_send_tokens", 6),
    ("num_max_nvl_chunked_recv_tokens", 256),
    ("num_max_rdma_chunked_send_tokens", 6),
    ("num_max_rdma_chunked_recv_tokens", 256),
]


def _positional(fn, skip_self):
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        assert params[0].name == "self"
        params = params[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [(p.name, p.default) for p in params if p.kind in kinds], [p.name for p in params if p.kind not in kinds]


def _raises(argument, fn):
    """`fn()` raises InvalidArgumentError naming `argument` (a TypeError would fail the test)."""
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        fn()
    assert e.value.argument == argument, str(e.value)
    assert e.value.rule and str(e.value).startswith(f"invalid {argument}: ")
    return e.value


def test_imports_without_torch():
    assert deep_ep.Buffer is dbuffer.Buffer and deep_ep.Config is dconfig.Config
    if HAS_TORCH:
        import torch

        assert deep_ep.topk_idx_t is torch.int64
        assert deep_ep.EventOverlap is epcomm.EventOverlap
        assert {"EventOverlap", "topk_idx_t"} <= set(deep_ep.__all__)
        # Megatron's import: `from deep_ep.utils import EventHandle, EventOverlap`.
        assert issubclass(deep_ep.utils.EventHandle, torch.cuda.Event)
    else:
        for name in ("EventOverlap", "topk_idx_t"):
            with pytest.raises(ImportError, match="needs PyTorch"):
                getattr(deep_ep, name)
        assert deep_ep.__all__ == ["Buffer", "Config"]
        for name in ("EventOverlap", "EventHandle"):
            with pytest.raises(ImportError, match="needs PyTorch"):
                getattr(deep_ep.utils, name)
    with pytest.raises(AttributeError):
        deep_ep.NoSuchThing
    assert deep_ep.utils.check_nvlink_connections(None) is None


def test_companion_package_is_the_layer():
    sys.path.insert(0, COMPAT)
    try:
        for name in ("deep_ep", "deep_ep.buffer", "deep_ep.utils"):
            sys.modules.pop(name, None)
        import deep_ep as compat
        import deep_ep.buffer
        import deep_ep.utils
    finally:
        sys.path.remove(COMPAT)
    assert compat is deep_ep
    assert sys.modules["deep_ep.buffer"] is dbuffer
    assert sys.modules["deep_ep.utils"] is deep_ep.utils
    for name in ("deep_ep", "deep_ep.buffer", "deep_ep.utils"):
        sys.modules.pop(name, None)


def test_main_wheel_leaves_compat_out():
    """maturin packs the folder named after the module (python/epcomm); compat/ is beside it."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    pyproject = open(os.path.join(here, "pyproject.toml")).read()
    assert 'module-name = "epcomm._native"' in pyproject and "compat" not in pyproject
    compat = open(os.path.join(COMPAT, "pyproject.toml")).read()
    assert 'name = "epcomm-deep-ep"' in compat and 'packages = ["deep_ep"]' in compat


@pytest.mark.parametrize("method,params", DEEPEP_METHODS, ids=[m for m, _ in DEEPEP_METHODS])
def test_deepep_method_signatures(method, params):
    got, keyword_only = _positional(getattr(deep_ep.Buffer, method), skip_self=True)
    assert got == params
    if method == "__init__":
        assert keyword_only == ["max_tokens_per_rank", "transport", "schedule", "routes", "timeout"]
    else:
        assert keyword_only == []
    assert not isinstance(inspect.getattr_static(deep_ep.Buffer, method), staticmethod)


@pytest.mark.parametrize("method,params", DEEPEP_STATIC, ids=[m for m, _ in DEEPEP_STATIC])
def test_deepep_static_signatures(method, params):
    assert isinstance(inspect.getattr_static(deep_ep.Buffer, method), staticmethod)
    assert _positional(getattr(deep_ep.Buffer, method), skip_self=False) == (params, [])


def test_deepep_config_and_event_signatures():
    assert _positional(deep_ep.Config.__init__, skip_self=True) == (DEEPEP_CONFIG, [])
    assert _positional(deep_ep.Config.get_nvl_buffer_size_hint, skip_self=True) == (
        [("hidden_bytes", _), ("num_ranks", _)],
        [],
    )
    assert _positional(deep_ep.Config.get_rdma_buffer_size_hint, skip_self=True) == (
        [("hidden_bytes", _), ("num_ranks", _)],
        [],
    )
    assert deep_ep.Buffer.num_sms == 20
    if HAS_TORCH:
        assert _positional(deep_ep.EventOverlap.__init__, skip_self=True) == (
            [("event", None), ("extra_tensors", None)],
            [],
        )
        assert callable(deep_ep.EventOverlap.current_stream_wait)


def test_config_is_deepeps():
    c = deep_ep.Config()
    assert isinstance(c, epcomm.Config)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)
    assert deep_ep.Config(24, 8, 256) == deep_ep.Config(24, 8, 256, 6, 256)
    _raises("num_sms", lambda: deep_ep.Config(0))
    _raises("num_sms", lambda: deep_ep.Config("24"))
    _raises("num_max_nvl_chunked_send_tokens", lambda: deep_ep.Config(24, 0))
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    _raises("hidden_bytes", lambda: c.get_nvl_buffer_size_hint(0, 8))
    _raises("num_ranks", lambda: c.get_nvl_buffer_size_hint(7168 * 2, 0))
    _raises("num_ranks", lambda: c.get_rdma_buffer_size_hint(7168 * 2, True))


@pytest.mark.parametrize("world,hidden", [(1, 7168), (2, 7168), (8, 4096), (8, 2056), (16, 5120)])
def test_nvl_hint_holds_the_planned_tokens(world, hidden):
    """A num_nvl_bytes from get_nvl_buffer_size_hint fits the planned tokens per rank for every
    top-k and expert count up to the planned ones, and is the same for every Config."""
    budget = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, world)
    assert budget == deep_ep.Config(24, 8, 256).get_nvl_buffer_size_hint(hidden * 2, world)
    for top_k in (1, 8, dconfig.PLAN_TOPK):
        for experts in (16 // world * world, 256 // world * world, dconfig.PLAN_EXPERTS // world * world):
            m = dconfig.fit_tokens(budget, world, hidden, top_k, experts, 1)
            assert m >= dconfig.PLAN_TOKENS_PER_RANK, (top_k, experts, m)


def test_the_core_sizes_a_budget_like_the_size_hint():
    """epcomm.rules::max_tokens_for_budget (native) against the size hint: the largest token
    count whose memory fits, for several shapes and budgets."""
    for world, hidden, top_k, experts in [(1, 7168, 8, 256), (2, 512, 4, 16), (8, 2048, 9, 288)]:
        for m in (1, 3, 100, 4096):
            budget = epcomm.size_hint(world, m, hidden, top_k, experts)
            assert epcomm._native.max_tokens_for_budget(budget, world, hidden, top_k, experts) == m
            assert epcomm._native.max_tokens_for_budget(budget + 1, world, hidden, top_k, experts) == m
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm._native.max_tokens_for_budget(1000, 2, 7168, 8, 256)
    assert e.value.argument == "budget_bytes"


def test_fit_tokens_is_the_largest_that_fits():
    budget = int(2e9)
    m = dconfig.fit_tokens(budget, 1, 7168, 8, 256, 4096)
    assert epcomm.size_hint(1, m, 7168, 8, 256) <= budget < epcomm.size_hint(1, m + 1, 7168, 8, 256)
    assert dconfig.fit_tokens(epcomm.size_hint(2, 100, 512, 4, 16), 2, 512, 4, 16, 0) == 100
    e = _raises("num_nvl_bytes", lambda: dconfig.fit_tokens(0, 2, 7168, 8, 256, 128))
    assert str(epcomm.size_hint(2, 128, 7168, 8, 256)) in e.rule
    e = _raises("num_nvl_bytes", lambda: dconfig.fit_tokens(10**6, 2, 7168, 8, 256, 128))
    assert str(epcomm.size_hint(2, 128, 7168, 8, 256)) in e.rule and "128 tokens" in e.rule
    _raises("hidden", lambda: dconfig.fit_tokens(budget, 2, 100, 8, 256, 128))
    _raises("num_experts", lambda: dconfig.fit_tokens(budget, 2, 7168, 8, 255, 128))


def test_low_latency_hint_bounds_deepeps_topk():
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint == epcomm.low_latency_size_hint(128, 7168, 8, 256, dconfig.LL_MAX_TOPK)
    assert dconfig.LL_MAX_TOPK == 11
    for top_k in range(1, dconfig.LL_MAX_TOPK + 1):
        assert epcomm.low_latency_size_hint(128, 7168, 8, 256, top_k) <= hint
    _raises("num_max_dispatch_tokens_per_rank", lambda: deep_ep.Buffer.get_low_latency_rdma_size_hint(0, 7168, 8, 256))
    _raises("num_experts", lambda: deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 3, 256))


def test_static_helpers():
    assert deep_ep.Buffer.is_sm90_compiled() is True
    saved = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.num_sms == 24
        for num_ranks, send in ((2, 24), (8, 6), (1, 6), (3, 6)):
            c = deep_ep.Buffer.get_dispatch_config(num_ranks)
            assert isinstance(c, deep_ep.Config) and c.num_sms == 24
            assert c.num_max_nvl_chunked_send_tokens == send
        assert deep_ep.Buffer.get_combine_config(8).num_max_nvl_chunked_send_tokens == 4
        assert deep_ep.Buffer.get_combine_config(1) == deep_ep.Config(24)
        _raises("new_num_sms", lambda: deep_ep.Buffer.set_num_sms(0))
        _raises("new_num_sms", lambda: deep_ep.Buffer.set_num_sms(2.0))
        _raises("num_ranks", lambda: deep_ep.Buffer.get_dispatch_config(0))
        _raises("num_ranks", lambda: deep_ep.Buffer.get_combine_config("8"))
        assert deep_ep.Buffer.num_sms == 24
    finally:
        deep_ep.Buffer.num_sms = saved


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(enable_shrink=1), "enable_shrink"),
        (dict(num_nvl_bytes=-1), "num_nvl_bytes"),
        (dict(num_nvl_bytes=2.5), "num_nvl_bytes"),
        (dict(num_rdma_bytes=None), "num_rdma_bytes"),
        (dict(low_latency_mode=1), "low_latency_mode"),
        (dict(num_qps_per_rank="24"), "num_qps_per_rank"),
        (dict(allow_nvlink_for_low_latency_mode=None), "allow_nvlink_for_low_latency_mode"),
        (dict(allow_mnnvl="no"), "allow_mnnvl"),
        (dict(use_fabric=0), "use_fabric"),
        (dict(explicitly_destroy=1), "explicitly_destroy"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
        (dict(transport="tcp"), "transport"),
        (dict(transport=3), "transport"),
        (dict(schedule=None), "schedule"),
        (dict(timeout="soon"), "timeout"),
    ],
)
def test_bad_constructor_arguments_are_named_before_anything_starts(kwargs, argument):
    _raises(argument, lambda: deep_ep.Buffer(None, **kwargs))


def test_constructor_needs_torch_only_after_its_rules():
    if HAS_TORCH:
        pytest.skip("torch is installed here: the GPU tests create Buffers")
    with pytest.raises(ImportError, match="needs PyTorch"):
        deep_ep.Buffer(None, int(1e9))


def test_refused_methods_name_their_rule():
    b = object.__new__(deep_ep.Buffer)  # refusals touch no state
    _raises("get_local_buffer_tensor", lambda: b.get_local_buffer_tensor(None))
    for call in (
        lambda: b.low_latency_update_mask_buffer(1, True),
        lambda: b.low_latency_query_mask_buffer(None),
        lambda: b.low_latency_clean_mask_buffer(),
    ):
        e = _raises("enable_shrink", call)
        assert "enable_shrink=True" in e.rule
    for call in (lambda: b.internode_dispatch(None), lambda: b.internode_combine(None, None)):
        e = _raises("group", call)
        assert "internode" in e.rule
