"""Steady-state timing of CUDA-graph replays (and of eager batches).

The method follows the X-Stage paper (Sec. 5.3, "Measurement methodology"):

- The CuTe DSL Python launch path costs about as much as a short FA4 kernel, so every method is
  captured as N back-to-back calls in one CUDA graph (`capture`) and only replays are timed, with
  CUDA events on the current stream.
- Sender-side timing boundary: the timed region of one replay is the N calls plus ONE call of
  `barrier` (e.g. the cross-rank barrier kernel, or a 1-element NCCL all_reduce), not a barrier
  per call. The reported number is (elapsed of that region) / N, in microseconds. The same barrier
  is also called once before the start event, untimed, so that ranks start their replays together.
- Warm-up replays first; then `trials` timed replays per method, the method order rotated by one
  every trial (trial t runs names[t:] + names[:t]) so no method always follows the same neighbour.
- Per trial the maximum over ranks is kept (all_reduce MAX over `group` when it has > 1 rank);
  callers report the median over trials (`median`).
- Eager calls (`time_eager`): the same N calls launched from Python without a graph, host wall
  time from before the first launch to the end of the GPU work: it shows whether a call is
  GPU-bound (eager ~ graph time) or bound by its host path (launches, checks, dispatch).
- One loop times them all (`time_batches`): a batch is any callable that issues the N calls (a
  graph's replay, an `eager_batch`), with a caller's `before` (untimed) and `after` (timed) step.
- DVFS: `GpuClockMonitor` samples the SM clock and temperature through NVML while each replay runs
  and warns when a method's clock moved by more than 5% between its first and last sample.

L2: at small M a method's whole working set can stay in the 50 MB L2 of an H100/H200, and
back-to-back calls on the same tensors would then time warm-cache kernels. To avoid that, the
caller builds k = `input_sets_needed(bytes_per_set)` independent input/output sets and passes the
method as a list of k callables, one per set; call i of the graph then runs callable i % k:

    sets = [make_inputs() for _ in range(input_sets_needed(set_bytes))]
    methods = {"fa": [functools.partial(fa, *s) for s in sets], ...}
    times = time_graphs(methods, n_calls=round_up(n, len(sets)), trials=15, warmup=3)
"""
from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

Fn = Callable[[], object]
Calls = Union[Fn, Sequence[Fn]]

DRIFT_TOL = 0.05  # relative SM-clock change within one method that triggers a warning


def _check_methods(methods, n_calls, trials, barrier):
    """The arguments time_graphs and time_eager share -> (method names, {name: list of callables})."""
    if not methods:
        raise ValueError("methods: empty")
    calls = {name: _as_calls(fn, f"methods[{name!r}]") for name, fn in methods.items()}
    _check_count(n_calls, "n_calls", 1)
    _check_count(trials, "trials", 1)
    if barrier is not None and not callable(barrier):
        raise ValueError("barrier: expected a callable or None")
    return list(methods), calls


def _as_calls(fn: Calls, name: str = "fn") -> list:
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    if not fns or not all(callable(f) for f in fns):
        raise ValueError(f"{name}: expected a callable or a non-empty sequence of callables")
    return fns


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def rotated(names: Sequence[str], trial: int) -> list:
    """Method order of trial `trial`: the list rotated left by trial % len(names)."""
    names = list(names)
    if not names:
        return names
    r = trial % len(names)
    return names[r:] + names[:r]


def median(values: Sequence[float]) -> float:
    if len(values) == 0:
        raise ValueError("values: empty")
    return float(statistics.median(values))


