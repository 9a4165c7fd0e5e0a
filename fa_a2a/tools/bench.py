"""`python -m fa_a2a.bench`: steady-state sender-visible times of FA4 + Ulysses post-A2A vs M.

The methods are the rows of METHODS (fa_a2a.tools.bench_methods: the paper's Sec. 5.3 set, the baseline
users run today, and the Ulysses op itself); `--help` lists them. The derived metrics (E_res, the
hiding ratio, the speedups), the tables, plots and JSON: fa_a2a.tools.bench_report; the settings shared
with the whole-call benchmark: fa_a2a.tools.bench_config. Here: the command line, the timing of one
point, and main.

Timing (graphs.timing, the project's one timing loop): each method is captured as N back-to-back
calls in a CUDA graph; one timed replay is the N calls plus one cross-rank barrier (the paper's
sender-side boundary); per-call us = elapsed / N; per trial the max over ranks; median over
trials; method order rotated every trial; input sets rotated when they would fit in L2; SM clocks
logged through NVML. Then the same N calls eagerly (no graph, 3 trials): host wall time per call,
printed beside the graph time (GPU-bound when they agree).

Ranks: under `torchrun --nproc-per-node=N` the ranks are real and the benchmark times the whole
call instead (fa_a2a.tools.bench_call: FA4-local, pre-A2A, serial / fused / NCCL calls, the attention
block; one GPU per process, or N processes on one GPU under `python -m fa_a2a.mps`); `--per-kernel`
runs the methods below on real ranks instead (one GPU per process). In one
process, P ranks are emulated: the process runs rank 0's work only and its "remote" stores go to
P local windows; the other P-1 ranks' stores are never issued ("Op emulated" runs all P ranks'
work through fa_a2a.ulysses_attention_emulated). Methods that do not apply print "n/a (...)".

Destinations (--dest): hbm puts the windows in this GPU's memory; host puts them in pinned host
memory that the GPU's stores reach over PCIe (zero-copy under UVA): a one-GPU proxy for a slow
peer with the same mechanism (bursts, finite outstanding capacity, backpressure on the issuer)
but not NVLink's numbers. For each (M, destination) the Burst-Gap model of FA4's tile bursts
(fa_a2a.tools.xstage, platform from --platform) is printed beside the measured E_res and hiding ratio,
with the wave drain bound at the measured A2A-only rate (xstage.FaTiles.wave_drain_bound).
Without a GPU nothing is measured: the script prints the model's predictions and exits 0.
`--backward`: forward + backward of the op against FA4's instead (fa_a2a.tools.bench_backward).

Measured (one H200, 2026-12-03, bf16, D=128, H=24, emulated P=8, 3 trials; `-M 8192 16384 --dest
hbm host --platform <calibrate --dest host>`): windows in host memory, FA4 184.1 / 548.1 us, A2A-only
121.1 / 244.0 us (52 GB/s), serial 308.8 / 791.1, fused 295.1 / 774.2 (H 11% / 7%); the model
predicts E_res 46 / 92 us (a 16 us capacity stall per full wave + the last wave's drain), the wave
drain bound 221.9 / 624.4 us: the fused kernel waits for its stores far longer than either says.
Emulated op at M = 8192: graph 1599 us, eager wall 1713 us per call.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Optional, Sequence

from fa_a2a.tools.bench_config import (CALL_SEQLENS, DEFAULT_SEQLENS, DEFAULT_WORLD_SIZE, DESTS, DTYPES, EAGER_TRIALS,
                                 H200_FA4_TFLOPS, H200_NUM_SMS, QUICK_SEQLENS, BenchConfig, load_platform)
from fa_a2a.tools.bench_methods import BY_KEY, METHODS, _Point, not_applicable
from fa_a2a.tools.bench_report import (_finite, _first_line, _git_commit, _Log, _tiles, _versions, derive, format_eager,
                                 format_model, format_predictions, format_table, model_applies, model_row, window_dest,
                                 predictions, write_plots, write_result)
from fa_a2a.tools.cli import (MAX_HEADS, MAX_REPEATS, MAX_SEQLEN, MAX_WORLD_SIZE, check_out_dir, check_seqlens,
                               rank_from_env)
from fa_a2a.tools.xstage import US

EMULATION_NOTE = (
    "Emulated ranks: one process runs source rank 0's work for P={P} ranks; its stores to the "
    "{P} destination windows stay on this GPU or its host, and the other {Pm1} ranks' stores are never "
    "issued. NCCL methods need real ranks."
)
HOST_NOTE = (
    "--dest host: the windows are pinned host memory; the GPU's stores reach it over PCIe (UVA). A "
    "one-GPU proxy for a slow peer, not NVLink: its drain rate, capacity and latency are the PCIe path's."
)


# ----------------------------------------------------------------------------- command line
class _Parser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same arguments: only rank 0 prints a usage error (all exit 2)."""

    def error(self, message):
        if rank_from_env() != 0:
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fa_a2a.bench",
        description="CUDA-graph steady-state benchmark of FA4 + Ulysses post-A2A across sequence lengths M, "
        "windows in HBM or in pinned host memory, with the X-Stage Burst-Gap model beside the measurements.",
        epilog="Under torchrun the whole call is timed instead (fa_a2a.tools.bench_call; --per-kernel: these methods). "
        "methods: " + "; ".join(f"{m.key} = {m.what}" + {"real": " (torchrun --per-kernel only)",
                                                                  "emulated": " (emulated ranks only)"}.get(m.ranks, "")
                                        for m in METHODS),
    )
    p.add_argument("--seqlens", "-M", nargs="+", metavar="M", default=None,
                   help=f"full sequence lengths M (default {' '.join(map(str, DEFAULT_SEQLENS))}; "
                   f"--quick: {' '.join(map(str, QUICK_SEQLENS))})")
    p.add_argument("--heads", type=int, default=24, help="total heads H over all ranks (default 24)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--world-size", type=int, default=None,
                   help=f"ranks P (default {DEFAULT_WORLD_SIZE}, emulated on one GPU; under torchrun "
                   "the real world size)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--methods", nargs="+", choices=[m.key for m in METHODS], default=None,
                   help="subset of methods (default: all; listed below)")
    p.add_argument("--dest", nargs="+", choices=DESTS, default=None,
                   help="where the P output windows live: hbm (this GPU's memory, default) and/or host "
                   "(pinned host memory reached by the GPU's stores over PCIe: a one-GPU proxy for a slow "
                   "peer, NOT NVLink; emulated ranks only). Several: one row per M and destination")
    p.add_argument("--trials", type=int, default=None, help="timed replays per method (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed replays per method (default 3; quick 1)")
    p.add_argument("--calls", type=int, default=None,
                   help="calls per graph (default: enough for --target-ms per replay, 3..200)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="replay length that sets the default --calls (default 25; quick 5)")
    p.add_argument("--quick", action="store_true", help="M 8192 16384, 5 trials: under 2 minutes on one H200")
    p.add_argument("--out", default=os.path.join("results", "bench"), help="output folder for JSON and plots")
    p.add_argument("--platform", default=None,
                   help="platform model JSON (python -m fa_a2a.calibrate, of the destination measured) for "
                   "the Burst-Gap predictions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--num-sms", type=int, default=None,
                   help=f"SM count for the model without a GPU (default {H200_NUM_SMS}, H200)")
    p.add_argument("--fa-tflops", type=float, default=H200_FA4_TFLOPS,
                   help="FA throughput the no-GPU predictions assume (default: H200 measured)")
    p.add_argument("--mps-share", type=float, default=None, metavar="PERCENT",
                   help="the MPS thread percentage each rank runs with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). It "
                   "must be set before a process creates its CUDA context, so this flag only checks that the "
                   "environment says so and records it: set it for all ranks with `python -m fa_a2a.mps "
                   "--thread-percentage PERCENT -- torchrun ...`")
    p.add_argument("--backward", action="store_true",
                   help="forward + backward instead (fa_a2a.tools.bench_backward): FA4's forward with LSE + backward "
                   "on one rank's problem against the op's fwd+bwd (serial; NCCL on real ranks), per M, with the "
                   "ratios; emulated ranks in one process, or the real op under torchrun")
    p.add_argument("--out-proj", type=int, default=None, metavar="C_OUT",
                   help="with --backward: the attention block's output projection (H*D -> C_OUT) in both: FA4 + "
                   "torch's linear (forward and backward) against fa_a2a.ulysses_attention_out_proj, whose fused "
                   "backward takes dO from the projection's GEMM")
    p.add_argument("--joint", type=int, default=None, metavar="J",
                   help="with --backward: J joint (text) rows replicated on every rank, as Flux's 512 prompt tokens, "
                   "in both: FA4 on one rank's heads over M + J rows against the op with joint=(q, k, v) [B, J, H, D] "
                   "(their gradients too)")
    p.add_argument("--breakdown", action="store_true",
                   help="with --backward: after each M's timing, each method's kernel time per call by kind "
                   "(attention forward / backward kernels, FA4's pre/postprocess, GEMMs, A2A kernels, barriers, "
                   "copies, other; torch.profiler, rank 0's kernels on real ranks): a table and the JSON")
    p.add_argument("--per-kernel", action="store_true",
                   help="under torchrun (one GPU per process): the kernel methods above on real ranks instead of "
                   "the whole-call benchmark (fa_a2a.tools.bench_call)")
    return p


# Bounds of the numeric flags (a value outside is a usage error, exit 2, before torch is imported):
# the tools' shared maxima (fa_a2a.tools.cli), lower bounds where a tiny value breaks the model's arithmetic.
BOUNDS = {
    "--seqlens": (1, MAX_SEQLEN),
    "--heads": (1, MAX_HEADS),
    "--batch": (1, 1024),
    "--world-size": (1, MAX_WORLD_SIZE),
    "--trials": (1, MAX_REPEATS),
    "--warmup": (0, MAX_REPEATS),
    "--calls": (1, MAX_REPEATS),
    "--target-ms": (0.01, 60_000.0),
    "--num-sms": (1, 1024),
    "--fa-tflops": (0.01, 100_000.0),  # an H200's FA4 runs at ~690
    "--seed": (0, 2**31 - 1),
    "--mps-share": (1.0, 100.0),
    "--out-proj": (1, 1 << 16),
    "--joint": (1, 1 << 16),
}


def _bounded(value, name: str):
    """value if it is a finite number within BOUNDS[name], else ValueError naming the flag."""
    lo, hi = BOUNDS[name]
    kind = "an integer" if isinstance(lo, int) else "a number"
    if value is None or not (lo <= value <= hi) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name}: expected {kind} in [{lo:g}, {hi:g}], got {value!r}")
    return value


