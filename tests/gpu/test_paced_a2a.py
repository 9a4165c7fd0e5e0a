"""GPU tier: the paced fused kernel (fa4_a2a_forward(..., pacer=), cute_kernels.fa4_a2a_paced_sm90)
writes the same windows as the unpaced one, bit for bit, into HBM and pinned host memory, and its pacer really spaces the stores."""

import pytest
import torch

from cute_kernels.pacer import make_pacer
from cute_kernels.fa4 import fa4_a2a_forward, tile_m_for
from ulysses.transport import tensor_from_address


def _windows(shape, dtype, host, keep):
    n = 1
    for s in shape:
        n *= s
    if not host:
        return torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    buf = torch.empty(n * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8, pin_memory=True)
    keep.append(buf)
    t = tensor_from_address(buf.data_ptr(), buf.numel(), torch.device("cuda", torch.cuda.current_device()))
    return t.view(dtype).view(shape).fill_(float("nan"))


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("P,B,H_loc,D,dtype,kv_heads", [(8, 1, 3, 128, torch.bfloat16, 3),
                                                        (4, 2, 4, 64, torch.float16, 2)])
def test_paced_equals_unpaced(host, P, B, H_loc, D, dtype, kv_heads):
    torch.manual_seed(P + H_loc + D)
    S_loc = 2 * tile_m_for(D)
    q = torch.randn(B, P * S_loc, H_loc, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, P * S_loc, kv_heads, D, device="cuda", dtype=dtype) for _ in range(2))
    keep = []
    shape = (P, B, S_loc, P * H_loc, D)
    ref, out = _windows(shape, dtype, False, keep), _windows(shape, dtype, host, keep)
    pacer = make_pacer(q.device, 40.0, tile_m_for(D) * D * q.element_size())
    for rank in range(P):
        fa4_a2a_forward(q, k, v, ref, rank)
        fa4_a2a_forward(q, k, v, out, rank, pacer=pacer)
    torch.cuda.synchronize()
    assert not torch.isnan(ref).any()
    assert torch.equal(out, ref)


def test_pacer_spaces_the_stores():
    # 1 GB/s, 32 KiB tiles: 32.8 us per tile, 48 tiles, burst tolerance 2 -> >= 45 slots apart
    P, H_loc, D = 8, 3, 128
    S_loc = 2 * tile_m_for(D)
    q = torch.randn(1, P * S_loc, H_loc, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(P, 1, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
    n_tiles = P * S_loc // tile_m_for(D) * H_loc
    pacer = make_pacer(q.device, 1.0, tile_m_for(D) * D * 2, burst_tiles=2)
    fa4_a2a_forward(q, q, q, out, 0, pacer=pacer)  # compile, and a TAT in the past for the next launch
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fa4_a2a_forward(q, q, q, out, 0, pacer=pacer)
    b.record()
    torch.cuda.synchronize()
    dt_us = pacer[1].item() / 1e3
    assert a.elapsed_time(b) * 1e3 >= (n_tiles - 2 - 1) * dt_us
    assert a.elapsed_time(b) * 1e3 < (n_tiles + 20) * dt_us  # not stuck either
