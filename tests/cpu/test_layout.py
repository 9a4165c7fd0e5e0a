"""Ulysses index math: partition numbers, GQA head maps, joint rows, and data moved bit-exactly.

Moved data carries a hash of its coordinates: element (b, s, h, d) of a [B, S, H, D] tensor holds
((b*S + s)*H + h)*D + d + 1, exact in float64, so any misplaced or dropped element shows and the
zero padding (value 0) is told apart from every real element.
"""
import pytest
import torch

from ulysses.layout import (UlyssesLayout, gather_heads, gather_seq, head_to_seq, seq_to_head,
                            split_seq, take_heads)

# (seq_len, num_heads, num_kv_heads, world_size, joint_len): odd heads, uneven S, GQA with
# kv heads < P, = P and > P (dividing and not), joint tokens.
CASES = [
    (7, 3, 3, 1, 0), (7, 3, 1, 1, 2),
    (9, 5, 5, 2, 0), (16, 8, 4, 2, 3), (11, 10, 5, 2, 0), (6, 4, 1, 2, 1),
    (13, 7, 7, 3, 0), (10, 9, 3, 3, 4), (8, 6, 2, 3, 0), (5, 3, 1, 3, 2),
    (10, 8, 2, 4, 0), (9, 12, 6, 4, 3), (13, 6, 2, 4, 0), (5, 7, 7, 4, 1), (3, 16, 8, 4, 2),
]


def hashed(B, S, H, D):
    b, s, h, d = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (B, S, H, D)), indexing="ij")
    return ((b * S + s) * H + h) * D + d + 1


def expected_head_layout(B, S, H, D, seq_pad, heads):
    """What rank holds after the pre-A2A: rows [0, seq_pad), global heads `heads`; padding = 0."""
    b = torch.arange(B, dtype=torch.float64)[:, None, None, None]
    s = torch.arange(seq_pad, dtype=torch.float64)[None, :, None, None]
    h = torch.tensor(heads, dtype=torch.float64)[None, None, :, None]
    d = torch.arange(D, dtype=torch.float64)[None, None, None, :]
    value = ((b * S + s) * H + h) * D + d + 1
    return torch.where((s < S) & (h < H), value, torch.zeros(()))


