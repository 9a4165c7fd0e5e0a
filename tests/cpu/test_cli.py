"""The command-line tools refuse a bad flag the argparse way (usage line, one message naming the
flag, exit status 2) before torch or the kernels load: under a second, in a fresh process."""

import os
import subprocess
import sys
import time

import pytest

from fa_a2a import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = {"calibrate": ["-m", "fa_a2a.calibrate"], "bench_block": ["-m", "fa_a2a.bench_block"]}
EXAMPLES = {name: [os.path.join("examples", f"{name}.py")] for name in
            ("fused_speed", "qkv_speed", "host_window_hiding", "dit_inference")}
TOOLS = {**MODULES, **EXAMPLES}

BAD = [
    ("calibrate", ["--threads", "2000"], "--threads"),
    ("calibrate", ["--sigma-us", "inf"], "--sigma-us"),
    ("calibrate", ["--sigma-us", "1e9"], "--sigma-us"),
    ("calibrate", ["--dest", "peer", "--peer", "5000"], "--peer"),
    ("calibrate", ["--min-fit-volume-mib", "nan"], "--min-fit-volume-mib"),
    ("bench_block", ["--head-dim", "100"], "--head-dim"),
    ("bench_block", ["--seqlens", "0"], "--seqlens"),
    ("bench_block", ["--seqlens", "99999999"], "--seqlens"),
    ("bench_block", ["--world-size", "1e3"], "--world-size"),
    ("bench_block", ["--heads", "7"], "--heads"),
    ("bench_block", ["--trials", "-1"], "--trials"),
    ("bench_block", ["--platform", "no-such-file.json"], "--platform"),
    ("fused_speed", ["--seqlens", "100", "--world-size", "8"], "--seqlens"),
    ("fused_speed", ["--target-ms", "nan"], "--target-ms"),
    ("fused_speed", ["--head-dim", "96"], "--head-dim"),
    ("qkv_speed", ["--configs", "192x128"], "--configs"),
    ("qkv_speed", ["--hidden", "0"], "--hidden"),
    ("qkv_speed", ["--heads", "12", "--world-size", "5"], "--heads"),
    ("host_window_hiding", ["out.json", "--pace-fractions", "1.5"], "--pace-fractions"),
    ("host_window_hiding", ["out.json", "--paced-host-gbps", "-3"], "--paced-host-gbps"),
    ("host_window_hiding", ["out.json", "--pace-ctas", "0"], "--pace-ctas"),
    ("dit_inference", ["--nproc", "1"], "--nproc"),
    ("dit_inference", ["--steps", "0"], "--steps"),
    ("dit_inference", ["--height", "100000"], "--height"),
    ("dit_inference", ["--impls", "fused,magic"], "--impls"),
    ("dit_inference", ["--device", "cpu", "--impls", "fused"], "--impls"),
    ("dit_inference", ["--model", "flux", "--frames", "2"], "--frames"),
]


def _run(tool, argv):
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, *TOOLS[tool], *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    return res, time.perf_counter() - t0


@pytest.mark.parametrize("tool, argv, flag", BAD, ids=[f"{t}-{' '.join(a)}" for t, a, _ in BAD])
def test_bad_flag_is_refused_at_once(tool, argv, flag):
    res, seconds = _run(tool, argv)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert err and err[0].startswith("usage: ") and flag in err[-1] and "error:" in err[-1], res.stderr
    assert "Traceback" not in res.stderr and not res.stdout
    assert seconds < 1.0, f"{tool} {argv}: refused after {seconds:.2f} s (heavy imports before parsing?)"


@pytest.mark.parametrize("tool", sorted(MODULES))
def test_usage_names_how_the_module_is_run(tool):
    res, _ = _run(tool, ["--no-such-flag"])
    assert res.returncode == 2 and res.stderr.startswith(f"usage: python -m fa_a2a.{tool} ")


def test_bounded_types():
    import argparse

    n = cli.int_in(1, 8)
    assert n("8") == 8
    for text in ("0", "9", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, 8\]"):
            n(text)
    x = cli.float_in(0, 2)
    assert x("2") == 2.0 and x("1e-9") == 1e-9
    for text in ("0", "-1", "2.5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected a finite number in \(0, 2\]"):
            x(text)
    assert cli.float_in(0, 2, lo_inclusive=True)("0") == 0.0


def test_kernel_head_dims_match_the_op():
    from fa_a2a.problem import KERNEL_HEAD_DIMS

    assert tuple(cli.KERNEL_HEAD_DIMS) == tuple(KERNEL_HEAD_DIMS)
