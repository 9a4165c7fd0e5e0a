"""CPU tier of `python -m fa_a2a.bench --backward` (fa_a2a.tools.bench_backward): the flag and its hand-over,
the flags it refuses (a usage error, exit 2), the no-GPU line (exit 0, nothing written), the
ratios and the table from synthetic timings (nothing is timed here), and the first calls and batch
size it shares with the whole-call benchmark (on a fake clock)."""
import json
import os
import subprocess
import sys

import pytest

from fa_a2a.tools import bench, bench_backward as bb
from fa_a2a.tools.bench_config import CALL_SEQLENS, QUICK_SEQLENS
from tests.cpu.test_bench_call import _env  # a CPU-only environment without torchrun's variables


def _cfg(argv, env=None):
    return bench.parse_args(argv, env={} if env is None else env)


# ------------------------------------------------------------------------------ flags
def test_the_flag_parses_and_leaves_the_other_settings_as_bench_reads_them():
    assert bench.build_parser().parse_args([]).backward is False
    ns = bench.build_parser().parse_args(["--backward", "--quick", "--world-size", "2", "--heads", "8"])
    assert ns.backward is True
    bb.check_args(ns)
    cfg = bench.make_config(ns, env={})
    assert (cfg.seqlens, cfg.world_size, cfg.heads_local, cfg.trials, cfg.warmup) == (QUICK_SEQLENS, 2, 4, 5, 1)
    assert not cfg.real_ranks
    real = bench.make_config(bench.build_parser().parse_args(["--backward"]), env={"WORLD_SIZE": "4"})
    assert real.real_ranks and real.world_size == 4 and real.seqlens == CALL_SEQLENS  # as the whole-call bench


def test_out_proj_rides_on_backward_and_names_itself():
    """--out-proj C_OUT: the output projection in both sides of --backward (its title says so); without
    --backward, or out of its bounds, a ValueError naming --out-proj (a usage error)."""
    assert _cfg(["--backward"]).out_proj == 0
    cfg = _cfg(["--backward", "--out-proj", "3072", "--world-size", "2"])
    assert cfg.out_proj == 3072
    assert "output projection H*D -> 3072" in bb.table_title([], "NVIDIA H100", cfg)
    assert "output projection" not in bb.table_title([], "NVIDIA H100", _cfg(["--backward"]))
    with pytest.raises(ValueError, match="--out-proj: only with --backward"):
        _cfg(["--out-proj", "3072"])
    with pytest.raises(ValueError, match="--out-proj"):
        _cfg(["--backward", "--out-proj", "0"])


def test_joint_rides_on_backward_and_names_itself():
    """--joint J: joint (text) rows in both sides of --backward (the title says so); without --backward,
    with --out-proj (no joint rows there) or --causal (not defined with joint rows), or out of bounds: a
    ValueError naming --joint."""
    assert _cfg(["--backward"]).joint == 0
    cfg = _cfg(["--backward", "--joint", "512", "--world-size", "2"])
    assert cfg.joint == 512
    assert "512 joint rows (FA4 over M + 512 rows)" in bb.table_title([], "NVIDIA H100", cfg)
    assert "joint" not in bb.table_title([], "NVIDIA H100", _cfg(["--backward"]))
    for argv, match in ((["--joint", "512"], "--joint: only with --backward"),
                        (["--backward", "--joint", "0"], "--joint"),
                        (["--backward", "--joint", "8", "--out-proj", "3072"], "--joint: not with --out-proj"),
                        (["--backward", "--joint", "8", "--causal"], "--joint: not with --causal")):
        with pytest.raises(ValueError, match=match):
            _cfg(argv)


