"""CUDA-graph capture/replay and steady-state timing (graph replays, eager calls, medians, rank max,
clock monitor) for the per-kernel benchmark, the calibration and the examples (the torchrun
whole-call benchmark, fa_a2a.tools.bench_call, times rank-aligned batches with its own loop)."""
from graphs.timing import (
    DRIFT_TOL,
    GpuClockMonitor,
    capture,
    input_sets_needed,
    l2_cache_bytes,
    median,
    rank_max,
    rotated,
    round_up,
    time_eager,
    time_graphs,
)

__all__ = [
    "DRIFT_TOL",
    "GpuClockMonitor",
    "capture",
    "input_sets_needed",
    "l2_cache_bytes",
    "median",
    "rank_max",
    "rotated",
    "round_up",
    "time_eager",
    "time_graphs",
]
