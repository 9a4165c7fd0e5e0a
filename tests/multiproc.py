"""Run a check on gloo groups of several sizes in spawned processes (CPU and GPU tests share it), or a
test file's main under torchrun (the multi-GPU tests: run_torchrun).

torch.distributed.nn is imported here, before the rank processes initialize their groups: its functions
bind `group.WORLD` as a default argument when imported, and a first import after the init (torch._dynamo
imports it: torch.compile, torch.utils.checkpoint) keeps that group alive past destroy_process_group until
interpreter exit, where gloo aborts the process now and then (SIGABRT after a passing test).

Rank processes on one GPU run under a private CUDA MPS daemon where one can start (their kernels
then run at once instead of time-slicing the GPU); elsewhere, or with FA_A2A_TEST_MPS=0, they
time-slice it (a warning says why where MPS was expected to start)."""

import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any init in the rank processes: see the module docstring)
import torch.multiprocessing as mp

from fa_a2a.tools.mps import MpsUnavailableError, mps_available, mps_daemon
from tests.helpers import repo_env


def run_on_gloo_groups(check, sizes, *, cuda=False, timeout_s=60, teardown=None):
    """Spawn max(sizes) processes; for each P in sizes, ranks < P of a new gloo group run
    check(P, group, rank) (a module-level function). With cuda=True every process uses GPU 0
    (ranks sharing one GPU), under MPS where it can start: fa_a2a.tools.mps.mps_reachable() in check says
    which. teardown(), if given, runs on every rank after the last size."""
    world = max(sizes)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if cuda:
            _enter_mps(stack)
        args = (check, tuple(sizes), world, cuda, timeout_s, teardown, os.path.join(tmp, "init"))
        mp.spawn(_worker, args=args, nprocs=world, join=True)


def spawn_with_deadline(worker, args: tuple, nprocs: int, deadline_s: float, what: str, *,
                        may_abort: tuple = ()) -> None:
    """mp.spawn(worker, args, nprocs) that fails the test when a process is still running after
    deadline_s (a hang: every process is killed first) or ends with an error. Every rank runs to
    its end (a failing rank does not end the others). Ranks in may_abort may also end by SIGABRT:
    gloo aborts a process whose collective a peer never joins (its error escapes on gloo's own
    thread, std::terminate), which a rank that runs no fa-a2a code cannot avoid."""
    import pickle
    import signal

    import pytest

    ctx = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + deadline_s
    while any(p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    failures = []
    for rank, p in enumerate(ctx.processes):
        if p.is_alive():
            failures.append(f"rank {rank} was still running after {deadline_s} s (hang)")
        elif p.exitcode != 0 and not (p.exitcode == -signal.SIGABRT and rank in may_abort):
            trace = ""
            if os.path.exists(ctx.error_files[rank]) and os.path.getsize(ctx.error_files[rank]):
                with open(ctx.error_files[rank], "rb") as fh:
                    trace = pickle.load(fh)
            failures.append(f"rank {rank} ended with exit code {p.exitcode}\n{trace}")
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    if failures:
        pytest.fail(f"{what}:\n" + "\n".join(failures))


def run_gloo_case(case, P: int = 2, *args, deadline_s: float = 90, env: dict = None, may_abort: tuple = ()) -> None:
    """case(rank, P, *args) on P gloo ranks (spawned CPU processes, a file init), each with `env` set
    first, under spawn_with_deadline (a hang or a rank's error fails the test)."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(_gloo_case_worker, (case, P, os.path.join(tmp, "init"), args, env or {}), P, deadline_s,
                            case.__name__, may_abort=may_abort)


def _gloo_case_worker(rank, case, P, init_file, args, env):
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=30))
    try:
        case(rank, P, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _enter_mps(stack: contextlib.ExitStack) -> None:
    if os.environ.get("FA_A2A_TEST_MPS") == "0" or not mps_available():
        return
    try:
        stack.enter_context(mps_daemon())
    except MpsUnavailableError as e:
        warnings.warn(f"rank processes time-slice the GPU: {e}")


def _worker(rank, check, sizes, world, cuda, timeout_s, teardown, init_file):
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for P in sizes:
            group = dist.new_group(list(range(P)))  # every rank takes part in creating it
            if rank < P:
                check(P, group, rank)
            dist.barrier()
        if teardown is not None:
            teardown()  # collective; not on the error path (spawn ends the other ranks)
    finally:
        dist.destroy_process_group()


def run_torchrun_on_gpus(path: str, nproc: int, env: dict = None) -> str:
    """run_torchrun with one GPU per rank: the test is skipped where the machine has fewer than nproc."""
    import pytest

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc > gpus:
        pytest.skip(f"needs {nproc} GPUs, found {gpus}")
    return run_torchrun(path, nproc, env)


def run_torchrun(path: str, nproc: int, env: dict = None, timeout_s: int = 900) -> str:
    """`python -m torch.distributed.run --standalone --nproc-per-node=nproc path` with the repository
    on PYTHONPATH (env: extra variables); fails the test unless it exits 0. Returns its stdout."""
    env = repo_env(**(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout
