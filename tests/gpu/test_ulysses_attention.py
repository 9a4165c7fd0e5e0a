"""ulysses_attention on one GPU: emulated ranks, and 2/4 processes sharing the GPU (VMM windows).

Checks, per impl ("serial", "fused"):
  - bit-identical to the reference path: ulysses.reference's A2As around fa4_forward
    (the moved data is exact and FA4 is deterministic, so atol = 0 on the valid rows);
  - attention within FA4's tolerance rule: error vs the fp64 oracle on the unsplit sequence
    <= 2x the error of the same attention computed in the input dtype (torch SDPA) + 1e-3;
  - padding rows of the outputs are zero; fresh inputs on every run (stale windows show);
  - 1000 CUDA-graph replays with buffer reuse stay bit-exact; torch.compile(fullgraph) works;
  - real ranks (processes on one GPU) equal the emulated run bit for bit, also with a rank that
    starts late, and under CUDA-graph replay.
"""
import time

import pytest
import torch

from cute_kernels.fa4 import fa4_forward
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated
from ulysses.layout import UlyssesLayout
from ulysses.reference import emulated_post_a2a, emulated_pre_a2a

from tests import helpers
from tests.multiproc import run_on_gloo_groups

DTYPE = torch.bfloat16
# (P, B, S, H, H_kv, D, J, causal). FA4 compiles once per (D, GQA ratio, causal, seqused_k):
# the cases share compiles on purpose.
CASES = [
    (4, 1, 1024, 8, 8, 128, 0, False),
    (4, 2, 1001, 6, 2, 128, 77, False),  # uneven S (S_loc = 251), head padding, GQA, joint
    (2, 1, 512, 4, 2, 64, 0, True),  # causal, GQA with 2 query heads per KV head
]


def make_inputs(case, seed):
    return helpers.make_inputs(case, seed, dtype=DTYPE, device="cuda", poison=100, nan=True)


def reference_outputs(case, joint, shards):
    """ulysses.reference's A2As around fa4_forward: what every impl must equal bit for bit."""
    P, B, S, H, Hkv, D, J, causal = case
    L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
    used = L.seqused_k(causal)
    used = None if used is None else torch.full((B,), used, dtype=torch.int32, device="cuda")
    outs = [fa4_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, seqused_k=used)
            for q, k, v in emulated_pre_a2a(L, *shards, joint)]
    return emulated_post_a2a(L, outs)


def check_tolerance(case, rank, out, jout, full, joint):
    P, B, S, H, Hkv, D, J, causal = case
    (ref, jref), (base, jbase) = helpers.oracles(full, joint, causal, base_dtype=DTYPE)
    L = UlyssesLayout(S, H, Hkv, P)
    n, first = L.valid_rows(rank), rank * L.seq_loc
    helpers.check_attention(out[:, :n], ref[:, first:first + n], base[:, first:first + n], 1e-3, (case, rank))
    if joint is not None:
        helpers.check_attention(jout, jref, jbase, 1e-3, (case, rank, "joint"))
    assert (out[:, n:] == 0).all(), "padding rows must be zero"


def check_exact(case, rank, out, jout, want_seq, want_joint):
    P, B, S, H, Hkv, D, J, causal = case
    n = UlyssesLayout(S, H, Hkv, P).valid_rows(rank)
    assert torch.equal(out[:, :n], want_seq[rank][:, :n]), (case, rank)
    if want_joint is not None:
        assert torch.equal(jout, want_joint), (case, rank)


def run_emulated(case, impl, joint, shards):
    res = ulysses_attention_emulated(*shards, impl=impl, joint=joint, causal=case[-1], seq_len=case[2])
    return res if joint is not None else (res, [None] * case[0])


