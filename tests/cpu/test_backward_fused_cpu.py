"""The fused backward's routing and data movement on CPU (fa_a2a.engine.backward, impl "fused").

Routing: fused_backward_applies (impl "fused" decided, several ranks, CUDA SM90, bf16/fp16, D 64/128,
suffix padding) and what each call then runs. Data movement: the kernels are stood in
for by torch code that does what their docstrings say (cute_kernels.a2a's pre-A2A: dO rows of rank r to
window d at rows r * S_loc + s, padding heads zero; cute_kernels.fa4_bwd_a2a: FA4's backward, here the
reference backward as the stand-in of FA4's, with its dq, dk, dv rows stored into the owners' windows,
dk, dv rows >= seqused_k left unwritten; joint query and key rows into the rank's own joint tensors),
over an emulated transport on CPU whose barriers are recorded (or, for real ranks, threads meeting in a
threading.Barrier). The windows are NaN-poisoned first, so a
row read that no kernel wrote, or a padding row not zeroed, shows. The serial impl's backward (the
exchanges around the same stand-in of FA4's backward) is the reference: equal bit for bit.
"""

import dataclasses
import math
import threading

import pytest
import torch

import cute_kernels.a2a as a2a
from cute_kernels.limits import aligned16
from fa_a2a.engine import backward as fab, forward
from fa_a2a.engine.problem import Problem
from tests.helpers import poison_allocated
from ulysses.layout import UlyssesLayout, split_seq
from ulysses.reference import local_attention as reference_attention
from ulysses.reference import local_attention_backward as reference_attention_backward
from ulysses.transport import EmulatedTransport

DTYPE = torch.bfloat16
D = 64


def layout(P, S, H, H_kv, J=0, rows=None):
    return UlyssesLayout(S, H, H_kv, P, J) if rows is None else UlyssesLayout.from_shard_rows(rows, H, H_kv, P,
                                                                                            joint_len=J)


def problem(impl, P, B, S, H, H_kv, J=0, causal=False, rows=None, dtype=DTYPE, head_dim=D, device_type="cuda"):
    """The Problem check_call would build for CUDA tensors of these shapes (the CPU tensors stand in)."""
    lay = layout(P, S, H, H_kv, J, rows)
    return Problem(impl, B, lay.seq_loc, H, H_kv, head_dim, dtype, device_type, J, causal, None,
                   None if rows is not None else S, None if rows is None else tuple(rows), P, None, lay,
                   "st" if impl == "fused" else None)


# ---- stand-ins of the kernels -----------------------------------------------------------------------
def fake_fa4_bwd(q, k, v, out, dout, lse, softmax_scale, causal, seqused_k=None, deterministic=False, **kw):
    """flash_attn.cute.interface._flash_attn_bwd's stand-in: the reference backward; rows >= seqused_k of
    dk, dv NaN (FA4 leaves them unwritten: the callers zero them)."""
    used = None if seqused_k is None else int(seqused_k[0])
    dq, dk, dv = reference_attention_backward(q, k, v, dout, causal=causal, softmax_scale=softmax_scale,
                                              seqused_k=used)
    if used is not None:
        dk[:, used:] = float("nan")
        dv[:, used:] = float("nan")
    return dq, dk, dv


class Kernels:
    """The stand-ins and what they saw: events (in order), the transports (per P)."""

    def __init__(self):
        self.events, self.transports, self.dkv_stores = [], {}, []

    def transport(self, P, device="cpu"):
        if P not in self.transports:
            t = EmulatedTransport(P, device="cpu")
            t.barrier = lambda: self.events.append("barrier")
            t.host_barrier = lambda *a, **kw: self.events.append("host barrier")
            self.transports[P] = t
        return self.transports[P]

    def pre_a2a_launcher(self, dq, dk, dv, q_map, kv_map, rank, seq_len, key_rows, has_joint):
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            a2a._aligned(t, name)  # the real launcher's checks
        assert dk.shape[3] == dv.shape[3] == kv_map.numel() == 0, "dO's pre-A2A moves q heads only"
        assert not has_joint
        self.events.append(("bind pre", rank))

        def launch(q, k, v, joint=None):
            assert joint is None and aligned16(q)
            self.events.append(("pre", rank))
            P, B, N, h, _ = dq.shape
            S_loc = q.shape[1]
            for d in range(P):
                for j in range(h):
                    src = int(q_map[d * h + j])
                    dq[d, :, rank * S_loc:(rank + 1) * S_loc, j] = q[:, :, src] if src >= 0 else 0

        return launch

    def bwd_a2a_launcher(self, q, k, v, out, dout, lse, dq_w, dk_w, dv_w, rank, *, causal=False, softmax_scale=None,
                         seqused_k=None, deterministic=False, dkv_store=None, joint=None):
        B, N, h, _ = q.shape
        hk = k.shape[2]
        P, _, S_loc = dq_w.shape[:3]
        J = 0 if joint is None else joint[0].shape[1]
        self.dkv_stores.append(dkv_store)
        assert N == P * S_loc + J and dq_w.shape[3] == P * h and dk_w.shape[3] == dv_w.shape[3] == P * hk
        if joint is not None:
            assert [tuple(t.shape) for t in joint] == [(B, J, h, D), (B, J, hk, D), (B, J, hk, D)]
        for t in (q, k, v, out, dout):
            assert t.is_contiguous() and t.shape[1] == N
        assert tuple(dout.shape) == tuple(q.shape) and tuple(lse.shape) == (B, h, N)
        self.events.append(("build", rank, causal, deterministic, None if seqused_k is None else int(seqused_k[0])))

        def launch():
            self.events.append(("launch", rank))
            dq, dk, dv = fake_fa4_bwd(q, k, v, out, dout, lse, softmax_scale, causal, seqused_k, deterministic)
            used = N if seqused_k is None else int(seqused_k[0])
            S = used - J  # key rows: S sequence keys, J joint keys, then padding keys (not written)
            for d in range(P):
                lo = d * S_loc
                dq_w[d][:, :, rank * h:(rank + 1) * h] = dq[:, lo:lo + S_loc]
                n = max(0, min(S_loc, S - lo))
                dk_w[d][:, :n, rank * hk:(rank + 1) * hk] = dk[:, lo:lo + n]
                dv_w[d][:, :n, rank * hk:(rank + 1) * hk] = dv[:, lo:lo + n]
            if joint is not None:
                for t, g in zip(joint, (dq[:, P * S_loc:], dk[:, S:S + J], dv[:, S:S + J])):
                    t.copy_(g)

        return launch


