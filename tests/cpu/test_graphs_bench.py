"""CPU tier of graphs/ and fa_a2a.tools.bench: argument validation, derived metrics, tables, the model
beside the measurements, plots, the cross-rank max (two gloo processes), and the no-GPU run."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fa_a2a.tools import bench, bench_config, bench_methods, bench_report
from fa_a2a.tools.xstage import GB, US, PlatformModel
from graphs import timing
from graphs.timing import GpuClockMonitor, calls_for, input_sets_needed, rotated, round_up
from ulysses.reference import dist_head_to_seq

from tests.helpers import repo_env
from tests.multiproc import run_on_gloo_groups


# ------------------------------------------------------------------------------ graphs
def test_rotated_puts_every_method_in_every_position():
    names = ["fa", "a2a", "serial", "fused"]
    orders = [rotated(names, t) for t in range(len(names))]
    assert orders[0] == names and orders[1] == ["a2a", "serial", "fused", "fa"]
    for pos in range(len(names)):
        assert sorted(o[pos] for o in orders) == sorted(names)
    assert rotated(names, 5) == orders[1]
    assert rotated([], 3) == []


def test_input_sets_needed():
    L2 = 50 * 2**20
    assert input_sets_needed(L2 * 4, L2) == 1  # far bigger than L2: one set
    assert input_sets_needed(L2 // 2, L2) == 4  # 2 * L2 / (L2 / 2)
    assert input_sets_needed(31_500_000, L2) == math.ceil(2 * L2 / 31_500_000)
    assert input_sets_needed(1, L2) == 16  # clamped
    assert input_sets_needed(1, L2, max_sets=3) == 3
    assert input_sets_needed(1000, 0) == 1
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bytes_per_set"):
            input_sets_needed(bad, L2)
    with pytest.raises(ValueError, match="factor"):
        input_sets_needed(10, L2, factor=0)
    assert round_up(139, 4) == 140 and round_up(140, 4) == 140 and round_up(1, 1) == 1


def test_calls_for_fills_the_target_within_its_bounds():
    assert calls_for(1000.0, 25.0) == 25  # 1 ms calls, a 25 ms batch
    assert calls_for(999.0, 25.0) == 26  # rounded up
    assert calls_for(1e6, 25.0) == 3 and calls_for(0.0, 25.0) == 200


def test_capture_and_time_graphs_validate_before_touching_cuda():
    f = lambda: None  # noqa: E731
    with pytest.raises(ValueError, match="n_calls"):
        timing.capture(f, 0)
    with pytest.raises(ValueError, match="fn"):
        timing.capture([], 3)
    with pytest.raises(ValueError, match="fn"):
        timing.capture([f, 3], 3)
    with pytest.raises(ValueError, match="methods"):
        timing.time_graphs({}, 3, 3)
    with pytest.raises(ValueError, match="trials"):
        timing.time_graphs({"a": f}, 3, 0)
    with pytest.raises(ValueError, match="warmup"):
        timing.time_graphs({"a": f}, 3, 2, warmup=-1)
    with pytest.raises(ValueError, match="n_calls"):
        timing.time_graphs({"a": f}, True, 2)
    with pytest.raises(ValueError, match=r"methods\['b'\]"):
        timing.time_graphs({"a": f, "b": "nope"}, 3, 2)
    with pytest.raises(ValueError, match="barrier"):
        timing.time_graphs({"a": f}, 3, 2, barrier=5)
    with pytest.raises(ValueError, match="methods"):
        timing.time_eager({}, 3, 3)
    with pytest.raises(ValueError, match="n_calls"):
        timing.time_eager({"a": f}, 0, 3)
    with pytest.raises(ValueError, match="trials"):
        timing.time_eager({"a": f}, 3, 0)
    with pytest.raises(ValueError, match=r"methods\['a'\]"):
        timing.time_eager({"a": 1}, 3, 3)
    with pytest.raises(ValueError, match="barrier"):
        timing.time_eager({"a": f}, 3, 2, barrier="x")
    with pytest.raises(ValueError, match="values"):
        timing.median([])
    assert timing.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    assert timing.round_up(5, 4) == 8
    with pytest.raises(ValueError, match="multiple"):
        timing.round_up(5, 0)


def test_clock_monitor_drift_warning():
    mon = GpuClockMonitor(enabled=False)
    assert not mon.available and mon.sample("fa") is None and mon.summary() == {}
    mon.record("fa", 1980, 40)
    assert mon.drift("fa") is None  # one sample
    mon.record("fa", 1900, 45)
    mon.record("fa", 1890, 50)  # -4.5%: within 5%
    assert mon.check("fa") is None
    mon.record("fused", 1980, 50)
    mon.record("fused", 1700, 70)  # -14%
    with pytest.warns(RuntimeWarning, match=r"drifted -14\.1%.*'fused'.*1980 -> 1700 MHz"):
        msg = mon.check("fused")
    assert msg and mon.warnings == [msg]
    s = mon.summary()
    assert s["fa"]["sm_clock_mhz"] == {"first": 1980, "last": 1890, "min": 1890, "max": 1980}
    assert s["fused"]["temperature_c"]["max"] == 70 and s["fa"]["n"] == 3
    assert math.isclose(s["fa"]["drift"], (1890 - 1980) / 1980)
    # a dip in the middle warns even when first and last agree (seen on an H200: 1680 -> 1485 -> 1680)
    for mhz in (1680, 1485, 1680):
        mon.record("dip", mhz, 50)
    assert math.isclose(mon.drift("dip"), (1485 - 1680) / 1680)
    with pytest.warns(RuntimeWarning, match=r"-11\.6%.*range 1485-1680 MHz"):
        assert mon.check("dip")
    with pytest.raises(ValueError, match="drift_tol"):
        GpuClockMonitor(enabled=False, drift_tol=0)


def test_clock_monitor_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    mon = GpuClockMonitor()
    assert not mon.available and "NVML unavailable" in mon.reason
    assert mon.read() is None and mon.device_info() == {}


B, S_LOC, H_LOC, D = 2, 3, 2, 4


def _o(rank, world):  # rank's attention output [B, S, H_loc, D], distinct values everywhere
    n = B * world * S_LOC * H_LOC * D
    return (torch.arange(n, dtype=torch.float32) + 1000 * rank).view(B, world * S_LOC, H_LOC, D)


def _check_two_ranks(P, group, rank):
    # rank 0 is slower in trial 0, rank 1 in trial 1
    values = torch.tensor([[10.0 + 5 * (rank == 0), 1.0], [7.0, 2.0 + rank]], dtype=torch.float64)
    assert torch.equal(timing.rank_max(values, group), torch.tensor([[15.0, 1.0], [7.0, 3.0]], dtype=torch.float64))
    send = torch.empty(P, B, S_LOC, H_LOC, D)
    out = torch.full((B, S_LOC, P * H_LOC, D), float("nan"))
    dist_head_to_seq(_o(rank, P), group=group, buffers=(send, torch.empty_like(send), out))
    # Ulysses post-A2A: rank r's rows of every source rank's heads, head = src * H_loc + h
    expect = torch.cat([_o(src, P)[:, rank * S_LOC:(rank + 1) * S_LOC] for src in range(P)], dim=2)
    assert torch.equal(out, expect), rank


def test_rank_max_and_baseline_a2a_over_two_processes():
    run_on_gloo_groups(_check_two_ranks, (2,))
    x = torch.tensor([1.0, 2.0])
    assert timing.rank_max(x) is x  # no process group: identity


# ------------------------------------------------------------------------------ arguments
def test_defaults_emulated_and_quick():
    cfg = bench.parse_args([], env={})
    assert cfg.seqlens == (8192, 16384, 32768, 49152, 65536)
    assert (cfg.heads, cfg.head_dim, cfg.world_size, cfg.batch, cfg.dtype) == (24, 128, 8, 1, "bf16")
    assert not cfg.real_ranks and cfg.heads_local == 3 and not cfg.causal
    assert cfg.methods == tuple(m.key for m in bench_methods.METHODS) and cfg.calls is None and cfg.dests == ("hbm",)
    assert cfg.out == os.path.join("results", "bench")
    q = bench.parse_args(["--quick"], env={})
    assert q.seqlens == (8192, 16384) and q.trials < cfg.trials and q.target_ms < cfg.target_ms
    q = bench.parse_args(["--quick", "-M", "4096", "--trials", "9"], env={})
    assert q.seqlens == (4096,) and q.trials == 9
    c = bench.parse_args(["--causal", "--dtype", "fp16", "--methods", "fused", "fa", "--world-size", "4"], env={})
    assert c.causal and c.dtype == "fp16" and c.methods == ("fa", "fused") and c.heads_local == 6
    assert bench.parse_args(["--dest", "host", "hbm"], env={}).dests == ("hbm", "host")
    assert bench.parse_args(["--dest", "host"], env={}).dests == ("host",)


def test_help_names_the_host_proxy_and_every_method(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dest {hbm,host}" in text and "pinned host memory" in text and "NOT NVLink" in text
    assert all(f"{m.key} = " in text for m in bench_methods.METHODS)


def test_torchrun_world_size():
    cfg = bench.parse_args([], env={"WORLD_SIZE": "4"})
    assert cfg.real_ranks and cfg.world_size == 4 and cfg.heads_local == 6
    assert bench.parse_args([], env={"WORLD_SIZE": "1"}).real_ranks is False
    with pytest.raises(ValueError, match="--world-size"):
        bench.parse_args(["--world-size", "8"], env={"WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="--dest: host windows need emulated ranks"):
        bench.parse_args(["--dest", "host"], env={"WORLD_SIZE": "4"})


@pytest.mark.parametrize("argv, match", [
    (["--heads", "25"], "--heads"),
    (["--heads", "0"], "--heads"),
    (["--seqlens", "8190"], "--seqlens"),
    (["--seqlens", "0"], "--seqlens"),
    (["--seqlens", "8192", "8192"], "--seqlens"),
    (["--world-size", "0"], "--world-size"),
    (["--head-dim", "100"], "--head-dim"),
    (["--head-dim", "512"], "--head-dim"),
    (["--batch", "0"], "--batch"),
    (["--trials", "0"], "--trials"),
    (["--warmup", "-1"], "--warmup"),
    (["--calls", "0"], "--calls"),
    (["--target-ms", "0"], "--target-ms"),
    (["--platform", "/nonexistent/platform.json"], "--platform"),
    (["--num-sms", "0"], "--num-sms"),
    (["--fa-tflops", "-1"], "--fa-tflops"),
    (["--fa-tflops", "inf"], "--fa-tflops"),
    (["--fa-tflops", "nan"], "--fa-tflops"),
    (["--target-ms", "inf"], "--target-ms"),
])
def test_bad_arguments_raise_value_error(argv, match):
    with pytest.raises(ValueError, match=match):
        bench.parse_args(argv, env={})


def test_main_turns_bad_arguments_into_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--heads", "25"])
    assert e.value.code == 2
    assert "--heads: H=25 is not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "fp8"])
    with pytest.raises(SystemExit) as e:
        bench.main(["--dest", "nvlink"])
    assert e.value.code == 2 and "--dest" in capsys.readouterr().err


_GOOD = PlatformModel(t_iss0=1e-6, drain_rate=50e9, capacity=2**20).to_dict()


@pytest.mark.parametrize("contents", [
    "{not json",
    "{}",
    "[1, 2]",
    '"text"',
    "",
    json.dumps({**_GOOD, "t_iss0_s": 0}),
    json.dumps({**_GOOD, "drain_rate_Bps": -5}),
    json.dumps({**_GOOD, "capacity_B": 0}),
    json.dumps({**_GOOD, "t_iss0_s": True}),
    json.dumps({**_GOOD, "t_iss0_s": "1e-6"}),
    json.dumps({**_GOOD, "meta": 3}),
    json.dumps({k: v for k, v in _GOOD.items() if k != "drain_rate_Bps"}),
    json.dumps(_GOOD).replace('"t_iss0_s": 1e-06', '"t_iss0_s": NaN'),
    json.dumps(_GOOD).replace('"drain_rate_Bps": 50000000000.0', '"drain_rate_Bps": Infinity'),
])
def test_bad_platform_file_is_a_usage_error(tmp_path, capsys, contents):
    path = tmp_path / "platform.json"
    path.write_text(contents)
    with pytest.raises(SystemExit) as e:
        bench.main(["--platform", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--platform: {path} is not a platform model" in err and "Traceback" not in err


def test_fa_tflops_inf_is_a_usage_error_not_a_traceback(tmp_path):
    env = repo_env(CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    for flag in ("--fa-tflops", "--target-ms"):
        p = subprocess.run([sys.executable, "-m", "fa_a2a.tools.bench", "--quick", flag, "inf"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr, p.stderr


# ------------------------------------------------------------------------------ metrics
def test_derived_metrics_reproduce_the_papers_table():
    # X-Stage paper, Table 3 (FA4 + A2A, 8xB200): M=8192 and M=16384 columns.
    d = bench_report.derive({"fa": 85.4, "serial": 140.9, "fused": 99.4})
    assert math.isclose(d["e_res_us"], 14.0, abs_tol=1e-9)
    # the paper's metrics come from unrounded medians: 1.417x there, 140.9 / 99.4 = 1.4175 here
    assert round(100 * d["hiding"]) == 75 and abs(d["speedup"] - 1.417) < 1e-3
    assert math.isclose(d["fused_over_fa"], 99.4 / 85.4) and math.isclose(d["e_res_rel"], 14.0 / 85.4)
    d = bench_report.derive({"fa": 346.5, "serial": 462.4, "fused": 356.6})
    assert round(100 * d["hiding"]) == 91 and abs(d["speedup"] - 1.297) < 1e-3
    d = bench_report.derive({"fa": 1439.4, "serial": 1660.9, "fused": 1429.2})  # negative residual kept
    assert d["e_res_us"] < 0 and d["hiding"] > 1


def test_derived_metrics_with_missing_inputs():
    d = bench_report.derive({"fa": 100.0, "fused": 110.0},
                     {"fa": [100.0, 200.0, 100.0], "fused": [101.0, 204.0, 102.0]})
    assert d["fused_over_fa_paired"] == pytest.approx(1.02)  # median of 1.01, 1.02, 1.02
    # hiding ratio only when T_serial - T_FA stands out of the per-trial noise
    med = {"fa": 100.0, "serial": 104.0, "fused": 101.0}
    steady = {"fa": [100.0, 100.5, 99.5], "serial": [104.0, 104.5, 103.5], "fused": [101.0] * 3}
    assert bench_report.derive(med, steady)["hiding"] == pytest.approx(0.75)
    noisy = {"fa": [100.0, 103.0, 97.0], "serial": [104.0, 101.0, 105.0], "fused": [101.0] * 3}
    assert bench_report.derive(med, noisy)["hiding"] is None and bench_report.derive(med, noisy)["comm_us"] is None
    assert bench_report.derive(med, steady)["comm_us"] == 4.0
    d = bench_report.derive({"fa": 100.0, "fused": 110.0})
    assert d["e_res_us"] == 10.0 and d["hiding"] is None and d["speedup"] is None
    d = bench_report.derive({"fa": 100.0, "serial": 100.0, "fused": 101.0})
    assert d["hiding"] is None  # zero denominator
    d = bench_report.derive({"serial": 200.0, "fused": 100.0, "serial_nccl": 300.0, "layer_nccl": 9.0,
                             "layer_fused": 3.0})
    assert d["speedup"] == 2.0 and d["speedup_nccl"] == 3.0 and d["layer_speedup"] == 3.0
    assert d["e_res_us"] is None
    assert all(v is None for v in bench_report.derive({}).values())


def _point(M, med, status=None):
    return {"M": M, "median_us": med, "status": status or {}, "derived": bench_report.derive(med)}


def test_table_shows_only_measured_numbers():
    methods = ("fa", "a2a", "serial", "serial_nccl", "fused")
    pts = [
        _point(8192, {"fa": 181.04, "a2a": 20.0, "serial": 210.0, "fused": 183.0},
               {"serial_nccl": bench_methods.NA_REAL}),
        _point(16384, {"fa": 592.0, "serial": 630.0},
               {"serial_nccl": bench_methods.NA_REAL, "a2a": "skipped (fa_a2a.op.post_a2a does not exist yet)",
                "fused": "non-finite output"}),
    ]
    table = bench_report.format_table(pts, methods)
    lines = table.splitlines()
    assert lines[0].startswith("| M | FA4-only (us) | A2A-only (us) | Serial (us) | Serial-NCCL (us) | Fused (us) |")
    assert "T_serial/T_fused" in lines[0] and "H" in [c.strip() for c in lines[0].split("|")]
    assert "T_serial-NCCL/T_fused" not in lines[0]  # never computed: column hidden
    assert len(lines) == 4 and all(l.count("|") == lines[0].count("|") for l in lines)
    row1 = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert row1[:6] == ["8192", "181.0", "20.0", "210.0", bench_methods.NA_REAL, "183.0"]
    assert "+1.08%" in row1 and "93%" in row1  # E_res/T_FA = 1.96/181.04, H = 1 - 1.96/28.96
    row2 = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert row2[2].startswith("skipped") and row2[5] == "non-finite output"
    assert row2[6:] == ["-"] * (len(row2) - 6)  # no derived number without the fused time
    assert bench_report.format_table([_point(8192, {})], ["fa"]).splitlines()[2] == "| 8192 | not run |"
    # methods that apply nowhere go to a note; Serial-NCCL keeps its column
    keys = [m.key for m in bench_methods.METHODS]
    na = {m.key: why for m in bench_methods.METHODS if (why := bench_methods.not_applicable(m, False, "hbm"))}
    assert set(na) == {"a2a_nccl", "serial_nccl", "layer_fused", "layer_fused_st", "layer_serial", "layer_nccl",
                       "layer_auto"}
    table = bench_report.format_table([_point(8192, {"fa": 1.0}, na)], keys)
    assert table.splitlines()[0].startswith("| M | FA4-only (us) | A2A-only (us) | Serial (us) | Serial-NCCL (us) |")
    assert "Layer" not in table.splitlines()[0] and "windows" not in table.splitlines()[0]
    assert table.splitlines()[-1] == ("Not run: A2A-only NCCL, Layer fused, Layer fused st, Layer serial, Layer NCCL, "
                                      "Layer auto (needs real ranks).")
    # host windows: a windows column, and the op's own HBM windows do not apply there
    host = {m.key: why for m in bench_methods.METHODS if (why := bench_methods.not_applicable(m, False, "host"))}
    assert host["op_emulated"] == bench_methods.NA_HOST
    pts = [dict(_point(8192, {"fa": 1.0, "op_emulated": 9.0}, na), dest="hbm"),
           dict(_point(8192, {"fa": 1.5}, host), dest="host")]
    lines = bench_report.format_table(pts, keys).splitlines()
    assert lines[0].startswith("| M | windows | FA4-only (us) |") and "Op emulated (us)" in lines[0]
    assert lines[2].startswith("| 8192 | hbm | 1.0 |") and lines[3].startswith("| 8192 | host | 1.5 |")
    assert lines[3].split("|")[-2].strip() == bench_methods.NA_HOST
    # under torchrun the emulated op does not apply
    assert bench_methods.not_applicable(bench_methods.BY_KEY["op_emulated"], True, "hbm") == bench_methods.NA_EMULATED


def test_eager_table():
    p = dict(_point(8192, {"fa": 180.0, "op_emulated": 1600.0}), dest="hbm", eager_us={"fa": 190.0, "op_emulated": 2400.0})
    lines = bench_report.format_eager([p]).splitlines()
    assert lines[0] == "| M | method | graph (us/call) | eager wall (us/call) | eager / graph |"
    assert lines[2] == "| 8192 | FA4-only | 180.0 | 190.0 | 1.06 |"
    assert lines[3] == "| 8192 | Op emulated | 1600.0 | 2400.0 | 1.50 |"
    assert len(lines) == 4  # no eager time, no row


# ------------------------------------------------------------------------------ the model
def test_model_beside_the_measurements():
    # issue 19's host-memory numbers at M = 8192 (H200, 2026-12-03): FA4 184.5, A2A-only 121.1,
    # serial 306.6, fused 295.2 us; the bound there: T_bound ~ 221 us
    cfg = bench.parse_args(["-M", "8192", "--dest", "host"], env={})
    med = {"fa": 184.5, "a2a": 121.1, "serial": 306.6, "fused": 295.2}
    p = dict(_point(8192, med), dest="host")
    host = PlatformModel(t_iss0=1 * US, drain_rate=52 * GB, capacity=2**20, meta={"dest": "host"})
    r = bench_report.model_row(p, cfg, host, 132)
    o_bytes = 8192 * 3 * 128 * 2
    assert r["a2a_GBps"] == pytest.approx(o_bytes / 121.1e-6 / 1e9) and round(r["a2a_GBps"]) == 52
    assert r["waves"] == 2 and r["gap_us"] == pytest.approx(92.25)
    assert r["t_bound_us"] == pytest.approx(184.5 + 60 * 32768 / (o_bytes / 121.1e-6) * 1e6)
    assert 215 < r["t_bound_us"] < 225 and r["hiding_bound"] == pytest.approx(1 - (r["t_bound_us"] - 184.5) / 122.1)
    # the first wave's 4.3 MB burst overflows Q = 1 MiB and issues at R; the last wave drains after FA
    assert r["e_res_model_us"] == pytest.approx(((132 * 32768 - 2**20) / 52e9 - 1e-6 + 60 * 32768 / 52e9) * 1e6)
    assert r["hiding_model"] == pytest.approx(1 - r["e_res_model_us"] / 122.1)
    assert r["e_res_us"] == pytest.approx(110.7) and r["design_test"] == "FAILS: capacity"  # 4.3 MB > Q + R·T_iss0
    text = bench_report.format_model([r], "test")
    assert "| 8192 | host | 2 | 4.12 | 92.2 | FAILS: capacity | +99.8 | +110.7 | 18% | " in text
    # a model of the other destination is not applied; the bound needs no model
    hbm = PlatformModel(t_iss0=0.49 * US, drain_rate=4245 * GB, capacity=2**21, meta={"dest": "local"})
    r2 = bench_report.model_row(p, cfg, hbm, 132)
    assert r2["design_test"] is None and r2["e_res_model_us"] is None and r2["t_bound_us"] == r["t_bound_us"]
    assert bench_report.model_row(dict(_point(8192, {"fused": 1.0}), dest="host"), cfg, host, 132) is None
    # no knee: the capacity bound is undecided, not failed
    low = PlatformModel(t_iss0=1 * US, drain_rate=52 * GB, capacity=0.0, capacity_is_lower_bound=True)
    assert bench_report.model_row(p, cfg, low, 132)["design_test"] == "undecided: capacity (Q is a lower bound)"


def test_predictions_use_the_model():
    cfg = bench.parse_args(["-M", "8192", "65536"], env={})
    model, source = bench_config.load_platform(None)
    assert "paper" in source
    assert math.isclose(model.drain_rate, 717e9) and math.isclose(model.t_iss0, 0.76e-6)
    pred = bench_report.predictions(cfg, model, sigma_us=1.6, num_sms=132)
    V = 132 * 32768
    assert math.isclose(pred["m_ub"], 128 * (V / 717e9 - 0.76e-6) / 1.6e-6)
    r = pred["rows"][0]
    assert r["M"] == 8192 and math.isclose(r["gap_us"], 64 * 1.6) and r["design_test"] == "pass"
    assert math.isclose(r["recovery_gap_us"], (V / 717e9 - 0.76e-6) * 1e6)
    # a platform that cannot drain the burst in the gap fails the rate bound
    slow = PlatformModel(t_iss0=1e-6, drain_rate=1e9, capacity=1e6)
    assert bench_report.predictions(cfg, slow, 1.6, 132)["rows"][0]["design_test"].startswith("FAILS: rate")
    text = bench_report.format_predictions(pred, source)
    assert "not measurements" in text and "| 65536 |" in text


def test_platform_json_is_read(tmp_path):
    path = tmp_path / "platform.json"
    PlatformModel(t_iss0=2e-6, drain_rate=300e9, capacity=2**22).to_json(path)
    model, source = bench_config.load_platform(str(path))
    assert model.drain_rate == 300e9 and str(path) in source


def test_plots_are_written(tmp_path):
    pts = [_point(8192, {"fa": 181.0, "a2a": 20.0, "serial": 210.0, "fused": 183.0}),
           _point(16384, {"fa": 592.0, "a2a": 40.0, "serial": 640.0, "fused": 594.0}),
           dict(_point(8192, {"fa": 181.0, "a2a": 120.0, "serial": 300.0, "fused": 290.0}), dest="host")]
    cfg = bench.parse_args([], env={})
    import dataclasses

    result = {"points": pts, "env": {"card": "test card"}, "config": dataclasses.asdict(cfg)}
    files = bench_report.write_plots(result, tmp_path, m_ub=421.0)
    assert sorted(Path(f).name for f in files) == ["eres_vs_M.png", "speedup_vs_M.png", "time_vs_M.png"]
    assert all(Path(f).stat().st_size > 1000 for f in files)


# ------------------------------------------------------------------------------ no-GPU run
def test_script_without_gpu_exits_0_and_prints_predictions(tmp_path):
    env = repo_env(CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, "-m", "fa_a2a.tools.bench", "--quick", "--out", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "No CUDA GPU: nothing was measured" in p.stdout
    assert "Burst-Gap model predictions" in p.stdout and "not measurements" in p.stdout
    rows = [l for l in p.stdout.splitlines() if l.startswith("| 8192 ") or l.startswith("| 16384 ")]
    assert len(rows) == 2 and all(l.count("|") == 9 for l in rows)
    assert not out.exists() and f"Nothing written to {out}" in p.stdout  # nothing measured, nothing written
    bad = subprocess.run([sys.executable, "-m", "fa_a2a.tools.bench", "--heads", "7"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--heads" in bad.stderr
