"""`python -m fa_a2a.bench`: steady-state sender-visible times of FA4 + Ulysses post-A2A vs M.

The methods are the rows of METHODS (the paper's Sec. 5.3 set, the baseline users run today, and
the Ulysses op itself); `--help` lists them. Derived (from unrounded medians): E_res = T_fused -
T_FA, hiding ratio H = 1 - (T_fused - T_FA) / (T_serial - T_FA), speedup T_serial / T_fused, and
T_fused / T_FA.

Timing (graphs.timing, the project's one timing loop): each method is captured as N back-to-back
calls in a CUDA graph; one timed replay is the N calls plus one cross-rank barrier (the paper's
sender-side boundary); per-call us = elapsed / N; per trial the max over ranks; median over
trials; method order rotated every trial; input sets rotated when they would fit in L2; SM clocks
logged through NVML. Then the same N calls eagerly (no graph, 3 trials): host wall time per call,
printed beside the graph time (GPU-bound when they agree).

Ranks: under `torchrun --nproc-per-node=N` the ranks are real and the benchmark times the whole
call instead (fa_a2a.bench_call: FA4-local, pre-A2A, serial / fused / NCCL calls, the attention
block; one GPU per process, or N processes on one GPU under `python -m fa_a2a.mps`); `--per-kernel`
runs the methods below on real ranks instead (one GPU per process). In one
process, P ranks are emulated: the process runs rank 0's work only and its "remote" stores go to
P local windows; the other P-1 ranks' stores are never issued ("Op emulated" runs all P ranks'
work through fa_a2a.ulysses_attention_emulated). Methods that do not apply print "n/a (...)".

Destinations (--dest): hbm puts the windows in this GPU's memory; host puts them in pinned host
memory that the GPU's stores reach over PCIe (zero-copy under UVA): a one-GPU proxy for a slow
peer with the same mechanism (bursts, finite outstanding capacity, backpressure on the issuer)
but not NVLink's numbers. For each (M, destination) the Burst-Gap model of FA4's tile bursts
(fa_a2a.xstage, platform from --platform) is printed beside the measured E_res and hiding ratio,
with the wave drain bound at the measured A2A-only rate (xstage.FaTiles.wave_drain_bound).
Without a GPU nothing is measured: the script prints the model's predictions and exits 0.

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
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from fa_a2a.cli import MAX_HEADS, MAX_REPEATS, MAX_SEQLEN, MAX_WORLD_SIZE
from fa_a2a.xstage import GB, US, FaTiles, PlatformModel, fused_residual

DEFAULT_SEQLENS = (8192, 16384, 32768, 49152, 65536)
QUICK_SEQLENS = (8192, 16384)
CALL_SEQLENS = (4608, 16384)  # the whole-call benchmark under torchrun (fa_a2a.bench_call), --quick too
DEFAULT_WORLD_SIZE = 8
DTYPES = {"bf16": 2, "fp16": 2}  # name -> bytes per element (torch is imported after the arguments are parsed)


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
DESTS = ("hbm", "host")
EAGER_TRIALS = 3
NA_REAL = "n/a (needs real ranks)"
NA_EMULATED = "n/a (emulated ranks only)"
NA_HOST = "n/a (its windows are in HBM)"
# The paper's calibration of its 8xB200 node (K=148 producers, 32 KB bursts): used for the
# no-GPU predictions when --platform is not given. Not a measurement of this machine.
PAPER_PLATFORM = PlatformModel(t_iss0=0.76 * US, drain_rate=717 * GB, capacity=4.25 * 2**20)
PAPER_SOURCE = "the paper's 8xB200 calibration (T_iss0 0.76 us, R 717 GB/s, Q 4.25 MiB), not this machine"
# FA4 SM90 forward throughput measured on an H200 (bf16, D=128, non-causal, 16K-64K; DESIGN.md,
# 2026-12-02): the no-GPU predictions turn it into the Q-loop time per KV tile.
H200_FA4_TFLOPS = 690.0
H200_NUM_SMS = 132

EMULATION_NOTE = (
    "Emulated ranks: one process runs source rank 0's work for P={P} ranks; its stores to the "
    "{P} destination windows stay on this GPU or its host, and the other {Pm1} ranks' stores are never "
    "issued. NCCL methods need real ranks."
)
HOST_NOTE = (
    "--dest host: the windows are pinned host memory; the GPU's stores reach it over PCIe (UVA). A "
    "one-GPU proxy for a slow peer, not NVLink: its drain rate, capacity and latency are the PCIe path's."
)


# ----------------------------------------------------------------------------------- methods
class _Point:
    """What a method's builder needs for one (M, destination): sizes, rank, and allocators."""

    def __init__(self, cfg: "BenchConfig", M: int, dest: str, ctx: dict, gen: torch.Generator):
        self.cfg, self.M, self.dest = cfg, M, dest
        self.dev, self.group, self.rank = ctx["device"], ctx["group"], ctx["rank"]
        self.dtype = torch_dtype(cfg.dtype)
        self.S_loc = M // cfg.world_size
        self.gen = gen
        self.keep = []  # pinned host buffers behind host windows: alive as long as the point

    def randn(self, *shape):
        import torch

        return torch.randn(*shape, device=self.dev, dtype=self.dtype, generator=self.gen)

    def windows(self, name: str) -> torch.Tensor:
        """[P, B, S_loc, H, D] output windows of all ranks, filled with random values."""
        import torch

        cfg, P, H_loc = self.cfg, self.cfg.world_size, self.cfg.heads_local
        shape = (P, cfg.batch, self.S_loc, cfg.heads, cfg.head_dim)
        if cfg.real_ranks:  # peer buffers mapped at one stride (collective)
            from ulysses.transport import get_transport

            w = get_transport(self.group).windows(f"fa_a2a.bench.{name}", shape[1:], self.dtype)
            w.narrow(3, self.rank * H_loc, H_loc).copy_(self.randn(P, cfg.batch, self.S_loc, H_loc, cfg.head_dim))
            return w
        if self.dest == "host":
            from ulysses.transport import tensor_from_address

            nbytes = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.keep.append(host)
            w = tensor_from_address(host.data_ptr(), nbytes, self.dev).view(self.dtype).view(shape)
            w.copy_(self.randn(*shape))
            return w
        return self.randn(*shape)

    def mine(self, w: torch.Tensor) -> torch.Tensor:
        """The part of the windows this rank writes."""
        H_loc = self.cfg.heads_local
        return w.narrow(3, self.rank * H_loc, H_loc)


