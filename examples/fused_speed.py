"""Kernel-level check of the fused epilogue's cost: T_fused / T_FA4 on one GPU, emulated ranks.

One source rank's work (rank 0 of P): FA4 alone writing its local O, and the fused kernel (its
TMA and its per-thread-store O paths, the TMA path with the rank-rotated tile order, which
starts on rank 1's rows, and the TMA path that also keeps O and LSE for a backward: the forward with
grad's, cute_kernels.fa4.fa4_a2a_keeping_launcher) writing the same tiles into P rank windows (local
buffers standing in for the peers). Timed with graphs.time_graphs, the project's one timing loop: each
variant captured as N back-to-back calls in a CUDA graph, replays rotated across variants, median
over trials; the paired ratio is the median over trials of T_fused / T_FA4 from the same trial
(and of T_rotated / T_fused for the rotated order, beside T_fused' / T_fused of a second graph of
the unrotated kernel: the noise of one such ratio).

--backward: the same for the backward (issue 40's kernel bar): FA4's own backward (preprocess, main
kernel, dQ postprocess: flash_attn.cute.interface._flash_attn_bwd, which the serial path runs) of rank
0's heads writing its local dq, dk, dv, against cute_kernels.fa4_bwd_a2a_launcher storing the same
rows into P gradient windows (its per-thread dK/dV store path, and the TMA one where S_loc is a
multiple of FA4's backward tile_n), and a second graph of FA4's backward (the noise). Before timing,
the windows' rows equal FA4's dk, dv bit for bit and its dq to fp32-atomics order (checked here).

    python examples/fused_speed.py [--seqlens 8192 16384 32768 65536] [--trials 15] [--out DIR]
    python examples/fused_speed.py --backward --seqlens 8192 16384 32768
"""

import argparse
import json
import os
import statistics

from fa_a2a.tools.cli import (KERNEL_HEAD_DIMS, MAX_HEADS, MAX_REPEATS, MAX_WORLD_SIZE, SEQLEN, check_seqlens, float_in,
                        int_in, no_gpu)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=SEQLEN, nargs="+", default=[8192, 16384, 32768, 65536],
                    help="M, multiples of --world-size")
    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--heads-per-rank", type=int_in(1, MAX_HEADS), default=3)
    ap.add_argument("--head-dim", type=int, choices=KERNEL_HEAD_DIMS, default=128)
    ap.add_argument("--trials", type=int_in(1, MAX_REPEATS), default=15)
    ap.add_argument("--target-ms", type=float_in(0, 1e4), default=25.0,
                    help="length of one replay in ms (sets the calls per graph)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--backward", action="store_true",
                    help="time the backward kernels (FA4's vs the gradients' A2A in them) instead of the forward")
    args = ap.parse_args(argv)
    try:
        check_seqlens(args.seqlens, args.world_size, "--world-size")
    except ValueError as e:
        ap.error(str(e))
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # a bad flag is refused before torch and the kernels load

import torch  # noqa: E402

from cute_kernels.fa4 import fa4_a2a_forward, fa4_a2a_keeping_launcher, fa4_forward  # noqa: E402
from graphs import calls_for, median, time_graphs  # noqa: E402


