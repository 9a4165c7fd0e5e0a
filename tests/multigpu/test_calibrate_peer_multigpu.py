"""`python -m fa_a2a.calibrate --dest peer` on distinct GPUs (skipped with fewer than 2).

The VMM peer buffer's checks of tests/gpu/test_calibrate_peer.py with the owner on another GPU
and with the pages spread over every GPU, then the calibration itself (--quick, no FA4), whose
JSON must record the peer destination and an owner read-back that matched.
"""
import json
import subprocess
import sys

import pytest
import torch

from tests.gpu.test_calibrate_peer import check_peer_buffer
from tests.helpers import repo_env

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.multigpu
def test_peer_buffer_on_another_gpu_reaches_its_owner():
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPU 0 cannot access GPU 1")
    check_peer_buffer(0, [1])
    check_peer_buffer(1, [0])


@pytest.mark.multigpu
def test_peer_buffer_spread_over_every_gpu_reaches_each_owner():
    if not all(torch.cuda.can_device_access_peer(0, d) for d in range(1, N_GPUS)):
        pytest.skip("GPU 0 cannot access every GPU")
    check_peer_buffer(0, list(range(N_GPUS)))


@pytest.mark.multigpu
@pytest.mark.parametrize("spread", [False, True])
def test_calibrate_dest_peer_runs_and_its_owner_sees_the_bytes(tmp_path, spread):
    env = repo_env()
    cmd = [sys.executable, "-m", "fa_a2a.tools.calibrate", "--dest", "peer", "--quick", "--no-fa", "--out", str(tmp_path)]
    proc = subprocess.run(cmd + (["--spread"] if spread else []), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "destination check" in proc.stdout and ": ok" in proc.stdout, proc.stdout[-4000:]
    with open(tmp_path / "platform_model.json") as f:
        data = json.load(f)
    meta = data["meta"]
    assert meta["dest"] == "peer" and meta["issuer_gpu"] == 0
    assert meta["owner_gpus"] == (list(range(N_GPUS)) if spread else [1])
    assert data["dest_data_check"] is True
