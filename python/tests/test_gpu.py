"""The GPU suite: every case of gpu_cases.py on real GPUs, one process per rank, bit-exact
against the plain-torch reference. Skips (visibly) without GPUs; fails instead under
``EPCOMM_GPU_TESTS=1`` (gpu_harness.py)."""

import pytest

import gpu_harness as h

pytestmark = pytest.mark.gpu


def _nvshmem_ok(transport):
    if not transport.startswith("nvshmem"):
        return
    import epcomm

    why = epcomm._native.nvshmem_status()
    if why is not None:
        h.skip(f"transport {transport}: the NVSHMEM host library does not load here: {why}")


@pytest.mark.parametrize("transport,schedule", h.configs())
def test_suite_shapes(transport, schedule):
    """Every shape of the Rust suite: hidden 7168/128/2056/512/256, top-k 1..9, up to 288
    experts, 0/1/odd token counts, -1 entries, skewed routing, BF16 and FP8, host-synchronised
    and worst-case receive counts, several rounds per Buffer."""
    n = h.world()
    _nvshmem_ok(transport)
    h.launch("suite", n, transport, schedule)


@pytest.mark.parametrize(
    "case", ["events", "graphs", "zero_copy", "outputs_kept", "rows_only", "ll_hook_order", "stats", "bad_inputs"]
)
def test_api(case):
    """Events and stream ordering, CUDA-graph capture and replay, zero-copy views and
    in-place combine, dispatch outputs left alone by combine, dispatch without top-k ids
    (routing given by ranks), low-latency hooks ordered after the caller's stream, wait
    statistics, bad input -> exceptions."""
    h.launch(case, h.world())


@pytest.mark.parametrize("case", ["invalid_expert", "timeout", "config_mismatch"])
def test_failures(case):
    """Device-side failures become typed exceptions on every rank (the late rank named), and a
    new Buffer works afterwards."""
    h.launch(case, h.world())


@pytest.mark.parametrize("transport,schedule", h.configs())
def test_low_latency(transport, schedule):
    """low_latency_dispatch / low_latency_combine bit-exact against a plain-torch reference:
    tokens 0/1/7/128, top-k 1/8/9, hidden 2048/7168, -1 ids, BF16, FP8 and FP8 with
    power-of-two scales, synchronous, async and hook calls, both receive sets, stale handles."""
    n = h.world()
    _nvshmem_ok(transport)
    h.launch("low_latency", n, transport, schedule)


def test_low_latency_graph():
    """Low-latency dispatch + combine captured into a torch CUDA graph and replayed with new
    inputs, bit-exact every replay; a hook inside a capture refused."""
    h.launch("ll_graph", h.world())


def test_low_latency_refusals():
    """Bad low-latency arguments and DeepEP options epcomm lacks raise InvalidArgumentError
    naming them."""
    h.launch("low_latency_refusals", h.world())


def test_two_tier():
    """The same Buffer with two_tier=True: dispatch, cached dispatch and combine bit-exact
    against the two-stage reference; flat-only calls and num_worst_tokens refused. Transport:
    ``EPCOMM_TEST_TWO_TIER_TRANSPORT`` (default ``proxy-ce:vnodes=2``; its ranks get
    what the package's launchers give its ranks, ``gpu_harness.one_host_env``: e.g.
    ``CUDA_DEVICE_MAX_CONNECTIONS=16`` for four ranks of one GPU, unless the environment sets
    it); 4 ranks give 2 x 2."""
    import os

    n = h.world()
    transport = os.environ.get("EPCOMM_TEST_TWO_TIER_TRANSPORT", "proxy-ce:vnodes=2")
    _nvshmem_ok(transport)
    h.launch("two_tier", n, transport, "epoch", env_defaults=h.one_host_env(n))
