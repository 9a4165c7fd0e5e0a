"""Gradients through the op on one SM90 GPU (fa_a2a.engine.backward): FA4's backward on the ranks' heads.

Rule (FA4's): every grad's max error against the fp64 oracle (autograd through the full attention
on the unsplit sequence) <= 2x the error of FA4's own backward on the unsplit problem
(flash_attn.cute.flash_attn_func, bf16, joint rows appended) + 1e-3. Checked for impl "serial"
and "fused" on emulated ranks (P = 2, 3, 4, 8: seq_len padding, joint, causal, GQA with KV heads
repeated within a rank and across ranks, uneven shards), P = 1, and 2 rank processes sharing the
GPU (VMM windows; the serial backward's exchanges over their gloo group). Under
torch.use_deterministic_algorithms (FA4's deterministic backward) "fused" and "serial" give the
same gradients bit for bit, real ranks the emulated ranks' bits; the output of a call with grad
equals the no-grad call's. Padding rows get zero grads; joint grads summed over the ranks match.
impl "fused" with suffix padding takes the fused backward (cute_kernels.
fa4_bwd_a2a: dq, dk, dv stored into the owners' windows by FA4's backward kernels, dO's pre-A2A kernel
before it, no torch.distributed collective): checked to run there (and nowhere else) and to equal the
serial backward bit for bit also with every window it reads NaN-poisoned first (an unwritten tile
shows), emulated P = 2, 3, 4, 8 (D 64 and 128, GQA through FA4's accumulators and through the fp32 head
sums, seq_len padding, causal, joint rows, B = 2) and 2 real ranks under MPS; with uneven shards it
falls back to the exchanges and still equals serial.
The cases share FA4's compiles (forward with LSE and backward per D, GQA ratio, causal, seqused_k).

    python -m pytest -q tests/gpu/test_backward_gpu.py
"""

import pytest
import torch
import torch.distributed as dist

from fa_a2a.engine import backward as fab
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated
from ulysses.layout import UlyssesLayout, split_seq
from ulysses.reference import full_attention

