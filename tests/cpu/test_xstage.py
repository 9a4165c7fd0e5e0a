"""Burst–Gap model: the paper's arithmetic, the model's identities, and fits of synthetic data."""
import json
import math
import re

import numpy as np
import pytest

from fa_a2a.tools.xstage import (
    GB,
    KiB,
    MiB,
    US,
    PlatformModel,
    critical_path_stall,
    fa_burst_volume,
    fa_tile_burst_bytes,
    fit_capacity,
    fit_drain_rate,
    fit_issue_floor,
    qloop_gap_lower_bound,
)

# The paper's calibration (Sections 3.3-3.5, 4.3): R = 717 GB/s, T_iss0 = 0.76 us at K = 148,
# 32 KB per producer, knee at ~33 KB per producer, Q ~ 4.25 MiB.
PAPER = PlatformModel(t_iss0=0.76 * US, drain_rate=717 * GB, capacity=4.25 * MiB)
K_B200 = 148


def test_paper_fa4_design_point():
    bt = fa_tile_burst_bytes(128, 128, 2)
    assert bt == 32 * KiB
    v = fa_burst_volume(K_B200, 128, 128, 2)
    assert v == K_B200 * 32 * KiB
    assert v / MiB == pytest.approx(4.625)  # "V ~ 4.6 MiB"
    g_star = PAPER.recovery_gap(v)
    assert round(g_star / US, 1) == 6.0  # "G* ~ 6.0 us"
    m_ub = PAPER.fa_min_seqlen(v, 0.79 * US, 128)
    assert round(m_ub / 1000, 1) == 1.0  # "M_ub* ~ 1.0K tokens"
    assert m_ub == pytest.approx(128 * g_star / (0.79 * US))
    q_peak = PAPER.peak_outstanding(v)
    assert round(q_peak / MiB, 1) == 4.1  # "V - R T_iss0 ~ 4.1 MiB < Q ~ 4.25 MiB"
    dt = PAPER.design_test(v, 80 * US)  # M = 8192: measured Q-loop gap ~80 us
    assert dt.ok and dt.failing == ()
    assert dt.capacity_ok and dt.peak_outstanding < PAPER.capacity
    # "the measured Q-loop gap is about 80 us, roughly 13x the worst-case G*"
    assert 80 * US / g_star == pytest.approx(13.3, abs=0.1)


def test_paper_knee_gives_capacity():
    # knee at ~33 KB per producer for K = 148: V ~ 4.77 MiB; Q = V_knee - R T_iss0 ~ 4.25 MiB
    v_knee = K_B200 * 33 * KiB
    assert round(v_knee / MiB, 2) == 4.77
    q = v_knee - PAPER.drain_rate * PAPER.t_iss0
    assert round(q / MiB, 2) == 4.25
    m = PlatformModel(PAPER.t_iss0, PAPER.drain_rate, q)
    assert m.knee_volume() == pytest.approx(v_knee)


def test_design_test_names_failing_bound():
    v = fa_burst_volume(K_B200, 128, 128, 2)
    # zero gap: injection 4.85 MB / 0.76 us = 6.4 TB/s > R
    assert PAPER.design_test(v, 0.0).failing == ("rate",)
    big = 2 * v  # q_peak ~ 8.7 MiB > Q, and with a huge gap the rate bound holds
    assert PAPER.design_test(big, 1.0).failing == ("capacity",)
    assert PAPER.design_test(big, 0.0).failing == ("rate", "capacity")
    g_star = PAPER.recovery_gap(v)
    # rate bound V/(T0 + G) <= R holds exactly from G = G* on
    assert not PAPER.design_test(v, g_star * 0.99).rate_ok
    assert PAPER.design_test(v, g_star * 1.01).rate_ok
    assert "FAILS" in str(PAPER.design_test(v, 0.0))