# A builder takes (point, input set {"i": index, "q", "k", "v", "o_in"}) and returns (call, output): the call launches one call of
# the method; the output is the tensor it writes (NaN-poisoned before the timed replays and
# checked after them), or None to check the call's return value on an eager call after the run.
def _build_fa(pt, s):
    import torch

    from fa_a2a.fused import fa4_forward

    o = torch.empty_like(s["q"])
    return (lambda: fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal)), o


def _build_a2a(pt, s):
    from fa_a2a.op import post_a2a

    w = pt.windows(f"a2a.{s['i']}")
    return (lambda: post_a2a(s["o_in"], w, pt.rank)), pt.mine(w)


def _build_serial(pt, s):
    import torch

    from fa_a2a.fused import fa4_forward
    from fa_a2a.op import post_a2a

    o, w = torch.empty_like(s["q"]), pt.windows(f"serial.{s['i']}")
    return (lambda: (fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal),
                     post_a2a(o, w, pt.rank))), pt.mine(w)


def _build_fused(pt, s):
    from fa_a2a.fused import fa4_a2a_forward

    w = pt.windows(f"fused.{s['i']}")
    return (lambda: fa4_a2a_forward(s["q"], s["k"], s["v"], w, pt.rank, causal=pt.cfg.causal)), pt.mine(w)


def _nccl_buffers(pt):
    import torch

    cfg = pt.cfg
    send = torch.empty(cfg.world_size, cfg.batch, pt.S_loc, cfg.heads_local, cfg.head_dim, device=pt.dev,
                       dtype=pt.dtype)
    out = torch.empty(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim, device=pt.dev, dtype=pt.dtype)
    return send, torch.empty_like(send), out