def l2_cache_bytes(device=None) -> int:
    """L2 size of a CUDA device in bytes (torch's device properties)."""
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def input_sets_needed(bytes_per_set: int, l2_bytes: Optional[int] = None, *, factor: float = 2.0,
                      max_sets: int = 16) -> int:
    """Number of input sets to rotate so that one call does not find the previous call's data in
    L2: ceil(factor * L2 / bytes_per_set), clamped to [1, max_sets]. A set is everything one call
    reads or writes (inputs and outputs). l2_bytes defaults to the current CUDA device's L2."""
    if isinstance(bytes_per_set, bool) or not isinstance(bytes_per_set, int) or bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set: expected a positive int, got {bytes_per_set!r}")
    if factor <= 0:
        raise ValueError(f"factor: expected > 0, got {factor!r}")
    _check_count(max_sets, "max_sets", 1)
    if l2_bytes is None:
        l2_bytes = l2_cache_bytes()
    if l2_bytes < 0:
        raise ValueError(f"l2_bytes: expected >= 0, got {l2_bytes!r}")
    return max(1, min(max_sets, math.ceil(factor * l2_bytes / bytes_per_set)))


def calls_for(call_us: float, target_ms: float) -> int:
    """Back-to-back calls of one captured or eager batch: enough that the batch lasts about target_ms when
    one call takes call_us, 3 to 200."""
    return max(3, min(200, math.ceil(target_ms * 1e3 / max(call_us, 1e-3))))


