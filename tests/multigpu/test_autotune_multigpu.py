"""impl="auto" on real ranks, one GPU each (torchrun, NCCL, VMM windows), all ranks storing at once.

pytest runs this file under torchrun in a subprocess for P = 2, 4 and 8 as far as the machine has
GPUs. Each rank:
  - times the fused kernel's two O-store paths (TMA bulk stores, per-thread st.global) into the
    transport's windows, every rank at once (the fan-in where TMA into imported peer memory was seen
    to collapse on 8 x H200), and prints the rates (GB/s of this rank's O, the max over ranks' times);
  - makes the call with impl="auto" (which times fused:tma, fused:st, serial and nccl on its inputs),
    then times the auto call and every candidate back to back, paired per trial, and requires auto
    within 2% of the fastest candidate (median over trials of the per-trial ratio);
  - checks that auto's output equals every candidate's bit for bit.
"""
import os
import statistics

import pytest
import torch

from tests.multiproc import run_torchrun_on_gpus

TRIALS = 7
P_S = 16384  # the full sequence per case (S_loc = 16384 / P, a multiple of the tile's rows)


@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_auto_on_distinct_gpus(nproc):
    out = run_torchrun_on_gpus(__file__, nproc)
    assert out.count("RANK OK") == nproc, out[-4000:]


def _timed(f, barrier) -> float:
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def main():
    import torch.distributed as dist

    from fa_a2a.engine import autotune
    from cute_kernels.fa4 import fa4_a2a_launcher
    from fa_a2a.op import ulysses_attention
    from ulysses.transport import close_transports, get_transport

    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    t = get_transport(group)
    H, D = 3 * P, 128
    S_loc, H_loc = P_S // P, 3
    gen = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v = (torch.randn(1, S_loc, H, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))

    # the fused kernel's two store paths into the peers' windows, all ranks at once
    qh, kh, vh = (torch.randn(1, P_S, H_loc, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    windows = t.windows("test.autotune.o", (1, S_loc, H, D), torch.bfloat16)
    rates = {}
    for o_store in ("tma", "st"):
        launch = fa4_a2a_launcher(qh, kh, vh, windows, rank, o_store=o_store)
        launch()
        times = [_timed(launch, t.barrier) for _ in range(TRIALS)]
        worst = max(t.host_allgather(f"o-store {o_store}", statistics.median(times)))
        rates[o_store] = qh.numel() * 2 * (P - 1) / P / worst / 1e9
    if rank == 0:
        print(f"P={P}: fused kernel, O stored to peers at {rates['tma']:.0f} GB/s (TMA), {rates['st']:.0f} GB/s (st) "
              "per rank (kernel time, max over ranks)", flush=True)

    # auto decides, then auto against each candidate, paired per trial
    labels = ("fused:tma", "fused:st", "serial", "nccl")
    out = ulysses_attention(q, k, v, group=group, impl="auto").clone()
    print(f"rank {rank}: impl='auto': {autotune.decision_text('ulysses_attention', S_loc)}", flush=True)
    for label in labels:
        assert torch.equal(ulysses_attention(q, k, v, group=group, impl=label), out), label
    calls = {name: (lambda impl=name: ulysses_attention(q, k, v, group=group, impl=impl)) for name in ("auto",) + labels}
    for f in calls.values():
        f()
    trials = {name: [] for name in calls}
    for _ in range(TRIALS):
        for name, f in calls.items():
            trials[name].append(max(t.host_allgather(f"time {name}", _timed(lambda: [f() for _ in range(5)],
                                                                             t.barrier))))
    ratio = statistics.median(trials["auto"][i] / min(trials[c][i] for c in labels) for i in range(TRIALS))
    if rank == 0:
        print(f"P={P}: " + ", ".join(f"{n} {statistics.median(v) / 5 * 1e6:.1f} us" for n, v in trials.items())
              + f"; auto / best paired {ratio:.4f}", flush=True)
    assert ratio <= 1.02, ratio
    t.check()
    close_transports()
    dist.destroy_process_group()
    print("RANK OK", flush=True)


if __name__ == "__main__":
    main()
