"""Fused FA4 backward + post-A2A of dq, dk, dv (cute_kernels.fa4_bwd_a2a) on one SM90 or SM100 GPU with
emulated ranks: what lands in the NaN-poisoned windows equals FA4's own backward (flash_attn.cute.interface.
_flash_attn_bwd, same inputs) moved by the reference A2A (ulysses.layout.head_to_seq), bit for bit. (The
SM100 kernels, cute_kernels.fa4_bwd_a2a_sm100, have not run here yet: no Blackwell GPU was lent.)

Exactness: both run FA4's deterministic mode (its dQ, and GQA's dK, dV, are fp32 bulk reduce-adds whose
order otherwise varies between runs; deterministic=True orders them by semaphores, the same order in
both). Without it dK, dV of non-GQA calls are still exact (one CTA per KV block) and dQ is compared
with a tolerance. Rows >= seqused_k of dK, dV are left unwritten by design (still NaN).

    python -m pytest -q tests/gpu/test_bwd_a2a.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or (torch.cuda.get_device_capability() != (9, 0)
                                      and torch.cuda.get_device_capability()[0] != 10),
    reason="needs an SM90 or SM100 GPU (FA4's backward of that architecture)")

POISON = float("nan")


def _windows(P, B, S_loc, H, D, dtype, pad=0):
    """P NaN-poisoned windows [B, S_loc, H, D] at a uniform stride (pad elements between them)."""
    win = B * S_loc * H * D + pad
    storage = torch.full((P * win,), POISON, device="cuda", dtype=dtype)
    return storage.as_strided((P, B, S_loc, H, D), (win, S_loc * H * D, H * D, D, 1))


def _expected(grads, P, num_heads):
    """The reference post-A2A of every rank's heads-layout grads [B, N, h, D] -> [P, B, S_loc, P*h, D]."""
    from ulysses.layout import head_to_seq

    return torch.stack(head_to_seq(grads, num_heads))


def _check(name, got, want, unwritten_from=None):
    """got == want bit for bit; rows >= unwritten_from (global row) of every window still NaN."""
    P, B, S_loc = got.shape[:3]
    rows = torch.arange(P * S_loc, device="cuda").view(P, 1, S_loc, 1, 1).expand_as(got)
    written = rows < (unwritten_from if unwritten_from is not None else P * S_loc)
    left = torch.isnan(got) & written
    if left.any():
        where = left.any(dim=(3, 4)).nonzero().tolist()
        pytest.fail(f"{name}: {len(where)} (window, b, row) hold unwritten elements, e.g. {where[:6]}")
    if not torch.isnan(got[~written]).all():
        pytest.fail(f"{name}: rows >= seqused_k were written")
    bad = (got != want) & written
    if bad.any():
        where = bad.any(dim=(3, 4)).nonzero().tolist()
        pytest.fail(f"{name}: {len(where)} (window, b, row) differ from FA4 + reference A2A, e.g. {where[:6]}")


