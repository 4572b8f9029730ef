"""The argument rules of the torch layer, on plain tensor descriptions (no torch needed), and
the rendezvous' host grouping."""

import pytest

from epcomm import InvalidArgumentError
from epcomm._args import TensorDesc, aligned_counts, check, check_bool, check_int
from epcomm._rendezvous import local_ranks


def desc(shape=(4, 128), dtype="bfloat16", device=0, contiguous=True):
    return TensorDesc(tuple(shape), dtype, device, contiguous, 0x1000)


def rule(argument, d, **kw):
    kw.setdefault("dtypes", ("bfloat16",))
    kw.setdefault("shape", (None, 128))
    kw.setdefault("device", 0)
    with pytest.raises(InvalidArgumentError) as e:
        check(argument, d, shape_names=("num_tokens", "hidden"), **kw)
    assert e.value.argument == argument
    assert str(e.value) == f"invalid {argument}: {e.value.rule}"
    return e.value.rule


def test_a_good_tensor_passes():
    check("x", desc(), dtypes=("bfloat16",), shape=(None, 128), device=0)
    assert desc((3, 5)).numel == 15 and desc((0, 7)).numel == 0


def test_each_rule_names_the_argument_and_says_what_it_wants():
    assert rule("x", desc(dtype="float32")) == "must have dtype torch.bfloat16 (got torch.float32)"
    assert "not on the CPU" in rule("x", desc(device=None))
    assert rule("x", desc(device=1)) == "must be on cuda:0, this Buffer's GPU (got cuda:1)"
    assert "must have 2 dimensions [num_tokens, hidden=128]" in rule("x", desc(shape=(4, 128, 1)))
    assert "dimension 1 must be 128" in rule("x", desc(shape=(4, 64)))
    assert "contiguous" in rule("x", desc(contiguous=False))
    r = rule("topk_idx", desc(shape=(3, 8), dtype="int64"), dtypes=("int64",), shape=(4, 8))
    assert "dimension 0 must be 4" in r


def test_scalars():
    assert check_int("n", 3) == 3
    for bad, minimum in ((True, 0), (2.0, 0), (-1, 0), (0, 1), ("1", 0)):
        with pytest.raises(InvalidArgumentError) as e:
            check_int("n", bad, minimum=minimum)
        assert e.value.argument == "n"
    assert check_bool("flag", False) is False
    with pytest.raises(InvalidArgumentError):
        check_bool("flag", 1)


def test_expert_alignment_rounds_up_like_deepep():
    assert aligned_counts([0, 1, 4, 5, 128], 4) == [0, 4, 4, 8, 128]
    assert aligned_counts([3, 7], 1) == [3, 7]


def test_hosts_map_to_local_ranks():
    assert local_ranks(["a", "a", "b", "b"], 3) == (1, 2)
    assert local_ranks(["a"] * 8, 5) == (5, 8)
    for hosts in (["a", "b", "a", "b"], ["a", "a", "b"], ["a", "a", "b", "b", "a", "a"]):
        with pytest.raises(InvalidArgumentError) as e:
            local_ranks(hosts, 0)
        assert e.value.argument == "group"


def test_torch_tensors_are_described_as_the_rules_expect():
    torch = pytest.importorskip("torch", reason="the torch-side description needs PyTorch")
    from epcomm._args import describe

    d = describe("x", torch.zeros((3, 128), dtype=torch.bfloat16))
    assert (d.shape, d.dtype, d.device, d.contiguous) == ((3, 128), "bfloat16", None, True)
    assert describe("x", torch.zeros((4, 2)).t()).contiguous is False
    assert describe("x", torch.zeros(2, dtype=torch.float8_e4m3fn)).dtype == "float8_e4m3fn"
    with pytest.raises(InvalidArgumentError) as e:
        describe("topk_idx", [[1, 2]])
    assert e.value.argument == "topk_idx" and "torch.Tensor" in e.value.rule
    with pytest.raises(InvalidArgumentError) as e:
        check("x", d, dtypes=("bfloat16",), shape=(None, 128), device=0)
    assert "not on the CPU" in e.value.rule


def test_a_buffer_without_a_gpu_says_so():
    torch = pytest.importorskip("torch", reason="epcomm.Buffer needs PyTorch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU tests cover Buffer")
    import epcomm

    with pytest.raises(InvalidArgumentError) as e:
        epcomm.Buffer(None, max_tokens_per_rank=16, hidden=128, num_topk=2, num_experts=4)
    assert e.value.argument == "device"
    with pytest.raises(InvalidArgumentError) as e:
        epcomm.Buffer(None, 0, 5, max_tokens_per_rank=16, hidden=128, num_topk=2, num_experts=4)
    assert e.value.argument == "num_rdma_bytes"
