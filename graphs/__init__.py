"""CUDA-graph capture/replay and steady-state timing (events, medians, rank max, clock monitor)."""
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
    "time_graphs",
]
