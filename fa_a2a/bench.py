"""`python -m fa_a2a.bench`: steady-state sender-visible times of FA4 + Ulysses post-A2A vs M.

Methods (the paper's Sec. 5.3 set plus the baseline users run today):
  fa           FA4-only: fa_a2a.fused.fa4_forward on q, k, v [B, M, H_loc, D]
  a2a          A2A-only: our post-A2A kernel alone, fa_a2a.op.post_a2a(o, out_windows, rank)
  a2a_nccl     A2A-only, NCCL: permute + all_to_all_single + permute (real ranks only)
  serial       FA4, then our post-A2A
  serial_nccl  FA4, then permute + all_to_all_single (yunchang / xDiT / DeepSpeed; real ranks only)
  fused        FA4 with the post-A2A in its epilogue: fa_a2a.fused.fa4_a2a_forward
  layer_fused  whole Ulysses layer (pre-A2A + attention + post-A2A), impl="fused" (real ranks only)
  layer_nccl   the same layer with impl="nccl" (real ranks only)
Derived (from unrounded medians): E_res = T_fused - T_FA, hiding ratio
H = 1 - (T_fused - T_FA) / (T_serial - T_FA), speedup T_serial / T_fused, and T_fused / T_FA.

Timing (graphs.timing): each method is captured as N back-to-back calls in a CUDA graph; one
timed replay is the N calls plus one cross-rank barrier (the paper's sender-side boundary);
per-call us = elapsed / N; per trial the max over ranks; median over trials; method order rotated
every trial; input sets rotated when they would fit in L2; SM clocks logged through NVML.

Ranks: under `torchrun --nproc-per-node=N` (one GPU per process) the ranks are real. In one
process, P ranks are emulated: the process runs rank 0's work only and its "remote" stores go to
P local windows in HBM; the other P-1 ranks' stores are never issued. NCCL methods then print
"n/a (needs real ranks)". Without a GPU nothing is measured: the script prints the Burst-Gap
model's predictions (fa_a2a.xstage) and exits 0.

Methods whose functions do not exist yet (or fail on their first call) are skipped with the
reason printed; no number is printed that was not measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

DEFAULT_SEQLENS = (8192, 16384, 32768, 49152, 65536)
QUICK_SEQLENS = (8192, 16384)
DEFAULT_WORLD_SIZE = 8
# (key, table label, needs real ranks)
METHODS = (
    ("fa", "FA4-only", False),
    ("a2a", "A2A-only", False),
    ("a2a_nccl", "A2A-only NCCL", True),
    ("serial", "Serial", False),
    ("serial_nccl", "Serial-NCCL", True),
    ("fused", "Fused", False),
    ("layer_fused", "Layer fused", True),
    ("layer_nccl", "Layer NCCL", True),
)
METHOD_KEYS = tuple(k for k, _, _ in METHODS)
LABELS = {k: label for k, label, _ in METHODS}
NEEDS_REAL = {k for k, _, real in METHODS if real}
NA_REAL = "n/a (needs real ranks)"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The paper's calibration of its 8xB200 node (K=148 producers, 32 KB bursts): used for the
# no-GPU predictions when --platform is not given. Not a measurement of this machine.
PAPER_PLATFORM = {"t_iss0_us": 0.76, "drain_rate_GBps": 717.0, "capacity_MiB": 4.25}
# FA4 SM90 forward throughput measured on an H200 (bf16, D=128, non-causal, 16K-64K; DESIGN.md,
# 2026-12-02): the no-GPU predictions turn it into the Q-loop time per KV tile.
H200_FA4_TFLOPS = 690.0
H200_NUM_SMS = 132

EMULATION_NOTE = (
    "Emulated ranks: one process runs source rank 0's work for P={P} ranks; its stores to the "
    "{P} destination windows are local HBM stores, and the other {Pm1} ranks' stores are never "
    "issued. NCCL methods need real ranks."
)


# ----------------------------------------------------------------------------------- config
@dataclasses.dataclass
class BenchConfig:
    seqlens: tuple
    heads: int
    head_dim: int
    batch: int
    world_size: int
    real_ranks: bool
    dtype: str
    causal: bool
    trials: int
    warmup: int
    calls: Optional[int]
    target_ms: float
    methods: tuple
    quick: bool
    out: str
    platform: Optional[str]
    seed: int
    plots: bool
    num_sms: int
    fa_tflops: float

    @property
    def heads_local(self) -> int:
        return self.heads // self.world_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fa_a2a.bench",
        description="CUDA-graph steady-state benchmark of FA4 + Ulysses post-A2A: FA-only, A2A-only, "
        "serial, NCCL serial, fused, across sequence lengths M.",
    )
    p.add_argument("--seqlens", "-M", type=int, nargs="+", default=None,
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
    p.add_argument("--methods", nargs="+", choices=METHOD_KEYS, default=None,
                   help="subset of methods (default: all)")
    p.add_argument("--trials", type=int, default=None, help="timed replays per method (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed replays per method (default 3; quick 1)")
    p.add_argument("--calls", type=int, default=None,
                   help="calls per graph (default: enough for --target-ms per replay, 3..200)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="replay length that sets the default --calls (default 25; quick 5)")
    p.add_argument("--quick", action="store_true", help="M 8192 16384, 5 trials: under 2 minutes on one H200")
    p.add_argument("--out", default=os.path.join("results", "bench"), help="output folder for JSON and plots")
    p.add_argument("--platform", default=None,
                   help="platform model JSON (python -m fa_a2a.calibrate) for the M_ub* line and predictions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--num-sms", type=int, default=None,
                   help=f"SM count for the model without a GPU (default {H200_NUM_SMS}, H200)")
    p.add_argument("--fa-tflops", type=float, default=H200_FA4_TFLOPS,
                   help="FA throughput the no-GPU predictions assume (default: H200 measured)")
    return p


def _positive(value, name: str) -> int:
    if value is None or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
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
    _positive(world, "--world-size")
    seqlens = tuple(ns.seqlens) if ns.seqlens else (QUICK_SEQLENS if ns.quick else DEFAULT_SEQLENS)
    for m in seqlens:
        _positive(m, "--seqlens")
        if m % world:
            raise ValueError(f"--seqlens: M={m} is not divisible by the world size P={world}")
    if len(set(seqlens)) != len(seqlens):
        raise ValueError(f"--seqlens: repeated values in {list(seqlens)}")
    _positive(ns.heads, "--heads")
    if ns.heads % world:
        raise ValueError(f"--heads: H={ns.heads} is not divisible by the world size P={world}")
    if ns.head_dim not in (64, 128):
        raise ValueError(f"--head-dim: the fused kernel supports 64 and 128, got {ns.head_dim!r}")
    _positive(ns.batch, "--batch")
    if ns.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {ns.dtype!r}")
    trials = ns.trials if ns.trials is not None else (5 if ns.quick else 15)
    _positive(trials, "--trials")
    warmup = ns.warmup if ns.warmup is not None else (1 if ns.quick else 3)
    if warmup < 0:
        raise ValueError(f"--warmup: expected >= 0, got {warmup}")
    if ns.calls is not None:
        _positive(ns.calls, "--calls")
    target_ms = ns.target_ms if ns.target_ms is not None else (5.0 if ns.quick else 25.0)
    if not target_ms > 0:
        raise ValueError(f"--target-ms: expected > 0, got {target_ms}")
    methods = tuple(ns.methods) if ns.methods else METHOD_KEYS
    bad = [m for m in methods if m not in METHOD_KEYS]
    if bad:
        raise ValueError(f"--methods: unknown {bad}; choose from {list(METHOD_KEYS)}")
    methods = tuple(k for k in METHOD_KEYS if k in methods)  # canonical order
    if ns.platform is not None and not Path(ns.platform).is_file():
        raise ValueError(f"--platform: no such file: {ns.platform}")
    num_sms = ns.num_sms if ns.num_sms is not None else H200_NUM_SMS
    _positive(num_sms, "--num-sms")
    if not ns.fa_tflops > 0:
        raise ValueError(f"--fa-tflops: expected > 0, got {ns.fa_tflops}")
    return BenchConfig(
        seqlens=seqlens, heads=ns.heads, head_dim=ns.head_dim, batch=ns.batch, world_size=world,
        real_ranks=real, dtype=ns.dtype, causal=ns.causal, trials=trials, warmup=warmup,
        calls=ns.calls, target_ms=target_ms, methods=methods, quick=ns.quick, out=ns.out,
        platform=ns.platform, seed=ns.seed, plots=not ns.no_plots, num_sms=num_sms,
        fa_tflops=ns.fa_tflops,
    )


def parse_args(argv: Optional[Sequence[str]] = None, env: Optional[dict] = None) -> BenchConfig:
    return make_config(build_parser().parse_args(argv), env)


# ------------------------------------------------------------------------- derived metrics
def derive(med: dict, raw: Optional[dict] = None) -> dict:
    """Derived metrics from per-method medians (us). A metric is None when an input is missing
    (or the hiding ratio's denominator T_serial - T_FA is not positive).

    With per-trial times `raw`, also the paired ratio: the median over trials of
    T_fused / T_FA measured in the same trial (back to back), which a clock change between
    trials (power or thermal throttling, seen on the H200) shifts far less than the medians.
    And the hiding ratio is given only when the communication it divides by stands out of the
    noise: the per-trial T_serial - T_FA must have a median above 3x its median absolute
    deviation (with emulated ranks the local A2A is 5-35 us against ~1% noise in T_FA: the
    sweep of 2026-12-02 printed H = 101%, 93%, 23%, 160% before this gate)."""
    fa, serial, fused = med.get("fa"), med.get("serial"), med.get("fused")
    out = {"e_res_us": None, "e_res_rel": None, "hiding": None, "speedup": None,
           "fused_over_fa": None, "fused_over_fa_paired": None, "speedup_nccl": None,
           "layer_speedup": None}
    if raw and raw.get("fa") and raw.get("fused") and len(raw["fa"]) == len(raw["fused"]):
        out["fused_over_fa_paired"] = statistics.median([u / a for u, a in zip(raw["fused"], raw["fa"])])
    if fa is not None and fused is not None:
        out["e_res_us"] = fused - fa
        out["e_res_rel"] = (fused - fa) / fa
        out["fused_over_fa"] = fused / fa
    comm_resolved = True
    if raw and raw.get("serial") and raw.get("fa") and len(raw["serial"]) == len(raw["fa"]):
        diffs = [s - a for s, a in zip(raw["serial"], raw["fa"])]
        d = statistics.median(diffs)
        comm_resolved = d > 3 * statistics.median([abs(x - d) for x in diffs])
    if (fa is not None and fused is not None and serial is not None and serial - fa > 0
            and comm_resolved):
        out["hiding"] = 1.0 - (fused - fa) / (serial - fa)
    if serial is not None and fused is not None:
        out["speedup"] = serial / fused
    if med.get("serial_nccl") is not None and fused is not None:
        out["speedup_nccl"] = med["serial_nccl"] / fused
    if med.get("layer_nccl") is not None and med.get("layer_fused") is not None:
        out["layer_speedup"] = med["layer_nccl"] / med["layer_fused"]
    return out


DERIVED_COLUMNS = (
    ("e_res_us", "E_res (us)", lambda x: f"{x:+.1f}"),
    ("e_res_rel", "E_res/T_FA", lambda x: f"{100 * x:+.2f}%"),
    ("hiding", "H", lambda x: f"{100 * x:.0f}%"),
    ("speedup", "T_serial/T_fused", lambda x: f"{x:.3f}x"),
    ("fused_over_fa", "T_fused/T_FA", lambda x: f"{x:.4f}"),
    ("fused_over_fa_paired", "T_fused/T_FA paired", lambda x: f"{x:.4f}"),
    ("speedup_nccl", "T_serial-NCCL/T_fused", lambda x: f"{x:.3f}x"),
    ("layer_speedup", "layer NCCL/fused", lambda x: f"{x:.3f}x"),
)


def format_table(points: Sequence[dict], methods: Sequence[str]) -> str:
    """Markdown table, one row per M. Each point: {"M", "median_us": {key: us}, "status":
    {key: text shown instead of a number}, "derived": derive(...)}. A derived column appears
    only when some row has a value for it; methods that need real ranks and ran in no row (other
    than Serial-NCCL, the baseline) are named in a note under the table instead of a column."""
    folded = [m for m in methods if m != "serial_nccl" and points
              and all(p["status"].get(m) == NA_REAL and m not in p["median_us"] for p in points)]
    methods = [m for m in methods if m not in folded]
    cols = [LABELS[m] + " (us)" for m in methods]
    dcols = [c for c in DERIVED_COLUMNS if any(p["derived"].get(c[0]) is not None for p in points)]
    head = ["M"] + cols + [c[1] for c in dcols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [str(p["M"])]
        for m in methods:
            t = p["median_us"].get(m)
            cells.append(f"{t:.1f}" if t is not None else p["status"].get(m, "not run"))
        for key, _, fmt in dcols:
            v = p["derived"].get(key)
            cells.append(fmt(v) if v is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if folded:
        lines.append("\nNeed real ranks, not run: " + ", ".join(LABELS[m] for m in folded) + ".")
    return "\n".join(lines)


# ------------------------------------------------------------------------- model (no GPU too)
def fa4_sm90_tile(head_dim: int, causal: bool = False) -> tuple:
    """(tile_m, tile_n) of FA4 4.0.0b36's SM90 forward (interface._tile_size_fwd_sm90, no local
    window, head_dim_v = head_dim), copied so the CPU path does not import the CuTe DSL."""
    if head_dim <= 64:
        return 192, 128
    if head_dim <= 96:
        return 192, (128 if causal else 144)
    if head_dim <= 128:
        return 128, 128
    if head_dim <= 192:
        return 128, 112
    return 128, 80


def fa_geometry(M: int, cfg: BenchConfig, num_sms: int) -> dict:
    """Tile counts of one rank's FA: CTAs (= output tiles), waves, KV tiles per Q-loop, the burst
    per CTA Bt = tile_m * D * bytes and the aligned burst volume V = K * Bt, K = min(SMs, tiles)."""
    tile_m, tile_n = fa4_sm90_tile(cfg.head_dim, cfg.causal)
    tiles = cfg.batch * cfg.heads_local * math.ceil(M / tile_m)
    k = min(num_sms, tiles)
    bt = tile_m * cfg.head_dim * torch.tensor([], dtype=DTYPES[cfg.dtype]).element_size()
    return {"tile_m": tile_m, "tile_n": tile_n, "tiles": tiles, "waves": math.ceil(tiles / num_sms),
            "kv_tiles": math.ceil(M / tile_n), "K": k, "burst_bytes": bt, "volume_bytes": k * bt}


def sigma_from_tflops(cfg: BenchConfig, tflops: float, num_sms: int) -> float:
    """Q-loop time per KV tile (us) of one CTA at `tflops` spread over `num_sms` SMs:
    4 * tile_m * tile_n * D flops per KV tile (QK^T and PV)."""
    tile_m, tile_n = fa4_sm90_tile(cfg.head_dim, cfg.causal)
    return 4 * tile_m * tile_n * cfg.head_dim / (tflops * 1e12 / num_sms) * 1e6


def sigma_from_fa_time(t_fa_us: float, M: int, cfg: BenchConfig, num_sms: int) -> float:
    """Q-loop time per KV tile (us) estimated from a measured FA time: T_FA / (waves * KV tiles).
    Ignores prologue/epilogue and split-KV; use the largest M, where those matter least."""
    g = fa_geometry(M, cfg, num_sms)
    return t_fa_us / (g["waves"] * g["kv_tiles"])


def load_platform(path: Optional[str]):
    """(PlatformModel, description) from a calibration JSON, or the paper's 8xB200 calibration."""
    from fa_a2a.xstage import PlatformModel

    if path is not None:
        return PlatformModel.from_json(path), f"calibration {path}"
    pm = PAPER_PLATFORM
    model = PlatformModel(t_iss0=pm["t_iss0_us"] * 1e-6, drain_rate=pm["drain_rate_GBps"] * 1e9,
                             capacity=pm["capacity_MiB"] * 2**20)
    return model, ("the paper's 8xB200 calibration (T_iss0 0.76 us, R 717 GB/s, Q 4.25 MiB), "
                   "not this machine")