def test_model_identities_on_random_points():
    rng = np.random.default_rng(1234)
    for _ in range(20):
        m = PlatformModel(t_iss0=rng.uniform(0.1, 5) * US, drain_rate=rng.uniform(50, 5000) * GB,
                          capacity=rng.uniform(0.5, 50) * MiB)
        v = rng.uniform(1, 100) * MiB * rng.uniform(0.01, 1)
        g = rng.uniform(0, 40) * US
        r, t0 = m.drain_rate, m.t_iss0
        t_iss = m.issue_time(v, g)
        assert m.period(v, g) == pytest.approx(max(t_iss + g, v / r))  # eq. 1 & 2 agree
        assert m.issue_overhead(v, g) == pytest.approx(t_iss - t0, abs=1e-18)
        assert m.recovery_gap(v) == pytest.approx(max(v / r - t0, 0.0), abs=1e-18)
        assert m.issue_time(v, m.recovery_gap(v)) == pytest.approx(t0)
        assert m.issue_overhead(v, m.recovery_gap(v) + 1e-9) == 0.0
        assert m.completion_coupled_period(v, g) == pytest.approx(g + v / r)
        if v / r >= t0:  # the max law never exceeds the completion-coupled sum
            assert m.completion_coupled_period(v, g) >= m.period(v, g)
        q_peak = m.peak_outstanding(v)
        iso = m.isolated_issue_time(v)
        if q_peak <= m.capacity:
            assert iso == t0
        else:
            assert iso == pytest.approx(max(t0, (v - m.capacity) / r))
            assert iso >= t0


def test_vectorized_and_scalar_outputs():
    g = np.linspace(0, 20, 11) * US
    v = fa_burst_volume(K_B200, 128, 128, 2)
    t = PAPER.issue_time(v, g)
    assert isinstance(t, np.ndarray) and t.shape == g.shape
    assert np.all(np.diff(t) <= 0)  # more gap never slows issue
    assert isinstance(PAPER.issue_time(v, 1e-6), float)
    p = PAPER.period(v, g)
    assert np.all(p >= v / PAPER.drain_rate - 1e-18)
    vols = np.linspace(0.5, 10, 40) * MiB
    iso = PAPER.isolated_issue_time(vols)
    assert np.all(np.diff(iso) >= -1e-18)
    assert iso[0] == PAPER.t_iss0 and iso[-1] > PAPER.t_iss0


def test_fa_helpers_and_stall():
    assert qloop_gap_lower_bound(8192, 0.79 * US, 128) == pytest.approx(64 * 0.79 * US)
    assert critical_path_stall(9.93, 5.30) == pytest.approx(4.63)  # Table 2, DiT-MoE wave row
    assert critical_path_stall(7.88, 9.54) == 0.0  # DSv4-Pro: covered
    np.testing.assert_allclose(critical_path_stall([1.0, 3.0], [2.0, 1.0]), [0.0, 2.0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(t_iss0=0.0, drain_rate=1e9, capacity=1e6), "t_iss0"),
        (dict(t_iss0=1e-6, drain_rate=-1.0, capacity=1e6), "drain_rate"),
        (dict(t_iss0=1e-6, drain_rate=math.nan, capacity=1e6), "drain_rate"),
        (dict(t_iss0=1e-6, drain_rate=1e9, capacity=0), "capacity"),
        (dict(t_iss0=math.inf, drain_rate=1e9, capacity=1e6), "t_iss0"),
        (dict(t_iss0="fast", drain_rate=1e9, capacity=1e6), "t_iss0"),
    ],
)
def test_validation_names_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PlatformModel(**kwargs)


def test_bad_prediction_inputs():
    with pytest.raises(ValueError, match="volume"):
        PAPER.issue_time(-1.0, 0.0)
    with pytest.raises(ValueError, match="gap"):
        PAPER.period(1.0, [0.0, math.nan])
    with pytest.raises(ValueError, match="sigma_per_kv_tile"):
        PAPER.fa_min_seqlen(1e6, 0.0, 128)
    with pytest.raises(ValueError, match="tile_n"):
        PAPER.fa_min_seqlen(1e6, 1e-6, 0)
    with pytest.raises(ValueError, match="head_dim"):
        fa_tile_burst_bytes(128, 0, 2)
    with pytest.raises(ValueError, match="frozen|cannot assign"):
        try:
            PAPER.t_iss0 = 1.0
        except Exception as exc:  # dataclasses.FrozenInstanceError
            raise ValueError(str(exc)) from exc


