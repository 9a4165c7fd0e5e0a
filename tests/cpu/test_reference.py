"""Serial Ulysses reference: oracle, emulated ranks, and real ranks over gloo.

Attention is checked against the fp64 full-attention oracle on the unsplit sequence: the error
must stay within 2x the error of the same oracle computed in fp32, plus 1e-6. The padding rows of
the shards hold large random values (not zeros), so an unmasked padded key shows. Data moved by
the gloo A2As is checked bit-exactly against coordinate hashes. All gloo work runs in one spawn of
4 processes; P = 1, 2, 3, 4 are subgroups of it.
"""

import pytest
import torch

from ulysses.layout import UlyssesLayout, gather_seq, seq_to_head, split_seq
from ulysses.reference import (dist_gather_heads, dist_head_to_seq, dist_seq_to_head,
                               emulated_post_a2a, emulated_pre_a2a, emulated_ulysses_attention,
                               full_attention, local_attention, ulysses_reference_attention)

from tests.helpers import check_attention as _check, make_inputs, oracles, pair
from tests.multiproc import run_on_gloo_groups


def check_attention(out, ref, base):
    _check(out, ref, base, 1e-6)

# (P, B, S, H, H_kv, D, J, causal): odd heads, uneven S, GQA with kv heads < P and > P, joint.
CASES = [
    (1, 2, 7, 3, 1, 16, 0, True),
    (1, 1, 9, 5, 5, 8, 3, False),
    (2, 2, 9, 5, 5, 16, 0, False),
    (2, 1, 12, 6, 3, 8, 4, False),
    (2, 2, 11, 4, 1, 8, 0, True),
    (3, 2, 13, 7, 7, 16, 0, True),
    (3, 1, 10, 9, 3, 8, 5, False),
    (3, 2, 14, 6, 2, 8, 0, False),
    (4, 2, 10, 8, 2, 16, 3, False),
    (4, 1, 9, 12, 6, 8, 0, True),
    (4, 2, 13, 7, 7, 8, 2, False),
    (4, 1, 5, 6, 6, 8, 0, False),  # S < P + 2: the last rank holds padding only
]
GLOO_CASES = {P: [c for c in CASES if c[0] == P] for P in (1, 2, 3, 4)}


