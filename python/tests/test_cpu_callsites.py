"""The calls vLLM and SGLang make on ``deep_ep`` bind to ``epcomm.deep_ep`` (no GPU, no torch).

Each entry is one call site, written as the caller writes it: the positional and keyword
arguments it passes, with placeholders for tensors, groups, events and handles. Binding it
with ``inspect.signature(...).bind`` is what Python does before running the call, so a call
that binds here can no longer fail with a ``TypeError`` about its arguments. What the call then
does with the values (and the refusals of what epcomm does not support, e.g. NVFP4 dispatch)
is tested elsewhere (test_cpu_deep_ep.py, and on a GPU test_gpu_deep_ep.py).

Call sites read from:

* vLLM ``vllm/distributed/device_communicators/all2all.py`` (the DeepEP high-throughput and
  low-latency managers: buffer construction, ``set_num_sms``, the size hint, the mask calls,
  ``get_local_buffer_tensor``) and
  ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_{ht,ll}.py`` (layout,
  dispatch, combine, low-latency dispatch and combine), commit 055e47c;
* SGLang ``python/sglang/srt/layers/moe/token_dispatcher/deepep.py``, commit 003a81b.

Both also probe ``hasattr(deep_ep, "ElasticBuffer")`` (DeepEP v2): it must stay False here, so
that they take their V1 path.
"""

import inspect

import pytest

import epcomm.deep_ep as deep_ep

T = object()  # a tensor
X_FP8 = (object(), object())  # (e4m3 rows, f32 scales)
GROUP = object()  # a torch.distributed group
EVENT = object()  # an EventOverlap
HANDLE = object()  # a dispatch handle
CONFIG = object()  # a deep_ep.Config
SELF = object()  # the Buffer (or Config) the method is called on
GIB = 1 << 30

Buffer, Config = deep_ep.Buffer, deep_ep.Config


def site(name, fn, *args, **kwargs):
    """One call site: its name, the function called, and the arguments as the caller passes them."""
    return name, fn, args, kwargs


