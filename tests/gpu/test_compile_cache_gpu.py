"""The compile cache on the GPU: a fresh process whose kernels are all on disk runs the op with the
loaded kernels (shared-library entries through TVM-FFI): the same outputs bit for bit as the process
that compiled them, nothing compiled, and neither the CuTe DSL nor FA4's package imported."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# One process: FA4 alone (P = 1 op) and the emulated op (P = 2: pre-A2A, barrier, fused FA4 +
# post-A2A), saving both outputs; prints the kernels compiled and loaded and the packages imported.
_CHILD = """
import sys, torch
from fa_a2a import ulysses_attention, ulysses_attention_emulated
from fa_a2a.fused import compile_fa4
from cute_kernels.a2a import compile_post_a2a, compile_pre_a2a
from cute_kernels.signal import compile_barrier
g = torch.Generator(device="cuda").manual_seed(7)
q, k, v = (torch.randn(1, 1024, 4, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
with torch.no_grad():
    one = ulysses_attention(q, k, v)
    two = ulysses_attention_emulated(list(q.chunk(2, 1)), list(k.chunk(2, 1)), list(v.chunk(2, 1)), impl="fused")
torch.cuda.synchronize()
torch.save([one.cpu(), *(o.cpu() for o in two)], sys.argv[1])
fns = (compile_fa4, compile_pre_a2a, compile_post_a2a, compile_barrier)
print(sum(f.cache_info().misses - f.cache_info().loads for f in fns), sum(f.cache_info().loads for f in fns),
      ",".join(m for m in ("cutlass", "flash_attn.cute", "quack") if m in sys.modules) or "-")
"""


def _run(cache: Path, out: Path) -> tuple:
    env = dict(os.environ, FA_A2A_CACHE_DIR=str(cache), FA_A2A_CACHE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, loaded, imported = done.stdout.split("\n")[-2].split()
    return int(compiled), int(loaded), imported


def test_a_warm_process_runs_the_loaded_kernels(tmp_path):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("SM90 kernels")
    compiled, loaded, _ = _run(tmp_path / "cache", tmp_path / "cold.pt")
    assert compiled > 0 and loaded == 0
    compiled, loaded, imported = _run(tmp_path / "cache", tmp_path / "warm.pt")
    assert compiled == 0 and loaded > 0
    cold, warm = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    assert all(torch.equal(a, b) for a, b in zip(cold, warm))
    assert all(torch.isfinite(t).all() for t in warm)
    if any((tmp_path / "cache").rglob("*.so")):  # linked (a C compiler was found)
        assert imported == "-", f"a warm process imported {imported}"
