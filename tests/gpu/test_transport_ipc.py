"""VmmTransport with 2 and 4 processes sharing one GPU (gloo bootstrap, CUDA VMM windows).

Every rank writes rank- and round-coded values into every peer's window, passes the in-stream
barrier and checks its own window bit-exactly; a random rank sleeps before each round, so a late
rank must not let anyone read early. Then a rank skips a barrier: the others' barriers time out,
their next barrier() / windows() is refused naming the missing rank (no check() needed) and
check() names it too.

Injected set-up failures (one rank's cuMemCreate out of memory, one rank's cuMemMap failing, a
refused peer-access check, ranks on two hosts, windows() calls that differ, a rank late past the
set-up timeout):
every rank raises TransportSetupError naming the rank, within the timeout, and the failed
allocation leaves no GPU memory behind (1 GiB windows against the device's free memory).

The multi-GPU test's rank check (tests/multigpu) runs here on processes sharing the GPU: it
passes with the fused kernel and fails when the fused epilogue drops its remote tiles.
Every rank arms faulthandler to exit if it hangs: a hang fails the test instead of stalling it.
"""
import faulthandler
import random
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_on_gloo_groups

ROUNDS = 6
HARD_S = 240


def _exchange(P, group, rank):
    from ulysses.transport import VmmTransport

    t = VmmTransport(group, timeout_s=60)
    assert t.rank == rank and t.world_size == P
    n = 3000  # elements per sender slot; windows are [P, P, n]
    w = t.windows("test", (P, n), torch.int32)
    assert w.shape == (P, P, n) and w.stride(0) * 4 % (2 << 20) == 0  # 2 MiB granularity
    ptrs = t.pointer_table(w).tolist()
    assert ptrs == [w.data_ptr() + d * w.stride(0) * 4 for d in range(P)]
    assert t.windows("test", (P, n), torch.int32) is w  # cached
    assert [x is w for x in t.allocated_windows()] == [True]
    rng = random.Random(1234)  # the same sequence on every rank
    for rnd in range(ROUNDS):
        w[rank].fill_(-1)  # poison my own window
        torch.cuda.synchronize()
        dist.barrier(group=group)
        late = rng.randrange(P)
        if rank == late:
            time.sleep(1.0)
        base = torch.arange(n, device="cuda", dtype=torch.int32)
        code = lambda s, d: base + n * (s + P * (d + P * rnd))  # noqa: E731
        for d in range(P):  # my slot in every window, this round's values
            w[d, rank].copy_(code(rank, d))
        t.barrier()
        mine = w[rank].clone()
        t.barrier()  # nobody overwrites my window before I have read it
        want = torch.stack([code(s, rank) for s in range(P)])
        assert torch.equal(mine, want), (P, rank, rnd, late)
    torch.cuda.synchronize()
    t.check()
    assert t.epoch.item() == 2 * ROUNDS
    t.close()
    assert t.closed
    with pytest.raises(RuntimeError, match="closed"):
        t.windows("test", (P, n), torch.int32)


def _timeout(P, group, rank):
    from ulysses.transport import BarrierTimeoutError, VmmTransport

    t = VmmTransport(group, timeout_s=1.0)
    missing = P - 1
    if rank != missing:
        t.barrier()
        torch.cuda.synchronize()
        # refused without check(): the host reads the kernel's mapped error mirror
        for call in (t.barrier, lambda: t.windows("after", (4,), torch.float32)):
            with pytest.raises(BarrierTimeoutError, match=f"refused.*for rank {missing}, which never arrived") as e:
                call()
            assert e.value.missing == [(rank, missing, 1)], e.value.missing
        assert t.epoch.item() == 1  # the refused barrier never launched
        with pytest.raises(BarrierTimeoutError, match=f"for rank {missing}, which never arrived"):
            t.check()
    t.close()  # a failed transport closes without waiting for its peers
    assert t.closed


def _exchange_and_timeout(P, group, rank):
    faulthandler.dump_traceback_later(HARD_S, exit=True)
    _exchange(P, group, rank)
    _timeout(P, group, rank)
    faulthandler.cancel_dump_traceback_later()


def test_vmm_transport_two_and_four_processes_one_gpu():
    run_on_gloo_groups(_exchange_and_timeout, (2, 4), cuda=True, timeout_s=120)


# ---- injected set-up failures ----------------------------------------------------------------------
class _FailingDriver:
    """The CUDA driver bindings with some calls failing (CUDA_ERROR_OUT_OF_MEMORY)."""

    def __init__(self, real, fail):
        self._real, self._fail = real, set(fail)

    def __getattr__(self, name):
        if name in self._fail:
            oom = self._real.CUresult.CUDA_ERROR_OUT_OF_MEMORY
            return lambda *a, **k: (oom,) if name == "cuMemMap" else (oom, None)
        return getattr(self._real, name)