def test_breakdown_rides_on_backward_and_sorts_kernels_by_kind():
    """--breakdown: kernel time per call by kind, from torch.profiler's kernel names (these as an H100 printed
    them, 2026-12-06, cut short); without --backward a ValueError naming it."""
    assert _cfg(["--backward"]).breakdown is False and _cfg(["--backward", "--breakdown"]).breakdown is True
    with pytest.raises(ValueError, match="--breakdown: only with --backward"):
        _cfg(["--breakdown"])
    kinds = {
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object": "attention backward",
        "kernel_cutlass_kernel_cute_kernelsfa4_bwd_a2a_sm90FlashAttentionA2ABackwardSm90": "attention backward",
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object": "attention forward",
        "kernel_cutlass_kernel_cute_kernelsfa4_a2a_sm90FlashAttentionA2AForwardSm90": "attention forward",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess":
            "bwd pre/postprocess",
        "kernel_cutlass_kernel_cute_kernelsfa4_bwd_a2a_sm90FlashAttentionA2ABackwardPostprocess": "bwd pre/postprocess",
        "kernel_cutlass_kernel_cute_kernelsa2a_devicePreA2A_object_at__tensorptrbf16": "A2A kernels",
        "kernel_cutlass_kernel_cute_kernelsa2a_devicePostA2A_object_at__tensorptrbf16": "A2A kernels",
        "kernel_cutlass_kernel_cute_kernelssignal_deviceBarrierKernel_object_at__tensorptri32": "barriers",
        "kernel_cutlass_kernel_cute_kernelsqkv_a2a_sm90_deviceGemmRankWindowSm90_object": "GEMM",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "GEMM",
        "Memcpy DtoD (Device -> Device)": "copies, gathers",
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long": "copies, gathers",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<": "copies, gathers",
        "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, ":
            "fills, elementwise, reductions",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "fills, elementwise, reductions",
        "some_other_kernel": "other",
    }
    assert {n: bb.kernel_kind(n) for n in kinds} == kinds
    b = bb.breakdown([("Memcpy DtoD (Device -> Device)", 10.0), ("nvjet_x", 30.0), ("Memcpy DtoD", 20.0)], 2)
    assert b == {"copies, gathers": 15.0, "GEMM": 15.0, "total": 30.0}
    with pytest.raises(ValueError, match="calls: expected an int >= 1"):
        bb.breakdown([], 0)
    table = bb.format_breakdown([{"M": 8192, "breakdown_us": {"op_fwdbwd:fused": b}}, {"M": 16384}])
    assert table.splitlines()[2] == ("| 8192 | op_fwdbwd:fused | - | - | - | 15.0 | - | - | 15.0 | - | - | 30.0 |")
    assert len(table.splitlines()) == 3


@pytest.mark.parametrize("argv, flag", [
    (["--methods", "fa"], "--methods"),
    (["--dest", "host"], "--dest"),
    (["--per-kernel"], "--per-kernel"),
    (["--platform", "model.json"], "--platform"),
])
def test_flags_of_the_kernel_benchmark_are_refused(argv, flag):
    with pytest.raises(ValueError, match=f"^{flag}: not with --backward"):
        bb.check_args(bench.build_parser().parse_args(["--backward", *argv]))