def _fmt_test(result) -> str:
    """'pass' or 'FAILS: <bounds>' for xstage's DesignTest."""
    return "pass" if result.ok else "FAILS: " + ", ".join(result.failing)


def predictions(cfg: BenchConfig, model, sigma_us: float, num_sms: int) -> dict:
    """The Burst-Gap model's predictions for each M (times in us): the aligned burst V = K * Bt,
    the recovery gap G*, the Q-loop gap G(M) = KV tiles * sigma (its fixed part dropped), the
    issue overhead per burst [V/R - G - T_iss0]+, the design test at G(M), and the sufficient
    sequence length M_ub* = tile_n * G* / sigma (xstage works in seconds and bytes)."""
    rows = []
    mub = None
    for M in cfg.seqlens:
        g = fa_geometry(M, cfg, num_sms)
        V = g["volume_bytes"]
        gap_s = g["kv_tiles"] * sigma_us * 1e-6
        mub = model.fa_min_seqlen(V, sigma_us * 1e-6, g["tile_n"])
        rows.append({"M": M, "K": g["K"], "volume_bytes": V, "gap_us": gap_s * 1e6,
                     "recovery_gap_us": model.recovery_gap(V) * 1e6,
                     "issue_overhead_us": model.issue_overhead(V, gap_s) * 1e6,
                     "design_test": _fmt_test(model.design_test(V, gap_s)), "m_ub": mub})
    return {"sigma_us": sigma_us, "num_sms": num_sms, "rows": rows, "m_ub": mub}


