"""The pace option without a GPU: its values and refusals, the automatic rule on given link and FA4
rates, the per-launch plan (fa_a2a.engine.pacing), and the host transport's shared mapping."""
import ctypes
import math
import os

import pytest
import torch

from fa_a2a.engine import pacing
from fa_a2a.engine.pacing import (PACE_FRACTION, Pacing, check_pace, decide, decode_pace, encode_pace, launch_pacer, pace_path,
                           plan_pacing)
from fa_a2a.engine.problem import check_call
from fa_a2a.tools.xstage import FaTiles


@pytest.mark.parametrize("pace, expected", [("auto", "auto"), (None, None), ("off", None), (44, 44.0), (0.5, 0.5)])
def test_pace_values(pace, expected):
    assert check_pace(pace) == expected
    assert decode_pace(encode_pace(check_pace(pace))) == expected


@pytest.mark.parametrize("pace", [True, 0, -1.0, math.inf, math.nan, 1e7, "fast", "AUTO", [44]])
def test_bad_pace_is_refused_by_name(pace):
    with pytest.raises(ValueError, match=r"^pace: "):
        check_pace(pace)


def _qkv(S_loc=16, H=4, D=64):
    return tuple(torch.randn(1, S_loc, H, D) for _ in range(3))


def test_the_call_carries_pace_only_for_the_fused_impl():
    q, k, v = _qkv()
    for impl in ("reference", "nccl"):
        problem, _ = check_call(q, k, v, None, impl, False, None, None, 2, pace="auto")
        assert problem.pace is None  # nothing to pace: ranks passing "auto" and None agree
        with pytest.raises(ValueError, match=r"^pace: a rate paces the fused kernel's stores"):
            check_call(q, k, v, None, impl, False, None, None, 2, pace=44.0)
    with pytest.raises(ValueError, match=r"^pace: "):
        check_call(q, k, v, None, "reference", False, None, None, 2, pace="sometimes")


def _tiles(S, H_loc, sms=132):
    return FaTiles(S, H_loc, 128, 1, 2, sms, 128, 128)


def test_auto_paces_a_slow_link_below_its_rate():
    """The H200's host link (the A2A kernel alone: 52 GB/s) at the measured table's shapes: paced at
    PACE_FRACTION of it (44-48 GB/s was best), inside the measured best range."""
    for S in (8192, 16384, 32768, 65536):
        d = decide(52.0, _tiles(S, 3))
        assert d.rate_gbps == pytest.approx(PACE_FRACTION * 52.0)
        assert 44.0 <= d.rate_gbps <= 48.0 and "paced" in d.reason


def test_auto_leaves_fast_links_and_single_waves_unpaced():
    for S in (8192, 16384, 65536):  # HBM: a wave drains in ~3 us of a >= 100 us Q-loop
        assert decide(1500.0, _tiles(S, 3)).rate_gbps is None
    one_wave = decide(52.0, _tiles(1024, 3))  # 24 tiles on 132 SMs
    assert one_wave.rate_gbps is None and "one wave" in one_wave.reason
    with pytest.raises(ValueError, match=r"^link: "):
        decide(0.0, _tiles(8192, 3))


