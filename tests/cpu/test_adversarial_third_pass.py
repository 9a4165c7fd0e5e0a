"""A third hostile pass (2026-12-05), on gradients: every probe compares each input's (and parameter's)
gradient with autograd through a plain fp64 torch oracle of the unsplit problem (tests.helpers.
fp64_attention on the concatenated sequence and joint rows), the loss summed over the ranks. Joint
(replicated) inputs: real ranks' joint grads summed over the ranks (all_reduce, as sequence-parallel
training does for replicated parameters); the emulated op's one joint tuple gets that sum itself.

Tolerance: max |got - oracle| <= RTOL * max |oracle| with RTOL = 1e-5 for fp32 inputs. The fp32 path
rounds each product and sum of a <= 25-term softmax / P @ V once or twice (unit roundoff 6e-8); the
observed errors are 0.5e-7 .. 3e-6, and any structural mistake (a head, a row, a rank's part, the
scale or a GQA sum missing or doubled) is off by >= 1e-2. bf16 / fp16 inputs: against the same
computation of the rounded values in fp32 (the library's own path), within that dtype's rounding.

Found: torch.compile(fullgraph=True) of a call with non-contiguous inputs (UlyssesAttention's "bhsd"
layout: transposed views) failed as soon as the sequence length changed (torch's automatic dynamic
shapes) with dynamo's "Unsupported: sort with non-constant keys" from the memory-overlap check
(fa_a2a.engine.problem.overlaps sorted symbolic strides): test_compiled_bhsd_module_trains_at_a_new_sequence_length.
"""
import os
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from fa_a2a import UlyssesAttention, block, ulysses_attention, ulysses_attention_emulated
from fa_a2a.op import ulysses_attention_out_proj, ulysses_attention_out_proj_emulated
from tests.helpers import fp64_attention
from tests.multiproc import run_gloo_case
from ulysses.layout import UlyssesLayout

RTOL = 1e-5


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| (an all-zero ref: got must be all zero too)."""
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def assert_close(got, ref, what, rtol=RTOL):
    assert got is not None, (what, "no gradient")
    assert torch.isfinite(got).all(), (what, "not finite")
    err = rel_err(got, ref)
    assert err <= rtol, (what, err)


# ---- the problem, its shards and its oracle --------------------------------------------------------------------
class Problem:
    """Full fp64 q [B, S, H, D], k/v [B, S, H_kv, D], joint rows (J), dO of the sequence and each rank's joint dO,
    and the shards as the op takes them: the ceil split with poisoned padding rows (seq_len), or shard_rows."""

    def __init__(self, P, B, S, H, H_kv, D, J=0, causal=False, scale=None, rows=None, seed=0):
        self.P, self.B, self.S, self.H, self.H_kv, self.D, self.J = P, B, S, H, H_kv, D, J
        self.causal, self.scale, self.rows = causal, scale, rows
        g = torch.Generator().manual_seed(seed)
        self.g = g
        randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.full = [randn(B, S, h, D) for h in (H, H_kv, H_kv)]
        self.joint = [randn(B, J, h, D) for h in (H, H_kv, H_kv)] if J else None
        self.dout = randn(B, S, H, D)
        self.djouts = [randn(B, J, H, D) for _ in range(P)] if J else None
        self.layout = (UlyssesLayout(S, H, H_kv, P, J) if rows is None
                       else UlyssesLayout.from_shard_rows(rows, H, H_kv, P, joint_len=J))

    def kwargs(self):
        kw = dict(causal=self.causal, softmax_scale=self.scale)
        kw.update(shard_rows=self.rows) if self.rows is not None else kw.update(seq_len=self.S)
        return kw

    def span(self, r):
        first = sum(self.layout.shard_rows[:r])
        return first, self.layout.shard_rows[r]

    def shard(self, x, r, dtype=torch.float32):
        """Rank r's rows of x [B, S, ...]; with seq_len padding, padded to S_loc with 1e3 * randn and a NaN."""
        first, n = self.span(r)
        t = x[:, first:first + n]
        if self.rows is None and n < self.layout.seq_loc:
            pad = 1e3 * torch.randn(x.shape[0], self.layout.seq_loc - n, *x.shape[2:], generator=self.g,
                                    dtype=x.dtype)
            pad[:, :, :1, :1] = float("nan")
            t = torch.cat([t, pad], 1)
        return t.to(dtype).clone()

    def oracle(self, dout=None, djouts=None):
        """fp64 grads [dq, dk, dv (+ djq, djk, djv)] of sum(out * dout) + sum_r sum(jout * djouts[r])."""
        dout = self.dout if dout is None else dout
        djouts = self.djouts if djouts is None else djouts
        ins = [x.clone().requires_grad_() for x in self.full]
        jins = [x.clone().requires_grad_() for x in self.joint] if self.J else []
        q, k, v = ([a] + ([b] if jins else []) for a, b in zip(ins, jins or [None] * 3))
        q, k, v = (torch.cat(t, 1) for t in (q, k, v))
        mask = torch.ones(self.S, self.S, dtype=torch.bool).tril() if self.causal else None
        o = fp64_attention(q, k, v, scale=self.scale, mask=mask)
        loss = (o[:, :self.S] * dout).sum()
        if self.J:
            loss = loss + (o[:, self.S:] * sum(djouts)).sum()
        return torch.autograd.grad(loss, ins + jins)

    def check_rank(self, r, grads, ref, what, scale=1.0, need=(True, True, True)):
        """Rank r's shard grads against the oracle's rows of its shard; padding rows zero."""
        first, n = self.span(r)
        for i, (g, name) in enumerate(zip(grads, ("dq", "dk", "dv"))):
            if not need[i]:
                assert g is None, (what, r, name, "a tensor that does not require grad got a .grad")
                continue
            if n:
                assert_close(g[:, :n], scale * ref[i][:, first:first + n], (what, r, name))
            assert (g[:, n:] == 0).all(), (what, r, name, "padding rows must get zero grads")