def round_up(n: int, multiple: int) -> int:
    if multiple < 1:
        raise ValueError(f"multiple: expected >= 1, got {multiple!r}")
    return -(-n // multiple) * multiple


def capture(fn: Calls, n_calls: int, *, eager_warmup: int = 1, pool=None) -> "torch.cuda.CUDAGraph":
    """Capture `n_calls` back-to-back calls into a CUDA graph and return it (not yet replayed).

    `fn` is a callable or a sequence of k callables (one per input set); call i runs fn[i % k].
    Each callable is first run `eager_warmup` times on a side stream (kernel compilation, cuBLAS
    and NCCL workspaces happen outside the capture), as torch's graph docs require. The callables
    must only launch work on the current stream and must not synchronize with the host.
    """
    fns = _as_calls(fn)
    _check_count(n_calls, "n_calls", 1)
    _check_count(eager_warmup, "eager_warmup", 0)
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(eager_warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for i in range(n_calls):
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    return graph


def rank_max(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise maximum of `values` over the ranks of `group` (identity without a process
    group or with one rank). Uses a CUDA tensor when the group's backend is NCCL."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    if dist.get_world_size(group) <= 1:
        return values
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    buf = values.to(device=device, dtype=torch.float64).contiguous()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf.to(values.device, values.dtype)


class GpuClockMonitor:
    """SM clock (MHz) and GPU temperature (C) samples from NVML, kept per label (method name).

    `sample(label)` reads the clocks now; `check(label)` warns when the label's last SM-clock
    sample differs from its first by more than `drift_tol` (relative). Without nvidia-ml-py or
    NVML (or without a GPU) the monitor is inert: `available` is False and `reason` says why.
    """

    def __init__(self, device=None, *, drift_tol: float = DRIFT_TOL, enabled: bool = True):
        if drift_tol <= 0:
            raise ValueError(f"drift_tol: expected > 0, got {drift_tol!r}")
        self.drift_tol = drift_tol
        self.samples: dict = {}
        self.warnings: list = []
        self.available = False
        self.reason = "disabled"
        self._nvml = None
        self._handle = None
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = self._nvml_index(device)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.available = True
            self.reason = ""
        except Exception as e:  # no nvidia-ml-py, no driver, no device
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"

    @staticmethod
    def _nvml_index(device) -> int:
        if torch.cuda.is_available():
            dev = torch.cuda.current_device() if device is None else device
            try:  # honours CUDA_VISIBLE_DEVICES (NVML numbers all GPUs of the host)
                return torch.cuda._get_nvml_device_index(dev)
            except Exception:
                return dev if isinstance(dev, int) else (torch.device(dev).index or 0)
        return 0 if device is None else int(device)

    def read(self):
        """(sm_clock_mhz, temperature_c) now, or None when unavailable."""
        if not self.available:
            return None
        n = self._nvml
        clock = n.nvmlDeviceGetClockInfo(self._handle, n.NVML_CLOCK_SM)
        temp = n.nvmlDeviceGetTemperature(self._handle, n.NVML_TEMPERATURE_GPU)
        return int(clock), int(temp)

    def sample(self, label: str):
        s = self.read()
        if s is not None:
            self.record(label, *s)
        return s

    def record(self, label: str, sm_clock_mhz: float, temperature_c: float) -> None:
        self.samples.setdefault(label, []).append((float(sm_clock_mhz), float(temperature_c)))

    def drift(self, label: str) -> Optional[float]:
        """Largest relative clock change among the label's SM-clock samples, signed by direction
        (a dip in the middle counts, not only first vs last); None with < 2 samples."""
        s = [c for c, _ in self.samples.get(label, [])]
        if len(s) < 2 or min(s) <= 0:
            return None
        hi, lo = max(s), min(s)
        falling = s.index(hi) < len(s) - 1 - s[::-1].index(lo)  # the maximum comes before the minimum
        return (lo - hi) / hi if falling else (hi - lo) / lo

    def check(self, label: str) -> Optional[str]:
        d = self.drift(label)
        if d is None or abs(d) <= self.drift_tol:
            return None
        s = self.samples[label]
        clocks = [c for c, _ in s]
        msg = (f"SM clock drifted {100 * d:+.1f}% during {label!r} "
               f"({s[0][0]:.0f} -> {s[-1][0]:.0f} MHz, range {min(clocks):.0f}-{max(clocks):.0f} MHz, "
               f"{s[0][1]:.0f} -> {s[-1][1]:.0f} C): "
               "rerun this point once clocks are stable")
        self.warnings.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return msg

    def summary(self) -> dict:
        out = {}
        for label, s in self.samples.items():
            clocks = [c for c, _ in s]
            temps = [t for _, t in s]
            out[label] = {
                "n": len(s),
                "sm_clock_mhz": {"first": clocks[0], "last": clocks[-1], "min": min(clocks), "max": max(clocks)},
                "temperature_c": {"first": temps[0], "last": temps[-1], "min": min(temps), "max": max(temps)},
                "drift": self.drift(label),
            }
        return out

    def device_info(self) -> dict:
        """Static clock facts (max SM clock, driver) for the record; empty when unavailable."""
        if not self.available:
            return {}
        n = self._nvml
        info = {}
        for key, f in (("max_sm_clock_mhz", lambda: n.nvmlDeviceGetMaxClockInfo(self._handle, n.NVML_CLOCK_SM)),
                       ("driver", lambda: n.nvmlSystemGetDriverVersion()),
                       ("power_limit_w", lambda: n.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000)):
            try:
                v = f()
                info[key] = v.decode() if isinstance(v, bytes) else v
            except Exception:
                pass
        return info


def eager_batch(fn: Calls, n_calls: int) -> Fn:
    """One eager batch: `n_calls` back-to-back calls launched from Python (call i runs fn[i % k]),
    their outputs dropped as they come."""
    fns = _as_calls(fn)
    _check_count(n_calls, "n_calls", 1)

    def batch() -> None:
        for i in range(n_calls):
            fns[i % len(fns)]()

    return batch


def time_batches(batches: Mapping[str, Fn], n_calls: int, trials: int, warmup: int = 0, *,
                 before: Optional[Fn] = None, after: Optional[Fn] = None, group=None, host_clock: bool = False,
                 monitor: Optional[GpuClockMonitor] = None,
                 progress: Optional[Callable[[str, int], None]] = None) -> dict:
    """The one timing loop: per-call time in microseconds of each batch (a callable that issues
    `n_calls` calls: a graph's replay, an eager_batch), one value per trial: {name: [t_0, ...]}.

    `warmup` untimed runs of every batch, then `trials` rounds; round t runs the batches in
    `rotated(names, t)` order. One timed run is: before() (untimed) | start | batch() | after() |
    end, its value (end - start) / n_calls; start and end are CUDA events on the current stream, or
    with `host_clock` the host's clock after a torch.cuda.synchronize (the host's launch path and the
    GPU work, whichever is longer). With a process group of > 1 rank each value is the maximum over
    ranks (one all_reduce MAX at the end; all ranks pass the same names). `monitor` samples the clocks
    at every timed run (an event-timed batch still running) and checks each batch's drift at the end;
    `progress(name, trial)` is called after every timed run."""
    names = list(batches)
    if not names:
        raise ValueError("batches: empty")
    _check_count(n_calls, "n_calls", 1)
    _check_count(trials, "trials", 1)
    _check_count(warmup, "warmup", 0)
    before = before or (lambda: None)
    after = after or (lambda: None)
    if monitor is None:
        monitor = GpuClockMonitor(enabled=False)
    for _ in range(warmup):
        for name in names:
            before()
            batches[name]()
            after()
    torch.cuda.synchronize()

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    raw = torch.zeros(trials, len(names), dtype=torch.float64)
    for t in range(trials):
        for name in rotated(names, t):
            before()
            if host_clock:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                batches[name]()
                after()
                torch.cuda.synchronize()
                us = (time.perf_counter() - t0) * 1e6
                monitor.sample(name)
            else:
                start.record()
                batches[name]()
                after()
                end.record()
                monitor.sample(name)  # read while the batch is (usually) still running
                end.synchronize()
                us = start.elapsed_time(end) * 1e3
            raw[t, names.index(name)] = us / n_calls
            if progress is not None:
                progress(name, t)
    for name in names:
        monitor.check(name)
    raw = rank_max(raw, group)
    return {name: raw[:, j].tolist() for j, name in enumerate(names)}


def time_graphs(methods: Mapping[str, Calls], n_calls: int, trials: int, warmup: int = 3,
                barrier: Optional[Fn] = None, group=None, *, monitor: Optional[GpuClockMonitor] = None,
                progress: Optional[Callable[[str, int], None]] = None,
                after_capture: Optional[Fn] = None) -> dict:
    """Per-call time in microseconds of each method, one value per trial: {name: [t_0, ...]}.

    Each method (a callable, or a list of callables rotated over input sets, see `capture`) is
    captured once as `n_calls` back-to-back calls. Then `warmup` untimed replays of every method,
    then `trials` rounds; round t replays the methods in `rotated(names, t)` order. One timed
    replay is: barrier() (untimed) | start event | graph replay | barrier() | end event, and its
    value is elapsed / n_calls. With a process group of > 1 rank each value is the maximum over
    ranks (one all_reduce MAX at the end; all ranks must pass the same method names). `progress`,
    if given, is called as progress(name, trial) after every timed replay. `after_capture`, if
    given, runs once after all captures and before the first replay (capture runs each callable
    eagerly first, so e.g. poisoning outputs there shows what the replays wrote).
    """
    names, calls = _check_methods(methods, n_calls, trials, barrier)
    _check_count(warmup, "warmup", 0)
    # One private memory pool per graph: graphs that share a pool must replay in capture order,
    # and the order here rotates.
    graphs = {name: capture(calls[name], n_calls) for name in names}
    if after_capture is not None:
        after_capture()
        torch.cuda.synchronize()
    return time_batches({name: graphs[name].replay for name in names}, n_calls, trials, warmup, before=barrier,
                        after=barrier, group=group, monitor=monitor, progress=progress)


def time_eager(methods: Mapping[str, Calls], n_calls: int, trials: int, barrier: Optional[Fn] = None,
               group=None) -> dict:
    """Wall time per call in microseconds of `n_calls` eager back-to-back calls (no graph), one
    value per trial: {name: [t_0, ...]}. One timed run is: barrier() | synchronize | host clock |
    n_calls calls (call i runs fn[i % k]) | barrier() | synchronize | host clock; so it covers the
    host's launch path and the GPU work, whichever is longer. Method order rotated per trial,
    maximum over the ranks of `group` as in `time_graphs`. Call every method once before (compiles)."""
    names, calls = _check_methods(methods, n_calls, trials, barrier)
    return time_batches({name: eager_batch(calls[name], n_calls) for name in names}, n_calls, trials,
                        before=barrier, after=barrier, group=group, host_clock=True)