def kernel_forward_emulated(p, qs, ks, vs, joint, rows):
    """_kernel_forward_emulated's stand-in: the reference forward of the exchange path, its Saved with
    the heads-layout O and an LSE (what the serial forward keeps)."""
    spec = fab.Spec(p.layout, p.causal, p.scale, False)
    results = fab._collective_forward(spec, range(p.world_size), qs, ks, vs, joint, fab._transpose)
    done = [forward._deliver(p.layout, r, res, rows[r]) for r, (res, _) in enumerate(results)]
    saved = []
    for _, s in results:
        used = p.layout.seqused_k(p.causal)
        o = reference_attention(s.q, s.k, s.v, causal=p.causal, softmax_scale=p.scale, seqused_k=used).to(s.q.dtype)
        B, N, h, _ = s.q.shape
        saved.append(fab.Saved(s.q, s.k, s.v, o, torch.zeros(B, h, N)))
    return done, saved


@pytest.fixture
def kernels(monkeypatch):
    import flash_attn.cute.interface as fa4_interface

    import cute_kernels.fa4_bwd_a2a as bwd_a2a

    k = Kernels()
    monkeypatch.setattr(fab, "_fused_arch", lambda device: True)
    monkeypatch.setattr(fab, "_capability_of", lambda device: (9, 0))  # an SM90 GPU (the projection's GEMM)
    monkeypatch.setattr(fab, "_kernel_forward_emulated", kernel_forward_emulated)
    monkeypatch.setattr(fab, "_fused_ranks", {})
    monkeypatch.setattr(forward, "_plans", {})
    monkeypatch.setattr(forward, "emulated_transport", k.transport)
    monkeypatch.setattr(forward.WindowPlan, "_warm", lambda self: None)
    monkeypatch.setattr(a2a, "pre_a2a_launcher", k.pre_a2a_launcher)
    monkeypatch.setattr(bwd_a2a, "fa4_bwd_a2a_launcher", k.bwd_a2a_launcher)
    monkeypatch.setattr(fa4_interface, "_flash_attn_bwd", fake_fa4_bwd)
    return k


def poison_windows(transport, p):
    """NaN into the windows the fused backward uses (its staging ones allocated here first, as it would allocate
    them) and into every other window allocated so far (the gradient sets 1.. it lends out of: tests.helpers)."""
    lay, B, P = p.layout, p.batch, p.world_size
    forward.window_plan(transport, lay, B, D, p.dtype)
    for name, heads in (("dq", lay.heads_pad), ("dk", P * lay.kv_heads_loc), ("dv", P * lay.kv_heads_loc)):
        transport.windows(f"ulysses.{name}", (B, lay.seq_loc, heads, D), p.dtype)
    if lay.joint_len:
        transport.windows("ulysses.djout", (P, B, lay.joint_len, lay.heads_loc, D), p.dtype)
    poison_allocated(transport)


def inputs(p, seed):
    """Per-rank shards (padding rows poisoned, a NaN included), per-rank dO (poisoned likewise)."""
    g = torch.Generator().manual_seed(seed)
    lay, B, P = p.layout, p.batch, p.world_size

    def shards(H):
        x = torch.randn(B, lay.seq_len, H, D, generator=g).to(DTYPE)
        parts = split_seq(x, P) if p.shard_rows is None else list(x.split(list(p.shard_rows), dim=1))
        out = []
        for r, t in enumerate(parts):
            t = t.clone()
            n = lay.valid_rows(r)
            if n < t.shape[1]:
                t[:, n:] = 1e3
                t[:, n:, :1, :1] = float("nan")
            out.append(t)
        return out

    qkv = [shards(h) for h in (p.num_heads, p.num_kv_heads, p.num_kv_heads)]
    joint = ([torch.randn(B, p.joint_len, h, D, generator=g).to(DTYPE) for h in
              (p.num_heads, p.num_kv_heads, p.num_kv_heads)] if p.joint_len else None)
    return qkv, joint, shards(p.num_heads), ([torch.randn(B, p.joint_len, p.num_heads, D, generator=g).to(DTYPE)
                                             for _ in range(P)] if p.joint_len else None)


def emulated_grads(p, seed):
    """-> grads of every input (per-rank dq, dk, dv, then the joint ones) of an emulated call with grad."""
    (qs, ks, vs), joint, douts, djouts = inputs(p, seed)
    ins = [t.requires_grad_() for xs in (qs, ks, vs) for t in xs]
    jins = [t.requires_grad_() for t in joint] if joint else []
    P = p.world_size
    outs, jouts = fab.attention_emulated_with_grad(p, ins[:P], ins[P:2 * P], ins[2 * P:], tuple(jins) or None)
    return torch.autograd.grad([*outs, *(jouts or ())], ins + jins, [*douts, *(djouts or ())])


def check_equal(a, b, p):
    P, lay = p.world_size, p.layout
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (i, x.shape, y.shape)
        assert torch.isfinite(x).all(), (p, i, "non-finite grads")
        assert torch.equal(x, y), (p, i, "fused and serial grads differ")
        if i < 3 * P:
            n = lay.valid_rows(i % P)
            assert (x[:, n:] == 0).all(), (p, i, "padding rows must get zero grads")


def expected_events(P, first: bool, deterministic=False, seqused=None, causal=False):
    ev = [("bind pre", r) for r in range(P)] if first else []
    for r in range(P):
        ev.append(("build", r, causal, deterministic, seqused))
        if first:
            ev.append("host barrier")
    return ev + [("pre", r) for r in range(P)] + ["barrier"] + [("launch", r) for r in range(P)] + ["barrier"]


