"""`torchrun --nproc-per-node=P -m fa_a2a.bench`: the whole Ulysses call on P real ranks.

The ranks are processes: one GPU each, or P processes sharing one GPU, whose kernels run at once
under CUDA MPS (`python -m fa_a2a.mps -- torchrun ...`; without MPS their contexts time-slice).
Two ranks on one GPU cannot use NCCL ("Duplicate GPU detected"): the process group is then gloo
only and the NCCL call is skipped with that reason. Per M (the full sequence S), every rank times:

  fa4_local  fa4_forward on the rank's own [B, S, H/P, D] problem: the call if communication were free
  fa4_aligned  the same behind the transport's in-stream barrier every call: FA4-local with the ranks
             lined up as the call lines them up (on one GPU under MPS the free-running FA4-local of
             the ranks interleave and fill each other's tails; a call's barriers align them)
  pre_a2a    the pre-A2A kernel alone (the first step of forward.rank_call)
  serial     fa_a2a.ulysses_attention(impl="serial"): pre-A2A, barrier, FA4, post-A2A kernel, barrier, delivery
  fused      fa_a2a.ulysses_attention(impl="fused"): FA4 with the post-A2A in its epilogue, its
             stores paced as pace="auto" decides (fa_a2a.engine.pacing; the decision is logged per M)
  fused_unpaced  the same with pace=None (what the fused call did before pacing existed)
  fused_st   fa_a2a.ulysses_attention(impl="fused:st"): the fused call with per-thread O stores
             (where S_loc is a multiple of the tile's rows "fused" stores with TMA)
  nccl       fa_a2a.ulysses_attention(impl="nccl"): all_to_all_single around FA4 (one GPU per rank only)
  auto       fa_a2a.ulysses_attention(impl="auto"): the path fa_a2a.engine.autotune picked at its first call
             (its decision, how it was reached and its candidates' times are printed per M)
  qkv_gemm   the attention block's QKV projection alone (Flux-style bias, per-head RMSNorm, RoPE; C = H*D)
             with a plain output: the same kernels, tiles and epilogue as the block, no rank windows
  block      fa_a2a.ulysses_qkv_attention from the hidden states: the projection storing into the
             rank windows (pre-A2A), then the fused FA4

Timing: a method is n_calls back-to-back calls; before each timed batch the ranks line up with
torch.cuda.synchronize + dist.barrier + one in-stream barrier of the transport (so the start
events of all ranks fire together). The batch is a CUDA-graph replay when every rank could capture
every method (graphs.capture; the in-stream barriers replay), else the same calls eagerly
(graphs.eager_batch); the JSON says which ("timing_mode", and the capture error). Timed by
graphs.time_batches (CUDA events): per trial the maximum over ranks, the method order rotated
every trial, medians over trials; ratios also paired (the median over trials of the per-trial
ratio: every method ran back to back in that trial). The eager time of every method is measured
too (host launch cost shows as eager > graph).

Ratios: fused / (fa4_local + pre_a2a) (target <= 1.03: the fused call should cost what its
attention and pre-A2A kernel cost alone), block / (qkv_gemm + fa4_local) (targets <= 1.10 at
S 4608, <= 1.05 at 16384), the same two over fa4_aligned (what the call adds beyond the alignment
of the ranks), serial / fused, nccl / fused; and the hiding of the fused calls,
H = 1 - (call - fa4_local) / (serial - fa4_local): the share of what the serial call spends beyond
FA4-local that the call hides (over the host transport, FA_A2A_TRANSPORT=host: the slow link), and
the same beyond FA4-local + pre-A2A: the share of the post-A2A hidden (the part the fused epilogue
moves; the pre-A2A is in both calls).

Breakdown of the fused call (eager, the steps of forward.rank_call with CUDA events between them,
on every rank): pre-A2A, barrier 1 wait, attention, barrier 2 wait, delivery (the output left in
its out-slot, or the copy out of the staging window: fa_a2a.engine.forward), and host = the
GPU idle from the end of one call to the start of the next (the host had not launched it yet:
wall time minus GPU time). Their sum over the eager fused call's time is the coverage (>= 90%
expected: otherwise the public call does work the steps do not show). `launch` is the host time
to issue one call's steps.

Rank 0 prints the tables and writes bench_call.json and bench_call.png into --out.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from fa_a2a.engine.autotune import decision_text
from fa_a2a.tools.bench_config import EAGER_TRIALS, BenchConfig, torch_dtype
from fa_a2a.tools.bench_report import over_best, _finite, _first_line, _git_commit, _Log, _versions, write_result

CALL_TARGET = 1.03  # fused / (fa4_local + pre_a2a)
BLOCK_TARGETS = {4608: 1.10, 16384: 1.05}  # block / (qkv_gemm + fa4_local), by M
COVERAGE_MIN = 0.90
NCCL_SHARED = "skipped (ranks share a GPU: NCCL refuses two ranks on one device, 'Duplicate GPU detected')"


@dataclasses.dataclass(frozen=True)
class CallMethod:
    key: str
    label: str
    what: str
    needs_nccl: bool = False


CALL_METHODS = (
    CallMethod("fa4_local", "FA4-local", "fa4_forward on the rank's own [B, S, H/P, D] problem"),
    CallMethod("fa4_aligned", "FA4-aligned", "fa4_forward as FA4-local, behind the transport's in-stream barrier"),
    CallMethod("pre_a2a", "pre-A2A", "the pre-A2A kernel alone (forward.rank_call's first step)"),
    CallMethod("serial", "serial call", "ulysses_attention(impl='serial')"),
    CallMethod("fused", "fused call", "ulysses_attention(impl='fused'), pace='auto'"),
    CallMethod("fused_unpaced", "fused unpaced", "ulysses_attention(impl='fused', pace=None)"),
    CallMethod("fused_st", "fused st", "ulysses_attention(impl='fused:st'), pace='auto'"),
    CallMethod("nccl", "NCCL call", "ulysses_attention(impl='nccl')", needs_nccl=True),
    CallMethod("auto", "auto call", "ulysses_attention(impl='auto'): the path fa_a2a.engine.autotune picked"),
    CallMethod("qkv_gemm", "QKV GEMM", "the block's QKV projection alone, plain output (qkv_projection_plain)"),
    CallMethod("block", "block call", "ulysses_qkv_attention(impl='fused') from the hidden states"),
)
CALL_BY_KEY = {m.key: m for m in CALL_METHODS}

# name, numerator, denominator (summed): computed from medians and paired per trial
RATIOS = (
    ("call_over_local", "fused", ("fa4_local", "pre_a2a")),
    ("call_over_fa4", "fused", ("fa4_local",)),
    ("call_over_aligned", "fused", ("fa4_aligned", "pre_a2a")),
    ("block_over_aligned", "block", ("qkv_gemm", "fa4_aligned")),
    ("serial_over_fused", "serial", ("fused",)),
    ("nccl_over_fused", "nccl", ("fused",)),
    ("block_over_local", "block", ("qkv_gemm", "fa4_local")),
)
# name, call, what serial's excess is measured beyond: FA4-local (all communication), or FA4-local + the
# pre-A2A kernel alone (the post-A2A: what the fused epilogue can hide; over a slow link the pre-A2A,
# 3/4 of the bytes, is in every call)
HIDING = (("hiding_fused", "fused", ("fa4_local",)), ("hiding_unpaced", "fused_unpaced", ("fa4_local",)),
          ("hiding_post_fused", "fused", ("fa4_local", "pre_a2a")),
          ("hiding_post_unpaced", "fused_unpaced", ("fa4_local", "pre_a2a")))
STEPS = ("pre", "wait1", "attend", "wait2", "deliver")  # the fused call's steps, in order
PHASES = STEPS + ("host",)
PHASE_LABELS = {"pre": "pre-A2A", "wait1": "barrier 1 wait", "attend": "attention", "wait2": "barrier 2 wait",
                "deliver": "delivery", "host": "host (GPU idle)"}


# ------------------------------------------------------------------------------ pure parts
def ranks_share_gpu(local_world_size: int, device_count: int) -> bool:
    """Whether some GPU of this host runs two ranks (rank r uses GPU r % device_count)."""
    return local_world_size > device_count


def select_methods(shared_gpu: bool) -> tuple:
    """(keys to run, {key: why it does not run})."""
    status = {m.key: NCCL_SHARED for m in CALL_METHODS if m.needs_nccl and shared_gpu}
    return tuple(m.key for m in CALL_METHODS if m.key not in status), status


def targets(M: int) -> dict:
    return {"call_over_local": CALL_TARGET, "block_over_local": BLOCK_TARGETS.get(M)}


def _quot(values: dict, num: str, den: Sequence[str]) -> Optional[float]:
    if num not in values or any(d not in values for d in den):
        return None
    return values[num] / sum(values[d] for d in den)


def ratios(med: dict, raw: Optional[dict] = None) -> dict:
    """RATIOS from the medians (us), and "<name>_paired": the median over trials of the ratio of the
    same trial's times (raw: {key: [us per trial]}, all of one length)."""
    out = {}
    for name, num, den in RATIOS:
        out[name] = _quot(med, num, den)
        keys = (num,) + tuple(den)
        paired = None
        if raw and all(raw.get(k) for k in keys):
            n = len(raw[num])
            if any(len(raw[k]) != n for k in keys):
                raise ValueError(f"raw: expected the same number of trials for {keys}, got "
                                 f"{[len(raw[k]) for k in keys]}")
            paired = statistics.median(_quot({k: raw[k][t] for k in keys}, num, den) for t in range(n))
        out[name + "_paired"] = paired
    out["auto_over_best"] = over_best({k: [v] for k, v in med.items()}, "auto", AUTO_CANDIDATES)
    out["auto_over_best_paired"] = over_best(raw or {}, "auto", AUTO_CANDIDATES)
    for name, call, base in HIDING:
        out[name] = _hiding(med, call, base)
        paired = None
        if raw and all(raw.get(k) for k in (call, "serial") + base):
            per_trial = [_hiding({k: raw[k][t] for k in raw}, call, base) for t in range(len(raw[call]))]
            paired = statistics.median(per_trial) if None not in per_trial else None
        out[name + "_paired"] = paired
    return out


