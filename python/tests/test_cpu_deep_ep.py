"""The drop-in ``deep_ep`` layer (``epcomm.deep_ep``) without a GPU: import without torch, the
companion ``deep_ep`` package, DeepEP V1's signatures (parameter names and defaults, written
down here from DeepEP's deep_ep/buffer.py at commit 567632dd), the static helpers and sizing,
and refusals as InvalidArgumentError naming their argument (never a TypeError); the internode
path's split into (logical) nodes and, where torch is installed, its row permutation against
reference.py's two-tier order on CPU tensors."""

import importlib.util
import inspect
import os
import sys

import pytest

import epcomm
import epcomm.deep_ep as deep_ep
from epcomm.deep_ep import buffer as dbuffer
from epcomm.deep_ep import config as dconfig
from epcomm.deep_ep import handles as dhandles
from epcomm.deep_ep import nodes as dnodes

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


#: Keyword-only parameters beyond DeepEP V1's: epcomm's own options of the constructor, and
#: the keywords of DeepEP branches that vLLM and SGLang pass (accepted, refused when used).
KEYWORD_ONLY = {
    "__init__": ["max_tokens_per_rank", "transport", "schedule", "routes", "timeout"],
    "low_latency_dispatch": ["use_nvfp4", "x_global_scale"],
    "low_latency_combine": [
        "overlap",
        "packed_recv_count",
        "comp_signal",
        "block_m",
        "threshold",
        "num_sms",
        "src_signals",
        "src_signal_expect_value",
    ],
}


def test_branch_keywords_are_refused_typed():
    """NVFP4 dispatch and single-batch overlap (DeepEP branches' keywords, passed by vLLM and
    SGLang for some models) fail naming the keyword, before anything else is looked at."""
    nobody = object()
    _raises("use_nvfp4", lambda: deep_ep.Buffer.low_latency_dispatch(nobody, None, None, 128, 256, use_nvfp4=True))
    _raises("x_global_scale", lambda: deep_ep.Buffer.low_latency_dispatch(nobody, None, None, 128, 256, x_global_scale=1.0))
    _raises("overlap", lambda: deep_ep.Buffer.low_latency_combine(nobody, None, None, None, None, overlap=True, block_m=64))
    _raises("src_signals", lambda: deep_ep.Buffer.low_latency_combine(nobody, None, None, None, None, src_signals=[1]))


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
    assert keyword_only == KEYWORD_ONLY.get(method, [])
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
        assert "internode" in e.rule and "EPCOMM_DEEP_EP_NODE_SIZE" in e.rule


# ----------------------------------------------------------------------------------------------
# The internode path: how a group splits into nodes (torch-free), and the row order between the
# two-tier core and DeepEP (torch on the CPU)

NODE = dnodes.NODE_SIZE_ENV
TRANSPORT = dnodes.TRANSPORT_ENV


@pytest.mark.parametrize(
    "world,per_host,transport,env,want",
    [
        # One host, no knob: one node, the intranode path as before (ipc unless named).
        (4, 4, None, {}, (4, 1, "ipc", "ipc")),
        (8, 8, "nvshmem:vnodes=2", {}, (8, 1, "nvshmem:vnodes=2", "nvshmem:vnodes=2")),
        (4, 4, None, {NODE: "4"}, (4, 1, "ipc", "ipc")),
        (4, 4, None, {NODE: ""}, (4, 1, "ipc", "ipc")),
        # Logical nodes on one host: vnodes added to the internode transport (nvshmem by default).
        (4, 4, None, {NODE: "2"}, (2, 2, "nvshmem:vnodes=2", "ipc")),
        (4, 4, None, {NODE: "2", TRANSPORT: "proxy-ce"}, (2, 2, "proxy-ce:vnodes=2", "ipc")),
        (4, 4, None, {NODE: "1", TRANSPORT: "proxy-ce"}, (1, 4, "proxy-ce:vnodes=4", "ipc")),
        (4, 4, "proxy-ce:vnodes=2", {NODE: "2"}, (2, 2, "proxy-ce:vnodes=2", "proxy-ce:vnodes=2")),
        (4, 4, "nvshmem:vnodes=max", {NODE: "1"}, (1, 4, "nvshmem:vnodes=max", "nvshmem:vnodes=max")),
        (8, 8, "proxy-ce", {NODE: "4", TRANSPORT: "proxy-verbs"}, (4, 2, "proxy-ce:vnodes=2", "proxy-ce")),
        # Several hosts: a node per host (DeepEP's 8 NVLink peers on 8-GPU hosts), or smaller.
        (16, 8, None, {}, (8, 2, "nvshmem", "nvshmem")),
        (16, 8, None, {TRANSPORT: "proxy-verbs"}, (8, 2, "proxy-verbs", "proxy-verbs")),
        (16, 8, None, {NODE: "4", TRANSPORT: "proxy-verbs"}, (4, 4, "proxy-verbs:vnodes=2", "proxy-verbs")),
        (16, 8, "nvshmem", {NODE: "8"}, (8, 2, "nvshmem", "nvshmem")),
    ],
)
def test_node_plan(world, per_host, transport, env, want):
    p = dnodes.plan(world, per_host, transport, env)
    assert (p.node_size, p.num_nodes, p.transport, p.ll_transport) == want
    assert p.internode == (want[1] > 1) and p.world == world
    assert repr(p).startswith(f"NodePlan({want[1]} node(s) x {want[0]} rank(s)")


