"""Gradients through the op on CPU (fa_a2a.engine.backward): gloo ranks, emulated ranks, one rank.

The oracle is autograd through the full attention on the unsplit sequence in fp64 (the loss: every
rank's outputs against its own random dO; joint outputs are replicated, so the oracle's joint dO is
the sum of the ranks'). Errors follow FA4's rule against the same attention in fp32: err <= 2x the
fp32 baseline's + 1e-6. Per rank: the grads of its shard rows equal the oracle's rows of that shard;
its padding rows (poisoned with 1e3 * randn and a NaN) get zeros; joint grads summed over the ranks
equal the oracle's joint grads. "nccl" and "reference" run the same math on CPU: equal bit for bit.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fa_a2a.engine import backward as fab
from fa_a2a.attention import UlyssesAttention
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated
from ulysses.layout import UlyssesLayout, split_seq
from ulysses.reference import full_attention

from tests.multiproc import run_on_gloo_groups


class GradCase:
    """P ranks, q [B, S, H, D], k/v [B, S, H_kv, D], J joint rows; rows: uneven shard_rows (or None)."""

    def __init__(self, P, B, S, H, H_kv, D, J=0, causal=False, rows=None):
        self.P, self.B, self.S, self.H, self.H_kv, self.D, self.J, self.causal = P, B, S, H, H_kv, D, J, causal
        self.rows = rows
        self.layout = (UlyssesLayout(S, H, H_kv, P, J) if rows is None
                       else UlyssesLayout.from_shard_rows(rows, H, H_kv, P, joint_len=J))

    def __repr__(self):
        return (f"GradCase(P={self.P}, B={self.B}, S={self.S}, H={self.H}, H_kv={self.H_kv}, D={self.D}, "
                f"J={self.J}, causal={self.causal}, rows={self.rows})")

    def kwargs(self):
        return dict(causal=self.causal, **({"shard_rows": self.rows} if self.rows else {"seq_len": self.S}))


# causal + seq_len padding + GQA with one KV head replicated; joint + uneven shards, D 128; GQA
# where a rank reads one KV head twice (H 12, H_kv 6, P 4); a rank holding padding only; head padding
CASES = [
    GradCase(2, 1, 7, 4, 1, 64, causal=True),
    GradCase(2, 2, 9, 4, 2, 128, J=3, rows=[6, 3]),
    GradCase(3, 1, 10, 6, 3, 64, J=2),
    GradCase(3, 1, 11, 5, 5, 128, causal=True),
    GradCase(4, 1, 13, 12, 6, 64, causal=True),
    GradCase(4, 2, 10, 8, 2, 128, J=3, rows=[4, 0, 3, 3]),
]


def make(case: GradCase, seed: int, dtype=torch.float32, rounded=None):
    """(full q, k, v, joint or None) in fp64; per-rank shards in dtype (padding rows poisoned);
    per-rank dO (padding rows poisoned too: the forward's output there is a constant) and joint dO.
    rounded: a dtype every value is rounded to first."""
    g = torch.Generator().manual_seed(seed)
    B, S, D, J = case.B, case.S, case.D, case.J

    def randn(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return x if rounded is None else x.to(rounded).double()

    full = [randn(B, S, h, D) for h in (case.H, case.H_kv, case.H_kv)]
    joint = [randn(B, J, h, D) for h in (case.H, case.H_kv, case.H_kv)] if J else None
    lay = case.layout

    def shards(x):
        if case.rows is None:
            parts = [t.clone() for t in split_seq(x, case.P)]
        else:
            parts = list(x.split(list(case.rows), dim=1))
        out = []
        for r, t in enumerate(parts):
            t = t.clone()
            n = lay.valid_rows(r)
            if n < t.shape[1]:
                t[:, n:] = 1e3 * randn(*t[:, n:].shape)
                t[:, n:, :1, :1] = float("nan")
            out.append(t.to(dtype))
        return out

    qkv = [shards(x) for x in full]
    douts = shards(randn(B, S, case.H, D))
    djouts = [randn(B, J, case.H, D).to(dtype) for _ in range(case.P)] if J else None
    return full, joint, qkv, douts, djouts


def oracle_grads(case: GradCase, full, joint, douts, djouts, dtype=torch.float64):
    """Autograd through the full attention in dtype -> [dq, dk, dv (full rows)] + joint grads."""
    ins = [x.to(dtype).requires_grad_() for x in full]
    jins = [x.to(dtype).requires_grad_() for x in joint] if joint is not None else []
    valid = [d[:, :case.layout.valid_rows(r)] for r, d in enumerate(douts)]
    dout = torch.cat(valid, dim=1).to(dtype)
    res = full_attention(*ins, joint=tuple(jins) if jins else None, causal=case.causal, dtype=dtype)
    if jins:
        out, jout = res
        return torch.autograd.grad((out, jout), ins + jins, (dout, sum(d.to(dtype) for d in djouts)))
    return torch.autograd.grad(res, ins, dout)


def check_grad(got, ref, base, what, atol=1e-6):
    assert torch.isfinite(got).all(), what
    if got.numel() == 0:  # a rank with no rows
        return
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + atol, (what, err, base_err)


def check_rank_grads(case, r, grads, ref, base, what):
    """Rank r's (dq, dk, dv) against the oracle's rows of its shard; padding rows zero."""
    lay = case.layout
    first = sum(lay.shard_rows[:r])
    n = lay.valid_rows(r)
    for i, name in enumerate(("dq", "dk", "dv")):
        g = grads[i]
        assert g.shape[1] == (case.rows[r] if case.rows else lay.seq_loc), (what, name)
        check_grad(g[:, :n], ref[i][:, first:first + n], base[i][:, first:first + n], (what, r, name))
        assert (g[:, n:] == 0).all(), (what, r, name, "padding rows must get zero grads")


# ---- one rank and emulated ranks -------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["reference", "nccl"])
@pytest.mark.parametrize("case", [GradCase(1, 2, 9, 4, 2, 64, J=3), GradCase(1, 1, 8, 3, 1, 128, causal=True)])
def test_single_rank_gradients_match_the_oracle(case, impl):
    full, joint, (qs, ks, vs), douts, djouts = make(case, seed=1)
    ins = [qs[0].requires_grad_(), ks[0].requires_grad_(), vs[0].requires_grad_()]
    jins = [j.float().requires_grad_() for j in joint] if joint else []
    res = ulysses_attention(*ins, impl=impl, joint=tuple(jins) if jins else None, causal=case.causal)
    outs = res if jins else (res,)
    got = torch.autograd.grad(outs, ins + jins, (douts[0], *(djouts or ())))
    ref = oracle_grads(case, full, joint, douts, djouts)
    base = oracle_grads(case, full, joint, douts, djouts, torch.float32)
    check_rank_grads(case, 0, got, ref, base, impl)
    for i in range(3, len(got)):
        check_grad(got[i], ref[i], base[i], (impl, "joint", i))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_emulated_reference_gradients_match_the_oracle(case):
    full, joint, (qs, ks, vs), douts, djouts = make(case, seed=2)
    ins = [t.requires_grad_() for xs in (qs, ks, vs) for t in xs]
    jins = [j.float().requires_grad_() for j in joint] if joint else []
    res = ulysses_attention_emulated(qs, ks, vs, impl="reference", joint=tuple(jins) if jins else None,
                                     **case.kwargs())
    outs = list(res[0]) + list(res[1]) if jins else list(res)
    got = torch.autograd.grad(outs, ins + jins, list(douts) + list(djouts or ()))
    ref = oracle_grads(case, full, joint, douts, djouts)
    base = oracle_grads(case, full, joint, douts, djouts, torch.float32)
    P = case.P
    for r in range(P):
        check_rank_grads(case, r, [got[r], got[P + r], got[2 * P + r]], ref, base, "emulated")
    for i in range(len(jins)):  # the one joint tuple: the sum over the ranks
        check_grad(got[3 * P + i], ref[3 + i], base[3 + i], ("emulated joint", i))


def test_gradcheck_one_rank_fp64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    joint = [torch.randn(1, 2, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    f = lambda q, k, v, jq, jk, jv: ulysses_attention(q, k, v, impl="reference", joint=(jq, jk, jv))  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v, *joint))
    causal = lambda q, k, v: ulysses_attention(q, k, v, impl="reference", causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(causal, (q, k, v))


@pytest.mark.parametrize("kw", [dict(seq_len=5, causal=True), dict(shard_rows=[4, 1], joint=2)], ids=str)
def test_gradcheck_emulated_ranks_fp64(kw):
    """The whole Jacobian through both exchanges, padding and GQA (P = 2 emulated ranks, fp64)."""
    kw = dict(kw)
    g = torch.Generator().manual_seed(4)
    rows = kw.get("shard_rows", [3, 3])
    J = kw.pop("joint", 0)
    shards = [[torch.randn(1, n, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in rows]
              for h in (4, 2, 2)]
    joint = [torch.randn(1, J, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]

    def f(*ts):
        qs, ks, vs = ts[0:2], ts[2:4], ts[4:6]
        res = ulysses_attention_emulated(list(qs), list(ks), list(vs), impl="reference",
                                         joint=tuple(ts[6:]) if J else None, **kw)
        return tuple([*res[0], *res[1]] if J else res)

    inputs = [t for xs in shards for t in xs] + (joint if J else [])
    assert torch.autograd.gradcheck(f, tuple(inputs))


def test_no_grad_and_inference_mode_keep_the_forward_path(monkeypatch):
    """Under no_grad / inference_mode (or without inputs that require grad) the call takes today's
    forward: nothing of fa_a2a.engine.backward runs, nothing is saved; the grad path gives the same output."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 4, 8, generator=g).requires_grad_() for _ in range(3))
    with_grad = ulysses_attention(q, k, v, impl="reference")
    assert with_grad.grad_fn is not None

    def fail(*a, **kw):
        raise AssertionError("the backward's forward ran")

    monkeypatch.setattr(fab, "forward_saving", fail)
    monkeypatch.setattr(fab, "attention_with_grad", fail)
    with torch.no_grad():
        plain = ulysses_attention(q, k, v, impl="reference")
    with torch.inference_mode():
        inference = ulysses_attention(q, k, v, impl="reference")
    detached = ulysses_attention(q.detach(), k.detach(), v.detach(), impl="reference")
    for out in (plain, inference, detached):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, with_grad.detach())


