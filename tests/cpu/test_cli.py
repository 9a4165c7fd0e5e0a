"""The command-line tools refuse a bad flag the argparse way (usage line, one message naming the
flag, exit status 2) before torch, the CuTe DSL, quack or diffusers load: under a second, in a
fresh process."""

import functools
import os
import subprocess
import sys
import time

import pytest

from fa_a2a import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = {"calibrate": "fa_a2a.calibrate", "bench_block": "fa_a2a.bench_block"}
EXAMPLES = {name: os.path.join("examples", f"{name}.py") for name in
            ("fused_speed", "qkv_speed", "host_window_hiding", "dit_inference")}
HEAVY = ("torch", "cutlass", "quack", "diffusers")
# Runs a tool as `python -m MODULE` / `python FILE` would, then prints which heavy packages it loaded.
WRAPPER = """
import runpy, sys
kind, target, *argv = sys.argv[1:]
sys.argv = [target, *argv]
try:
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")
finally:
    print(sorted(m for m in %r if m in sys.modules))
""" % (HEAVY,)

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
    kind, target = ("module", MODULES[tool]) if tool in MODULES else ("file", EXAMPLES[tool])
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", WRAPPER, kind, target, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    return res, time.perf_counter() - t0


@pytest.mark.parametrize("tool, argv, flag", BAD, ids=[f"{t}-{' '.join(a)}" for t, a, _ in BAD])
def test_bad_flag_is_refused_at_once(tool, argv, flag):
    res, seconds = _run(tool, argv)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert err and err[0].startswith("usage: ") and flag in err[-1] and "error:" in err[-1], res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout.strip() == "[]", f"{tool} {argv}: loaded {res.stdout.strip()} before refusing the flag"
    limit = max(1.0, 1.5 * _numpy_start_s() + 0.2)  # 1 s; more only while the machine is loaded
    assert seconds < limit, f"{tool} {argv}: refused after {seconds:.2f} s (limit {limit:.2f} s)"


@functools.lru_cache(maxsize=None)
def _numpy_start_s():
    """Seconds for `python -c "import numpy"` here now (numpy: the tools' one light dependency),
    to tell a loaded machine from a slow tool; ~0.15 s on an idle 2-core machine."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import numpy"], check=True, timeout=60)
    return time.perf_counter() - t0


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


def test_readme_dit_snippet_names_what_exists():
    """The README's DiT snippet (run as written by tests/gpu/test_readme_dit.py) compiles and imports
    only names that exist."""
    import ast
    import importlib

    section = open(os.path.join(ROOT, "README.md")).read().split("## Use it in your DiT", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, a.name) for a in node.names), node.module
