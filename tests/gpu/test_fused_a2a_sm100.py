"""Fused FA4 + post-A2A on an SM100 (Blackwell) GPU with emulated ranks: bit-exact to FA4's SM100
forward moved by the reference A2A, windows NaN-poisoned first (the same checks as
tests/gpu/test_fused_a2a.py, whose case runner this file uses). Skipped on any other device.
"""

import pytest
import torch

from cute_kernels.fa4 import fa4_a2a_forward
from tests.gpu.test_fused_a2a import _run_case


def _device_is_sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs an SM100/SM103 (Blackwell) GPU; no CUDA GPU found"
    major, minor = torch.cuda.get_device_capability()
    return f"needs an SM100/SM103 (Blackwell) GPU; found compute capability {major}.{minor}"


pytestmark = pytest.mark.skipif(not _device_is_sm100(), reason=_skip_reason())


@pytest.fixture
def fa4_knobs(monkeypatch):
    """Set FA4's forward knobs (FA_DISABLE_2CTA, FA_CLC) as its environment variables would."""
    from flash_attn.cute import utils

    def set_knobs(disable_2cta=None, clc=None):
        if disable_2cta is not None:
            monkeypatch.setattr(utils, "_fa_disable_2cta_enabled", disable_2cta)
            monkeypatch.setattr(utils, "_fa_disable_2cta_cuda12", False)
        if clc is not None:
            monkeypatch.setattr(utils, "_fa_clc_enabled", clc)

    return set_knobs


CASES = [
    # P, B, S_loc, H_loc, D, dtype, causal: on SM100 a stage is 128 rows, a work tile 256 (512 with 2-CTA)
    (1, 1, 256, 2, 128, torch.bfloat16, False),
    (2, 2, 512, 4, 64, torch.float16, False),
    (4, 1, 320, 3, 128, torch.bfloat16, False),  # stages straddle rank boundaries
    (4, 2, 200, 2, 64, torch.bfloat16, True),  # straddling, causal
    (8, 1, 256, 3, 128, torch.bfloat16, False),
    (8, 1, 100, 1, 128, torch.float16, True),  # S_loc < 128: a stage spans several ranks
    (8, 2, 1000, 2, 128, torch.bfloat16, False),
    (4, 1, 32, 2, 128, torch.bfloat16, False),  # S = 128: one Q stage, FA4's S ping-pong
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,causal", CASES)
def test_fused_matches_fa4_plus_reference_a2a(P, B, S_loc, H_loc, D, dtype, causal):
    _run_case(P, B, S_loc, H_loc, D, dtype, causal)


@pytest.mark.parametrize("disable_2cta", [False, True])
def test_fused_one_and_two_cta(fa4_knobs, disable_2cta):
    fa4_knobs(disable_2cta=disable_2cta)
    _run_case(8, 1, 512, 2, 128, torch.bfloat16, False)


def test_fused_causal_clc_scheduler(fa4_knobs):
    fa4_knobs(clc=True)
    _run_case(4, 1, 512, 4, 128, torch.bfloat16, True, kv_heads=2)


def test_fused_st_path_on_aligned_windows():
    _run_case(4, 1, 512, 2, 128, torch.bfloat16, False, o_store="st")


def test_fused_gqa_padded_windows_and_seqused():
    _run_case(4, 1, 384, 4, 128, torch.bfloat16, False, kv_heads=1, window_pad=4096, seqused=1400)


def test_fused_routes_lse():
    _run_case(4, 2, 256, 2, 128, torch.bfloat16, False, with_lse=True)


def test_fused_refuses_straddling_lse():
    P, B, S_loc, H_loc, D = 4, 1, 200, 2, 128
    q = torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16)
    windows = torch.empty(P, B, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
    lse_windows = torch.empty(P, B, P * H_loc, S_loc, device="cuda")
    with pytest.raises(ValueError, match="lse_windows: on SM100"):
        fa4_a2a_forward(q, q, q, windows, 0, lse_windows=lse_windows)


def test_fused_more_keys_than_queries():
    _run_case(2, 1, 256, 2, 128, torch.bfloat16, False, extra_keys=77)


@pytest.mark.parametrize("o_store", ["tma", "st"])
def test_fused_into_host_windows(o_store):
    _run_case(8, 1, 1024, 3, 128, torch.bfloat16, False, o_store=o_store, host=True)


ROTATE_CASES = [
    # P, B, S_loc, H_loc, D, dtype, kv_heads, with_lse: every rank of P with the rank-rotated order
    # (2-CTA work tiles are 512 rows: S_loc = 384 and 320 make the shift's work tile straddle ranks)
    (2, 2, 512, 2, 128, torch.bfloat16, None, False),
    (4, 1, 320, 3, 128, torch.bfloat16, None, False),  # stages straddle ranks
    (4, 1, 384, 4, 128, torch.bfloat16, 1, True),  # GQA, LSE
    (8, 1, 256, 3, 128, torch.bfloat16, None, True),
    (8, 1, 100, 1, 128, torch.bfloat16, None, False),  # S_loc < 128
]


@pytest.mark.parametrize("P,B,S_loc,H_loc,D,dtype,kv_heads,with_lse", ROTATE_CASES)
def test_rotated_order_is_bit_exact(P, B, S_loc, H_loc, D, dtype, kv_heads, with_lse):
    _run_case(P, B, S_loc, H_loc, D, dtype, False, kv_heads=kv_heads, with_lse=with_lse, rotate=True)


@pytest.mark.parametrize("disable_2cta", [False, True])
def test_rotated_order_one_and_two_cta(fa4_knobs, disable_2cta):
    fa4_knobs(disable_2cta=disable_2cta)
    _run_case(8, 1, 768, 2, 128, torch.bfloat16, False, rotate=True)


def test_rotation_refused_for_causal():
    P, B, S_loc, H_loc, D = 4, 1, 256, 2, 128
    q = torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16)
    windows = torch.empty(P, B, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotate: the rank-rotated tile order is for non-causal"):
        fa4_a2a_forward(q, q, q, windows, 0, causal=True, rotate=True)
