"""Cost of the pre-A2A in the QKV projection's epilogue: T(fused projection + pre-A2A) on one GPU.

One source rank (rank 3 of P, emulated: the P destination windows are local buffers in one
allocation at a uniform stride) projects x [1, S_loc, C] with W [N = 3*H*D, C] (Flux: C = 3072,
H = 24, D = 128, N = 9216, bf16, P = 8). Methods, each captured as back-to-back calls in a CUDA
graph and timed by graph replays (graphs.time_graphs, medians over trials):
  fused      q|k|v + bias, one launch, stored into the P rank windows
  plain      quack's own GEMM, same tile configuration, plain output [1, S_loc, N]
  plain+copy plain, then one copy of its output into the windows (the unfused local equivalent)
  fused-nr   q|k with bias + per-head RMSNorm + RoPE (one launch), v with bias (one launch)
  plain-nr   the same two quack GEMMs with plain outputs
  fused-nr1  / plain-nr1: the same in one launch (one_launch=True: v passed through the epilogue)
  matmul     torch.matmul(x, W^T) (cuBLAS), and linear: torch.nn.functional.linear with bias
W alone (57 MB) exceeds the 50 MB L2, so one input set is used. Optional extra tile
configurations (--configs) are timed for fused/plain at every shape.

--dest host puts the P windows in pinned host memory (the one-GPU proxy of a slow peer: the
epilogue's stores reach them over PCIe; issue 24's question whether the pre-A2A's stores, 3/4 of
the traffic, queue on a slow link as FA4's O bursts did). Then also timed: copy (the windows'
bytes alone, the link's time) and plain-nr+copy (the unfused chain of fused-nr), and printed per
S_loc the hiding H = 1 - (fused - plain) / (plain+copy - plain) of the projection's stores.
--paced-gbps R ... adds fused / fused-nr with their stores paced at R GB/s (p<R>) and as
fa_a2a.engine.pacing's automatic rule decides from the windows' link, measured as the op measures it
(pauto; the decision is printed), and their H.

    python examples/qkv_speed.py [--seqlens 576 1024 4096] [--configs 192x128c1x2] [--out DIR]
        [--dest hbm|host] [--paced-gbps 40 44 48] [--start-after FILE]   (--start-after: compile
        and warm up, then wait for FILE before timing)
"""

import argparse
import json
import math
import os
import re
import time

from fa_a2a.tools.cli import add_block_shape_args, check_seqlens, no_gpu


