"""What `python -m fa_a2a.bench` reports, and how both of its benchmarks write their results.

Derived (from unrounded medians, derive): E_res = T_fused - T_FA, hiding ratio H = 1 - (T_fused -
T_FA) / (T_serial - T_FA), speedup T_serial / T_fused, and T_fused / T_FA. The markdown tables
(format_table, format_eager); the Burst-Gap model of FA4's tile bursts beside the measurements
(model_row, format_model) or, without a GPU, in their place (predictions, format_predictions); the
plots (write_plots). Shared with the whole-call benchmark (fa_a2a.tools.bench_call): rank 0's log (_Log),
the run's versions and git commit, the finite check of an output, and write_result (the JSON and
the plots into --out).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from fa_a2a.tools.bench_config import DTYPES, BenchConfig
from fa_a2a.tools.bench_methods import BY_KEY, METHODS
from fa_a2a.tools.xstage import GB, US, FaTiles, PlatformModel, fused_residual


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
           "layer_speedup": None, "comm_us": None, "hiding_auto": None, "auto_over_fa_paired": None}
    if raw and raw.get("fa") and raw.get("fused_auto") and len(raw["fa"]) == len(raw["fused_auto"]):
        out["auto_over_fa_paired"] = statistics.median([u / a for u, a in zip(raw["fused_auto"], raw["fa"])])
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
        if med.get("fused_auto") is not None:
            out["hiding_auto"] = 1.0 - (med["fused_auto"] - fa) / (serial - fa)
    if serial is not None and fused is not None:
        out["speedup"] = serial / fused
    if med.get("serial_nccl") is not None and fused is not None:
        out["speedup_nccl"] = med["serial_nccl"] / fused
    if med.get("layer_nccl") is not None and med.get("layer_fused") is not None:
        out["layer_speedup"] = med["layer_nccl"] / med["layer_fused"]
    out["op_auto_over_best_paired"] = _auto_over_best(raw or {})
    return out


# impl="auto" (fa_a2a.engine.autotune) against its candidates timed in the same run: (auto, candidates)
AUTO_ROWS = (("op_emulated_auto", ("op_emulated", "op_emulated_st", "op_emulated_serial")),
             ("layer_auto", ("layer_fused", "layer_fused_st", "layer_serial", "layer_nccl")))


def over_best(raw: dict, auto: str, candidates) -> Optional[float]:
    """Median over trials of T_auto / the fastest of `candidates` in the same trial (raw: {method:
    [time per trial]}; medians as one-trial lists give the ratio of medians); None without auto or a
    candidate with auto's trial count."""
    import statistics

    ran = [raw[k] for k in candidates if raw.get(k)]
    if not raw.get(auto) or not ran or any(len(r) != len(raw[auto]) for r in ran):
        return None
    return statistics.median(a / min(r[t] for r in ran) for t, a in enumerate(raw[auto]))


def _auto_over_best(raw: dict) -> Optional[float]:
    """over_best of the first AUTO_ROWS pair that ran (the emulated op's, or the real ranks' layer)."""
    for auto, candidates in AUTO_ROWS:
        value = over_best(raw, auto, candidates)
        if value is not None:
            return value
    return None