from tests.helpers import deterministic, poison_allocated
from tests.multiproc import run_on_gloo_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an SM90 GPU (FA4's SM90 backward)")

DTYPE = torch.bfloat16
# (P, B, S, H, H_kv, D, J, causal, shard_rows)
CASES = [
    (2, 1, 999, 4, 4, 128, 77, False, None),  # seq_len padding (S_loc 500), joint
    (3, 1, 768, 6, 2, 64, 0, True, None),  # causal, GQA: ranks read KV heads (0, 0), (0, 1), (1, 1)
    (4, 2, 1024, 8, 2, 128, 64, False, [300, 260, 256, 208]),  # uneven shards, joint, KV heads across ranks
    (8, 1, 1024, 24, 24, 128, 64, False, None),  # Flux's 24 heads, joint
]


def layout(case):
    P, B, S, H, H_kv, D, J, causal, rows = case
    return UlyssesLayout(S, H, H_kv, P, J) if rows is None else UlyssesLayout.from_shard_rows(rows, H, H_kv, P,
                                                                                            joint_len=J)


def make(case, seed):
    """fp64 full q, k, v, joint; bf16 shards (padding rows poisoned, a NaN included), per-rank dO
    (padding rows poisoned) and joint dO."""
    P, B, S, H, H_kv, D, J, causal, rows = case
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(DTYPE).double()

    lay = layout(case)
    full = [randn(B, S, h, D) for h in (H, H_kv, H_kv)]
    joint = [randn(B, J, h, D) for h in (H, H_kv, H_kv)] if J else None

    def shards(x):
        parts = split_seq(x, P) if rows is None else list(x.split(rows, dim=1))
        out = []
        for r, t in enumerate(parts):
            t = t.clone()
            n = lay.valid_rows(r)
            if n < t.shape[1]:
                t[:, n:] = 100 * randn(*t[:, n:].shape)
                t[:, n:, :1, :1] = float("nan")
            out.append(t.to(DTYPE))
        return out

    douts = shards(randn(B, S, H, D))
    djouts = [randn(B, J, H, D).to(DTYPE) for _ in range(P)] if J else None
    return full, joint, [shards(x) for x in full], douts, djouts


def upstream(case, douts, djouts):
    """The full problem's dO (valid rows) and joint dO (the ranks' sum, rounded to bf16 as the op's)."""
    lay = layout(case)
    dout = torch.cat([d[:, :lay.valid_rows(r)] for r, d in enumerate(douts)], dim=1)
    djout = torch.stack(djouts).float().sum(0).to(DTYPE) if djouts else None
    return dout, djout


def oracle(case, full, joint, douts, djouts):
    """fp64 autograd through the full attention -> [dq, dk, dv, (djq, djk, djv)]."""
    causal = case[7]
    dout, djout = upstream(case, douts, djouts)
    ins = [x.clone().requires_grad_() for x in full]
    jins = [x.clone().requires_grad_() for x in joint] if joint else []
    res = full_attention(*ins, joint=tuple(jins) if jins else None, causal=causal)
    if jins:
        return torch.autograd.grad(res, ins + jins, (dout.double(), djout.double()))
    return torch.autograd.grad(res, ins, dout.double())


def fa4_baseline(case, full, joint, douts, djouts):
    """FA4's own forward + backward on the unsplit bf16 problem (joint rows appended)."""
    from flash_attn.cute import flash_attn_func

    causal = case[7]
    dout, djout = upstream(case, douts, djouts)
    ins = [x.to(DTYPE).requires_grad_() for x in full]
    jins = [x.to(DTYPE).requires_grad_() for x in joint] if joint else []
    q, k, v = (torch.cat([x, j], dim=1) if jins else x for x, j in zip(ins, jins or [None] * 3))
    out = flash_attn_func(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    grad_out = torch.cat([dout, djout], dim=1) if jins else dout
    return torch.autograd.grad(out, ins + jins, grad_out)


def check(got, ref, base, what):
    assert torch.isfinite(got).all(), what
    if got.numel() == 0:
        return
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + 1e-3, (what, err, base_err)


def check_rank(case, r, grads, ref, base, what):
    lay = layout(case)
    first, n = sum(lay.shard_rows[:r]), lay.valid_rows(r)
    for i, name in enumerate(("dq", "dk", "dv")):
        check(grads[i][:, :n], ref[i][:, first:first + n], base[i][:, first:first + n], (what, r, name))
        assert (grads[i][:, n:] == 0).all(), (what, r, name, "padding rows must get zero grads")


def emulated_grads(case, impl, shards, joint, douts, djouts):
    """-> (outputs, [per-rank (dq, dk, dv)], joint grads or None) of an emulated call with grad."""
    P, B, S, H, H_kv, D, J, causal, rows = case
    qs, ks, vs = ([t.clone().requires_grad_() for t in xs] for xs in shards)
    jins = [j.to(DTYPE).requires_grad_() for j in joint] if joint else []
    kw = dict(shard_rows=rows) if rows else dict(seq_len=S)
    res = ulysses_attention_emulated(qs, ks, vs, impl=impl, joint=tuple(jins) if jins else None, causal=causal,
                                     **kw)
    outs = [*res[0], *res[1]] if jins else list(res)
    got = torch.autograd.grad(outs, [*qs, *ks, *vs, *jins], [*douts, *(djouts or ())])
    with torch.no_grad():
        plain = ulysses_attention_emulated(qs, ks, vs, impl=impl, joint=tuple(jins) if jins else None,
                                           causal=causal, **kw)
    for a, b in zip(outs, [*plain[0], *plain[1]] if jins else plain):
        assert torch.equal(a.detach(), b), (case, impl, "the output with grad differs from the no-grad call's")
    per_rank = [(got[r], got[P + r], got[2 * P + r]) for r in range(P)]
    return outs, per_rank, (got[3 * P:] if jins else None)


def takes_fused_backward(case) -> bool:
    """Whether impl "fused" takes the fused backward on this case (suffix padding)."""
    return layout(case).is_suffix_padded


@pytest.fixture
def fused_calls(monkeypatch):
    """The specs of the fused backwards that ran (fa_a2a.engine.backward._fused_backward)."""
    calls, inner = [], fab._fused_backward
    monkeypatch.setattr(fab, "_fused_backward", lambda spec, *a: calls.append(spec) or inner(spec, *a))
    return calls


@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_gradients_within_fa4_rule_and_fused_equals_serial(case, fused_calls):
    full, joint, shards, douts, djouts = make(case, seed=sum(case[:6]))
    ref = oracle(case, full, joint, douts, djouts)
    base = fa4_baseline(case, full, joint, douts, djouts)
    results = {}
    with deterministic():
        for impl in ("serial", "fused"):
            results[impl] = emulated_grads(case, impl, shards, joint, douts, djouts)
            # serial never, fused where it applies (else the exchanges: joint rows, uneven shards)
            assert len(fused_calls) == (impl == "fused" and takes_fused_backward(case)), (case, impl)
    for impl, (_, per_rank, jgrads) in results.items():
        for r, grads in enumerate(per_rank):
            check_rank(case, r, grads, ref, base, impl)
        for i, g in enumerate(jgrads or ()):
            check(g, ref[3 + i], base[3 + i], (impl, "joint", i))
    serial, fused = ([*per_rank, jgrads or ()] for _, per_rank, jgrads in (results["serial"], results["fused"]))
    for a, b in zip(serial, fused):
        for x, y in zip(a, b):
            assert torch.equal(x, y), (case, "fused and serial gradients differ")


def test_one_rank_gradients():
    case = (1, 1, 1024, 24, 24, 128, 64, False, None)
    full, joint, shards, douts, djouts = make(case, seed=11)
    ins = [s[0].clone().requires_grad_() for s in shards]
    jins = [j.to(DTYPE).requires_grad_() for j in joint]
    out, jout = ulysses_attention(*ins, impl="serial", joint=tuple(jins))
    got = torch.autograd.grad((out, jout), ins + jins, (douts[0], djouts[0]))
    ref = oracle(case, full, joint, douts, djouts)
    base = fa4_baseline(case, full, joint, douts, djouts)
    check_rank(case, 0, got, ref, base, "P = 1")
    for i in range(3):
        check(got[3 + i], ref[3 + i], base[3 + i], ("P = 1 joint", i))


def _real_ranks(P, group, rank):
    """Each rank's grads equal the emulated ranks' bit for bit (the emulated ones are checked against
    the oracle above); the joint grads summed over the ranks equal the emulated run's."""
    case = CASES[0]
    _, joint, shards, douts, djouts = make(case, seed=sum(case[:6]))
    with deterministic():
        _, emulated, ejoint = emulated_grads(case, "serial", shards, joint, douts, djouts)
        for impl in ("serial", "fused"):
            ins = [s[rank].clone().requires_grad_() for s in shards]
            jins = [j.to(DTYPE).requires_grad_() for j in joint]
            out, jout = ulysses_attention(*ins, group=group, impl=impl, joint=tuple(jins), seq_len=case[2])
            got = torch.autograd.grad((out, jout), ins + jins, (douts[rank], djouts[rank]))
            for x, y in zip(got[:3], emulated[rank]):
                assert torch.equal(x, y), (impl, rank, "real ranks differ from emulated ranks")
            lay = layout(case)
            mine = set(lay.q_head_index[rank])
            assert all((got[3][:, :, h] == 0).all() for h in range(case[3]) if h not in mine)
            for i in range(3):
                total = got[3 + i].float()
                dist.all_reduce(total, group=group)
                assert torch.equal(total.to(DTYPE), ejoint[i]), (impl, rank, "joint", i)


def test_real_ranks_gradients():
    run_on_gloo_groups(_real_ranks, (2,), cuda=True, timeout_s=120)


# ---- the fused backward (impl "fused": fa_a2a.engine.backward.fused_backward_applies) -------------------
# suffix padding: FA4's backward kernels store dq, dk, dv into the owners' windows (joint rows: on the rank)
FUSED_CASES = [
    (2, 1, 999, 4, 4, 128, 0, False, None),  # seq_len padding: S_loc 500, keys masked (per-thread dK/dV stores)
    (2, 1, 1024, 4, 2, 64, 0, True, None),  # causal, GQA (dK, dV through FA4's accumulators), S_loc 512 (TMA)
    (3, 1, 768, 6, 2, 64, 0, True, None),  # causal, KV heads (0, 0), (0, 1), (1, 1): summed over the ranks
    (4, 2, 1000, 8, 2, 128, 0, False, [250, 250, 250, 250]),  # B 2, rows given (the ceil split), GQA
    (4, 1, 768, 12, 6, 128, 0, True, None),  # a rank reads a KV head twice (fp32 head sums)
    (8, 1, 1024, 24, 24, 128, 0, False, None),  # Flux's 24 heads, S_loc 128 (TMA)
    (8, 1, 1999, 16, 8, 64, 0, False, None),  # GQA, S_loc 250 with a padding row
    (2, 1, 999, 4, 4, 128, 77, False, None),  # joint rows, seq_len padding (keys: sequence, joint, padding)
    (4, 1, 1000, 8, 2, 64, 33, False, None),  # joint rows, GQA (the postprocesses route them)
    (8, 1, 1024, 24, 24, 128, 64, False, None),  # Flux's 24 heads with 64 joint rows, S_loc 128
]


def poison_windows(case):
    """NaN into every window the emulated fused backward reads: dO's (the forward's q in-windows) and
    the gradients' (each allocated here if the backward has not yet)."""
    from fa_a2a.engine import forward

    P, B, S, H, H_kv, D = case[:6]
    lay = layout(case)
    transport = forward.emulated_transport(P, torch.device("cuda", torch.cuda.current_device()))
    forward.window_plan(transport, lay, B, D, DTYPE)
    for name, heads in (("dq", lay.heads_pad), ("dk", P * lay.kv_heads_loc), ("dv", P * lay.kv_heads_loc)):
        transport.windows(f"ulysses.{name}", (B, lay.seq_loc, heads, D), DTYPE)
    if lay.joint_len:
        transport.windows("ulysses.djout", (P, B, lay.joint_len, lay.heads_loc, D), DTYPE)
    poison_allocated(transport)  # and every set allocated so far (the grads' sets 1..: emulated ranks lend)


def fused_grads_poisoned(case, shards, joint, douts, djouts):
    """The fused call's forward, every window poisoned, then its backward -> (per-rank (dq, dk, dv), the
    joint grads or None)."""
    P, B, S, H, H_kv, D, J, causal, rows = case
    qs, ks, vs = ([t.clone().requires_grad_() for t in xs] for xs in shards)
    jins = [j.to(DTYPE).requires_grad_() for j in joint] if joint else []
    kw = dict(shard_rows=rows) if rows else dict(seq_len=S)
    res = ulysses_attention_emulated(qs, ks, vs, impl="fused", causal=causal, joint=tuple(jins) or None, **kw)
    outs = [*res[0], *res[1]] if jins else res
    poison_windows(case)
    got = torch.autograd.grad(outs, [*qs, *ks, *vs, *jins], [*douts, *(djouts or ())])
    return [(got[r], got[P + r], got[2 * P + r]) for r in range(P)], (got[3 * P:] if jins else None)


@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_emulated_fused_backward_equals_serial_bit_for_bit(case, fused_calls):
    full, joint, shards, douts, djouts = make(case, seed=sum(case[:6]))
    assert takes_fused_backward(case)
    with deterministic():
        _, serial, serial_joint = emulated_grads(case, "serial", shards, joint, douts, djouts)
        assert not fused_calls
        _, fused, fused_joint = emulated_grads(case, "fused", shards, joint, douts, djouts)
        assert len(fused_calls) == 1 and fused_calls[0].fused
        poisoned, poisoned_joint = fused_grads_poisoned(case, shards, joint, douts, djouts)
        assert len(fused_calls) == 2
    ref = oracle(case, full, joint, douts, djouts)
    base = fa4_baseline(case, full, joint, douts, djouts)
    for r in range(case[0]):
        check_rank(case, r, fused[r], ref, base, "fused backward")
        for name, a, b, c in zip(("dq", "dk", "dv"), serial[r], fused[r], poisoned[r]):
            assert torch.equal(a, b), (case, r, name, "fused backward differs from serial")
            assert torch.equal(a, c), (case, r, name, "fused backward over poisoned windows differs: unwritten rows")
    for i, (a, b, c) in enumerate(zip(serial_joint or (), fused_joint or (), poisoned_joint or ())):
        check(b, ref[3 + i], base[3 + i], ("fused backward", "joint", i))
        assert torch.equal(a, b) and torch.equal(a, c), (case, "joint", i, "fused joint grads differ from serial")


def test_fused_backward_without_deterministic_mode_is_close():
    """FA4's default mode: dQ (and GQA's dK, dV) summed by reduce-adds in any order, in the fused
    backward as in FA4's own: within the FA4 rule, not bit-compared."""
    case = FUSED_CASES[1]
    full, joint, shards, douts, djouts = make(case, seed=5)
    _, fused, _ = emulated_grads(case, "fused", shards, joint, douts, djouts)
    ref = oracle(case, full, joint, douts, djouts)
    base = fa4_baseline(case, full, joint, douts, djouts)
    for r in range(case[0]):
        check_rank(case, r, fused[r], ref, base, "fused backward (FA4's default mode)")


def _real_ranks_fused(P, group, rank):
    """Real ranks (VMM windows, MPS): impl "fused" takes the fused backward with no all_to_all_single
    over the (gloo) group; its grads equal the emulated ranks' serial ones and the real serial ones, also
    those of a call whose grads stay alive through a second fused call (lent out of their gradient set, which
    the second call must not take: forward.Slots)."""
    calls = {"a2a": 0, "fused": 0}
    real_a2a, real_fused = dist.all_to_all_single, fab._fused_backward

    def a2a(*args, **kwargs):
        calls["a2a"] += 1
        return real_a2a(*args, **kwargs)

    def fused(*args):
        calls["fused"] += 1
        return real_fused(*args)

    dist.all_to_all_single, fab._fused_backward = a2a, fused
    try:
        for case in (c for c in FUSED_CASES if c[0] == P):
            _, joint, shards, douts, djouts = make(case, seed=sum(case[:6]))
            kw = dict(shard_rows=case[8]) if case[8] else dict(seq_len=case[2])
            with deterministic():
                _, emulated, ejoint = emulated_grads(case, "serial", shards, joint, douts, djouts)
                got = {}
                for impl in ("fused", "fused again", "serial"):
                    before = dict(calls)
                    ins = [s[rank].clone().requires_grad_() for s in shards]
                    jins = [j.to(DTYPE).requires_grad_() for j in joint] if joint else []
                    out = ulysses_attention(*ins, group=group, impl=impl.split()[0], causal=case[7],
                                            joint=tuple(jins) or None, **kw)
                    grad_out = (douts[rank], djouts[rank]) if jins else douts[rank]
                    got[impl] = torch.autograd.grad(out, ins + jins, grad_out)
                    if impl != "serial":
                        assert calls == {"a2a": before["a2a"], "fused": before["fused"] + 1}, (case, calls)
                        for i in range(3, len(got[impl])):  # the joint grads: this rank's heads, summed over ranks
                            total = got[impl][i].float()
                            dist.all_reduce(total, group=group)
                            assert torch.equal(total.to(DTYPE), ejoint[i - 3]), (case, rank, "joint", i - 3)
                        for x, y in zip(got[impl][:3], emulated[rank]):
                            assert torch.equal(x, y), (case, rank, "fused real ranks differ from emulated serial")
                        for x, y in zip(got["fused"][:3], emulated[rank]):
                            assert torch.equal(x, y), (case, rank, impl, "the first call's grads changed")
                    else:
                        assert calls["fused"] == before["fused"] and calls["a2a"] > before["a2a"], (case, calls)
                for x, y in zip(got["fused"], got["serial"]):
                    assert torch.equal(x, y), (case, rank, "fused and serial backward differ on real ranks")
    finally:
        dist.all_to_all_single, fab._fused_backward = real_a2a, real_fused


def test_real_ranks_fused_backward():
    run_on_gloo_groups(_real_ranks_fused, (2, 4), cuda=True, timeout_s=300)


@pytest.mark.parametrize("impl", ["serial", "fused"])
def test_forward_and_backward_replay_in_a_cuda_graph(impl):
    """The emulated op's forward + backward captured in one CUDA graph (after eager warm-up calls, as
    the benchmark does) replays the eager gradients bit for bit (deterministic mode): no host-to-device
    copy or host sync inside (index tensors are built once per device: ulysses.layout.index_tensor)."""
    P, B, S, H, D = 2, 1, 1024, 8, 128
    g = torch.Generator(device="cuda").manual_seed(31)
    shards = [[torch.randn(B, S // P, H, D, device="cuda", generator=g).to(DTYPE).requires_grad_()
               for _ in range(P)] for _ in range(3)]
    douts = [torch.randn(B, S // P, H, D, device="cuda", generator=g).to(DTYPE) for _ in range(P)]

    def step():
        for t in (x for xs in shards for x in xs):
            t.grad = None
        outs = ulysses_attention_emulated(*shards, impl=impl)
        torch.autograd.backward(outs, douts)
        return [x.grad for xs in shards for x in xs]

    with deterministic():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            want = [t.clone() for t in step()]
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step()
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_block_with_grad_is_the_chain_then_the_op():
    """The attention block with hidden states that require grad (fa_a2a.block._attention_with_grad), emulated
    P = 2, impl fused and serial: outputs and grads bit for bit the torch chain of its weights followed
    by the op (deterministic mode), and the output close to the fused block's without grad."""
    from fa_a2a import block

    P, S_loc, H, D = 2, 256, 4, 128
    C = H * D
    g = torch.Generator(device="cuda").manual_seed(41)
    chain = block.TorchQKV((torch.randn(3 * C, C, device="cuda", generator=g) / C ** 0.5).to(DTYPE),
                           (0.1 * torch.randn(3 * C, device="cuda", generator=g)).to(DTYPE),
                           torch.ones(D, device="cuda"), torch.ones(D, device="cuda"), H, H, D)
    proj = block.block_weights(chain, P)
    rot = [block.rotary_pair(torch.arange(r * S_loc, (r + 1) * S_loc, device="cuda"), D) for r in range(P)]
    base = [torch.randn(1, S_loc, C, device="cuda", generator=g).to(DTYPE) for _ in range(P)]
    douts = [torch.randn(1, S_loc, H, D, device="cuda", generator=g).to(DTYPE) for _ in range(P)]
    with torch.no_grad():
        fused = block.ulysses_qkv_attention_emulated(base, proj, rotary=rot, impl="fused")
    with deterministic():
        for impl in ("fused", "serial"):
            xs = [x.clone().requires_grad_() for x in base]
            outs = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot, impl=impl)
            torch.autograd.backward(outs, douts)
            xw = [x.clone().requires_grad_() for x in base]
            qkv = [chain(x, block.rope_table(r, S_loc, D, "cuda")) for x, r in zip(xw, rot)]
            want = ulysses_attention_emulated(*([t[i] for t in qkv] for i in range(3)), impl=impl)
            torch.autograd.backward(want, douts)
            for r in range(P):
                assert torch.equal(outs[r], want[r]) and torch.equal(xs[r].grad, xw[r].grad), (impl, r)
                assert (outs[r].float() - fused[r].float()).abs().max() < 0.05, (impl, r)


def _compiled_module_on_group(P, group, rank):
    from fa_a2a import UlyssesAttention

    torch.use_deterministic_algorithms(True, warn_only=True)  # (a spawned process: set here)
    B, S_loc, H, D = 1, 512, 8, 128
    g = torch.Generator(device="cuda").manual_seed(50 + rank)
    ins = [torch.randn(B, S_loc, H, D, device="cuda", generator=g).to(DTYPE) for _ in range(3)]
    dout = torch.randn(B, S_loc, H, D, device="cuda", generator=g).to(DTYPE)
    for impl in ("fused", "serial"):
        mod = UlyssesAttention(group=group, impl=impl)
        grads = []
        for fn in (mod, torch.compile(mod, fullgraph=True)):
            xs = [t.clone().requires_grad_() for t in ins]
            out = fn(*xs)
            out.backward(dout)
            grads.append([out.detach()] + [x.grad for x in xs])
        for a, b in zip(*grads):
            assert torch.equal(a, b), impl


def test_torch_compile_fullgraph_module_forward_and_backward():
    """UlyssesAttention under torch.compile(fullgraph=True) (the functional op and its registered
    backward; inductor around them), 2 rank processes sharing the GPU: output and grads equal the eager
    module's bit for bit, impl fused and serial, under deterministic mode."""
    from ulysses.transport import close_transports

    run_on_gloo_groups(_compiled_module_on_group, (2,), cuda=True, timeout_s=600, teardown=close_transports)