def test_torch_compile_fullgraph_forward_and_backward():
    """torch.compile(fullgraph=True) through the functional op and its registered backward."""
    g = torch.Generator().manual_seed(6)
    ins = [torch.randn(1, 7, h, 8, generator=g) for h in (4, 2, 2)]
    joint = [torch.randn(1, 3, h, 8, generator=g) for h in (4, 2, 2)]

    def f(q, k, v, jq, jk, jv):
        out, jout = ulysses_attention(q, k, v, impl="reference", joint=(jq, jk, jv), softmax_scale=0.3)
        return (out * out).sum() + jout.sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        xs = [t.clone().requires_grad_() for t in ins + joint]
        fn(*xs).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_emulated_ranks_with_grad_are_refused_under_torch_compile():
    xs = [torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(2)]
    f = torch.compile(lambda a, b: ulysses_attention_emulated([a, b], [a, b], [a, b], impl="reference"),
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="^qs: inputs that require grad: emulated ranks are differentiable eagerly"):
        f(*xs)


def test_module_gradients_bhsd_layout():
    case = GradCase(1, 1, 6, 4, 2, 8)
    full, _, (qs, ks, vs), douts, _ = make(case, seed=7)
    t = lambda x: x.transpose(1, 2).contiguous().requires_grad_()  # noqa: E731
    q, k, v = t(qs[0]), t(ks[0]), t(vs[0])
    out = UlyssesAttention(impl="reference", layout="bhsd")(q, k, v)
    got = torch.autograd.grad(out, (q, k, v), douts[0].transpose(1, 2))
    ref = oracle_grads(case, full, None, douts, None)
    base = oracle_grads(case, full, None, douts, None, torch.float32)
    check_rank_grads(case, 0, [x.transpose(1, 2) for x in got], ref, base, "module")