AUTO_CANDIDATES = ("fused", "fused_st", "serial", "nccl")  # impl "auto"'s candidates, as methods here


def _hiding(values: dict, call: str, base: Sequence[str]) -> Optional[float]:
    """1 - (call - sum(base)) / (serial - sum(base)): None without them or when serial <= sum(base)."""
    if any(k not in values for k in (call, "serial") + tuple(base)):
        return None
    floor = sum(values[k] for k in base)
    if values["serial"] <= floor:
        return None
    return 1 - (values[call] - floor) / (values["serial"] - floor)


def phases_from_stamps(stamps: Sequence[Sequence[float]]) -> dict:
    """{phase: [us per call]} from the event times (us) of back-to-back calls: stamps[i] holds call
    i's len(STEPS) + 1 times (before the pre-A2A, then after each step); "host" is the GPU idle from
    the end of call i to the start of call i + 1."""
    if len(stamps) < 2:
        raise ValueError(f"stamps: expected at least 2 calls, got {len(stamps)}")
    out = {p: [] for p in PHASES}
    for i, s in enumerate(stamps):
        if len(s) != len(STEPS) + 1 or any(b < a for a, b in zip(s, s[1:])):
            raise ValueError(f"stamps[{i}]: expected {len(STEPS) + 1} non-decreasing times, got {list(s)}")
        for step, a, b in zip(STEPS, s, s[1:]):
            out[step].append(b - a)
        if i + 1 < len(stamps):
            out["host"].append(stamps[i + 1][0] - s[-1])
    return out


