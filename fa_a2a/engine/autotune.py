"""impl="auto": the op times its own paths on the machine it runs on, once, and keeps the fastest.

Why: every path computes the same bits (the All-to-All only moves data), but which one is fastest
depends on the machine, and a rule tuned on one GPU cannot know it: on 8 x H200 (NVSwitch) TMA bulk
stores into peer memory imported from another process collapse to ~130 GB/s per rank when 8 ranks
store at once, where st.global holds ~325 GB/s (fast-ulysses, h200_a2a_tma_vs_nontma report); over
PCIe, stores issued by SMs into peer memory are 5-13x slower than copy engines (FlashInfer #4876).
On one H200 every "peer" is the same HBM and none of this shows.

Candidates ("labels"; the applicable ones, in this order, which is also the tie order):
  "fused:tma"  FA4 storing O tiles into the owners' windows with TMA bulk stores (S_loc a multiple
               of the tile's rows: a tile never straddles two ranks)
  "fused:st"   the same kernel with per-thread 16-byte stores (any S_loc)
  "serial"     FA4, then the post-A2A kernel
  "nccl"       permute + all_to_all_single around FA4 (real ranks, an NCCL group, one GPU per rank)
The fused candidates are paced as the call's `pace` decides (fa_a2a.engine.pacing).

The decision, at the first call of a signature (every rank at the same call, as every call is):
  1. FA_A2A_IMPL (a label above, or "fused" / "reference"; the same on every rank) forces it;
  2. else this machine's record of the signature on disk, where every rank has the same one;
  3. else every candidate runs WARMUP + TRIALS times on the call's own inputs, round robin, all
     ranks in lock step (each call has its barriers: fan-in as in the real call), a CUDA event
     pair around each call; per candidate the median on each rank, then the max over the ranks
     (every rank gets every rank's times, so all pick alike). The fastest wins; a candidate within
     TIE of it that comes first in the order above wins instead (ties -> fused). The choice and
     its times are written to disk and logged once (logger "fa_a2a.engine.autotune", level INFO).
  A first call under CUDA-graph capture takes the static rule (fused, TMA where S_loc allows) and
  says so once; CPU tensors have one candidate (real ranks: nccl, emulated: reference).
Records live in <compile cache folder>/impl/ (fa_a2a's disk cache: FA_A2A_CACHE_DIR, FA_A2A_CACHE=0
turns it off), one JSON file per key: the GPU's name, the GPU count, the driver, the transport, the
ranks per GPU, the world size and the signature (shapes, dtype, causal, joint rows, pace, ...). A
record of another machine or driver has another key and is never read. clear_records() (or
removing the folder) makes the next process measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from fa_a2a.engine.log import log_once
from fa_a2a.engine.problem import AUTO_LABELS, ENV_IMPL, forced_label, split_impl

__all__ = ["LABELS", "TIE", "TRIALS", "WARMUP", "Choice", "candidates", "choose", "concrete", "decide", "decide_path",
           "decisions", "decision_text", "forced_label", "record_key", "read_record", "write_record", "records_dir",
           "clear_records", "static_choice", "time_candidates"]

logger = logging.getLogger(__name__)

LABELS = AUTO_LABELS
TIE = 0.01  # candidates within 1% of the fastest count as tied
TRIALS = 5
WARMUP = 1  # the first call of a candidate compiles and allocates; the next is timed


@dataclasses.dataclass(frozen=True)
class Choice:
    """A decision: label (one of LABELS, or "reference"), how it was reached (source: "measured",
    "disk", "forced", "static", "only"), the candidates' times in seconds (max over ranks; measured
    decisions and disk records), the cost of the measurement in seconds, and why, in words."""

    label: str
    source: str
    times: Optional[Mapping[str, float]] = None
    cost_s: float = 0.0
    reason: str = ""

    def describe(self) -> str:
        times = ""
        if self.times:
            times = " (" + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in self.times.items()) + ")"
        cost = f"; measuring took {self.cost_s * 1e3:.0f} ms" if self.source == "measured" else ""
        return f"{self.label}, {self.source}{times}{cost}" + (f": {self.reason}" if self.reason else "")


def concrete(problem, label: str):
    """The Problem of impl "auto" with a decided label in its place (pace only applies to fused)."""
    impl, o_store = split_impl(label)
    return dataclasses.replace(problem, impl=impl, o_store=o_store,
                               pace=problem.pace if impl == "fused" else None)


def candidates(seq_loc: int, tile_m: int, nccl: bool) -> tuple:
    """The applicable labels: fused:tma where tile_m divides S_loc, fused:st, serial, nccl where it runs."""
    labels = (("fused:tma",) if seq_loc % tile_m == 0 else ()) + ("fused:st", "serial")
    return labels + (("nccl",) if nccl else ())


def static_label(seq_loc: int, tile_m: int) -> str:
    """The static rule (what impl "fused" does): TMA O-stores where S_loc allows, else st."""
    return "fused:tma" if seq_loc % tile_m == 0 else "fused:st"


def choose(per_rank: Sequence[Mapping[str, float]]) -> tuple:
    """(label, {label: max over ranks}) from every rank's {label: seconds}: the fastest by its
    slowest rank; a label within TIE of it that comes earlier in LABELS wins instead."""
    labels = [label for label in LABELS if label in per_rank[0]]
    worst = {label: max(times[label] for times in per_rank) for label in labels}
    best = min(worst.values())
    return next(label for label in labels if worst[label] <= best * (1 + TIE)), worst


# ---- records on disk ---------------------------------------------------------------------------
def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return str(version) if err == driver.CUresult.CUDA_SUCCESS else "unknown"
    except Exception:  # no driver API: a CPU machine
        return "none"


def machine_facts(device: torch.device) -> dict:
    """What decides the fastest path besides the call: the GPU model and count, the driver."""
    if device.type != "cuda":
        return dict(gpu="cpu")
    return dict(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(), driver=_driver_version())


def record_key(problem, transport, entry: str = "ulysses_attention") -> dict:
    """The key of a decision: the machine, the transport, and the signature's agreed fields (text)."""
    fields = {name: repr(value) for name, value in problem.agreed_fields() if name not in ("impl", "o_store")}
    return dict(machine_facts(transport.device), transport=type(transport).__name__,
                ranks_per_gpu=transport.ranks_per_gpu, entry=entry, **fields)  # fields hold world_size


