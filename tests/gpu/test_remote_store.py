"""GPU tier: the X-Stage microbenchmark writes every destination byte with its pattern, and its
timestamps are consistent (monotone, positive periods, grid barrier orders aligned bursts)."""
import pytest
import torch

from cute_kernels.remote_store import burst_times_ns, clock_rate_ghz, expected_words, run_bursts

POISON = -0x21524111  # 0xDEADBEEF


def _n_sm():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _seed(k, b, mode):
    while True:
        seed = int(torch.randint(-2**31, 2**31 - 1, (1,)))
        if not bool((expected_words(mode, k, b, seed) == POISON).any()):
            return seed


@pytest.mark.parametrize("mode", ["vector", "bulk"])
@pytest.mark.parametrize("k_frac", [None, 1.0])  # None: 5 CTAs
def test_every_byte_written(mode, k_frac):
    k = 5 if k_frac is None else _n_sm()
    b = 8192 + 48  # not a power of two: a shorter last bulk chunk, a partial last thread sweep
    n_slots, guard = 3, 37
    slot = k * b // 4
    dst = torch.full((n_slots * slot + guard,), POISON, dtype=torch.int32, device="cuda")
    seed = _seed(k, b, mode)
    times, smid = run_bursts(dst, num_ctas=k, bytes_per_cta=b, n_bursts=n_slots + 2, gap_iters=100,
                             seed=seed, mode=mode)
    torch.cuda.synchronize()
    exp = expected_words(mode, k, b, seed)
    got = dst.cpu()
    for s in range(n_slots):
        part = got[s * slot:(s + 1) * slot]
        bad = (part != exp).nonzero()
        assert bad.numel() == 0, f"slot {s}: {bad.numel()} words wrong, first at {bad[0].item()}"
    assert bool((got[n_slots * slot:] == POISON).all()), "wrote past the last whole slot"
    assert smid.unique().numel() == k and bool((smid >= 0).all())


def test_timestamps_monotone_and_periods_positive():
    k = _n_sm()
    times, smid = run_bursts(torch.empty(64 << 20, dtype=torch.int32, device="cuda"), num_ctas=k,
                             bytes_per_cta=16384, n_bursts=8, gap_iters=2000)
    torch.cuda.synchronize()
    t = times.cpu()
    assert smid.unique().numel() == k, "expected one producer CTA per SM"
    assert bool((t[..., 1] >= t[..., 0]).all()), "globaltimer went backwards within a burst"
    assert bool((t[..., 3] > t[..., 2]).all()), "clock64 did not advance within a burst"
    assert bool((t[:, 1:, 2] > t[:, :-1, 3]).all()), "a burst started before the previous one ended"
    ghz = clock_rate_ghz(t)
    assert 0.3 < ghz < 3.5, f"implausible SM clock {ghz} GHz"
    issue, period, gap = burst_times_ns(t, ghz)
    assert bool((issue > 0).all()) and bool((period > 0).all()) and bool((gap > 0).all())
    assert torch.allclose(period, issue[:, :-1] + gap)


def test_gap_grows_with_iterations():
    k = _n_sm()
    dst = torch.empty(16 << 20, dtype=torch.int32, device="cuda")
    gaps = []
    for iters in (1000, 4000, 16000):
        times, _ = run_bursts(dst, num_ctas=k, bytes_per_cta=1024, n_bursts=4, gap_iters=iters)
        torch.cuda.synchronize()
        gaps.append(float(burst_times_ns(times.cpu())[2].median()))
    assert gaps[0] < gaps[1] < gaps[2]
    assert 3.0 < (gaps[2] - gaps[0]) / (gaps[1] - gaps[0]) < 6.0  # linear in iterations: 5x expected


def test_grid_barrier_orders_aligned_bursts():
    k = _n_sm()
    times, _ = run_bursts(torch.empty(16 << 20, dtype=torch.int32, device="cuda"), num_ctas=k,
                          bytes_per_cta=4096, n_bursts=5, gap_iters=500, align=True)
    torch.cuda.synchronize()
    t = times.cpu()
    # every CTA's burst b starts after every CTA's burst b-1 has ended (globaltimer is device-wide)
    assert bool((t[:, 1:, 0].min(dim=0).values >= t[:, :-1, 1].max(dim=0).values).all())


def test_ipc_destination_reaches_owner():
    from fa_a2a.tools.calibrate import CudaIpcPeerBuffer

    k, b = _n_sm(), 32768
    seed = _seed(k, b, "vector")
    with CudaIpcPeerBuffer(k * b // 4) as peer:
        peer.tensor.fill_(POISON)
        run_bursts(peer.tensor, num_ctas=k, bytes_per_cta=b, n_bursts=1, seed=seed)
        torch.cuda.synchronize()
        assert peer.check(expected_words("vector", k, b, seed))
        assert not peer.check(expected_words("vector", k, b, seed + 1))  # the check can fail


def test_bad_inputs_name_the_argument():
    dst = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="dst"):
        run_bursts(dst.float(), num_ctas=1, bytes_per_cta=1024, n_bursts=1)
    with pytest.raises(ValueError, match="num_ctas"):
        run_bursts(dst, num_ctas=_n_sm() + 1, bytes_per_cta=1024, n_bursts=1)
    with pytest.raises(ValueError, match="bytes_per_cta"):
        run_bursts(dst, num_ctas=1, bytes_per_cta=1000, n_bursts=1)
    with pytest.raises(ValueError, match="dst"):
        run_bursts(dst[:100], num_ctas=4, bytes_per_cta=1024, n_bursts=1)
    with pytest.raises(ValueError, match="n_bursts"):
        run_bursts(dst, num_ctas=1, bytes_per_cta=1024, n_bursts=0)