def graph_calls(fn, target_ms: float) -> int:
    """Calls per graph so that one replay takes about target_ms (graphs.calls_for of one eager call's time)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return calls_for(e0.elapsed_time(e1) * 1e3, target_ms)


def paired(t: dict, name: str, base: str) -> tuple:
    """(median, min, max) over trials of t[name] / t[base] from the same trial."""
    r = [a / b for a, b in zip(t[name], t[base])]
    return statistics.median(r), min(r), max(r)


def backward(args):
    """The backward's rows (module docstring, --backward)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    from cute_kernels.fa4_bwd_a2a import bwd_tiles, fa4_bwd_a2a_launcher

    P, H_loc, D = args.world_size, args.heads_per_rank, args.head_dim
    scale = D ** -0.5
    rows = []
    for M in args.seqlens:
        S_loc = M // P
        q, k, v, do = (torch.randn(1, M, H_loc, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        lse = torch.empty(1, H_loc, M, device="cuda", dtype=torch.float32)
        o = fa4_forward(q, k, v, softmax_scale=scale, lse=lse)
        windows = [torch.full((P, 1, S_loc, P * H_loc, D), float("nan"), device="cuda", dtype=torch.bfloat16)
                   for _ in range(3)]
        stores = ["st"] + (["tma"] if S_loc % bwd_tiles(D)[1] == 0 else [])
        fa4 = lambda: _flash_attn_bwd(q, k, v, o, do, lse, scale, False)  # noqa: E731
        fns = {"fa4": fa4}
        dq, dk, dv = fa4()
        for store in stores:
            launch = fns[f"fused-{store}"] = fa4_bwd_a2a_launcher(q, k, v, o, do, lse, *windows, 0,
                                                                  softmax_scale=scale, dkv_store=store)
            for w in windows:
                w.fill_(float("nan"))
            launch()
            # rank 0's heads of every window, rows in sequence order
            got = [torch.cat([w[d][:, :, :H_loc] for d in range(P)], dim=1) for w in windows]
            if not (torch.equal(got[1], dk) and torch.equal(got[2], dv)):
                raise SystemExit(f"M={M} {store}: the windows' dk, dv differ from FA4's")
            err = (got[0].float() - dq.float()).abs().max().item()
            if not err <= 1e-2 * dq.float().abs().max().item():
                raise SystemExit(f"M={M} {store}: the windows' dq differs from FA4's by {err}")
        fns["fa4-again"] = fa4
        n_calls = graph_calls(fa4, args.target_ms)
        t = time_graphs(fns, n_calls, args.trials, warmup=2)
        row = dict(M=M, n_calls=n_calls, t_us=t, median_us={name: median(ts) for name, ts in t.items()},
                   paired={name: paired(t, name, "fa4") for name in t if name != "fa4"})
        rows.append(row)
        del q, k, v, do, o, lse, windows, dq, dk, dv
    card = torch.cuda.get_device_name()
    print(f"\n{card}, bf16, D={D}, H_loc={H_loc}, emulated P={P}, rank 0's backward, CUDA-graph medians (us) over "
          f"{args.trials} trials; ratios paired per trial (median, min-max)")
    print("| M | FA4 bwd | fused st | fused TMA | st / FA4 | TMA / FA4 | FA4 again / FA4 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        med, pr = r["median_us"], r["paired"]

        def cell(name):
            return f"{med[name]:.1f}" if name in med else "-"

        def ratio(name):
            return f"{pr[name][0]:.4f} ({pr[name][1]:.4f}-{pr[name][2]:.4f})" if name in pr else "-"

        print(f"| {r['M']} | {cell('fa4')} | {cell('fused-st')} | {cell('fused-tma')} | {ratio('fused-st')} | "
              f"{ratio('fused-tma')} | {ratio('fa4-again')} |")
    return dict(card=card, P=P, H_loc=H_loc, D=D, **{"pass": "backward"}, rows=rows)


def main(args):
    if not torch.cuda.is_available():
        raise SystemExit(no_gpu("examples/fused_speed.py", "the fused kernel's timing"))
    if args.backward:
        result = backward(args)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fused_speed_backward.json"), "w") as f:
                json.dump(result, f, indent=1)
        return
    P, H_loc, D = args.world_size, args.heads_per_rank, args.head_dim
    rows = []
    for M in args.seqlens:
        S_loc = M // P
        q, k, v = (torch.randn(1, M, H_loc, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        windows = torch.randn(P, 1, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
        o_kept, lse_kept = torch.empty_like(q), torch.empty(1, H_loc, M, device="cuda")
        keeping = fa4_a2a_keeping_launcher(q, k, v, windows, 0, o_kept, lse_kept, o_store="tma")
        fns = {
            "fa4": lambda: fa4_forward(q, k, v, out),
            "fused": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="tma"),
            "fused-st": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="st"),
            "fused-rot": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="tma", rotate=True),
            "fused-again": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="tma"),
            "fused-keep": lambda: keeping(o_kept, lse_kept),
        }
        for fn in fns.values():
            fn()
        n_calls = graph_calls(fns["fa4"], args.target_ms)
        t = time_graphs(fns, n_calls, args.trials, warmup=2)
        med = {name: median(ts) for name, ts in t.items()}
        rot, again, keep = (paired(t, name, "fused") for name in ("fused-rot", "fused-again", "fused-keep"))
        flops = 4 * M * M * H_loc * D
        rows.append(dict(M=M, n_calls=n_calls, t_us=t, t_fa4_us=med["fa4"], t_fused_us=med["fused"],
                         t_fused_st_us=med["fused-st"], t_fused_rot_us=med["fused-rot"],
                         ratio=paired(t, "fused", "fa4")[0], ratio_st=paired(t, "fused-st", "fa4")[0],
                         ratio_rot=rot[0], ratio_rot_range=rot[1:], ratio_again=again[0], ratio_again_range=again[1:],
                         ratio_keep=keep[0], ratio_keep_range=keep[1:], fa4_tflops=flops / med["fa4"] / 1e6))
        del q, k, v, out, windows, o_kept, lse_kept, keeping
    card = torch.cuda.get_device_name()
    print(f"\n{card}, bf16, D={D}, H_loc={H_loc}, emulated P={P}, CUDA-graph medians (us) over {args.trials} trials")
    print("| M | FA4 | fused (TMA) | fused (st) | fused (TMA, rotated) | T_fused/T_FA4 TMA (paired) | st (paired) "
          "| T_rotated/T_fused (paired; min-max) | same kernel again (paired; min-max) "
          "| keeping O and LSE / T_fused (paired; min-max) | FA4 TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["ratio_rot_range"]
        alo, ahi = r["ratio_again_range"]
        klo, khi = r["ratio_keep_range"]
        print(f"| {r['M']} | {r['t_fa4_us']:.1f} | {r['t_fused_us']:.1f} | {r['t_fused_st_us']:.1f} | "
              f"{r['t_fused_rot_us']:.1f} | {r['ratio']:.4f} | {r['ratio_st']:.4f} | {r['ratio_rot']:.4f} "
              f"({lo:.4f}-{hi:.4f}) | {r['ratio_again']:.4f} ({alo:.4f}-{ahi:.4f}) | {r['ratio_keep']:.4f} "
              f"({klo:.4f}-{khi:.4f}) | {r['fa4_tflops']:.0f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused_speed.json"), "w") as f:
            json.dump(dict(card=card, P=P, H_loc=H_loc, D=D, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(ARGS)