def make_config(ns: argparse.Namespace, env: Optional[dict] = None) -> BenchConfig:
    """Resolve defaults and validate. Raises ValueError naming the bad argument."""
    env = os.environ if env is None else env
    try:
        env_world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE: not an integer: {env.get('WORLD_SIZE')!r}") from None
    real = env_world > 1
    if real:
        if ns.world_size is not None and ns.world_size != env_world:
            raise ValueError(f"--world-size: {ns.world_size} differs from torchrun's WORLD_SIZE={env_world}")
        world = env_world
    else:
        world = DEFAULT_WORLD_SIZE if ns.world_size is None else ns.world_size
    _bounded(world, "--world-size")
    if ns.per_kernel and not real:
        raise ValueError("--per-kernel: expected torchrun with several processes (real ranks), got one process")
    whole_call = real and not ns.per_kernel
    if ns.seqlens:
        seqlens = tuple(ns.seqlens)
    else:
        seqlens = CALL_SEQLENS if whole_call else (QUICK_SEQLENS if ns.quick else DEFAULT_SEQLENS)
    seqlens = check_seqlens(seqlens, world, "the world size P")
    _bounded(ns.heads, "--heads")
    if ns.heads % world:
        raise ValueError(f"--heads: H={ns.heads} is not divisible by the world size P={world}")
    from cute_kernels.limits import HEAD_DIMS

    if ns.head_dim not in HEAD_DIMS:
        raise ValueError(f"--head-dim: the fused kernel supports {' and '.join(map(str, HEAD_DIMS))}, got {ns.head_dim!r}")
    _bounded(ns.batch, "--batch")
    if ns.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {ns.dtype!r}")
    trials = ns.trials if ns.trials is not None else (5 if ns.quick else 15)
    _bounded(trials, "--trials")
    warmup = _bounded(ns.warmup if ns.warmup is not None else (1 if ns.quick else 3), "--warmup")
    if ns.calls is not None:
        _bounded(ns.calls, "--calls")
    target_ms = ns.target_ms if ns.target_ms is not None else (5.0 if ns.quick else 25.0)
    _bounded(target_ms, "--target-ms")
    keys = [m.key for m in METHODS]
    if ns.methods and whole_call:
        raise ValueError("--methods: the whole-call benchmark under torchrun runs every method that applies; "
                         "--methods selects the kernel methods (one process, or torchrun with --per-kernel)")
    if ns.platform is not None and whole_call:
        raise ValueError("--platform: the whole-call benchmark under torchrun has no model column; the X-Stage "
                         "predictions are the per-kernel benchmark's (one process, or torchrun with --per-kernel)")
    check_out_dir(ns.out)
    methods = tuple(ns.methods) if ns.methods else tuple(keys)
    bad = [m for m in methods if m not in keys]
    if bad:
        raise ValueError(f"--methods: unknown {bad}; choose from {keys}")
    methods = tuple(k for k in keys if k in methods)  # canonical order
    dests = tuple(d for d in DESTS if d in (ns.dest or ("hbm",)))
    bad = [d for d in (ns.dest or ()) if d not in DESTS]
    if bad:
        raise ValueError(f"--dest: expected {' or '.join(DESTS)}, got {bad}")
    if real and "host" in dests:
        raise ValueError(f"--dest: host windows need emulated ranks (one process), got torchrun's "
                         f"WORLD_SIZE={env_world}")
    load_platform(ns.platform)  # bad contents are a usage error now, not a traceback later
    num_sms = ns.num_sms if ns.num_sms is not None else H200_NUM_SMS
    _bounded(num_sms, "--num-sms")
    _bounded(ns.fa_tflops, "--fa-tflops")
    _bounded(ns.seed, "--seed")
    mps_share = _mps_share(ns.mps_share, env)
    if ns.out_proj is not None:
        _bounded(ns.out_proj, "--out-proj")
        if not ns.backward:
            raise ValueError(f"--out-proj: only with --backward (the forward + backward benchmark), got {ns.out_proj}")
    if ns.joint is not None:
        _bounded(ns.joint, "--joint")
        if not ns.backward:
            raise ValueError(f"--joint: only with --backward (the forward + backward benchmark), got {ns.joint}")
        if ns.out_proj is not None:
            raise ValueError("--joint: not with --out-proj (ulysses_attention_out_proj takes no joint rows)")
        if ns.causal:
            raise ValueError("--joint: not with --causal (causal masking with joint rows is not defined)")
    if ns.breakdown and not ns.backward:
        raise ValueError("--breakdown: only with --backward (the forward + backward benchmark)")
    return BenchConfig(
        seqlens=seqlens, heads=ns.heads, head_dim=ns.head_dim, batch=ns.batch, world_size=world,
        real_ranks=real, dtype=ns.dtype, causal=ns.causal, trials=trials, warmup=warmup,
        calls=ns.calls, target_ms=target_ms, methods=methods, dests=dests, quick=ns.quick, out=ns.out,
        platform=ns.platform, seed=ns.seed, plots=not ns.no_plots, num_sms=num_sms,
        fa_tflops=ns.fa_tflops, mps_share=mps_share, per_kernel=ns.per_kernel, out_proj=ns.out_proj or 0,
        joint=ns.joint or 0, breakdown=ns.breakdown,
    )