def emulated_grads(pb: Problem, need=(True,) * 6, dtype=torch.float32, dout=None, djouts=None):
    """The emulated op's .grad of every shard (None where not required) and of the joint tuple."""
    dout = pb.dout if dout is None else dout
    djouts = pb.djouts if djouts is None else djouts
    shards = [[pb.shard(x, r, dtype).requires_grad_(need[i]) for r in range(pb.P)] for i, x in enumerate(pb.full)]
    jt = tuple(j.to(dtype).requires_grad_(need[3 + i]) for i, j in enumerate(pb.joint)) if pb.J else None
    res = ulysses_attention_emulated(*shards, impl="reference", joint=jt, **pb.kwargs())
    outs = list(res[0]) + list(res[1]) if pb.J else list(res)
    douts = [pb.shard(dout, r, dtype) for r in range(pb.P)] + ([d.to(dtype) for d in djouts] if pb.J else [])
    torch.autograd.backward(outs, douts)
    return [[t.grad for t in xs] for xs in shards], ([t.grad for t in jt] if pb.J else [])


# ---- emulated ranks: the whole sequence of features at once ----------------------------------------------------
EMULATED = [
    # joint + GQA (one KV head read by 2 ranks) + head padding (H 5 on 3 ranks) + seq_len padding + scale + B 2
    dict(P=3, B=2, S=13, H=5, H_kv=1, D=8, J=3, scale=0.3),
    # joint + GQA with KV heads duplicated inside a rank (H 6, H_kv 2, P 4: head padding too), a rank of padding only
    dict(P=4, B=1, S=9, H=6, H_kv=2, D=8, J=2, scale=1.7),
    # causal + GQA + seq_len padding + scale
    dict(P=4, B=2, S=13, H=6, H_kv=3, D=8, causal=True, scale=0.2),
    dict(P=2, B=1, S=7, H=4, H_kv=1, D=8, causal=True),
    # uneven shards with empty ranks, joint, GQA, B 2
    dict(P=3, B=2, S=9, H=6, H_kv=2, D=8, J=3, rows=[2, 7, 0]),
    dict(P=4, B=1, S=9, H=8, H_kv=8, D=8, rows=[0, 0, 9, 0]),
    # one token and one joint row
    dict(P=2, B=1, S=1, H=2, H_kv=1, D=8, J=1),
]


@pytest.mark.parametrize("case", EMULATED, ids=str)
def test_emulated_gradients_match_the_fp64_oracle(case):
    pb = Problem(**case)
    shard_grads, joint_grads = emulated_grads(pb)
    ref = pb.oracle()
    for r in range(pb.P):
        pb.check_rank(r, [g[r] for g in shard_grads], ref, "emulated")
    for i, g in enumerate(joint_grads):
        assert_close(g, ref[3 + i], ("emulated joint", i))


@pytest.mark.parametrize("need", [(1, 0, 0, 0, 0, 0), (0, 0, 1, 0, 1, 0), (0, 0, 0, 1, 1, 1), (0, 1, 1, 1, 0, 0)],
                         ids=str)
def test_only_the_inputs_that_require_grad_get_grads(need):
    """q, k, v, joint q, k, v with only some requiring grad: the others' .grad stays None, the given ones right."""
    need = tuple(bool(n) for n in need)
    pb = Problem(P=3, B=1, S=10, H=4, H_kv=2, D=8, J=2, scale=0.5, seed=3)
    shard_grads, joint_grads = emulated_grads(pb, need)
    ref = pb.oracle()
    for r in range(pb.P):
        pb.check_rank(r, [g[r] for g in shard_grads], ref, "partial", need=need[:3])
    for i, g in enumerate(joint_grads):
        if need[3 + i]:
            assert_close(g, ref[3 + i], ("partial joint", i))
        else:
            assert g is None