def format_predictions(pred: dict, source: str) -> str:
    lines = [f"Burst-Gap model predictions (platform: {source}; Q-loop {pred['sigma_us']:.3f} us per KV tile, "
             f"K <= {pred['num_sms']} SMs). Model output, not measurements:",
             "| M | K | V (KiB) | Q-loop gap G (us) | G* (us) | issue overhead per burst (us) "
             "| design test at G | M_ub* |",
             "|---|---|---|---|---|---|---|---|"]
    for r in pred["rows"]:
        lines.append(f"| {r['M']} | {r['K']} | {r['volume_bytes'] / 1024:.0f} | {r['gap_us']:.1f} | "
                     f"{r['recovery_gap_us']:.2f} | {r['issue_overhead_us']:.2f} | {r['design_test']} | "
                     f"{r['m_ub']:.0f} |")
    return "\n".join(lines)


def no_gpu(cfg: BenchConfig) -> int:
    print("No CUDA GPU: nothing was measured (the benchmark needs an SM90 GPU; run it there, or under "
          "torchrun --nproc-per-node=N for N GPUs).")
    model, source = load_platform(cfg.platform)
    sigma = sigma_from_tflops(cfg, cfg.fa_tflops, cfg.num_sms)
    print(f"Sizes: B={cfg.batch}, H={cfg.heads} over P={cfg.world_size} (H_loc={cfg.heads_local}), "
          f"D={cfg.head_dim}, {cfg.dtype}{', causal' if cfg.causal else ''}; FA at {cfg.fa_tflops:g} TFLOP/s "
          f"on {cfg.num_sms} SMs.")
    print(format_predictions(predictions(cfg, model, sigma, cfg.num_sms), source))
    return 0