def _run_case(P, B, S_loc, H_loc, D, causal, kv_heads=None, seqused=None, dkv_store=None, deterministic=True,
              dtype=torch.bfloat16, window_pad=0, joint_len=0):
    from flash_attn.cute.interface import _flash_attn_bwd

    from cute_kernels.fa4 import fa4_forward
    from cute_kernels.fa4_bwd_a2a import fa4_bwd_a2a

    torch.manual_seed(1000 * P + S_loc + H_loc + D + joint_len)
    J, H_kv = joint_len, kv_heads or H_loc
    N = P * S_loc + J
    S = (seqused - J) if seqused is not None else P * S_loc  # key rows: S sequence keys, J joint, padding
    scale = D ** -0.5
    sk = None if seqused is None else torch.full((B,), seqused, device="cuda", dtype=torch.int32)
    dq_w = _windows(P, B, S_loc, P * H_loc, D, dtype, window_pad)
    dk_w, dv_w = (_windows(P, B, S_loc, P * H_kv, D, dtype, window_pad) for _ in range(2))
    refs, joints = [], []
    for r in range(P):
        q, do = (torch.randn(B, N, H_loc, D, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(B, N, H_kv, D, device="cuda", dtype=dtype) for _ in range(2))
        lse = torch.empty(B, H_loc, N, device="cuda")
        o = fa4_forward(q, k, v, causal=causal, softmax_scale=scale, seqused_k=sk, lse=lse)
        joint = None
        if J:  # the rank's own joint-row grads, poisoned
            joint = tuple(torch.full((B, J, h, D), POISON, device="cuda", dtype=dtype) for h in (H_loc, H_kv, H_kv))
            joints.append(joint)
        fa4_bwd_a2a(q, k, v, o, do, lse, dq_w, dk_w, dv_w, r, causal=causal, softmax_scale=scale, seqused_k=sk,
                    deterministic=deterministic, dkv_store=dkv_store, joint=joint)
        refs.append(_flash_attn_bwd(q, k, v, o, do, lse, scale, causal, seqused_k=sk, deterministic=deterministic))
    torch.cuda.synchronize()
    dq, dk, dv = (_expected([g[i][:, :P * S_loc] for g in refs], P, None) for i in range(3))
    _check("dk", dk_w, dk, S if J else seqused)
    _check("dv", dv_w, dv, S if J else seqused)
    for r, joint in enumerate(joints):  # query rows P * S_loc.. and key rows S..S + J stay on the rank
        for name, got, want in zip(("djq", "djk", "djv"), joint,
                                   (refs[r][0][:, P * S_loc:], refs[r][1][:, S:S + J], refs[r][2][:, S:S + J])):
            if name != "djq" or deterministic:
                assert torch.equal(got, want), (name, r, "the joint rows differ from FA4's")
    if deterministic:
        _check("dq", dq_w, dq)
    else:
        assert not torch.isnan(dq_w).any(), "dq: unwritten rows"
        torch.testing.assert_close(dq_w, dq, atol=2e-2, rtol=2e-2)


CASES = [
    # P, B, S_loc, H_loc, D, causal: S_loc a multiple of tile_n (128: the TMA path) or not (per-thread
    # stores); FA4's dQ tile rows are 80 (D=128), 64 (D=128 causal), 128 (D=64)
    (2, 1, 256, 2, 128, False),  # TMA dK/dV, dQ tiles straddle (256 % 80)
    (2, 2, 320, 2, 64, True),
    (4, 1, 320, 3, 128, False),  # blocks straddle rank boundaries
    (4, 1, 384, 2, 128, True),
    (8, 1, 256, 3, 128, False),
    (8, 1, 100, 1, 128, True),  # S_loc < tile: a tile spans several ranks
    (8, 2, 200, 2, 64, False),
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,causal", CASES)
def test_fused_backward_matches_fa4_plus_reference_a2a(P, B, S_loc, H_loc, D, causal):
    _run_case(P, B, S_loc, H_loc, D, causal)


def test_per_thread_stores_on_aligned_windows_padded_stride():
    # the "st" path where TMA would do, windows at a stride larger than a window (VMM granularity)
    _run_case(4, 1, 256, 2, 128, False, dkv_store="st", window_pad=4096)


@pytest.mark.parametrize("P,S_loc,H_loc,kv_heads,D,causal", [(4, 384, 4, 1, 128, False), (2, 200, 4, 2, 64, True),
                                                             (8, 128, 2, 1, 128, False)])
def test_gqa_routes_dkv_in_the_postprocess(P, S_loc, H_loc, kv_heads, D, causal):
    _run_case(P, 1, S_loc, H_loc, D, causal, kv_heads=kv_heads)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_padded_keys_are_not_written(kv_heads):
    # seqused_k: dK, dV rows >= 1400 (rank 3's last rows) stay NaN, the rest exact
    _run_case(4, 1, 384, 4, 128, False, kv_heads=kv_heads, seqused=1400)


def test_nondeterministic_mode():
    # FA4's default: dK, dV (one CTA per KV block) exact, dQ (reduce-adds in any order) close
    _run_case(4, 1, 320, 2, 128, False, deterministic=False)


def test_relaunch_and_fp16():
    # a launcher reused (its scratch re-zeroed) gives the same bits again
    from cute_kernels.fa4 import fa4_forward
    from cute_kernels.fa4_bwd_a2a import fa4_bwd_a2a_launcher

    P, B, S_loc, H_loc, D, dtype = 2, 1, 320, 4, 128, torch.float16
    N = P * S_loc
    q, do = (torch.randn(B, N, H_loc, D, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, N, 2, D, device="cuda", dtype=dtype) for _ in range(2))
    lse = torch.empty(B, H_loc, N, device="cuda")
    o = fa4_forward(q, k, v, lse=lse)
    windows = [_windows(P, B, S_loc, P * h, D, dtype) for h in (H_loc, 2, 2)]
    launch = fa4_bwd_a2a_launcher(q, k, v, o, do, lse, *windows, 1, deterministic=True)
    launch()
    first = [w.clone() for w in windows]
    for w in windows:
        w.fill_(POISON)
    launch()
    torch.cuda.synchronize()
    for w, f in zip(windows, first):
        h = w.shape[3] // P  # rank 1's heads
        mine, before = w[:, :, :, h:2 * h], f[:, :, :, h:2 * h]
        assert not torch.isnan(mine).any() and torch.equal(mine, before)


@pytest.mark.parametrize("P,S_loc,H_loc,kv_heads,J,seqused", [
    (2, 256, 2, None, 77, None),  # joint rows, no padding keys: key rows S_pad.. are the joint ones
    (4, 320, 3, None, 33, 4 * 320 - 50 + 33),  # padding keys after the joint ones, tiles straddling
    (4, 384, 4, 1, 64, 4 * 384 - 10 + 64),  # GQA: the postprocesses route the joint rows
    (8, 100, 1, None, 5, None),  # S_loc < tile, a few joint rows
])
def test_joint_rows_stay_on_the_rank(P, S_loc, H_loc, kv_heads, J, seqused):
    """Joint (text) rows: N = P * S_loc + J; query rows >= P * S_loc and key rows S .. S + J - 1 land
    in the rank's own tensors, equal to FA4's own backward's rows; every other row as without them."""
    _run_case(P, 1, S_loc, H_loc, 128, False, kv_heads=kv_heads, seqused=seqused, joint_len=J)