# ---- routing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,fused", [
    (dict(), True),
    (dict(impl="serial"), False),
    (dict(impl="nccl"), False),
    (dict(impl="reference"), False),
    (dict(P=1, S=64, H=4, H_kv=4), False),  # one rank: no exchange to fuse
    (dict(J=5), True),  # joint rows: the kernels route them to the rank's own tensors
    (dict(rows=[40, 24]), False),  # uneven shards: keys compacted
    (dict(rows=[32, 31]), True),  # explicit rows equal to the ceil split: suffix padding
    (dict(S=63), True),  # seq_len padding (a suffix)
    (dict(causal=True), True),
    (dict(dtype=torch.float32), False),
    (dict(head_dim=96), False),
    (dict(device_type="cpu"), False),
])
def test_fused_backward_applies_by_the_conditions(monkeypatch, change, fused):
    monkeypatch.setattr(fab, "_fused_arch", lambda device: True)
    monkeypatch.setattr(fab, "_capability_of", lambda device: (9, 0))
    args = dict(impl="fused", P=2, B=1, S=64, H=4, H_kv=2)
    args.update(change)
    p = problem(args.pop("impl"), args.pop("P"), args.pop("B"), args.pop("S"), args.pop("H"), args.pop("H_kv"),
                **args)
    assert fab.fused_backward_applies(p, "cuda") is fused
    spec = fab.spec_of(p, "cuda")
    assert spec.fused is fused and spec.fa4 == (p.device_type == "cuda" and p.impl != "reference")
    monkeypatch.setattr(fab, "_capability_of", lambda device: (10, 0))  # SM100: the same conditions
    assert fab.fused_backward_applies(p, "cuda") is fused
    monkeypatch.setattr(fab, "_fused_arch", lambda device: False)  # another GPU (SM80, SM120)
    assert not fab.fused_backward_applies(p, "cuda")
    assert not fab.fused_backward_applies(p, None) and not fab.spec_of(p).fused


