"""A2A copy kernels and the barrier kernel on one GPU, ranks emulated (windows = local buffers).

Moved data must be bit-identical to the reference A2A of ulysses.layout / ulysses.reference.
Windows are poisoned (NaN) before every run, so an element the kernels never wrote shows; the
window stride is deliberately not the window size (windows carved out of a larger buffer).
Reused windows are run into without poisoning too, so an element left over from the previous
run shows. A barrier timeout makes the transport refuse later calls, naming the missing rank.
"""
import pytest
import torch

from fa_a2a.engine.forward import head_maps as _head_maps
from fa_a2a.op import post_a2a, pre_a2a
from ulysses.layout import UlyssesLayout, head_to_seq, split_seq
from ulysses.reference import emulated_pre_a2a
from ulysses.transport import BarrierTimeoutError, EmulatedTransport

DEV = "cuda"


def strided_windows(P, shape, dtype, gap_elems=40):
    """[P, *shape] windows at a stride of numel + gap (a multiple of 16 bytes), poisoned."""
    contiguous, numel = [], 1
    for s in reversed(shape):
        contiguous.insert(0, numel)
        numel *= s
    stride = numel + gap_elems
    flat = torch.full((P * stride,), float("nan"), dtype=dtype, device=DEV)
    return flat.as_strided((P, *shape), (stride, *contiguous))


# (P, B, S, H, H_kv, D, J, dtype): even and uneven S, head padding, GQA split and replicated, joint.
PRE_CASES = [
    (4, 1, 512, 8, 8, 128, 0, torch.bfloat16),
    (4, 2, 333, 6, 2, 64, 0, torch.float16),
    (2, 2, 257, 5, 1, 128, 17, torch.bfloat16),
    (8, 1, 1000, 24, 8, 128, 0, torch.bfloat16),
    (4, 1, 64, 12, 6, 64, 5, torch.float16),
]


@pytest.mark.parametrize("case", PRE_CASES)
def test_pre_a2a_matches_reference_bit_exact(case):
    *case, dtype = case
    case = tuple(case)
    P, B, S, H, Hkv, D, J = case
    g = torch.Generator(device=DEV).manual_seed(hash(case) % 1000)
    L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
    for run in range(2):  # fresh inputs each run: a stale element from run 0 shows in run 1
        full = [torch.randn(B, S, h, D, device=DEV, dtype=dtype, generator=g) for h in (H, Hkv, Hkv)]
        joint = tuple(torch.randn(B, J, h, D, device=DEV, dtype=dtype, generator=g) for h in (H, Hkv, Hkv)) if J else None
        qs, ks, vs = (split_seq(x, P) for x in full)
        for shards in (qs, ks, vs):  # padding rows hold random data: they move like any row
            for r, t in enumerate(shards):
                n = L.valid_rows(r)
                t[:, n:] = torch.randn(t[:, n:].shape, device=DEV, generator=g).to(dtype)
        dq = strided_windows(P, (B, L.num_rows, L.heads_loc, D), dtype)
        dk = strided_windows(P, (B, L.num_rows, L.kv_heads_loc, D), dtype)
        dv = strided_windows(P, (B, L.num_rows, L.kv_heads_loc, D), dtype)
        for r in range(P):
            pre_a2a(qs[r], ks[r], vs[r], (dq, dk, dv), r, seq_len=S, joint=joint)
        torch.cuda.synchronize()
        ref = emulated_pre_a2a(L, qs, ks, vs, joint)
        for d in range(P):
            for name, got, want in (("q", dq[d], ref[d][0]), ("k", dk[d], ref[d][1]), ("v", dv[d], ref[d][2])):
                assert torch.equal(got, want), (case, run, name, d)


POST_CASES = [
    (4, 1, 256, 3, 128),
    (8, 1, 128, 3, 128),
    (2, 2, 320, 4, 64),  # S_loc not a multiple of 128
    (4, 2, 251, 2, 128),
]


@pytest.mark.parametrize("case", POST_CASES)
def test_post_a2a_matches_reference_bit_exact(case):
    P, B, S_loc, H_loc, D = case
    dtype = torch.bfloat16
    H = P * H_loc
    for run in range(2):
        outs = [torch.randn(B, P * S_loc, H_loc, D, device=DEV, dtype=dtype) for _ in range(P)]
        w = strided_windows(P, (B, S_loc, H, D), dtype)
        for r in range(P):
            post_a2a(outs[r], w, r)
        torch.cuda.synchronize()
        ref = head_to_seq(outs)
        for d in range(P):
            assert torch.equal(w[d], ref[d]), (case, run, d)