def test_local_attention_matches_explicit_softmax():
    g = torch.Generator().manual_seed(1)
    B, Nq, Nk, Hq, Hk, D = 2, 7, 9, 6, 2, 8
    q = torch.randn(B, Nq, Hq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Nk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    for causal, used in ((False, None), (False, 5), (True, None), (True, 6)):
        kk, vv = (t.repeat_interleave(Hq // Hk, dim=2) for t in (k, v))
        logits = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
        keep = torch.ones(Nq, Nk, dtype=torch.bool)
        if used is not None:
            keep[:, used:] = False
        if causal:
            keep &= torch.ones(Nq, Nk, dtype=torch.bool).tril()
        p = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        expect = torch.einsum("bhqk,bkhd->bqhd", p, vv)
        got = local_attention(q, k, v, causal=causal, softmax_scale=0.3, seqused_k=used)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)


def test_full_attention_joint_is_attention_over_the_concatenation():
    (q, k, v), joint, _ = make_inputs((1, 2, 6, 4, 2, 8, 3, False), seed=2)
    out, jout = full_attention(q, k, v, joint=joint)
    both = full_attention(*(torch.cat([x, j], dim=1) for x, j in zip((q, k, v), joint)))
    torch.testing.assert_close(torch.cat([out, jout], dim=1), both, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_emulated_matches_oracle(case):
    P, B, S, H, Hkv, D, J, causal = case
    full, joint, (qs, ks, vs) = make_inputs(case, seed=10)
    res = emulated_ulysses_attention(qs, ks, vs, joint=joint, causal=causal, seq_len=S)
    outs, jout = pair(res, joint)
    assert len(outs) == P and all(o.shape == qs[0].shape and o.dtype == torch.float32 for o in outs)
    (ref, jref), (base, jbase) = oracles(full, joint, causal)
    check_attention(gather_seq(outs, S), ref, base)
    if joint is not None:
        assert jout.shape == (B, J, H, D)
        check_attention(jout, jref, jbase)


def test_emulated_halves_and_kernel_view():
    """emulated_pre_a2a gives the head-layout tensors a kernel sees; post(attention(pre)) == whole."""
    case = (3, 2, 10, 9, 3, 8, 5, False)
    _, joint, (qs, ks, vs) = make_inputs(case, seed=3)
    L = UlyssesLayout.from_shard(qs[0].shape[1], 9, 3, 3, seq_len=10, joint_len=5)
    ranks = emulated_pre_a2a(L, qs, ks, vs, joint)
    for q, k, v in ranks:
        assert q.shape == (2, L.num_rows, L.heads_loc, 8) and k.shape == v.shape == (2, L.num_rows, L.kv_heads_loc, 8)
    outs = [local_attention(q, k, v, seqused_k=L.seqused_k()) for q, k, v in ranks]
    seq, jout = emulated_post_a2a(L, outs)
    whole, jwhole = emulated_ulysses_attention(qs, ks, vs, joint=joint, seq_len=10)
    assert all(torch.equal(a, b) for a, b in zip(seq, whole)) and torch.equal(jout, jwhole)


def test_bad_input_names_the_argument():
    _, joint, (qs, ks, vs) = make_inputs((2, 1, 8, 4, 2, 8, 2, False), seed=4)
    with pytest.raises(ValueError, match="causal"):
        emulated_ulysses_attention(qs, ks, vs, joint=joint, causal=True)
    with pytest.raises(ValueError, match="causal"):
        full_attention(torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1), joint=joint, causal=True)
    with pytest.raises(ValueError, match="seq_len"):
        emulated_ulysses_attention(qs, ks, vs, seq_len=3)
    with pytest.raises(ValueError, match="ks"):
        emulated_ulysses_attention(qs, [k[:, :3] for k in ks], vs)
    with pytest.raises(ValueError, match="num_kv_heads"):
        emulated_ulysses_attention(qs, [k[:, :, :1].expand(-1, -1, 3, -1) for k in ks],
                                   [v[:, :, :1].expand(-1, -1, 3, -1) for v in vs])
    with pytest.raises(ValueError, match="joint k"):
        emulated_ulysses_attention(qs, ks, vs, joint=(joint[0], joint[0], joint[2]))
    with pytest.raises(ValueError, match="joint"):
        emulated_ulysses_attention(qs, ks, vs, joint=joint[:2])
    with pytest.raises(ValueError, match="dtype"):
        full_attention(qs[0], ks[0].double(), vs[0])
    with pytest.raises(ValueError, match="seqused_k"):
        local_attention(qs[0], ks[0], vs[0], seqused_k=0)


# ---- real ranks over gloo ---------------------------------------------------------------------
def hashed(B, S, H, D, offset=0.0):
    b, s, h, d = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (B, S, H, D)), indexing="ij")
    return ((b * S + s) * H + h) * D + d + 1 + offset


def _check_moves(P, group, rank):
    """Pre/post A2A and the head all-gather move hash-coded data bit-exactly."""
    B, D = 2, 3
    for S, H, Hkv, J in ((9, 7, 7, 2), (10, 12, 6, 3), (7, 6, 2, 1)):
        L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
        for heads, index in ((H, L.q_head_index), (Hkv, L.kv_head_index)):
            shards = split_seq(hashed(B, S, heads, D), P)
            got = dist_seq_to_head(shards[rank], index, group=group)
            b = torch.arange(B, dtype=torch.float64)[:, None, None, None]
            s = torch.arange(L.seq_pad, dtype=torch.float64)[None, :, None, None]
            h = torch.tensor(index[rank], dtype=torch.float64)[None, None, :, None]
            d = torch.arange(D, dtype=torch.float64)
            expect = torch.where((s < S) & (h < heads), ((b * S + s) * heads + h) * D + d + 1, torch.zeros(()))
            assert torch.equal(got, expect), (P, rank, S, H, Hkv)
            assert torch.equal(got, seq_to_head(shards, index)[rank])
        full = hashed(B, L.seq_pad, L.heads_pad, D, offset=0.5)  # head layout, global coordinates
        mine = full[:, :, list(L.q_head_index[rank])].contiguous()
        got = dist_head_to_seq(mine, group=group, num_heads=H)
        rows = [L.seq_row(rank, i) for i in range(L.seq_loc)]
        assert torch.equal(got, full[:, rows, :H])
        jfull = hashed(B, J, L.heads_pad, D, offset=-0.25)
        got = dist_gather_heads(jfull[:, :, list(L.q_head_index[rank])].contiguous(), group=group, num_heads=H)
        assert torch.equal(got, jfull[:, :, :H])


