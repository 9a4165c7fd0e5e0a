"""A hostile pass over the benchmark and tool code (fa_a2a/tools, 2026-12-05): each test is a probe that
found a defect, fixed since (a wrong number printed without a note, a flag ignored, a run's results lost
at the end, ranks that disagree on what to report). CPU only: the GPU parts are replaced by fakes where a
test needs them."""
import json
import math

import pytest
import torch

from fa_a2a.tools import bench, bench_block, bench_call, bench_config, bench_report, calibrate
from fa_a2a.tools.xstage import GB, US, PlatformModel, fit_capacity
from tests.multiproc import run_gloo_case


def _model_file(tmp_path, dest, name="model.json"):
    pm = PlatformModel(t_iss0=0.5 * US, drain_rate=60 * GB, capacity=3 * 2**20, meta={"dest": dest})
    path = tmp_path / name
    pm.to_json(path)
    return pm, str(path)


# ------------------------------------------------------------------------------ --out
def test_bench_refuses_out_that_is_an_existing_file(tmp_path):
    """--out naming an existing file is refused up front (not a FileExistsError after the whole run)."""
    f = tmp_path / "existing.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="--out"):
        bench.parse_args(["--out", str(f)], env={})


@pytest.mark.parametrize("tool", ["bench_block", "calibrate"])
def test_tools_refuse_out_that_is_an_existing_file(tool, tmp_path, capsys, monkeypatch):
    """bench_block, calibrate: --out naming an existing file is a usage error naming --out, before any work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = tmp_path / "existing.json"
    f.write_text("{}")
    with pytest.raises(SystemExit) as e:
        {"bench_block": bench_block, "calibrate": calibrate}[tool].main(["--out", str(f)])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


# ------------------------------------------------------------------------------ --platform
def test_whole_call_benchmark_does_not_silently_ignore_platform(tmp_path):
    """Under torchrun without --per-kernel the whole-call benchmark never reads --platform: refuse it."""
    _, path = _model_file(tmp_path, "peer")
    with pytest.raises(ValueError, match="--platform"):
        bench.parse_args(["--platform", path], env={"WORLD_SIZE": "2"})


def test_peer_calibration_is_not_applied_to_host_windows():
    """A --dest peer (NVLink) calibration must not be used for the PCIe host-window rows."""
    pm = PlatformModel(t_iss0=0.5 * US, drain_rate=400 * GB, capacity=4 * 2**20, meta={"dest": "peer"})
    assert not bench_report.model_applies(pm, "host")


def test_no_gpu_predictions_flag_a_host_calibration_used_for_hbm_windows(tmp_path, capsys, monkeypatch):
    """No GPU, windows in HBM, --platform of a host calibration: the predictions must say the model is of
    another destination (on a GPU model_row refuses the same model for hbm rows)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, path = _model_file(tmp_path, "host")
    assert bench.main(["--platform", path, "--seqlens", "8192"]) == 0
    out = capsys.readouterr().out.replace(path, "")
    assert "Burst-Gap model predictions" not in out or "host" in out


# ------------------------------------------------------------------------------ the model
def test_causal_predictions_use_the_causal_q_loop():
    """--causal: a causal tile's Q-loop visits only the KV tiles up to its diagonal (the first one: 1),
    so the predicted gap G (and the design test and M_ub* from it) cannot be the full non-causal one."""
    nc = bench.parse_args(["--seqlens", "8192"], env={})
    c = bench.parse_args(["--seqlens", "8192", "--causal"], env={})
    model = bench_config.PAPER_PLATFORM
    g_nc = bench_report.predictions(nc, model, 1.0, 132)["rows"][0]["gap_us"]
    g_c = bench_report.predictions(c, model, 1.0, 132)["rows"][0]["gap_us"]
    assert g_c < g_nc


def test_calibration_json_has_no_nan():
    """platform_model.json carries the isolated fit; without a knee its knee_volume is NaN, which is not
    JSON (RFC 8259: jq, JavaScript and strict parsers refuse the file)."""
    cf = fit_capacity([1e6, 2e6, 4e6, 8e6], [1e-6] * 4, 1e13)  # every point on the floor: no knee
    assert not cf.knee_found
    pm = PlatformModel(t_iss0=1e-6, drain_rate=1e13, capacity=cf.capacity, capacity_is_lower_bound=True)
    text = pm.to_json(extra={"sweeps": {"isolated": {"fit": cf.as_dict()}}})

    def refuse(c):
        raise ValueError(f"not JSON: {c}")

    json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------------ ranks that disagree
def _fake_event():
    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, *a):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.1

    return Event


