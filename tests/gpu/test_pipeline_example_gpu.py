"""examples/pipeline.py on one GPU: P = 2 rank processes sharing it (under a private MPS daemon where
one can start), the tiny random FluxPipeline of tests/cpu/test_pipeline_example.py with 2 heads of
64, bf16, impls fused and serial. Every attention call of the timed run must take the fused block
(FusedFluxAttnProcessor: fused), and the two impls' images must be identical."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from fa_a2a.tools.mps import mps_available  # noqa: E402
from tests.cpu.test_pipeline_example import ROOT, RUN, STEPS, tiny_flux_pipeline  # noqa: E402
from tests.helpers import repo_env  # noqa: E402


def test_tiny_pipeline_fused_on_two_ranks_sharing_the_gpu(tmp_path):
    model = tmp_path / "tiny-flux"
    tiny_flux_pipeline(model, heads=2, head_dim=64)
    launch = [sys.executable, "-m", "fa_a2a.tools.mps", "--"] if mps_available() else []
    cmd = [*launch, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "examples", "pipeline.py"), "--model", str(model), "--impl", "fused", "serial",
           "--steps", str(STEPS), *RUN, "--out", str(tmp_path / "img.png"), "--json", str(tmp_path / "table.json")]
    env = repo_env()
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    print(p.stdout)
    table = json.loads((tmp_path / "table.json").read_text())
    assert (table["world_size"], table["group"]) == (2, "gloo")
    calls = 2 * STEPS
    for row in table["rows"]:
        assert row["routes"].get("FusedFluxAttnProcessor") == {"fused": calls}, row
    assert "fused and serial images identical: True" in p.stdout
