"""CUDA-graph capture/replay and steady-state timing (graph replays, eager calls, medians, rank max,
clock monitor): the one timing loop of the benchmark, the calibration and the examples."""
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
