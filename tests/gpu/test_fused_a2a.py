"""Fused FA4 + post-A2A on one GPU with emulated ranks: bit-exact to FA4 moved by the reference A2A."""

import math

import pytest
import torch

from cute_kernels.fa4 import fa4_a2a_forward, fa4_forward, tile_m_for

POISON = float("nan")


def _reference_windows(outs, P):
    """Reference post-A2A of per-source-rank FA4 outputs [B, S, H_loc, D] -> windows [P, B, S_loc, H, D]."""
    B, S, H_loc, D = outs[0].shape
    S_loc = S // P
    # source r, row s = d*S_loc + i, head h -> window d, row i, head r*H_loc + h
    per_src = [o.view(B, P, S_loc, H_loc, D).permute(1, 0, 2, 3, 4) for o in outs]
    return torch.cat(per_src, dim=3)


def _windows(P, win_elems, dtype, host, keep):
    """P windows of win_elems elements, NaN-poisoned, in HBM or in pinned host memory."""
    if not host:
        return torch.full((P * win_elems,), POISON, device="cuda", dtype=dtype)
    from ulysses.transport import tensor_from_address

    nbytes = P * win_elems * torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    keep.append(buf)
    storage = tensor_from_address(buf.data_ptr(), nbytes, torch.device("cuda", torch.cuda.current_device()))
    return storage.view(dtype).fill_(POISON)


def _run_case(P, B, S_loc, H_loc, D, dtype, causal, kv_heads=None, window_pad=0, seqused=None, extra_keys=0,
              with_lse=False, o_store=None, host=False, rotate=False):
    """Every rank r of P runs the fused kernel into NaN-poisoned windows; the windows must equal
    FA4's outputs moved by the reference A2A bit for bit. rotate: the rank-rotated build, and
    then also the default build into fresh poisoned windows, the two compared bit for bit."""
    torch.manual_seed(1000 * P + S_loc + H_loc + D)
    S, H = P * S_loc, P * H_loc
    H_kv = kv_heads or H_loc
    qs = [torch.randn(B, S, H_loc, D, device="cuda", dtype=dtype) for _ in range(P)]
    S_k = S + extra_keys
    ks = [torch.randn(B, S_k, H_kv, D, device="cuda", dtype=dtype) for _ in range(P)]
    vs = [torch.randn(B, S_k, H_kv, D, device="cuda", dtype=dtype) for _ in range(P)]
    win_elems = B * S_loc * H * D + window_pad
    keep = []
    storage = _windows(P, win_elems, dtype, host, keep)
    windows = storage.as_strided((P, B, S_loc, H, D), (win_elems, S_loc * H * D, H * D, D, 1))
    sk = None if seqused is None else torch.full((B,), seqused, device="cuda", dtype=torch.int32)
    lse_windows = lses = None
    if with_lse:
        lse_windows = torch.full((P, B, H, S_loc), POISON, device="cuda")
        lses = [torch.empty(B, H_loc, S, device="cuda") for _ in range(P)]
    for r in range(P):
        fa4_a2a_forward(qs[r], ks[r], vs[r], windows, r, causal=causal, seqused_k=sk, lse_windows=lse_windows,
                        o_store=o_store, rotate=rotate)
    if rotate:
        storage_off = _windows(P, win_elems, dtype, host, keep)
        windows_off = storage_off.as_strided(windows.shape, windows.stride())
        lse_off = None if lse_windows is None else torch.full_like(lse_windows, POISON)
        for r in range(P):
            fa4_a2a_forward(qs[r], ks[r], vs[r], windows_off, r, causal=causal, seqused_k=sk, lse_windows=lse_off,
                            o_store=o_store)
        torch.cuda.synchronize()
        assert torch.equal(storage.view(torch.int16), storage_off.view(torch.int16)), "rotate on/off differ"
        if lse_off is not None:
            assert torch.equal(lse_windows.view(torch.int32), lse_off.view(torch.int32)), "rotate on/off LSE differ"
    outs = [fa4_forward(qs[r], ks[r], vs[r], causal=causal, seqused_k=sk, lse=None if lses is None else lses[r])
            for r in range(P)]
    torch.cuda.synchronize()
    if with_lse:
        # lse [B, H_loc, S] of source r -> window d = s // S_loc, head r*H_loc + h, row s % S_loc
        expected_lse = torch.cat([l.view(B, H_loc, P, S_loc).permute(2, 0, 1, 3) for l in lses], dim=2)
        assert not torch.isnan(lse_windows).any(), "some LSE rows were never written"
        assert torch.equal(lse_windows, expected_lse)
    expected = _reference_windows(outs, P)
    bad = (windows != expected) & ~(torch.isnan(windows) & torch.isnan(expected))
    if bad.any():
        where = bad.any(dim=(3, 4)).nonzero().tolist()  # (window, b, row) triples
        unwritten = torch.isnan(windows).any(dim=(3, 4)).nonzero().tolist()
        pytest.fail(f"{len(where)} (window, b, row) differ, e.g. {where[:6]}; "
                    f"{len(unwritten)} hold unwritten elements, e.g. {unwritten[:6]}")
    # and FA4 itself is attention: fp32 reference on rank 0
    q, k, v = (t[0].float() for t in (qs[0][:1], ks[0][:1], vs[0][:1]))
    rep = H_loc // H_kv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = None
    if seqused is not None:
        mask = torch.arange(S_k, device="cuda")[None, :] < seqused
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal and mask is None, scale=1 / math.sqrt(D),
    ).transpose(0, 1)
    err = (outs[0][0].float() - ref).abs().max().item()
    assert err < 2e-2, err


