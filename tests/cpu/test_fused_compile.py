"""CPU tier: FA4's SM90 forward and the rank-window subclass compile for sm_90a with fake tensors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa_a2a import fused


@pytest.fixture
def compile_keys(monkeypatch):
    """The keys fused.compile_fa4 is asked for (positional key + timestamps), in call order."""
    keys, compile_fa4 = [], fused.compile_fa4

    def spy(*key, timestamps=False, **kw):
        keys.append((*key, timestamps))
        return compile_fa4(*key, timestamps=timestamps, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    return keys


@pytest.mark.parametrize("D,causal,dtype", [(128, False, torch.bfloat16), (64, True, torch.float16)])
def test_compiles_without_gpu(D, causal, dtype, compile_keys):
    with FakeTensorMode():
        P, B, S_loc, H_loc = 4, 1, 320, 3
        q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
        k, v = torch.empty_like(q), torch.empty_like(q)
        fused.fa4_forward(q, k, v, causal=causal)
        windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
        fused.fa4_a2a_forward(q, k, v, windows, 1, causal=causal)
        S_loc = 3 * fused.tile_m_for(D, causal)
        q2 = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
        windows2 = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
        fused.fa4_a2a_forward(q2, q2, q2, windows2, 0, causal=causal)
        lse_windows = torch.empty(P, B, P * H_loc, S_loc, dtype=torch.float32, device="cuda")
        fused.fa4_a2a_forward(q2, q2, q2, windows2, 0, causal=causal, lse_windows=lse_windows)
    assert ("a2a-tma", dtype, D, 1, causal, False, False, False) in compile_keys
    assert ("a2a-tma", dtype, D, 1, causal, False, True, False) in compile_keys
    assert ("a2a-st", dtype, D, 1, causal, False, False, False) in compile_keys  # 320 % tile_m != 0


@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_timestamp_variants_compile(D, dtype, compile_keys):
    # the stamped debug builds of both O paths (straddling and aligned S_loc)
    with FakeTensorMode():
        P, B, H_loc = 4, 1, 3
        for S_loc in (320, 3 * fused.tile_m_for(D)):
            q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
            windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
            n_m = -(-P * S_loc // fused.tile_m_for(D))
            ts = torch.empty(B, H_loc, n_m, 7, dtype=torch.int64, device="cuda")
            fused.fa4_a2a_forward(q, q, q, windows, 1, timestamps=ts)
    for kind in ("a2a-st", "a2a-tma"):
        assert (kind, dtype, D, 1, False, False, False, True) in compile_keys


def _fake_inputs(**over):
    shapes = dict(P=2, B=1, S_loc=128, H_loc=2, D=128)
    shapes.update(over)
    P, B, S_loc, H_loc, D = (shapes[k] for k in ("P", "B", "S_loc", "H_loc", "D"))
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=torch.bfloat16, device="cuda")
    w = torch.empty(P, B, S_loc, P * H_loc, D, dtype=torch.bfloat16, device="cuda")
    return q, w


def test_bad_inputs_name_the_argument():
    with FakeTensorMode():
        q, w = _fake_inputs()
        k, v = torch.empty_like(q), torch.empty_like(q)
        with pytest.raises(ValueError, match="q: dtype"):
            fused.fa4_forward(q.float(), k, v)
        with pytest.raises(ValueError, match="head dim"):
            q96 = torch.empty(1, 256, 2, 96, dtype=torch.bfloat16, device="cuda")
            fused.fa4_forward(q96, q96, q96)
        with pytest.raises(ValueError, match="rank"):
            fused.fa4_a2a_forward(q, k, v, w, 2)
        with pytest.raises(ValueError, match="rank"):
            fused.fa4_a2a_forward(q, k, v, w, 1.0)
        with pytest.raises(ValueError, match="base address"):
            flat = torch.empty(w.numel() + 1, dtype=w.dtype, device="cuda")
            fused.fa4_a2a_forward(q, k, v, flat.as_strided(w.shape, w.stride(), 1), 0)
        with pytest.raises(ValueError, match="out:"):
            fused.fa4_forward(q, k, v, out=q.narrow(1, 0, 8))
        with pytest.raises(ValueError, match="out_windows: P \\* S_loc"):
            fused.fa4_a2a_forward(q, k, v, w.narrow(2, 0, 100), 0)
        with pytest.raises(ValueError, match="out_windows: H"):
            fused.fa4_a2a_forward(q, k, v, w.narrow(3, 0, 3), 0)
        with pytest.raises(ValueError, match="k: 3 KV heads"):
            k3 = torch.empty(1, 256, 3, 128, dtype=torch.bfloat16, device="cuda")
            fused.fa4_forward(q, k3, k3)
        with pytest.raises(ValueError, match="lse_windows"):
            fused.fa4_a2a_forward(q, k, v, w, 0, lse_windows=torch.empty(2, 1, 4, 100, device="cuda"))
        with pytest.raises(ValueError, match="o_store: 'bulk' is not"):
            fused.fa4_a2a_forward(q, k, v, w, 0, o_store="bulk")
        with pytest.raises(ValueError, match="timestamps: expected a contiguous int64"):
            fused.fa4_a2a_forward(q, k, v, w, 0, timestamps=torch.empty(1, 2, 3, 7, dtype=torch.int64, device="cuda"))
        with pytest.raises(ValueError, match="seqused_k"):
            fused.fa4_forward(q, k, v, seqused_k=torch.empty(2, dtype=torch.int64, device="cuda"))


def test_cpu_tensors_are_refused():
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fused.fa4_forward(q, q, q)