def _mps_share(value: Optional[float], env) -> Optional[float]:
    """--mps-share checked against the environment the CUDA context is created from."""
    if value is None:
        return None
    _bounded(value, "--mps-share")
    have = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    try:
        same = have is not None and float(have) == value
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"--mps-share: {value:g} needs CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={value:g} in every rank's "
                         f"environment before its CUDA context exists, got {have!r}; run `python -m fa_a2a.mps "
                         f"--thread-percentage {value:g} -- torchrun ...`")
    return value


def parse_args(argv: Optional[Sequence[str]] = None, env: Optional[dict] = None) -> BenchConfig:
    return make_config(build_parser().parse_args(argv), env)


# ------------------------------------------------------------------------------ no GPU
def no_gpu(cfg: BenchConfig) -> int:
    """The Burst-Gap model's predictions without a GPU, printed by rank 0 (under torchrun the
    other ranks print nothing); nothing is written: not to --out, and FA4's tile table, which the
    model reads, is not kept in the compile cache (FA_A2A_CACHE=0 while it is read)."""
    if rank_from_env() != 0:
        return 0
    saved = os.environ.get("FA_A2A_CACHE")
    os.environ["FA_A2A_CACHE"] = "0"
    try:
        return _predict_without_gpu(cfg)
    finally:
        if saved is None:
            os.environ.pop("FA_A2A_CACHE", None)
        else:
            os.environ["FA_A2A_CACHE"] = saved