def records_dir() -> Path:
    from cute_kernels.compile_cache import cache_dir

    return cache_dir() / "impl"


def _record_file(key: Mapping) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return records_dir() / f"{digest}.json"


_RECORD_MAX_BYTES = 1 << 16  # a record is a few hundred bytes


def read_record(key: Mapping, labels: Sequence[str]) -> Optional[Choice]:
    """This machine's decision of `key`, if one is on disk, its key matches and its label is one of
    `labels`; None otherwise (and with the disk cache off)."""
    from cute_kernels.compile_cache import enabled

    if not enabled():
        return None
    path = _record_file(key)
    try:
        # a plain file of a record's size (not a FIFO, which would block the read)
        if not path.is_file() or path.stat().st_size > _RECORD_MAX_BYTES:
            return None
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("key") != dict(key) or data.get("label") not in labels:
            return None
        times = data.get("times")
        if times is not None and not (isinstance(times, dict) and all(
                t in labels and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                and v >= 0 for t, v in times.items())):
            return None  # a foreign or damaged record: measured again (and written over)
    except (OSError, ValueError, OverflowError, RecursionError):  # unreadable, not JSON, a huge int, nested deep
        return None
    return Choice(data["label"], "disk", times, reason="read from disk, not measured")


def write_record(key: Mapping, choice: Choice) -> None:
    """Keep a measured decision (atomically: a temporary file renamed over the record)."""
    from cute_kernels.compile_cache import enabled

    if not enabled():
        return
    path = _record_file(key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(key=dict(key), label=choice.label, times=dict(choice.times or {})), indent=1))
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        logger.warning("fa_a2a impl='auto': could not write its record to %s (%s); the next process measures again",
                       path, e)


def clear_records() -> int:
    """Remove every decision kept on disk (the next process measures again) -> how many were removed."""
    folder = records_dir()
    removed = 0
    for path in folder.glob("*.json") if folder.is_dir() else ():
        if path.is_dir():  # not a record
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


