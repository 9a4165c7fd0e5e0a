"""The VMM transport's bootstrap (Unix-socket gather/broadcast with fd passing) on CPU processes.

Every wait is bounded: a rank that never arrives, a root that never answers and ranks that call
different steps make every rank raise TransportSetupError naming the rank, within the timeout.
Each rank arms faulthandler to kill itself if it hangs, so a hang fails the test instead of
stalling it.
"""
import faulthandler
import os
import tempfile
import time

import pytest
import torch.distributed as dist

from tests.multiproc import run_on_gloo_groups

HARD_S = 60  # a rank still running after this is hung: it exits with a traceback


def _bootstrap(P, group, rank, timeout_s):
    """As VmmTransport does it: the root listens before the ranks exchange its address."""
    from ulysses.bootstrap import _Bootstrap

    mine = os.urandom(6).hex()
    boot = _Bootstrap(0, P, f"\0fa_a2a.test.{mine}", timeout_s) if rank == 0 else None
    token = [None] * P
    dist.all_gather_object(token, mine, group=group)
    return boot or _Bootstrap(rank, P, f"\0fa_a2a.test.{token[0]}", timeout_s)


def _values_and_fds(P, group, rank):
    faulthandler.dump_traceback_later(HARD_S, exit=True)
    boot = _bootstrap(P, group, rank, 20.0)
    with tempfile.TemporaryFile() as f:
        f.write(f"rank {rank}".encode())
        f.flush()
        for step in range(3):  # several steps on one socket
            values, fds = boot.allgather(f"step {step}", {"rank": rank, "step": step}, f.fileno())
            assert values == [{"rank": q, "step": step} for q in range(P)]
            for q, fd in enumerate(fds):  # a peer's fd, dup'ed into this process
                assert fd >= 0 and fd != f.fileno()
                assert os.pread(fd, 64, 0) == f"rank {q}".encode()
                os.close(fd)
        values, fds = boot.allgather("no fds", rank)
        assert values == list(range(P)) and fds == [-1] * P
    dist.barrier(group=group)
    boot.close()
    faulthandler.cancel_dump_traceback_later()


def test_bootstrap_gathers_values_and_passes_fds():
    run_on_gloo_groups(_values_and_fds, (1, 2, 3))


def _failures(P, group, rank):
    from ulysses.transport import TransportSetupError

    faulthandler.dump_traceback_later(HARD_S, exit=True)
    timeout = 1.0

    def expect(fn, *needles):
        t0 = time.monotonic()
        with pytest.raises(TransportSetupError) as info:
            fn()
        took = time.monotonic() - t0
        assert took < 4 * timeout + 1, (rank, took)
        for needle in needles:
            assert needle in str(info.value), (rank, str(info.value))
        return info.value

    # 1. rank 2 is late by more than the timeout: rank 0 names it, rank 1 is told, rank 2 finds
    #    no answer; the failed bootstrap refuses the next step at once.
    boot = _bootstrap(P, group, rank, timeout)
    if rank == P - 1:
        time.sleep(2 * timeout)
        err = expect(lambda: boot.allgather("late", rank), "rank 0: did not answer")
    else:
        err = expect(lambda: boot.allgather("late", rank), f"rank {P - 1}: did not arrive within 1 s")
        assert P - 1 in err.failures
    expect(lambda: boot.allgather("next", rank), "failed earlier")
    dist.barrier(group=group)
    boot.close()
    # 2. rank 1 calls a different step: every rank is told which rank was where.
    boot = _bootstrap(P, group, rank, timeout)
    step = "windows b" if rank == 1 else "windows a"
    err = expect(lambda: boot.allgather(step, rank), "rank 1: was at setup step 1 'windows b'")
    assert list(err.failures) == [1]
    dist.barrier(group=group)
    boot.close()
    # 3. the root never comes: the others give up at the timeout, naming rank 0.
    boot = _bootstrap(P, group, rank, timeout)
    if rank != 0:
        expect(lambda: boot.allgather("rootless", rank), "rank 0: did not answer")
    dist.barrier(group=group)
    boot.close()
    faulthandler.cancel_dump_traceback_later()


def test_bootstrap_failures_are_bounded_and_named():
    run_on_gloo_groups(_failures, (3,))


# ---- small pieces, one process ---------------------------------------------------------------------
def test_symmetric_window_bases_add_the_tensor_offset():
    from ulysses.symm import symmetric_window_bases, uniform_window_stride

    class Handle:  # torch's handle: segment bases of a pool; the tensor sits 4 KiB in, on every rank
        buffer_ptrs = [0x10000000, 0x30000000]
        buffer_size = 1 << 24

    bases = symmetric_window_bases(Handle, 0x30001000, rank=1)
    assert bases == [0x10001000, 0x30001000]
    assert uniform_window_stride(bases, 1 << 20) == 0x20000000
    with pytest.raises(ValueError, match="buffer_ptrs"):
        symmetric_window_bases(Handle, 0x20000000, rank=1)  # not in this rank's segment


@pytest.mark.parametrize("var, value", [("FA_A2A_TIMEOUT_S", "abc"), ("FA_A2A_TIMEOUT_S", "0"),
                                        ("FA_A2A_SETUP_TIMEOUT_S", "nan"), ("FA_A2A_SETUP_TIMEOUT_S", "inf")])
def test_timeout_knobs_are_checked(monkeypatch, var, value):
    from ulysses.transport import get_transport

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        get_transport()


@pytest.mark.parametrize("kwargs, name", [(dict(timeout_s=float("nan")), "timeout_s"),
                                          (dict(timeout_s=-1), "timeout_s")])
def test_transport_timeouts_are_checked(kwargs, name):
    from ulysses.transport import EmulatedTransport

    with pytest.raises(ValueError, match=name):
        EmulatedTransport(2, device="cpu", **kwargs)
