"""CPU tier: the paced fused kernel (cute_kernels.fa4_a2a_paced_sm90) compiles for sm_90a with fake
tensors, its PTX holds the pacer (compare-and-swap on the slot word, %globaltimer), and bad
arguments are refused."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4_a2a_paced_sm90 as paced
from fa_a2a import fused


def _inputs(P=4, B=1, H_loc=3, D=128, dtype=torch.bfloat16, S_loc=None):
    S_loc = S_loc or 2 * fused.tile_m_for(D)
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
    windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
    pacer = torch.empty(3, dtype=torch.int64, device="cuda")
    return q, windows, pacer


@pytest.mark.parametrize("D,dtype,stamps", [(128, torch.bfloat16, False), (64, torch.float16, True)])
def test_paced_compiles(D, dtype, stamps):
    with FakeTensorMode():
        q, windows, pacer = _inputs(D=D, dtype=dtype)
        ts = None
        if stamps:
            ts = torch.empty(1, q.shape[2], q.shape[1] // fused.tile_m_for(D), 7, dtype=torch.int64, device="cuda")
        paced.fa4_a2a_paced_forward(q, q, q, windows, 1, pacer, timestamps=ts)
    assert paced.compile_paced.cache_info().currsize >= 1


def test_ptx_has_the_pacer(tmp_path):
    import cutlass.cute as cute

    with FakeTensorMode():
        from flash_attn.cute.cute_dsl_utils import to_cute_tensor

        q, windows, pacer = _inputs()
        dst = windows.narrow(3, 0, q.shape[2])
        tq, to = to_cute_tensor(q), to_cute_tensor(dst)
        tpace = to_cute_tensor(pacer, assumed_align=8)
    fa = fused._make_kernel(paced.FlashAttentionA2APacedForwardSm90, torch.bfloat16, 128, 1, False)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    cute.compile(fa, tq, tq, tq, to, 1.0, None, None, tpace, stream,
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp_path}")
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    assert "red.relaxed.gpu.global.max.s64" in ptx and "atom.relaxed.gpu.global.add.u64" in ptx
    assert "%globaltimer" in ptx
    assert "cp.async.bulk.tensor" in ptx  # the TMA store it paces


def test_refusals():
    with FakeTensorMode():
        q, windows, pacer = _inputs()
        with pytest.raises(ValueError, match="pacer"):
            paced.fa4_a2a_paced_forward(q, q, q, windows, 0, torch.empty(3, dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match="pacer"):
            paced.fa4_a2a_paced_forward(q, q, q, windows, 0, torch.empty(2, dtype=torch.int64, device="cuda"))
        q2, w2, _ = _inputs(S_loc=fused.tile_m_for(128) + 64)
        with pytest.raises(ValueError, match="out_windows"):
            paced.fa4_a2a_paced_forward(q2, q2, q2, w2, 0, pacer)
    with pytest.raises(ValueError, match="o_store"):
        fused._make_kernel(paced.FlashAttentionA2APacedForwardSm90, torch.bfloat16, 128, 1, False, o_store="st")
    with pytest.raises(ValueError, match="rotate"):
        fused._make_kernel(paced.FlashAttentionA2APacedForwardSm90, torch.bfloat16, 128, 1, False, rotate=True)


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
