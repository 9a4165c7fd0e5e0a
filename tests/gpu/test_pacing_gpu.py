"""The pace option on an SM90 GPU (fa_a2a.engine.pacing): paced == unpaced == serial bit for bit into
NaN-poisoned windows, with emulated ranks (HBM windows) and with real rank processes over the host
transport (windows in pinned host memory, every store over PCIe; under MPS where it starts); the
link measured, and the automatic decision: unpaced on HBM, paced over host memory."""

import pytest
import torch

from tests.helpers import poison_allocated
from tests.multiproc import run_on_gloo_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs an SM90 GPU (the paced kernel is SM90's)")


def _poison(transport, ranks):
    poison_allocated(transport, ranks)  # (not the windows of the outputs held: emulated ranks lend them)
    torch.cuda.synchronize()


def _shards(P, S_loc, H, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.randn(1, S_loc, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(P)]
            for _ in range(3)]


def test_emulated_paced_equals_unpaced_and_serial_and_auto_leaves_hbm_unpaced():
    from fa_a2a import ulysses_attention_emulated
    from fa_a2a.engine.forward import _plans, emulated_transport

    P = 2
    qs, ks, vs = _shards(P, 4096, 8, 128, 0)  # rank's FA4: 8192 rows x 4 heads, 2 waves on 132 SMs
    transport = emulated_transport(P, qs[0].device)
    serial = ulysses_attention_emulated(qs, ks, vs, impl="serial")
    assert all(torch.isfinite(o).all() for o in serial)
    for pace in (None, 44.0, "auto"):
        _poison(transport, range(P))
        out = ulysses_attention_emulated(qs, ks, vs, impl="fused", pace=pace)
        for r in range(P):
            assert torch.equal(out[r], serial[r]), f"pace={pace!r}, rank {r}"
    assert transport.pacing_link_gbps > 200, f"HBM windows measured at {transport.pacing_link_gbps:.1f} GB/s"
    plan = next(p for p in _plans.values() if p.transport is transport and p.layout.seq_loc == 4096)
    decision = plan.pacing  # the last fused launch prepared: pace "auto"
    assert decision.rate_gbps is None and "the link keeps up" in decision.reason, decision


def test_link_rate_of_host_windows_is_slow_and_auto_paces_it():
    from fa_a2a.engine.pacing import decide, measure_store_rate, sm_count
    from fa_a2a.tools.xstage import FaTiles
    from ulysses.transport import tensor_from_address

    P, rows, H, D = 8, 16384, 8, 128  # 32 MiB from rank 0, as the op's probe
    shape = (P, 1, rows, H, D)
    nbytes = P * rows * H * D * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    host_w = tensor_from_address(host.data_ptr(), nbytes, dev).view(torch.bfloat16).view(shape)
    hbm_w = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    r_host, r_hbm = measure_store_rate(host_w, 0), measure_store_rate(hbm_w, 0)
    print(f"post-A2A alone: host windows {r_host:.1f} GB/s, HBM windows {r_hbm:.1f} GB/s")
    assert r_host < 100 < 300 < r_hbm
    tiles = FaTiles.fa4(8192, 3, D, num_sms=sm_count(torch.device("cuda")))
    assert decide(r_host, tiles).rate_gbps is not None and decide(r_hbm, tiles).rate_gbps is None


def _host_ranks(P, group, rank):
    import torch.distributed as dist

    from fa_a2a import ulysses_attention
    from fa_a2a.engine.forward import _rank_calls
    from ulysses.transport import HostTransport, get_transport

    transport = get_transport(group)
    assert isinstance(transport, HostTransport), type(transport).__name__
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    q, k, v = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    outs = {}
    for impl, pace in (("serial", None), ("fused", None), ("fused", 20.0), ("fused", "auto")):
        ulysses_attention(q, k, v, group=group, impl=impl, pace=pace)  # windows, compiles, the link
        _poison(transport, [rank])
        dist.barrier(group)
        outs[impl, pace] = ulysses_attention(q, k, v, group=group, impl=impl, pace=pace)
        torch.cuda.synchronize()
        dist.barrier(group)
    ref = outs["serial", None]
    assert torch.isfinite(ref).all()
    for key, o in outs.items():
        assert torch.equal(o, ref), f"rank {rank}: {key} differs from serial"
    plans = [c.plan for key, c in _rank_calls.items() if key[0].impl == "fused" and key[0].pace == "auto"]
    # auto decided over the measured link; whether it paces follows the shared-GPU rule (pacing.decide)
    assert plans and plans[0].pacing is not None and transport.pacing_link_gbps is not None
    print(f"rank {rank}: host link {transport.pacing_link_gbps:.1f} GB/s (each of {P} ranks at once); "
          f"{plans[0].pacing.reason}")
    assert transport.pacing_link_gbps < 100


def test_real_ranks_over_the_host_transport(monkeypatch):
    from ulysses.transport import close_transports

    monkeypatch.setenv("FA_A2A_TRANSPORT", "host")
    monkeypatch.setenv("FA_A2A_TIMEOUT_S", "300")  # the first calls compile while the peer waits
    run_on_gloo_groups(_host_ranks, (2,), cuda=True, timeout_s=300, teardown=close_transports)