def test_reused_windows_carry_no_stale_elements():
    """The same transport windows across runs, as the op's window plan reuses them: poison, run A,
    check; run B into A's leftovers, check (a stale element of A differs from B); poison again, run
    C, check. Pre-A2A with uneven S, padding heads, GQA and joint rows; post-A2A scatter and broadcast."""
    P, B, S, H, Hkv, D, J = 4, 2, 333, 6, 2, 64, 5
    dtype = torch.bfloat16
    L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
    t = EmulatedTransport(P)
    dq = t.windows("q", (B, L.num_rows, L.heads_loc, D), dtype)
    dk = t.windows("k", (B, L.num_rows, L.kv_heads_loc, D), dtype)
    dv = t.windows("v", (B, L.num_rows, L.kv_heads_loc, D), dtype)
    out_w = t.windows("out", (B, L.seq_loc, L.heads_pad, D), dtype)
    jout_w = t.windows("jout", (B, J, L.heads_pad, D), dtype)
    g = torch.Generator(device=DEV).manual_seed(7)
    H_loc = L.heads_loc
    for run, poison in enumerate((True, False, True)):
        if poison:
            for w in t.allocated_windows():
                w.fill_(float("nan"))
        full = [torch.randn(B, S, h, D, device=DEV, dtype=dtype, generator=g) for h in (H, Hkv, Hkv)]
        joint = tuple(torch.randn(B, J, h, D, device=DEV, dtype=dtype, generator=g) for h in (H, Hkv, Hkv))
        qs, ks, vs = (split_seq(x, P) for x in full)
        outs = [torch.randn(B, P * L.seq_loc, H_loc, D, device=DEV, dtype=dtype, generator=g) for _ in range(P)]
        jouts = [torch.randn(B, J, H_loc, D, device=DEV, dtype=dtype, generator=g) for _ in range(P)]
        for r in range(P):
            pre_a2a(qs[r], ks[r], vs[r], (dq, dk, dv), r, seq_len=S, joint=joint)
            post_a2a(outs[r], out_w, r)
            post_a2a(jouts[r], jout_w, r, broadcast=True)
        torch.cuda.synchronize()
        ref = emulated_pre_a2a(L, qs, ks, vs, joint)
        want_out = head_to_seq(outs)
        for d in range(P):
            for name, got, want in (("q", dq[d], ref[d][0]), ("k", dk[d], ref[d][1]), ("v", dv[d], ref[d][2]),
                                    ("out", out_w[d][:, :, :P * H_loc], want_out[d]),
                                    ("joint out", jout_w[d][:, :, :P * H_loc], torch.cat(jouts, dim=2))):
                assert torch.equal(got, want), (run, name, d)


def test_post_a2a_broadcast_and_head_padding():
    P, B, J, H_loc, D = 4, 2, 77, 3, 64
    dtype = torch.float16
    H_pad = P * H_loc + 2  # windows wider than P*H_loc: the extra heads stay untouched
    outs = [torch.randn(B, J, H_loc, D, device=DEV, dtype=dtype) for _ in range(P)]
    w = strided_windows(P, (B, J, H_pad, D), dtype)
    for r in range(P):
        post_a2a(outs[r], w, r, broadcast=True)
    torch.cuda.synchronize()
    want = torch.cat(outs, dim=2)
    for d in range(P):
        assert torch.equal(w[d][:, :, :P * H_loc], want)
        assert torch.isnan(w[d][:, :, P * H_loc:]).all()


def test_post_a2a_bad_arguments():
    w = strided_windows(2, (1, 4, 4, 64), torch.bfloat16)
    o = torch.randn(1, 8, 2, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rank"):
        post_a2a(o, w, 2)
    with pytest.raises(ValueError, match="o:"):
        post_a2a(o[:, :7], w, 0)
    with pytest.raises(ValueError, match="o:"):
        post_a2a(o.float(), w, 0)
    with pytest.raises(ValueError, match="out_windows"):
        post_a2a(o, w[:, :, :, :3], 0)


def test_head_maps_mark_padding_heads():
    L = UlyssesLayout(8, 6, 2, 4)
    q_map, kv_map = _head_maps(L, DEV)
    assert q_map.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert kv_map.tolist() == [h for row in L.kv_head_index for h in row]


# ---- barrier ---------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4, 8])
def test_emulated_barrier_counts_epochs(P):
    t = EmulatedTransport(P)
    for _ in range(5):
        t.barrier()
    torch.cuda.synchronize()
    assert t.epoch.tolist() == [5] * P
    assert t.signal.cpu().tolist() == [[5] * P] * P
    t.check()


def test_barrier_timeout_names_the_missing_rank_and_refuses_later_calls():
    from cute_kernels.signal import barrier

    P = 4
    t = EmulatedTransport(P, timeout_s=0.05)
    w = t.windows("x", (8,), torch.float32)
    # ranks 0..2 arrive, rank 3 never does
    barrier(t.signal, t.epoch[:P - 1], t.error[:P - 1], 0, int(0.05e9), error_host=t.error_host[:P - 1])
    torch.cuda.synchronize()
    assert t.error_host[:P - 1, 3].tolist() == [1] * (P - 1)  # the host-mapped mirror
    # later calls are refused, naming the missing rank, without a check() first
    for call in (t.barrier, lambda: t.windows("x", (8,), torch.float32)):
        with pytest.raises(BarrierTimeoutError, match="refused.*for rank 3, which never arrived") as info:
            call()
        assert sorted(info.value.missing) == [(r, 3, 1) for r in range(P - 1)]
    with pytest.raises(BarrierTimeoutError, match="for rank 3, which never arrived"):
        t.check()
    assert t.epoch[:P - 1].tolist() == [1] * (P - 1)  # nothing launched after the refusal
    # the kernel on its own (as in a replayed graph): poisoned, it signals but does not wait
    barrier(t.signal, t.epoch[:P - 1], t.error[:P - 1], 0, int(60e9), error_host=t.error_host[:P - 1])
    torch.cuda.synchronize()
    assert t.epoch[:P - 1].tolist() == [2] * (P - 1)
    assert w.shape == (P, 8)


def test_barrier_rejects_an_unpinned_error_mirror():
    from cute_kernels.signal import barrier

    t = EmulatedTransport(2)
    with pytest.raises(ValueError, match="error_host"):
        barrier(t.signal, t.epoch, t.error, 0, int(1e9), error_host=torch.zeros(2, 2, dtype=torch.int32))


def test_emulated_barrier_in_cuda_graph():
    P = 4
    t = EmulatedTransport(P)
    t.barrier()  # warm-up compile
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            t.barrier()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(1000):
        graph.replay()
    torch.cuda.synchronize()
    assert t.epoch.tolist() == [1001] * P
    t.check()