# ------------------------------------------------------------------------------ GPU helpers
_SOURCES = {  # name -> modules to look in, in order
    "fa4_forward": ("fa_a2a.fused",),
    "fa4_a2a_forward": ("fa_a2a.fused",),
    "post_a2a": ("fa_a2a.op",),
    "ulysses_attention": ("fa_a2a", "fa_a2a.op"),
}
_NEEDS = {
    "fa": ("fa4_forward",), "a2a": ("post_a2a",), "a2a_nccl": (), "serial": ("fa4_forward", "post_a2a"),
    "serial_nccl": ("fa4_forward",), "fused": ("fa4_a2a_forward",),
    "layer_fused": ("ulysses_attention",), "layer_nccl": ("ulysses_attention",),
}


def lookup(name: str):
    """(function, None) or (None, why it is missing). Imported lazily: pieces land separately."""
    why = []
    for module in _SOURCES[name]:
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            why.append(f"{module} not importable ({_first_line(e)})")
            continue
        fn = getattr(mod, name, None)
        if fn is not None:
            return fn, None
        why.append(f"{module}.{name} does not exist yet")
    return None, "; ".join(why)


def get_transport(group):
    """ulysses.transport's transport for `group` (peer windows at one stride + in-stream barrier)."""
    return importlib.import_module("ulysses.transport").get_transport(group)


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist_name in ("nvidia-cutlass-dsl", "flash-attn-4", "quack-kernels", "nvidia-ml-py", "fa-a2a"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[dist_name] = None
    return out


def _git_commit() -> Optional[str]:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


class _Log:
    def __init__(self, rank: int):
        self.rank = rank
        self.seen = set()
        self.bar = None  # a tqdm bar: print through it while it is shown

    def __call__(self, *a, once: Optional[str] = None):
        if self.rank != 0:
            return
        if once is not None:
            if once in self.seen:
                return
            self.seen.add(once)
        if self.bar is not None:
            self.bar.write(" ".join(map(str, a)))
        else:
            print(*a, flush=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


# ------------------------------------------------------------------------------ one point
def run_point(cfg: BenchConfig, M: int, ctx: dict, log: _Log, bar=None) -> dict:
    from graphs import GpuClockMonitor, capture, input_sets_needed, median, rank_max, round_up, time_graphs

    dev, group, rank = ctx["device"], ctx["group"], ctx["rank"]
    P, B, H, D, H_loc = cfg.world_size, cfg.batch, cfg.heads, cfg.head_dim, cfg.heads_local
    S_loc = M // P
    dtype = DTYPES[cfg.dtype]
    fns, status = ctx["fns"], dict(ctx["status"])
    todo = [m for m in cfg.methods if m not in status]

    es = torch.tensor([], dtype=dtype).element_size()
    x_bytes = B * M * H_loc * D * es
    # per call: q, k, v read, O written (plus O read and written once more by serial)
    n_sets = input_sets_needed(5 * x_bytes, ctx["l2_bytes"])
    gen = torch.Generator(device=dev)
    gen.manual_seed(cfg.seed * 1_000_003 + M)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    sets = []
    for _ in range(n_sets):
        s = {"q": randn(B, M, H_loc, D), "k": randn(B, M, H_loc, D), "v": randn(B, M, H_loc, D),
             "o_in": randn(B, M, H_loc, D)}
        sets.append(s)

    def windows(name):
        if cfg.real_ranks:  # [P, B, S_loc, H, D]: peer buffers mapped at one stride (collective)
            w = get_transport(group).windows(f"fa_a2a.bench.{name}", (B, S_loc, H, D), dtype)
            w.narrow(3, rank * H_loc, H_loc).copy_(randn(P, B, S_loc, H_loc, D))
            return w
        return randn(P, B, S_loc, H, D)

    def mine(w):  # the part of the windows this rank writes
        return w.narrow(3, rank * H_loc, H_loc)

    fa4, a2a, fused_fn, layer = (fns.get(n) for n in ("fa4_forward", "post_a2a", "fa4_a2a_forward",
                                                       "ulysses_attention"))
    c = cfg.causal
    calls, outputs = {}, {}
    for m in todo:
        try:
            per_set, outs = [], []
            for i, s in enumerate(sets):
                q, k, v = s["q"], s["k"], s["v"]
                if m == "fa":
                    o = torch.empty_like(q)
                    per_set.append(lambda q=q, k=k, v=v, o=o: fa4(q, k, v, out=o, causal=c))
                    outs.append(o)
                elif m == "a2a":
                    w = windows(f"{m}.{i}")
                    per_set.append(lambda o=s["o_in"], w=w: a2a(o, w, rank))
                    outs.append(mine(w))
                elif m == "serial":
                    o, w = torch.empty_like(q), windows(f"{m}.{i}")
                    per_set.append(lambda q=q, k=k, v=v, o=o, w=w: (fa4(q, k, v, out=o, causal=c), a2a(o, w, rank)))
                    outs.append(mine(w))
                elif m == "fused":
                    w = windows(f"{m}.{i}")
                    per_set.append(lambda q=q, k=k, v=v, w=w: fused_fn(q, k, v, w, rank, causal=c))
                    outs.append(mine(w))
                elif m in ("a2a_nccl", "serial_nccl"):
                    from ulysses.reference import dist_head_to_seq  # permute + all_to_all_single

                    send = torch.empty(P, B, S_loc, H_loc, D, device=dev, dtype=dtype)
                    recv, out = torch.empty_like(send), torch.empty(B, S_loc, H, D, device=dev, dtype=dtype)
                    if m == "a2a_nccl":
                        per_set.append(lambda o=s["o_in"], a=send, b=recv, out=out:
                                       dist_head_to_seq(o, group=group, buffers=(a, b, out)))
                    else:
                        o = torch.empty_like(q)
                        per_set.append(lambda q=q, k=k, v=v, o=o, a=send, b=recv, out=out: (
                            fa4(q, k, v, out=o, causal=c), dist_head_to_seq(o, group=group, buffers=(a, b, out))))
                    outs.append(out)
                elif m in ("layer_fused", "layer_nccl"):
                    impl = m.split("_")[1]
                    xq, xk, xv = randn(B, S_loc, H, D), randn(B, S_loc, H, D), randn(B, S_loc, H, D)
                    per_set.append(lambda xq=xq, xk=xk, xv=xv, impl=impl: layer(
                        xq, xk, xv, group=group, impl=impl, causal=c))
                    outs.append(None)  # checked on an eager call after the run
            calls[m], outputs[m] = per_set, outs
        except Exception as e:
            status[m] = f"skipped ({_first_line(e)})"

    # First eager call of each method (compiles; a method that fails is skipped), a rough time
    # that sets the calls per graph, and a trial capture so that one method that cannot be
    # captured does not end the run. All ranks keep the same methods (graphs hold collectives).
    est = {}
    for m in list(calls):
        try:
            for f in calls[m]:
                f()
            torch.cuda.synchronize()
            try:
                del_me = capture(calls[m], len(calls[m]), eager_warmup=0)
                del del_me
            except Exception as e:
                raise RuntimeError(f"not graph-capturable: {_first_line(e)}") from e
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            calls[m][0]()
            t1.record()
            t1.synchronize()
            est[m] = t0.elapsed_time(t1) * 1e3
        except Exception as e:
            status[m] = f"skipped ({_first_line(e)})"
    failed = torch.tensor([1.0 if m in status else 0.0 for m in METHOD_KEYS])
    failed = rank_max(failed, group)
    for j, m in enumerate(METHOD_KEYS):
        if failed[j] > 0 and m not in status:
            status[m] = "skipped (failed on another rank)"
    for m in list(calls):
        if m in status:
            calls.pop(m)
            outputs.pop(m)
    for m, why in status.items():
        if m in cfg.methods:
            log(f"  {LABELS[m]}: {why}", once=f"{m}:{why}")

    point = {"M": M, "S_loc": S_loc, "H_loc": H_loc, "input_sets": n_sets, "n_calls": None,
             "raw_us": {}, "median_us": {}, "status": status, "finite": {}, "clocks": {}}
    if not calls:
        point["derived"] = derive({})
        return point

    if cfg.calls is not None:
        n_calls = cfg.calls
    else:
        t_est = max(est.values())
        n_calls = max(3, min(200, math.ceil(cfg.target_ms * 1e3 / max(t_est, 1e-3))))
    n_calls = round_up(n_calls, n_sets)
    n_calls = int(rank_max(torch.tensor([float(n_calls)]), group)[0])
    point["n_calls"] = n_calls

    def poison():  # after capture, so the finite check below sees what the replays wrote
        for outs in outputs.values():
            for t in outs:
                if t is not None:
                    t.fill_(float("nan"))

    monitor = GpuClockMonitor(dev)
    if bar is not None:
        bar.set_description(f"M={M}")

    def progress(name, trial):
        if bar is not None:
            bar.update(1)

    names = list(calls)
    raw = time_graphs({m: calls[m] for m in names}, n_calls, cfg.trials, cfg.warmup,
                      barrier=ctx["barrier"], group=group, monitor=monitor, progress=progress,
                      after_capture=poison)
    torch.cuda.synchronize()
    for m in names:
        ok = True
        for f, t in zip(calls[m], outputs[m]):
            if t is None:
                t = f()
                torch.cuda.synchronize()
            ok = ok and bool(torch.isfinite(t).all())
        point["finite"][m] = ok
        if not ok:
            status[m] = "non-finite output"
            log(f"  {LABELS[m]} at M={M}: output has NaN/Inf after the run; its time is not reported")
    point["raw_us"] = raw
    point["median_us"] = {m: median(raw[m]) for m in names if point["finite"][m]}
    point["clocks"] = monitor.summary()
    point["clock_warnings"] = list(monitor.warnings)
    point["derived"] = derive(point["median_us"], {m: raw[m] for m in point["median_us"]})
    del sets, calls, outputs
    return point


# ------------------------------------------------------------------------------ plots
def write_plots(result: dict, out_dir: Path, m_ub: Optional[float] = None) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    pts = result["points"]
    title = (f"{result['env'].get('card', '')}: B={result['config']['batch']}, H={result['config']['heads']}, "
             f"D={result['config']['head_dim']}, P={result['config']['world_size']}"
             f"{' (emulated)' if not result['config']['real_ranks'] else ''}")
    files = []
    all_m = sorted({p["M"] for p in pts})

    def save(fig, name, lo=min(all_m)):
        ax = fig.axes[0]
        ax.set_xlim(lo / 1.25, max(all_m) * 1.25)
        ax.set_xscale("log")
        ax.set_xticks(all_m)
        ax.set_xticklabels([f"{m // 1024}K" if m % 1024 == 0 else str(m) for m in all_m])
        ax.xaxis.set_minor_locator(NullLocator())
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(str(path))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in METHOD_KEYS:
        xs = [p["M"] for p in pts if m in p["median_us"]]
        if xs:
            ax.plot(xs, [p["median_us"][m] for p in pts if m in p["median_us"]], "o-", label=LABELS[m])
    ax.set(yscale="log", xlabel="M (sequence length)", ylabel="time per call (us)", title=title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "time_vs_M.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["M"] for p in pts if p["derived"]["e_res_rel"] is not None]
    ax.plot(xs, [100 * p["derived"]["e_res_rel"] for p in pts if p["derived"]["e_res_rel"] is not None],
            "o-", label="measured E_res / T_FA")
    ax.axhline(0, color="k", lw=0.8)
    lo = min(all_m)
    if m_ub is not None and m_ub > 0:
        ax.axvline(m_ub, color="r", ls="--", label=f"model M_ub* = {m_ub:.0f}")
        lo = min(lo, m_ub)
    elif m_ub is not None:
        ax.plot([], [], " ", label="model M_ub* = 0 (G* = 0: every M drains)")
    ax.set(xlabel="M (sequence length)", ylabel="E_res / T_FA (%)", title=title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "eres_vs_M.png", lo)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("speedup", "T_serial / T_fused"), ("speedup_nccl", "T_serial-NCCL / T_fused"),
                       ("layer_speedup", "layer: NCCL / fused")):
        sel = [p for p in pts if p["derived"].get(key) is not None]
        if sel:
            ax.plot([p["M"] for p in sel], [p["derived"][key] for p in sel], "o-", label=label)
    sel = [p for p in pts if "serial" in p["median_us"] and "fa" in p["median_us"]]
    if sel:
        ax.plot([p["M"] for p in sel], [p["median_us"]["serial"] / p["median_us"]["fa"] for p in sel], "k:",
                label="bound T_serial / T_FA")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xlabel="M (sequence length)", ylabel="speedup", title=title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "speedup_vs_M.png")
    return files


# ------------------------------------------------------------------------------ main (GPU)
def _setup_distributed(cfg: BenchConfig) -> dict:
    import torch.distributed as dist

    if not cfg.real_ranks:
        torch.cuda.set_device(0)
        return {"rank": 0, "group": None, "device": torch.device("cuda", 0), "barrier": None,
                "barrier_kind": "none (emulated ranks: no other rank to wait for)"}
    local = int(os.environ.get("LOCAL_RANK", "0"))
    n_local = int(os.environ.get("LOCAL_WORLD_SIZE", str(cfg.world_size)))
    if torch.cuda.device_count() < n_local:
        raise SystemExit(f"{n_local} processes per node but {torch.cuda.device_count()} GPUs: processes "
                         "sharing a GPU would time contention. Run one process per GPU, or one process "
                         "with emulated ranks (no torchrun).")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
    group = dist.group.WORLD
    try:  # the in-stream barrier kernel of the peer windows (what the fused path uses)
        transport = get_transport(group)
        barrier, kind = transport.barrier, "ulysses.transport barrier kernel"
    except Exception as e:  # stream-ordered fallback: a 1-element NCCL all_reduce
        token = torch.zeros(1, device=dev)
        kind = f"NCCL all_reduce (transport unavailable: {_first_line(e)})"

        def barrier():
            dist.all_reduce(token, group=group)
    return {"rank": dist.get_rank(), "group": group, "device": dev, "barrier": barrier, "barrier_kind": kind}


def run_gpu(cfg: BenchConfig) -> int:
    from graphs import GpuClockMonitor, l2_cache_bytes

    ctx = _setup_distributed(cfg)
    log = _Log(ctx["rank"])
    dev = ctx["device"]
    props = torch.cuda.get_device_properties(dev)
    ctx["l2_bytes"] = l2_cache_bytes(dev)
    torch.manual_seed(cfg.seed + ctx["rank"])
    log(f"fa_a2a.bench on {props.name} ({props.multi_processor_count} SMs): B={cfg.batch}, H={cfg.heads}, "
        f"D={cfg.head_dim}, P={cfg.world_size}, H_loc={cfg.heads_local}, {cfg.dtype}"
        f"{', causal' if cfg.causal else ''}; M={list(cfg.seqlens)}; {cfg.trials} trials, {cfg.warmup} warm-up")
    if cfg.real_ranks:
        log(f"Real ranks: {cfg.world_size} processes, one GPU each; per-trial time = max over ranks; "
            f"barrier: {ctx['barrier_kind']}.")
    else:
        log(EMULATION_NOTE.format(P=cfg.world_size, Pm1=cfg.world_size - 1))

    fns, status = {}, {}
    for m in cfg.methods:
        if m in NEEDS_REAL and not cfg.real_ranks:
            status[m] = NA_REAL
            continue
        for name in _NEEDS[m]:
            if name not in fns:
                fn, why = lookup(name)
                if fn is None:
                    status[m] = f"skipped ({why})"
                    break
                fns[name] = fn
    ctx["fns"], ctx["status"] = fns, status

    env_monitor = GpuClockMonitor(dev)
    env_monitor.sample("start")
    result = {"config": dataclasses.asdict(cfg), "env": {
        "card": props.name, "sm_count": props.multi_processor_count, "l2_bytes": ctx["l2_bytes"],
        "capability": f"{props.major}.{props.minor}", "versions": _versions(), "git_commit": _git_commit(),
        "nvml": env_monitor.device_info(), "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "emulated": not cfg.real_ranks, "barrier": ctx["barrier_kind"],
        "emulation_note": None if cfg.real_ranks else EMULATION_NOTE.format(P=cfg.world_size, Pm1=cfg.world_size - 1),
        "timing": "CUDA-graph replay of n_calls back-to-back calls + one barrier, per-call us; per trial max over "
                  "ranks; median over trials; method order rotated per trial",
        "points": []}
    result["config"]["seqlens"] = list(cfg.seqlens)
    result["config"]["methods"] = list(cfg.methods)

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    n_run = len([m for m in cfg.methods if m not in status])
    bar = None
    if tqdm is not None and ctx["rank"] == 0:
        bar = tqdm(total=len(cfg.seqlens) * cfg.trials * n_run, unit="replay", file=sys.stderr)
    log.bar = bar
    for M in cfg.seqlens:
        result["points"].append(run_point(cfg, M, ctx, log, bar))
        torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    log.bar = None
    env_monitor.sample("end")
    result["env"]["clocks"] = env_monitor.summary()
    result["env"]["clock_samples"] = env_monitor.samples

    m_ub = None
    if cfg.platform is not None:
        try:
            model, source = load_platform(cfg.platform)
            big = [p for p in result["points"] if "fa" in p["median_us"]]
            if big:
                p = max(big, key=lambda p: p["M"])
                sigma = sigma_from_fa_time(p["median_us"]["fa"], p["M"], cfg, props.multi_processor_count)
                result["model"] = predictions(cfg, model, sigma, props.multi_processor_count)
                result["model"]["source"] = source
                result["model"]["sigma_from"] = f"measured FA at M={p['M']}"
                m_ub = result["model"]["m_ub"]
        except Exception as e:
            log(f"No model line: {_first_line(e)}")

    if ctx["rank"] == 0:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
        files = [str(out / "bench.json")]
        if cfg.plots:
            try:
                files += write_plots(result, out, m_ub)
            except Exception as e:
                log(f"No plots: {_first_line(e)}")
        warn = [w for p in result["points"] for w in p.get("clock_warnings", [])]
        for w in warn:
            log(f"warning: {w}")
        if "model" in result:
            log(format_predictions(result["model"], result["model"]["source"]))
        log("Wrote " + ", ".join(files))
        log("")
        log(f"{props.name}, {cfg.dtype}, D={cfg.head_dim}, H={cfg.heads}, P={cfg.world_size}"
            f"{' emulated' if not cfg.real_ranks else ''}, B={cfg.batch}"
            f"{', causal' if cfg.causal else ''}: per-call median (us) of CUDA-graph replays")
        log(format_table(result["points"], cfg.methods))
    if cfg.real_ranks:
        import torch.distributed as dist

        if ctx["barrier_kind"].startswith("ulysses"):
            get_transport(ctx["group"]).check()  # raises if a barrier timed out
        dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = make_config(ns)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        return no_gpu(cfg)
    return run_gpu(cfg)


if __name__ == "__main__":
    sys.exit(main())
