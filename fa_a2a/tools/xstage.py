"""X-Stage Burst–Gap model: platform parameters, predictions, design test, and fits.

The model (paper "X-Stage", Section 3) describes device-initiated remote stores issued in bursts:
K producers each store B bytes (aggregate volume V = K·B), then run a producer-side gap G of useful
work with no stores. Accepted stores keep draining while the gap runs ("X-Stage"). Three measured
platform quantities M_X = (T_iss0, R, Q):

- ``t_iss0``     backpressure-free issue time of a recovered burst (seconds),
- ``drain_rate`` effective aggregate drain rate R (bytes/second),
- ``capacity``   effective outstanding capacity Q (bytes).

Predictions (all [x]+ = max(x, 0)):

    T_iss(G)     = max(T_iss0, V/R - G)             sender-visible burst issue time   (eq. 3)
    T_period(G)  = max(T_iss0 + G, V/R)             burst start-to-start period       (eq. 2)
    dT_iss(G)    = [V/R - G - T_iss0]+              issue overhead                    (eq. 4)
    G*           = [V/R - T_iss0]+                  recovery gap                      (eq. 5)
    q_peak       = [V - R·T_iss0]+                  isolated-burst peak outstanding   (eq. 6)
    T_iss_iso    = max(T_iss0, (V - Q)/R) if q_peak > Q else T_iss0                  (eq. 7)
    design test:   V/(T_iss0 + G) <= R  (rate)  and  [V - R·T_iss0]+ <= Q  (capacity)  (eq. 10)
    FA tiles:      Bt = b_m·d·s_out, V = K·Bt, M_ub* = b_n·G*/sigma                    (eq. 20)
    per-tile stall dt = [T_RS - T_cover]+                                             (eq. 15)

FA4's tile shape comes from FA4 itself (fa4_tile_shape); FaTiles holds one forward's tile
geometry (tiles, waves, bursts); fused_residual and FaTiles.wave_drain_bound apply the model and
a drain-queue bound to FA with its output stores in the epilogue (fa_a2a.tools.bench prints both).

Units follow the paper: R in GB/s means 1e9 bytes/s; per-producer bytes in KB and capacities in MiB
are binary (KiB = 1024 B, MiB = 2**20 B). With the paper's calibration (R = 717 GB/s, T_iss0 =
0.76 us, K = 148, 32 KiB per producer) this gives V = 4.625 MiB, G* = 6.0 us, q_peak = 4.1 MiB <
Q = 4.25 MiB, and M_ub* = 973 ~ 1.0K tokens for sigma = 0.79 us per KV tile and b_n = 128.

Every prediction accepts Python scalars (returns a float) or array-likes (returns a numpy array).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

# FA4's tile geometry lives in the engine (the pacing reads it); the model builds on it and names it here too
from fa_a2a.engine.tiles import (FaTiles, _check_positive, fa4_tile_shape, fa_burst_volume,  # noqa: F401
                                 fa_tile_burst_bytes)

KiB = 1024
MiB = 1024 * 1024
GB = 1e9  # the paper's drain rate unit: 717 GB/s = 717e9 B/s
US = 1e-6

ArrayLike = Union[float, int, Sequence[float], np.ndarray]

_JSON_FORMAT = "fa_a2a.tools.xstage.PlatformModel/1"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def _as_array(name: str, x: ArrayLike, *, allow_negative: bool = False) -> tuple[np.ndarray, bool]:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a number or an array of numbers, got {x!r}") from exc
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: must be finite, got {x!r}")
    if not allow_negative and np.any(arr < 0):
        raise ValueError(f"{name}: must be >= 0, got {x!r}")
    return arr, arr.ndim == 0


def _out(arr: np.ndarray, scalar: bool):
    return float(arr) if scalar else arr


def _pos(x: ArrayLike) -> np.ndarray:
    return np.maximum(x, 0.0)


def qloop_gap_lower_bound(seqlen: ArrayLike, sigma_per_kv_tile: float, tile_n: int):
    """Conservative Q-loop gap G_Qloop(M) >= sigma·M/b_n (fixed positive part dropped)."""
    m, scalar = _as_array("seqlen", seqlen)
    sigma = _check_positive("sigma_per_kv_tile", sigma_per_kv_tile)
    if not isinstance(tile_n, (int, np.integer)) or tile_n <= 0:
        raise ValueError(f"tile_n: must be a positive integer, got {tile_n!r}")
    return _out(sigma * m / tile_n, scalar)


def critical_path_stall(t_rs: ArrayLike, t_cover: ArrayLike):
    """Per-tile critical-path stall dt = [T_RS - T_cover]+ (eq. 15): the part of a tile's
    remote-store span that the cover window of local staging does not hide."""
    rs, s1 = _as_array("t_rs", t_rs)
    cov, s2 = _as_array("t_cover", t_cover)
    return _out(_pos(rs - cov), s1 and s2)


# --------------------------------------------------------------------------------------------
# design test result
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DesignTest:
    """Outcome of the X-Stage design test (eq. 10) for one burst volume and gap."""

    volume: float            # V, bytes
    gap: float               # G, seconds
    injection_rate: float    # V/(T_iss0 + G), bytes/s
    drain_rate: float        # R, bytes/s
    peak_outstanding: float  # [V - R·T_iss0]+, bytes
    capacity: float          # Q, bytes
    recovery_gap: float      # G* = [V/R - T_iss0]+, seconds
    capacity_is_lower_bound: bool = False  # Q >= capacity only (no knee was measured)

    @property
    def rate_ok(self) -> bool:
        """Long-term injection-rate bound V/(T_iss0 + G) <= R."""
        return self.injection_rate <= self.drain_rate

    @property
    def capacity_ok(self) -> bool:
        """Single-burst capacity bound [V - R·T_iss0]+ <= Q, shown to hold (with a lower bound
        for Q it may hold without being shown: see `undecided`)."""
        return self.peak_outstanding <= self.capacity

    @property
    def undecided(self) -> tuple[str, ...]:
        """("capacity",) when Q is only known from below and the peak exceeds that bound."""
        return ("capacity",) if self.capacity_is_lower_bound and not self.capacity_ok else ()

    @property
    def ok(self) -> bool:
        """Both bounds shown to hold."""
        return self.rate_ok and self.capacity_ok

    @property
    def failing(self) -> tuple[str, ...]:
        """Names of the bounds shown to fail: a subset of ("rate", "capacity")."""
        return tuple(n for n, good in (("rate", self.rate_ok), ("capacity", self.capacity_ok))
                     if not good and n not in self.undecided)

    def __str__(self) -> str:
        rate = "ok" if self.rate_ok else "FAILS"
        cap = "ok" if self.capacity_ok else "unknown (Q is a lower bound)" if self.undecided else "FAILS"
        return (
            f"V={self.volume / MiB:.3f} MiB, G={self.gap / US:.2f} us: "
            f"rate {self.injection_rate / GB:.1f} <= {self.drain_rate / GB:.1f} GB/s {rate}; "
            f"capacity {self.peak_outstanding / MiB:.3f} <= {'>= ' if self.capacity_is_lower_bound else ''}"
            f"{self.capacity / MiB:.3f} MiB {cap}; G* = {self.recovery_gap / US:.2f} us"
        )


# --------------------------------------------------------------------------------------------
# platform model
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlatformModel:
    """Platform model M_X = (T_iss0, R, Q) of the Burst–Gap model.

    t_iss0: backpressure-free burst issue time, seconds (for the producer configuration and
        volume it was calibrated at; the paper's T_iss0(K, V)).
    drain_rate: effective aggregate drain rate R, bytes/second.
    capacity: effective outstanding capacity Q, bytes (math.inf when not calibrated).
    meta: free-form provenance (card, date, K, B, destination); not used by predictions.
    capacity_is_lower_bound: True when no isolated burst rose above the issue floor (no knee):
        Q >= capacity is all that was measured, and capacity may then be 0 (nothing learnt).
        The design test then leaves the capacity bound undecided instead of failing it.
    """

    t_iss0: float
    drain_rate: float
    capacity: float = math.inf
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    capacity_is_lower_bound: bool = False

    def __post_init__(self):
        if not isinstance(self.capacity_is_lower_bound, (bool, np.bool_)):
            raise ValueError(f"capacity_is_lower_bound: expected a bool, got {self.capacity_is_lower_bound!r}")
        lower = bool(self.capacity_is_lower_bound)
        object.__setattr__(self, "capacity_is_lower_bound", lower)
        object.__setattr__(self, "t_iss0", _check_positive("t_iss0", self.t_iss0))
        object.__setattr__(self, "drain_rate", _check_positive("drain_rate", self.drain_rate))
        object.__setattr__(self, "capacity", _check_positive("capacity", self.capacity, allow_inf=not lower,
                                                             allow_zero=lower))
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"meta: expected a mapping, got {type(self.meta).__name__}")

    # ---- predictions ------------------------------------------------------------------------
    def drain_time(self, volume: ArrayLike):
        """V/R: time to drain a burst of `volume` bytes."""
        v, s = _as_array("volume", volume)
        return _out(v / self.drain_rate, s)

    def issue_time(self, volume: ArrayLike, gap: ArrayLike):
        """T_iss(G) = max(T_iss0, V/R - G) in steady periodic bursts (eq. 3)."""
        v, s1 = _as_array("volume", volume)
        g, s2 = _as_array("gap", gap)
        return _out(np.maximum(self.t_iss0, v / self.drain_rate - g), s1 and s2)

    def period(self, volume: ArrayLike, gap: ArrayLike):
        """T_period(G) = max(T_iss0 + G, V/R): start-to-start period (eq. 2)."""
        v, s1 = _as_array("volume", volume)
        g, s2 = _as_array("gap", gap)
        return _out(np.maximum(self.t_iss0 + g, v / self.drain_rate), s1 and s2)

    def completion_coupled_period(self, volume: ArrayLike, gap: ArrayLike):
        """Counterfactual G + V/R if the issuer waited for remote completion (Section 3.4)."""
        v, s1 = _as_array("volume", volume)
        g, s2 = _as_array("gap", gap)
        return _out(g + v / self.drain_rate, s1 and s2)

    def issue_overhead(self, volume: ArrayLike, gap: ArrayLike):
        """dT_iss(G) = [V/R - G - T_iss0]+ (eq. 4)."""
        v, s1 = _as_array("volume", volume)
        g, s2 = _as_array("gap", gap)
        return _out(_pos(v / self.drain_rate - g - self.t_iss0), s1 and s2)

    def recovery_gap(self, volume: ArrayLike):
        """G* = [V/R - T_iss0]+: the smallest gap that brings issue back to T_iss0 (eq. 5)."""
        v, s = _as_array("volume", volume)
        return _out(_pos(v / self.drain_rate - self.t_iss0), s)

    def peak_outstanding(self, volume: ArrayLike):
        """q_peak = [V - R·T_iss0]+: outstanding bytes at the end of an unconstrained issue (eq. 6)."""
        v, s = _as_array("volume", volume)
        return _out(_pos(v - self.drain_rate * self.t_iss0), s)

    def isolated_issue_time(self, volume: ArrayLike):
        """Issue time of one burst into an empty X-Stage (eq. 7):
        max(T_iss0, (V - Q)/R) when q_peak > Q, else T_iss0."""
        v, s = _as_array("volume", volume)
        q_peak = _pos(v - self.drain_rate * self.t_iss0)
        if math.isinf(self.capacity):
            t = np.full_like(v, self.t_iss0)
        else:
            t = np.where(q_peak > self.capacity,
                         np.maximum(self.t_iss0, (v - self.capacity) / self.drain_rate),
                         self.t_iss0)
        return _out(t, s)

    def knee_volume(self) -> float:
        """Aggregate volume at which an isolated burst starts to backpressure itself: Q + R·T_iss0."""
        return self.capacity + self.drain_rate * self.t_iss0

    def design_test(self, volume: float, gap: float) -> DesignTest:
        """Both bounds of eq. 10 for one recurring burst; `.failing` names the bounds that fail."""
        v, s1 = _as_array("volume", volume)
        g, s2 = _as_array("gap", gap)
        if not (s1 and s2):
            raise ValueError("volume, gap: design_test takes scalars")
        v, g = float(v), float(g)
        return DesignTest(
            volume=v,
            gap=g,
            injection_rate=v / (self.t_iss0 + g),
            drain_rate=self.drain_rate,
            peak_outstanding=max(v - self.drain_rate * self.t_iss0, 0.0),
            capacity=self.capacity,
            recovery_gap=max(v / self.drain_rate - self.t_iss0, 0.0),
            capacity_is_lower_bound=self.capacity_is_lower_bound,
        )

    def fa_min_seqlen(self, volume: float, sigma_per_kv_tile: float, tile_n: int) -> float:
        """Sufficient sequence length M_ub* = b_n·G*/sigma (eq. 20), in tokens.

        The Q-loop gap of the next output tile is at least sigma·M/b_n (its positive fixed part
        dropped), so every M >= M_ub* gives G_Qloop(M) >= G* and no drain-induced issue overhead.
        Not rounded: round up to a multiple of tile_n for a tile-aligned length.
        """
        sigma = _check_positive("sigma_per_kv_tile", sigma_per_kv_tile)
        if not isinstance(tile_n, (int, np.integer)) or tile_n <= 0:
            raise ValueError(f"tile_n: must be a positive integer, got {tile_n!r}")
        return float(tile_n) * self.recovery_gap(volume) / sigma

    # ---- serialization ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": _JSON_FORMAT,
            "t_iss0_s": self.t_iss0,
            "drain_rate_Bps": self.drain_rate,
            "capacity_B": None if math.isinf(self.capacity) else self.capacity,
            "capacity_is_lower_bound": self.capacity_is_lower_bound,
            "meta": dict(self.meta),
        }

    def to_json(self, path: Optional[Union[str, os.PathLike]] = None, *, indent: int = 2,
                extra: Optional[Mapping[str, Any]] = None) -> str:
        """JSON text of the model (plus `extra` top-level keys, e.g. raw sweeps); written to
        `path` when given. capacity = inf is stored as null."""
        d = self.to_dict()
        if extra:
            clash = set(extra) & set(d)
            if clash:
                raise ValueError(f"extra: keys {sorted(clash)} clash with the model's keys")
            d.update(extra)
        text = json.dumps(_finite_or_null(d), indent=indent, allow_nan=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PlatformModel":
        if not isinstance(d, Mapping):
            raise ValueError(f"d: expected a mapping, got {type(d).__name__}")
        fmt = d.get("format")
        if fmt != _JSON_FORMAT:
            raise ValueError(f"format: expected {_JSON_FORMAT!r}, got {fmt!r}")
        for key in ("t_iss0_s", "drain_rate_Bps", "capacity_B"):
            if key not in d:
                raise ValueError(f"{key}: missing from the platform model JSON")
        cap = d["capacity_B"]
        meta = d.get("meta")
        if meta is not None and not isinstance(meta, Mapping):
            raise ValueError(f"meta: expected a JSON object, got {type(meta).__name__}")
        return cls(
            t_iss0=d["t_iss0_s"],
            drain_rate=d["drain_rate_Bps"],
            capacity=math.inf if cap is None else cap,
            meta=dict(meta or {}),
            capacity_is_lower_bound=d.get("capacity_is_lower_bound", False),
        )

    @classmethod
    def from_json(cls, source: Union[str, os.PathLike]) -> "PlatformModel":
        """Load from JSON text or from a file path (e.g. `python -m fa_a2a.calibrate`'s output).
        A string whose first non-blank character opens a JSON object or array is text, any other
        string a path. Bad contents raise ValueError; a missing file FileNotFoundError."""
        if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
            text = source
        elif isinstance(source, (str, os.PathLike)):
            with open(source) as f:
                text = f.read()
        else:
            raise ValueError(f"source: expected JSON text or a path, got {type(source).__name__}")
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ValueError(f"source: not valid JSON ({type(exc).__name__}: {exc})") from None
        if not isinstance(d, dict):
            raise ValueError(f"source: expected a JSON object (a platform model), got a JSON {type(d).__name__}")
        return cls.from_dict(d)

    # ---- calibration ------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        *,
        zero_gap_volumes: ArrayLike,
        zero_gap_periods: ArrayLike,
        plateau_volume: float,
        plateau_gaps: ArrayLike,
        plateau_issue_times: ArrayLike,
        isolated_volumes: Optional[ArrayLike] = None,
        isolated_issue_times: Optional[ArrayLike] = None,
        isolated_floor: Optional[ArrayLike] = None,
        min_volume: float = 0.0,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> "PlatformModel":
        """Fit M_X the way the paper does, each parameter from its own experiment:

        R from zero-gap periodic bursts (T_period = V/R, points with V >= min_volume),
        T_iss0 from the large-gap plateau of a gap sweep at `plateau_volume` (gaps >= V/R),
        Q from the knee of isolated bursts (see fit_capacity; omitted -> capacity = inf).
        """
        r = fit_drain_rate(zero_gap_volumes, zero_gap_periods, min_volume=min_volume)
        t0 = fit_issue_floor(plateau_gaps, plateau_issue_times, plateau_volume, r)
        q = math.inf
        if (isolated_volumes is None) != (isolated_issue_times is None):
            raise ValueError("isolated_volumes, isolated_issue_times: give both or neither")
        lower = False
        if isolated_volumes is not None:
            cf = fit_capacity(isolated_volumes, isolated_issue_times, r, floor=isolated_floor)
            q, lower = cf.capacity, not cf.knee_found
        return cls(t_iss0=t0, drain_rate=r, capacity=q, meta=dict(meta or {}), capacity_is_lower_bound=lower)


def fused_residual(model: PlatformModel, tiles: FaTiles, t_fa: float) -> dict:
    """Burst–Gap prediction of E_res = T_fused - T_FA for FA whose epilogue stores each output
    tile (seconds). Every wave but the last is followed by the next wave's Q-loop, a gap
    G = T_FA/waves (measured, fixed part included); its aligned burst V_w stalls the issuers by
    the larger of the periodic issue overhead [V_w/R - G - T_iss0]+ (eq. 4: the X-Stage has not
    drained the previous burst) and the capacity stall T_iss_iso(V_w) - T_iss0 (eq. 7: a burst
    whose peak [V - R·T_iss0]+ exceeds Q issues at the drain rate). No Q-loop follows the last
    wave: the timed region ends when the kernel's stores have drained, max(T_iss0, V_last/R)
    later. Returns {"gap", "stalls" (per covered wave), "tail", "e_res"}. Like eq. 15 it counts a
    burst's whole stall against compute; the paper found that one-window estimate 0.45-0.82 us
    per tile above its measurements."""
    t = _check_positive("t_fa", t_fa)
    vols = tiles.wave_volumes()
    gap = t / tiles.waves
    stalls = [max(float(model.issue_overhead(v, gap)), float(model.isolated_issue_time(v)) - model.t_iss0)
              for v in vols[:-1]]
    tail = max(model.t_iss0, vols[-1] / model.drain_rate)
    return {"gap": gap, "stalls": stalls, "tail": tail, "e_res": sum(stalls) + tail}


def _finite_or_null(x):
    """x as JSON takes it: numpy arrays and numbers as Python's, every float NaN / inf (e.g. a sweep's knee
    that was not found) as None (JSON has no NaN)."""
    if isinstance(x, (np.ndarray, np.floating, np.integer)):
        x = x.tolist()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------
# fits
# --------------------------------------------------------------------------------------------
def _paired(name_x: str, x: ArrayLike, name_y: str, y: ArrayLike, *, min_len: int = 1):
    xa, _ = _as_array(name_x, x)
    ya, _ = _as_array(name_y, y)
    xa, ya = np.atleast_1d(xa), np.atleast_1d(ya)
    if xa.ndim != 1 or xa.shape != ya.shape:
        raise ValueError(f"{name_x}, {name_y}: expected 1-D arrays of equal length, got {xa.shape} and {ya.shape}")
    if xa.size < min_len:
        raise ValueError(f"{name_x}: need at least {min_len} points, got {xa.size}")
    return xa, ya


def fit_drain_rate(volumes: ArrayLike, periods: ArrayLike, *, min_volume: float = 0.0) -> float:
    """R from zero-gap steady-state periods T_period = V/R (Section 3.3).

    Least squares in relative error through the origin (each point weighs the same whatever its
    volume). Small volumes sit on the issue floor instead of the drain line: exclude them with
    `min_volume` (bytes).
    """
    v, t = _paired("volumes", volumes, "periods", periods)
    if np.any(t <= 0):
        raise ValueError("periods: must be > 0")
    keep = v >= min_volume
    if not np.any(keep & (v > 0)):
        raise ValueError(f"min_volume: no point with volume >= {min_volume} (and > 0)")
    x = v[keep] / t[keep]  # per-point rate estimate V/T
    m = x.max()
    y = x / m  # (scaled: x * x underflows or overflows for rates near float's ends)
    rate = float(m * (y * y).sum() / y.sum())  # 1/R minimises sum (1 - x/R)^2
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"volumes, periods: no finite positive drain rate fits them (got {rate})")
    return rate


def fit_issue_floor(gaps: ArrayLike, issue_times: ArrayLike, volume: float, drain_rate: float) -> float:
    """T_iss0 from the large-gap plateau of a gap sweep at one volume (Section 3.4).

    Uses the points with G >= V/R: since G* = V/R - T_iss0 <= V/R, those lie on the recovered
    plateau whatever T_iss0 is. Returns their median.
    """
    g, t = _paired("gaps", gaps, "issue_times", issue_times)
    vol = float(_as_array("volume", volume)[0])
    r = _check_positive("drain_rate", drain_rate)
    plateau = g >= vol / r
    if not np.any(plateau):
        raise ValueError(f"gaps: none reaches the drain time V/R = {vol / r / US:.3f} us; extend the sweep")
    return float(np.median(t[plateau]))


@dataclass(frozen=True)
class CapacityFit:
    """Result of fit_capacity: Q and the issue floor used, T_iss0(V) = floor_intercept + floor_slope·V."""

    capacity: float         # Q, bytes; without a knee the lower bound max(V - R·floor)+ (0: none)
    knee_volume: float      # V at which the drain branch meets the floor, bytes (nan: no knee)
    floor_intercept: float  # seconds
    floor_slope: float      # seconds per byte (0 for a constant floor)
    knee_found: bool        # False: no point rose above the floor; capacity is then a lower bound
    rms_rel_error: float    # of the fitted curve against the points

    def as_dict(self) -> dict:
        return asdict(self)


def _q_search(v: np.ndarray, t: np.ndarray, floor: np.ndarray, r: float) -> tuple[float, float]:
    """Q minimising the relative SSE of max(floor, (V - Q)/R) against t; returns (Q, sse)."""

    def sse(q: np.ndarray) -> np.ndarray:
        pred = np.maximum(floor[None, :], (v[None, :] - q[:, None]) / r)
        return (((pred - t[None, :]) / t[None, :]) ** 2).sum(axis=1)

    lo, hi = 0.0, float(v.max())
    best_q = hi
    for _ in range(3):  # coarse grid, then two refinements around the best point
        qs = np.linspace(lo, hi, 2001)
        e = sse(qs)
        i = int(np.argmin(e))
        best_q = float(qs[i])
        step = (hi - lo) / 2000
        lo, hi = max(0.0, best_q - 2 * step), best_q + 2 * step
    return best_q, float(sse(np.array([best_q]))[0])


def fit_capacity(volumes: ArrayLike, issue_times: ArrayLike, drain_rate: float, *,
                 floor: Optional[ArrayLike] = None, n_iter: int = 8) -> CapacityFit:
    """Q from the isolated-burst knee (Section 3.5): fit T_iso(V) = max(T_iss0(V), (V - Q)/R)
    with R fixed.

    floor: the backpressure-free issue time per point (a scalar T_iss0, or an array such as the
    local-memory control's issue times at the same volumes). When omitted the floor is fitted as
    an affine a + b·V to the points below the knee (start: the smallest third of the volumes),
    alternating with the Q search until the split stops changing.

    When no point lies on the drain branch (no knee in the swept range, or points on the drain
    line itself, which an affine floor fits as well) Q is not measured: knee_found is False and
    capacity is the tightest lower bound max(V - R·floor)+ over the points, 0.0 when the sweep
    says nothing about Q (PlatformModel.fit then marks its Q a lower bound).
    """
    v, t = _paired("volumes", volumes, "issue_times", issue_times, min_len=3)
    r = _check_positive("drain_rate", drain_rate)
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"n_iter: expected an int >= 1, got {n_iter!r}")
    if np.any(v <= 0):
        raise ValueError(f"volumes: must be > 0, got {v.tolist()}")
    if np.unique(v).size < 2:
        raise ValueError(f"volumes: need at least 2 distinct volumes to fit a floor, got {v.tolist()}")
    if np.any(t <= 0):
        raise ValueError("issue_times: must be > 0")
    order = np.argsort(v)
    v, t = v[order], t[order]

    if floor is not None:
        f, fs = _as_array("floor", floor)
        if fs:
            f = np.full_like(v, float(f))
        elif f.shape != v.shape:
            raise ValueError(f"floor: expected a scalar or {v.shape[0]} values, got shape {f.shape}")
        else:
            f = f[order]
        q, sse = _q_search(v, t, f, r)
        a, b = (float(np.median(f)), 0.0) if fs else (float("nan"), float("nan"))
        if not fs:  # affine summary of the given floor for the knee volume
            b, a = np.polyfit(v, f, 1) if v.size >= 2 else (0.0, float(f[0]))
    else:
        below = np.zeros_like(v, dtype=bool)
        below[: max(2, v.size // 3)] = True
        q, sse = float(v.max()), float("inf")
        for _ in range(n_iter):
            b, a = np.polyfit(v[below], t[below], 1) if below.sum() >= 2 else (0.0, float(t[below][0]))
            b = max(float(b), 0.0)
            f = a + b * v
            q, sse = _q_search(v, t, f, r)
            new_below = f >= (v - q) / r
            if new_below.sum() < 2:
                new_below[:2] = True
            if np.array_equal(new_below, below):
                break
            below = new_below
        a, b = float(a), float(b)
        f = a + b * v

    drain_branch = (v - q) / r > f
    knee_found = bool(np.any(drain_branch))
    if knee_found:
        denom = 1.0 - r * b
        knee = (q + r * a) / denom if denom > 0 else float("inf")
    else:
        # flat SSE for every Q above all points: report the tightest lower bound
        q = float(np.max(v - r * f))
        q = max(q, 0.0)
        knee = float("nan")
    rms = math.sqrt(sse / v.size)
    return CapacityFit(capacity=q, knee_volume=float(knee), floor_intercept=float(a), floor_slope=float(b),
                       knee_found=knee_found, rms_rel_error=rms)
