"""How a GPU test runs: one process per rank (`gpu_worker.py`), and when it may not run.

Nothing passes silently (the rule of the Rust GPU tests, crates/epcomm-check/tests/common):

* without ``EPCOMM_GPU_TESTS=1`` (CI, a laptop) a GPU test that cannot run here **skips**
  and says why (pytest prints skip reasons: ``-rs`` in pyproject.toml);
* with ``EPCOMM_GPU_TESTS=1`` a missing torch, CUDA or GPU, fewer ranks than a test needs,
  a wheel without kernels or an NVSHMEM library that fails to load is a **failure**, and the
  session fails when no GPU test ran (conftest.py);
* every GPU test that ran appends ``<test> <configuration>`` to the file named by
  ``EPCOMM_GPU_TESTS_RAN_FILE`` (when set) and to :data:`RAN`.

Ranks: ``EPCOMM_TEST_WORLD`` (default: one per GPU); ranks map to GPUs round-robin, so
``EPCOMM_TEST_WORLD=2`` on a one-GPU machine runs two ranks on it (correctness only).
Configurations: ``EPCOMM_TEST_TRANSPORTS`` (comma-separated specs, default
``ipc,nvshmem:vnodes=max``) times ``EPCOMM_TEST_SCHEDULES`` (default ``epoch,global``).
"""

import os
import socket
import subprocess
import sys
import time

import pytest

#: Every GPU test that ran in this session: ``(test, configuration)``.
RAN = []

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")


def required():
    """True when GPU tests must run (``EPCOMM_GPU_TESTS=1``): a skip is then a failure."""
    return os.environ.get("EPCOMM_GPU_TESTS") == "1"


def skip(why):
    """Skips the test, or fails it when GPU tests are required."""
    if required():
        pytest.fail(f"EPCOMM_GPU_TESTS=1 but {why}", pytrace=False)
    pytest.skip(f"{why} (EPCOMM_GPU_TESTS=1 makes this a failure)")


def world(min_ranks=2):
    """The number of ranks for a multi-process test, or a skip (failure when required)."""
    try:
        import torch
    except ImportError as e:
        skip(f"PyTorch is not installed ({e})")
    if not torch.cuda.is_available():
        skip("torch.cuda.is_available() is False (no CUDA driver or GPU, or a CPU-only torch)")
    gpus = torch.cuda.device_count()
    import epcomm

    if not epcomm.kernels_embedded():
        skip(f"this epcomm build carries no kernels ({epcomm.build_info()['kernels']}): build it with `cargo xtask wheel`")
    n = int(os.environ.get("EPCOMM_TEST_WORLD", gpus))
    if n < min_ranks:
        skip(
            f"it needs {min_ranks} ranks and this machine has {gpus} GPU(s); set EPCOMM_TEST_WORLD={min_ranks} "
            f"to run {min_ranks} ranks on fewer GPUs"
        )
    return n


def one_host_env(n):
    """What the package's own one-host launchers give `n` ranks on this machine's GPUs (round
    robin, so ranks share a GPU when there are fewer): ``epcomm._native.single_host_env_defaults``
    (e.g. the hardware queues the copy-engine proxy's streams need, fewer per rank the more
    ranks share a GPU under MPS). Variables the environment sets are left out."""
    import torch

    import epcomm

    gpus = max(1, torch.cuda.device_count())
    return dict(epcomm._native.single_host_env_defaults(-(-n // gpus), n))


def configs():
    """``[(transport, schedule)]`` to run under; NVSHMEM specs only where NVSHMEM loads (a
    failure under ``EPCOMM_GPU_TESTS=1`` unless the list leaves them out)."""
    transports = [t.strip() for t in os.environ.get("EPCOMM_TEST_TRANSPORTS", "ipc,nvshmem:vnodes=max").split(",") if t.strip()]
    schedules = [s.strip() for s in os.environ.get("EPCOMM_TEST_SCHEDULES", "epoch,global").split(",") if s.strip()]
    return [(t, s) for t in transports for s in schedules]


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case, n, transport="ipc", schedule="epoch", timeout=1200, env_defaults=None):
    """Runs `case` of gpu_cases.py on `n` ranks; fails naming every rank that failed (with the
    end of its output). When one rank fails, the others get 30 s to finish, then are ended.
    `env_defaults`: variables the ranks get unless the environment sets them."""
    port = _free_port()
    procs = []
    for rank in range(n):
        env = dict(env_defaults or {})
        env.update(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            EPCOMM_TEST_TRANSPORT=transport,
            EPCOMM_TEST_SCHEDULE=schedule,
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, case],
                env=env,
                cwd=os.path.dirname(WORKER),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [b""] * n
    deadline = time.monotonic() + timeout
    failed_at = None
    import selectors

    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    while any(p.poll() is None for p in procs) or sel.get_map():
        for key, _ in sel.select(timeout=0.2):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if chunk:
                outputs[key.data] += chunk
                if key.data == 0:
                    sys.stderr.write(chunk.decode(errors="replace"))
            else:
                sel.unregister(key.fileobj)
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 30):
            for p in procs:
                if p.poll() is None:
                    p.kill()
    codes = [p.wait() for p in procs]
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad:
        report = "\n".join(
            f"--- rank {r} (exit {codes[r]}) ---\n" + outputs[r].decode(errors="replace")[-6000:] for r in bad
        )
        raise AssertionError(f"{case} ({transport}, {schedule}, {n} ranks): rank(s) {bad} failed\n{report}")
    config = f"world={n} transport={transport} schedule={schedule}"
    RAN.append((case, config))
    path = os.environ.get("EPCOMM_GPU_TESTS_RAN_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"python:{case} {config}\n")