def _predict_without_gpu(cfg: BenchConfig) -> int:
    print("No CUDA GPU: nothing was measured (the benchmark needs an SM90 GPU; run it there, or under "
          "torchrun --nproc-per-node=N for N GPUs).")
    model, source = load_platform(cfg.platform)
    sigma = _tiles(cfg, cfg.seqlens[0], cfg.num_sms).sigma_from_flops(cfg.fa_tflops * 1e12) / US
    print(f"Sizes: B={cfg.batch}, H={cfg.heads} over P={cfg.world_size} (H_loc={cfg.heads_local}), "
          f"D={cfg.head_dim}, {cfg.dtype}{', causal' if cfg.causal else ''}; FA at {cfg.fa_tflops:g} TFLOP/s "
          f"on {cfg.num_sms} SMs.")
    if "host" in cfg.dests:
        print(HOST_NOTE + (" The model below is of another path: give --platform of a host calibration."
                           if not model_applies(model, "host") or cfg.platform is None else ""))
    other = [window_dest(cfg, d) for d in cfg.dests if not model_applies(model, window_dest(cfg, d))]
    if cfg.platform is not None and other:
        print(f"Note: the model ({source}) measured windows in {model.meta.get('dest')}, not in "
              f"{' and '.join(other)}: its predictions below do not describe those (give --platform of their "
              "calibration).")
    print(format_predictions(predictions(cfg, model, sigma, cfg.num_sms), source))
    print(f"Nothing written to {cfg.out} (only measurements are written), nor to the compile cache.")
    return 0


