"""`python -m fa_a2a.bench_block`: the Ulysses attention block from hidden states, three ways.

One source rank (rank 0 of P, emulated as fa_a2a.bench does: its stores into the P windows stay
on this GPU, the other ranks' work is not issued; rank 0 attends window 0's N = P*S_loc rows with
its H/P heads) runs x [1, S_loc, C] -> out windows, on the op's own window plan:
  unfused     torch chain (one Linear over [W_q; W_k; W_v] with bias -> per-head RMSNorm (q, k)
              -> interleaved RoPE (q, k)) -> pre-A2A kernel -> FA4 -> post-A2A kernel
  attn-fused  the same torch chain -> pre-A2A kernel -> FA4 with the post-A2A in its epilogue
              (the attention-only fused op of today)
  block-fused the projection with the pre-A2A in its epilogue (cute_kernels/qkv_a2a_sm90.py,
              q|k then v: two launches, quack's default tiles) -> fused FA4
  block-fused1 the same with config_for's tile and q|k|v in one launch (one_launch)
and the parts: chain, pre-a2a, proj-fused (two launches), proj-fused1, fa4+post (FA4 + post-A2A
kernel), fa4-fused. No barriers (one rank). Timing: graphs.time_graphs (each method captured as
back-to-back calls, CUDA-graph replays, method order rotated, medians over trials); one input
set (the weight, 57 MB at Flux shapes, exceeds the 50 MB L2). The windows are NaN-poisoned after
capture and checked finite after the replays (rank 0's heads of the out-windows).

    python -m fa_a2a.bench_block [--seqlens 576 1024 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[576, 1024, 4096], help="S_loc values")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--trials", type=int, default=11)
    ap.add_argument("--out", default=None, help="directory for bench_block.json")
    args = ap.parse_args(argv)
    for name in ("seqlens", "world_size", "heads", "hidden", "calls", "trials"):
        v = getattr(args, name)
        if any(x < 1 for x in (v if isinstance(v, list) else [v])):
            raise SystemExit(f"--{name.replace('_', '-')}: positive ints expected, got {v}")
    if args.heads % args.world_size:
        raise SystemExit(f"--heads: a multiple of --world-size {args.world_size} expected, got {args.heads}")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (SM90)")
    from cute_kernels import qkv_a2a_sm90 as K
    from fa_a2a import block
    from fa_a2a.forward import window_plan
    from graphs import median, time_graphs
    from ulysses.layout import UlyssesLayout
    from ulysses.transport import EmulatedTransport

    P, H, D, C, dtype = args.world_size, args.heads, args.head_dim, args.hidden, torch.bfloat16
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    n = 3 * H * D
    chain = block.TorchQKV((r(n, C) / C ** 0.5).to(dtype), (0.1 * r(n)).to(dtype), r(D) * 0.2 + 1,
                           r(D) * 0.2 + 1, H, H, D)
    proj = block.block_weights(chain, P)
    transport = EmulatedTransport(P, dev)
    scale = 1.0 / math.sqrt(D)

    rows = []
    for S_loc in args.seqlens:
        lay = UlyssesLayout.from_shard(S_loc, H, H, P)
        plan = window_plan(transport, lay, 1, D, dtype)
        wins = (plan.dq, plan.dk, plan.dv)
        x = r(1, S_loc, C).to(dtype)
        pos = torch.arange(S_loc, device=dev, dtype=torch.float32)
        ang = pos[:, None] * 10000.0 ** (-torch.arange(D // 2, device=dev) / (D // 2))[None]
        cs = K.interleaved_cos_sin(ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1))
        cfg1 = K.config_for(S_loc, (H // P) * D, D, True)
        qkv = chain(x, cs)  # the chain's outputs, for the parts that start after it

        def pre(q, k, v):
            plan.pre(0, q, k, v, None)

        methods = {
            "unfused": lambda: (pre(*chain(x, cs)), plan.attend(0, "serial", False, scale)),
            "attn-fused": lambda: (pre(*chain(x, cs)), plan.attend(0, "fused", False, scale)),
            "block-fused": lambda: (block.project(wins, lay, 0, x, proj, cs), plan.attend(0, "fused", False, scale)),
            "block-fused1": lambda: (block.project(wins, lay, 0, x, proj, cs, config=cfg1, one_launch=True),
                                     plan.attend(0, "fused", False, scale)),
            "chain": lambda: chain(x, cs),
            "pre-a2a": lambda: pre(*qkv),
            "proj-fused": lambda: block.project(wins, lay, 0, x, proj, cs),
            "proj-fused1": lambda: block.project(wins, lay, 0, x, proj, cs, config=cfg1, one_launch=True),
            "fa4+post": lambda: plan.attend(0, "serial", False, scale),
            "fa4-fused": lambda: plan.attend(0, "fused", False, scale),
        }
        for name, fn in methods.items():  # compile and warm up
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            print(f"S_loc={S_loc} {name}: ready ({time.time() - t0:.1f} s)", flush=True)
        mine = plan.out_w[:, :, :, :H // P]

        def poison():
            for w in (plan.dq, plan.dk, plan.dv, plan.out_w):
                w.fill_(float("nan"))
            # rank 0 attends window 0's rows of every source rank: only its own rows are written
            for w in (plan.dq, plan.dk, plan.dv):
                w[0].zero_()

        times = time_graphs(methods, n_calls=args.calls, trials=args.trials, after_capture=poison)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(mine).all())
        med = {name: median(v) for name, v in times.items()}
        rows.append(dict(S_loc=S_loc, M=P * S_loc, median_us=med, trials_us=times, out_finite=finite))
        print(f"S_loc={S_loc}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + f"; finite={finite}",
              flush=True)

    card = torch.cuda.get_device_name()
    print(f"\n{card}, bf16, C={C}, H={H}, D={D}, emulated P={P} (source rank 0's work), CUDA-graph replay "
          f"medians (us) of {args.calls} calls, {args.trials} trials")
    print("| S_loc | M | unfused | attn-fused | block-fused | block-fused1 | attn-fused/unfused "
          "| block-fused/unfused | block-fused1/unfused | chain | pre-a2a | proj-fused | proj-fused1 "
          "| fa4+post | fa4-fused |")
    print("|---" * 15 + "|")
    for row in rows:
        m = row["median_us"]
        u = m["unfused"]
        print(f"| {row['S_loc']} | {row['M']} | {u:.1f} | {m['attn-fused']:.1f} | {m['block-fused']:.1f} "
              f"| {m['block-fused1']:.1f} | {m['attn-fused'] / u:.3f} | {m['block-fused'] / u:.3f} "
              f"| {m['block-fused1'] / u:.3f} | {m['chain']:.1f} | {m['pre-a2a']:.1f} | {m['proj-fused']:.1f} "
              f"| {m['proj-fused1']:.1f} | {m['fa4+post']:.1f} | {m['fa4-fused']:.1f} |")
    bad = [row["S_loc"] for row in rows if not row["out_finite"]]
    if bad:
        print(f"NON-FINITE out-windows after the replays at S_loc = {bad}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_block.json"), "w") as fh:
            json.dump(dict(card=card, P=P, H=H, D=D, C=C, dtype="bf16", calls=args.calls, trials=args.trials,
                           rows=rows), fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
