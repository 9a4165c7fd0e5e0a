"""Rank processes sharing one GPU under a private CUDA MPS daemon (fa_a2a.tools.mps, tests.multiproc).

- the daemon starts, answers, and is gone after the block (pid and directories);
- the launcher's rank processes are clients of its MPS server (get_client_list lists their pids),
  and an eager fused call of a small problem (P = 2, S_loc = 128, H = 24, D = 128) takes < 1 ms
  per call, max over ranks: processes that time-slice the GPU take milliseconds (a barrier waits
  for a context switch).
Skipped where nvidia-cuda-mps-control is missing or FA_A2A_TEST_MPS=0.
"""
import os
import statistics
import time

import pytest
import torch

from fa_a2a.tools import mps

from tests.multiproc import run_on_gloo_groups

pytestmark = pytest.mark.skipif(not mps.mps_available() or os.environ.get("FA_A2A_TEST_MPS") == "0",
                                reason="needs nvidia-cuda-mps-control and a CUDA GPU (and FA_A2A_TEST_MPS != 0)")

EAGER_LIMIT_US = 1000.0


def test_private_daemon_starts_answers_and_stops():
    if mps.mps_reachable():
        pytest.skip("an MPS daemon already runs in this environment (mps_daemon reuses it)")
    with mps.mps_daemon() as pipe_dir:
        assert os.environ[mps.PIPE_VAR] == pipe_dir and mps.mps_reachable()
        pid = mps._daemon_pid(pipe_dir)
        assert pid is not None
        mps.mps_control("get_server_list")  # raises if it does not answer
    assert not os.path.exists(pipe_dir) and mps.PIPE_VAR not in os.environ
    assert not mps._alive(pid)  # gone, or a zombie nobody reaped (a container's init may never)


def _ranks_under_mps(P, group, rank):
    import torch.distributed as dist

    from fa_a2a import ulysses_attention

    assert mps.mps_reachable(), f"rank {rank}: no MPS daemon reachable (see the launcher's warning)"
    q, k, v = (torch.randn(1, 128, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()  # this process's context exists: it is an MPS client now, or never
    pids = [None] * P
    dist.all_gather_object(pids, os.getpid(), group=group)
    if rank == 0:
        servers = mps.mps_control("get_server_list").split()
        clients = {int(c) for s in servers for c in mps.mps_control(f"get_client_list {s}").split()}
        assert set(pids) <= clients, f"rank pids {pids} are not all clients of MPS servers {servers}: {clients}"
    call = lambda: ulysses_attention(q, k, v, group=group, impl="fused")  # noqa: E731
    for _ in range(3):  # compiles, window allocation
        call()
    per_call = []
    for _ in range(5):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e6 / 20)
    worst = torch.tensor(statistics.median(per_call), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        print(f"P = 2 processes on one GPU under MPS, eager fused call: {worst.item():.1f} us (median, max over ranks)")
    assert worst.item() < EAGER_LIMIT_US, (
        f"eager fused call {worst.item():.0f} us >= {EAGER_LIMIT_US:g} us under MPS: the ranks look time-sliced")


def test_launcher_ranks_are_mps_clients_and_run_concurrently(monkeypatch):
    from ulysses.transport import close_transports

    monkeypatch.setenv("FA_A2A_TIMEOUT_S", "300")  # the first calls compile while the peer waits
    run_on_gloo_groups(_ranks_under_mps, (2,), cuda=True, timeout_s=300, teardown=close_transports)