CASES = [
    # P, B, S_loc, H_loc, D, dtype, causal
    (1, 1, 256, 2, 128, torch.bfloat16, False),
    (2, 2, 512, 4, 64, torch.float16, False),
    (4, 1, 320, 3, 128, torch.bfloat16, False),  # tiles straddle rank boundaries
    (4, 2, 200, 2, 64, torch.bfloat16, True),  # straddling, causal, tile_m 192 at D=64
    (8, 1, 256, 3, 128, torch.bfloat16, False),
    (8, 1, 100, 1, 128, torch.float16, True),  # S_loc < tile_m: a tile spans several ranks
    (8, 2, 1000, 2, 128, torch.bfloat16, False),
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,causal", CASES)
def test_fused_matches_fa4_plus_reference_a2a(P, B, S_loc, H_loc, D, dtype, causal):
    _run_case(P, B, S_loc, H_loc, D, dtype, causal)


def test_fused_gqa_padded_windows_and_seqused():
    # GQA (4 query heads per KV head), a window stride larger than the window (as with VMM
    # granularity), and padded keys masked by seqused_k
    _run_case(4, 1, 384, 4, 128, torch.bfloat16, False, kv_heads=1, window_pad=4096, seqused=1400)


@pytest.mark.parametrize("S_loc", [256, 200])  # TMA path, per-thread-store path
def test_fused_routes_lse(S_loc):
    _run_case(4, 2, S_loc, 2, 128, torch.bfloat16, False, with_lse=True)


def test_fused_more_keys_than_queries():
    # joint (text) keys appended after the image sequence: queries route, keys do not
    _run_case(2, 1, 256, 2, 128, torch.bfloat16, False, extra_keys=77)


HOST_CASES = [
    # P, B, S_loc, H_loc, D, dtype, o_store: windows in pinned host memory (stores over PCIe)
    (8, 1, 1024, 3, 128, torch.bfloat16, "tma"),
    (8, 1, 1024, 3, 128, torch.bfloat16, "st"),
    (4, 1, 320, 3, 128, torch.bfloat16, "st"),  # tiles straddle rank boundaries
    (8, 1, 100, 1, 128, torch.float16, "st"),  # S_loc < tile_m: a tile spans several ranks
    (2, 2, 1536, 4, 64, torch.float16, "tma"),  # D = 64 (tile_m 192)
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,o_store", HOST_CASES)
def test_fused_into_host_windows(P, B, S_loc, H_loc, D, dtype, o_store):
    _run_case(P, B, S_loc, H_loc, D, dtype, False, o_store=o_store, host=True)


def test_fused_into_host_windows_lse_gqa():
    _run_case(4, 1, 512, 4, 128, torch.bfloat16, False, kv_heads=2, with_lse=True, host=True)


def test_timestamps_debug_variant():
    # every tile stamped once, in order, by the CTA that ran it; the output still exact
    from cute_kernels.fa4_a2a_sm90 import TIMESTAMP_FIELDS

    P, B, S_loc, H_loc, D = 8, 1, 1024, 3, 128
    q, k, v = (torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fa4_forward(q, k, v)
    expected = _reference_windows([out] * P, P)[:, :, :, :H_loc]
    n_m = P * S_loc // tile_m_for(D)
    for o_store in ("tma", "st"):
        ts = torch.zeros(B, H_loc, n_m, len(TIMESTAMP_FIELDS), dtype=torch.int64, device="cuda")
        windows = torch.full((P, B, S_loc, P * H_loc, D), POISON, device="cuda", dtype=torch.bfloat16)
        fa4_a2a_forward(q, k, v, windows, 0, o_store=o_store, timestamps=ts)
        torch.cuda.synchronize()
        assert torch.equal(windows[:, :, :, :H_loc], expected)
        st = ts.view(-1, len(TIMESTAMP_FIELDS))
        f = {name: st[:, i] for i, name in enumerate(TIMESTAMP_FIELDS)}
        assert bool((f["cta_start"] > 0).all())
        for a, b in zip(TIMESTAMP_FIELDS[2:], TIMESTAMP_FIELDS[3:]):
            assert bool((f[a] <= f[b]).all()), (o_store, a, b)
        n_ctas = len(set(f["cta"].tolist()))
        assert n_ctas == st.shape[0]  # FA4's scheduler: one tile per CTA


def test_tile_m_known():
    assert tile_m_for(128) == 128 and tile_m_for(64) == 192


ROTATE_CASES = [
    # P, B, S_loc, H_loc, D, dtype, kv_heads, with_lse: every rank of P with the rank-rotated order
    (2, 2, 512, 2, 128, torch.bfloat16, None, False),
    (4, 1, 320, 3, 128, torch.bfloat16, None, True),  # tiles straddle ranks (the shift's tile too), LSE
    (4, 1, 384, 4, 128, torch.bfloat16, 1, True),  # GQA, TMA path, LSE
    (8, 1, 256, 3, 128, torch.bfloat16, None, False),
    (8, 1, 100, 1, 128, torch.bfloat16, None, False),  # S_loc < tile_m: a tile spans several ranks
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,kv_heads,with_lse", ROTATE_CASES)
def test_rotated_order_is_bit_exact(P, B, S_loc, H_loc, D, dtype, kv_heads, with_lse):
    _run_case(P, B, S_loc, H_loc, D, dtype, False, kv_heads=kv_heads, with_lse=with_lse, rotate=True)


@pytest.mark.parametrize("P,S_loc,o_store", [(8, 1024, "tma"), (4, 320, "st")])
def test_rotated_order_starts_on_the_next_ranks_rows(P, S_loc, o_store):
    # the stamped build records which CTA (linear block id) ran each tile: with rotate, CTA
    # blockIdx.x = i ran m-block (i + k) mod m_blocks, k = floor((r + 1) % P * S_loc / tile_m)
    from cute_kernels.fa4_a2a_sm90 import TIMESTAMP_FIELDS

    B, H_loc, D = 1, 3, 128
    tile_m = tile_m_for(D)
    n_m = -(-P * S_loc // tile_m)
    q, k, v = (torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = _reference_windows([fa4_forward(q, k, v)] * P, P)[:, :, :, :H_loc]
    for rank in (0, P // 2, P - 1):
        ts = torch.zeros(B, H_loc, n_m, len(TIMESTAMP_FIELDS), dtype=torch.int64, device="cuda")
        windows = torch.full((P, B, S_loc, P * H_loc, D), POISON, device="cuda", dtype=torch.bfloat16)
        fa4_a2a_forward(q, k, v, windows, rank, o_store=o_store, timestamps=ts, rotate=True)
        torch.cuda.synchronize()
        assert torch.equal(windows[:, :, :, rank * H_loc:(rank + 1) * H_loc], expected)
        cta = ts[..., TIMESTAMP_FIELDS.index("cta")]  # bx + n_m * (head + H_loc * batch)
        shift = (rank + 1) % P * S_loc // tile_m
        m = torch.arange(n_m, device="cuda")
        assert torch.equal(cta % n_m, ((m - shift) % n_m).expand_as(cta)), rank
        assert torch.equal(cta // n_m, torch.arange(H_loc, device="cuda")[:, None].expand(H_loc, n_m)[None])


def test_rotation_refused_for_causal():
    P, B, S_loc, H_loc, D = 4, 1, 256, 2, 128
    q = torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16)
    windows = torch.empty(P, B, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotate: the rank-rotated tile order is for non-causal"):
        fa4_a2a_forward(q, q, q, windows, 0, causal=True, rotate=True)


KEEP_CASES = [
    # P, B, S_loc, H_loc, D, dtype, causal, kv_heads, seqused, o_store
    (4, 2, 256, 2, 128, torch.bfloat16, False, None, None, "tma"),
    (4, 2, 256, 2, 128, torch.bfloat16, False, None, None, "st"),
    (4, 1, 200, 3, 128, torch.bfloat16, False, None, None, "st"),  # tiles straddle rank boundaries
    (2, 1, 384, 4, 64, torch.float16, True, None, None, None),  # causal, D 64
    (8, 1, 100, 4, 128, torch.bfloat16, False, 1, 700, "st"),  # S_loc < tile_m, GQA, padded keys
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,causal,kv_heads,seqused,o_store", KEEP_CASES)
def test_keeping_kernel_keeps_fa4s_o_and_lse_bit_for_bit(P, B, S_loc, H_loc, D, dtype, causal, kv_heads, seqused,
                                                          o_store):
    """fa4_a2a_keeping_launcher (the forward that keeps O and LSE for FA4's backward): the windows get rank r's
    rows as fa4_a2a_forward routes them, and the kept O and LSE (the first S rows of longer NaN-poisoned
    tensors, as the op's joint rows leave them) equal FA4's own O and LSE bit for bit; their other rows and
    the windows' other heads stay unwritten."""
    from cute_kernels.fa4 import fa4_a2a_keeping_launcher

    torch.manual_seed(7 * P + S_loc + D)
    S, H, J, r = P * S_loc, P * H_loc, 24, P - 1
    H_kv = kv_heads or H_loc
    q = torch.randn(B, S, H_loc, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, S, H_kv, D, device="cuda", dtype=dtype) for _ in range(2))
    sk = None if seqused is None else torch.full((B,), seqused, device="cuda", dtype=torch.int32)
    windows = torch.full((P, B, S_loc, H, D), POISON, device="cuda", dtype=dtype)
    o_full = torch.full((B, S + J, H_loc, D), POISON, device="cuda", dtype=dtype)
    lse_full = torch.full((B, H_loc, S + J), POISON, device="cuda")
    o, lse = o_full[:, :S], lse_full[:, :, :S]
    launch = fa4_a2a_keeping_launcher(q, k, v, windows, r, o, lse, causal=causal, seqused_k=sk, o_store=o_store)
    launch(o, lse)
    ref_lse = torch.empty(B, H_loc, S, device="cuda")
    ref = fa4_forward(q, k, v, causal=causal, seqused_k=sk, lse=ref_lse)
    torch.cuda.synchronize()
    assert torch.equal(o.view(torch.int16), ref.view(torch.int16)), "kept O differs from FA4's"
    assert torch.equal(lse.view(torch.int32), ref_lse.view(torch.int32)), "kept LSE differs from FA4's"
    assert torch.isnan(o_full[:, S:]).all() and torch.isnan(lse_full[:, :, S:]).all(), "rows past S written"
    mine = windows[:, :, :, r * H_loc:(r + 1) * H_loc]
    assert torch.equal(mine, ref.view(B, P, S_loc, H_loc, D).permute(1, 0, 2, 3, 4))
    others = torch.cat([windows[:, :, :, :r * H_loc], windows[:, :, :, (r + 1) * H_loc:]], dim=3)
    assert torch.isnan(others).all(), "other ranks' heads written"