def test_diffusers_backend_local_route_is_differentiable():
    """Without a parallel config the backend's call is local attention, differentiable (SDPA's
    autograd); the routes under context parallelism: tests/cpu/test_train_example.py."""
    pytest.importorskip("diffusers")
    from fa_a2a.models.diffusers_backend import _attention

    q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
    out = _attention("fa_a2a", "reference", q, k, v, None, 0.0, False, None, False, False, None)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    for a, b in zip(got, torch.autograd.grad(ref.square().sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("D,causal,H_kv,S", [(128, False, 2, 299), (64, True, 1, 512)])
def test_fa4_forward_and_backward_compile_without_gpu(D, causal, H_kv, S):
    """FA4's SM90 forward with its LSE and backward (preprocess, main, postprocess), as the op calls
    them on a rank's heads, compile for sm_90a from fake tensors: GQA, causal, keys masked by
    seqused_k. (FA4's deterministic backward needs a device to build its semaphores: GPU tier.)"""
    lay = UlyssesLayout(S, 4, H_kv, 2, 0)
    spec = fab.Spec(lay, causal, 0.125, True)
    with FakeTensorMode():
        B, N, h, hk = 1, lay.num_rows, lay.heads_loc, lay.kv_heads_loc
        q = torch.empty(B, N, h, D, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(B, N, hk, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        o, saved = fab._attention(spec, q, k, v)
        dq, dk, dv = fab._attention_backward(spec, saved, torch.empty_like(q))
    assert tuple(saved.lse.shape) == (B, h, N) and tuple(o.shape) == (B, N, h, D)
    assert (tuple(dq.shape), tuple(dk.shape)) == ((B, N, h, D), (B, N, hk, D))


def test_saved_bytes_per_layer():
    """The docstring's numbers: Flux (4096 + 512 tokens, 24 heads, D 128), Wan 2.1 14B 720p."""
    flux = [fab.saved_bytes(1, 4096, 512, 24, 24, 128, P) for P in (1, 2, 4, 8)]
    assert [round(b / 1e6, 1) for b in flux] == [113.7, 56.8, 28.4, 14.2]
    wan = [fab.saved_bytes(1, 75600, 0, 40, 40, 128, P) for P in (1, 2, 4, 8)]
    assert [round(b / 1e6) for b in wan] == [3109, 1554, 777, 389]
    assert [round(fab.saved_bytes(1, 32760, 0, 12, 12, 128, P) / 1e6, 1) for P in (1, 8)] == [404.1, 67.4]


# ---- real ranks over gloo ------------------------------------------------------------------------------
def _grads_on_rank(case, rank, group, impl, seed, dtype=torch.float32, rounded=None):
    full, joint, (qs, ks, vs), douts, djouts = make(case, seed, dtype, rounded)
    ins = [qs[rank].requires_grad_(), ks[rank].requires_grad_(), vs[rank].requires_grad_()]
    jins = [j.to(dtype).requires_grad_() for j in joint] if joint else []
    res = ulysses_attention(*ins, group=group, impl=impl, joint=tuple(jins) if jins else None, **case.kwargs())
    outs = res if jins else (res,)
    got = torch.autograd.grad(outs, ins + jins, (douts[rank], *((djouts[rank],) if jins else ())))
    with torch.no_grad():
        plain = ulysses_attention(*ins, group=group, impl=impl, joint=tuple(jins) if jins else None, **case.kwargs())
    for a, b in zip(outs, plain if jins else (plain,)):
        assert torch.equal(a.detach(), b), "the grad path's output differs from the forward's"
    return (full, joint, douts, djouts), list(got)


def _check_group(P, group, rank):
    for i, case in enumerate(c for c in CASES if c.P == P):
        results = {impl: _grads_on_rank(case, rank, group, impl, seed=20 + i) for impl in ("reference", "nccl")}
        (full, joint, douts, djouts), got = results["reference"]
        for a, b in zip(got, results["nccl"][1]):
            assert torch.equal(a, b), (case, rank, "nccl and reference differ")
        ref = oracle_grads(case, full, joint, douts, djouts)
        base = oracle_grads(case, full, joint, douts, djouts, torch.float32)
        check_rank_grads(case, rank, got, ref, base, ("gloo", P))
        if joint is not None:  # this rank's heads only; summed over the ranks: the full gradient
            lay = case.layout
            mine = set(h for h in lay.q_head_index[rank] if h < case.H)
            assert all((got[3][:, :, h] == 0).all() for h in range(case.H) if h not in mine)
            for i in range(3, 6):
                total = got[i].clone()
                dist.all_reduce(total, group=group)
                check_grad(total, ref[i], base[i], ("gloo joint", P, rank, i))
        # bf16 runs the same path: within bf16 rounding of the fp32 grads of the same (rounded) values
        _, got16 = _grads_on_rank(case, rank, group, "nccl", 20 + i, torch.bfloat16, torch.bfloat16)
        _, got32 = _grads_on_rank(case, rank, group, "nccl", 20 + i, torch.float32, torch.bfloat16)
        for a, b in zip(got16, got32):
            assert a.dtype == torch.bfloat16
            tol = 1e-2 * b.abs().max().item() if b.numel() else 0
            assert torch.allclose(a.float(), b, rtol=2e-2, atol=tol), (case, rank, "bf16")
    # the module (SDPA layout) on this group
    case = next(c for c in CASES if c.P == P and c.rows is None)
    full, joint, (qs, ks, vs), douts, djouts = make(case, seed=30)
    t = lambda x: x.transpose(1, 2).requires_grad_()  # noqa: E731
    q, k, v = t(qs[rank]), t(ks[rank]), t(vs[rank])
    jt = tuple(j.float().transpose(1, 2).requires_grad_() for j in joint) if joint else None
    res = UlyssesAttention(group, impl="nccl", causal=case.causal, layout="bhsd")(q, k, v, joint=jt, seq_len=case.S)
    outs = res if jt else (res,)
    got = torch.autograd.grad(outs, (q, k, v), (douts[rank].transpose(1, 2),
                                                *((djouts[rank].transpose(1, 2),) if jt else ())))
    ref = oracle_grads(case, full, joint, douts, djouts)
    base = oracle_grads(case, full, joint, douts, djouts, torch.float32)
    check_rank_grads(case, rank, [x.transpose(1, 2) for x in got], ref, base, ("module", P))


def test_gloo_ranks_gradients_match_the_oracle():
    run_on_gloo_groups(_check_group, (2, 3, 4), timeout_s=60)


def _requires_grad_disagrees(P, group, rank):
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 4, 8, generator=g) for _ in range(3))
    for impl in ("reference", "nccl"):
        with pytest.raises(ValueError) as info:
            ulysses_attention(q.clone().requires_grad_(rank == 1), k, v, group=group, impl=impl)
        msg = str(info.value)
        assert msg.startswith("requires_grad (grad mode on and q, k, v or joint requiring grad): expected the "
                              "same value on every rank"), msg
        assert "rank 1: True" in msg and "rank 0: False" in msg
        # a rank under no_grad differs from one building a graph the same way
        with pytest.raises(ValueError, match="^requires_grad"), torch.set_grad_enabled(rank != 0):
            ulysses_attention(q.clone().requires_grad_(), k, v, group=group, impl=impl)
        # the group goes on: agreeing calls with and without grad
        out = ulysses_attention(q.clone().requires_grad_(), k, v, group=group, impl=impl)
        out.sum().backward()
        with torch.no_grad():
            assert torch.equal(out.detach(), ulysses_attention(q, k, v, group=group, impl=impl))


def test_requires_grad_must_agree_across_ranks():
    run_on_gloo_groups(_requires_grad_disagrees, (2, 3), timeout_s=20)


def _backward_order_disagrees(P, group, rank):
    """Ranks that run the backwards of two calls in different orders: the first backward of every
    rank raises the same ValueError (the backward is agreed like a call), no exchange is mismatched."""
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 4, 8, generator=g).requires_grad_() for _ in range(3))
    a = ulysses_attention(q, k, v, group=group, impl="reference")
    b = ulysses_attention(q, k, v, group=group, impl="reference", causal=True)
    first, second = (a, b) if rank == 0 else (b, a)
    with pytest.raises(ValueError, match="^causal: expected the same value on every rank"):
        torch.autograd.grad(first.sum(), (q, k, v))
    for out in (a, b):  # in the same order: the group goes on
        assert all(torch.isfinite(x).all() for x in torch.autograd.grad(out.sum(), (q, k, v)))


def test_backward_order_must_agree_across_ranks():
    run_on_gloo_groups(_backward_order_disagrees, (2,), timeout_s=20)


def _compiled_on_group(P, group, rank):
    case = next(c for c in CASES if c.P == P and c.J)
    full, joint, (qs, ks, vs), douts, djouts = make(case, seed=40)

    def f(q, k, v, jq, jk, jv):
        out, jout = ulysses_attention(q, k, v, group=group, impl="reference", joint=(jq, jk, jv), **case.kwargs())
        return (out * douts[rank]).sum() + (jout * djouts[rank]).sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        xs = [t.clone().requires_grad_() for t in (qs[rank], ks[rank], vs[rank])] + \
             [j.float().requires_grad_() for j in joint]
        fn(*xs).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert math.isfinite(grads[1][0].sum().item())


def test_torch_compile_on_gloo_ranks():
    run_on_gloo_groups(_compiled_on_group, (2,), timeout_s=60)
