"""The attention with its output projection (fa_a2a.ulysses_attention_out_proj[_emulated], the engine's
_ProjectedFunction) on CPU.

Through the reference impl: the same outputs and gradients as ulysses_attention then torch's linear
(fp64), and torch.autograd.gradcheck. Through the fused backward with the kernels stood in
(tests/cpu/test_backward_fused_cpu.py's stand-ins, and the QKV projection's launcher stood in by the GEMM
its docstring describes: x @ weight^T, destination d's columns into window d at the rank's rows): dO comes
from the output projection's GEMM into the poisoned dO windows (no pre-A2A launched) and the gradients
equal the serial backward's within bf16 rounding (the GEMMs differ: dy @ W in torch, x @ (W^T)^T in
the stand-in), padding rows zero. The argument checks."""

import pytest
import torch

import cute_kernels.qkv_a2a_sm90 as qkv_kernels
import fa_a2a
from fa_a2a.engine import backward as fab

from tests.cpu.test_backward_fused_cpu import inputs, kernels, poison_windows, problem  # noqa: F401

C_OUT = 24


def _reference_inputs(P, S, H, H_kv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, S, h, D, generator=g, dtype=dtype) for h in (H, H_kv, H_kv)]
    shards = [[t.clone().requires_grad_() for t in x.chunk(P, dim=1)] for x in full]
    w = torch.randn(C_OUT, H * D, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(C_OUT, generator=g, dtype=dtype).requires_grad_()
    dys = [torch.randn(1, S // P, C_OUT, generator=g, dtype=dtype) for _ in range(P)]
    return shards, w, b, dys


@pytest.mark.parametrize("P,H,H_kv,causal", [(2, 4, 4, False), (4, 8, 2, True)])
def test_reference_equals_the_op_then_linear(P, H, H_kv, causal):
    (qs, ks, vs), w, b, dys = _reference_inputs(P, 16, H, H_kv, 8, seed=P + H)
    leaves = [*qs, *ks, *vs, w, b]
    ys = fa_a2a.ulysses_attention_out_proj_emulated(qs, ks, vs, w, b, impl="reference", causal=causal)
    got = torch.autograd.grad(ys, leaves, dys)
    outs = fa_a2a.ulysses_attention_emulated(qs, ks, vs, impl="reference", causal=causal)
    want_ys = [torch.nn.functional.linear(o.flatten(2), w, b) for o in outs]
    want = torch.autograd.grad(want_ys, leaves, dys)
    for y, z in zip(ys, want_ys):
        assert torch.equal(y, z)
    for i, (a, e) in enumerate(zip(got, want)):
        assert torch.allclose(a, e, rtol=1e-12, atol=1e-12), i


def test_gradcheck_fp64():
    (qs, ks, vs), w, b, _ = _reference_inputs(2, 4, 2, 2, 4, seed=1)

    def f(*leaves):
        return tuple(fa_a2a.ulysses_attention_out_proj_emulated(list(leaves[:2]), list(leaves[2:4]), list(leaves[4:6]),
                                                                leaves[6], leaves[7], impl="reference"))

    assert torch.autograd.gradcheck(f, (*qs, *ks, *vs, w, b), eps=1e-6, atol=1e-7)


def test_one_rank_without_torch_distributed():
    (qs, ks, vs), w, b, dys = _reference_inputs(1, 8, 2, 2, 8, seed=2)
    y = fa_a2a.ulysses_attention_out_proj(qs[0], ks[0], vs[0], w, b, impl="reference")
    got = torch.autograd.grad(y, [qs[0], w], dys[0])
    z = torch.nn.functional.linear(fa_a2a.ulysses_attention(qs[0], ks[0], vs[0], impl="reference").flatten(2), w, b)
    want = torch.autograd.grad(z, [qs[0], w], dys[0])
    assert torch.equal(y, z)
    assert all(torch.allclose(a, e, rtol=1e-12, atol=1e-12) for a, e in zip(got, want))


def test_argument_checks_name_the_argument():
    q = torch.randn(1, 4, 2, 8)
    w = torch.randn(C_OUT, 16)
    with pytest.raises(ValueError, match=r"out_weight: expected a \[C_out, H \* D = 16\]"):
        fa_a2a.ulysses_attention_out_proj(q, q, q, torch.randn(C_OUT, 15))
    with pytest.raises(ValueError, match="out_weight: expected q's torch.float32"):
        fa_a2a.ulysses_attention_out_proj(q, q, q, w.double())
    with pytest.raises(ValueError, match=r"out_bias: expected None or a \[24\]"):
        fa_a2a.ulysses_attention_out_proj(q, q, q, w, torch.randn(C_OUT + 1))
    with pytest.raises(ValueError, match="qs: expected a non-empty list"):
        fa_a2a.ulysses_attention_out_proj_emulated(q, [q], [q], w)


# ---- the fused backward with its dO from the output projection's GEMM ------------------------------------
class Projection:
    """qkv_a2a_launcher's stand-in for the q part alone (what project_dout binds)."""

    def __init__(self, events):
        self.events = events

    def __call__(self, x, proj, windows, row0, *, rope_cs=None, config=None, one_launch=False, pacer=None):
        dq, dk, dv = windows
        assert dk is None and dv is None and rope_cs is None and proj.bias is None and proj.norm_weight is None
        assert proj.kv_heads_loc == 0 and proj.weight.shape[0] == proj.world_size * proj.heads_loc * proj.head_dim
        self.events.append(("bind projection", row0))

        def launch(x, proj, rope_cs=None):
            self.events.append(("projection", row0))
            P, B, _, h, D = dq.shape
            y = x @ proj.weight.t()  # [B, M, P * h * D]: destination d's heads in columns [d * h * D, ...)
            M = x.shape[1]
            for d in range(P):
                dq[d, :, row0:row0 + M] = y[..., d * h * D:(d + 1) * h * D].unflatten(-1, (h, D))

        return launch


def _projected_grads(p, seed, w, b):
    (qs, ks, vs), _, _, _ = inputs(p, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dys = [torch.randn(p.batch, q.shape[1], C_OUT, generator=g).to(q.dtype) for q in qs]
    leaves = [t.requires_grad_() for xs in (qs, ks, vs) for t in xs]
    P = p.world_size
    ys = fab.projected_with_grad(p, leaves[:P], leaves[P:2 * P], leaves[2 * P:], w, b, None, None)
    return torch.autograd.grad(ys, leaves + [w, b], dys)


@pytest.mark.parametrize("case", [(2, 1, 64, 4, 4), (4, 1, 30, 8, 2), (3, 2, 40, 5, 5)], ids=str)
def test_fused_backward_takes_dout_from_the_projection(kernels, monkeypatch, case):
    """(P, B, S, H, H_kv): S 30 / 40 leave padding rows, H 5 over 3 ranks a padding head."""
    P, B, S, H, H_kv = case
    events = kernels.events
    monkeypatch.setattr(qkv_kernels, "qkv_a2a_launcher", Projection(events))
    g = torch.Generator().manual_seed(S)
    D = 64
    w = torch.randn(C_OUT, H * D, generator=g).to(torch.bfloat16).requires_grad_()
    b = torch.randn(C_OUT, generator=g).to(torch.bfloat16).requires_grad_()
    serial = _projected_grads(problem("serial", P, B, S, H, H_kv), S, w, b)
    p = problem("fused", P, B, S, H, H_kv)
    lay = p.layout
    for call in range(2):
        poison_windows(kernels.transport(P), p)
        events.clear()
        fused = _projected_grads(p, S, w, b)
        kinds = [e[0] if isinstance(e, tuple) else e for e in events]
        assert "pre" not in kinds  # dO's pre-A2A is bound with the rank's backward, never launched
        assert ("bind pre" in kinds) == (call == 0)
        launches = P + sum(lay.valid_rows(r) < lay.seq_loc for r in range(P))  # + the zero rows of padding
        assert kinds.count("projection") == launches
        assert kinds.count("bind projection") == (launches if call == 0 else 0)
        assert kinds.index("barrier") > max(i for i, k in enumerate(kinds) if k == "projection")
        for i, (a, e) in enumerate(zip(fused, serial)):
            assert a.shape == e.shape and torch.isfinite(a).all(), i
            if i < 3 * P:
                n = lay.valid_rows(i % P)
                assert (a[:, n:] == 0).all(), (i, "padding rows must get zero grads")
            # bf16 rounding of dO (two GEMM orders) carried through the attention's backward
            assert torch.allclose(a.float(), e.float(), rtol=0.05, atol=0.05 * e.float().abs().max().item()), i
        assert torch.equal(fused[-2], serial[-2]) and torch.equal(fused[-1], serial[-1])  # nn.Linear's own grads


def test_fused_backward_on_sm100_takes_dout_from_torch_then_the_pre_a2a(kernels, monkeypatch):
    """The projection's GEMM with the pre-A2A epilogue is SM90's (quack): on SM100 the fused backward
    computes dO = dY @ W in torch and launches the pre-A2A kernel, as the attention-only op does."""
    P, B, S, H, H_kv = 3, 1, 40, 5, 5  # a padding head and padding rows
    events = kernels.events
    monkeypatch.setattr(qkv_kernels, "qkv_a2a_launcher", Projection(events))
    monkeypatch.setattr(fab, "_capability_of", lambda device: (10, 0))
    g = torch.Generator().manual_seed(S)
    w = torch.randn(C_OUT, H * 64, generator=g).to(torch.bfloat16).requires_grad_()
    b = torch.randn(C_OUT, generator=g).to(torch.bfloat16).requires_grad_()
    serial = _projected_grads(problem("serial", P, B, S, H, H_kv), S, w, b)
    fused = _projected_grads(problem("fused", P, B, S, H, H_kv), S, w, b)
    kinds = [e[0] if isinstance(e, tuple) else e for e in events]
    assert "projection" not in kinds and kinds.count("pre") == P and kinds.count("launch") == P
    for i, (a, e) in enumerate(zip(fused, serial)):
        assert torch.equal(a, e), i  # dO in torch as the serial path's, the same kernels' stand-ins


# ---- the attention block with its output projection (fa_a2a.block: out_proj) ------------------------------
def _block_case():
    from tests.cpu.test_block_grad_cpu import CASES, _chain, _inputs

    P, H, H_kv, D, C, _ = CASES[1]  # GQA with KV heads replicated across ranks
    return P, H, H_kv, D, C, _chain(H, H_kv, D, C, 0), _inputs(CASES[1])


def test_block_with_grad_and_out_proj_is_the_chain_then_the_projected_op():
    """Hidden states that require grad and a trained output projection: outputs [B, S_loc, C_out], the
    hidden states' and the projection's grads bit for bit the torch chain followed by
    ulysses_attention_out_proj_emulated (the path the block runs)."""
    from fa_a2a import block

    P, H, H_kv, D, C, chain, (xs, rot, _, _, _) = _block_case()
    proj = block.block_weights(chain, P)
    out = torch.nn.Linear(H * D, C_OUT, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    dys = [torch.randn(1, xs[0].shape[1], C_OUT, generator=g).to(torch.bfloat16) for _ in range(P)]
    ys = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot, out_proj=out)
    assert all(tuple(y.shape) == (1, xs[0].shape[1], C_OUT) for y in ys)
    torch.autograd.backward(ys, dys)
    got = [x.grad.clone() for x in xs] + [out.weight.grad.clone(), out.bias.grad.clone()]
    for t in xs + [out.weight, out.bias]:
        t.grad = None
    qkv = [chain(x, block.rope_table(r, x.shape[1], D, "cpu")) for x, r in zip(xs, rot)]
    want = fa_a2a.ulysses_attention_out_proj_emulated(*([t[i] for t in qkv] for i in range(3)), out.weight, out.bias)
    torch.autograd.backward(want, dys)
    for a, b in zip(ys, want):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(got, [x.grad for x in xs] + [out.weight.grad, out.bias.grad])):
        assert torch.equal(a, b), i


def test_block_module_out_proj_and_its_refusals():
    """The module's out_proj: a submodule (its parameters are the module's only ones), the output
    [B, S_loc, C_out] with grad on the chain path (Wan's norms across heads) too; refused: another type,
    joint rows with out_proj, each naming out_proj."""
    from fa_a2a import block

    P, H, H_kv, D, C, chain, (xs, rot, _, _, _) = _block_case()
    lin = [torch.nn.Linear(C, n * D, dtype=torch.bfloat16) for n in (H, H_kv, H_kv)]
    out = torch.nn.Linear(H * D, C_OUT, dtype=torch.bfloat16)
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P, out_proj=out)
    assert [n for n, _ in mod.named_parameters()] == ["out_proj.weight", "out_proj.bias"]
    ys = mod.forward_emulated(xs, rotary=rot)
    torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
    assert out.weight.grad is not None and all(x.grad is not None for x in xs)
    wan = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P, across_heads=True,
                                                norm_q=torch.nn.RMSNorm(H * D), norm_k=torch.nn.RMSNorm(H_kv * D),
                                                out_proj=out)
    ys = wan.forward_emulated([x.detach().requires_grad_() for x in xs])
    assert all(tuple(y.shape) == (1, xs[0].shape[1], C_OUT) for y in ys)
    with pytest.raises(ValueError, match="out_proj: expected None or an nn.Linear"):
        block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P, out_proj=out.weight)
    with pytest.raises(ValueError, match="out_proj: not with joint rows"):
        block.ulysses_qkv_attention_emulated(xs, block.block_weights(chain, P), rotary=rot,
                                             joint=torch.randn(1, 2, C).to(torch.bfloat16), out_proj=out)
    with pytest.raises(ValueError, match="out_proj: expected None, an nn.Linear or a"):
        block.ulysses_qkv_attention_emulated(xs, block.block_weights(chain, P), rotary=rot, out_proj="linear")