def tile_config(text):
    """argparse type: '192x128c1x2' (pingpong) or '128x192c2x1coop' -> (text, GemmConfig's fields)."""
    m = re.fullmatch(r"(\d+)x(\d+)c(\d+)x(\d+)(coop)?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a tile configuration such as 192x128c1x2 or 128x192c2x1coop, "
                                         f"got {text!r}")
    return text, (*(int(g) for g in m.groups()[:4]), m.group(5) is None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_block_shape_args(ap)
    ap.add_argument("--configs", type=tile_config, nargs="*", default=[tile_config("192x128c1x2"), tile_config("128x128c2x1")])
    ap.add_argument("--dest", choices=("hbm", "host"), default="hbm",
                    help="where the P rank windows live: this GPU's memory, or pinned host memory (a slow link)")
    ap.add_argument("--paced-gbps", type=float, nargs="*", default=[],
                    help="also time fused and fused-nr with their stores paced at these GB/s, and as "
                         "pace='auto' decides")
    ap.add_argument("--start-after", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if any(not 0 < r <= 1e6 for r in args.paced_gbps):
        ap.error(f"--paced-gbps: rates in (0, 1e6] GB/s expected, got {args.paced_gbps}")
    if args.heads % args.world_size:
        ap.error(f"--heads: a multiple of --world-size {args.world_size} expected, got {args.heads}")
    try:
        check_seqlens(args.seqlens)
    except ValueError as e:
        ap.error(str(e))
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # a bad flag is refused before torch and the kernels load

import torch  # noqa: E402

from cute_kernels import qkv_a2a_sm90 as K  # noqa: E402
from fa_a2a.block import rotary_pair  # noqa: E402
from graphs import median, time_graphs  # noqa: E402


_PINNED = []  # host memory behind --dest host windows: alive as long as the process


def windows_for(P, S_loc, heads, D, dtype, dest="hbm"):
    """The op's in-window layout: per window q | k | v contiguous, P windows at one stride; in HBM,
    or in pinned host memory the GPU stores into over PCIe (dest="host")."""
    N = P * S_loc
    per = N * heads * D
    if dest == "host":
        from ulysses.transport import pinned_on_device

        mem, host = pinned_on_device(P * 3 * per, dtype, torch.device("cuda", torch.cuda.current_device()))
        _PINNED.append(host.zero_())
        mem = mem.view(P, 3 * per)
    else:
        mem = torch.zeros(P, 3 * per, dtype=dtype, device="cuda")
    return [mem[:, t * per:(t + 1) * per].unflatten(1, (1, N, heads, D)) for t in range(3)]


NAN = float("nan")


def hiding(medians, fused, plain, chain):
    """H = 1 - (fused - plain) / (chain - plain) of the named medians (nan where one is missing)."""
    get = lambda k: medians.get(k, NAN)  # noqa: E731
    return 1 - (get(fused) - get(plain)) / (get(chain) - get(plain))


def measured_link(P, dtype, dest):
    """GB/s of the post-A2A kernel alone into P windows in `dest` (fa_a2a.engine.pacing.measure_store_rate
    of LINK_PROBE_BYTES, as the op measures a transport's link)."""
    from fa_a2a.engine.pacing import measure_store_rate, probe_shape

    shape = (P, *probe_shape(P))
    numel = math.prod(shape)
    if dest == "host":
        from ulysses.transport import pinned_on_device

        mem, host = pinned_on_device(numel, dtype, torch.device("cuda", torch.cuda.current_device()))
        _PINNED.append(host)
    else:
        mem = torch.empty(numel, dtype=dtype, device="cuda")
    return measure_store_rate(mem.view(shape), min(3, P - 1))


def main(args):
    if not torch.cuda.is_available():
        raise SystemExit(no_gpu("examples/qkv_speed.py", "the projection's timing"))
    P, H, D, C, dtype = args.world_size, args.heads, args.head_dim, args.hidden, torch.bfloat16
    rank = min(3, P - 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    wq, wk, wv = ((r(H * D, C) / C ** 0.5).to(dtype) for _ in range(3))
    bq, bk, bv = ((0.1 * r(H * D)).to(dtype) for _ in range(3))
    plain_w = K.QKVWeights.from_linear(wq, wk, wv, head_dim=D, world_size=P, bq=bq, bk=bk, bv=bv)
    norm_w = K.QKVWeights.from_linear(wq, wk, wv, head_dim=D, world_size=P, bq=bq, bk=bk, bv=bv,
                                      q_norm_weight=r(D) * 0.2 + 1, k_norm_weight=r(D) * 0.2 + 1)
    weight_t = plain_w.weight.t()
    configs = {"default": None, **{text: K.GemmConfig(*fields) for text, fields in args.configs}}
    link = measured_link(P, dtype, args.dest) if args.paced_gbps else None
    decisions = {}

    def methods_for(S_loc):
        """The timed callables of one shape (their own tensors: closures bind this call's locals)."""
        x = r(1, S_loc, C).to(dtype)
        cs = K.interleaved_cos_sin(*rotary_pair(torch.arange(rank * S_loc, (rank + 1) * S_loc, device="cuda"), D))
        win = windows_for(P, S_loc, H // P, D, dtype, args.dest)
        y = torch.empty(1, S_loc, 3 * H * D, dtype=dtype, device="cuda")
        row0 = rank * S_loc
        view = K.rank_window_view(win, row0, 0, S_loc)
        y5 = y.view(1, S_loc, 3, P, H // P * D)
        methods = {}
        for name, cfg in configs.items():
            tag = "" if cfg is None else f"@{name}"
            methods["fused" + tag] = lambda cfg=cfg: K.qkv_a2a_projection(x, plain_w, win, row0, config=cfg)
            methods["plain" + tag] = lambda cfg=cfg: K.qkv_projection_plain(x, plain_w, y, config=cfg)
            methods["fused-nr" + tag] = lambda cfg=cfg: K.qkv_a2a_projection(
                x, norm_w, win, row0, rope_cs=cs, config=cfg)
            methods["plain-nr" + tag] = lambda cfg=cfg: K.qkv_projection_plain(
                x, norm_w, y, rope_cs=cs, config=cfg)
            methods["fused-nr1" + tag] = lambda cfg=cfg: K.qkv_a2a_projection(
                x, norm_w, win, row0, rope_cs=cs, config=cfg, one_launch=True)
            methods["plain-nr1" + tag] = lambda cfg=cfg: K.qkv_projection_plain(
                x, norm_w, y, rope_cs=cs, config=cfg, one_launch=True)
        methods["plain+copy"] = lambda: (K.qkv_projection_plain(x, plain_w, y), view.copy_(y5))
        if args.dest == "host":
            methods["copy"] = lambda: view.copy_(y5)
            methods["plain-nr+copy"] = lambda: (K.qkv_projection_plain(x, norm_w, y, rope_cs=cs), view.copy_(y5))
        if args.paced_gbps:
            from fa_a2a.engine.pacing import decide_projection, projection_pacer, Pacing

            d = decisions[S_loc] = decide_projection(link, S_loc * 3 * H * D * x.element_size(),
                                                     2.0 * S_loc * C * 3 * H * D)
            rates = {f"p{r:g}": Pacing(r, "given") for r in args.paced_gbps}
            if d.rate_gbps is not None:
                rates["pauto"] = d
            for tag, decision in rates.items():
                pacers = [projection_pacer(decision, x.device) for _ in range(2)]
                methods[f"fused-{tag}"] = lambda p=pacers[0]: K.qkv_a2a_projection(x, plain_w, win, row0, pacer=p)
                methods[f"fused-nr-{tag}"] = lambda p=pacers[1]: K.qkv_a2a_projection(
                    x, norm_w, win, row0, rope_cs=cs, pacer=p)
        methods["matmul"] = lambda: torch.matmul(x, weight_t)
        methods["linear"] = lambda: torch.nn.functional.linear(x, plain_w.weight, plain_w.bias)
        return methods

    plans = []
    for S_loc in args.seqlens:
        ok = {}
        for name, fn in methods_for(S_loc).items():  # compile and warm up before any timing
            try:
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                ok[name] = fn
                print(f"S_loc={S_loc} {name}: ready ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001  (a tile configuration quack refuses is reported, not fatal)
                print(f"S_loc={S_loc} {name}: FAILED {type(e).__name__}: {e}", flush=True)
        plans.append((S_loc, ok))

    if args.start_after:
        t0 = time.time()
        while not os.path.exists(args.start_after) and time.time() - t0 < 600:
            time.sleep(0.5)

    rows = []
    for S_loc, methods in plans:
        times = time_graphs(methods, n_calls=args.calls, trials=args.trials)
        med = {name: median(v) for name, v in times.items()}
        flops = 2 * S_loc * C * 3 * H * D
        rows.append(dict(S_loc=S_loc, median_us=med, trials_us=times,
                         tflops={n: flops / t / 1e6 for n, t in med.items()}))
        print(f"S_loc={S_loc}: " + ", ".join(f"{n} {t:.1f}" for n, t in med.items()), flush=True)

    card = torch.cuda.get_device_name()
    if args.paced_gbps:
        print(f"\nlink (the post-A2A kernel alone into {args.dest} windows, as fa_a2a.engine.pacing measures it): "
              f"{link:.1f} GB/s")
        for S_loc, d in decisions.items():
            print(f"S_loc {S_loc}: pace='auto': {d.reason}")
        print("\n| S_loc | variant | fused | H | fused-nr | H nr |")
        print("|---" * 6 + "|")
        for row in rows:
            m = row["median_us"]
            for tag in ["", *sorted({k[len("fused-"):] for k in m if k.startswith("fused-p")})]:
                f, fn = ("fused" + (f"-{tag}" if tag else ""), "fused-nr" + (f"-{tag}" if tag else ""))
                print(f"| {row['S_loc']} | {tag or 'unpaced'} | {m.get(f, NAN):.1f} "
                      f"| {hiding(m, f, 'plain', 'plain+copy'):.0%} | {m.get(fn, NAN):.1f} "
                      f"| {hiding(m, fn, 'plain-nr', 'plain-nr+copy'):.0%} |")
    print(f"\n{card}, bf16, C={C}, N={3 * H * D}, H={H}, D={D}, emulated P={P} (rank {rank}), windows in "
          f"{args.dest}, CUDA-graph replay medians (us) of {args.calls} calls, {args.trials} trials")
    if args.dest == "host":
        print("\nthe projection's stores over the slow link: H = 1 - (fused - plain) / (plain+copy - plain)")
        print("| S_loc | plain | copy | plain+copy | fused | H | plain-nr | plain-nr+copy | fused-nr | H nr |")
        print("|---" * 10 + "|")
        for row in rows:
            m = row["median_us"]
            cells = [f"{m.get(k, NAN):.1f}" for k in ("plain", "copy", "plain+copy", "fused")]
            cells += [f"{hiding(m, 'fused', 'plain', 'plain+copy'):.0%}"]
            cells += [f"{m.get(k, NAN):.1f}" for k in ("plain-nr", "plain-nr+copy", "fused-nr")]
            cells += [f"{hiding(m, 'fused-nr', 'plain-nr', 'plain-nr+copy'):.0%}"]
            print(f"| {row['S_loc']} | " + " | ".join(cells) + " |")
    for name in configs:
        tag = "" if name == "default" else f"@{name}"
        print(f"\nconfig {name}")
        print("| S_loc | fused | plain | fused/plain | plain+copy | fused-nr | plain-nr | fused-nr/plain-nr "
              "| fused-nr1 | plain-nr1 | fused-nr1/plain-nr1 | matmul | fused/matmul | fused-nr1/matmul "
              "| linear |")
        print("|---" * 15 + "|")
        for row in rows:
            m = row["median_us"]
            get = lambda k: m.get(k, float("nan"))  # noqa: E731
            f, p, fn, pn, f1, p1, mm = (get(k) for k in (
                "fused" + tag, "plain" + tag, "fused-nr" + tag, "plain-nr" + tag, "fused-nr1" + tag,
                "plain-nr1" + tag, "matmul"))
            print(f"| {row['S_loc']} | {f:.1f} | {p:.1f} | {f / p:.3f} | {get('plain+copy'):.1f} | {fn:.1f} "
                  f"| {pn:.1f} | {fn / pn:.3f} | {f1:.1f} | {p1:.1f} | {f1 / p1:.3f} | {mm:.1f} "
                  f"| {f / mm:.3f} | {f1 / mm:.3f} | {get('linear'):.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "qkv_speed.json"), "w") as fh:
            json.dump(dict(card=card, P=P, H=H, D=D, C=C, dest=args.dest, configs=list(configs), rows=rows), fh,
                      indent=1)


if __name__ == "__main__":
    main(ARGS)