def _build_a2a_nccl(pt, s):
    from ulysses.reference import dist_head_to_seq  # permute + all_to_all_single

    bufs = _nccl_buffers(pt)
    return (lambda: dist_head_to_seq(s["o_in"], group=pt.group, buffers=bufs)), bufs[2]


def _build_serial_nccl(pt, s):
    import torch

    from fa_a2a.fused import fa4_forward
    from ulysses.reference import dist_head_to_seq

    bufs, o = _nccl_buffers(pt), torch.empty_like(s["q"])
    return (lambda: (fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal),
                     dist_head_to_seq(o, group=pt.group, buffers=bufs))), bufs[2]


def _layer_builder(impl: str):
    def build(pt, s):
        from fa_a2a.op import ulysses_attention

        cfg = pt.cfg
        x = [pt.randn(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim) for _ in range(3)]
        return (lambda: ulysses_attention(*x, group=pt.group, impl=impl, causal=cfg.causal)), None
    return build


def _build_emulated(pt, s):
    from fa_a2a.op import ulysses_attention_emulated

    cfg = pt.cfg
    qs, ks, vs = ([pt.randn(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim) for _ in range(cfg.world_size)]
                  for _ in range(3))
    return (lambda: ulysses_attention_emulated(qs, ks, vs, impl="fused", causal=cfg.causal)), None


@dataclasses.dataclass(frozen=True)
class Method:
    key: str
    label: str
    what: str
    build: Callable
    ranks: str = "any"      # "any" | "real" (torchrun, one GPU per rank) | "emulated" (one process)
    hbm_only: bool = False  # allocates its own windows in HBM: --dest host does not apply


METHODS = (
    Method("fa", "FA4-only", "fa_a2a.fused.fa4_forward on q, k, v [B, M, H_loc, D]", _build_fa),
    Method("a2a", "A2A-only", "our post-A2A kernel alone, fa_a2a.op.post_a2a(o, windows, rank)", _build_a2a),
    Method("a2a_nccl", "A2A-only NCCL", "permute + all_to_all_single + permute", _build_a2a_nccl, "real", True),
    Method("serial", "Serial", "FA4, then our post-A2A", _build_serial),
    Method("serial_nccl", "Serial-NCCL", "FA4, then permute + all_to_all_single (yunchang / xDiT / DeepSpeed)",
           _build_serial_nccl, "real", True),
    Method("fused", "Fused", "FA4 with the post-A2A in its epilogue: fa_a2a.fused.fa4_a2a_forward", _build_fused),
    Method("layer_fused", "Layer fused", "whole Ulysses layer (pre-A2A + attention + post-A2A), impl='fused'",
           _layer_builder("fused"), "real", True),
    Method("layer_nccl", "Layer NCCL", "the same layer with impl='nccl'", _layer_builder("nccl"), "real", True),
    Method("op_emulated", "Op emulated", "fa_a2a.ulysses_attention_emulated, impl='fused': all P ranks' work "
           "(pre-A2A, fused attention, barrier) in one process", _build_emulated, "emulated", True),
)
BY_KEY = {m.key: m for m in METHODS}


def not_applicable(m: Method, real_ranks: bool, dest: str) -> Optional[str]:
    """Why method m does not run in this setting (a table cell), or None."""
    if m.ranks == "real" and not real_ranks:
        return NA_REAL
    if m.ranks == "emulated" and real_ranks:
        return NA_EMULATED
    if m.hbm_only and dest != "hbm":
        return NA_HOST
    return None


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
    dests: tuple
    quick: bool
    out: str
    platform: Optional[str]
    seed: int
    plots: bool
    num_sms: int
    fa_tflops: float
    mps_share: Optional[float] = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of every rank, when given
    per_kernel: bool = False  # torchrun: the kernel methods instead of the whole call

    @property
    def whole_call(self) -> bool:
        """torchrun runs the whole-call benchmark (fa_a2a.bench_call) unless --per-kernel."""
        return self.real_ranks and not self.per_kernel

    @property
    def heads_local(self) -> int:
        return self.heads // self.world_size


