"""The package without a GPU: import, build facts, option checks and their errors, Config,
size hints, and the DeepEP-compatible signatures. Runs in CI (no torch, no GPU)."""

import ast
import importlib.util
import inspect

import pytest

import epcomm
from epcomm import errors


def test_imports_without_torch_and_reports_the_build():
    info = epcomm.build_info()
    assert info["version"] == epcomm.__version__
    assert [k[0] for k in info["kernels"]] == ["intranode", "intranode_nvshmem", "intranode_nvshmem_3_7", "intranode_proxy"]
    assert epcomm.kernels_embedded(), "the wheel must carry the kernels (cargo xtask wheel)"
    assert info["transports"] == ["ipc", "nvshmem", "nvshmem:vnodes=N", "nvshmem:vnodes=max", "proxy-ce", "proxy-ce:vnodes=N", "proxy-verbs", "proxy-verbs:vnodes=N"]
    assert set(info["schedules"]) == {"epoch", "global"}
    assert set(info["routes"]) == {"auto", "put-signal"}
    assert isinstance(info["cuda_driver"], bool)


def test_torch_classes_load_lazily():
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs PyTorch"):
            epcomm.Buffer
    else:
        assert epcomm.Buffer.__name__ == "Buffer"
    with pytest.raises(AttributeError):
        epcomm.NoSuchThing


def test_transport_specs_are_the_librarys():
    assert epcomm.parse_transport(" ipc ") == "ipc"
    assert epcomm.parse_transport("nvlink-ipc") == "ipc"
    assert epcomm.parse_transport("nvshmem:vnodes=1") == "nvshmem"
    assert epcomm.parse_transport("nvshmem:vnodes=max") == "nvshmem:vnodes=max"
    for bad in ("tcp", "nvshmem:vnodes=0", "ipc:vnodes=2", "nvshmem:lanes=2"):
        with pytest.raises(epcomm.InvalidArgumentError) as e:
            epcomm.parse_transport(bad)
        assert e.value.argument == "transport", bad
        assert str(e.value).startswith("invalid transport: ")
        assert isinstance(e.value, ValueError)


def good(**over):
    args = dict(world_size=2, max_tokens_per_rank=4096, hidden=7168, num_topk=8, num_experts=256)
    args.update(over)
    return args


def test_options_resolve_like_the_buffer():
    facts = epcomm.check_options(**good())
    assert facts["capacity"] == 2 * 4096
    assert facts["transport"] == "ipc"
    assert facts["symmetric_bytes"] == epcomm.size_hint(2, 4096, 7168, 8, 256)
    # Bigger shapes need more memory; the plan is per world size.
    assert epcomm.size_hint(2, 4096, 7168, 8, 256) > epcomm.size_hint(2, 2048, 7168, 8, 256)
    assert epcomm.check_options(**good(world_size=8, num_experts=256))["capacity"] == 8 * 4096
    assert epcomm.check_options(**good(transport="nvshmem:vnodes=max", schedule="global"))["transport"] == "nvshmem:vnodes=max"