@pytest.mark.parametrize(
    "world,per_host,transport,env,argument,words",
    [
        (4, 4, None, {NODE: "3"}, NODE, ("dividing the 4 rank(s) per host", "never spans hosts")),
        (4, 4, None, {NODE: "0"}, NODE, ("positive",)),
        (4, 4, None, {NODE: "two"}, NODE, ("'two'",)),
        (16, 8, None, {NODE: "16"}, NODE, ("8 rank(s) per host",)),
        (4, 4, "ipc", {NODE: "2"}, "transport", ("ipc reaches the ranks of one node only", "2 nodes x 2 ranks")),
        (16, 8, "ipc", {}, "transport", ("ipc",)),
        (4, 4, None, {NODE: "2", TRANSPORT: "ipc"}, TRANSPORT, ("ipc",)),
        (4, 4, None, {NODE: "2", TRANSPORT: "tcp"}, TRANSPORT, ("tcp",)),
        (4, 4, "nvshmem:vnodes=max", {NODE: "2"}, "transport", ("vnodes=2", "4 logical node(s)")),
        (4, 4, None, {NODE: "2", TRANSPORT: "proxy-ce:vnodes=4"}, TRANSPORT, ("vnodes=2",)),
        (16, 8, "nvshmem:vnodes=2", {}, "transport", ("vnodes=1", NODE)),
    ],
)
def test_node_plan_refusals(world, per_host, transport, env, argument, words):
    e = _raises(argument, lambda: dnodes.plan(world, per_host, transport, env))
    for w in words:
        assert w in e.rule, (w, e.rule)


def test_split_spec():
    assert dnodes.split_spec("nvshmem") == ("nvshmem", None)
    assert dnodes.split_spec("proxy-ce:vnodes=2") == ("proxy-ce", 2)
    assert dnodes.split_spec("nvshmem:vnodes=max") == ("nvshmem", "max")


def test_transport_default_is_decided_by_the_plan():
    """transport=None (the default) is accepted before anything starts; a bad spec is refused."""
    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    assert params["transport"].default is None
    _raises("transport", lambda: deep_ep.Buffer(None, transport="tcp"))


def test_internode_handle_is_deepeps_ten_tuple():
    order = dhandles.ReceiveOrder("perm", "inv", 3, 5)
    items = ("in_rank", None, None, None, "rdma", None, "gbl", None, None, None)
    h = dhandles.InternodeHandle(items, "core handle", order)
    assert isinstance(h, tuple) and len(h) == 10 and tuple(h) == items
    assert h[-4] == "gbl" and h.epcomm_handle == "core handle" and h.order is order
    assert (order.num_recv, order.num_rows) == (3, 5) and "num_rows=5" in repr(order)
    assert deep_ep.buffer.InternodeHandle is dhandles.InternodeHandle


def _torch():
    return pytest.importorskip("torch")


def _internode():
    _torch()
    from epcomm.deep_ep import _internode

    return _internode


@pytest.mark.parametrize("world,local", [(4, 2), (8, 2), (8, 4), (6, 3), (4, 1), (2, 1)])
def test_receive_order_matches_the_two_tier_reference(world, local):
    """perm / inv against reference.two_stage_order (rows grouped by the source's local rank,
    then source node): DeepEP row i is core row perm[i], core row k is DeepEP row inv[k]."""
    torch = _torch()
    import reference as ref

    I = _internode()  # noqa: E741
    g = torch.Generator().manual_seed(world * 10 + local)
    for trial in range(5):
        counts = torch.randint(0, 7, (world,), generator=g, dtype=torch.int64)
        if trial == 0:
            counts.zero_()
        src = torch.repeat_interleave(torch.arange(world), counts)

        class Rec:
            src_rank = src

        order = ref.two_stage_order(Rec, local)
        gbl, perm, inv = I.receive_order(counts, local, "cpu")
        n = int(counts.sum())
        assert gbl.dtype == torch.int32 and gbl.tolist() == torch.cumsum(counts, 0).tolist()
        assert perm.dtype == torch.int64 and perm.shape == (n,) and inv.shape == (n,)
        assert torch.equal(inv, order)
        assert torch.equal(perm[inv], torch.arange(n)) and torch.equal(inv[perm], torch.arange(n))
        # Source of every DeepEP row, through the core's rows: in rank order, token order kept.
        core_src = src[order]
        assert torch.equal(core_src[perm], src)