@pytest.mark.parametrize(
    "args, expect",
    [
        # S, H, Hkv, P -> S_loc, S_pad, H_loc, H_pad, Hkv_loc, qpk, kv_head_index
        ((13, 7, 7, 3), (5, 15, 3, 9, 3, 1, ((0, 1, 2), (3, 4, 5), (6, 6, 6)))),
        ((16, 8, 4, 2), (8, 16, 4, 8, 2, 2, ((0, 1), (2, 3)))),
        ((8, 8, 2, 4), (2, 8, 2, 8, 1, 2, ((0,), (0,), (1,), (1,)))),
        ((9, 9, 3, 3), (3, 9, 3, 9, 1, 3, ((0,), (1,), (2,)))),
        ((8, 4, 1, 4), (2, 8, 1, 4, 1, 1, ((0,), (0,), (0,), (0,)))),
        ((8, 12, 6, 4), (2, 8, 3, 12, 3, 1, ((0, 0, 1), (1, 2, 2), (3, 3, 4), (4, 5, 5)))),
        ((5, 1, 1, 2), (3, 6, 1, 2, 1, 1, ((0,), (0,)))),
        ((8, 16, 4, 2), (4, 8, 8, 16, 2, 4, ((0, 1), (2, 3)))),
    ],
)
def test_layout_numbers(args, expect):
    L = UlyssesLayout(*args)
    got = (L.seq_loc, L.seq_pad, L.heads_loc, L.heads_pad, L.kv_heads_loc, L.qhead_per_kvhead,
           L.kv_head_index)
    assert got == expect
    assert L.q_head_index == tuple(tuple(range(r * L.heads_loc, (r + 1) * L.heads_loc))
                                   for r in range(L.world_size))


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_gqa_kv_heads_serve_every_query_head(P):
    for H in range(1, 25):
        for Hkv in (n for n in range(1, H + 1) if H % n == 0):
            L = UlyssesLayout(16, H, Hkv, P)
            g, qpk = H // Hkv, L.qhead_per_kvhead
            assert L.heads_loc % qpk == 0 and L.kv_heads_loc == L.heads_loc // qpk
            for r in range(P):
                row = L.kv_heads_of(r)
                assert len(row) == L.kv_heads_loc and all(0 <= x < Hkv for x in row)
                for j in range(L.heads_loc):
                    h = L.head_global(r, j)
                    if h < H:
                        assert row[j // qpk] == h // g, (H, Hkv, P, r, j)
            if Hkv % P == 0:  # a plain split, nothing replicated
                assert qpk == g and L.kv_head_index == tuple(
                    tuple(range(r * Hkv // P, (r + 1) * Hkv // P)) for r in range(P))


@pytest.mark.parametrize("case", CASES)
def test_index_helpers(case):
    S, H, Hkv, P, J = case
    L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
    owners = [L.seq_owner(s) for s in range(L.seq_pad)]
    assert sorted(owners) == [(r, i) for r in range(P) for i in range(L.seq_loc)]
    assert all(L.seq_row(*o) == s for s, o in enumerate(owners))
    assert sum(L.valid_rows(r) for r in range(P)) == S
    assert [L.valid_rows(r) for r in range(P)] == [sum(1 for s in range(S) if L.seq_owner(s)[0] == r)
                                                   for r in range(P)]
    heads = [L.head_owner(h) for h in range(L.heads_pad)]
    assert sorted(heads) == [(r, j) for r in range(P) for j in range(L.heads_loc)]
    assert all(L.head_global(*o) == h for h, o in enumerate(heads))
    # Head-layout rows: q and k/v orders are both permutations of [0, N).
    q_rows = [L.q_row(s) for s in range(L.seq_pad)] + [L.q_joint_row(j) for j in range(J)]
    kv_valid = [L.kv_row(s) for s in range(S)] + [L.kv_joint_row(j) for j in range(J)]
    kv_pad = [L.kv_row(s) for s in range(S, L.seq_pad)]
    assert sorted(q_rows) == list(range(L.num_rows)) == sorted(kv_valid + kv_pad)
    assert q_rows[: L.seq_pad] == list(range(L.seq_pad))
    used = L.seqused_k()
    if L.seq_pad == S:
        assert used is None and kv_valid == q_rows
    else:  # every padded key in the masked suffix, every real key before it
        assert used == S + J and max(kv_valid) < used <= min(kv_pad)
    src = L.kv_row_source()
    assert [int(src[L.kv_row(s)]) for s in range(L.seq_pad)] == list(range(L.seq_pad))
    assert [int(src[L.kv_joint_row(j)]) for j in range(J)] == list(range(L.seq_pad, L.num_rows))
    if J == 0:
        assert L.seqused_k(causal=True) is None
    else:
        with pytest.raises(ValueError, match="causal"):
            L.seqused_k(causal=True)


@pytest.mark.parametrize("case", CASES)
def test_seq_to_head_bit_exact(case):
    S, H, Hkv, P, _ = case
    B, D = 2, 3
    L = UlyssesLayout(S, H, Hkv, P)
    for heads, index in ((H, L.q_head_index), (Hkv, L.kv_head_index)):
        x = hashed(B, S, heads, D)
        shards = split_seq(x, P)
        assert len(shards) == P and all(t.shape == (B, L.seq_loc, heads, D) for t in shards)
        assert torch.equal(gather_seq(shards, S), x)
        ys = seq_to_head(shards, index)
        for r in range(P):
            assert torch.equal(ys[r], expected_head_layout(B, S, heads, D, L.seq_pad, index[r]))
    # Default index = the query split; head_to_seq inverts it bit-exactly, padding dropped.
    x = hashed(B, S, H, D)
    shards = split_seq(x, P)
    ys = seq_to_head(shards)
    assert all(torch.equal(a, b) for a, b in zip(ys, seq_to_head(shards, L.q_head_index)))
    back = head_to_seq(ys, H)
    assert all(torch.equal(a, b) for a, b in zip(back, shards))
    padded = head_to_seq(ys)
    assert padded[0].shape == (B, L.seq_loc, L.heads_pad, D)
    assert torch.count_nonzero(padded[0][:, :, H:]) == 0


def test_head_to_seq_bit_exact():
    """Head-layout data encoded directly (global row, global head) lands where the layout says."""
    B, D = 2, 3
    for S, H, Hkv, P, _ in CASES:
        L = UlyssesLayout(S, H, Hkv, P)
        full = hashed(B, L.seq_pad, L.heads_pad, D)
        ys = [full[:, :, list(L.q_head_index[r])] for r in range(P)]
        out = head_to_seq(ys, H)
        for d in range(P):
            rows = [L.seq_row(d, i) for i in range(L.seq_loc)]
            assert torch.equal(out[d], full[:, rows, :H])


@pytest.mark.parametrize("case", [c for c in CASES if c[4]])
def test_joint_rows_and_heads(case):
    S, H, Hkv, P, J = case
    B, D = 2, 3
    L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
    jq, jk = -hashed(B, J, H, D), -hashed(B, J, Hkv, D)  # negative: never confused with sequence data
    parts = [L.joint_q_heads(jq, r) for r in range(P)]
    assert all(torch.equal(p, take_heads(jq, L.q_head_index[r])) for r, p in enumerate(parts))
    assert torch.equal(gather_heads(parts, H), jq)  # the all-gather over heads restores joint q
    for r in range(P):
        kj = L.joint_kv_heads(jk, r)
        assert torch.equal(kj, jk[:, :, list(L.kv_heads_of(r))])
        seq_q = hashed(B, L.seq_pad, L.heads_loc, D)
        seq_k = hashed(B, L.seq_pad, L.kv_heads_loc, D)
        q = L.assemble_q(seq_q, parts[r])
        k = L.assemble_kv(seq_k, kj)
        assert q.shape[1] == k.shape[1] == L.num_rows
        for s in range(L.seq_pad):
            assert torch.equal(q[:, L.q_row(s)], seq_q[:, s])
            assert torch.equal(k[:, L.kv_row(s)], seq_k[:, s])
        for j in range(J):
            assert torch.equal(q[:, L.q_joint_row(j)], parts[r][:, j])
            assert torch.equal(k[:, L.kv_joint_row(j)], kj[:, j])
        o_seq, o_joint = L.split_out(q)
        assert torch.equal(o_seq, seq_q) and torch.equal(o_joint, parts[r])


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="seq_len"):
        UlyssesLayout(0, 4, 4, 2)
    with pytest.raises(ValueError, match="num_heads"):
        UlyssesLayout(8, 0, None, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        UlyssesLayout(8, 6, 4, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        UlyssesLayout(8, 6, 0, 2)
    with pytest.raises(ValueError, match="world_size"):
        UlyssesLayout(8, 4, 4, 0)
    with pytest.raises(ValueError, match="joint_len"):
        UlyssesLayout(8, 4, 4, 2, joint_len=-1)
    with pytest.raises(ValueError, match="world_size"):
        UlyssesLayout(8, 4, 4, 2.0)
    with pytest.raises(ValueError, match="seq_len"):
        UlyssesLayout(True, 4, 4, 2)
    with pytest.raises(ValueError, match="seq_len"):
        UlyssesLayout.from_shard(4, 4, 4, 2, seq_len=6)  # fits 3 rows per rank, not 4
    assert UlyssesLayout.from_shard(4, 4, None, 2, seq_len=7).seq_len == 7
    L = UlyssesLayout(9, 5, 5, 2, joint_len=2)
    for fn, arg in ((L.seq_owner, "s"), (L.head_owner, "h"), (L.valid_rows, "rank"),
                    (L.kv_heads_of, "rank"), (L.q_joint_row, "j")):
        with pytest.raises(ValueError, match=arg):
            fn(10 ** 6)
    with pytest.raises(ValueError, match="s: expected an int >= 0"):
        L.kv_row(-1)
    x = torch.randn(1, 4, 5, 2)
    with pytest.raises(ValueError, match="xs"):
        seq_to_head(x)
    with pytest.raises(ValueError, match=r"xs\[1\]"):
        seq_to_head([x, torch.randn(1, 4, 4, 2)])
    with pytest.raises(ValueError, match=r"xs\[1\]"):
        seq_to_head([x, x.double()])
    with pytest.raises(ValueError, match="head_index"):
        seq_to_head([x, x], [[0, 1]])
    with pytest.raises(ValueError, match="ys"):
        head_to_seq([torch.randn(1, 5, 3, 2)] * 2)
    with pytest.raises(ValueError, match="num_heads"):
        head_to_seq([torch.randn(1, 4, 3, 2)] * 2, num_heads=7)
    with pytest.raises(ValueError, match="seq"):
        L.assemble_q(torch.randn(1, 9, 3, 2), torch.randn(1, 2, 3, 2))
    with pytest.raises(ValueError, match="joint is required"):
        L.assemble_q(torch.randn(1, 10, 3, 2))
    with pytest.raises(ValueError, match="joint"):
        L.assemble_kv(torch.randn(1, 10, 3, 2), torch.randn(1, 3, 3, 2))
    with pytest.raises(ValueError, match="joint q"):
        L.joint_q_heads(torch.randn(1, 2, 4, 2), 0)
    with pytest.raises(ValueError, match="world_size"):
        split_seq(x, 0)
    with pytest.raises(ValueError, match="seq_len"):
        gather_seq([x, x], seq_len=9)


@pytest.mark.parametrize("rows,J", [((3, 3, 3, 1), 0), ((3, 3, 3, 1), 4), ((5, 3), 2), ((2, 5, 0, 4), 3),
                                    ((0, 0, 7), 0), ((4, 4), 0)])
def test_uneven_key_rows_are_one_permutation(rows, J):
    """The pre-A2A kernel's per-rank key placement (key_rows) is kv_row, and kv_row_source inverts it:
    valid keys compacted in [0, S), joint rows next, padded keys last; queries keep their slots."""
    L = UlyssesLayout(sum(rows), 4, 2, len(rows), J, shard_rows=rows)
    assert L.seq_loc == max(rows) and L.seq_len == sum(rows)
    assert L.is_suffix_padded == (rows == UlyssesLayout(sum(rows), 4, 2, len(rows)).shard_rows)
    source = L.kv_row_source().tolist()
    assert sorted(source) == list(range(L.num_rows))
    for r, n in enumerate(rows):
        valid_base, pad_base = L.key_rows(r)
        for s in range(L.seq_loc):
            kernel_row = valid_base + s if s < n else pad_base + s - n  # cute_kernels/a2a_device.py PreA2A
            assert kernel_row == L.kv_row(r * L.seq_loc + s)
            assert source[kernel_row] == r * L.seq_loc + s
            assert (kernel_row < L.seq_len) == (s < n)
    if L.is_suffix_padded:  # the default split: kv_row(g) = g for g < S, g + J after
        assert all(L.kv_row(g) == (g if g < L.seq_len else g + J) for g in range(L.seq_pad))