def _per_kernel_case(rank, P):
    """bench.run_point on 2 gloo ranks, GPU parts faked: rank 1's fused output is NaN, rank 0's finite."""
    import torch.distributed as dist

    import graphs
    from fa_a2a.tools import bench_methods

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Event = _fake_event()
    graphs.capture = lambda *a, **k: object()
    graphs.time_graphs = lambda methods, n_calls, trials, *a, **k: {m: [10.0] * trials for m in methods}
    eager_names = []

    def time_eager(methods, n_calls, trials, **k):
        eager_names.append(sorted(methods))
        return {m: [12.0] * trials for m in methods}

    graphs.time_eager = time_eager

    def build(bad_rank):
        def b(pt, s):
            out = torch.full((2,), math.nan if pt.rank == bad_rank else 0.0)
            return (lambda: None), out
        return b

    by_key = dict(bench_methods.BY_KEY)
    for key, bad in (("fa", -1), ("fused", 1)):
        m = by_key[key]
        by_key[key] = bench_methods.Method(m.key, m.label, m.what, build(bad), m.ranks, m.hbm_only)
    bench.BY_KEY = by_key
    cfg = bench.parse_args(["--per-kernel", "--seqlens", "16", "--heads", "2", "--methods", "fa", "fused",
                            "--calls", "2", "--trials", "2", "--batch", "1"], env={"WORLD_SIZE": "2"})
    ctx = {"rank": rank, "group": dist.group.WORLD, "device": torch.device("cpu"), "barrier": None,
           "l2_bytes": 0}
    point = bench.run_point(cfg, 16, "hbm", ctx, bench_report._Log(rank))
    assert point["finite"]["fused"] is False, f"rank {rank} reports fused finite though rank 1's was NaN"
    assert "fused" not in point["median_us"]
    names = [None] * P
    dist.all_gather_object(names, eager_names)
    assert names[0] == names[1], f"the ranks timed different eager methods: {names}"


def test_per_kernel_bench_agrees_the_finite_check_across_ranks():
    """bench.run_point: a method non-finite on one rank only must be dropped on every rank (rank 0 writes
    the JSON and table; the eager timing's collectives need the same methods on all ranks)."""
    run_gloo_case(_per_kernel_case, 2, deadline_s=120)


def _call_point_case(rank, P):
    """bench_call.run_call_point on 2 gloo ranks, GPU parts faked: rank 1's fused output is NaN."""
    import graphs

    graphs.capture = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no graphs here"))
    graphs.time_batches = lambda batches, n_calls, trials, *a, **k: {m: [10.0] * trials for m in batches}
    bench_call.select_methods = lambda shared: (("fa4_local", "fused"), {})
    bench_call.first_calls = lambda keys, first, timed, status, group, after_first=None: {k: 10.0 for k in keys}
    bench_call.rank_aligner = lambda group: (lambda: None)
    bench_call._breakdown = lambda steps, n_calls, trials, align: ({p: 1.0 for p in bench_call.PHASES}, 1.0)
    nan = math.nan if rank == 1 else 0.0
    calls = {"fa4_local": lambda: torch.zeros(2), "fused": lambda: torch.full((2,), nan)}
    bench_call._build = lambda cfg, M, ctx, keys: (calls, ("steps",), None)
    cfg = bench.parse_args(["--seqlens", "16", "--heads", "2", "--calls", "2", "--trials", "2"],
                           env={"WORLD_SIZE": "2"})
    import torch.distributed as dist

    ctx = {"rank": rank, "group": dist.group.WORLD, "shared_gpu": False, "device": torch.device("cpu")}
    point = bench_call.run_call_point(cfg, 16, ctx, bench_report._Log(rank))
    assert point["finite"]["fused"] is False, f"rank {rank} reports the fused call finite though rank 1's was NaN"
    assert "fused" not in point["median_us"] and point["breakdown"] is None


def test_whole_call_bench_agrees_the_finite_check_across_ranks():
    """bench_call.run_call_point: the fused call's finite check is per rank, and the breakdown (with its
    barriers and all_reduce) runs only where it passed: one NaN rank leaves the others in a collective."""
    run_gloo_case(_call_point_case, 2, deadline_s=120)


# ------------------------------------------------------------------------------ fourth pass (2026-12-05)
@pytest.mark.parametrize("out", ["", "afile/sub"])
def test_bench_refuses_out_that_cannot_be_made(out, tmp_path):
    """--out under an existing file, or empty, was accepted: the writes at the end of the run failed."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="^--out: "):
        bench.parse_args(["--out", str(tmp_path / out) if out else out], env={})


@pytest.mark.parametrize("damage", ["huge int", "deep"])
def test_a_platform_file_of_a_huge_int_or_deep_json_is_a_usage_error(damage, tmp_path, capsys, monkeypatch):
    """A platform file holding a 400-digit int (OverflowError) or JSON nested deep (RecursionError): a
    traceback, exit 1, instead of the usage error naming --platform."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, path = _model_file(tmp_path, "peer")
    data = json.loads(open(path).read())
    data["t_iss0_s"] = 10 ** 400
    text = json.dumps(data) if damage == "huge int" else "[" * 5000 + "]" * 5000
    with open(path, "w") as fh:
        fh.write(text)
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--platform", path])
    assert e.value.code == 2 and "--platform" in capsys.readouterr().err
