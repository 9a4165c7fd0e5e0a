"""What the per-call agreement of the ranks costs (fa_a2a.engine.problem.agree_call, ulysses.channel).

P gloo rank processes on this machine's CPU: the channel's word exchange alone, then the whole
agreement (agree_call: the channel's lookup, the exchange, the verdict), each as median host time
per call: each rank's, max over ranks; that of the rank that entered the call last, which finds
every other word there and so times its own cost; and the spread of the ranks' entries, which the
others wait out. Then ulysses_attention(impl=...) with the agreement against the same calls with it
switched off, timed back to back (median per call, max over ranks).
P above the CPU count oversubscribes the cores: the waits then are the scheduler's.

Measured 2026-12-04, per call over all ranks / own cost of the rank that entered last, the
version before in parentheses (runs alternated with it):
  CPU-only dev machine (2 cores, shared with other jobs), --ranks 2, medians of 10 runs: exchange
  0.84 / 0.78 us (0.95 / 0.89), agree_call 1.67 / 1.61 us (5.3 / 5.1).
  16-core GPU host (Xeon; --seq 64 --heads 8, which only the attention line uses), medians of 4
  runs: --ranks 2 exchange 1.33 / 1.19 us (1.36 / 1.21), agree_call 2.13 / 2.05 us (4.84 / 4.67);
  --ranks 4 (3 runs) exchange 2.20 / 1.47 us (2.17 / 1.51), agree_call 3.05 / 2.48 us (5.96 / 5.46).

    python examples/agreement_cost.py [--ranks 2] [--impl nccl] [--seq 256] [--heads 24] [--head-dim 64]
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

from fa_a2a.tools.cli import MAX_HEADS, MAX_REPEATS, MAX_SEQLEN, int_in


MAX_RANKS = 64  # rank processes on this one machine (each a Python process with torch)


def _worker(rank, P, impl, S_loc, heads, head_dim, calls, init_file, results):
    import torch
    import torch.distributed as dist

    import fa_a2a.engine.problem as problem
    from fa_a2a import ulysses_attention
    from ulysses.channel import get_channel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    channel = get_channel(group)
    clock, spans, agreed = time.perf_counter_ns, [], []  # one clock for every process of the host
    for _ in range(calls):
        t0 = clock()
        channel.exchange(12345)
        spans.append((t0, clock()))
    for _ in range(calls):  # the whole per-call agreement: the channel's lookup, the exchange, the verdict
        t0 = clock()
        problem.agree_call(None, 12345, None, group)
        agreed.append((t0, clock()))
    q, k, v = (torch.randn(1, S_loc, heads, head_dim) for _ in range(3))
    agree = problem.agree_call
    per = {"with agreement": [], "without": []}
    with torch.no_grad():
        for i in range(calls // 10):
            for label in per if i % 2 else reversed(list(per)):
                problem.agree_call = agree if label == "with agreement" else (lambda *a: None)
                dist.barrier()
                t0 = time.perf_counter()
                ulysses_attention(q, k, v, impl=impl)
                per[label].append(time.perf_counter() - t0)
    problem.agree_call = agree
    results[rank] = {"spans": spans, "agreed": agreed, "channel": channel.kind,
                     **{label: statistics.median(t) * 1e6 for label, t in per.items()}}
    dist.destroy_process_group()


def _exchange_report(spans, what="word exchange alone"):
    """Median times of `what`: each rank's call (its own host cost plus its wait for the others,
    max over ranks), the call of the rank that entered last (its own host cost: the others' words
    are there), and the spread of the ranks' entries (the wait that skew alone causes)."""
    calls = list(zip(*spans))  # per call: every rank's (enter, leave), ns
    whole = max(statistics.median(b - a for a, b in rank) for rank in spans)
    last = statistics.median(b - a for a, b in (max(call) for call in calls))
    skew = statistics.median(max(a for a, _ in call) - min(a for a, _ in call) for call in calls)
    return [f"{what}, median per call: {whole / 1e3:.2f} us (max over ranks; own cost plus the wait "
            "for the others)",
            f"  the rank that entered last (its own host cost): {last / 1e3:.2f} us; "
            f"spread of the ranks' entries: {skew / 1e3:.2f} us"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python examples/agreement_cost.py", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=2, help=f"rank processes (at most {MAX_RANKS})")
    ap.add_argument("--impl", choices=("nccl", "reference"), default="nccl")
    ap.add_argument("--seq", type=int_in(1, MAX_SEQLEN), default=256, help="rows per rank (S_loc)")
    ap.add_argument("--heads", type=int_in(1, MAX_HEADS), default=24)
    ap.add_argument("--head-dim", type=int_in(1, 1024), default=64)
    ap.add_argument("--calls", type=int_in(1, MAX_REPEATS), default=2000)
    ns = ap.parse_args(argv)
    if ns.heads % ns.ranks:
        ap.error(f"--heads: expected a multiple of --ranks {ns.ranks}, got {ns.heads}")

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(ns.ranks, ns.impl, ns.seq, ns.heads, ns.head_dim, ns.calls,
                                os.path.join(tmp, "init"), results), nprocs=ns.ranks, join=True)
        res = dict(results)
    worst = {key: max(r[key] for r in res.values()) for key in ("with agreement", "without")}
    print(f"{ns.ranks} gloo ranks on CPU ({os.cpu_count()} CPUs), channel: {res[0]['channel']}")
    for line in _exchange_report([res[r]["spans"] for r in range(ns.ranks)]):
        print(line)
    for line in _exchange_report([res[r]["agreed"] for r in range(ns.ranks)], "agree_call (lookup, exchange, verdict)"):
        print(line)
    print(f"ulysses_attention impl={ns.impl} [1, {ns.seq}, {ns.heads}, {ns.head_dim}] per rank, median per call "
          "(max over ranks): "
          f"{worst['with agreement']:.0f} us with the agreement, {worst['without']:.0f} us without "
          f"(x{worst['with agreement'] / worst['without']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
