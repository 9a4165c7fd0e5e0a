"""The compile cache on the GPU: a fresh process whose kernels are all on disk runs the op and the
attention block with the loaded kernels (shared-library entries through TVM-FFI; the QKV
projection's launch form from disk): the same outputs bit for bit as the process that compiled
them, nothing compiled, and neither the CuTe DSL nor FA4's package nor quack imported."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import repo_env

ROOT = Path(__file__).resolve().parents[2]

# One process: FA4 alone (P = 1 op), the emulated op (P = 2: pre-A2A, barrier, fused FA4 +
# post-A2A), the block at P = 1 and emulated at P = 2 (Flux-style projection: bias, RMSNorm,
# diffusers' rotary pair), saving the outputs; prints the kernels compiled and loaded and the
# packages imported.
_CHILD = """
import sys, torch
from fa_a2a import ulysses_attention, ulysses_attention_emulated
from fa_a2a.block import TorchQKV, block_weights, ulysses_qkv_attention, ulysses_qkv_attention_emulated
from cute_kernels.fa4 import compile_fa4
from cute_kernels.a2a import compile_post_a2a, compile_pre_a2a
from cute_kernels.signal import compile_barrier
g = torch.Generator(device="cuda").manual_seed(7)
q, k, v = (torch.randn(1, 1024, 4, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
with torch.no_grad():
    one = ulysses_attention(q, k, v)
    two = ulysses_attention_emulated(list(q.chunk(2, 1)), list(k.chunk(2, 1)), list(v.chunk(2, 1)), impl="fused")
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    H, D, C, S = 4, 128, 512, 1024
    chain = TorchQKV((r(3 * H * D, C) / C ** 0.5).bfloat16(), (0.1 * r(3 * H * D)).bfloat16(), r(D) * 0.2 + 1,
                     r(D) * 0.2 + 1, H, H, D)
    x = r(1, S, C).bfloat16()
    ang = torch.arange(S, device="cuda")[:, None] * 10000.0 ** (-torch.arange(D // 2, device="cuda") / (D // 2))
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    blk1 = ulysses_qkv_attention(x, block_weights(chain, 1), rotary=(cos, sin))
    blk2 = ulysses_qkv_attention_emulated(list(x.chunk(2, 1)), block_weights(chain, 2),
                                          rotary=[(c, s_) for c, s_ in zip(cos.chunk(2), sin.chunk(2))])
torch.cuda.synchronize()
torch.save([one.cpu(), *(o.cpu() for o in two), blk1.cpu(), *(o.cpu() for o in blk2)], sys.argv[1])
fns = (compile_fa4, compile_pre_a2a, compile_post_a2a, compile_barrier)
print(sum(f.cache_info().misses - f.cache_info().loads for f in fns), sum(f.cache_info().loads for f in fns),
      ",".join(m for m in ("cutlass", "flash_attn.cute", "quack") if m in sys.modules) or "-")
"""


def _run(cache: Path, out: Path) -> tuple:
    env = repo_env(FA_A2A_CACHE_DIR=str(cache), FA_A2A_CACHE="1")
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
    kept = lambda: sorted(p for p in (tmp_path / "cache").rglob("*") if p.suffix in (".o", ".so", ".pkl"))  # noqa: E731
    entries = kept()
    assert any(p.parent.name == "compile_projection" for p in entries)
    compiled, loaded, imported = _run(tmp_path / "cache", tmp_path / "warm.pt")
    assert compiled == 0 and loaded > 0
    assert kept() == entries  # nothing compiled or computed again
    cold, warm = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    assert all(torch.equal(a, b) for a, b in zip(cold, warm))
    assert all(torch.isfinite(t).all() for t in warm)
    if any((tmp_path / "cache").rglob("*.so")):  # linked (a C compiler was found)
        assert imported == "-", f"a warm process imported {imported}"