def test_json_round_trip(tmp_path):
    m = PlatformModel(0.9 * US, 3000 * GB, 12.5 * MiB, meta={"card": "test", "K": 132})
    path = tmp_path / "m.json"
    text = m.to_json(path, extra={"sweeps": {"x": np.arange(3)}})
    back = PlatformModel.from_json(path)
    assert back == m and back.meta["K"] == 132
    assert PlatformModel.from_json(text) == m
    assert json.loads(text)["sweeps"]["x"] == [0, 1, 2]
    inf = PlatformModel(1 * US, 1 * GB)
    assert math.isinf(PlatformModel.from_json(inf.to_json()).capacity)
    with pytest.raises(ValueError, match="format"):
        PlatformModel.from_json('{"t_iss0_s": 1}')
    d = m.to_dict()
    del d["drain_rate_Bps"]
    with pytest.raises(ValueError, match="drain_rate_Bps"):
        PlatformModel.from_dict(d)
    with pytest.raises(ValueError, match="extra"):
        m.to_json(extra={"t_iss0_s": 1})


# ----------------------------------------------------------------------------------------------
# fits of synthetic measurements from known parameters, 1% multiplicative noise
# ----------------------------------------------------------------------------------------------
TRUE = PlatformModel(t_iss0=1.3 * US, drain_rate=2400 * GB, capacity=7.5 * MiB)
NOISE = 0.01


def _noisy(rng, x):
    return np.asarray(x) * (1 + NOISE * rng.standard_normal(np.shape(x)))


def _issue_floor(v):
    """Synthetic backpressure-free issue time growing with volume (instruction issue)."""
    return 0.4 * US + np.asarray(v) / (9000 * GB)


def _synthetic(rng):
    # zero-gap periods over K x B; small volumes are issue-limited (floor), large drain-limited
    ks = np.array([33, 66, 132])
    bs = np.array([8, 16, 32, 64, 128, 256]) * KiB
    vz = (ks[:, None] * bs[None, :]).ravel().astype(float)
    tz = _noisy(rng, np.maximum(_issue_floor(vz), vz / TRUE.drain_rate))
    # gap sweep at the design point
    v0 = 132 * 64 * KiB
    t0 = float(_issue_floor(v0))
    design = PlatformModel(t0, TRUE.drain_rate, TRUE.capacity)
    gaps = np.linspace(0, 3 * v0 / TRUE.drain_rate, 25)
    tiss = _noisy(rng, design.issue_time(v0, gaps))
    # isolated sweep over B at K = 132
    vi = 132 * np.geomspace(4, 512, 30) * KiB
    ti = _noisy(rng, np.maximum(_issue_floor(vi), (vi - TRUE.capacity) / TRUE.drain_rate))
    return vz, tz, v0, t0, gaps, tiss, vi, ti


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_parameters(seed):
    rng = np.random.default_rng(seed)
    vz, tz, v0, t0, gaps, tiss, vi, ti = _synthetic(rng)
    r = fit_drain_rate(vz, tz, min_volume=4 * MiB)
    assert r == pytest.approx(TRUE.drain_rate, rel=0.02)
    # including the issue-limited points biases R low: the cut matters
    assert fit_drain_rate(vz, tz) < 0.97 * TRUE.drain_rate
    assert fit_issue_floor(gaps, tiss, v0, r) == pytest.approx(t0, rel=0.02)
    cf = fit_capacity(vi, ti, r)
    assert cf.knee_found
    assert cf.capacity == pytest.approx(TRUE.capacity, rel=0.03)
    assert cf.floor_slope * 9000 * GB == pytest.approx(1.0, rel=0.15)
    # with the local-control floor given per point
    cf2 = fit_capacity(vi, ti, r, floor=_noisy(rng, _issue_floor(vi)))
    assert cf2.capacity == pytest.approx(TRUE.capacity, rel=0.03)

    m = PlatformModel.fit(zero_gap_volumes=vz, zero_gap_periods=tz, min_volume=4 * MiB,
                          plateau_volume=v0, plateau_gaps=gaps, plateau_issue_times=tiss,
                          isolated_volumes=vi, isolated_issue_times=ti, meta={"seed": seed})
    assert m.drain_rate == pytest.approx(TRUE.drain_rate, rel=0.02)
    assert m.t_iss0 == pytest.approx(t0, rel=0.02)
    assert m.capacity == pytest.approx(TRUE.capacity, rel=0.03)
    # the fitted model predicts the whole gap sweep with no refit
    pred = m.issue_time(v0, gaps)
    assert np.max(np.abs(pred - tiss) / tiss) < 0.06


