"""CUDA-graph capture/replay and steady-state timing (one loop for graph replays and eager batches,
medians, rank max, clock monitor) for the benchmarks, the calibration and the examples."""
from graphs.timing import (
    DRIFT_TOL,
    GpuClockMonitor,
    capture,
    eager_batch,
    input_sets_needed,
    l2_cache_bytes,
    median,
    rank_max,
    rotated,
    round_up,
    time_batches,
    time_eager,
    time_graphs,
)

__all__ = [
    "DRIFT_TOL",
    "GpuClockMonitor",
    "capture",
    "eager_batch",
    "input_sets_needed",
    "l2_cache_bytes",
    "median",
    "rank_max",
    "rotated",
    "round_up",
    "time_batches",
    "time_eager",
    "time_graphs",
]