def _free_bytes(group):
    torch.cuda.synchronize()
    dist.barrier(group=group)
    free = torch.cuda.mem_get_info()[0]
    dist.barrier(group=group)
    return free


def _setup_failures(P, group, rank):
    import ulysses.vmm as tr
    from ulysses.transport import TransportSetupError, VmmTransport

    faulthandler.dump_traceback_later(HARD_S, exit=True)
    real_cu, GiB = tr._cu, 1 << 30

    def expect(fn, *needles, within=10.0):
        t0 = time.monotonic()
        with pytest.raises(TransportSetupError) as info:
            fn()
        assert time.monotonic() - t0 < within, (rank, time.monotonic() - t0)
        for needle in needles:
            assert needle in str(info.value), (rank, needle, str(info.value))
        return info.value

    # 1, 2: one rank's allocation or mapping fails; every rank frees what it had made.
    for call in ("cuMemCreate", "cuMemMap"):
        t = VmmTransport(group, setup_timeout_s=20)
        free0 = _free_bytes(group)
        if rank == 1:
            tr._cu = lambda: _FailingDriver(real_cu(), {call})
        try:
            err = expect(lambda: t.windows("big", (GiB,), torch.uint8), f"rank 1: RuntimeError: {call}",
                         "CUDA_ERROR_OUT_OF_MEMORY")
        finally:
            tr._cu = real_cu
        assert list(err.failures) == [1], err.failures
        expect(lambda: t.windows("small", (16,), torch.uint8), "refused")  # a failed transport stays failed
        t.close()
        leaked = free0 - _free_bytes(group)
        assert leaked < GiB // 4, (call, rank, leaked)
    # 3: rank 1 reports that it cannot access rank 0's GPU: nobody builds a transport.
    real_peer = tr._can_access_peer
    if rank == 1:
        tr._can_access_peer = lambda a, b: False
    try:
        expect(lambda: VmmTransport(group), "rank 1: GPU", "cannot access the memory of rank 0")
    finally:
        tr._can_access_peer = real_peer
    dist.barrier(group=group)
    # 3b: ranks on two hosts (rank 1 reports another host name): refused on every rank.
    real_host = tr.socket.gethostname
    if rank == 1:
        tr.socket.gethostname = lambda: "another-host"
    try:
        with pytest.raises(ValueError, match="group: the VMM transport needs every rank on one host"):
            VmmTransport(group)
    finally:
        tr.socket.gethostname = real_host
    dist.barrier(group=group)
    # 4: windows() calls that differ between the ranks.
    t = VmmTransport(group, setup_timeout_s=20)
    expect(lambda: t.windows("x", (64 if rank else 32,), torch.float32), "calls differ",
           "rank 0: called windows x:(32,)", "rank 1: called windows x:(64,)")
    t.close()
    dist.barrier(group=group)
    # 5: a rank late by more than the set-up timeout: rank 0 names it, the late rank names rank 0.
    t = VmmTransport(group, setup_timeout_s=1.0)
    if rank == 1:
        time.sleep(2.5)
        expect(lambda: t.windows("late", (16,), torch.float32), "rank 0: did not answer")
    else:
        expect(lambda: t.windows("late", (16,), torch.float32), "rank 1: did not arrive within 1 s")
    t.close()
    dist.barrier(group=group)
    faulthandler.cancel_dump_traceback_later()


def test_vmm_setup_failures_reach_every_rank_and_free_memory():
    run_on_gloo_groups(_setup_failures, (2,), cuda=True, timeout_s=120)


# ---- the multi-GPU test's rank check on processes sharing the GPU ---------------------------------
def _multigpu_check(P, group, rank):
    import cute_kernels.fa4 as fused
    from tests.multigpu.test_multigpu import check_ranks, drop_remote_tiles
    from ulysses.transport import close_transports

    faulthandler.dump_traceback_later(HARD_S, exit=True)
    case = (lambda P: (1, P * 256, 2 * P, P, 128, 0, False),)
    assert check_ranks(P, group, rank, impls=("fused", "serial"), cases=case)
    # a fresh transport, so that the window plan prepares its launches again with the broken launcher
    dist.barrier(group=group)
    close_transports()
    real = fused.fa4_a2a_launcher
    fused.fa4_a2a_launcher = drop_remote_tiles(real)
    try:
        with pytest.raises(AssertionError, match="fused"):
            check_ranks(P, group, rank, impls=("fused",), cases=case)
    finally:
        fused.fa4_a2a_launcher = real
    faulthandler.cancel_dump_traceback_later()


def test_multigpu_check_sees_a_fused_epilogue_that_drops_remote_tiles():
    from ulysses.transport import close_transports

    run_on_gloo_groups(_multigpu_check, (2,), cuda=True, timeout_s=300, teardown=close_transports)