def test_ranks_that_differ_in_requires_grad_get_their_own_grads_only():
    pb = Problem(P=2, B=1, S=8, H=4, H_kv=2, D=8, seed=4)
    qs = [pb.shard(pb.full[0], 0).requires_grad_(), pb.shard(pb.full[0], 1)]
    ks, vs = ([pb.shard(x, r) for r in range(2)] for x in pb.full[1:])
    vs[1].requires_grad_()
    outs = ulysses_attention_emulated(qs, ks, vs, impl="reference", **pb.kwargs())
    torch.autograd.backward(outs, [pb.shard(pb.dout, r) for r in range(2)])
    ref = pb.oracle()
    assert qs[1].grad is None and all(t.grad is None for t in ks) and vs[0].grad is None
    assert_close(qs[0].grad, ref[0][:, :4], "rank 0 q")
    assert_close(vs[1].grad, ref[2][:, 4:], "rank 1 v")


# ---- aliasing, graphs used twice, unusual losses ---------------------------------------------------------------
def test_the_same_tensor_as_q_and_k_and_one_tensor_viewed_as_q_k_v():
    g = torch.Generator().manual_seed(5)
    x, v = (torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64)
    # q is k (self-attention of one tensor): its grad is the sum of the two
    xs, vs = x.float().requires_grad_(), v.float().requires_grad_()
    ulysses_attention(xs, xs, vs, impl="reference", softmax_scale=0.7).backward(dout.float())
    x64, v64 = x.clone().requires_grad_(), v.clone().requires_grad_()
    (fp64_attention(x64, x64, v64, scale=0.7) * dout).sum().backward()
    assert_close(xs.grad, x64.grad, "q is k")
    assert_close(vs.grad, v64.grad, "v next to q is k")
    # q, k, v as views (unbind) of one packed qkv tensor [B, S, 3, H, D], split over two emulated ranks
    qkv = torch.randn(1, 6, 3, 4, 8, generator=g, dtype=torch.float64)
    packed = qkv.float().requires_grad_()
    q, k, v = packed.unbind(2)
    outs = ulysses_attention_emulated(list(q.split(3, 1)), list(k.split(3, 1)), list(v.split(3, 1)), impl="reference")
    torch.autograd.backward(outs, list(dout.float().split(3, 1)))
    p64 = qkv.clone().requires_grad_()
    (fp64_attention(*p64.unbind(2)) * dout).sum().backward()
    assert_close(packed.grad, p64.grad, "packed qkv")
    # one tensor as two ranks' q shards: its grad is the sum of both ranks' parts
    y = torch.randn(1, 3, 4, 8, generator=g, dtype=torch.float64)
    ys = y.float().requires_grad_()
    outs = ulysses_attention_emulated([ys, ys], list(x.float().split(3, 1)), list(v.float().split(3, 1)),
                                      impl="reference")
    torch.autograd.backward(outs, list(dout.float().split(3, 1)))
    y64 = y.clone().requires_grad_()
    (fp64_attention(torch.cat([y64, y64], 1), x, v) * dout).sum().backward()
    assert_close(ys.grad, y64.grad, "one tensor for two ranks")


def test_backward_twice_with_retain_graph_accumulates():
    pb = Problem(P=3, B=1, S=10, H=4, H_kv=2, D=8, J=2, seed=6)
    shards = [[pb.shard(x, r).requires_grad_() for r in range(3)] for x in pb.full]
    jt = tuple(j.float().requires_grad_() for j in pb.joint)
    outs, jouts = ulysses_attention_emulated(*shards, impl="reference", joint=jt, **pb.kwargs())
    loss = sum((o * pb.shard(pb.dout, r)).sum() + (j * pb.djouts[r].float()).sum()
               for r, (o, j) in enumerate(zip(outs, jouts)))
    loss.backward(retain_graph=True)
    loss.backward()
    ref = pb.oracle()
    for r in range(3):
        pb.check_rank(r, [xs[r].grad for xs in shards], ref, "retain_graph", scale=2.0)
    for i, t in enumerate(jt):
        assert_close(t.grad, 2 * ref[3 + i], ("retain_graph joint", i))