def test_fit_without_knee_reports_lower_bound():
    rng = np.random.default_rng(7)
    vi = 132 * np.geomspace(4, 32, 10) * KiB  # all below the 7.5 MiB knee
    ti = _noisy(rng, _issue_floor(vi))
    cf = fit_capacity(vi, ti, TRUE.drain_rate)
    assert not cf.knee_found
    assert cf.capacity <= TRUE.capacity and cf.capacity >= 0


def test_fit_input_errors():
    with pytest.raises(ValueError, match="gaps"):
        fit_issue_floor([0.0, 1e-7], [1e-6, 1e-6], 1e6, 1e9)  # V/R = 1 ms never reached
    with pytest.raises(ValueError, match="periods"):
        fit_drain_rate([1e6, 2e6], [1e-6])
    with pytest.raises(ValueError, match="min_volume"):
        fit_drain_rate([1e6, 2e6], [1e-6, 2e-6], min_volume=1e9)
    with pytest.raises(ValueError, match="isolated_volumes"):
        PlatformModel.fit(zero_gap_volumes=[1e6], zero_gap_periods=[1e-6], plateau_volume=1e6,
                          plateau_gaps=[1e-3], plateau_issue_times=[1e-6], isolated_volumes=[1.0])


# ----------------------------------------------------------------------------------------------
# the calibration pipeline (fa_a2a.tools.calibrate) on a simulated platform: sweeps, fits, outputs
# ----------------------------------------------------------------------------------------------
class _SimBench:
    """Stands in for calibrate.Bench: answers runs from `platform` (default TRUE) with a
    volume-dependent issue floor; the "control" destination has no drain or capacity limit."""

    n_sm = 132
    ns_per_iter = 2.0
    ref_ghz = 1.98
    smid_ok = True

    def __init__(self, seed, platform=TRUE):
        self.rng = np.random.default_rng(seed)
        self.platform = platform

    def iters_for(self, gap_s):
        return max(0, int(round(gap_s * 1e9 / self.ns_per_iter)))

    def run(self, dst, K, B, *, n_bursts, gap_iters=0, align=False, warmup=2, seed=0):
        from fa_a2a.tools.calibrate import RunStats

        v = K * B
        g = gap_iters * self.ns_per_iter * 1e-9 + 0.05 * US  # loop overhead: a small fixed gap
        fl = float(_issue_floor(v))
        r, q = self.platform.drain_rate, self.platform.capacity
        if dst == "control":
            t, per = fl, fl + g
        elif align:
            t, per = max(fl, (v - q) / r), float("nan")
        else:
            t, per = max(fl, v / r - g), max(fl + g, v / r)
        t, per = (float(_noisy(self.rng, x)) for x in (t, per))
        return RunStats(num_ctas=K, bytes_per_cta=B, volume=v, gap_iters=gap_iters, align=align, issue_s=t,
                        issue_max_s=t, period_s=per, gap_s=g, ghz=self.ref_ghz)


