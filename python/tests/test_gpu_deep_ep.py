"""The drop-in ``deep_ep`` layer on GPUs: the cases of gpu_cases_deep_ep.py (DeepEP's own test
sequences against plain-torch references), one process per rank (default world 2 on one GPU:
``EPCOMM_TEST_WORLD``). Skips (visibly) without GPUs; fails instead under
``EPCOMM_GPU_TESTS=1`` (gpu_harness.py), and a case that checked nothing fails."""

import pytest

import gpu_harness as h

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["deep_ep_intranode", "deep_ep_intranode_fp8"])
def test_deep_ep_intranode(case):
    """tests/test_intranode.py's calls with top-k: layout, dispatch (BF16, FP8 with
    column-major scales; previous events, async), the 6-tuple handle's rank_prefix_matrix,
    num_worst_tokens, cached dispatch, combine, tuning configs with one SM count, bias."""
    h.launch(case, h.world())


def test_deep_ep_intranode_without_topk():
    """tests/test_intranode.py's dispatches without top-k (routing by is_token_in_rank and
    num_tokens_per_expert), which create the Buffer's core, then cached dispatch and combine."""
    h.launch("deep_ep_intranode_no_topk", h.world())


def test_deep_ep_internode():
    """tests/test_internode.py's calls on a group split into two logical nodes (at least 4
    ranks: 2 x 2 on one GPU; ``EPCOMM_DEEP_EP_NODE_SIZE`` = half the ranks): layout with
    num_tokens_per_rdma_rank, dispatch BF16 and FP8 with and without top-k (previous events,
    async), rows in DeepEP's order through recv_gbl_rank_prefix_sum, the 10-tuple handle,
    num_worst_tokens, cached dispatch, combine with weights and biases against the two-stage
    reference, bit for bit. Transport: ``EPCOMM_DEEP_EP_TRANSPORT`` (default ``proxy-ce``, whose
    ranks get what the package's launchers give them, ``gpu_harness.one_host_env``, e.g.
    ``CUDA_DEVICE_MAX_CONNECTIONS=16`` for four ranks of one GPU, unless the environment sets
    it, as in test_gpu.py's test_two_tier)."""
    import os

    n = max(4, h.world())
    n -= n % 2
    transport = os.environ.get("EPCOMM_DEEP_EP_TRANSPORT", "proxy-ce")
    if transport.startswith("nvshmem"):
        import epcomm

        why = epcomm._native.nvshmem_status()
        if why is not None:
            h.skip(f"transport {transport}: the NVSHMEM host library does not load here: {why}")
    env = {
        **h.one_host_env(n),
        "EPCOMM_DEEP_EP_NODE_SIZE": str(n // 2),
        "EPCOMM_DEEP_EP_TRANSPORT": transport,
    }
    h.launch("deep_ep_internode", n, transport, "epoch", env_defaults=env)


@pytest.mark.parametrize("case", ["deep_ep_low_latency", "deep_ep_ll_hook"])
def test_deep_ep_low_latency(case):
    """tests/test_low_latency.py's loop: BF16, FP8, power-of-two and packed UE8M0 scales in
    DeepEP's column-major layout, async and hook calls, zero-copy combine through
    get_next_low_latency_combine_buffer."""
    h.launch(case, h.world())


def test_deep_ep_low_latency_kernel_names():
    """bench_kineto's conditions: one profiler row names 'dispatch', one 'combine'; with hooks
    their trace events come in pairs."""
    h.launch("deep_ep_ll_kernel_names", h.world())


def test_deep_ep_refusals():
    """Budgets, fixed shapes and SMs, and the DeepEP features epcomm lacks: InvalidArgumentError
    naming the argument."""
    h.launch("deep_ep_refusals", h.world())


def test_deep_ep_shrink():
    """Rank masking (test_low_latency.py --shrink-test's sequence): ranks stop at a dispatch,
    a combine and a clean; the others keep decoding, bit-exact without them, and the mask
    names exactly the stopped ranks. At least 4 ranks (two stops and two survivors)."""
    h.launch("deep_ep_shrink", max(4, h.world()))
