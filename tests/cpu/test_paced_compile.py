"""CPU tier: the paced fused kernel (fa4_a2a_forward(..., pacer=), cute_kernels.fa4_a2a_paced_sm90)
compiles for sm_90a with fake tensors, its PTX holds the pacer (atomic max and add on the slot word,
%globaltimer), and bad arguments are refused."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4_a2a_paced_sm90 as paced_kernel
from cute_kernels import pacer as paced
from cute_kernels import fa4 as fused


def _inputs(P=4, B=1, H_loc=3, D=128, dtype=torch.bfloat16, S_loc=None):
    S_loc = S_loc or 2 * fused.tile_m_for(D)
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
    windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
    pacer = paced.make_pacer("cuda", 44.0, B * fused.tile_m_for(D) * H_loc * D * dtype.itemsize)
    return q, windows, pacer


@pytest.mark.parametrize("D,dtype,stamps", [(128, torch.bfloat16, False), (64, torch.float16, True)])
def test_paced_compiles(D, dtype, stamps, monkeypatch):
    kinds, compile_fa4 = [], fused.compile_fa4

    def spy(kind, *key, **kw):
        kinds.append(kind)
        return compile_fa4(kind, *key, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    with FakeTensorMode():
        q, windows, pacer = _inputs(D=D, dtype=dtype)
        ts = None
        if stamps:
            ts = torch.empty(1, q.shape[2], q.shape[1] // fused.tile_m_for(D), 7, dtype=torch.int64, device="cuda")
        fused.fa4_a2a_forward(q, q, q, windows, 1, pacer=pacer, timestamps=ts)
    assert kinds == ["a2a-paced"]


def test_paced_st_path_compiles_for_straddling_tiles(monkeypatch):
    """S_loc not a multiple of the tile rows: the paced kernel's per-thread store path."""
    kinds, compile_fa4 = [], fused.compile_fa4

    def spy(kind, *key, **kw):
        kinds.append(kind)
        return compile_fa4(kind, *key, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    with FakeTensorMode():
        q, windows, pacer = _inputs(S_loc=fused.tile_m_for(128) + 64)
        fused.fa4_a2a_forward(q, q, q, windows, 1, pacer=pacer)
        q, windows, pacer = _inputs()
        fused.fa4_a2a_forward(q, q, q, windows, 1, pacer=pacer, o_store="st")
    assert kinds == ["a2a-paced-st", "a2a-paced-st"]


def test_ptx_has_the_pacer(tmp_path):
    key = ("a2a-paced", torch.bfloat16, 128, 1, False, False, False)
    ptx = fused.compile_fa4(*key, extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert "red.relaxed.gpu.global.max.s64" in ptx and "atom.relaxed.gpu.global.add.u64" in ptx
    assert "%globaltimer" in ptx
    assert "cp.async.bulk.tensor" in ptx  # the TMA store it paces
    plain = fused.compile_fa4("a2a-tma", *key[1:], extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert "%globaltimer" not in plain  # the unpaced build stays without the pacer
    st = fused.compile_fa4("a2a-paced-st", *key[1:], extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert "atom.relaxed.gpu.global.add.u64" in st and "st.global" in st  # paced per-thread stores,
    assert ".global.shared::cta" not in st  # and no TMA store (its TMA loads go shared::cta.global)
    assert ".global.shared::cta" in ptx


def test_refusals():
    with FakeTensorMode():
        q, windows, pacer = _inputs()
        for bad in (torch.empty(3, dtype=torch.int32, device="cuda"), torch.empty(2, dtype=torch.int64, device="cuda"),
                    torch.empty(3, dtype=torch.int64), "pacer"):
            with pytest.raises(ValueError, match="pacer: expected an int64 tensor"):
                fused.fa4_a2a_forward(q, q, q, windows, 0, pacer=bad)
        with pytest.raises(ValueError, match="pacer: expected the state make_pacer returned"):
            fused.fa4_a2a_forward(q, q, q, windows, 0, pacer=torch.zeros(3, dtype=torch.int64, device="cuda"))
        with pytest.raises(ValueError, match="pacer: the paced kernel is SM90's, without lse_windows or rotate"):
            fused.fa4_a2a_forward(q, q, q, windows, 0, pacer=pacer, rotate=True)
        P, B, S_loc, H, _ = windows.shape
        lse = torch.empty(P, B, H, S_loc, dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError, match="pacer: the paced kernel is SM90's, without lse_windows or rotate"):
            fused.fa4_a2a_forward(q, q, q, windows, 0, pacer=pacer, lse_windows=lse)
    with pytest.raises(ValueError, match="kind: the paced kernel is SM90 only"):
        fused.compile_fa4("a2a-paced", torch.bfloat16, 128, 1, False, False, False, rotate=True)
    with pytest.raises(ValueError, match="o_store"):
        fused._make_kernel(paced_kernel.FlashAttentionA2APacedForwardSm90, torch.bfloat16, 128, 1, False, o_store="x")
    with pytest.raises(ValueError, match="rotate"):
        fused._make_kernel(paced_kernel.FlashAttentionA2APacedForwardSm90, torch.bfloat16, 128, 1, False, rotate=True)


def test_make_pacer():
    p = paced.make_pacer("cpu", 40.0, 32768, burst_tiles=4)
    assert p.tolist() == [0, 819, 4 * 819]  # 32768 B / 40 GB/s = 819.2 ns
    for bad in (0.0, -1.0, float("inf"), "40"):
        with pytest.raises(ValueError, match="rate_gbps"):
            paced.make_pacer("cpu", bad, 32768)
    with pytest.raises(ValueError, match="tile_bytes"):
        paced.make_pacer("cpu", 40.0, 0)
    with pytest.raises(ValueError, match="burst_tiles"):
        paced.make_pacer("cpu", 40.0, 32768, burst_tiles=-1)