def test_calibration_pipeline_on_simulated_platform(tmp_path):
    from fa_a2a.tools import calibrate

    bench = _SimBench(3)
    plan = calibrate.SweepPlan.make(bench.n_sm, quick=True)
    model, res = calibrate.run_sweeps(bench, [("dest", "remote"), ("control", "control")], plan, log=lambda m: None)
    assert model.drain_rate == pytest.approx(TRUE.drain_rate, rel=0.02)
    v0 = bench.n_sm * 32 * KiB
    assert model.t_iss0 == pytest.approx(float(_issue_floor(v0)), rel=0.03)
    assert model.capacity == pytest.approx(TRUE.capacity, rel=0.05)
    assert res["isolated"]["fit"]["knee_found"]
    assert max(abs(e) for e in res["gap_sweep"]["error_period_rel"]) < 0.06
    fa = calibrate.fa4_design(model, bench.n_sm, {"sigma_s": 1.6 * US, "method": "given"})
    assert fa["volume_B"] == bench.n_sm * 32 * KiB
    assert fa["m_ub_tokens"] == pytest.approx(128 * model.recovery_gap(fa["volume_B"]) / (1.6 * US))
    json_path, pngs = calibrate.write_outputs(str(tmp_path), model, res, fa, {"clock": {}}, "cuda-ipc")
    assert PlatformModel.from_json(json_path) == model
    assert len(pngs) == 4 and all((tmp_path / p).stat().st_size > 1000 for p in pngs)
    table = calibrate.markdown_table(model, res, fa, "header")
    assert table.count("\n| ") == 12 and "R (drain rate)" in table  # header row + 11 rows (control Q)
    assert "| FA4 capacity bound" in table and ("holds" in table or "FAILS" in table)
    with pytest.raises(ValueError, match="dests"):
        calibrate.run_sweeps(bench, [("control", "control")], plan)


# ----------------------------------------------------------------------------------------------
# edges (issue 12 item 6): no knee, zero volumes, non-numbers, JSON that is not an object
# ----------------------------------------------------------------------------------------------
def test_fit_on_the_drain_line_marks_q_a_lower_bound():
    vi = 132 * np.geomspace(4, 512, 12) * KiB
    ti = vi / TRUE.drain_rate  # every point on V/R: an affine floor fits it as well as a knee
    cf = fit_capacity(vi, ti, TRUE.drain_rate)
    assert not cf.knee_found and cf.capacity == pytest.approx(0.0, abs=1.0)
    vz = np.array([8, 16, 32]) * MiB
    m = PlatformModel.fit(zero_gap_volumes=vz, zero_gap_periods=vz / TRUE.drain_rate, plateau_volume=vz[0],
                          plateau_gaps=[1e-3], plateau_issue_times=[1e-6], isolated_volumes=vi,
                          isolated_issue_times=ti)
    assert m.capacity_is_lower_bound and m.capacity >= 0 and m.drain_rate == pytest.approx(TRUE.drain_rate)
    # the design test cannot fail the capacity bound on a lower bound: it leaves it undecided
    dt = m.design_test(64 * MiB, 1.0)
    assert dt.undecided == ("capacity",) and dt.failing == () and not dt.ok
    assert "unknown (Q is a lower bound)" in str(dt)
    assert PlatformModel.from_json(m.to_json()) == m
    # a knee found: Q is exact and a larger peak fails
    assert PAPER.design_test(2 * fa_burst_volume(K_B200, 128, 128, 2), 1.0).failing == ("capacity",)


def test_fit_without_knee_gives_a_model():
    rng = np.random.default_rng(7)
    vi = 132 * np.geomspace(4, 32, 10) * KiB
    ti = _noisy(rng, _issue_floor(vi))
    vz = np.array([8, 16, 32]) * MiB
    m = PlatformModel.fit(zero_gap_volumes=vz, zero_gap_periods=vz / TRUE.drain_rate, plateau_volume=vz[0],
                          plateau_gaps=[1e-3], plateau_issue_times=[1e-6], isolated_volumes=vi,
                          isolated_issue_times=ti)
    assert m.capacity_is_lower_bound and 0 <= m.capacity <= TRUE.capacity


