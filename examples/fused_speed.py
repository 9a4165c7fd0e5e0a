"""Kernel-level check of the fused epilogue's cost: T_fused / T_FA4 on one GPU, emulated ranks.

One source rank's work (rank 0 of P): FA4 alone writing its local O, and the fused kernel (its
TMA and its per-thread-store O paths) writing the same tiles into P rank windows (local buffers standing in for the peers). Each is
captured in a CUDA graph and timed with triton.testing.do_bench_cudagraph (median), the variants
interleaved twice so the spread between repeats shows the noise.

    python examples/fused_speed.py [--seqlens 8192 16384 32768 65536] [--out DIR]
"""

import argparse
import json
import os

import torch
import triton.testing

from fa_a2a.fused import fa4_a2a_forward, fa4_forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--heads-per-rank", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (SM90)")
    P, H_loc, D = args.world_size, args.heads_per_rank, args.head_dim
    rows = []
    for M in args.seqlens:
        if M % P:
            raise SystemExit(f"--seqlens: {M} is not divisible by --world-size {P}")
        S_loc = M // P
        q, k, v = (torch.randn(1, M, H_loc, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        windows = torch.randn(P, 1, S_loc, P * H_loc, D, device="cuda", dtype=torch.bfloat16)
        fns = {
            "fa4": lambda: fa4_forward(q, k, v, out),
            "fused": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="tma"),
            "fused-st": lambda: fa4_a2a_forward(q, k, v, windows, 0, o_store="st"),
        }
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = {name: [] for name in fns}
        for _ in range(2):
            for name, fn in fns.items():
                times[name].append(1e3 * triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median"))
        t_fa, t_fused, t_st = min(times["fa4"]), min(times["fused"]), min(times["fused-st"])
        flops = 4 * M * M * H_loc * D
        rows.append(dict(M=M, t_fa4_us=times["fa4"], t_fused_us=times["fused"], t_fused_st_us=times["fused-st"],
                         ratio=t_fused / t_fa, ratio_st=t_st / t_fa, fa4_tflops=flops / t_fa / 1e6))
        del q, k, v, out, windows
    card = torch.cuda.get_device_name()
    print(f"\n{card}, bf16, D={D}, H_loc={H_loc}, emulated P={P}, CUDA-graph median (us), two repeats")
    print("| M | FA4 | fused (TMA) | fused (st) | T_fused/T_FA4 TMA | st | FA4 TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        fa = "/".join(f"{t:.1f}" for t in r["t_fa4_us"])
        fu = "/".join(f"{t:.1f}" for t in r["t_fused_us"])
        st = "/".join(f"{t:.1f}" for t in r["t_fused_st_us"])
        print(f"| {r['M']} | {fa} | {fu} | {st} | {r['ratio']:.4f} | {r['ratio_st']:.4f} | {r['fa4_tflops']:.0f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fused_speed.json"), "w") as f:
            json.dump(dict(card=card, P=P, H_loc=H_loc, D=D, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