def test_losses_on_some_outputs_and_constant_douts():
    """Only rank 1's output in the loss (the other outputs get no gradient), only the joint outputs, and
    loss = out.sum() (torch hands the op an expanded dO, stride 0) with padding rows."""
    pb = Problem(P=2, B=1, S=7, H=4, H_kv=2, D=8, J=2, seed=7)
    zero_dj = [torch.zeros_like(d) for d in pb.djouts]
    for name, pick in (("rank 1 only", lambda outs, jouts: (outs[1] * pb.shard(pb.dout, 1)).sum()),
                       ("joint only", lambda outs, jouts: sum((j * d.float()).sum() for j, d in zip(jouts, pb.djouts))),
                       ("sums", lambda outs, jouts: sum(o.sum() for o in outs) + sum(j.sum() for j in jouts))):
        shards = [[pb.shard(x, r).requires_grad_() for r in range(2)] for x in pb.full]
        jt = tuple(j.float().requires_grad_() for j in pb.joint)
        outs, jouts = ulysses_attention_emulated(*shards, impl="reference", joint=jt, **pb.kwargs())
        pick(outs, jouts).backward()
        if name == "rank 1 only":
            dout = pb.dout.clone()
            dout[:, :pb.layout.shard_rows[0]] = 0
            ref = pb.oracle(dout, zero_dj)
        elif name == "joint only":
            ref = pb.oracle(torch.zeros_like(pb.dout))
        else:
            ref = pb.oracle(torch.ones_like(pb.dout), [torch.ones_like(d) for d in pb.djouts])
        for r in range(2):
            pb.check_rank(r, [xs[r].grad for xs in shards], ref, name)
        for i, t in enumerate(jt):
            assert_close(t.grad, ref[3 + i], (name, "joint", i))