@pytest.mark.parametrize(
    "over,argument",
    [
        (dict(hidden=100), "hidden"),
        (dict(hidden=0), "hidden"),
        (dict(num_topk=300), "top_k"),
        (dict(num_experts=255), "num_experts"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
        (dict(num_sms=0), "num_sms"),
        (dict(timeout=0.0), "timeout"),
        (dict(timeout=float("nan")), "timeout"),
        (dict(timeout="soon"), "timeout"),
        (dict(schedule="lazy"), "schedule"),
        (dict(routes="carrier"), "route policy"),
        (dict(transport="tcp"), "transport"),
        (dict(transport=3), "transport"),
        (dict(world_size=4, local_world_size=2), "world"),
        (dict(rank=2), "rank"),
        (dict(world_size=True), "world_size"),
    ],
)
def test_bad_options_name_their_argument(over, argument):
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm.check_options(**good(**over))
    assert e.value.argument == argument, str(e.value)
    assert argument.split()[0] in str(e.value)
    assert e.value.rule


def test_config_is_deepeps():
    c = epcomm.Config(24, 6, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 6, 128)
    assert epcomm.Config(24) == epcomm.Config(24)
    assert epcomm.Config(24) != epcomm.Config(32)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(epcomm.InvalidArgumentError) as e:
            epcomm.Config(bad)
        assert e.value.argument == "num_sms"
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm.Config(24, 0)
    assert e.value.argument == "num_max_nvl_chunked_send_tokens"


def test_error_classes():
    assert issubclass(epcomm.InvalidArgumentError, ValueError)
    assert issubclass(epcomm.InvalidExpertError, epcomm.InvalidArgumentError)
    assert issubclass(epcomm.TimeoutError, TimeoutError)
    assert issubclass(epcomm.BootstrapTimeoutError, epcomm.TimeoutError)
    for name in errors.__all__:
        cls = getattr(epcomm, name)
        assert issubclass(cls, epcomm.EpcommError)
        e = cls("message", late_rank=3, argument="x")
        assert str(e) == "message" and e.message == "message" and e.late_rank == 3 and e.argument == "x"
    assert epcomm.TimeoutError("m").late_rank is None


def _signature(cls_name, method):
    """Parameter names of `cls_name.method` in epcomm/buffer.py, read from the source (no torch
    needed)."""
    path = importlib.util.find_spec("epcomm.buffer").origin
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    a = f.args
                    return [x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs]
    raise AssertionError(f"{cls_name}.{method} not found")


def test_deepep_signatures():
    """Same positional parameters, in the same order, as DeepEP's Buffer."""
    assert _signature("Buffer", "get_dispatch_layout")[0] == [
        "self", "topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream",
    ]
    assert _signature("Buffer", "dispatch")[0] == [
        "self", "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
        "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens", "config",
        "previous_event", "async_finish", "allocate_on_comm_stream",
    ]
    assert _signature("Buffer", "combine")[0] == [
        "self", "x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream",
    ]
    positional, keyword = _signature("Buffer", "__init__")
    assert positional == ["self", "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode"]
    assert {"max_tokens_per_rank", "hidden", "num_topk", "num_experts", "transport", "schedule"} <= set(keyword)
    assert _signature("Buffer", "set_num_sms")[0] == ["new_num_sms"]
    assert _signature("Buffer", "get_dispatch_config")[0] == ["num_ranks"]
    assert _signature("Buffer", "get_combine_config")[0] == ["num_ranks"]
    from epcomm import config

    assert list(inspect.signature(config.Config).parameters)[0] == "num_sms"


def test_the_workload_is_the_benchmarks():
    w = epcomm._native.deepep_workload(4, 256, 2, 8, 2025, 1)
    assert len(w["x"]) == 4 * 256 * 2
    assert len(w["topk_idx"]) == 4 * 2 * 8 and len(w["topk_weights"]) == 4 * 2 * 4
    assert len(w["x_fp8"]) == 4 * 256 and len(w["scales"]) == 4 * 2 * 4
    assert w == epcomm._native.deepep_workload(4, 256, 2, 8, 2025, 1)
    assert w["x"] != epcomm._native.deepep_workload(4, 256, 2, 8, 2025, 0)["x"]
    ids = [int.from_bytes(w["topk_idx"][i : i + 8], "little", signed=True) for i in range(0, len(w["topk_idx"]), 8)]
    assert all(0 <= e < 8 for e in ids)
    with pytest.raises(epcomm.InvalidArgumentError):
        epcomm._native.deepep_workload(1, 8, 3, 2, 7, 0)


def test_every_name_the_package_uses_is_defined():
    """A name used but bound nowhere (a local renamed in one place, a helper's argument dropped)
    fails only when that line runs, often on a GPU path CI cannot reach: pyflakes (pinned with
    the test tools) finds them statically in every module of the installed package and of the
    ``deep_ep`` shim. Names listed in ``__all__`` but served by a module ``__getattr__`` are not
    uses, so only undefined names in code count."""
    from pyflakes import api, messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.found = []

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message):
            if isinstance(message, messages.UndefinedName):
                self.found.append(str(message))

    import pathlib

    roots = [pathlib.Path(epcomm.__file__).parent]
    shim = pathlib.Path(__file__).resolve().parents[1] / "compat" / "deep_ep"
    if shim.is_dir():
        roots.append(shim)
    files = [p for root in roots for p in sorted(root.rglob("*.py"))]
    assert len(files) > 10, f"found only {files}"
    out = Collect()
    for path in files:
        api.checkPath(str(path), out)
    assert not out.found, "\n".join(out.found)
