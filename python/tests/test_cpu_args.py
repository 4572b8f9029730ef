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