CALLS = [
    # vLLM, high-throughput manager and prepare/finalize
    site("vllm HT Buffer(**kwargs), one node", Buffer.__init__, SELF, group=GROUP, num_nvl_bytes=GIB, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True),
    site("vllm HT Buffer(**kwargs), several nodes", Buffer.__init__, SELF, group=GROUP, num_nvl_bytes=GIB, num_rdma_bytes=GIB, low_latency_mode=False, num_qps_per_rank=10, explicitly_destroy=True),
    site("vllm Buffer.set_num_sms", Buffer.set_num_sms, 20),
    site("vllm Buffer.get_dispatch_config", Buffer.get_dispatch_config, 8),
    site("vllm Buffer.get_combine_config", Buffer.get_combine_config, 8),
    site("vllm Buffer.capture (the previous event of dual-batch overlap)", Buffer.capture),
    site("vllm HT get_dispatch_layout", Buffer.get_dispatch_layout, SELF, topk_idx=T, num_experts=256, previous_event=None, async_finish=False, allocate_on_comm_stream=False),
    site("vllm HT dispatch", Buffer.dispatch, SELF, x=X_FP8, handle=None, num_tokens_per_rank=T, num_tokens_per_rdma_rank=None, is_token_in_rank=T, num_tokens_per_expert=T, topk_idx=T, topk_weights=T, expert_alignment=1, config=CONFIG, previous_event=None, async_finish=True, allocate_on_comm_stream=False),
    site("vllm HT combine", Buffer.combine, SELF, x=T, handle=HANDLE, topk_weights=None, config=CONFIG, previous_event=None, async_finish=True, allocate_on_comm_stream=False),
    site("vllm destroy", Buffer.destroy, SELF),
    # vLLM, low-latency manager and prepare/finalize
    site("vllm LL get_low_latency_rdma_size_hint", Buffer.get_low_latency_rdma_size_hint, num_max_dispatch_tokens_per_rank=256, hidden=7168, num_ranks=16, num_experts=256),
    site("vllm LL Buffer(**kwargs)", Buffer.__init__, SELF, group=GROUP, num_nvl_bytes=GIB, num_rdma_bytes=123456, low_latency_mode=True, num_qps_per_rank=16, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True, enable_shrink=False),
    site("vllm LL low_latency_query_mask_buffer", Buffer.low_latency_query_mask_buffer, SELF, T),
    site("vllm LL low_latency_clean_mask_buffer", Buffer.low_latency_clean_mask_buffer, SELF),
    site("vllm LL get_local_buffer_tensor", Buffer.get_local_buffer_tensor, SELF, dtype=object(), use_rdma_buffer=True),
    site("vllm LL low_latency_dispatch, FP8 or BF16", Buffer.low_latency_dispatch, SELF, T, T, 256, 256, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=True),
    site("vllm LL low_latency_dispatch, NVFP4 (VLLM_DEEPEPLL_NVFP4_DISPATCH=1)", Buffer.low_latency_dispatch, SELF, T, T, 256, 256, use_fp8=False, round_scale=False, use_ue8m0=False, use_nvfp4=True, x_global_scale=T, async_finish=False, return_recv_hook=True),
    site("vllm LL low_latency_combine", Buffer.low_latency_combine, SELF, T, T, T, HANDLE, async_finish=False, zero_copy=False, return_recv_hook=True, out=T),
    # SGLang
    site("sglang Buffer.get_dispatch_config", Buffer.get_dispatch_config, 8),
    site("sglang Buffer.get_combine_config", Buffer.get_combine_config, 8),
    site("sglang Config.get_nvl_buffer_size_hint", Config.get_nvl_buffer_size_hint, SELF, 7168, 8),
    site("sglang Config.get_rdma_buffer_size_hint", Config.get_rdma_buffer_size_hint, SELF, 7168, 8),
    site("sglang get_low_latency_rdma_size_hint, positional", Buffer.get_low_latency_rdma_size_hint, 128, 7168, 8, 256),
    site("sglang Buffer(group, nvl, rdma, ...)", Buffer.__init__, SELF, GROUP, GIB, 1 << 28, low_latency_mode=True, num_qps_per_rank=32, allow_mnnvl=True),
    site("sglang Config(**json)", Config, num_sms=24, num_max_nvl_chunked_send_tokens=16, num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128),
    site("sglang clean_low_latency_buffer, positional", Buffer.clean_low_latency_buffer, SELF, 128, 7168, 256),
    site("sglang Buffer.capture", Buffer.capture),
    site("sglang get_dispatch_layout", Buffer.get_dispatch_layout, SELF, T, 256, previous_event=EVENT, async_finish=True, allocate_on_comm_stream=True),
    site("sglang normal dispatch", Buffer.dispatch, SELF, X_FP8, topk_idx=T, topk_weights=T, num_tokens_per_rank=T, num_tokens_per_rdma_rank=None, is_token_in_rank=T, num_tokens_per_expert=T, previous_event=EVENT, async_finish=True, allocate_on_comm_stream=True, expert_alignment=128, config=None),
    site("sglang normal combine", Buffer.combine, SELF, T, HANDLE, async_finish=True, previous_event=EVENT, allocate_on_comm_stream=True, config=None),
    site("sglang LL low_latency_dispatch, FP8 with UE8M0 scales", Buffer.low_latency_dispatch, SELF, T, T, 128, 256, use_fp8=True, async_finish=False, return_recv_hook=True, round_scale=True, use_ue8m0=True),
    site("sglang LL low_latency_dispatch, BF16", Buffer.low_latency_dispatch, SELF, T, T, 128, 256, use_fp8=False, async_finish=False, return_recv_hook=True),
    site("sglang LL low_latency_dispatch, NVFP4", Buffer.low_latency_dispatch, SELF, T, T, 128, 256, use_fp8=False, use_nvfp4=True, x_global_scale=T, async_finish=False, return_recv_hook=True),
    site("sglang LL low_latency_combine", Buffer.low_latency_combine, SELF, x=T, topk_idx=T, topk_weights=T, handle=HANDLE, async_finish=False, return_recv_hook=True),
    site("sglang LL low_latency_combine, single-batch overlap", Buffer.low_latency_combine, SELF, x=T, topk_idx=T, topk_weights=T, handle=HANDLE, async_finish=False, return_recv_hook=True, overlap=True, packed_recv_count=T, comp_signal=T, block_m=64, threshold=1, num_sms=3),
    site("sglang LL low_latency_combine, single-batch overlap with source signals", Buffer.low_latency_combine, SELF, x=T, topk_idx=T, topk_weights=T, handle=HANDLE, async_finish=False, return_recv_hook=True, overlap=True, src_signals=T, src_signal_expect_value=1),
]


@pytest.mark.parametrize("site,fn,args,kwargs", CALLS, ids=[c[0] for c in CALLS])
def test_call_site_binds(site, fn, args, kwargs):
    inspect.signature(fn).bind(*args, **kwargs)


def test_callers_take_the_v1_path():
    """vLLM and SGLang use DeepEP v2 where ``deep_ep.ElasticBuffer`` exists, and SGLang reads
    ``Buffer.num_sms`` as a class attribute (the instance attributes they read, ``rank`` and
    ``group_size``, are checked on a GPU: test_gpu_deep_ep.py)."""
    assert not hasattr(deep_ep, "ElasticBuffer")
    assert isinstance(Buffer.num_sms, int)