def summarize_breakdown(rank_phases: Sequence[dict], launch_us: Sequence[float], call_us: float) -> dict:
    """Per rank: the phase medians (us), their sum, coverage = sum / call_us (the eager fused call,
    max over ranks), and the host launch time of one call; plus the smallest coverage."""
    if not call_us > 0:
        raise ValueError(f"call_us: expected a positive time, got {call_us!r}")
    rows = []
    for r, (ph, launch) in enumerate(zip(rank_phases, launch_us)):
        total = sum(ph[p] for p in PHASES)
        rows.append({"rank": r, **{p: ph[p] for p in PHASES}, "sum": total, "coverage": total / call_us,
                     "launch": launch})
    return {"call_eager_us": call_us, "ranks": rows, "coverage_min": min(r["coverage"] for r in rows)}


def new_point(M: int, S_loc: int, H_loc: int, status: dict) -> dict:
    """One M's record (JSON) before anything is timed."""
    return {"M": M, "S_loc": S_loc, "H_loc": H_loc, "n_calls": None, "status": status, "timing_mode": None,
            "capture_error": None, "raw_us": {}, "median_us": {}, "eager_raw_us": {}, "eager_us": {},
            "ratios": ratios({}), "breakdown": None, "finite": {}, "pacing": None, "auto": None}


def fill_point(point: dict, raw: dict, eager_raw: dict, rank_rows: Optional[Sequence[Sequence[float]]] = None) -> dict:
    """point's medians, ratios and breakdown from the per-trial times ({key: [us]}, max over ranks):
    a method whose output was not finite (point["finite"]) gets that status and no time. rank_rows:
    every rank's fused-call phase medians in PHASES order, then its launch time (us)."""
    bad = [k for k, ok in point["finite"].items() if not ok]
    for k in bad:
        point["status"][k] = "non-finite output"
    point["raw_us"], point["eager_raw_us"] = raw, eager_raw
    point["median_us"] = {k: statistics.median(v) for k, v in raw.items() if k not in bad}
    point["eager_us"] = {k: statistics.median(v) for k, v in eager_raw.items() if k not in bad}
    point["ratios"] = ratios(point["median_us"], {k: raw[k] for k in point["median_us"]})
    if rank_rows is not None and "fused" in point["eager_us"]:
        point["breakdown"] = summarize_breakdown([dict(zip(PHASES, row)) for row in rank_rows],
                                                 [row[len(PHASES)] for row in rank_rows], point["eager_us"]["fused"])
    return point


