"""Calls that must fail loudly: ranks that disagree, NaN inputs (requires_grad: tests/cpu/test_backward_cpu.py).

Mismatch tests run on 2 and 3 gloo processes; every rank must raise the same ValueError naming
the argument that differs, for impls "nccl" and "reference" (the fused path: tests/gpu). The
process group's timeout (20 s) bounds a hang, so a missed mismatch fails instead of stalling.
"""

import re

import pytest
import torch

from fa_a2a.op import ulysses_attention, ulysses_attention_emulated

from tests.multiproc import run_on_gloo_groups

# name -> (kwargs of rank 0, kwargs of the other ranks, the argument named in the error)
MISMATCHES = {
    "dtype": (dict(dtype=torch.bfloat16), dict(dtype=torch.float16), "q (dtype)"),
    "dtype width": (dict(dtype=torch.float32), dict(dtype=torch.bfloat16), "q (dtype)"),
    "causal": (dict(causal=True), dict(causal=False), "causal"),
    "seq_len": (dict(seq_len=lambda P: 4 * P - 1), dict(seq_len=None), "seq_len"),
    "softmax_scale": (dict(softmax_scale=None), dict(softmax_scale=1.0), "softmax_scale"),
    "H and D": (dict(H=4, D=8), dict(H=8, D=4), "q (H)"),
    "S_loc": (dict(S_loc=4), dict(S_loc=5), "q (S_loc)"),
    "H_kv": (dict(H_kv=2), dict(H_kv=4), "k (H_kv)"),
    "B": (dict(B=1), dict(B=2), "q (B)"),
    "joint length": (dict(J=3), dict(J=2), "joint"),
    "joint on one rank": (dict(J=3), dict(J=0), "joint"),
    "impl": (dict(impl="nccl"), dict(impl="reference"), "impl"),
}


def _call(rank, impl="reference", dtype=torch.float32, B=1, S_loc=4, H=4, H_kv=None, D=8, J=0, causal=False,
          seq_len=None, softmax_scale=None):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, S_loc, H, D, generator=g).to(dtype)
    kv = [torch.randn(B, S_loc, H_kv or H, D, generator=g).to(dtype) for _ in range(2)]
    joint = tuple(torch.randn(B, J, h, D, generator=g).to(dtype) for h in (H, H_kv or H, H_kv or H)) if J else None
    return ulysses_attention(q, *kv, impl=impl, joint=joint, causal=causal, seq_len=seq_len,
                             softmax_scale=softmax_scale, group=_call.group)


def _check_mismatches(P, group, rank):
    import torch.distributed as dist

    _call.group = group
    for name, (first, others, argument) in MISMATCHES.items():
        for impl in ("nccl", "reference"):
            mine = first if rank == 0 else others
            kwargs = {"impl": impl, **{k: v(P) if callable(v) else v for k, v in mine.items()}}
            with pytest.raises(ValueError, match="^" + re.escape(argument)) as info:
                _call(rank, **kwargs)
            assert "rank 0" in str(info.value) and f"rank {P - 1}" in str(info.value), (name, str(info.value))
    # one rank's own bad input: every rank raises, the others naming the rank
    with pytest.raises(ValueError, match="softmax_scale") as info:
        _call(rank, softmax_scale=-1.0 if rank == P - 1 else None)
    assert rank == P - 1 or f"rank {P - 1} of {P}" in str(info.value)
    # the group still works afterwards
    out = _call(rank, seq_len=P * 4 - 1)
    assert out.shape == (1, 4, 4, 8) and torch.isfinite(out).all()
    dist.barrier(group)


def test_ranks_that_disagree_all_raise_the_same_error():
    run_on_gloo_groups(_check_mismatches, (2, 3), timeout_s=20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P,S", [(1, 8), (2, 8), (2, 7)])
def test_nan_in_a_query_row_reaches_its_output_row(dtype, causal, P, S):
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, S, 2, 8, generator=g).to(dtype) for _ in range(3)]
    full[0][0, 1, 0, 3] = float("nan")  # query row 1, head 0
    shards = [list(x.split(-(-S // P), dim=1)) for x in full]
    if S % P:  # pad the last shard
        for s in shards:
            s[-1] = torch.cat([s[-1], s[-1].new_zeros(1, 1, 2, 8)], dim=1)
    outs = ulysses_attention_emulated(*shards, impl="reference", causal=causal, seq_len=S)
    out = torch.cat(outs, dim=1)[:, :S]
    assert out[0, 1, 0].isnan().all(), "the NaN query row must come back NaN"
    assert not out[0, 1, 1].isnan().any() and not out[0, 0].isnan().any(), "other rows and heads stay finite"


def test_cached_signature_does_not_admit_equal_values_of_another_type():
    x = torch.randn(1, 4, 2, 8)
    ulysses_attention(x, x, x, impl="reference", causal=False, seq_len=4)  # valid: cached
    for kwargs, match in ((dict(causal=0, seq_len=4), "causal"), (dict(causal=False, seq_len=4.0), "seq_len"),
                          (dict(causal=False, seq_len=4, softmax_scale=True), "softmax_scale")):
        with pytest.raises(ValueError, match=match):
            ulysses_attention(x, x, x, impl="reference", **kwargs)