class _Parser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same arguments: only rank 0 prints a usage error (all exit 2)."""

    def error(self, message):
        if _rank_from_env() != 0:
            self.exit(2)
        super().error(message)


def _rank_from_env() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fa_a2a.bench",
        description="CUDA-graph steady-state benchmark of FA4 + Ulysses post-A2A across sequence lengths M, "
        "windows in HBM or in pinned host memory, with the X-Stage Burst-Gap model beside the measurements.",
        epilog="Under torchrun the whole call is timed instead (fa_a2a.bench_call; --per-kernel: these methods). "
        "methods: " + "; ".join(f"{m.key} = {m.what}" + {"real": " (torchrun --per-kernel only)",
                                                                  "emulated": " (emulated ranks only)"}.get(m.ranks, "")
                                        for m in METHODS),
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
    p.add_argument("--per-kernel", action="store_true",
                   help="under torchrun (one GPU per process): the kernel methods above on real ranks instead of "
                   "the whole-call benchmark (fa_a2a.bench_call)")
    return p


# Bounds of the numeric flags (a value outside is a usage error, exit 2, before torch is imported):
# the tools' shared maxima (fa_a2a.cli), lower bounds where a tiny value breaks the model's arithmetic.
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
}


def _bounded(value, name: str):
    """value if it is a finite number within BOUNDS[name], else ValueError naming the flag."""
    lo, hi = BOUNDS[name]
    kind = "an integer" if isinstance(lo, int) else "a number"
    if value is None or not (lo <= value <= hi) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name}: expected {kind} in [{lo:g}, {hi:g}], got {value!r}")
    return value


def load_platform(path: Optional[str]) -> tuple:
    """(PlatformModel, description) from a calibration JSON, or the paper's 8xB200 calibration.
    Bad contents raise ValueError naming --platform."""
    if path is None:
        return PAPER_PLATFORM, PAPER_SOURCE
    if not Path(path).is_file():
        raise ValueError(f"--platform: expected a platform model JSON file, got {path!r} (no such file)")
    try:
        model = PlatformModel.from_json(Path(path))
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--platform: {path} is not a platform model ({e})") from None
    return model, f"calibration {path}"


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
    for m in seqlens:
        _bounded(m, "--seqlens")
        if m % world:
            raise ValueError(f"--seqlens: M={m} is not divisible by the world size P={world}")
    if len(set(seqlens)) != len(seqlens):
        raise ValueError(f"--seqlens: repeated values in {list(seqlens)}")
    _bounded(ns.heads, "--heads")
    if ns.heads % world:
        raise ValueError(f"--heads: H={ns.heads} is not divisible by the world size P={world}")
    if ns.head_dim not in (64, 128):
        raise ValueError(f"--head-dim: the fused kernel supports 64 and 128, got {ns.head_dim!r}")
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
    return BenchConfig(
        seqlens=seqlens, heads=ns.heads, head_dim=ns.head_dim, batch=ns.batch, world_size=world,
        real_ranks=real, dtype=ns.dtype, causal=ns.causal, trials=trials, warmup=warmup,
        calls=ns.calls, target_ms=target_ms, methods=methods, dests=dests, quick=ns.quick, out=ns.out,
        platform=ns.platform, seed=ns.seed, plots=not ns.no_plots, num_sms=num_sms,
        fa_tflops=ns.fa_tflops, mps_share=mps_share, per_kernel=ns.per_kernel,
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
    import statistics

    fa, serial, fused = med.get("fa"), med.get("serial"), med.get("fused")
    out = {"e_res_us": None, "e_res_rel": None, "hiding": None, "speedup": None,
           "fused_over_fa": None, "fused_over_fa_paired": None, "speedup_nccl": None,
           "layer_speedup": None, "comm_us": None}
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
    if fa is not None and serial is not None and serial - fa > 0 and comm_resolved:
        out["comm_us"] = serial - fa  # the communication a hiding ratio divides by
        if fused is not None:
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


def _row_head(p: dict, with_dest: bool) -> list:
    return [str(p["M"])] + ([p.get("dest", "hbm")] if with_dest else [])


def format_table(points: Sequence[dict], methods: Sequence[str]) -> str:
    """Markdown table, one row per (M, destination). Each point: {"M", "dest", "median_us":
    {key: us}, "status": {key: text shown instead of a number}, "derived": derive(...)}. A derived
    column appears only when some row has a value for it; a method that applies in no row (other
    than Serial-NCCL, the baseline) is named in a note under the table instead of a column."""
    folded = [m for m in methods if m != "serial_nccl" and points
              and all(p["status"].get(m, "").startswith("n/a") and m not in p["median_us"] for p in points)]
    methods = [m for m in methods if m not in folded]
    with_dest = any(p.get("dest", "hbm") != "hbm" for p in points)
    cols = [BY_KEY[m].label + " (us)" for m in methods]
    dcols = [c for c in DERIVED_COLUMNS if any(p["derived"].get(c[0]) is not None for p in points)]
    head = ["M"] + (["windows"] if with_dest else []) + cols + [c[1] for c in dcols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = _row_head(p, with_dest)
        for m in methods:
            t = p["median_us"].get(m)
            cells.append(f"{t:.1f}" if t is not None else p["status"].get(m, "not run"))
        for key, _, fmt in dcols:
            v = p["derived"].get(key)
            cells.append(fmt(v) if v is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if folded:
        why = {}
        for m in folded:
            why.setdefault(next(p["status"][m] for p in points), []).append(BY_KEY[m].label)
        lines.append("\nNot run: " + "; ".join(f"{', '.join(v)} ({k[5:-1] if k.startswith('n/a (') else k})"
                                                for k, v in why.items()) + ".")
    return "\n".join(lines)


def format_eager(points: Sequence[dict]) -> str:
    """Eager wall time per call beside the graph time, one row per (M, destination, method)."""
    with_dest = any(p.get("dest", "hbm") != "hbm" for p in points)
    head = ["M"] + (["windows"] if with_dest else []) + ["method", "graph (us/call)", "eager wall (us/call)",
                                                          "eager / graph"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        for m in METHODS:
            g, e = p["median_us"].get(m.key), p.get("eager_us", {}).get(m.key)
            if g is None or e is None:
                continue
            lines.append("| " + " | ".join(_row_head(p, with_dest) + [m.label, f"{g:.1f}", f"{e:.1f}",
                                                                      f"{e / g:.2f}"]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- the model
def _tiles(cfg: BenchConfig, M: int, num_sms: int) -> FaTiles:
    es = DTYPES[cfg.dtype]
    return FaTiles.fa4(M, cfg.heads_local, cfg.head_dim, num_sms=num_sms, batch=cfg.batch, out_bytes=es,
                       causal=cfg.causal)


def _fmt_test(result) -> str:
    """'pass', 'FAILS: <bounds>' or 'undecided: capacity' for xstage's DesignTest."""
    if result.ok:
        return "pass"
    if result.failing:
        return "FAILS: " + ", ".join(result.failing)
    return "undecided: " + ", ".join(result.undecided) + " (Q is a lower bound)"