# ------------------------------------------------------------------------------ one point
def run_point(cfg: BenchConfig, M: int, dest: str, ctx: dict, log: _Log, bar=None) -> dict:
    from graphs import (GpuClockMonitor, calls_for, capture, input_sets_needed, median, rank_max, round_up,
                        time_eager, time_graphs)

    import torch

    P, B, D, H_loc = cfg.world_size, cfg.batch, cfg.head_dim, cfg.heads_local
    status = {}
    for key in cfg.methods:
        why = not_applicable(BY_KEY[key], cfg.real_ranks, dest)
        if why is not None:
            status[key] = why

    es = DTYPES[cfg.dtype]
    x_bytes = B * M * H_loc * D * es
    # per call: q, k, v read, O written (plus O read and written once more by serial)
    n_sets = input_sets_needed(5 * x_bytes, ctx["l2_bytes"])
    gen = torch.Generator(device=ctx["device"])
    gen.manual_seed(cfg.seed * 1_000_003 + M)
    pt = _Point(cfg, M, dest, ctx, gen)
    sets = [{"i": i, **{n: pt.randn(B, M, H_loc, D) for n in ("q", "k", "v", "o_in")}} for i in range(n_sets)]

    calls, outputs = {}, {}
    for key in cfg.methods:
        if key in status:
            continue
        try:
            built = [BY_KEY[key].build(pt, s) for s in sets]
            calls[key], outputs[key] = [c for c, _ in built], [o for _, o in built]
        except Exception as e:
            status[key] = f"skipped ({_first_line(e)})"

    # First eager call of each method (compiles; a method that fails is skipped), a rough time
    # that sets the calls per graph, and a trial capture so that one method that cannot be
    # captured does not end the run. All ranks keep the same methods (graphs hold collectives).
    est = {}
    for key in list(calls):
        try:
            for f in calls[key]:
                f()
            torch.cuda.synchronize()
            try:
                del_me = capture(calls[key], len(calls[key]), eager_warmup=0)
                del del_me
            except Exception as e:
                raise RuntimeError(f"not graph-capturable: {_first_line(e)}") from e
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            calls[key][0]()
            t1.record()
            t1.synchronize()
            est[key] = t0.elapsed_time(t1) * 1e3
        except Exception as e:
            status[key] = f"skipped ({_first_line(e)})"
    failed = rank_max(torch.tensor([1.0 if m.key in status else 0.0 for m in METHODS]), ctx["group"])
    for j, m in enumerate(METHODS):
        if failed[j] > 0 and m.key not in status:
            status[m.key] = "skipped (failed on another rank)"
    for key in list(calls):
        if key in status:
            calls.pop(key)
            outputs.pop(key)
    for key, why in status.items():
        if key in cfg.methods and not why.startswith("n/a"):
            log(f"  {BY_KEY[key].label} ({dest}): {why}", once=f"{key}:{dest}:{why}")

    point = {"M": M, "dest": dest, "S_loc": M // P, "H_loc": H_loc, "input_sets": n_sets, "n_calls": None,
             "raw_us": {}, "median_us": {}, "eager_raw_us": {}, "eager_us": {}, "status": status, "finite": {},
             "clocks": {}, "auto": None}
    if "op_emulated_auto" in calls or "layer_auto" in calls:  # decided at its first call, above
        from fa_a2a.engine.autotune import decision_text

        point["auto"] = decision_text("ulysses_attention", M // P)
        log(f"  M={M} ({dest}): impl='auto': {point['auto']}")
    if not calls:
        point["derived"] = derive({})
        return point

    if cfg.calls is not None:
        n_calls = cfg.calls
    else:
        t_est = max(est.values())
        n_calls = calls_for(t_est, cfg.target_ms)
    n_calls = round_up(n_calls, n_sets)
    n_calls = int(rank_max(torch.tensor([float(n_calls)]), ctx["group"])[0])
    point["n_calls"] = n_calls

    def poison():  # after capture, so the finite check below sees what the replays wrote
        for outs in outputs.values():
            for t in outs:
                if t is not None:
                    t.fill_(float("nan"))

    monitor = GpuClockMonitor(ctx["device"])
    if bar is not None:
        bar.set_description(f"M={M} {dest}")

    def progress(name, trial):
        if bar is not None:
            bar.update(1)

    names = list(calls)
    raw = time_graphs({m: calls[m] for m in names}, n_calls, cfg.trials, cfg.warmup,
                      barrier=ctx["barrier"], group=ctx["group"], monitor=monitor, progress=progress,
                      after_capture=poison)
    torch.cuda.synchronize()
    mine = []
    for key in names:
        ok = True
        for f, t in zip(calls[key], outputs[key]):
            if t is None:
                t = f()
                torch.cuda.synchronize()
            ok = ok and _finite(t)
        mine.append(0.0 if ok else 1.0)
    # one verdict for every rank: rank 0 reports, and the eager timing's collectives need the same methods
    bad = rank_max(torch.tensor(mine, dtype=torch.float64), ctx["group"]) if names else []
    for key, b in zip(names, bad):
        point["finite"][key] = ok = bool(b == 0)
        if not ok:
            status[key] = "non-finite output"
            log(f"  {BY_KEY[key].label} at M={M} ({dest}): output has NaN/Inf after the run (on some rank); its "
                "time is not reported")
    point["raw_us"] = raw
    point["median_us"] = {m: median(raw[m]) for m in names if point["finite"][m]}
    eager = time_eager({m: calls[m] for m in point["median_us"]}, n_calls, EAGER_TRIALS,
                       barrier=ctx["barrier"], group=ctx["group"]) if point["median_us"] else {}
    point["eager_raw_us"] = eager
    point["eager_us"] = {m: median(v) for m, v in eager.items()}
    point["clocks"] = monitor.summary()
    point["clock_warnings"] = list(monitor.warnings)
    point["derived"] = derive(point["median_us"], {m: raw[m] for m in point["median_us"]})
    del sets, calls, outputs, pt
    return point


# ------------------------------------------------------------------------------ main (GPU)
def _setup_distributed(cfg: BenchConfig) -> dict:
    import torch
    import torch.distributed as dist

    if not cfg.real_ranks:
        torch.cuda.set_device(0)
        return {"rank": 0, "group": None, "device": torch.device("cuda", 0), "barrier": None,
                "barrier_kind": "none (emulated ranks: no other rank to wait for)"}
    local = int(os.environ.get("LOCAL_RANK", "0"))
    n_local = int(os.environ.get("LOCAL_WORLD_SIZE", str(cfg.world_size)))
    if torch.cuda.device_count() < n_local:
        raise SystemExit(f"--per-kernel: {n_local} processes per node but {torch.cuda.device_count()} GPUs: "
                         "the NCCL methods need one GPU per process. Without --per-kernel the whole-call "
                         "benchmark runs ranks that share a GPU (under python -m fa_a2a.mps).")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
    group = dist.group.WORLD
    # The in-stream barrier kernel of the peer windows (what the fused path uses). Its set-up is
    # agreed across ranks: a failure raises TransportSetupError on every rank (no rank falls back
    # to another barrier while the others wait in this one).
    from ulysses.transport import get_transport

    barrier = get_transport(group).barrier
    return {"rank": dist.get_rank(), "group": group, "device": dev, "barrier": barrier,
            "barrier_kind": "ulysses.transport barrier kernel"}


def run_gpu(cfg: BenchConfig) -> int:
    import torch

    from graphs import GpuClockMonitor, l2_cache_bytes

    ctx = _setup_distributed(cfg)
    log = _Log(ctx["rank"])
    dev = ctx["device"]
    props = torch.cuda.get_device_properties(dev)
    ctx["l2_bytes"] = l2_cache_bytes(dev)
    torch.manual_seed(cfg.seed + ctx["rank"])
    log(f"fa_a2a.tools.bench on {props.name} ({props.multi_processor_count} SMs): B={cfg.batch}, H={cfg.heads}, "
        f"D={cfg.head_dim}, P={cfg.world_size}, H_loc={cfg.heads_local}, {cfg.dtype}"
        f"{', causal' if cfg.causal else ''}; M={list(cfg.seqlens)}; windows in {'/'.join(cfg.dests)}; "
        f"{cfg.trials} trials, {cfg.warmup} warm-up")
    if cfg.real_ranks:
        log(f"Real ranks: {cfg.world_size} processes, one GPU each; per-trial time = max over ranks; "
            f"barrier: {ctx['barrier_kind']}.")
    else:
        log(EMULATION_NOTE.format(P=cfg.world_size, Pm1=cfg.world_size - 1))
    if "host" in cfg.dests:
        log(HOST_NOTE)

    env_monitor = GpuClockMonitor(dev)
    env_monitor.sample("start")
    result = {"config": dataclasses.asdict(cfg), "env": {
        "card": props.name, "sm_count": props.multi_processor_count, "l2_bytes": ctx["l2_bytes"],
        "capability": f"{props.major}.{props.minor}", "versions": _versions(), "git_commit": _git_commit(),
        "nvml": env_monitor.device_info(), "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "emulated": not cfg.real_ranks, "barrier": ctx["barrier_kind"],
        "emulation_note": None if cfg.real_ranks else EMULATION_NOTE.format(P=cfg.world_size, Pm1=cfg.world_size - 1),
        "host_note": HOST_NOTE if "host" in cfg.dests else None,
        "methods": {m.key: {"label": m.label, "what": m.what, "ranks": m.ranks} for m in METHODS},
        "timing": "CUDA-graph replay of n_calls back-to-back calls + one barrier, per-call us; per trial max over "
                  "ranks; median over trials; method order rotated per trial. eager_us: host wall time per call "
                  f"of the same calls without a graph, median of {EAGER_TRIALS}",
        "points": []}
    result["config"]["seqlens"] = list(cfg.seqlens)

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    n_run = sum(not_applicable(BY_KEY[k], cfg.real_ranks, d) is None for k in cfg.methods for d in cfg.dests)
    bar = None
    if tqdm is not None and ctx["rank"] == 0:
        bar = tqdm(total=len(cfg.seqlens) * cfg.trials * n_run, unit="replay", file=sys.stderr)
    log.bar = bar
    for M in cfg.seqlens:
        for dest in cfg.dests:
            result["points"].append(run_point(cfg, M, dest, ctx, log, bar))
            torch.cuda.empty_cache()
        if cfg.real_ranks:  # a barrier that timed out makes this M's numbers wrong and the transport unusable
            from ulysses.transport import get_transport

            get_transport(ctx["group"]).check()
    if bar is not None:
        bar.close()
    log.bar = None
    env_monitor.sample("end")
    result["env"]["clocks"] = env_monitor.summary()
    result["env"]["clock_samples"] = env_monitor.samples

    n_sm = props.multi_processor_count
    model, source = (load_platform(cfg.platform) if cfg.platform is not None else (None, None))
    result["model"] = {"source": source, "rows": [r for p in result["points"]
                                                  if (r := model_row(p, cfg, model, n_sm)) is not None]}
    m_ub = None
    big = [p for p in result["points"] if "fa" in p["median_us"]]
    if model is not None and big:
        p = max(big, key=lambda p: p["M"])
        t = _tiles(cfg, p["M"], n_sm)
        m_ub = model.fa_min_seqlen(t.volume, t.sigma_from_time(p["median_us"]["fa"] * US), t.tile_n)
        result["model"]["m_ub"] = m_ub

    if ctx["rank"] == 0:
        files = write_result(cfg, "bench.json", result, lambda out: write_plots(result, out, m_ub), log)
        for w in [w for p in result["points"] for w in p.get("clock_warnings", [])]:
            log(f"warning: {w}")
        log("Wrote " + ", ".join(files))
        log("")
        log(f"{props.name}, {cfg.dtype}, D={cfg.head_dim}, H={cfg.heads}, P={cfg.world_size}"
            f"{' emulated' if not cfg.real_ranks else ''}, B={cfg.batch}"
            f"{', causal' if cfg.causal else ''}: per-call median (us) of CUDA-graph replays")
        log(format_table(result["points"], cfg.methods))
        log("")
        log(format_eager(result["points"]))
        if result["model"]["rows"]:
            log("")
            log(format_model(result["model"]["rows"], source))
    if cfg.real_ranks:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.backward:
            from fa_a2a.tools.bench_backward import check_args

            check_args(ns)
        cfg = make_config(ns)
    except ValueError as e:
        parser.error(str(e))
    import torch  # after the arguments: a bad flag is refused without loading torch

    if ns.backward:
        from fa_a2a.tools.bench_backward import run

        return run(cfg, torch.cuda.is_available())
    if not torch.cuda.is_available():
        return no_gpu(cfg)
    if cfg.whole_call:
        from fa_a2a.tools.bench_call import run_calls

        return run_calls(cfg)
    return run_gpu(cfg)


if __name__ == "__main__":
    sys.exit(main())