def test_non_contiguous_inputs_and_douts():
    """Transposed views ([B, H, S, D] storage) and strided slices of a wider tensor, dO transposed too."""
    g = torch.Generator().manual_seed(8)
    base = [torch.randn(1, h, 8, 8, generator=g, dtype=torch.float64) for h in (4, 2)]
    wide = torch.randn(1, 8, 2, 11, generator=g, dtype=torch.float64)
    qb, kb, wv = base[0].float().requires_grad_(), base[1].float().requires_grad_(), wide.float().requires_grad_()
    q, k, v = qb.transpose(1, 2), kb.transpose(1, 2), wv[..., 2:10]
    dout = torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    outs = ulysses_attention_emulated(list(q.split(4, 1)), list(k.split(4, 1)), list(v.split(4, 1)),
                                      impl="reference", softmax_scale=0.9)
    torch.autograd.backward(outs, list(dout.float().split(4, 1)))
    b64 = [t.clone().requires_grad_() for t in base]
    w64 = wide.clone().requires_grad_()
    (fp64_attention(b64[0].transpose(1, 2), b64[1].transpose(1, 2), w64[..., 2:10], scale=0.9) * dout).sum().backward()
    assert_close(qb.grad, b64[0].grad, "q transposed")
    assert_close(kb.grad, b64[1].grad, "k transposed")
    assert_close(wv.grad, w64.grad, "v strided slice")
    assert (wv.grad[..., :2] == 0).all() and (wv.grad[..., 10:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_other_dtypes(dtype):
    """fp64 inputs: fp64 grads within fp64 rounding of the oracle. bf16 / fp16: grads in that dtype, within
    its rounding (2 ulp of the largest grad, 1 ulp per element) of the same path on the rounded values in fp32."""
    pb = Problem(P=3, B=1, S=10, H=5, H_kv=1, D=8, J=2, scale=0.4, seed=9)
    for x in pb.full + pb.joint + [pb.dout] + pb.djouts:
        x.copy_(x.to(dtype).double())  # every value representable in dtype
    shard_grads, joint_grads = emulated_grads(pb, dtype=dtype)
    if dtype == torch.float64:
        ref = pb.oracle()
        for r in range(3):
            for i in range(3):
                first, n = pb.span(r)
                assert shard_grads[i][r].dtype == dtype
                assert rel_err(shard_grads[i][r][:, :n], ref[i][:, first:first + n]) < 1e-12
        assert all(rel_err(g, ref[3 + i]) < 1e-12 for i, g in enumerate(joint_grads))
        return
    want, want_joint = emulated_grads(pb, dtype=torch.float32)
    eps = torch.finfo(dtype).eps
    for got, exp in zip([g for xs in shard_grads for g in xs] + joint_grads,
                        [g for xs in want for g in xs] + want_joint):
        assert got.dtype == dtype
        tol = 2 * eps * exp.abs().max().item()
        assert torch.allclose(got.float(), exp, rtol=eps, atol=tol), (dtype, (got.float() - exp).abs().max())


def test_in_place_on_an_output_is_right_or_refused():
    """out.mul_(2) before backward (allowed under no_grad): a wrong gradient would be silent; torch's refusal is not."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64)
    xs = [t.float().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*xs, impl="reference")
    try:
        out.mul_(2)
    except RuntimeError as e:
        assert "inplace" in str(e).replace("in-place", "inplace"), e
        return
    out.backward(dout.float())
    x64 = [t.clone().requires_grad_() for t in (q, k, v)]
    (2 * fp64_attention(*x64) * dout).sum().backward()
    for a, b in zip(xs, x64):
        assert_close(a.grad, b.grad, "in place on out")


# ---- the block and the output projection (emulated) --------------------------------------------------------------
def _rope64(x, pos, D):
    """diffusers' apply_rotary_emb (use_real, interleaved pairs) in fp64, for rotary_pair(pos, D)."""
    freqs = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D // 2))
    ang = pos.double()[:, None] * freqs[None]
    cos, sin = (t.repeat_interleave(2, -1)[None, :, None, :] for t in (ang.cos(), ang.sin()))
    re, im = x.unflatten(-1, (-1, 2)).unbind(-1)
    return x * cos + torch.stack([-im, re], -1).flatten(-2) * sin


def _rms64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("case", [dict(P=3, H=4, H_kv=2, S=10, J=2), dict(P=4, H=6, H_kv=3, S=13, out=True)],
                         ids=str)
def test_module_from_linear_trains_every_layer_in_fp32(case):
    """UlyssesQKVAttention.from_linear with fp32 layers (across_heads: Wan's norms, the torch chain of the
    layers then the op; the per-head path takes bf16 only), text layers (add_*), seq_len padding, GQA, an
    output projection: every parameter's grad and the hidden states' against the fp64 chain + attention."""
    P, H, Hk, S, J, out = case["P"], case["H"], case["H_kv"], case["S"], case.get("J", 0), case.get("out", False)
    D, C, B = 8, 16, 1
    torch.manual_seed(11)

    def layers():
        lin = [torch.nn.Linear(C, n * D) for n in (H, Hk, Hk)]
        norms = [torch.nn.RMSNorm(n * D, eps=1e-5) for n in (H, Hk)]
        with torch.no_grad():
            for n in norms:
                n.weight.add_(0.3 * torch.randn(n.weight.shape))
        return lin, norms

    lin, norms = layers()
    add, add_norms = layers() if J else ([None] * 3, [None] * 2)
    proj = torch.nn.Linear(H * D, C) if out else None
    extra = dict(add_q=add[0], add_k=add[1], add_v=add[2], norm_added_q=add_norms[0], norm_added_k=add_norms[1])
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=norms[0], norm_k=norms[1], world_size=P,
                                                across_heads=True, out_proj=proj, **(extra if J else {}))
    lay = UlyssesLayout(S, H, Hk, P, J)
    Sl = lay.seq_loc
    x = torch.randn(B, S, C, dtype=torch.float64)
    xs = [torch.cat([x[:, r * Sl:r * Sl + lay.valid_rows(r)], 100 * torch.randn(B, Sl - lay.valid_rows(r), C,
                                                                                   dtype=torch.float64)], 1)
          .float().requires_grad_() for r in range(P)]
    rot = [block.rotary_pair(torch.arange(r * Sl, (r + 1) * Sl), D) for r in range(P)]
    jx = torch.randn(B, J, C, dtype=torch.float64) if J else None
    jxs = jx.float().requires_grad_() if J else None
    res = mod.forward_emulated(xs, rotary=rot, joint=jxs, joint_rotary=block.rotary_pair(torch.arange(J) + 99, D)
                               if J else None, seq_len=S)
    outs, jouts = res if J else (res, [])
    dys = [torch.randn_like(o) for o in outs]
    djs = [torch.randn_like(j) for j in jouts]
    torch.autograd.backward(list(outs) + list(jouts), dys + djs)

    params = [p for m in lin + norms + (add + add_norms if J else []) + ([proj] if out else []) for p in m.parameters()]
    p64 = {id(p): p.detach().double().requires_grad_() for p in params}
    x64 = x.clone().requires_grad_()
    j64 = jx.clone().requires_grad_() if J else None

    def chain(h, ls, ns, pos):
        q, k, v = (torch.nn.functional.linear(h, p64[id(m.weight)], p64[id(m.bias)]) for m in ls)
        q, k = (_rms64(t, p64[id(n.weight)], n.eps) for t, n in ((q, ns[0]), (k, ns[1])))
        q, k, v = (t.unflatten(-1, (-1, D)) for t in (q, k, v))
        return _rope64(q, pos, D), _rope64(k, pos, D), v

    pos = torch.cat([torch.arange(r * Sl, r * Sl + lay.valid_rows(r)) for r in range(P)])
    q, k, v = chain(x64, lin, norms, pos)
    if J:
        jq, jk, jv = chain(j64, add, add_norms, torch.arange(J) + 99)
        q, k, v = (torch.cat(t, 1) for t in ((q, jq), (k, jk), (v, jv)))
    o = fp64_attention(q, k, v)
    y = o[:, :S]
    if out:
        y = torch.nn.functional.linear(y.flatten(2), p64[id(proj.weight)], p64[id(proj.bias)])
    loss = (y * torch.cat([d[:, :lay.valid_rows(r)] for r, d in enumerate(dys)], 1).double()).sum()
    if J:
        loss = loss + (o[:, S:] * sum(djs).double()).sum()
    loss.backward()
    for i, p in enumerate(params):
        want = p64[id(p)].grad
        if out and p is proj.bias:  # the projection's bias also lands on the padding rows (y = 0 @ W^T + b there)
            want = want + sum(d[:, lay.valid_rows(r):].double().sum((0, 1)) for r, d in enumerate(dys))
        assert_close(p.grad, want, ("parameter", i, tuple(p.shape)), rtol=2e-5)
    got_x = torch.cat([t.grad[:, :lay.valid_rows(r)] for r, t in enumerate(xs)], 1)
    assert_close(got_x, x64.grad, "hidden states", rtol=2e-5)
    assert all((t.grad[:, lay.valid_rows(r):] == 0).all() for r, t in enumerate(xs))
    if J:
        assert_close(jxs.grad, j64.grad, "joint hidden states", rtol=2e-5)


# ---- torch.compile -------------------------------------------------------------------------------------------------
def test_compiled_partial_grads_equal_the_eager_ones():
    """The functional op's backward (aot_eager): GQA, seq_len padding, a transposed k, joint, only some inputs
    requiring grad: the same bits as eager, the others' .grad None."""
    g = torch.Generator().manual_seed(12)
    B, S, H, Hk, D, J = 2, 7, 4, 2, 8, 3
    base = [torch.randn(B, S, H, D, generator=g), torch.randn(B, Hk, S, D, generator=g).transpose(1, 2),
            torch.randn(B, S, Hk, D, generator=g)] + [torch.randn(B, J, h, D, generator=g) for h in (H, Hk, Hk)]

    def f(q, k, v, jq, jk, jv):
        o, jo = ulysses_attention(q, k, v, impl="reference", joint=(jq, jk, jv), softmax_scale=0.6)
        return (o * o).sum() + (jo * jo.flip(1)).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for need in ((1, 1, 1, 1, 1, 1), (0, 1, 0, 1, 0, 0), (0, 0, 0, 0, 0, 1)):
        grads = []
        for fn in (f, compiled):
            xs = [t.detach().clone().requires_grad_(bool(n)) if t.is_contiguous()
                  else t.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_(bool(n))
                  for t, n in zip(base, need)]
            fn(*xs).backward()
            grads.append([x.grad for x in xs])
        for a, b, n in zip(*grads, need):
            assert (a is None and b is None) if not n else torch.equal(a, b), need


def test_compiled_bhsd_module_trains_at_a_new_sequence_length():
    """torch.compile(fullgraph=True) of UlyssesAttention(layout="bhsd") (its q, k, v transposed views) at a
    second and third sequence length, where torch traces the sequence dim as symbolic (automatic dynamic
    shapes). Before the fix: dynamo's "Unsupported: sort with non-constant keys" from the overlap check."""
    torch._dynamo.reset()
    module = UlyssesAttention(impl="reference", layout="bhsd", softmax_scale=0.5)
    f = torch.compile(lambda q, k, v, w: (module(q, k, v) * w).sum(), backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(13)
    for S in (8, 12, 16):
        full = [torch.randn(1, 4, S, 8, generator=g, dtype=torch.float64) for _ in range(4)]
        xs = [t.float().requires_grad_() for t in full[:3]]
        f(*xs, full[3].float()).backward()
        x64 = [t.clone().requires_grad_() for t in full[:3]]
        out = fp64_attention(*(t.transpose(1, 2) for t in x64), scale=0.5).transpose(1, 2)
        (out * full[3]).sum().backward()
        for a, b, name in zip(xs, x64, "qkv"):
            assert_close(a.grad, b.grad, (S, name))
    torch._dynamo.reset()


def test_compiled_refusal_at_a_dynamic_sequence_length_is_the_value_error():
    """A refusal whose message names sizes (here: v's heads share memory) at a second sequence length, which
    torch.compile traces as dynamic: the ValueError with the call's sizes. (It was dynamo's "Failed to convert
    args/kwargs to proxy": the message, formatted from symbolic sizes, was passed to the op as its argument.)"""
    torch._dynamo.reset()
    module = UlyssesAttention(impl="reference", layout="bhsd")
    f = torch.compile(lambda q, k, v: module(q, k, v), backend="aot_eager", fullgraph=True)
    for S in (8, 12):
        q, k = torch.randn(1, 4, S, 8), torch.randn(1, 4, S, 8)
        v = torch.randn(1, 1, S, 8).expand(1, 4, S, 8)
        with pytest.raises(ValueError, match=rf"v: expected a tensor whose elements do not share memory, got shape "
                                             rf"\(1, {S}, 4, 8\)"):
            f(q, k, v)
    torch._dynamo.reset()


# ---- real ranks (gloo) -----------------------------------------------------------------------------------------------
GLOO = [
    dict(B=2, S=13, H=5, H_kv=1, D=8, J=3, scale=0.3),
    dict(B=1, S=11, H=6, H_kv=3, D=8, causal=True, scale=1.3),
    dict(B=2, S=9, H=6, H_kv=2, D=8, J=2, rows="uneven"),
]


def _rank_grads(pb: Problem, rank, group, impl, need=(True,) * 6, loss="weights", reps=1):
    ins = [pb.shard(x, rank).requires_grad_(need[i]) for i, x in enumerate(pb.full)]
    jins = [j.float().requires_grad_(need[3 + i]) for i, j in enumerate(pb.joint)] if pb.J else None
    res = ulysses_attention(*ins, group=group, impl=impl, joint=tuple(jins) if pb.J else None, **pb.kwargs())
    out, jout = res if pb.J else (res, None)
    if loss == "sum":
        total = out.sum() + (jout.sum() if pb.J else 0)
    elif loss == "rank 0 only" and rank:
        total = (0 * out).sum() + ((0 * jout).sum() if pb.J else 0)  # backpropagates, as every rank must
    else:
        total = (out * pb.shard(pb.dout, rank)).sum() + ((jout * pb.djouts[rank].float()).sum() if pb.J else 0)
    for i in range(reps):
        total.backward(retain_graph=i + 1 < reps)
    return [t.grad for t in ins], ([t.grad for t in jins] if pb.J else [])


def _check_real(pb, rank, group, grads, ref, what, need=(True,) * 6, scale=1.0):
    shard, joint = grads
    pb.check_rank(rank, shard, ref, what, scale=scale, need=need[:3])
    for i, gj in enumerate(joint):
        if not need[3 + i]:
            assert gj is None, (what, "joint", i)
            continue
        total = gj.clone()
        dist.all_reduce(total, group=group)
        assert_close(total, scale * ref[3 + i], (what, rank, "joint summed over the ranks", i))


def _chain(x, w, group, impl):
    """Two calls, the second on the first's output (as q, k and v): a two-layer model."""
    o1 = ulysses_attention(x @ w[0], x @ w[1], x, group=group, impl=impl, softmax_scale=0.4)
    return ulysses_attention(o1, 0.5 * o1, o1.tanh(), group=group, impl=impl)


def _gloo_gradients(rank, P):
    group = dist.group.WORLD
    for i, case in enumerate(GLOO):
        case = dict(case)
        if case.get("rows") == "uneven":
            case["rows"] = [9, 0] if P == 2 else [0, 7, 2]
        pb = Problem(P=P, seed=20 + i, **case)
        ref = pb.oracle()
        got = {impl: _rank_grads(pb, rank, group, impl) for impl in ("reference", "nccl")}
        for a, b in zip(got["reference"][0] + got["reference"][1], got["nccl"][0] + got["nccl"][1]):
            assert torch.equal(a, b), (case, rank, "nccl and reference differ")
        _check_real(pb, rank, group, got["nccl"], ref, ("gloo", P, case))

    pb = Problem(P=P, B=1, S=10, H=4, H_kv=2, D=8, J=2, seed=30)
    ref = pb.oracle()
    for need in ((False, False, False, True, True, True), (False, False, True, False, True, False)):
        _check_real(pb, rank, group, _rank_grads(pb, rank, group, "nccl", need), ref, ("partial", need), need)
    _check_real(pb, rank, group, _rank_grads(pb, rank, group, "reference", reps=2), ref, "retain_graph", scale=2.0)
    dout = pb.dout.clone()
    dout[:, pb.layout.shard_rows[0]:] = 0
    ref0 = pb.oracle(dout, [pb.djouts[0]] + [torch.zeros_like(d) for d in pb.djouts[1:]])
    _check_real(pb, rank, group, _rank_grads(pb, rank, group, "nccl", loss="rank 0 only"), ref0, "rank 0's loss only")
    pb = Problem(P=P, B=1, S=3 * P - 1, H=4, H_kv=2, D=8, J=2, seed=31)
    ref1 = pb.oracle(torch.ones_like(pb.dout), [torch.ones_like(d) for d in pb.djouts])
    _check_real(pb, rank, group, _rank_grads(pb, rank, group, "reference", loss="sum"), ref1, "out.sum()")

    # a two-layer chain, plain and under activation checkpointing (the forward's collectives run again
    # inside the backward), against the fp64 chain; the weights' grads summed over the ranks
    g = torch.Generator().manual_seed(32)
    B, S, H, D = 1, 4 * P, 4, 8
    x = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    w = [torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(2)]
    dout = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    x64, w64 = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in w]
    o1 = fp64_attention(x64 @ w64[0], x64 @ w64[1], x64, scale=0.4)
    (fp64_attention(o1, 0.5 * o1, o1.tanh()) * dout).sum().backward()
    rows = slice(rank * 4, rank * 4 + 4)
    for mode in ("plain", "checkpoint", "reentrant checkpoint"):
        xs, ws = x[:, rows].float().requires_grad_(), [t.float().requires_grad_() for t in w]
        if mode == "plain":
            out = _chain(xs, ws, group, "nccl")
        else:
            out = checkpoint(_chain, xs, ws, group, "reference", use_reentrant=mode.startswith("reentrant"))
        (out * dout[:, rows].float()).sum().backward()
        assert_close(xs.grad, x64.grad[:, rows], (mode, rank, "x"))
        for i, (a, b) in enumerate(zip(ws, w64)):
            total = a.grad.clone()
            dist.all_reduce(total, group=group)
            assert_close(total, b.grad, (mode, rank, "w", i))


def test_gloo_ranks_gradients_p2():
    run_gloo_case(_gloo_gradients, 2, deadline_s=90)


def test_gloo_ranks_gradients_p3():
    run_gloo_case(_gloo_gradients, 3, deadline_s=90)


def _gloo_out_proj_and_backend(rank, P):
    """The output projection (weight and bias grads: this rank's rows' part, summed over the ranks) with seq_len
    padding and GQA; the diffusers backend's Ulysses route with ulysses_anything's uneven shards (tensor_split)."""
    from fa_a2a.models import diffusers_backend as backend

    group = dist.group.WORLD
    pb = Problem(P=P, B=2, S=3 * P - 1, H=5, H_kv=1, D=8, scale=0.7, seed=40)
    w64 = torch.randn(12, 5 * 8, generator=torch.Generator().manual_seed(41), dtype=torch.float64) / 6
    b64 = torch.randn(12, generator=torch.Generator().manual_seed(42), dtype=torch.float64)
    dy = torch.randn(2, pb.S, 12, generator=torch.Generator().manual_seed(43), dtype=torch.float64)
    ins = [pb.shard(x, rank).requires_grad_() for x in pb.full]
    w, b = w64.float().requires_grad_(), b64.float().requires_grad_()
    first, n = pb.span(rank)
    dys = torch.zeros(2, pb.layout.seq_loc, 12)
    dys[:, :n] = dy[:, first:first + n].float()  # zero dY on padding rows (there y = b)
    y = ulysses_attention_out_proj(*ins, w, b, group=group, impl="nccl", **pb.kwargs())
    (y * dys).sum().backward()
    x64 = [x.clone().requires_grad_() for x in pb.full]
    wr, br = w64.clone().requires_grad_(), b64.clone().requires_grad_()
    o = fp64_attention(*x64, scale=0.7)
    (torch.nn.functional.linear(o.flatten(2), wr, br) * dy).sum().backward()
    pb.check_rank(rank, [t.grad for t in ins], [t.grad for t in x64], "out_proj")
    for got, want, name in ((w.grad, wr.grad, "weight"), (b.grad, br.grad, "bias")):
        total = got.clone()
        dist.all_reduce(total, group=group)
        assert_close(total, want, ("out_proj", rank, name))

    mesh = types.SimpleNamespace(get_group=lambda: group)
    cp = types.SimpleNamespace(ulysses_degree=P, ring_degree=1, ulysses_anything=True, ring_anything=False,
                               _ulysses_mesh=mesh, _flattened_mesh=mesh)
    g = torch.Generator().manual_seed(44)
    S = 3 * P + 1
    full = [torch.randn(2, S, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    dout = torch.randn(2, S, 4, 8, generator=g, dtype=torch.float64)
    parts = [t.tensor_split(P, 1) for t in full + [dout]]
    first = sum(p.shape[1] for p in parts[0][:rank])
    q, k, v = (p[rank].float().requires_grad_() for p in parts[:3])
    out = backend._attention("fa_a2a_third_pass", "reference", q, k, v, None, 0.0, False, 0.5, True, False,
                             types.SimpleNamespace(context_parallel_config=cp))
    (out * parts[3][rank].float()).sum().backward()
    assert backend.route_counts("fa_a2a_third_pass")["ulysses"] == 1
    x64 = [t.clone().requires_grad_() for t in full]
    (fp64_attention(*x64, scale=0.5) * dout).sum().backward()
    for t, r, name in zip((q, k, v), x64, "qkv"):
        assert_close(t.grad, r.grad[:, first:first + t.shape[1]], ("backend ulysses_anything", rank, name))


def test_gloo_out_proj_and_diffusers_backend_gradients():
    pytest.importorskip("diffusers")
    run_gloo_case(_gloo_out_proj_and_backend, 3, deadline_s=90)


def _skipped_backward(rank, P):
    """Rank 1 never runs the backward of a call that required grad (its loss did not reach the output):
    rank 0's backward must end in a TimeoutError naming the missing rank, not hang."""
    os.environ["FA_A2A_TIMEOUT_S"] = "3"
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    out = ulysses_attention(q, q.detach(), q.detach(), impl="reference")
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not reach"):
            out.sum().backward()
        assert time.monotonic() - start < 20


def test_a_rank_that_skips_the_backward_makes_the_others_time_out():
    run_gloo_case(_skipped_backward, 2, deadline_s=40)
