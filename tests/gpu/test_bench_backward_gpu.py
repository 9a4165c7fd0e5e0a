"""`python -m fa_a2a.bench --backward --quick --world-size 2` on one SM90 GPU (FA4's SM90 backward): the
forward + backward benchmark runs in a subprocess, as a user runs it, prints a table with a row per M and
impl (serial, fused) whose times and ratios are positive, and writes its JSON.

    python -m pytest -q tests/gpu/test_bench_backward_gpu.py
"""
import json
import subprocess
import sys

import pytest
import torch

from fa_a2a.tools import bench_backward as bb
from fa_a2a.tools.bench_config import QUICK_SEQLENS
from tests.helpers import repo_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an SM90 GPU (FA4's SM90 backward)")


def test_quick_emulated_two_ranks(tmp_path):
    env = repo_env()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    out = tmp_path / "res"
    p = subprocess.run([sys.executable, "-m", "fa_a2a.bench", "--backward", "--quick", "--world-size", "2",
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    lines = p.stdout.splitlines()
    head = "| " + " | ".join(bb.TABLE_HEAD) + " |"
    assert head in lines, p.stdout
    below = lines[lines.index(head) + 2:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in below if ln.startswith("| ")]
    impls, _ = bb.select_impls(real_ranks=False)  # serial and fused (NCCL needs real ranks)
    assert "fused" in impls
    assert [(int(r[0]), r[1]) for r in rows] == [(M, i) for M in QUICK_SEQLENS for i in impls], p.stdout
    for r in rows:
        values = [float(c) for c in r[2:]]  # no "-": every time and ratio measured
        assert all(v > 0 for v in values), r
        fa4_fwd, fa4_fb, op_fwd, op_fb = values[:4]
        assert fa4_fb > fa4_fwd and op_fb > op_fwd, r
    result = json.loads((out / bb.RESULT_NAME).read_text())
    assert [pt["M"] for pt in result["points"]] == list(QUICK_SEQLENS)
    for pt in result["points"]:
        assert pt["factor"] == 2 and pt["timing_mode"] in ("cuda-graph", "eager"), pt
        assert (pt["timing_mode"] == "eager") == bool(pt["capture_error"]), pt
        assert set(pt["median_us"]) == set(bb.method_keys(impls)) and all(pt["finite"].values()), pt
        for impl in impls:
            assert pt["ratios"][impl]["fwdbwd_paired"] > 0 and pt["ratios"][impl]["bwd"] > 0, (impl, pt)