def test_fused_arch_reads_the_device_capability(monkeypatch):
    """SM90 and SM100 / SM103, nothing else; once per device (the op's eager path asks every call with grad)."""
    assert not fab._fused_arch("cpu")
    asked = []
    capability = {0: (9, 0), 1: (8, 0), 2: (10, 0), 3: (10, 3), 4: (12, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or capability[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(fab, "_capability", fab.functools.lru_cache(maxsize=None)(fab._capability.__wrapped__))
    assert fab._fused_arch("cuda:0") and fab._fused_arch(torch.device("cuda", 0))
    assert not fab._fused_arch(torch.device("cuda", 1))
    assert not fab._fused_arch("cuda")  # the current device: 1
    assert fab._fused_arch("cuda:2") and fab._fused_arch("cuda:3") and not fab._fused_arch("cuda:4")
    assert asked == [0, 1, 2, 3, 4]


def test_auto_takes_the_fused_backward_where_it_decides_fused(kernels, monkeypatch):
    from fa_a2a.engine import autotune

    p = problem("auto", 2, 1, 20, 4, 4)
    for label, fused in (("fused:st", True), ("fused:tma", True), ("serial", False)):
        monkeypatch.setattr(forward, "_auto_problem_emulated", lambda p, *a, label=label: autotune.concrete(p, label))
        kernels.events.clear()
        emulated_grads(p, seed=1)
        assert any(e[0] == "launch" for e in kernels.events if isinstance(e, tuple)) is fused, label


# ---- emulated ranks: the data movement --------------------------------------------------------------------
# (P, B, S, H, H_kv, causal, rows): GQA with a KV head replicated over ranks, KV heads read twice by one
# rank (H 12, H_kv 6, P 4: the fp32 head sums), head padding (H 5 over 2), seq_len padding with a rank of
# padding only, explicit rows of the ceil split, causal
CASES = [
    (2, 1, 20, 4, 1, False, None),
    (2, 2, 19, 5, 5, True, None),
    (3, 1, 16, 6, 3, False, None),
    (4, 1, 13, 12, 6, True, None),
    (4, 2, 15, 8, 2, False, [4, 4, 4, 3]),
    (8, 1, 13, 8, 8, False, None),  # rows (2, 2, 2, 2, 2, 2, 1, 0)
    (8, 1, 32, 24, 24, True, None),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_fused_backward_equals_serial(kernels, case):
    P, B, S, H, H_kv, causal, rows = case
    serial = emulated_grads(problem("serial", P, B, S, H, H_kv, causal=causal, rows=rows), seed=sum(case[:5]))
    assert not any(isinstance(e, tuple) and e[0] in ("pre", "launch") for e in kernels.events)
    p = problem("fused", P, B, S, H, H_kv, causal=causal, rows=rows)
    lay = p.layout
    seqused = None if causal else lay.seqused_k(False)
    for call in range(2):  # built and lined up once; the second call binds its own saved tensors
        poison_windows(kernels.transport(P), p)
        kernels.events.clear()
        fused = emulated_grads(p, seed=sum(case[:5]))
        assert kernels.events == expected_events(P, call == 0, seqused=seqused, causal=causal), kernels.events
        check_equal(fused, serial, p)
    # the grads held (lent out of a gradient set, or copies): a later call takes another set and leaves
    # them as they were
    kept = [g.clone() for g in fused]
    emulated_grads(p, seed=sum(case[:5]) + 1)
    assert all(torch.equal(a, b) for a, b in zip(fused, kept))
    windows = {w[r].data_ptr() for f in fab._fused_ranks.values() for j in (1, 2) for w in f.sets.windows(j)
               for r in range(P)}
    if H % P == 0:  # (padding heads: dq is not its window's contiguous rows, copied)
        assert any(g.data_ptr() in windows for g in fused), "no grad lent out of a gradient set"


# (P, B, S, H, H_kv, J, rows): joint rows with GQA, with seq_len padding and a padding head (H 5 over 2), with
# KV heads read twice by one rank, with explicit rows of the ceil split, one joint row
JOINT_CASES = [
    (2, 1, 20, 4, 2, 3, None),
    (2, 2, 19, 5, 5, 4, None),
    (4, 1, 13, 12, 6, 5, None),
    (4, 2, 15, 8, 2, 2, [4, 4, 4, 3]),
    (3, 1, 16, 6, 6, 1, None),
]


@pytest.mark.parametrize("case", JOINT_CASES, ids=str)
def test_emulated_fused_backward_with_joint_rows_equals_serial(kernels, case):
    """Joint (text) rows in the fused backward: each rank's joint-output grads of each rank's heads go to that
    rank's djout window, are summed there into dO's joint rows after the first barrier, and the kernels
    leave the joint rows' dq, dk, dv on the rank: every grad, the joint ones included, equals the serial
    (exchange) backward's bit for bit, over NaN-poisoned windows."""
    P, B, S, H, H_kv, J, rows = case
    serial = emulated_grads(problem("serial", P, B, S, H, H_kv, J=J, rows=rows), seed=sum(case[:6]))
    p = problem("fused", P, B, S, H, H_kv, J=J, rows=rows)
    assert fab.fused_backward_applies(p, "cuda")
    for call in range(2):
        poison_windows(kernels.transport(P), p)
        kernels.events.clear()
        fused = emulated_grads(p, seed=sum(case[:6]))
        assert kernels.events == expected_events(P, call == 0, seqused=p.layout.seqused_k(False)), kernels.events
        check_equal(fused, serial, p)
        assert all(g.abs().sum() > 0 for g in fused[3 * P:]), "the joint grads must be written"


def _random_joint_layouts(n: int, seed: int) -> list:
    """(P, B, S, H, H_kv, J, rows): P 2-8, GQA ratios 1-4, seq_len padding (ranks of padding only too), J from
    1 to past 2 x S_loc, a third with explicit rows of the ceil split."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < n:
        P, B, H_kv, g = rng.randint(2, 8), rng.randint(1, 2), rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 1, 2, 4])
        S = rng.randint(1, 6 * P)
        S_loc = -(-S // P)
        J = rng.choice([1, 2, S_loc, S_loc + 1, 2 * S_loc + 3, rng.randint(1, 20)])
        rows = list(layout(P, S, H_kv * g, H_kv, J).shard_rows) if rng.random() < 0.3 else None
        out.append((P, B, S, H_kv * g, H_kv, J, rows))
    return out


@pytest.mark.parametrize("case", _random_joint_layouts(12, seed=0), ids=str)
def test_random_layouts_with_joint_rows_equal_serial(kernels, case):
    """Seeded random layouts with joint rows: two calls with other dO and joint dO over poisoned windows,
    then one over the windows as the last call left them: fused == serial bit for bit each time."""
    P, B, S, H, H_kv, J, rows = case
    p = problem("fused", P, B, S, H, H_kv, J=J, rows=rows)
    assert fab.fused_backward_applies(p, "cuda")
    serial_p = dataclasses.replace(p, impl="serial", o_store=None)
    for seed, poison in ((1, True), (2, True), (3, False)):
        serial = emulated_grads(serial_p, seed=seed)
        if poison:
            poison_windows(kernels.transport(P), p)
        kernels.events.clear()
        check_equal(emulated_grads(p, seed=seed), serial, p)
        assert sum(isinstance(e, tuple) and e[0] == "launch" for e in kernels.events) == P


def test_joint_rows_come_and_go_on_one_transport(kernels):
    """Calls with and without joint rows (and of other lengths) in turn on one transport: each equals serial."""
    for P, B, S, H, H_kv in ((2, 1, 20, 4, 2), (4, 2, 13, 5, 5)):
        for J in (0, 3, 0, 5, 3, 1):
            p = problem("fused", P, B, S, H, H_kv, J=J)
            serial = emulated_grads(dataclasses.replace(p, impl="serial", o_store=None), seed=J + P)
            check_equal(emulated_grads(p, seed=J + P), serial, p)


@pytest.mark.parametrize("o_store,dkv_store", [("st", "st"), ("tma", None), (None, None)])
def test_the_backward_stores_dk_dv_as_the_forward_stored_o(kernels, o_store, dkv_store):
    """impl "fused:st" (or "auto" that timed per-thread O stores faster): the fused backward stores dK, dV
    per thread too, and says so in the agreed fields; otherwise the launcher's rule (TMA where it can)."""
    p = dataclasses.replace(problem("fused", 2, 1, 20, 4, 4), o_store=o_store)
    assert fab.spec_of(p, "cuda").dkv_store == dkv_store
    emulated_grads(p, seed=7)
    assert kernels.dkv_stores == [dkv_store] * 2


def test_deterministic_mode_reaches_the_kernels(kernels):
    p = problem("fused", 2, 1, 20, 4, 2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        emulated_grads(p, seed=3)
    finally:
        torch.use_deterministic_algorithms(False)
    builds = [e for e in kernels.events if isinstance(e, tuple) and e[0] == "build"]
    assert [e[3] for e in builds] == [True, True]
    kernels.events.clear()
    emulated_grads(p, seed=3)  # the other mode: built again, the ranks lined up again for its compiles
    assert kernels.events == expected_events(2, False)[:1] + ["host barrier"] + expected_events(2, False)[1:2] + \
        ["host barrier"] + expected_events(2, False)[2:]


@pytest.mark.parametrize("change", [dict(rows=[12, 8]), dict(rows=[0, 10, 10])], ids=str)
def test_fused_falls_back_to_the_exchanges_and_equals_serial(kernels, change):
    """Uneven shards: impl "fused" takes the exchange backward (no kernel launched, no barrier) with the
    same grads as serial."""
    P = len(change.get("rows", [0, 0]))
    p = problem("fused", P, 1, sum(change.get("rows", [10, 10])), 4, 2, **change)
    assert not fab.fused_backward_applies(p, "cuda")
    serial = emulated_grads(dataclasses.replace(p, impl="serial", o_store=None), seed=4)
    kernels.events.clear()
    check_equal(emulated_grads(p, seed=4), serial, p)
    assert kernels.events == []


def test_dout_pre_a2a_zeroes_padding_rows_and_heads(kernels):
    """dO's window after the pre-A2A: every rank's rows of every rank's heads, padding rows (poisoned
    in the caller's dO) and padding heads (H 5 over 2 ranks: head 5) zero."""
    p = problem("fused", 2, 1, 7, 5, 5)
    (qs, ks, vs), _, douts, _ = inputs(p, seed=5)
    transport = kernels.transport(2)
    poison_windows(transport, p)
    plan = forward.window_plan(transport, p.layout, 1, D, DTYPE)
    for r in range(2):
        f = fab._fused_rank(plan, r)
        f.pre(fab._padded(p.layout, r, douts[r]))
    full = torch.cat([douts[0], douts[1][:, :3]], dim=1)  # the 7 valid rows
    for d in range(2):
        got = plan.dq[d]  # [B, 8, 3, D]
        for j in range(3):
            h = 3 * d + j
            if h < 5:
                assert torch.equal(got[:, :7, j], full[:, :, h]) and (got[:, 7:, j] == 0).all()
            else:
                assert (got[:, :, j] == 0).all()


@pytest.mark.parametrize("B", [1, 2])
def test_dout_pre_a2a_kv_windows_have_no_heads_and_pass_the_stride_checks(B):
    """The k, v windows of dO's pre-A2A: no heads (no block launched for them), views of the plan's own
    windows, and every stride the kernel's TVM-FFI entry checks (dims of extent != 1 but the head dim,
    whose stride is 1) a multiple of 16 bytes as DLPack exports it."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    transport = EmulatedTransport(4, device="cpu")
    plan = forward.WindowPlan.__new__(forward.WindowPlan)  # the windows alone (no kernel compiles)
    lay = layout(4, 30, 8, 2)
    plan.dq, plan.dk, plan.dv = forward.in_windows(lambda n: transport.windows("ulysses.in", (n,), DTYPE), lay, B, D)
    for w in (plan.dk, plan.dv):
        z = fab._no_heads(w)
        assert tuple(z.shape) == (4, B, lay.num_rows, 0, D) and z.storage_offset() == w.storage_offset()
        assert z.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        a2a._aligned(z, "dk")
        exported = tvm_ffi.from_dlpack(z)
        elems = 16 // z.element_size()
        shape, strides = exported.shape, exported.strides
        assert strides[-1] == 1 and all(st % elems == 0 for n, st in zip(shape[:-1], strides[:-1]) if n != 1), strides
    transport.close()


# ---- real ranks: one rank's path per thread, meeting in the transport's barriers -----------------------
class _Group:
    group_name = "fake"


def run_ranks(P, meet, body):
    """body(r) in P threads, one per rank; a rank that raises aborts `meet` (the others' barrier) and is reported."""
    errors = []

    def rank(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append((r, e))
            meet.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


@pytest.mark.parametrize("J", [0, 3])
def test_real_ranks_fused_backward_in_threads(kernels, monkeypatch, J):
    """The real-rank path (group given): each of P threads runs one rank's backward over a shared
    transport whose barriers are a threading.Barrier; no torch.distributed call is made (the backward's
    agreement is stood in for); every rank's grads (its joint grads too) equal the serial backward's."""
    import torch.distributed as dist

    import ulysses.transport as transport_mod

    P = 4
    p = problem("fused", P, 2, 30, 8, 2, J=J)
    lay = p.layout
    (qs, ks, vs), joint, douts, djouts = inputs(p, seed=6)
    djouts = djouts or [None] * P
    rows = [q.shape[1] for q in qs]
    padded = [[fab._padded(lay, r, x) for r, x in enumerate(xs)] for xs in (qs, ks, vs)]
    _, saved = kernel_forward_emulated(p, *padded, joint, rows)
    serial_spec = fab.Spec(lay, False, p.scale, True, False)
    serial = fab.backward(serial_spec, range(P), saved, douts, djouts, rows)

    meet = threading.Barrier(P, timeout=60)
    transport = kernels.transport(P)
    transport.barrier = lambda: meet.wait()
    transport.host_barrier = lambda *a, **kw: meet.wait()
    monkeypatch.setattr(transport_mod, "get_transport", lambda group: transport)
    agreed = []
    monkeypatch.setattr(fab, "_agree_backward",
                        lambda spec, s, group, refusal=None, call=0: agreed.append((spec, group.group_name)))
    for name in ("all_to_all_single", "all_reduce", "barrier", "all_gather"):
        monkeypatch.setattr(dist, name, lambda *a, **kw: pytest.fail("a torch.distributed collective ran"))
    poison_windows(transport, p)
    plan = forward.window_plan(transport, lay, p.batch, D, DTYPE)
    # no group on this transport: its gradient sets would be one process's (emulated ranks' choice, the
    # threads racing on it); the staging set, copied out, is what this test reads (lending: the next test)
    monkeypatch.setenv("FA_A2A_OUT_SLOTS", "0")
    for r in range(P):  # the plan's per-rank state exists before the threads (one process per rank builds its own)
        fab._fused_rank(plan, r)
    spec = fab.spec_of(p, "cuda")
    assert spec.fused
    results = [None] * P

    def rank(r):
        [results[r]] = fab.backward(spec, [r], [saved[r]], [douts[r]], [djouts[r]], [rows[r]], group=_Group())

    run_ranks(P, meet, rank)
    assert agreed == [(spec, "fake")] * P
    for r in range(P):
        if not J:
            assert results[r][3:] == (None, None, None)
        for x, y in zip(results[r], serial[r]):
            assert (x is None and y is None) or torch.equal(x, y), r


class _ThreadChannel:
    """ulysses.channel's exchange between P threads (each registers its rank): every rank's word, in rank order."""

    def __init__(self, P):
        self.rank_of, self.words, self.meet, self.sent = {}, [None] * P, threading.Barrier(P, timeout=60), []

    def exchange(self, word: int) -> list:
        self.words[self.rank_of[threading.get_ident()]] = word
        self.meet.wait()
        words = list(self.words)
        self.meet.wait()
        self.sent.append(words)
        return words


@pytest.mark.parametrize("H_kv", [4, 2])  # each KV head once (dk, dv lent too) / read twice (head sums: dq only)
def test_real_ranks_lend_their_grads_and_keep_them_while_alive(kernels, monkeypatch, H_kv):
    """Real ranks deliver the fused backward's grads as the forward delivers its output (forward.Slots): lent out
    of a gradient set every rank has free, with no copy; a later call takes another set while any of them lives
    (its grads stay as they were), and set 1 again once they are gone. Each call equals the serial backward."""
    import ulysses.channel as channel_mod
    import ulysses.transport as transport_mod

    P = 4
    p = problem("fused", P, 1, 32, 8, H_kv)
    lay = p.layout
    (qs, ks, vs), _, douts, _ = inputs(p, seed=7)
    rows = [q.shape[1] for q in qs]
    padded = [[fab._padded(lay, r, x) for r, x in enumerate(xs)] for xs in (qs, ks, vs)]
    _, saved = kernel_forward_emulated(p, *padded, None, rows)
    serial_spec = fab.Spec(lay, False, p.scale, True, False)
    dout_sets = [douts, [d.flip(1).contiguous() for d in douts], [(d * 0.5).to(DTYPE) for d in douts]]
    serial = [fab.backward(serial_spec, range(P), saved, ds, [None] * P, rows) for ds in dout_sets]

    meet = threading.Barrier(P, timeout=60)
    transport = kernels.transport(P)
    transport.barrier = lambda: meet.wait()
    transport.host_barrier = lambda *a, **kw: meet.wait()
    transport.group = _Group()
    chan = _ThreadChannel(P)
    monkeypatch.setattr(channel_mod, "get_channel", lambda group, timeout_s=None: chan)
    monkeypatch.setattr(transport_mod, "get_transport", lambda group: transport)
    monkeypatch.setattr(fab, "_agree_backward", lambda spec, s, group, refusal=None, call=0: None)
    poison_windows(transport, p)
    plan = forward.window_plan(transport, lay, p.batch, D, DTYPE)
    for r in range(P):
        for j in (1, 2):  # the sets the calls below take, allocated and poisoned first
            for w in fab._fused_rank(plan, r).sets.windows(j):
                w.fill_(float("nan"))
    spec = fab.spec_of(p, "cuda")
    results = [[None] * P for _ in dout_sets]

    def call(c):
        def rank(r):
            chan.rank_of[threading.get_ident()] = r
            [results[c][r]] = fab.backward(spec, [r], [saved[r]], [dout_sets[c][r]], [None], [rows[r]],
                                           group=_Group())

        run_ranks(P, meet, rank)

    def windows(j, r):
        return [w[r].data_ptr() for w in fab._fused_rank(plan, r).sets.windows(j)]

    in_order = H_kv == 4
    lent = 3 if in_order else 1  # dq, and dk, dv where they are the rank's rows as they are

    call(0)
    call(1)  # call 0's grads alive: set 2
    assert [words[0] for words in chan.sent] == [0b111111110] * P + [0b111111100] * P
    for r in range(P):
        for c, j in ((0, 1), (1, 2)):
            got = [g.data_ptr() for g in results[c][r][:3]]
            assert got[:lent] == windows(j, r)[:lent], (c, r, "grads lent out of their set's windows")
            assert all(a not in windows(j, r) for a in got[lent:]), (c, r)
            for x, y in zip(results[c][r][:3], serial[c][r][:3]):
                assert torch.equal(x, y), (c, r, "lent grads differ from the serial backward's")
        assert results[0][r][3:] == (None, None, None)
    results[0] = [None] * P  # call 0's grads gone: set 1 is free again
    call(2)
    for r in range(P):
        assert [g.data_ptr() for g in results[2][r][:lent]] == windows(1, r)[:lent]
        for x, y in zip(results[2][r][:3], serial[2][r][:3]):
            assert torch.equal(x, y), (r, "set 1 again")
        for x, y in zip(results[1][r][:3], serial[1][r][:3]):
            assert torch.equal(x, y), (r, "call 1's grads changed by a later call")


def test_backward_agreement_names_its_path_and_mode(monkeypatch):
    """Ranks whose backwards would meet in different collectives (fused / exchanges) or build for
    another deterministic mode disagree on the host before any data moves."""
    from fa_a2a.engine import problem as engine_problem

    seen = []
    monkeypatch.setattr(engine_problem, "agree_call", lambda fields, word, error, group: seen.append((fields, word)))
    monkeypatch.setattr(fab, "_backward_words", {})
    lay = layout(2, 20, 4, 2)
    saved = fab.Saved(torch.empty(1, 20, 2, 64, dtype=torch.bfloat16), None, None, None, None)
    fab._agree_backward(fab.Spec(lay, False, 0.125, True, True), saved, _Group())
    fab._agree_backward(fab.Spec(lay, False, 0.125, True, False), saved, _Group())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        fab._agree_backward(fab.Spec(lay, False, 0.125, True, True), saved, _Group())
    finally:
        torch.use_deterministic_algorithms(False)
    # the saved q's batch, head dim and dtype (two calls' exchanges of the same size must not meet)
    for q in (torch.empty(2, 20, 2, 32, dtype=torch.bfloat16), torch.empty(1, 20, 2, 64, dtype=torch.float16)):
        fab._agree_backward(fab.Spec(lay, False, 0.125, True, True), saved._replace(q=q), _Group())
    (f0, w0), (f1, w1), (f2, w2), (f3, w3), (f4, w4) = seen
    assert (f0["impl"], f1["impl"]) == ("fused backward", "exchange backward")
    assert (f0["deterministic"], f2["deterministic"]) == (False, True)
    assert (f3["batch"], f3["head_dim"], f4["dtype"]) == (2, 32, "float16")
    assert len({w0, w1, w2, w3, w4}) == 5
    assert engine_problem._ARGUMENT["impl"] == "impl"  # a disagreement on the path names the argument


# ---- torch.compile: the backward op reads the forward op's decision --------------------------------------
def test_traced_backward_op_keys_the_forward_ops_decision(monkeypatch):
    """The backward op's arguments are fixed at trace time; whether it is fused is what the forward op
    decided when it ran, looked up by the same key from the backward op's own arguments."""
    keys = []
    inner = fab._traced_key
    monkeypatch.setattr(fab, "_traced_key", lambda *a: keys.append(inner(*a)) or keys[-1])
    monkeypatch.setattr(fab, "_traced_paths", {})
    from fa_a2a.op import ulysses_attention

    g = torch.Generator().manual_seed(7)
    ins = [torch.randn(1, 6, h, 8, generator=g) for h in (4, 2, 2)]
    joint = [torch.randn(1, 3, h, 8, generator=g) for h in (4, 2, 2)]

    def f(q, k, v, jq, jk, jv):
        out, jout = ulysses_attention(q, k, v, impl="reference", joint=(jq, jk, jv), softmax_scale=0.25)
        return out.square().sum() + jout.sum()

    xs = [t.clone().requires_grad_() for t in ins + joint]
    torch.compile(f, backend="aot_eager", fullgraph=True)(*xs).backward()
    assert len(keys) == 2 and keys[0] == keys[1], keys
    assert fab._traced_paths == {keys[0]: (False, None)}  # (fused, dkv_store)
    assert all(torch.isfinite(x.grad).all() for x in xs)


# ---- the forward kept for the backward (_GradAttend) -------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["FA4 + post-A2A", "fused kernel keeping O"])
@pytest.mark.parametrize("J", [0, 3], ids=["no joint", "joint"])
def test_grad_attend_keeps_fresh_o_lse_and_one_copy_of_the_in_window(monkeypatch, J, fused):
    """_GradAttend: each call's O and LSE are fresh tensors, which the backward keeps as they are; q, k, v are
    kept by one copy of the rank's in-window (a later pre-A2A into the window does not reach them). Serial: FA4
    writes every row of them, the post-A2A kernels send that call's O (sequence rows to the out-slot, joint rows
    to the joint out-window). Fused: the fused kernel routes the sequence rows into the out-slot and keeps them
    in the fresh O and LSE; FA4 writes the joint rows there, whose post-A2A sends them."""
    import cute_kernels.fa4 as fa4

    P, B, S, H, H_kv, rank = 2, 1, 10, 4, 2, 1
    lay = layout(P, S, H, H_kv, J)
    transport = EmulatedTransport(P, device="cpu")
    monkeypatch.setattr(forward.WindowPlan, "_warm", lambda self: None)
    plan = forward.WindowPlan(transport, lay, B, D, DTYPE)
    launches, posts = [], []  # (kind, o, lse) written; (src, windows, broadcast) sent
    fa4_rows = slice(lay.seq_pad, None) if fused else slice(None)

    def into_launcher(q, k, v, out_like, *, causal, softmax_scale, seqused_k, lse_like):
        assert not (fused and causal)  # (the joint rows: non-causal, as the fused forward runs them)
        assert q.data_ptr() == plan.dq[rank][:, fa4_rows].data_ptr() and q.shape == plan.dq[rank][:, fa4_rows].shape
        assert k.data_ptr() == plan.dk[rank].data_ptr() and v.data_ptr() == plan.dv[rank].data_ptr()
        assert out_like.shape == q.shape and tuple(lse_like.shape) == (B, q.shape[2], q.shape[1])

        def launch(out, lse):
            assert out.shape == out_like.shape and out.stride() == out_like.stride() and lse.stride() == lse_like.stride()
            out.copy_(torch.randn(out.shape))
            lse.copy_(torch.randn(lse.shape))
            launches.append(("fa4", out, lse))

        return launch

    def keeping_launcher(q, k, v, windows, r, o_like, lse_like, *, causal, softmax_scale, seqused_k, o_store):
        assert fused and r == rank and windows is plan.out_w and q.shape[1] == lay.seq_pad == o_like.shape[1]
        assert q.data_ptr() == plan.dq[rank].data_ptr() and tuple(lse_like.shape) == (B, q.shape[2], lay.seq_pad)

        def launch(o, lse):
            assert o.stride() == o_like.stride() and lse.stride() == lse_like.stride()
            o.copy_(torch.randn(o.shape))
            lse.copy_(torch.randn(lse.shape))
            launches.append(("fused", o, lse))

        return launch

    def post_launcher(o, windows, r, broadcast=False):
        assert r == rank and o.shape[1] == (J if broadcast else lay.seq_pad)
        assert not (fused and not broadcast), "the fused kernel routes the sequence rows itself"
        return lambda src=o: posts.append((src, windows, broadcast))

    monkeypatch.setattr(fa4, "fa4_into_launcher", into_launcher)
    monkeypatch.setattr(fa4, "fa4_a2a_keeping_launcher", keeping_launcher)
    monkeypatch.setattr(a2a, "post_a2a_launcher", post_launcher)
    attend = fab._GradAttend(plan, rank, False, 0.125, fused=fused)
    firsts = []
    for call in range(2):
        for w in (plan.dq, plan.dk, plan.dv):
            w.copy_(torch.randn(w.shape))
        window = [w[rank].clone() for w in (plan.dq, plan.dk, plan.dv)]
        launches.clear()
        posts.clear()
        attend()
        saved = attend.take()
        for w in (plan.dq, plan.dk, plan.dv):  # the next call's pre-A2A into the in-windows
            w.fill_(float("nan"))
        assert all(torch.equal(s, e) for s, e in zip(saved[:3], window)), call
        N = lay.num_rows
        assert saved.o.shape == (B, N, lay.heads_loc, D) and saved.lse.shape == (B, lay.heads_loc, N)
        kinds = [kind for kind, _, _ in launches]
        assert kinds == (["fused"] + ["fa4"] * bool(J) if fused else ["fa4"])
        for _, o, lse in launches:  # every row of the kept O and LSE written once, in them
            assert o.data_ptr() in {saved.o.data_ptr(), saved.o[:, lay.seq_pad:].data_ptr()}
        written = sum(o.shape[1] for _, o, _ in launches)
        assert written == N
        firsts.append(saved.o)
        if fused:
            seq_posts, joint = [], posts
        else:
            seq_posts, joint = posts[:1], posts[1:]
            [(src, windows, _)] = seq_posts
            assert src.data_ptr() == saved.o.data_ptr() and src.shape[1] == lay.seq_pad and windows is plan.out_w
        if J:
            [(src, windows, broadcast)] = joint
            assert broadcast and windows is plan.jout_w and torch.equal(src, saved.o[:, lay.seq_pad:])
        else:
            assert not joint
    assert firsts[0].data_ptr() != firsts[1].data_ptr()
    transport.close()


def test_emulated_op_builds_its_rank_calls_once_and_again_after_a_close(kernels, monkeypatch):
    """forward_emulated keeps the P ranks' RankCalls of a signature as one cache entry (one lookup per call),
    built at the first call and again once their transport was closed."""
    built = []

    class Call:
        def __init__(self, transport, p, rank):
            self.transport, self.rank = transport, rank
            built.append(rank)

        closed = property(lambda self: self.transport.closed)

        def pre(self, q, k, v, joint):
            pass

    def calls(calls, stages, rows, outs=None, joint_outs=None):
        assert [c.rank for c in calls] == list(range(len(calls)))
        for stage in stages:
            stage()
        return [(torch.zeros(1), None) for _ in calls]

    monkeypatch.setattr(forward, "RankCall", Call)
    monkeypatch.setattr(forward, "emulated_calls", calls)
    monkeypatch.setattr(forward, "_emulated_calls", {})
    p = problem("fused", 4, 1, 32, 4, 4)
    xs = [torch.zeros(1, 8, 4, D, dtype=DTYPE) for _ in range(4)]
    for _ in range(3):
        forward.forward_emulated(p, xs, xs, xs, None)
    assert built == [0, 1, 2, 3]
    kernels.transport(4).close()
    monkeypatch.setattr(kernels, "transports", {})  # a new transport after the close
    forward.forward_emulated(p, xs, xs, xs, None)
    assert built == [0, 1, 2, 3] * 2 and len(forward._emulated_calls) == 1


def test_grad_attend_refuses_in_windows_that_are_not_one_allocation():
    """_GradAttend saves q | k | v by one copy of the rank's in-window: k, v elsewhere (even at the storage
    offsets they would have in one allocation) are refused, not read from q's storage."""
    import types

    P, shape = 2, (1, 8, 2, D)
    n = math.prod(shape)
    ours, other = torch.randn(P, 3 * n).to(DTYPE), torch.randn(P, 3 * n).to(DTYPE)
    dq = ours[:, :n].unflatten(1, shape)
    for dk, dv in (((other[:, n:2 * n].unflatten(1, shape), other[:, 2 * n:].unflatten(1, shape))),  # same offsets
                   (torch.randn(P, *shape).to(DTYPE), torch.randn(P, *shape).to(DTYPE))):
        plan = types.SimpleNamespace(layout=layout(P, 16, 2, 2), dq=dq, dk=dk, dv=dv)
        with pytest.raises(RuntimeError, match="one allocation"):
            fab._GradAttend(plan, 1, False, 0.125)  # (before anything is launched or allocated)


def test_traced_forward_returns_saved_tensors_on_storages_of_their_own():
    """The grad custom op returns the saved q, k, v, which the kernel paths keep as views of one copy;
    torch refuses a custom op whose returns share a storage, and below autograd (where the op runs) such
    views have no _base: _apart must tell them by storage and copy all but the first."""
    from fa_a2a.engine.backward import Saved, _apart

    flat = torch.randn(3 * 24)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        q, k, v = (flat[i * 24:(i + 1) * 24].view(2, 3, 4) for i in range(3))
    assert q._base is None  # what the _base rule missed
    o, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    apart = _apart(Saved(q, k, v, o, lse))
    assert apart[0] is q and apart[3] is o and apart[4] is lse
    assert not torch._C._any_output_is_alias_to_input_or_output((), {}, (apart,))
    assert all(torch.equal(a, b) for a, b in zip(apart, (q, k, v, o, lse)))
    assert _apart(Saved(q, k, v, None, None))[3:] == [None, None]


def test_forward_with_grad_keeps_o_in_the_fused_kernel_where_it_can(monkeypatch):
    """_keeps_fused: the forward with grad of impl "fused" runs the fused kernel that keeps O and LSE on SM90
    CUDA devices when its stores are unpaced (the paced kernel has no LSE path); FA4 + the post-A2A on SM100,
    paced, for "serial" and on other devices."""
    import dataclasses
    import types

    paced = []
    plan = types.SimpleNamespace(transport=types.SimpleNamespace(device=torch.device("cuda", 0)),
                                 pacer=lambda rank, causal, pace: paced.append(pace) or (object() if pace else None))
    capability = [(9, 0)]
    monkeypatch.setattr(fab, "_capability_of", lambda device: capability[0])
    fused, serial = problem("fused", 2, 1, 32, 4, 4), problem("serial", 2, 1, 32, 4, 4)
    assert fab._keeps_fused(fused, plan, 1)
    assert not fab._keeps_fused(dataclasses.replace(fused, pace=48.0), plan, 1) and paced[-1] == 48.0
    assert not fab._keeps_fused(serial, plan, 1)
    capability[0] = (10, 0)
    assert not fab._keeps_fused(fused, plan, 1)
    capability[0] = (9, 0)
    plan.transport.device = torch.device("cpu")
    assert not fab._keeps_fused(fused, plan, 1)