def predictions(cfg: BenchConfig, model: PlatformModel, sigma_us: float, num_sms: int) -> dict:
    """The Burst-Gap model's predictions for each M (times in us) with no measurement: the aligned
    burst V = K * Bt, the recovery gap G*, the Q-loop gap G(M) = KV tiles * sigma (its fixed part
    dropped), the issue overhead per burst [V/R - G - T_iss0]+, the design test at G(M), and the
    sufficient sequence length M_ub* = tile_n * G* / sigma."""
    rows = []
    mub = None
    for M in cfg.seqlens:
        t = _tiles(cfg, M, num_sms)
        V = t.volume
        gap_s = t.kv_tiles * sigma_us * US
        mub = model.fa_min_seqlen(V, sigma_us * US, t.tile_n)
        rows.append({"M": M, "K": t.producers, "volume_bytes": V, "gap_us": gap_s / US,
                     "recovery_gap_us": model.recovery_gap(V) / US,
                     "issue_overhead_us": model.issue_overhead(V, gap_s) / US,
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


_MODEL_DEST = {"hbm": "hbm", "local": "hbm", "cuda-ipc": "hbm", "ipc": "hbm", "host": "host"}


def model_applies(model: Optional[PlatformModel], dest: str) -> bool:
    """A calibration describes the destination it measured (meta "dest"); one without says nothing."""
    if model is None:
        return False
    measured = _MODEL_DEST.get(str(model.meta.get("dest")))
    return measured is None or measured == dest


def model_row(p: dict, cfg: BenchConfig, model: Optional[PlatformModel], num_sms: int) -> Optional[dict]:
    """The model beside the measurements of one point (us): the design test of FA4's tile bursts
    at the measured Q-loop gap G = T_FA/waves, the predicted E_res and hiding
    (xstage.fused_residual), and the wave drain bound T_bound at the measured A2A-only rate
    (xstage.FaTiles.wave_drain_bound) with its hiding. None without a measured FA time."""
    med = p["median_us"]
    if "fa" not in med:
        return None
    t = _tiles(cfg, p["M"], num_sms)
    fa = med["fa"]
    comm = p["derived"].get("comm_us")  # None unless T_serial - T_FA stands out of the noise
    row = {"M": p["M"], "dest": p.get("dest", "hbm"), "waves": t.waves, "volume_bytes": t.volume,
           "gap_us": fa / t.waves, "e_res_us": p["derived"].get("e_res_us"), "hiding": p["derived"].get("hiding"),
           "fused_us": med.get("fused"), "design_test": None, "e_res_model_us": None, "hiding_model": None,
           "a2a_GBps": None, "t_bound_us": None, "hiding_bound": None}
    if model_applies(model, row["dest"]):
        row["design_test"] = _fmt_test(model.design_test(t.volume, fa / t.waves * US))
        row["e_res_model_us"] = fused_residual(model, t, fa * US)["e_res"] / US
        if comm:
            row["hiding_model"] = 1 - row["e_res_model_us"] / comm
    if "a2a" in med:
        rate = cfg.batch * p["M"] * cfg.heads_local * cfg.head_dim * t.out_bytes / (med["a2a"] * US)
        row["a2a_GBps"] = rate / GB
        row["t_bound_us"] = t.wave_drain_bound(fa * US, rate) / US
        if comm:
            row["hiding_bound"] = 1 - (row["t_bound_us"] - fa) / comm
    return row


def format_model(rows: Sequence[dict], source: Optional[str]) -> str:
    def f(x, fmt):
        return "-" if x is None else fmt.format(x)

    lines = [f"Burst-Gap model of FA4's tile bursts (platform: {source or 'none, give --platform'}; G = T_FA/waves "
             "measured) and the wave drain bound at the measured A2A-only rate, beside the measurements:",
             "| M | windows | waves | V (MiB) | G (us) | design test at G | E_res model (us) | E_res measured (us) "
             "| H model | H measured | A2A GB/s | T_bound (us) | H bound | T_fused measured (us) |",
             "|" + "---|" * 14]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["M"]), r["dest"], str(r["waves"]), f"{r['volume_bytes'] / 2**20:.2f}", f"{r['gap_us']:.1f}",
            r["design_test"] or "-", f(r["e_res_model_us"], "{:+.1f}"), f(r["e_res_us"], "{:+.1f}"),
            f(r["hiding_model"], "{:.0%}"), f(r["hiding"], "{:.0%}"), f(r["a2a_GBps"], "{:.0f}"),
            f(r["t_bound_us"], "{:.1f}"), f(r["hiding_bound"], "{:.0%}"), f(r["fused_us"], "{:.1f}")]) + " |")
    return "\n".join(lines)


