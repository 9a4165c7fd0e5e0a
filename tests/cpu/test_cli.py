"""The command-line tools refuse a bad flag the argparse way (usage line, one message naming the
flag, exit status 2) before torch, the CuTe DSL, quack or diffusers load: under a second, in a
fresh process."""

import functools
import os
import subprocess
import sys
import time

import pytest

from fa_a2a.tools import cli
from tests.helpers import repo_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = {"calibrate": "fa_a2a.calibrate", "bench_block": "fa_a2a.bench_block"}  # run as `python -m MODULE`
EXAMPLES = {name: os.path.join("examples", f"{name}.py") for name in
            ("fused_speed", "qkv_speed", "host_window_hiding", "dit_inference", "pipeline", "eager_host_cost",
             "first_call_time", "flux_block_memory", "agreement_cost")}
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
    ("dit_inference", ["--height", "7", "--width", "9"], "--frames x --height x --width (image tokens): expected a "
                                                         "multiple of the 2 ranks"),
    ("dit_inference", ["--text-len", "7", "--nproc", "4"], "--text-len: expected a multiple of the 4 ranks"),
    ("dit_inference", ["--text-len", "1", "--ulysses-anything"], "--text-len: expected at least one token per rank"),
    ("dit_inference", ["--impls", "fused,magic"], "--impls"),
    ("dit_inference", ["--device", "cpu", "--impls", "fused"], "--impls"),
    ("dit_inference", ["--model", "flux", "--frames", "2"], "--frames"),
    ("pipeline", ["--model", "x", "--steps", "0"], "--steps"),
    ("pipeline", ["--model", "x", "--impl", "magic"], "--impl"),
    ("pipeline", ["--steps", "2"], "--model"),
    ("flux_block_memory", ["--device", "tpu"], "--device"),
    ("agreement_cost", ["--ranks", "65536"], "--ranks"),  # a process per rank: 64 at most
    ("agreement_cost", ["--calls", "0"], "--calls"),
    ("flux_block_memory", ["--json", "examples"], "--json: expected a file, got the folder"),
    ("dit_inference", ["--json", ""], "--json: expected a file path"),
    ("dit_inference", ["--json", "no-such-folder/x.json"], "--json: 'no-such-folder/x.json' cannot be written"),
    ("pipeline", ["--model", "x", "--json", "examples"], "--json: expected a file, got the folder"),
    ("pipeline", ["--model", "x", "--out", "README.md/x.png"],
     "--out: expected a folder (new or existing), got the file"),
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


# ---- one exit code without a GPU ------------------------------------------------------------------
# Every tool that needs a GPU: (tool, argv). CUDA_VISIBLE_DEVICES="" hides any GPU of the machine.
GPU_ONLY = [
    ("calibrate", ["--quick"]),
    ("bench_block", []),
    ("fused_speed", []),
    ("qkv_speed", []),
    ("host_window_hiding", ["out.json"]),
    ("eager_host_cost", []),
    ("first_call_time", []),
]


def _no_gpu_env(**extra):
    env = repo_env(CUDA_VISIBLE_DEVICES="", **extra)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def _tool_cmd(tool, argv):
    if tool in MODULES:
        return [sys.executable, "-m", MODULES[tool], *argv]
    if tool == "bench":
        return [sys.executable, "-m", "fa_a2a.tools.bench", *argv]
    return [sys.executable, os.path.join(ROOT, EXAMPLES[tool]), *argv]