def test_receive_order_round_trip_of_a_dispatch_and_combine():
    """A two-tier receive (rows in two_stage_order) put in DeepEP's order by perm is the flat
    reference's receive; expert outputs in DeepEP's order taken back by inv are the rows in the
    core's order, so the two-stage combine reference sees the same rows."""
    torch = _torch()
    import reference as ref

    I = _internode()  # noqa: E741
    world, local, experts, hidden, top_k = 4, 2, 16, 128, 4
    inputs = [ref.make_inputs(r, 20 + 3 * r, hidden, top_k, experts, world, 5, mask=0.1) for r in range(world)]
    for r in range(world):
        flat = ref.dispatch(inputs, r, experts)
        order = ref.two_stage_order(flat, local)
        core_rows, core_ids = flat.x[order], flat.topk_idx[order]
        counts = torch.bincount(flat.src_rank, minlength=world)
        gbl, perm, inv = I.receive_order(counts, local, "cpu")
        assert torch.equal(I.reorder(core_rows, perm, core_rows.shape[0], 0), flat.x)
        assert torch.equal(I.reorder(core_ids, perm, core_ids.shape[0], -1), flat.topk_idx)
        y = ref.expert_output(flat.x, r)
        assert torch.equal(y.index_select(0, inv), y[order])
        # DeepEP's check_data: rows of source i end at recv_gbl_rank_prefix_sum[i].
        start = 0
        for i, end in enumerate(gbl.tolist()):
            assert bool((flat.src_rank[start:end] == i).all())
            start = end


def test_reorder_pads_and_keeps_fp8():
    torch = _torch()
    I = _internode()  # noqa: E741
    t = torch.arange(12, dtype=torch.float32).view(6, 2)
    perm = torch.tensor([2, 0, 1])
    out = I.reorder(t[:3], perm, 5, -1)
    assert out.tolist() == [[4, 5], [0, 1], [2, 3], [-1, -1], [-1, -1]]
    assert torch.equal(I.reorder(t[:3], perm, 3, 0), t[:3][perm])
    x8 = torch.randn(3, 8).to(torch.float8_e4m3fn)
    got = I.reorder(x8, perm, 4, 0)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (4, 8)
    assert torch.equal(got[:3].view(torch.uint8), x8[perm].view(torch.uint8))
    assert not got[3].view(torch.uint8).any()
    assert I.reorder(None, perm, 3, 0) is None


def test_route_ids_send_each_token_to_its_ranks():
    torch = _torch()
    I = _internode()  # noqa: E741
    g = torch.Generator().manual_seed(3)
    world, epr = 6, 4
    in_rank = torch.rand((50, world), generator=g) < 0.4
    in_rank[0] = False
    in_rank[1] = True
    for k in (world, world + 2):
        ids = I.route_ids(in_rank, epr, k)
        assert ids.shape == (50, k) and ids.dtype == torch.int64
        ranks = torch.where(ids >= 0, ids // epr, -1)
        for t in range(50):
            got = [r for r in ranks[t].tolist() if r >= 0]
            assert got == torch.nonzero(in_rank[t]).flatten().tolist()  # each rank once, in order
            assert all(i % epr == 0 for i in ids[t].tolist() if i >= 0)
    narrow = I.route_ids(in_rank, epr, 2)
    assert narrow.shape == (50, 2) and narrow[1].tolist() == [0, epr]


def test_node_counts_and_rdma_prefix():
    torch = _torch()
    import reference as ref

    I = _internode()  # noqa: E741
    world, local, experts = 8, 2, 32
    nodes = world // local
    inputs = [ref.make_inputs(r, 30 + r, 128, 4, experts, world, 9, mask=0.2) for r in range(world)]
    per_node = []
    for r in range(world):
        in_rank = ref.layout(inputs[r].topk_idx, experts, world)[2]
        got = I.node_counts(in_rank, local)
        want = [int(in_rank[:, m * local : (m + 1) * local].any(dim=1).sum()) for m in range(nodes)]
        assert got.dtype == torch.int32 and got.tolist() == want
        per_node.append(want)
    gathered = torch.tensor(per_node, dtype=torch.int64)
    for r in range(world):
        # Tokens crossing the rail to r: from the rank of each node with r's local rank.
        rail = [per_node[m * local + r % local][r // local] for m in range(nodes)]
        got = I.rdma_prefix(gathered, r, local)
        assert got.dtype == torch.int32 and got.tolist() == torch.cumsum(torch.tensor(rail), 0).tolist()
