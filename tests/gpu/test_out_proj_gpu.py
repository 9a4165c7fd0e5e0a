"""The attention with its output projection on one SM90 GPU (fa_a2a.ulysses_attention_out_proj_emulated):
with impl "fused" the backward's dO comes from the output projection's input-gradient GEMM with the
pre-A2A in its epilogue (the QKV projection's kernel, q part alone: fa_a2a.engine.backward.
_FusedRank.project_dout), no pre-A2A kernel.

Checked on emulated ranks (P 2, 3, 4, 8; seq_len padding, GQA, a padding head, causal, D 64 / 128):
every gradient (q, k, v shards, the weight and the bias) within 2x the error of the serial path (dO =
dY @ W in torch, the exchange backward) against the fp64 oracle (the full attention and linear on the
unsplit sequence) + 1e-3 of its scale; the projected path ran; under deterministic mode a second call over NaN-poisoned
windows gives the same bits (no unwritten tile).

    python -m pytest -q tests/gpu/test_out_proj_gpu.py
"""

import pytest
import torch

from fa_a2a.engine import backward as fab
from fa_a2a.op import ulysses_attention_out_proj_emulated
from ulysses.layout import split_seq
from ulysses.reference import full_attention

from tests.helpers import deterministic, poison_allocated

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an SM90 GPU (FA4's SM90 backward)")

DTYPE = torch.bfloat16
C_OUT = 384
# (P, S, H, H_kv, D, causal)
CASES = [
    (2, 999, 4, 4, 128, False),  # seq_len padding
    (4, 1024, 8, 2, 64, True),  # GQA, causal
    (8, 2048, 24, 24, 128, False),  # Flux's 24 heads
    (3, 600, 4, 4, 64, False),  # a padding head: the weight copied into destination rows (others read it in place)
]


def make(case, seed):
    P, S, H, H_kv, D, causal = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    full = [torch.randn(1, S, h, D, device="cuda", generator=g, dtype=torch.float64) for h in (H, H_kv, H_kv)]
    w = torch.randn(C_OUT, H * D, device="cuda", generator=g, dtype=torch.float64) / (H * D) ** 0.5
    b = torch.randn(C_OUT, device="cuda", generator=g, dtype=torch.float64)
    dy = torch.randn(1, S, C_OUT, device="cuda", generator=g, dtype=torch.float64)
    return full, w, b, dy


def oracle(case, full, w, b, dy):
    P, S, H, H_kv, D, causal = case
    leaves = [t.clone().requires_grad_() for t in (*full, w, b)]
    o = full_attention(*leaves[:3], causal=causal)
    y = torch.nn.functional.linear(o.flatten(2), leaves[3], leaves[4])
    return torch.autograd.grad(y, leaves, dy)


def run(case, impl, full, w, b, dy):
    """-> (full-sequence dq, dk, dv, dW, db) of the emulated call (shards padded to S_loc rows)."""
    P = case[0]
    shards = [[t.to(DTYPE).clone().requires_grad_() for t in split_seq(x, P)] for x in full]
    wl, bl = w.to(DTYPE).requires_grad_(), b.to(DTYPE).requires_grad_()
    dys = [t.to(DTYPE) for t in split_seq(dy, P)]
    ys = ulysses_attention_out_proj_emulated(*shards, wl, bl, impl=impl, causal=case[5])
    leaves = [t for xs in shards for t in xs] + [wl, bl]
    grads = torch.autograd.grad(ys, leaves, dys)
    S = case[1]
    return [torch.cat(grads[i * P:(i + 1) * P], dim=1)[:, :S] for i in range(3)] + list(grads[3 * P:])


def err(a, ref):
    return (a.double() - ref).abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_projected_fused_backward_within_the_serial_rule(case, monkeypatch):
    full, w, b, dy = make(case, seed=sum(case[:5]))
    calls = []
    real = fab._FusedRank.project_dout
    monkeypatch.setattr(fab._FusedRank, "project_dout", lambda self, *a: calls.append(self.rank) or real(self, *a))
    with deterministic():
        serial = run(case, "serial", full, w, b, dy)
        assert not calls
        fused = run(case, "fused", full, w, b, dy)
        assert sorted(calls) == list(range(case[0])), calls
        for f in fab._fused_ranks.values():  # every window the projected backward reads or writes (every
            poison_allocated(f.plan.transport)  # gradient set but those the grads held are lent out of)
        again = run(case, "fused", full, w, b, dy)
    ref = oracle(case, full, w, b, dy)
    for name, s, f, a, r in zip(("dq", "dk", "dv", "dW", "db"), serial, fused, again, ref):
        assert torch.isfinite(f).all(), (case, name)
        assert torch.equal(f, a), (case, name, "a call over NaN-poisoned windows differs: unwritten rows")
        scale = r.abs().max().item()
        assert err(f, r) <= 2 * err(s, r) + 1e-3 * scale, (case, name, err(f, r), err(s, r), scale)
