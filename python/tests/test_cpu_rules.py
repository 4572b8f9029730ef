"""What a new user meets first, without a GPU: check_options runs the rules Buffer runs (the
library's device-free rules), `python -m epcomm.bench` says in one line why it cannot run, the
package imports with `*`, and the package's own texts describe what it offers. Runs in CI."""

import os
import re
import subprocess
import sys

import pytest

import epcomm
from epcomm import bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def good(**over):
    args = dict(world_size=2, max_tokens_per_rank=4096, hidden=7168, num_topk=8, num_experts=256)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,argument,words",
    [
        # The kernels' tables hold 64 ranks.
        (dict(world_size=128), "world", "1 to 64 ranks"),
        # CUDA IPC has no put/signal.
        (dict(transport="ipc", routes="put-signal"), "routes", "put-signal"),
        # The low-latency routing bitmaps must fit in shared memory: 992 tokens for 256 experts.
        (dict(num_max_dispatch_tokens_per_rank=4096), "num_max_dispatch_tokens_per_rank", "at most 992 tokens"),
        (dict(world_size=8, num_max_dispatch_tokens_per_rank=993), "num_max_dispatch_tokens_per_rank", "992"),
        # A transport option is named by the argument that chose it.
        (dict(world_size=4, transport="nvshmem:vnodes=3"), "transport", "vnodes=3"),
    ],
)
def test_check_options_refuses_what_buffer_refuses(over, argument, words):
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm.check_options(**good(**over))
    assert e.value.argument == argument, str(e.value)
    assert words in str(e.value), str(e.value)
    assert "::" not in str(e.value), "an internal field name leaked: " + str(e.value)


def test_check_options_lists_every_broken_rule():
    with pytest.raises(epcomm.InvalidArgumentError) as e:
        epcomm.check_options(**good(routes="put-signal", num_max_dispatch_tokens_per_rank=4096))
    msg = str(e.value)
    assert e.value.argument == "routes", msg
    assert "put-signal" in msg and "invalid num_max_dispatch_tokens_per_rank" in msg, msg


def test_check_options_accepts_the_limits():
    assert epcomm.check_options(**good(world_size=64))["capacity"] == 64 * 4096
    assert epcomm.check_options(**good(transport="nvshmem", routes="put-signal"))["transport"] == "nvshmem"
    assert epcomm.check_options(**good(transport="proxy-ce:vnodes=2", routes="put-signal"))["transport"] == "proxy-ce:vnodes=2"
    ll = epcomm.check_options(**good(world_size=8, num_max_dispatch_tokens_per_rank=992))
    assert ll["low_latency_bytes"] > 0


def _run_bench(tmp_path, *argv):
    # From a directory of its own: python/ on sys.path would shadow the installed package.
    return subprocess.run(
        [sys.executable, "-m", "epcomm.bench", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )


def test_bench_without_a_gpu_exits_3_in_one_line(tmp_path):
    why = bench.environment_problem()
    if why is None:
        pytest.skip("this machine can run the benchmark (PyTorch with CUDA and a GPU)")
    for argv in ([], ["--world", "2"]):
        r = _run_bench(tmp_path, *argv)
        assert r.returncode == bench.EXIT_ENVIRONMENT == 3, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert lines == [f"python -m epcomm.bench: cannot run here: {why}"], (argv, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_bench_help_shows_the_defaults(tmp_path):
    r = _run_bench(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    for default in ("(default: 4096)", "(default: 7168)", "(default: 256)", "(default: ipc)", "(default: 50)"):
        assert default in r.stdout, (default, r.stdout)
    r = _run_bench(tmp_path, "--tokens", "0")
    assert r.returncode == bench.EXIT_USAGE == 2 and "--tokens" in r.stderr, r.stderr


def test_star_import_works_without_torch():
    names = {}
    exec("from epcomm import *", names)
    assert "check_options" in names and "InvalidArgumentError" in names
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "Buffer" not in names
    else:
        assert "Buffer" in names


def _text(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_the_texts_describe_the_low_latency_ops_too():
    texts = {
        "README.md": _text("README.md"),
        "python/README.md": _text("python", "README.md"),
        "python/pyproject.toml": _text("python", "pyproject.toml"),
        "docs/deepep-comparison.md": _text("docs", "deepep-comparison.md"),
        "docs/python.md": _text("docs", "python.md"),
        "epcomm.__doc__": epcomm.__doc__,
    }
    for name, text in texts.items():
        assert not re.search(r"normal[- ]mode(\s+\S+)?\s+only", text, re.I), name
        # Where the normal-mode API is named as what the package offers, the low-latency ops
        # are named too.
        if re.search(r"normal-mode[` ]+Buffer", text):
            assert re.search(r"low[-_ ]latency", text, re.I), name
    # The package summary, as pip shows it.
    summary = re.search(r'^description = "(.*)"$', texts["python/pyproject.toml"], re.M).group(1)
    assert "low-latency" in summary, summary