@pytest.mark.parametrize("tool, argv", GPU_ONLY, ids=[t for t, _ in GPU_ONLY])
def test_gpu_only_tools_without_a_gpu_print_one_line_and_exit_with_the_one_code(tool, argv, tmp_path):
    res = subprocess.run(_tool_cmd(tool, argv), cwd=tmp_path, env=_no_gpu_env(FA_A2A_CACHE_DIR=str(tmp_path / "c")),
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert res.returncode == cli.NO_GPU_EXIT, (res.returncode, res.stderr)
    assert len(lines) == 1 and "no CUDA GPU found" in lines[0], res.stderr
    assert lines[0].endswith("Nothing measured, nothing written."), lines[0]
    name = MODULES[tool].replace(".", "/") if tool in MODULES else EXAMPLES[tool]
    assert lines[0].startswith((f"python -m {MODULES.get(tool)}:", f"{EXAMPLES.get(tool)}:")), (name, lines[0])
    assert res.stdout == "" and sorted(os.listdir(tmp_path)) == [], (res.stdout, os.listdir(tmp_path))


def test_bench_without_a_gpu_exits_0_and_writes_nothing_anywhere(tmp_path):
    cache = tmp_path / "cache"
    res = subprocess.run(_tool_cmd("bench", ["--quick", "--out", str(tmp_path / "res")]), cwd=tmp_path,
                         env=_no_gpu_env(FA_A2A_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith("No CUDA GPU: nothing was measured")
    assert "Nothing written to" in res.stdout.splitlines()[-1] and "nor to the compile cache" in res.stdout
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # neither --out nor the cache folder


# ---- --seqlens read one way -----------------------------------------------------------------------
SEQLENS = [
    ("bench", ["--seqlens", "0"], "expected an integer in [1, 4194304], got '0'"),
    ("bench", ["-M", "x"], "expected an integer in [1, 4194304], got 'x'"),
    ("bench", ["--seqlens", "100"], "expected multiples of 8 (the world size P), got 100"),
    ("bench", ["--seqlens", "8192", "8192"], "expected distinct values, got [8192, 8192]"),
    ("bench_block", ["--seqlens", "0"], "expected an integer in [1, 4194304], got '0'"),
    ("bench_block", ["--seqlens", "x"], "expected an integer in [1, 4194304], got 'x'"),
    ("bench_block", ["--seqlens", "576", "576"], "expected distinct values, got [576, 576]"),
    ("qkv_speed", ["--seqlens", "0"], "expected an integer in [1, 4194304], got '0'"),
    ("qkv_speed", ["--seqlens", "576", "576"], "expected distinct values, got [576, 576]"),
    ("fused_speed", ["--seqlens", "x"], "expected an integer in [1, 4194304], got 'x'"),
    ("fused_speed", ["--seqlens", "100"], "expected multiples of 8 (--world-size), got 100"),
    ("fused_speed", ["--seqlens", "8192", "8192"], "expected distinct values, got [8192, 8192]"),
    ("host_window_hiding", ["out.json", "--seqlens", "0"], "expected an integer in [1, 4194304], got '0'"),
]


@pytest.mark.parametrize("tool, argv, message", SEQLENS, ids=[f"{t}-{' '.join(a)}" for t, a, _ in SEQLENS])
def test_seqlens_are_refused_in_one_wording(tool, argv, message, tmp_path):
    res = subprocess.run(_tool_cmd(tool, argv), cwd=tmp_path, env=_no_gpu_env(), capture_output=True, text=True,
                         timeout=120)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.endswith(f"error: argument --seqlens: {message}"), res.stderr


def test_check_seqlens():
    assert cli.check_seqlens(["8", 16], 8) == (8, 16)
    whole = r"an integer in \[1, 4194304\], got "
    for values, match in (([0], whole + "'0'"), ([1.5], whole + "'1.5'"), ([True], whole + "'True'"),
                          ([12], r"multiples of 8 \(P\), got 12"), ([8, 8], r"distinct values, got \[8, 8\]")):
        with pytest.raises(ValueError, match=r"^argument --seqlens: expected " + match):
            cli.check_seqlens(values, 8, "P")


# ---- examples/flux_block_memory.py says what it needs ---------------------------------------------
def test_flux_block_memory_says_what_it_needs_up_front(tmp_path):
    res = subprocess.run(_tool_cmd("flux_block_memory", ["--help"]), env=_no_gpu_env(), capture_output=True,
                         text=True, timeout=60)
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and '[dit] extra' in text and "~24 GB" in text and "--attention-only ~5 GB" in text
    # without diffusers: one line, the exit code of a tool that cannot run here, nothing loaded
    code = "import sys; sys.modules['diffusers'] = None; sys.argv = ['x']; import runpy; " \
           f"runpy.run_path({os.path.join(ROOT, EXAMPLES['flux_block_memory'])!r}, run_name='__main__')"
    res = subprocess.run([sys.executable, "-c", code], env=_no_gpu_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == cli.NO_GPU_EXIT and res.stdout == "", res.stderr
    assert res.stderr.strip() == ('examples/flux_block_memory.py: needs diffusers, the [dit] extra '
                                  '(pip install -e ".[dit]"). Nothing measured, nothing written.'), res.stderr


def test_flux_block_memory_refuses_a_model_larger_than_the_free_memory(monkeypatch, capsys):
    pytest.importorskip("diffusers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("flux_block_memory", os.path.join(ROOT, EXAMPLES["flux_block_memory"]))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "free_bytes", lambda device: 10 ** 9)
    monkeypatch.setattr(mod, "measure", lambda args: pytest.fail("measured although the model does not fit"))
    assert mod.main(["--device", "cpu"]) == cli.NO_GPU_EXIT
    err = capsys.readouterr().err.strip()
    assert err.startswith("examples/flux_block_memory.py: the Flux.1 transformer needs ~23.8 GB on cpu, 1.0 GB free")
    assert "--attention-only" in err and len(err.splitlines()) == 1
    assert mod.model_bytes(mod._parse(["--attention-only"])) == pytest.approx(5.022e9, rel=1e-3)  # the docstring's