# ---- measuring ----------------------------------------------------------------------------------
def time_candidates(labels: Sequence[str], run: Callable[[str], object], device, trials: int = TRIALS) -> dict:
    """{label: median seconds} of run(label) on this rank: WARMUP calls each (compiles, allocations,
    the ranks lined up), then `trials` rounds of one call each, round robin, a CUDA event pair
    around each call (the call's host gaps included, as an eager caller sees them)."""
    for _ in range(WARMUP):
        for label in labels:
            run(label)
    torch.cuda.synchronize(device)
    marks: dict = {label: [] for label in labels}
    for _ in range(trials):
        for label in labels:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(label)
            end.record()
            marks[label].append((start, end))
    torch.cuda.synchronize(device)
    return {label: statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e-3 for label, pairs in marks.items()}


_decisions: dict = {}  # record key (text) -> Choice, this process's decisions


def decisions() -> dict:
    """This process's decisions: {record key as JSON text: Choice}."""
    return dict(_decisions)


def decision_text(entry: str, seq_loc: int) -> Optional[str]:
    """The newest decision of `entry` ("ulysses_attention", "ulysses_qkv_attention") at S_loc rows,
    in words (Choice.describe), or None (the benchmarks print it)."""
    made = [c for key, c in _decisions.items() if f'"entry": "{entry}"' in key and f'"seq_loc": "{seq_loc}"' in key]
    return made[-1].describe() if made else None


def _log(key: Mapping, choice: Choice) -> Choice:
    text = json.dumps(key, sort_keys=True)
    _decisions[text] = choice
    log_once(logger, ("impl auto", text, choice.label, choice.source), logging.INFO, "fa_a2a impl='auto' (%s): %s",
             ", ".join(f"{k}={v}" for k, v in key.items()), choice.describe())
    return choice


def static_choice(label: str, reason: str, key: Optional[Mapping] = None) -> Choice:
    """A decision by rule, logged once (key: what it is for, as record_key gives it)."""
    return _log(key or {"rule": reason}, Choice(label, "static", reason=reason))


def decide_path(problem, transport, run: Callable[[str], object], q, *, nccl: bool = False,
                entry: str = "ulysses_attention") -> Choice:
    """decide() over `problem`'s candidates on q's device: fused:tma where the fused kernel's output
    tile (its rows on this architecture) divides S_loc, fused:st, serial, nccl where `nccl` says it
    runs; the static rule where nothing can be timed."""
    from cute_kernels.fa4 import device_arch, tile_m_for

    tile_m, seq_loc = tile_m_for(problem.head_dim, problem.causal, device_arch(q)), problem.layout.seq_loc
    return decide(problem, transport, run, candidates(seq_loc, tile_m, nccl), static_label(seq_loc, tile_m), entry)


def decide(problem, transport, run: Callable[[str], object], labels: Sequence[str], static: str,
           entry: str = "ulysses_attention") -> Choice:
    """impl "auto"'s decision for `problem` on `transport` (module docstring; collective: every rank
    calls it at the same call). run(label): one whole call of that candidate on the call's inputs.
    labels: the applicable candidates (candidates()); static: the static rule's label."""
    key = record_key(problem, transport, entry)
    forced = forced_label()
    capturing = transport.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:
        return _log(key, Choice(static, "static", reason="the first call of this signature is under CUDA-graph "
                                "capture, where candidates cannot be timed"))
    record = None if forced else read_record(key, labels)
    everyone = transport.host_allgather("fa_a2a impl auto", (forced, None if record is None else record.label))
    if any(f != forced for f, _ in everyone):
        shown = ", ".join(f"rank {r}: {f!r}" for r, (f, _) in enumerate(everyone))
        raise ValueError(f"{ENV_IMPL}: expected the same value on every rank, got {shown}")
    if forced is not None:
        label = static if forced == "fused" else forced
        if label not in labels and label != "reference":
            raise ValueError(f"{ENV_IMPL}: {forced!r} does not run this call (the candidates here: {tuple(labels)})")
        return _log(key, Choice(label, "forced", reason=f"{ENV_IMPL}={forced}"))
    if len(labels) == 1:
        return _log(key, Choice(labels[0], "only", reason="the one candidate that runs here"))
    if record is not None and all(r == record.label for _, r in everyone):
        return _log(key, record)
    start = time.perf_counter()
    mine = time_candidates(labels, run, transport.device)
    label, worst = choose(transport.host_allgather("fa_a2a impl auto times", mine))
    choice = Choice(label, "measured", worst, time.perf_counter() - start)
    write_record(key, choice)
    return _log(key, choice)