def no_gpu(cfg: BenchConfig) -> int:
    """The Burst-Gap model's predictions without a GPU, printed by rank 0 (under torchrun the
    other ranks print nothing); nothing is written to --out."""
    if _rank_from_env() != 0:
        return 0
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
    print(format_predictions(predictions(cfg, model, sigma, cfg.num_sms), source))
    print(f"Nothing written to {cfg.out} (only measurements are written).")
    return 0


# ------------------------------------------------------------------------------ GPU helpers
def _versions() -> dict:
    from importlib import metadata

    import torch

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


def write_result(cfg: BenchConfig, name: str, result: dict, plots: Callable[[Path], list], log: "_Log") -> list:
    """Rank 0's output: result as JSON `name` in cfg.out, then plots(out) (-> the files it wrote) when
    cfg.plots; a plot that fails is logged, not raised. Returns the files written."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=1, default=str))
    files = [str(out / name)]
    if cfg.plots:
        try:
            files += plots(out)
        except Exception as e:
            log(f"No plots: {_first_line(e)}")
    return files


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _finite(x) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    if isinstance(x, (list, tuple)):
        return all(_finite(t) for t in x)
    return True


# ------------------------------------------------------------------------------ one point
def run_point(cfg: BenchConfig, M: int, dest: str, ctx: dict, log: _Log, bar=None) -> dict:
    from graphs import (GpuClockMonitor, capture, input_sets_needed, median, rank_max, round_up, time_eager,
                        time_graphs)

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
             "clocks": {}}
    if not calls:
        point["derived"] = derive({})
        return point

    if cfg.calls is not None:
        n_calls = cfg.calls
    else:
        t_est = max(est.values())
        n_calls = max(3, min(200, math.ceil(cfg.target_ms * 1e3 / max(t_est, 1e-3))))
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
    for key in names:
        ok = True
        for f, t in zip(calls[key], outputs[key]):
            if t is None:
                t = f()
                torch.cuda.synchronize()
            ok = ok and _finite(t)
        point["finite"][key] = ok
        if not ok:
            status[key] = "non-finite output"
            log(f"  {BY_KEY[key].label} at M={M} ({dest}): output has NaN/Inf after the run; its time is not reported")
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
    dests = sorted({p.get("dest", "hbm") for p in pts})

    def by_dest():
        for d in dests:
            yield d, [p for p in pts if p.get("dest", "hbm") == d], (f" ({d})" if len(dests) > 1 else "")

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
    for _, dp, tag in by_dest():
        for m in METHODS:
            sel = [p for p in dp if m.key in p["median_us"]]
            if sel:
                ax.plot([p["M"] for p in sel], [p["median_us"][m.key] for p in sel], "o-", label=m.label + tag)
    ax.set(yscale="log", xlabel="M (sequence length)", ylabel="time per call (us)", title=title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "time_vs_M.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for _, dp, tag in by_dest():
        sel = [p for p in dp if p["derived"]["e_res_rel"] is not None]
        ax.plot([p["M"] for p in sel], [100 * p["derived"]["e_res_rel"] for p in sel], "o-",
                label="measured E_res / T_FA" + tag)
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
    for _, dp, tag in by_dest():
        for key, label in (("speedup", "T_serial / T_fused"), ("speedup_nccl", "T_serial-NCCL / T_fused"),
                           ("layer_speedup", "layer: NCCL / fused")):
            sel = [p for p in dp if p["derived"].get(key) is not None]
            if sel:
                ax.plot([p["M"] for p in sel], [p["derived"][key] for p in sel], "o-", label=label + tag)
        sel = [p for p in dp if "serial" in p["median_us"] and "fa" in p["median_us"]]
        if sel:
            ax.plot([p["M"] for p in sel], [p["median_us"]["serial"] / p["median_us"]["fa"] for p in sel], "k:",
                    label="bound T_serial / T_FA" + tag)
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xlabel="M (sequence length)", ylabel="speedup", title=title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "speedup_vs_M.png")
    return files


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
    log(f"fa_a2a.bench on {props.name} ({props.multi_processor_count} SMs): B={cfg.batch}, H={cfg.heads}, "
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
        cfg = make_config(ns)
    except ValueError as e:
        parser.error(str(e))
    import torch  # after the arguments: a bad flag is refused without loading torch

    if not torch.cuda.is_available():
        return no_gpu(cfg)
    if cfg.whole_call:
        from fa_a2a.bench_call import run_calls

        return run_calls(cfg)
    return run_gpu(cfg)


if __name__ == "__main__":
    sys.exit(main())