@pytest.mark.parametrize("P, link, paced", [(2, 28.9, (False, False, True)), (4, 14.9, (False, False, True))])
def test_ranks_sharing_a_gpu_pace_only_slow_producers(P, link, paced):
    """The measured real-rank rows (P processes on one H200 under MPS, host transport, H 24): each
    rank has 1/P of the SMs and measured its share of the link; pacing paid at 32K only (the
    kernel makes O at ~20% of the paced rate), it cost more than it hid at P 4's 8K/16K."""
    for S, want in zip((8192, 16384, 32768), paced):
        d = decide(link, _tiles(S, 24 // P, sms=132 // P), gpu_sms=132, shared_gpu=True)
        assert (d.rate_gbps is not None) == want, (S, d.reason)
        assert d.rate_gbps is None or d.rate_gbps == pytest.approx(PACE_FRACTION * link)
    # one kernel at a time (emulated ranks) keeps pacing where the shared rule would not
    assert decide(link, _tiles(8192, 24 // P, sms=132 // P), gpu_sms=132).rate_gbps is not None


def test_plan_pacing_follows_the_option_and_the_path(monkeypatch):
    monkeypatch.setattr(pacing, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")

    def plan(pace, path=None, *, seqlen=32768, link=lambda: 52.0, ranks_per_gpu=1):
        # rank 0 of P 8: H_loc 3; link as measured (nothing timed)
        return plan_pacing(pace, link, cpu, seqlen, 3, 1, 128, torch.bfloat16, False, 128, path,
                           ranks_per_gpu=ranks_per_gpu)

    def unmeasured():
        raise AssertionError("the link was probed")

    assert plan(None, link=unmeasured) == Pacing(None, "pace off")
    # 24 tiles: one wave, decided without timing the link
    assert "one wave" in plan("auto", seqlen=1024, link=unmeasured).reason
    assert plan(40.0, link=unmeasured).rate_gbps == 40.0
    assert plan("auto").rate_gbps == pytest.approx(PACE_FRACTION * 52.0)
    assert plan("auto", link=lambda: 1500.0, ranks_per_gpu=2).rate_gbps is None
    why = "S_loc 100 is not a multiple of the tile's 128 rows"
    assert plan("auto", why, link=unmeasured) == Pacing(None, f"unpaced: {why}")
    with pytest.raises(ValueError, match=r"^pace: a rate needs the paced kernel, and S_loc 100"):
        plan(44.0, why)
    assert launch_pacer(Pacing(None, "off"), cpu, 128, 128, torch.bfloat16) is None


def test_pace_path_names_why_the_paced_kernel_cannot_run(monkeypatch):
    import cute_kernels.fa4 as fused

    q = torch.empty(0)
    monkeypatch.setattr(fused, "device_arch", lambda q: 90)
    tile_m, why = pace_path(q, 4096, 128, False)
    assert why is None and 4096 % tile_m == 0
    assert pace_path(q, tile_m + 1, 128, False) == (tile_m, None)  # the paced kernel's st path
    monkeypatch.setattr(fused, "device_arch", lambda q: 100)
    assert pace_path(q, 4096, 128, False)[1] == "the paced kernel is SM90's (this GPU is SM100)"


def test_host_windows_map_every_rank_at_one_stride():
    """The host transport's mapping (without CUDA): P shared-memory files at base + d*W, twice (two
    ranks' views); a store through one view is seen through the other and in the file."""
    from ulysses.vmm import map_host_windows, unmap_host_windows

    if not hasattr(os, "memfd_create"):
        pytest.skip("needs Linux memfd")
    P, W = 3, 1 << 16
    fds = []
    for d in range(P):
        fds.append(os.memfd_create(f"w{d}"))
        os.ftruncate(fds[d], W)
    a, b = map_host_windows(fds, W), map_host_windows(fds, W)
    try:
        assert a != b
        for d in range(P):
            ctypes.memmove(a + d * W + 4096, bytes([d + 1]) * 16, 16)
        for d in range(P):
            assert ctypes.string_at(b + d * W + 4096, 16) == bytes([d + 1]) * 16
            assert os.pread(fds[d], 16, 4096) == bytes([d + 1]) * 16
    finally:
        unmap_host_windows(a, P * W)
        unmap_host_windows(b, P * W)
        for f in fds:
            os.close(f)


def test_pace_is_part_of_the_agreed_signature():
    """Ranks passing different pace to the fused impl disagree, and the message names pace (fake
    CUDA tensors: check_call's kernel limits need CUDA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_a2a.engine.problem import _disagreement, signature_fields, signature_word

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 128, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        fields = [signature_fields(check_call(q, k, v, None, "fused", False, None, None, 2, pace=pace)[0],
                                   "ulysses_attention", "g", None) for pace in ("auto", None, 40.0)]
    assert len({signature_word(f) for f in fields}) == 3
    err = _disagreement([("ok", fields[0]), ("ok", fields[1])], None)
    assert str(err).startswith("pace: expected the same value on every rank, got rank 0: 'auto', rank 1: None")


def test_every_entry_refuses_a_bad_pace_by_name():
    pytest.importorskip("diffusers")
    from fa_a2a import UlyssesAttention
    from fa_a2a.models.diffusers_backend import register_diffusers_backend

    for make in (lambda: UlyssesAttention(pace="fast"), lambda: register_diffusers_backend("fa_a2a_p", pace=-1),
                 lambda: check_call(*_qkv(), None, "fused", False, None, None, 2, pace=True)):
        with pytest.raises(ValueError, match=r"^pace: "):
            make()
    assert UlyssesAttention(pace=40).pace == 40.0 and UlyssesAttention(pace=None).pace is None


# ---- the projection's stores ------------------------------------------------------------------------
FLUX_FLOPS = 2.0 * 2304 * 9216 * 3072  # Flux's projection at S_loc 2304 (C 3072, N 9216)
FLUX_BYTES = 2304 * 9216 * 2


@pytest.mark.parametrize("hidden,link,paced", [
    (3072, 52.0, False),  # GEMM share 0.22 of the host link: link-bound, pacing cost (576 rows) or ~3%
    (9216, 52.0, True),  # share 0.69: -7% measured
    (24576, 52.0, True),  # share 1.8: the stores still queued, -23% measured
    (3072, 1257.0, False),  # HBM: share 5.6, pacing cost 9.5% measured
])
def test_projection_rule_follows_the_measured_shares(hidden, link, paced):
    flops = FLUX_FLOPS * hidden / 3072
    d = pacing.decide_projection(link, FLUX_BYTES, flops)
    assert (d.rate_gbps is not None) == paced, d.reason
    if paced:
        assert d.rate_gbps == pytest.approx(pacing.PROJECTION_PACE_FRACTION * link)


def test_projection_rule_edges():
    gemm_us = FLUX_FLOPS / (pacing.GEMM_TFLOPS * 1e6)
    lo, hi = pacing.PROJECTION_GEMM_SHARES
    link = lambda share: FLUX_BYTES / (gemm_us / share * 1e3)  # noqa: E731  (the link giving that GEMM share)
    for share, paced in ((lo * 0.999, False), (lo * 1.001, True), (hi * 0.999, True), (hi * 1.001, False)):
        assert (pacing.decide_projection(link(share), FLUX_BYTES, FLUX_FLOPS).rate_gbps is not None) == paced, share
    shared = pacing.decide_projection(link(1.0), FLUX_BYTES, FLUX_FLOPS, shared_gpu=True)
    assert shared.rate_gbps is None and "share the GPU" in shared.reason
    for bad in (0, -1.0, float("nan"), None):
        with pytest.raises(ValueError, match="link: expected a positive rate"):
            pacing.decide_projection(bad, FLUX_BYTES, FLUX_FLOPS)


def test_plan_projection_pacing_follows_the_option():
    probes = []

    def link():
        probes.append(1)
        return 20.0

    args = (2304, 9216, 24576, torch.bfloat16)
    assert pacing.plan_projection_pacing(None, link, *args).rate_gbps is None
    assert pacing.plan_projection_pacing(33.0, link, *args) == Pacing(33.0, "pace 33 GB/s given")
    assert probes == []  # the link is measured only for "auto"
    auto = pacing.plan_projection_pacing("auto", link, *args)
    assert auto.rate_gbps == pytest.approx(pacing.PROJECTION_PACE_FRACTION * 20.0) and probes == [1]
    pacer = pacing.projection_pacer(auto, "cpu")
    from cute_kernels.pacer import UNIT_BYTES

    assert pacer.tolist() == [0, round(UNIT_BYTES / auto.rate_gbps), pacing.PROJECTION_BURST_UNITS
                              * round(UNIT_BYTES / auto.rate_gbps)]
    assert pacing.projection_pacer(Pacing(None, "off"), "cpu") is None
    assert pacing.plan_projection_pacing("auto", link, *args, ranks_per_gpu=2).rate_gbps is None