def _cell(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _target_cell(value, target) -> str:
    if value is None or target is None:
        return "-"
    return f"<= {target:g}: {'yes' if value <= target else 'NO'}"


def not_run_lines(points: Sequence[dict], word: str, label=str) -> list:
    """What goes under a table (also bench --backward's): a blank line, then one line per method and
    reason a point's status gives for a method without a time, "<word> (<label(key)>: <reason>) at
    M = <those points' M>."; nothing when every method has its time."""
    why = {}
    for p in points:
        for key, reason in p["status"].items():
            if key not in p["median_us"]:
                why.setdefault(f"{label(key)}: {reason}", []).append(str(p["M"]))
    return [""] + [f"{word} ({text}) at M = {', '.join(ms)}." for text, ms in why.items()] if why else []


def format_call_table(points: Sequence[dict]) -> str:
    """Markdown table: one row per M, a column per method that ran anywhere, the ratios and targets;
    the methods that ran nowhere are named under it with the reason."""
    shown = [m for m in CALL_METHODS if any(m.key in p["median_us"] for p in points)]
    head = (["M", "S_loc"] + [m.label + " (us)" for m in shown]
            + ["fused/(FA4+pre)", "paired", "target", "block/(GEMM+FA4)", "paired", "target",
               "fused/(FA4-aligned+pre) paired", "block/(GEMM+FA4-aligned) paired", "serial/fused",
               "NCCL/fused", "auto/best paired", "hidden: fused", "hidden: unpaced", "post-A2A hidden: fused",
               "unpaced"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        r, t = p["ratios"], targets(p["M"])
        cells = [str(p["M"]), str(p["S_loc"])] + [_cell(p["median_us"].get(m.key)) for m in shown]
        cells += [_cell(r.get("call_over_local"), "{:.3f}"), _cell(r.get("call_over_local_paired"), "{:.3f}"),
                  _target_cell(r.get("call_over_local_paired"), t["call_over_local"]),
                  _cell(r.get("block_over_local"), "{:.3f}"), _cell(r.get("block_over_local_paired"), "{:.3f}"),
                  _target_cell(r.get("block_over_local_paired"), t["block_over_local"]),
                  _cell(r.get("call_over_aligned_paired"), "{:.3f}"),
                  _cell(r.get("block_over_aligned_paired"), "{:.3f}"),
                  _cell(r.get("serial_over_fused"), "{:.3f}"), _cell(r.get("nccl_over_fused"), "{:.3f}"),
                  _cell(r.get("auto_over_best_paired"), "{:.3f}"), _cell(r.get("hiding_fused_paired"), "{:.0%}"),
                  _cell(r.get("hiding_unpaced_paired"), "{:.0%}"),
                  _cell(r.get("hiding_post_fused_paired"), "{:.0%}"),
                  _cell(r.get("hiding_post_unpaced_paired"), "{:.0%}")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += not_run_lines(points, "Not run", lambda key: CALL_BY_KEY[key].label)
    decided = [p for p in points if p.get("auto")]
    if decided:
        lines.append("")
        lines += [f"impl='auto' at M = {p['M']}: {p['auto']}" for p in decided]
    return "\n".join(lines)


def format_eager(points: Sequence[dict]) -> str:
    """Eager time per call beside the table's time (CUDA-graph replay, when it was used)."""
    lines = ["| M | method | table (us/call) | eager (us/call) | eager / table |", "|---|---|---|---|---|"]
    for p in points:
        for m in CALL_METHODS:
            t, e = p["median_us"].get(m.key), p["eager_us"].get(m.key)
            if t is not None and e is not None:
                lines.append(f"| {p['M']} | {m.label} | {t:.1f} | {e:.1f} | {e / t:.2f} |")
    return "\n".join(lines)


def format_breakdown(points: Sequence[dict]) -> str:
    head = ["M", "rank"] + [PHASE_LABELS[p] for p in PHASES] + ["sum", "fused call (eager)", "coverage",
                                                                  "host launch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    low = []
    for p in points:
        b = p.get("breakdown")
        if not b:
            continue
        for row in b["ranks"]:
            lines.append("| " + " | ".join([str(p["M"]), str(row["rank"])] + [f"{row[ph]:.1f}" for ph in PHASES]
                                           + [f"{row['sum']:.1f}", f"{b['call_eager_us']:.1f}",
                                              f"{100 * row['coverage']:.1f}%", f"{row['launch']:.1f}"]) + " |")
        if b["coverage_min"] < COVERAGE_MIN:
            low.append(str(p["M"]))
    lines.append("")
    lines.append(f"Coverage >= {COVERAGE_MIN:.0%} on every rank: "
                 + ("yes" if not low else f"NO at M = {', '.join(low)} (the call does work its steps do not show)"))
    return "\n".join(lines)


def write_call_plots(result: dict, out_dir: Path) -> list:
    """bench_call.png: the ratios against M with their targets, and the fused call's breakdown per
    (M, rank) as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, label in (("call_over_local", "fused / (FA4-local + pre-A2A)"),
                        ("block_over_local", "block / (QKV GEMM + FA4-local)"),
                        ("serial_over_fused", "serial / fused"), ("nccl_over_fused", "NCCL / fused")):
        sel = [p for p in pts if p["ratios"].get(name + "_paired") is not None]
        if sel:
            line, = ax.plot([p["M"] for p in sel], [p["ratios"][name + "_paired"] for p in sel], "o-", label=label)
            for p in sel:
                t = targets(p["M"]).get(name)
                if t is not None:
                    ax.plot([p["M"]], [t], "_", ms=18, mew=2, color=line.get_color())
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="M (full sequence)", ylabel="ratio (paired median); dashes: targets",
           title=result.get("title", ""))
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    bars = [(f"{p['M']} r{row['rank']}", row) for p in pts if p.get("breakdown") for row in p["breakdown"]["ranks"]]
    bottom = [0.0] * len(bars)
    for ph in PHASES:
        vals = [row[ph] for _, row in bars]
        bx.bar(range(len(bars)), vals, bottom=bottom, label=PHASE_LABELS[ph])
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=45, fontsize=8)
    bx.set(ylabel="us per call (eager)", title="fused call, per rank")
    bx.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "bench_call.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [str(path)]


# ------------------------------------------------------------------------------ GPU
def setup_ranks(cfg: BenchConfig) -> dict:
    """This process's rank of a torchrun job (also `python -m fa_a2a.bench --backward`'s real ranks): its
    GPU (fa_a2a.tools.mps.rank_device) and the default process group, gloo only where ranks share a
    GPU (NCCL refuses two ranks on one device), else cpu:gloo,cuda:nccl -> {rank, group, device,
    shared_gpu, local_world_size, gpus, backend}."""
    import torch
    import torch.distributed as dist

    from fa_a2a.tools.mps import rank_device  # cuda:(LOCAL_RANK % device count), made current; logs a shared GPU

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(cfg.world_size)))
    shared = ranks_share_gpu(local_world, torch.cuda.device_count())
    dev = rank_device()
    backend = "gloo" if shared else "cpu:gloo,cuda:nccl"
    if shared:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, device_id=dev)
    return {"rank": dist.get_rank(), "group": dist.group.WORLD, "device": dev, "shared_gpu": shared,
            "local_world_size": local_world, "gpus": torch.cuda.device_count(), "backend": backend}


def _build(cfg: BenchConfig, M: int, ctx: dict, keys: Sequence[str]) -> tuple:
    """({key: zero-argument call}, the fused call's steps, its window plan) of this rank at M, built
    in `keys` order (every rank the same: window allocations are collective)."""
    import torch

    from cute_kernels.qkv_a2a_sm90 import interleaved_cos_sin, qkv_projection_plain
    from fa_a2a import block
    from fa_a2a.engine.forward import rank_call
    from fa_a2a.engine.projection import auto_tiles
    from cute_kernels.fa4 import fa4_forward
    from fa_a2a.op import ulysses_attention
    from fa_a2a.engine.problem import check_call

    P, B, H, D = cfg.world_size, cfg.batch, cfg.heads, cfg.head_dim
    rank, group, dev = ctx["rank"], ctx["group"], ctx["device"]
    S_loc, H_loc, C, dtype, causal = M // P, H // P, H * D, torch_dtype(cfg.dtype), cfg.causal
    gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1_000_003 + M * 64 + rank)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    q, k, v = (randn(B, S_loc, H, D) for _ in range(3))
    made = []

    def block_inputs():
        """x [B, S_loc, C], Flux-style weights (bias, per-head RMSNorm), this rank's RoPE table, the
        plain projection's output and the tiles the block's projection picks (engine.projection.auto_tiles)."""
        if not made:
            x = randn(B, S_loc, C)
            f32 = torch.float32
            weight, bias = (randn(3 * C, C, dt=f32) / C ** 0.5).to(dtype), (0.1 * randn(3 * C, dt=f32)).to(dtype)
            chain = block.TorchQKV(weight, bias, randn(D, dt=f32) * 0.2 + 1, randn(D, dt=f32) * 0.2 + 1, H, H, D)
            proj = block.block_weights(chain, P)
            rows = torch.arange(rank * S_loc, (rank + 1) * S_loc, device=dev)
            table = interleaved_cos_sin(*block.rotary_pair(rows, D))
            y = torch.empty(B, S_loc, proj.weight.shape[0], device=dev, dtype=dtype)
            made.extend((x, proj, table, y, *auto_tiles(S_loc, proj, table)))
        return made

    problem, _ = check_call(q, k, v, None, "fused", causal, None, None, P, None, rank, pace="auto")
    calls, steps, plan = {}, None, None
    built = {}

    def once(name, make):  # FA4-local's inputs and the rank call serve two methods each
        if name not in built:
            built[name] = make()
        return built[name]

    def local_fa4():
        ql, kl, vl = (randn(B, M, H_loc, D) for _ in range(3))
        o = torch.empty_like(ql)
        return lambda: fa4_forward(ql, kl, vl, out=o, causal=causal)

    for key in keys:
        if key == "fa4_local":
            calls[key] = once("fa4", local_fa4)
        elif key == "fa4_aligned":
            barrier = once("rank", lambda: rank_call(problem, group, rank)).transport.barrier
            fa4 = once("fa4", local_fa4)
            calls[key] = lambda: (barrier(), fa4())
        elif key == "pre_a2a":
            call = once("rank", lambda: rank_call(problem, group, rank))
            transport, plan, pre, attend = call.transport, call.plan, call.pre, call.attend
            slot = [0]  # WindowPlan.complete's steps, the out-slot chosen with barrier 1

            def choose_and_barrier():
                slot[0] = plan.choose_slot()
                transport.barrier()

            steps = (lambda: pre(q, k, v, None), choose_and_barrier, lambda: attend(slot[0]), transport.barrier,
                     lambda: plan.finish(rank, S_loc, slot=slot[0]))
            calls[key] = steps[0]
        elif key in ("serial", "fused", "nccl", "auto"):
            calls[key] = lambda impl=key: ulysses_attention(q, k, v, group=group, impl=impl, causal=causal)
        elif key == "fused_st":
            calls[key] = lambda: ulysses_attention(q, k, v, group=group, impl="fused:st", causal=causal)
        elif key == "fused_unpaced":
            calls[key] = lambda: ulysses_attention(q, k, v, group=group, impl="fused", causal=causal, pace=None)
        elif key == "qkv_gemm":
            x, proj, table, y, tiles, one = block_inputs()
            calls[key] = lambda: qkv_projection_plain(x, proj, y, rope_cs=table, config=tiles, one_launch=one)
        elif key == "block":
            x, proj, table = block_inputs()[:3]
            calls[key] = lambda: block.ulysses_qkv_attention(x, proj, group=group, rotary=table, impl="fused",
                                                             causal=causal)
        else:
            raise ValueError(f"keys: unknown method {key!r}")
    return calls, steps, plan


def rank_aligner(group):
    """Line the ranks up before a timed batch: own GPU idle, hosts met, then one in-stream barrier
    so that the start events that follow it fire together on every rank."""
    import torch
    import torch.distributed as dist

    from ulysses.transport import get_transport

    transport = get_transport(group)

    def align():
        torch.cuda.synchronize()
        dist.barrier(group)
        transport.barrier()

    return align


def _breakdown(steps, n_calls: int, trials: int, align) -> tuple:
    """This rank's fused-call phases ({phase: median us}) and host launch time per call (us), from
    `trials` eager batches of n_calls calls with CUDA events between the steps."""
    import torch

    per = {p: [] for p in PHASES}
    launch = []
    for _ in range(trials):
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)] for _ in range(n_calls)]
        align()
        for ev in events:
            t0 = time.perf_counter()
            ev[0].record()
            for step, e in zip(steps, ev[1:]):
                step()
                e.record()
            launch.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        origin = events[0][0]
        stamps = [[origin.elapsed_time(e) * 1e3 for e in ev] for ev in events]
        for p, values in phases_from_stamps(stamps).items():
            per[p] += values
    return {p: statistics.median(v) for p, v in per.items()}, statistics.median(launch)


def first_calls(keys: Sequence[str], first, timed, status: dict, group, after_first=None) -> dict:
    """Every method's first call, then one timed call each (before a point is timed; also bench
    --backward's): first(key) for every key in `keys` order (compiles, window allocations: collective,
    so the same order on every rank; what it returns is kept until every method's first call ran),
    then after_first(), then timed(key) between two CUDA events. A method whose call raised gets
    status[key] = "skipped (<its error>)" and is dropped on every rank (the others: "skipped (failed
    on another rank)") -> {key: us of its timed call} of the methods left, in `keys` order."""
    import torch

    from graphs import rank_max

    est, failed, held = {}, torch.zeros(len(keys)), []
    for stage in ("first", "timed"):
        for j, key in enumerate(keys):
            if failed[j]:
                continue
            try:
                if stage == "first":
                    held.append(first(key))
                    torch.cuda.synchronize()
                    continue
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                timed(key)
                t1.record()
                t1.synchronize()
                est[key] = t0.elapsed_time(t1) * 1e3
            except Exception as e:  # reported in the table; the other ranks drop the method too
                status[key] = f"skipped ({_first_line(e)})"
                failed[j] = 1
        held.clear()
        if stage == "first" and after_first is not None:
            after_first()
    failed = rank_max(failed, group)
    for j, key in enumerate(keys):
        if failed[j] > 0:
            status.setdefault(key, "skipped (failed on another rank)")
    return {key: est[key] for j, key in enumerate(keys) if failed[j] == 0}


def calls_per_batch(cfg: BenchConfig, us: Sequence[float], group, multiple: int = 1) -> int:
    """n_calls of every method's batch: --calls, else enough that the slowest method's batch (us: each
    method's one timed call) lasts about --target-ms (3 to 200); rounded up to a multiple of
    `multiple`, the maximum over the ranks."""
    import torch

    from graphs import calls_for, rank_max, round_up

    n_calls = cfg.calls or calls_for(max(us), cfg.target_ms)
    return int(rank_max(torch.tensor([float(round_up(n_calls, multiple))]), group)[0])


def run_call_point(cfg: BenchConfig, M: int, ctx: dict, log: _Log) -> dict:
    import torch

    from graphs import capture, eager_batch, rank_max, time_batches

    group = ctx["group"]
    keys, status = select_methods(ctx["shared_gpu"])
    point = new_point(M, M // cfg.world_size, cfg.heads_local, status)
    calls, steps, plan = _build(cfg, M, ctx, keys)
    if plan is not None:  # the fused call's plan: pace="auto" decided while it was built
        point["pacing"] = {"rate_gbps": plan.pacing.rate_gbps, "reason": plan.pacing.reason,
                           "link_gbps": getattr(plan.transport, "pacing_link_gbps", None),
                           "transport": type(plan.transport).__name__}
        log(f"M={M}: {point['pacing']['transport']}, pace='auto': {plan.pacing.reason}")
    def decided():  # impl "auto" decides at its first call
        point["auto"] = decision_text("ulysses_attention", M // cfg.world_size)
        log(f"M={M}: impl='auto': {point['auto']}")

    # First calls (compiles) in one order on every rank, each output kept until every method ran: each
    # call leaves its own out-slot allocated (fa_a2a.engine.forward's delivery), one for each method's CUDA
    # graph to own, and no timed call below allocates one. Then one timed call each.
    est = first_calls(keys, lambda key: calls[key](), lambda key: calls[key](), status, group,
                      decided if "auto" in keys else None)
    names = list(est)
    for key in keys:
        if key not in est:
            log(f"  M={M} {CALL_BY_KEY[key].label}: {status[key]}")
    if not names:
        return point
    n_calls = calls_per_batch(cfg, est.values(), group)
    point["n_calls"] = n_calls

    graphs, error = {}, None
    try:
        for key in names:
            graphs[key] = capture(calls[key], n_calls, eager_warmup=0)
    except Exception as e:
        error = _first_line(e)
    if rank_max(torch.tensor([float(error is not None)]), group)[0] > 0:
        graphs = {}
        error = error or "capture failed on another rank"
    point["capture_error"] = error
    point["timing_mode"] = "cuda-graph" if graphs else "eager"
    align = rank_aligner(group)
    eager = {k: eager_batch(calls[k], n_calls) for k in names}
    log(f"M={M}: {n_calls} calls per batch, {point['timing_mode']}"
        + (f" (graph capture failed: {error})" if error else ""))
    if graphs:
        raw = time_batches({k: g.replay for k, g in graphs.items()}, n_calls, cfg.trials, cfg.warmup, before=align,
                           group=group)
        eager_raw = time_batches(eager, n_calls, EAGER_TRIALS, before=align, group=group)
    else:
        raw = eager_raw = time_batches(eager, n_calls, cfg.trials, cfg.warmup, before=align, group=group)
    del graphs
    checked = [k for k in ("serial", "fused", "fused_unpaced", "fused_st", "nccl", "auto", "block") if k in names]
    # fresh outputs, checked once after the timing; one verdict for every rank (rank 0 reports, and the
    # breakdown below meets in collectives)
    bad = rank_max(torch.tensor([0.0 if _finite(calls[k]()) else 1.0 for k in checked], dtype=torch.float64), group)
    for key, b in zip(checked, bad.tolist()):
        point["finite"][key] = b == 0
        if not point["finite"][key]:
            log(f"  M={M} {CALL_BY_KEY[key].label}: output has NaN/Inf (on some rank); its time is not reported")
    rank_rows = None
    if steps is not None and "fused" in names and point["finite"]["fused"]:
        phases, launch = _breakdown(steps, n_calls, EAGER_TRIALS, align)
        mine = torch.zeros(cfg.world_size, len(PHASES) + 1, dtype=torch.float64)
        mine[ctx["rank"]] = torch.tensor([phases[p] for p in PHASES] + [launch], dtype=torch.float64)
        rank_rows = rank_max(mine, group).tolist()  # every rank's row: a max over the others' zeros
    return fill_point(point, raw, eager_raw, rank_rows)


def run_calls(cfg: BenchConfig) -> int:
    import torch
    import torch.distributed as dist

    from ulysses.transport import close_transports, get_transport

    ctx = setup_ranks(cfg)
    log = _Log(ctx["rank"])
    props = torch.cuda.get_device_properties(ctx["device"])
    mps = {"thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "mps_share": cfg.mps_share,
           "pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}
    where = (f"{ctx['local_world_size']} processes sharing {ctx['gpus']} GPU(s)" if ctx["shared_gpu"]
             else "one GPU per process")
    log(f"fa_a2a.tools.bench (whole call) on {props.name}: P={cfg.world_size} ranks, {where}; B={cfg.batch}, "
        f"H={cfg.heads}, D={cfg.head_dim}, {cfg.dtype}{', causal' if cfg.causal else ''}; M={list(cfg.seqlens)}; "
        f"process group {ctx['backend']}; MPS thread percentage {mps['thread_percentage'] or 'not set'}")
    result = {"config": {**dataclasses.asdict(cfg), "seqlens": list(cfg.seqlens)},
              "env": {"card": props.name, "sm_count": props.multi_processor_count,
                      "capability": f"{props.major}.{props.minor}", "versions": _versions(),
                      "git_commit": _git_commit(), "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
              "ranks": {"world_size": cfg.world_size, "local_world_size": ctx["local_world_size"],
                        "gpus": ctx["gpus"], "shared_gpu": ctx["shared_gpu"], "process_group": ctx["backend"],
                        "mps": mps},
              "methods": {m.key: {"label": m.label, "what": m.what} for m in CALL_METHODS},
              "targets": {"call_over_local": CALL_TARGET, "block_over_local": BLOCK_TARGETS,
                          "coverage_min": COVERAGE_MIN},
              "timing": "n_calls back-to-back calls per batch after synchronize + dist.barrier + one in-stream "
                        "barrier; CUDA-graph replay (timing_mode) or eager; per trial the max over ranks; medians "
                        f"over trials; method order rotated per trial; eager_us: eager, {EAGER_TRIALS} trials",
              "points": []}
    for M in cfg.seqlens:
        result["points"].append(run_call_point(cfg, M, ctx, log))
        torch.cuda.empty_cache()
        get_transport(ctx["group"]).check()  # a barrier that timed out makes this M's numbers wrong
    result["title"] = (f"{props.name}: P={cfg.world_size} ({where}), H={cfg.heads}, D={cfg.head_dim}, "
                       f"{cfg.dtype}")
    if ctx["rank"] == 0:
        files = write_result(cfg, "bench_call.json", result, lambda out: write_call_plots(result, out), log)
        log("Wrote " + ", ".join(files))
        modes = sorted({str(p["timing_mode"]) for p in result["points"]})
        log(f"\n{result['title']}: per call, median over trials of the max over ranks (us), {'/'.join(modes)}")
        log(format_call_table(result["points"]))
        log("\nEager time per call:")
        log(format_eager(result["points"]))
        log("\nFused call breakdown (eager; CUDA events between the steps of forward.rank_call; us per call, "
            "median over calls and trials):")
        log(format_breakdown(result["points"]))
    close_transports()
    dist.destroy_process_group()
    return 0