@pytest.mark.parametrize("impl", ["serial", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_emulated_ranks_exact_and_within_tolerance(case, impl):
    for run in range(2):  # the second run reuses the windows with fresh inputs
        full, joint, shards = make_inputs(case, seed=10 * run + 1)
        outs, jouts = run_emulated(case, impl, joint, shards)
        want_seq, want_joint = reference_outputs(case, joint, shards)
        for r in range(case[0]):
            check_exact(case, r, outs[r], jouts[r], want_seq, want_joint)
            check_tolerance(case, r, outs[r], jouts[r], full, joint)


@pytest.mark.parametrize("impl", ["serial", "fused"])
def test_1000_graph_replays_stay_exact(impl):
    case = CASES[1]
    full, joint, shards = make_inputs(case, seed=3)
    static = [[t.clone() for t in s] for s in shards]
    static_joint = tuple(t.clone() for t in joint)
    run_emulated(case, impl, static_joint, static)  # allocates windows, compiles
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        g_outs, g_jouts = run_emulated(case, impl, static_joint, static)
    torch.cuda.current_stream().wait_stream(s)
    for rnd in range(10):
        full, joint, shards = make_inputs(case, seed=100 + rnd)
        for dst, src in zip(static, shards):
            for a, b in zip(dst, src):
                a.copy_(b)
        for a, b in zip(static_joint, joint):
            a.copy_(b)
        want_seq, want_joint = reference_outputs(case, joint, shards)
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
        for r in range(case[0]):
            check_exact(case, r, g_outs[r], g_jouts[r], want_seq, want_joint)
    from fa_a2a.engine.forward import _emulated

    transport = _emulated[(case[0], torch.device("cuda", torch.cuda.current_device()))]
    transport.check()


def test_torch_compile_fullgraph():
    case = CASES[0]
    full, joint, shards = make_inputs(case, seed=5)

    def f(qs, ks, vs):
        outs = ulysses_attention_emulated(qs, ks, vs, impl="fused")
        return [o.float() * 2 for o in outs]

    eager = f(*shards)
    compiled = torch.compile(f, fullgraph=True)(*shards)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows,H,Hkv,J", [((300, 212, 256, 0), 8, 8, 0), ((129, 128), 6, 2, 77), ((0, 200, 57), 6, 3, 0)])
def test_uneven_shards_emulated(rows, H, Hkv, J):
    """shard_rows (diffusers' ulysses_anything): fused == serial == the reference A2As around FA4, bit for bit."""
    P = len(rows)
    g = torch.Generator(device="cuda").manual_seed(sum(rows))
    full = [torch.randn(1, sum(rows), h, 128, device="cuda", generator=g).to(DTYPE) for h in (H, Hkv, Hkv)]
    joint = tuple(torch.randn(1, J, h, 128, device="cuda", generator=g).to(DTYPE) for h in (H, Hkv, Hkv)) if J else None
    shards = [list(x.split(rows, dim=1)) for x in full]
    L = UlyssesLayout(sum(rows), H, Hkv, P, J, shard_rows=rows)
    padded = [[L.pad_shard(x, r) for r, x in enumerate(s)] for s in shards]
    used = torch.full((1,), L.seqused_k(False) or L.num_rows, dtype=torch.int32, device="cuda")
    heads = emulated_pre_a2a(L, *padded, joint)
    outs = [fa4_forward(*(x.contiguous() for x in qkv), seqused_k=used) for qkv in heads]
    want, want_joint = emulated_post_a2a(L, outs)
    (ref, jref), (base, jbase) = helpers.oracles(full, joint, False, base_dtype=DTYPE)
    for impl in ("serial", "fused"):
        outs, jouts = helpers.pair(ulysses_attention_emulated(*shards, impl=impl, joint=joint, shard_rows=rows), joint)
        for r, n in enumerate(rows):
            first = sum(rows[:r])
            assert outs[r].shape[1] == n and torch.equal(outs[r], want[r][:, :n]), (impl, r)
            if n:
                helpers.check_attention(outs[r], ref[:, first:first + n], base[:, first:first + n], 1e-3, (impl, r))
            if joint is not None:
                assert torch.equal(jouts[r], want_joint)


# ---- one rank (P = 1): no communication, FA4 on the whole input ----------------------------------
@pytest.mark.parametrize("case", [(1, 2, 300, 6, 2, 128, 0, False), (1, 1, 257, 4, 4, 64, 33, False),
                                  (1, 1, 200, 4, 2, 128, 0, True)])
@pytest.mark.parametrize("impl", ["fused", "serial", "nccl", "reference"])
def test_single_rank_every_impl(case, impl):
    full, joint, shards = make_inputs(case, seed=11)
    res = ulysses_attention(*(s[0] for s in shards), impl=impl, joint=joint, causal=case[-1], seq_len=case[2])
    out, jout = helpers.pair(res, joint)
    check_tolerance(case, 0, out, jout, full, joint)
    if impl != "reference":  # FA4 on the unsplit input (joint rows appended), bit for bit
        q, k, v = (x if joint is None else torch.cat([x, j], dim=1) for x, j in zip(full, joint or (None,) * 3))
        want = fa4_forward(q, k, v, causal=case[-1])
        assert torch.equal(out, want[:, :case[2]])
        if joint is not None:
            assert torch.equal(jout, want[:, case[2]:])


# ---- real ranks: processes sharing the GPU -------------------------------------------------------
def _real_ranks(P, group, rank):
    case = (P, 1, P * 256, 8, 8, 128, 0, False) if P == 2 else CASES[1]
    full, joint, shards = make_inputs(case, seed=999)
    for impl in ("fused", "nccl"):  # ranks that disagree: every rank raises, nothing moves, no hang
        with pytest.raises(ValueError, match="^causal: expected the same value on every rank"):
            ulysses_attention(shards[0][rank], shards[1][rank], shards[2][rank], group=group, impl=impl,
                              joint=None, causal=rank == 0, seq_len=case[2])
    for impl in ("serial", "fused"):
        for rnd in range(3):
            full, joint, shards = make_inputs(case, seed=1000 + rnd)
            if rank == rnd % P:
                time.sleep(0.5)  # a late rank: the others wait inside the barrier kernel
            res = ulysses_attention(shards[0][rank], shards[1][rank], shards[2][rank], group=group, impl=impl,
                                    joint=joint, causal=case[-1], seq_len=case[2])
            out, jout = helpers.pair(res, joint)
            want_seq, want_joint = reference_outputs(case, joint, shards)
            check_exact(case, rank, out, jout, want_seq, want_joint)
            check_tolerance(case, rank, out, jout, full, joint)
        # CUDA graph on real ranks
        q, k, v = (s[rank].clone() for s in shards)
        jt = tuple(t.clone() for t in joint) if joint is not None else None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            g = ulysses_attention(q, k, v, group=group, impl=impl, joint=jt, causal=case[-1], seq_len=case[2])
        torch.cuda.current_stream().wait_stream(s)
        g_out, g_jout = g if joint is not None else (g, None)
        for rnd in range(3):
            full, joint, shards = make_inputs(case, seed=2000 + rnd)
            q.copy_(shards[0][rank]), k.copy_(shards[1][rank]), v.copy_(shards[2][rank])
            if jt is not None:
                for a, b in zip(jt, joint):
                    a.copy_(b)
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
            want_seq, want_joint = reference_outputs(case, joint, shards)
            check_exact(case, rank, g_out, g_jout, want_seq, want_joint)
    from ulysses.transport import get_transport

    get_transport(group).check()


def test_real_ranks_two_and_four_processes_one_gpu():
    from ulysses.transport import close_transports

    run_on_gloo_groups(_real_ranks, (2, 4), cuda=True, timeout_s=300, teardown=close_transports)