def _check_attention(P, group, rank):
    for i, case in enumerate(GLOO_CASES[P]):
        _, _, S, H, Hkv, D, J, causal = case
        full, joint, (qs, ks, vs) = make_inputs(case, seed=100 + i)  # the same on every rank
        res = ulysses_reference_attention(qs[rank], ks[rank], vs[rank], group=group, joint=joint,
                                          causal=causal, seq_len=S)
        out, jout = pair(res, joint)
        emu = emulated_ulysses_attention(qs, ks, vs, joint=joint, causal=causal, seq_len=S)
        emu_out, emu_jout = emu if joint is not None else (emu, None)
        assert torch.equal(out, emu_out[rank]), case  # same ops on the same data: bit-identical
        (ref, jref), (base, jbase) = oracles(full, joint, causal)
        L = UlyssesLayout(S, H, Hkv, P)
        n = L.valid_rows(rank)
        first = rank * L.seq_loc
        if n:  # a rank may hold padding rows only
            check_attention(out[:, :n], ref[:, first:first + n], base[:, first:first + n])
        if joint is not None:
            assert torch.equal(jout, emu_jout)
            check_attention(jout, jref, jbase)


# Uneven shards (diffusers' ulysses_anything): rank r holds the next shard_rows[r] rows of the sequence.
UNEVEN = [((5, 3), 4, 2, 0, False), ((4, 4, 2), 6, 3, 3, False), ((2, 5, 0, 4), 5, 5, 2, False),
          ((1, 3, 3), 4, 4, 0, False)]


def _uneven_inputs(rows, H, Hkv, J, seed):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(2, sum(rows), h, 8, generator=g) for h in (H, Hkv, Hkv)]
    joint = tuple(torch.randn(2, J, h, 8, generator=g) for h in (H, Hkv, Hkv)) if J else None
    shards = [list(x.split(rows, dim=1)) for x in full]
    return full, joint, shards


def _check_uneven(outs, jout, rows, full, joint, causal):
    (ref, jref), (base, jbase) = oracles(full, joint, causal)
    for r, n in enumerate(rows):
        first = sum(rows[:r])
        assert outs[r].shape[1] == n
        if n:
            check_attention(outs[r], ref[:, first:first + n], base[:, first:first + n])
    if joint is not None:
        check_attention(jout, jref, jbase)


@pytest.mark.parametrize("rows,H,Hkv,J,causal", UNEVEN)
def test_uneven_shards_emulated_match_oracle(rows, H, Hkv, J, causal):
    full, joint, (qs, ks, vs) = _uneven_inputs(rows, H, Hkv, J, seed=sum(rows))
    outs, jout = pair(emulated_ulysses_attention(qs, ks, vs, joint=joint, causal=causal, shard_rows=rows), joint)
    _check_uneven(outs, jout, rows, full, joint, causal)


def test_uneven_shards_refuse_causal_and_wrong_rows():
    full, joint, (qs, ks, vs) = _uneven_inputs((5, 3), 4, 4, 0, seed=1)
    with pytest.raises(ValueError, match="causal"):
        emulated_ulysses_attention(qs, ks, vs, causal=True, shard_rows=(5, 3))
    with pytest.raises(ValueError, match="rows"):
        emulated_ulysses_attention(qs, ks, vs, shard_rows=(4, 4))
    with pytest.raises(ValueError, match="shard_rows"):
        emulated_ulysses_attention(qs, ks, vs, shard_rows=(5, 3, 0))


def _check_uneven_gloo(P, group, rank):
    for i, (rows, H, Hkv, J, causal) in enumerate(c for c in UNEVEN if len(c[0]) == P):
        full, joint, shards = _uneven_inputs(rows, H, Hkv, J, seed=sum(rows))
        res = ulysses_reference_attention(*(s[rank] for s in shards), group=group, joint=joint, causal=causal,
                                          shard_rows=rows)
        out, jout = pair(res, joint)
        want, want_joint = pair(emulated_ulysses_attention(*shards, joint=joint, causal=causal, shard_rows=rows),
                                joint)
        assert torch.equal(out, want[rank]) and (joint is None or torch.equal(jout, want_joint))


def _check_moves_and_attention(P, group, rank):
    _check_moves(P, group, rank)
    _check_attention(P, group, rank)
    _check_uneven_gloo(P, group, rank)


def test_gloo_ranks_match_emulated_and_oracle():
    run_on_gloo_groups(_check_moves_and_attention, (1, 2, 3, 4))