@pytest.mark.parametrize("volumes", [[0.0, 0.0, 0.0], [0.0, 1e6, 2e6], [1e6, 1e6, 1e6]])
def test_fit_capacity_refuses_degenerate_volumes(volumes, capfd):
    with pytest.raises(ValueError, match="volumes"):
        fit_capacity(volumes, [1e-6, 2e-6, 3e-6], 1e12)
    assert "LAPACK" not in capfd.readouterr().err


@pytest.mark.parametrize("kwargs, name", [
    (dict(t_iss0=True, drain_rate=1e9), "t_iss0"),
    (dict(t_iss0=1e-6, drain_rate=True), "drain_rate"),
    (dict(t_iss0="1e-6", drain_rate=1e9), "t_iss0"),
    (dict(t_iss0=1e-6, drain_rate=1e9, capacity=False), "capacity"),
    (dict(t_iss0=1e-6, drain_rate=1e9, capacity=0.0), "capacity"),
    (dict(t_iss0=1e-6, drain_rate=1e9, capacity=-1.0, capacity_is_lower_bound=True), "capacity"),
    (dict(t_iss0=1e-6, drain_rate=1e9, capacity=math.inf, capacity_is_lower_bound=True), "capacity"),
    (dict(t_iss0=1e-6, drain_rate=1e9, capacity_is_lower_bound=1), "capacity_is_lower_bound"),
])
def test_platform_model_refuses_non_numbers(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PlatformModel(**kwargs)


def test_from_json_bad_contents_raise_value_error(tmp_path):
    for text, name in ((" [1]", "source"), ("[]", "source"), ('{"format": 1}', "format"),
                       ("{not json", "source")):
        with pytest.raises(ValueError, match=name):
            PlatformModel.from_json(text)
    d = PAPER.to_dict()
    d["meta"] = [1]
    with pytest.raises(ValueError, match="meta"):
        PlatformModel.from_dict(d)
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON list"):
        PlatformModel.from_json(path)
    with pytest.raises(FileNotFoundError):
        PlatformModel.from_json(str(tmp_path / "missing.json"))
    old = PAPER.to_dict()
    del old["capacity_is_lower_bound"]  # files written before the flag existed still load
    assert PlatformModel.from_dict(old) == PAPER


# ----------------------------------------------------------------------------------------------
# FA4 tiles on a platform
# ----------------------------------------------------------------------------------------------
def test_fa4_tile_shape_is_fa4s_table():
    iface = pytest.importorskip("flash_attn.cute.interface")
    from fa_a2a.tools.xstage import fa4_tile_shape

    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            cfg = iface._tile_size_fwd_sm90(d, d, causal, False)
            assert fa4_tile_shape(d, causal) == (cfg.m_block_size, cfg.n_block_size), (d, causal)
    assert fa4_tile_shape(128) == (128, 128)
    for bad in (0, True, 12.0):
        with pytest.raises(ValueError, match="head_dim"):
            fa4_tile_shape(bad)


def test_fa_tiles_and_wave_bound():
    from fa_a2a.tools.xstage import FaTiles, fused_residual

    t = FaTiles(seqlen=8192, heads=3, head_dim=128, batch=1, out_bytes=2, num_sms=132, tile_m=128, tile_n=128)
    assert (t.tiles, t.waves, t.kv_tiles, t.producers) == (192, 2, 64, 132)
    assert t.burst_bytes == 32 * KiB and t.volume == fa_burst_volume(132, 128, 128, 2)
    assert t.wave_volumes() == [132 * 32 * KiB, 60 * 32 * KiB]
    assert FaTiles(256, 1, 128, 1, 2, 132, 128, 128).producers == 2
    # issue 19's bound at M = 8192 into host memory: T_FA 184.5 us, 52 GB/s -> 222 us
    bound = t.wave_drain_bound(184.5 * US, 52 * GB)
    assert bound == pytest.approx(184.5 * US + 60 * 32 * KiB / (52 * GB))
    assert round(bound / US) == 222
    # a fast destination: every burst drains within the next wave, the bound is T_FA + last drain
    assert t.wave_drain_bound(184.5 * US, 4000 * GB) == pytest.approx(184.5 * US + 60 * 32 * KiB / (4000 * GB))
    # a slow one: the first burst's drain is still running when the second wave finishes
    slow = t.wave_drain_bound(184.5 * US, 20 * GB)
    assert slow == pytest.approx(92.25 * US + 192 * 32 * KiB / (20 * GB))
    sigma = t.sigma_from_flops(690e12)
    assert sigma == pytest.approx(4 * 128**3 / (690e12 / 132))
    assert t.sigma_from_time(t.waves * t.kv_tiles * sigma) == pytest.approx(sigma)
    with pytest.raises(ValueError, match="seqlen"):
        FaTiles(0, 3, 128, 1, 2, 132, 128, 128)
    with pytest.raises(ValueError, match="flops_per_s"):
        t.sigma_from_flops(math.inf)

    roomy = PlatformModel(t_iss0=1 * US, drain_rate=52 * GB, capacity=8 * MiB)
    r = fused_residual(roomy, t, 184.5 * US)
    assert r["gap"] == pytest.approx(92.25 * US)
    assert r["stalls"] == [0.0]  # 4.3 MB drains in 83 us < the 92 us Q-loop gap, and fits in Q
    assert r["tail"] == pytest.approx(60 * 32 * KiB / (52 * GB)) and r["e_res"] == r["tail"]
    r = fused_residual(roomy, t, 100 * US)  # a shorter gap than the drain: issue overhead (eq. 4)
    assert r["stalls"][0] == pytest.approx(132 * 32 * KiB / (52 * GB) - 50 * US - 1 * US)
    small_q = PlatformModel(t_iss0=1 * US, drain_rate=52 * GB, capacity=1 * MiB)
    r = fused_residual(small_q, t, 184.5 * US)  # the burst overflows Q: it issues at R (eq. 7)
    assert r["stalls"][0] == pytest.approx((132 * 32 * KiB - 1 * MiB) / (52 * GB) - 1 * US)
    assert r["e_res"] == pytest.approx(r["stalls"][0] + r["tail"])


def test_calibration_without_a_knee_reports_q_as_a_lower_bound(tmp_path):
    # a destination whose capacity is far beyond the swept bursts (no knee): before, the fit gave
    # Q = 0 and PlatformModel refused it; now Q is a lower bound and the capacity test is open
    from fa_a2a.tools import calibrate

    bench = _SimBench(2, PlatformModel(t_iss0=1.3 * US, drain_rate=2400 * GB, capacity=10 * 1024 * MiB))
    plan = calibrate.SweepPlan.make(bench.n_sm, quick=True)
    model, res = calibrate.run_sweeps(bench, [("dest", "remote"), ("control", "control")], plan, log=lambda m: None)
    assert not res["isolated"]["fit"]["knee_found"] and model.capacity_is_lower_bound
    fa = calibrate.fa4_design(model, bench.n_sm, {"sigma_s": None, "method": "not measured"})
    assert fa["capacity_is_lower_bound"] and fa["capacity_ok"] in (True, None)
    table = calibrate.markdown_table(model, res, fa, "header")
    assert "| Q (capacity) | >= " in table and "no knee in the swept range" in table
    json_path, _ = calibrate.write_outputs(str(tmp_path), model, res, fa, {}, "host")
    assert PlatformModel.from_json(json_path).capacity_is_lower_bound


@pytest.mark.parametrize("argv, name", [
    (["--threads", "-5"], "--threads"),
    (["--threads", "100"], "--threads"),
    (["--sigma-us", "nan"], "--sigma-us"),
    (["--sigma-us", "0"], "--sigma-us"),
    (["--sigma-us", "inf"], "--sigma-us"),
    (["--min-fit-volume-mib", "-1"], "--min-fit-volume-mib"),
    (["--min-fit-volume-mib", "nan"], "--min-fit-volume-mib"),
    (["--dest", "ipc"], "--dest"),
    (["--peer", "1"], "--peer"),                                   # --peer / --spread need --dest peer
    (["--dest", "host", "--spread"], "--spread"),
    (["--dest", "peer", "--peer", "1", "--spread"], "--peer"),
    (["--dest", "peer", "--peer", "-1"], "--peer"),
])
def test_calibrate_checks_arguments_before_looking_for_a_gpu(monkeypatch, capsys, argv, name):
    import torch

    from fa_a2a.tools import calibrate

    looked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: looked.append(1) or False)
    with pytest.raises(SystemExit) as e:
        calibrate.main(argv)
    assert e.value.code == 2 and name in capsys.readouterr().err and not looked