def test_a_refused_flag_is_a_usage_error_before_torch(tmp_path):
    code = ("import sys, runpy; sys.argv = ['x', '--backward', '--methods', 'fa']\n"
            "try:\n    runpy.run_module('fa_a2a.tools.bench', run_name='__main__')\n"
            "finally:\n    print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout.strip() == "False", (p.stdout, p.stderr)
    assert p.stderr.strip().splitlines()[-1].startswith("python -m fa_a2a.bench: error: --methods: not with --backward")


def test_main_hands_over_with_the_resolved_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(bb, "run", lambda cfg, gpu: seen.append((cfg, gpu)) or 7)
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert bench.main(["--backward", "-M", "1024", "--world-size", "4", "--heads", "8", "--trials", "3"]) == 7
    [(cfg, gpu)] = seen
    assert (cfg.seqlens, cfg.world_size, cfg.heads, cfg.trials) == ((1024,), 4, 8, 3) and isinstance(gpu, bool)


# ------------------------------------------------------------------------------ no GPU
def test_without_a_gpu_one_line_exit_0_and_nothing_written(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fa_a2a.tools.bench", "--backward", "--quick"], cwd=tmp_path,
                       env=_env(FA_A2A_CACHE_DIR=str(tmp_path / "cache")), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [bb.NO_GPU_LINE] and p.stdout.startswith("No CUDA GPU: nothing was measured")
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # neither --out nor the cache folder


def test_without_a_gpu_other_ranks_print_nothing(monkeypatch, capsys):
    cfg = _cfg(["--backward", "--quick"])
    monkeypatch.setenv("RANK", "1")
    assert bb.run(cfg, gpu=False) == 0 and capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert bb.run(cfg, gpu=False) == 0 and capsys.readouterr().out == bb.NO_GPU_LINE + "\n"


# ------------------------------------------------------------------------------ report
def test_impls_and_methods():
    assert bb.select_impls(False) == (("serial", "fused"), {k: bb.NCCL_EMULATED for k in ("op_fwd:nccl", "op_fwdbwd:nccl")})
    assert bb.select_impls(True, shared_gpu=True) == (("serial", "fused"), {k: bb.NCCL_SHARED for k in bb.op_keys("nccl")})
    assert bb.select_impls(True) == (("serial", "fused", "nccl"), {})
    assert bb.method_keys(("serial", "nccl")) == ("fa4_fwd", "fa4_fwdbwd", "op_fwd:serial", "op_fwdbwd:serial",
                                                  "op_fwd:nccl", "op_fwdbwd:nccl")


RAW = {"fa4_fwd": [100.0, 110.0, 90.0], "fa4_fwdbwd": [350.0, 360.0, 340.0],
       "op_fwd:serial": [500.0, 540.0, 460.0], "op_fwdbwd:serial": [1700.0, 1800.0, 1650.0],
       "op_fwd:fused": [500.0, 540.0, 460.0], "op_fwdbwd:fused": [1500.0, 1600.0, 1450.0]}


def test_ratios_over_p_times_fa4_from_medians_and_paired():
    r = bb.ratios({k: v[0] for k, v in RAW.items()}, RAW, "serial", 4)
    assert r["fwdbwd"] == pytest.approx(1700 / (4 * 350)) and r["fwd"] == pytest.approx(500 / 400)
    assert r["bwd"] == pytest.approx((1700 - 500) / (4 * (350 - 100)))
    paired = sorted((o - f) / (4 * (fb - a)) for f, o, a, fb in zip(RAW["op_fwd:serial"], RAW["op_fwdbwd:serial"],
                                                                     RAW["fa4_fwd"], RAW["fa4_fwdbwd"]))
    assert r["bwd_paired"] == pytest.approx(paired[1])
    assert r["fwdbwd_paired"] == pytest.approx(sorted(o / (4 * a) for o, a in zip(RAW["op_fwdbwd:serial"],
                                                                                  RAW["fa4_fwdbwd"]))[1])
    none = bb.ratios({"fa4_fwd": 100.0, "fa4_fwdbwd": 90.0, "op_fwd:serial": 1.0}, None, "serial", 1)
    assert none == {"fwd": 0.01, "fwdbwd": None, "bwd": None, "fwd_paired": None, "fwdbwd_paired": None,
                    "bwd_paired": None}  # fa4 bwd <= 0 and op fwd+bwd missing: no ratio
    with pytest.raises(ValueError, match="same number of trials"):
        bb.ratios({}, {**RAW, "fa4_fwd": [1.0]}, "serial", 1)
    with pytest.raises(ValueError, match="factor"):
        bb.ratios({}, None, "serial", 0)


def test_table_from_a_fake_result_one_row_per_m_and_impl():
    cfg = _cfg(["--backward", "-M", "8192", "16384", "--world-size", "4"])
    impls, status = bb.select_impls(cfg.real_ranks)
    points = []
    for M, scale in ((8192, 1.0), (16384, 4.0)):
        p = bb.new_point(M, cfg, impls, status)
        p["timing_mode"], p["finite"] = "cuda-graph", {k: True for k in RAW}
        points.append(bb.fill_point(p, {k: [scale * t for t in v] for k, v in RAW.items()}))
    assert points[0]["factor"] == 4 and points[0]["median_us"]["op_fwdbwd:serial"] == 1700.0
    json.dumps(points)  # the JSON record
    lines = bb.format_table(points).splitlines()
    assert lines[0] == "| " + " | ".join(bb.TABLE_HEAD) + " |"
    assert lines[2] == "| 8192 | serial | 100.0 | 350.0 | 500.0 | 1700.0 | 1.200 | 1.214 | 1.214 |"
    assert lines[3] == "| 8192 | fused | 100.0 | 350.0 | 500.0 | 1500.0 | 1.000 | 1.071 | 1.071 |"
    assert lines[4] == "| 16384 | serial | 400.0 | 1400.0 | 2000.0 | 6800.0 | 1.200 | 1.214 | 1.214 |"
    assert lines[7:] == [f"Not timed (op_fwd:nccl: {bb.NCCL_EMULATED}) at M = 8192, 16384.",
                         f"Not timed (op_fwdbwd:nccl: {bb.NCCL_EMULATED}) at M = 8192, 16384."]
    title = bb.table_title(points, "NVIDIA H200", cfg)
    assert "P=4 emulated ranks" in title and "ratios over 4 x FA4" in title and "(cuda-graph)" in title


def test_real_ranks_ratio_over_one_fa4_and_a_non_finite_method_loses_its_time():
    cfg = _cfg(["--backward", "-M", "4608"], env={"WORLD_SIZE": "2"})
    impls, status = bb.select_impls(True)
    p = bb.new_point(4608, cfg, impls, status)
    raw = {**RAW, "op_fwd:nccl": [400.0] * 3, "op_fwdbwd:nccl": [1200.0] * 3}
    p["timing_mode"], p["finite"] = "eager", {**{k: True for k in raw}, "op_fwdbwd:nccl": False}
    bb.fill_point(p, raw)
    assert p["factor"] == 1 and p["ratios"]["serial"]["fwdbwd"] == pytest.approx(1700 / 350)
    assert p["status"] == {"op_fwdbwd:nccl": "non-finite output or grads"} and "op_fwdbwd:nccl" not in p["median_us"]
    lines = bb.format_table([p]).splitlines()
    assert lines[2].startswith("| 4608 | serial | 100.0 | 350.0 | 500.0 | 1700.0 | 4.800 | 4.857 |")
    assert lines[3].startswith("| 4608 | fused | 100.0 | 350.0 | 500.0 | 1500.0 |")
    assert lines[4] == "| 4608 | nccl | 100.0 | 350.0 | 400.0 | - | - | - | - |"
    assert lines[-1] == "Not timed (op_fwdbwd:nccl: non-finite output or grads) at M = 4608."
    assert "P=2 real ranks" in bb.table_title([p], "H200", cfg) and "over 1 x FA4" in bb.table_title([p], "H200", cfg)


# ------------------------------------------------------------------------------ first calls (shared)
def test_first_calls_and_batch_size_are_the_whole_call_benchmarks(monkeypatch):
    """bench --backward makes its first calls and sizes its batches through bench_call.first_calls /
    calls_per_batch (one process: no rank to agree with): every method's first call in order, its
    outputs kept until all ran, then after_first, then one CUDA-event-timed call each; a method that
    raises is dropped with its reason; n_calls from the slowest, rounded up to the input sets."""
    import types

    import torch

    from fa_a2a.tools import bench_call

    clock = [0.0]  # ms

    def event(enable_timing=False):  # a CUDA event on the fake clock
        e = types.SimpleNamespace(t=None, synchronize=lambda: None, elapsed_time=lambda end: end.t - e.t)
        e.record = lambda: setattr(e, "t", clock[0])
        return e

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    order, alive = [], []

    class Out:  # an output whose life the first stage must keep until every method ran
        def __init__(self, key):
            self.key = key
            alive.append(key)

        def __del__(self):
            alive.remove(self.key)

    def first(key):
        order.append(("first", key, tuple(alive)))
        if key == "bad":
            raise RuntimeError("no kernel\nsecond line")
        return Out(key)

    def timed(key):
        order.append(("timed", key))
        clock[0] += {"a": 0.2, "b": 0.05}[key]  # ms

    status = {}
    est = bench_call.first_calls(["a", "bad", "b"], first, timed, status, None,
                                 lambda: order.append(("after_first", tuple(alive))))
    assert order == [("first", "a", ()), ("first", "bad", ("a",)), ("first", "b", ("a",)), ("after_first", ()),
                     ("timed", "a"), ("timed", "b")]
    assert list(est) == ["a", "b"] and est == pytest.approx({"a": 200.0, "b": 50.0})
    assert status == {"bad": "skipped (RuntimeError: no kernel)"}
    cfg = _cfg(["--backward", "--target-ms", "5"])
    assert bench_call.calls_per_batch(cfg, est.values(), None) == 25  # 5 ms / 200 us
    assert bench_call.calls_per_batch(cfg, est.values(), None, multiple=4) == 28
    assert bench_call.calls_per_batch(_cfg(["--backward", "--calls", "7"]), est.values(), None, multiple=4) == 8