DERIVED_COLUMNS = (
    ("e_res_us", "E_res (us)", lambda x: f"{x:+.1f}"),
    ("e_res_rel", "E_res/T_FA", lambda x: f"{100 * x:+.2f}%"),
    ("hiding", "H", lambda x: f"{100 * x:.0f}%"),
    ("hiding_auto", "H auto-paced", lambda x: f"{100 * x:.0f}%"),
    ("speedup", "T_serial/T_fused", lambda x: f"{x:.3f}x"),
    ("fused_over_fa", "T_fused/T_FA", lambda x: f"{x:.4f}"),
    ("fused_over_fa_paired", "T_fused/T_FA paired", lambda x: f"{x:.4f}"),
    ("auto_over_fa_paired", "T_auto/T_FA paired", lambda x: f"{x:.4f}"),
    ("speedup_nccl", "T_serial-NCCL/T_fused", lambda x: f"{x:.3f}x"),
    ("layer_speedup", "layer NCCL/fused", lambda x: f"{x:.3f}x"),
    ("op_auto_over_best_paired", "impl auto/best paired", lambda x: f"{x:.4f}"),
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


def q_loop_tiles(t, causal: bool) -> float:
    """KV tiles one Q tile's loop walks: all of them, or with causal masking those up to its diagonal,
    as the mean over the Q tiles (from ceil(tile_m / tile_n) for the first to all for the last)."""
    if not causal:
        return t.kv_tiles
    n_q = math.ceil(t.seqlen / t.tile_m)
    return sum(min(t.kv_tiles, math.ceil((i + 1) * t.tile_m / t.tile_n)) for i in range(n_q)) / n_q


def predictions(cfg: BenchConfig, model: PlatformModel, sigma_us: float, num_sms: int) -> dict:
    """The Burst-Gap model's predictions for each M (times in us) with no measurement: the aligned
    burst V = K * Bt, the recovery gap G*, the Q-loop gap G(M) = KV tiles * sigma (its fixed part
    dropped; causal: the mean KV tiles up to the diagonal, q_loop_tiles), the issue overhead per burst
    [V/R - G - T_iss0]+, the design test at G(M), and the sufficient sequence length M_ub* =
    tile_n * G* / sigma (causal: sigma scaled by the Q-loop's share of the KV tiles)."""
    rows = []
    mub = None
    for M in cfg.seqlens:
        t = _tiles(cfg, M, num_sms)
        V = t.volume
        share = q_loop_tiles(t, cfg.causal) / t.kv_tiles
        gap_s = t.kv_tiles * share * sigma_us * US
        mub = model.fa_min_seqlen(V, sigma_us * share * US, t.tile_n)
        rows.append({"M": M, "K": t.producers, "volume_bytes": V, "gap_us": gap_s / US,
                     "recovery_gap_us": model.recovery_gap(V) / US,
                     "issue_overhead_us": model.issue_overhead(V, gap_s) / US,
                     "design_test": _fmt_test(model.design_test(V, gap_s)), "m_ub": mub})
    return {"sigma_us": sigma_us, "num_sms": num_sms, "rows": rows, "m_ub": mub, "causal": cfg.causal}


def format_predictions(pred: dict, source: str) -> str:
    causal = " (causal: a Q tile's loop runs to its diagonal; G is the mean over the Q tiles)" if pred.get(
        "causal") else ""
    lines = [f"Burst-Gap model predictions (platform: {source}; Q-loop {pred['sigma_us']:.3f} us per KV tile, "
             f"K <= {pred['num_sms']} SMs){causal}. Model output, not measurements:",
             "| M | K | V (KiB) | Q-loop gap G (us) | G* (us) | issue overhead per burst (us) "
             "| design test at G | M_ub* |",
             "|---|---|---|---|---|---|---|---|"]
    for r in pred["rows"]:
        lines.append(f"| {r['M']} | {r['K']} | {r['volume_bytes'] / 1024:.0f} | {r['gap_us']:.1f} | "
                     f"{r['recovery_gap_us']:.2f} | {r['issue_overhead_us']:.2f} | {r['design_test']} | "
                     f"{r['m_ub']:.0f} |")
    return "\n".join(lines)


_MODEL_DEST = {"hbm": "hbm", "local": "hbm", "cuda-ipc": "hbm", "ipc": "hbm", "host": "host", "peer": "peer"}


def model_applies(model: Optional[PlatformModel], dest: str) -> bool:
    """A calibration describes the destination it measured (meta "dest"); one without says nothing. A
    calibration of another GPU's memory (calibrate --dest peer) describes neither the rows' own HBM nor
    pinned host memory: it applies to rows of dest "peer" only."""
    if model is None:
        return False
    measured = _MODEL_DEST.get(str(model.meta.get("dest")))
    return measured is None or measured == dest


def window_dest(cfg: BenchConfig, dest: str) -> str:
    """What the windows of a row are, as a calibration names it: real ranks store into other processes'
    windows ("peer": another GPU's memory on a machine of several), emulated ranks into `dest`."""
    return "peer" if cfg.real_ranks else dest


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
    if model_applies(model, window_dest(cfg, row["dest"])):
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


# ------------------------------------------------- the run record and the output (both benchmarks)
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
