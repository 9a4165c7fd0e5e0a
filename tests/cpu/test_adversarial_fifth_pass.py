"""A fifth hostile pass (2026-12-05): the block's copies of weights updated in place, traced arguments under
torch.compile, an in-place change of the op's output with grad. Each test fails without its fix. Numeric checks
are against a plain fp64 torch oracle of the unsplit sequence (CPU, impl "reference")."""
import types

import pytest
import torch

import fa_a2a
from fa_a2a import block
from tests.helpers import fp64_attention


def _proj(seed=0, H=4, D=64, C=64, P=2):
    g = torch.Generator().manual_seed(seed)
    n = 3 * H * D
    chain = block.TorchQKV(torch.randn(n, C, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16(),
                           torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5, H, H, D)
    return block.block_weights(chain, P)


# ---- the block's copies of its weights ----------------------------------------------------------------------
def test_the_joint_slice_follows_an_in_place_update_of_the_weights():
    """The joint rows' weights (the rank's slice, a copy) were cached per weights object (an lru_cache that also
    kept 64 weight sets alive) while the sequence rows read the weights live: after proj.weight.mul_(-1) one call
    projected its sequence rows with the new weights and its joint rows with the old (max error 8.19)."""
    from fa_a2a.engine.projection import _RankBlock

    jp = _proj()
    rank_block = types.SimpleNamespace(joint_src=None, joint_versions=None, joint_slice=None, rank=1)
    first = _RankBlock._joint_proj(rank_block, jp)
    assert _RankBlock._joint_proj(rank_block, jp) is first  # kept while the weights are the same
    with torch.no_grad():
        jp.weight.mul_(-1.0)
        jp.norm_weight.add_(1.0)
    now = _RankBlock._joint_proj(rank_block, jp)
    live = jp.rank_slice(1)
    for name in ("weight", "bias", "norm_weight"):
        assert torch.equal(getattr(now, name), getattr(live, name)), name


def test_the_one_launch_vectors_follow_an_in_place_update_of_the_norm_weight():
    """The one-launch epilogue's fp32 norm vector was a cached_property copy of norm_weight: an in-place update
    reached the two-launch path (which slices norm_weight live) but not the one-launch path."""
    jp = _proj(1)
    before = jp.one_launch_vectors
    assert jp.one_launch_vectors is before  # built once while the norm weight is the same
    with torch.no_grad():
        jp.norm_weight.add_(1.0)
    w, rot, sel = jp.one_launch_vectors
    n = jp.norm_weight.numel()
    assert torch.equal(w[:n], jp.norm_weight.float()) and torch.equal(w[n:], torch.zeros_like(w[n:]))
    assert torch.equal(rot + sel, torch.ones_like(rot))


# ---- torch.compile: traced arguments ------------------------------------------------------------------------
def test_softmax_scale_as_an_argument_of_a_fullgraph_dynamic_compile():
    """check_softmax_scale called math.isfinite on the traced scale: torch._dynamo's Unsupported ("torch.* op
    returned non-Tensor") under fullgraph=True, dynamic=True."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(lambda qs, ks, vs, scale: fa_a2a.ulysses_attention_emulated(
        qs, ks, vs, impl="reference", softmax_scale=scale), fullgraph=True, dynamic=True, backend="eager")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for scale in (0.5, 0.25):
        out = torch.cat(compiled(list(q.chunk(2, 1)), list(k.chunk(2, 1)), list(v.chunk(2, 1)), scale), 1)
        assert (out - fp64_attention(q, k, v, scale)).abs().max().item() < 1e-12, scale


def test_a_traced_seq_len_with_grad():
    """seq_len from a traced shape (a SymInt) under torch.compile(dynamic=True): without grad one graph served
    every length, with grad the grad op's fake refused it ("seq_len: expected an int or None, got s20")."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa_a2a.ulysses_attention(q, k, v, impl="reference", seq_len=q.shape[1]),
                             backend="aot_eager", dynamic=True, fullgraph=True)
    for S in (5, 7, 9):
        g = torch.Generator().manual_seed(S)
        q, k, v = (torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
        out = compiled(q, k, v)
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        want = fp64_attention(*xs)
        assert (out - want).abs().max().item() < 1e-12, S
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), xs)):
            assert (a - b).abs().max().item() < 1e-12, S


# ---- the op's output with grad --------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["op", "emulated", "emulated padded"])
def test_the_output_takes_an_in_place_change_with_grad(entry):
    """out.add_(residual) on the op's output raised autograd's "Output 0 of _UlyssesFunction is a view and is
    being modified inplace" with grad (the same call without grad, and SDPA's output, take it)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    res = torch.randn(1, 8, 4, 16, generator=g, dtype=torch.float64)
    rows = 7 if entry == "emulated padded" else 8  # (the last row: padding, seq_len 7 over 2 ranks of 4 rows)
    if entry == "op":
        out = fa_a2a.ulysses_attention(q, k, v, impl="reference").add_(res)
    else:
        outs = fa_a2a.ulysses_attention_emulated(list(q.chunk(2, 1)), list(k.chunk(2, 1)), list(v.chunk(2, 1)),
                                                 impl="reference", seq_len=rows)
        for o, r in zip(outs, res.chunk(2, 1)):
            o.add_(r)
        out = torch.cat(outs, 1)
    xs = [t.detach()[:, :rows].clone().requires_grad_() for t in (q, k, v)]
    want = fp64_attention(*xs) + res[:, :rows]
    assert (out[:, :rows] - want).abs().max().item() < 1e-12
    got = torch.autograd.grad(out[:, :rows].sum(), (q, k, v))
    for a, b in zip(got, torch.autograd.grad(want.sum(), xs)):
        assert (a[:, :rows] - b).abs().max().item() < 1e-12
