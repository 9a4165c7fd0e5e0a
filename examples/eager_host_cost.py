"""Host cost of eager ulysses_attention and attention-block calls (issue 18): is an eager call GPU-bound?

The block: fa_a2a.block.ulysses_qkv_attention, the attention from hidden states.

Per case, bf16, D = 128, after warm-up:
- host us/call: the time to enqueue N calls while the GPU is held busy by a long sleep kernel
  (torch.cuda._sleep) queued first, so nothing the calls launch can run: the pure host path
  (Python, checks, launches). Only meaningful while N calls' launches fit the launch queue.
- eager us/call: wall time of N back-to-back eager calls, GPU work included (max(host, GPU)).
- graph us/call: the same N calls captured in one CUDA graph, replay time / N (the GPU time).
Cases: one rank (P = 1, no torch.distributed), P emulated ranks in one process
(ulysses_attention_emulated: all P ranks' work per call), and P rank processes (the real-rank
path: VMM windows, in-stream barriers; a gloo group for the host side), 2 spawned here or P under
torchrun (only that case then), each on GPU local_rank % device_count. Processes sharing one GPU
time-slice it unless an MPS daemon runs (`python -m fa_a2a.mps -- ...`; the case name says
"MPS"): time-sliced, their eager wall time is not a speed result, the host column is.
Block cases ("block"): the same P and rows through the attention block with Flux-like shapes
(C = 3072 = H * D, q/k/v bias, per-head RMSNorm, diffusers' (cos, sin) rotary; x [1, rows, C]);
a last table prints each block case's host us/call beside the op's of the same P and rows. At P = 1
and up to fa_a2a.engine.projection.ONE_LAUNCH_ROWS rows the block also runs with its projection in two launches (q|k
and v apart, config=None) beside the one launch its automatic tiles pick.

    python examples/eager_host_cost.py [--json OUT.json] [--calls 50]
    python -m fa_a2a.mps -- torchrun --nproc-per-node=2 examples/eager_host_cost.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fa_a2a.tools.cli import no_gpu, out_file

H, D = 24, 128
C = H * D  # Flux's hidden size
BLOCK_LAUNCHES = 8  # an upper bound of the block's launches per rank and call (rope, projection, barriers, FA4, copy)
SLEEP_CYCLES = 400_000_000  # ~0.2 s at ~1.9 GHz: longer than enqueueing N calls


def _inputs(P: int, S_loc: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.randn(1, S_loc, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
            for _ in range(n)]


def _block_weights(P: int):
    """Flux-like projection weights (bias, per-head RMSNorm weights) gathered for P ranks; the same
    on every rank (seeded)."""
    from fa_a2a.block import TorchQKV, block_weights

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 3 * H * D
    w = (torch.randn(n, C, device="cuda", generator=g) / C ** 0.5).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=g) / 10).to(torch.bfloat16)
    norm = [torch.rand(D, device="cuda", generator=g) + 0.5 for _ in range(2)]
    return block_weights(TorchQKV(w, b, *norm, H, H, D), P)


def _block_inputs(S_loc: int, rank: int, seed: int):
    """A rank's x [1, S_loc, C] and its rows' rotary as diffusers passes it: (cos, sin) fp32 [S_loc, D]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    from fa_a2a.block import rotary_pair

    x = torch.randn(1, S_loc, C, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, rotary_pair(torch.arange(rank * S_loc, (rank + 1) * S_loc, device="cuda"), D)


def _host_us(call, n: int, barrier=None) -> float:
    """Enqueue n calls behind a sleep kernel; host seconds per call (us)."""
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6 / n


def _eager_us(call, n: int, barrier=None) -> float:
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def _graph_us(call, n: int) -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            call()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def _measure(call, n: int, n_host: int, trials: int = 5, barrier=None, graph: bool = True) -> dict:
    """n_host calls for the host column: few enough that their launches fit the launch queue. host_min_us
    (in the JSON): the fastest trial's, less moved by other work on the machine than the median."""
    for _ in range(3):
        call()
    hosts = [_host_us(call, n_host, barrier) for _ in range(trials)]
    eager = statistics.median(_eager_us(call, n, barrier) for _ in range(trials))
    return dict(host_us=statistics.median(hosts), host_min_us=min(hosts), eager_us=eager,
                graph_us=_graph_us(call, n) if graph else None)


def one_process_cases(n: int) -> list[dict]:
    from fa_a2a import ulysses_attention, ulysses_attention_emulated
    from fa_a2a.block import ulysses_qkv_attention, ulysses_qkv_attention_emulated
    from fa_a2a.engine.projection import ONE_LAUNCH_ROWS

    from cute_kernels.fa4 import fa4_forward

    q, k, v = _inputs(1, 128, 1, 0)[0]
    o = torch.empty_like(q)
    rows = [dict(case="one process, fa4_forward, S = 128", **_measure(lambda: fa4_forward(q, k, v, o), n, n))]
    proj = _block_weights(1)
    for S in (128, 4608):
        q, k, v = _inputs(1, S, 1, 0)[0]
        rows.append(dict(case=f"P = 1 fused, S = {S}", kind="op", pair=f"P = 1, S = {S}",
                         **_measure(lambda: ulysses_attention(q, k, v), n, n)))
        x, rot = _block_inputs(S, 0, 0)
        rows.append(dict(case=f"P = 1 block, S = {S}", kind="block", pair=f"P = 1, S = {S}",
                         **_measure(lambda: ulysses_qkv_attention(x, proj, rotary=rot), n,
                                    min(n, 600 // BLOCK_LAUNCHES))))
        if S <= ONE_LAUNCH_ROWS:  # the projection in one launch (auto) against q|k and v launched apart
            rows.append(dict(case=f"P = 1 block, q|k and v apart, S = {S}",
                             **_measure(lambda: ulysses_qkv_attention(x, proj, rotary=rot, config=None), n,
                                        min(n, 600 // BLOCK_LAUNCHES))))
    del proj
    for P, S_loc in ((2, 128), (8, 128), (8, 576), (8, 1024), (4, 1152)):
        xs = _inputs(P, S_loc, P, 1)
        qs, ks, vs = ([x[i] for x in xs] for i in range(3))
        call = lambda: ulysses_attention_emulated(qs, ks, vs, impl="fused")  # noqa: E731
        # ~4 launches per rank per call: 600 // (4 P) calls keep the host column's launches queued
        label = f"emulated P = {P}, S_loc = {S_loc}"
        rows.append(dict(case=f"emulated P = {P} fused, S_loc = {S_loc}", kind="op", pair=label,
                         **_measure(call, n, 600 // (4 * P))))
        if (P, S_loc) == (4, 1152):  # Flux's 4608 image rows on 4 ranks
            proj = _block_weights(P)
            ins = [_block_inputs(S_loc, r, 1) for r in range(P)]
            xb, rots = [t[0] for t in ins], [t[1] for t in ins]
            call = lambda: ulysses_qkv_attention_emulated(xb, proj, rotary=rots)  # noqa: E731
            rows.append(dict(case=f"emulated P = {P} block, S_loc = {S_loc}", kind="block", pair=label,
                             **_measure(call, n, 600 // (BLOCK_LAUNCHES * P))))
            del proj
    return rows


def _profile(call, n: int, what: str, report: bool) -> None:
    """Where the host time of n calls goes (enqueued behind a sleep kernel): the top functions,
    printed where `report`. Every rank makes the calls (each call is agreed across the ranks)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    if not report:
        return
    stats = pstats.Stats(prof).stats  # {(file, line, function): (calls, ncalls, own s, cumulative s, callers)}
    print(f"{f'function (rank 0, per {what} call)':<64} {'calls':>6} {'own us':>7} {'cum us':>7}")
    for (file, line, fn), (_, calls, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]:
        print(f"{f'{os.path.basename(file)}:{line}({fn})'[:64]:<64} {calls / n:6.1f} {own / n * 1e6:7.1f} "
              f"{cum / n * 1e6:7.1f}")


REAL_RANK_ROWS = (128, 1152)  # S_loc of the real-rank op and block cases (1152: Flux's 4608 rows on 4 ranks)


def _real_rank_rows(P: int, n: int, profile: bool) -> list[dict] | None:
    """This rank's part of the P-process case (process group initialised, device current):
    host/eager medians, max over ranks (the slowest bounds the call); the rows on rank 0."""
    from fa_a2a import ulysses_attention
    from fa_a2a.block import ulysses_qkv_attention
    from fa_a2a.tools.mps import mps_reachable
    from ulysses.transport import close_transports

    from cute_kernels.fa4 import fa4_forward

    rank = dist.get_rank()
    proj = _block_weights(P)
    names, res = [], []
    for S_loc in REAL_RANK_ROWS:
        q, k, v = _inputs(P, S_loc, 1, rank)[0]
        x, rot = _block_inputs(S_loc, rank, rank)
        op = lambda: ulysses_attention(q, k, v, impl="fused")  # noqa: E731
        blk = lambda: ulysses_qkv_attention(x, proj, rotary=rot)  # noqa: E731
        res.append(_measure(op, n, n, barrier=dist.barrier, graph=False))
        res.append(_measure(blk, n, min(n, 600 // BLOCK_LAUNCHES), barrier=dist.barrier, graph=False))
        names += [("op", "fused", S_loc), ("block", "block", S_loc)]
        if profile and S_loc == REAL_RANK_ROWS[0]:  # where the real-rank call's host time goes (rank 0's)
            _profile(op, n, "op", rank == 0)
            _profile(blk, min(n, 600 // BLOCK_LAUNCHES), "block", rank == 0)
    # the same processes' host cost of one plain FA4 launch: what sharing the GPU does to launches
    q, k, v = _inputs(P, 128, 1, rank)[0]
    o = torch.empty_like(q)
    res.append(_measure(lambda: fa4_forward(q, k, v, o), n, n, barrier=dist.barrier, graph=False))
    vals = torch.tensor([t for r in res for t in (r["host_us"], r["eager_us"], r["host_min_us"])],
                        dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    dist.barrier()
    close_transports()
    if rank != 0:
        return None
    where = f"{P} processes on {min(P, torch.cuda.device_count())} GPU(s){', MPS' if mps_reachable() else ''}"
    rows = [dict(case=f"{where}, {name}, S_loc = {S_loc}", kind=kind, pair=f"{P} processes, S_loc = {S_loc}",
                 host_us=vals[3 * i].item(), eager_us=vals[3 * i + 1].item(), host_min_us=vals[3 * i + 2].item(),
                 graph_us=None)
            for i, (kind, name, S_loc) in enumerate(names)]
    return rows + [dict(case=f"{where}, fa4_forward, S = 128", host_us=vals[-3].item(), eager_us=vals[-2].item(),
                        host_min_us=vals[-1].item(), graph_us=None)]


def _rank_entry(rank, P, n, init, out, profile):
    """One of P spawned rank processes."""
    from fa_a2a.tools.mps import rank_device

    rank_device(rank, local_world_size=P)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=120))
    try:
        rows = _real_rank_rows(P, n, profile)
        if rows is not None:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def real_rank_case(P: int, n: int, profile: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_rank_entry, args=(P, n, f"file://{os.path.join(tmp, 'init')}", out, profile), nprocs=P, join=True)
        with open(out) as f:
            return json.load(f)


def torchrun_case(n: int, profile: bool) -> list[dict] | None:
    """This process is one of torchrun's ranks: the real-rank case with P = WORLD_SIZE."""
    from fa_a2a.tools.mps import rank_device

    rank_device()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return _real_rank_rows(dist.get_world_size(), n, profile)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed run (default 50)")
    ap.add_argument("--json", type=out_file(), help="write the rows here")
    ap.add_argument("--no-real-ranks", action="store_true", help="skip the processes-sharing-the-GPU case")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of rank 0's real-rank calls")
    ap.add_argument("--real-ranks-only", action="store_true", help="only the processes-sharing-the-GPU case")
    args = ap.parse_args()
    under_torchrun = "WORLD_SIZE" in os.environ
    if under_torchrun and args.no_real_ranks:
        ap.error("--no-real-ranks: under torchrun only the real-rank case runs")
    if not torch.cuda.is_available():
        raise SystemExit(no_gpu("examples/eager_host_cost.py", "the timing of eager calls"))
    if under_torchrun:
        rows = torchrun_case(args.calls, args.profile)
        if rows is None:  # not rank 0
            return
    else:
        rows = [] if args.real_ranks_only else one_process_cases(args.calls)
        if not args.no_real_ranks:
            rows += real_rank_case(2, args.calls, args.profile)
    print(f"{torch.cuda.get_device_name()}, bf16, H = {H}, D = {D}, {args.calls} calls per run, medians of 5")
    print(f"{'case':<50} {'host us/call':>12} {'eager us/call':>13} {'graph us/call':>13} {'eager/graph':>11}")
    for r in rows:
        g = r["graph_us"]
        ratio = f"{r['eager_us'] / g:.2f}" if g else "-"
        gs = f"{g:.1f}" if g else "-"
        print(f"{r['case']:<50} {r['host_us']:>12.1f} {r['eager_us']:>13.1f} {gs:>13} {ratio:>11}")
    pairs = {}
    for r in rows:
        if "pair" in r:
            pairs.setdefault(r["pair"], {})[r["kind"]] = r["host_us"]
    pairs = {k: v for k, v in pairs.items() if len(v) == 2}
    if pairs:
        print(f"\n{'op and block (same P and rows)':<50} {'op host us/call':>15} {'block host us/call':>18}")
        for label, v in pairs.items():
            print(f"{label:<50} {v['op']:>15.1f} {v['block']:>18.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), calls=args.calls, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
