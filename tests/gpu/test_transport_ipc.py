"""VmmTransport with 2 and 4 processes sharing one GPU (gloo bootstrap, CUDA VMM windows).

Every rank writes rank- and round-coded values into every peer's window, passes the in-stream
barrier and checks its own window bit-exactly; a random rank sleeps before each round, so a late
rank must not let anyone read early. Then a rank skips a barrier: the others' barriers time out
and check() names the missing rank. One spawn of 4 processes; P = 2 is a subgroup.
"""
import random
import time

import torch
import torch.distributed as dist

from tests.multiproc import run_on_gloo_groups

ROUNDS = 6


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


def _timeout(P, group, rank):
    from ulysses.transport import BarrierTimeoutError, VmmTransport

    t = VmmTransport(group, timeout_s=1.0)
    missing = P - 1
    if rank != missing:
        t.barrier()
        torch.cuda.synchronize()
        try:
            t.check()
        except BarrierTimeoutError as e:
            assert f"for rank {missing}, which never arrived" in str(e), str(e)
            assert e.missing == [(rank, missing, 1)], e.missing
        else:
            raise AssertionError(f"rank {rank}: no timeout reported")
    t.close()


def _exchange_and_timeout(P, group, rank):
    _exchange(P, group, rank)
    _timeout(P, group, rank)


def test_vmm_transport_two_and_four_processes_one_gpu():
    run_on_gloo_groups(_exchange_and_timeout, (2, 4), cuda=True, timeout_s=120)