def test_calibrate_refuses_clearly_without_a_gpu(monkeypatch, capsys):
    import torch

    from fa_a2a.tools import calibrate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibrate.main(["--dest", "host", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--dest host" in err and "Nothing measured" in err
    with pytest.raises(SystemExit):
        calibrate.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{hbm,cuda-ipc,host,peer}" in text and "NOT NVLink" in text and "legacy CUDA IPC" in text
    assert "CUDA VMM" in text and "--spread" in text


def test_peer_owners_picks_the_owner_gpus_or_names_what_is_missing():
    from fa_a2a.tools.calibrate import peer_owners

    every = lambda a, b: True  # noqa: E731
    for n, access, found in ((0, every, "found 0 (no CUDA GPU)"), (1, every, "found 1 (one GPU)"),
                             (2, lambda a, b: False, "found 1 (GPU 0 cannot access the memory of GPUs [1]")):
        with pytest.raises(ValueError, match=r"^--dest peer: needs >= 2 GPUs with peer access, " + re.escape(found)):
            peer_owners(0, n, access)
    assert peer_owners(1, 4, every) == [2]                          # the next GPU after the issuer
    assert peer_owners(3, 4, every) == [0]                          # ... wrapping around
    assert peer_owners(1, 4, every, peer=0) == [0]
    assert peer_owners(1, 4, every, spread=True) == [0, 1, 2, 3]   # every GPU, the issuer's own included
    for bad in (1, 4, 9):
        with pytest.raises(ValueError, match=rf"^--peer: expected a GPU index in \[0, 4\) other than the issuing GPU 1, got {bad}"):
            peer_owners(1, 4, every, peer=bad)
    no_3 = lambda a, b: b != 3  # noqa: E731
    assert peer_owners(1, 4, no_3) == [2]
    assert peer_owners(2, 4, no_3) == [0]                           # skips the GPU it cannot reach
    with pytest.raises(ValueError, match=r"^--peer: GPU 1 cannot access the memory of GPU 3 .*\[2, 0\]"):
        peer_owners(1, 4, no_3, peer=3)
    with pytest.raises(ValueError, match=r"^--spread: GPU 1 cannot access the memory of GPUs \[3\]"):
        peer_owners(1, 4, no_3, spread=True)


@pytest.mark.parametrize("n_gpus", [0, 1])
def test_calibrate_dest_peer_refuses_one_gpu_before_touching_it(monkeypatch, capsys, n_gpus):
    import torch

    from fa_a2a.tools import calibrate

    def untouched(*a, **k):
        raise AssertionError("calibrate used the GPU after it should have refused")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", untouched)
    monkeypatch.setattr(torch, "empty", untouched)
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--dest", "peer", "--quick"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--dest peer: needs >= 2 GPUs with peer access, found {n_gpus}" in err
