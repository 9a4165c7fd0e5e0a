"""FA4's output tiles on the SMs: the geometry the store pacing (fa_a2a.engine.pacing) and the X-Stage
Burst-Gap model (fa_a2a.tools.xstage) both read. FA4's own tile table is read through cute_kernels.fa4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FaTiles", "fa4_tile_shape", "fa_tile_burst_bytes", "fa_burst_volume"]


def _check_positive(name: str, value: float, *, allow_inf: bool = False, allow_zero: bool = False) -> float:
    """float(value) for an int or float (numpy's too) that is > 0 (>= 0 with allow_zero) and finite
    (or inf with allow_inf); bools and strings are refused: True is not 1 s, "1e-6" is not a number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name}: expected a number in float's range, got an int of {len(str(value))} "
                         "digits") from None
    if math.isnan(v) or v < 0 or (v == 0 and not allow_zero) or (math.isinf(v) and not allow_inf):
        what = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name}: must be a {what}{'' if allow_inf else ' finite'} number, got {value!r}")
    return v


# --------------------------------------------------------------------------------------------
# FlashAttention tile helpers
# --------------------------------------------------------------------------------------------
def fa_tile_burst_bytes(tile_m: int, head_dim: int, out_bytes: int) -> int:
    """Bytes one CTA stores at an output-tile boundary: Bt = b_m·d·s_out (FA4 bf16 128x128: 32 KiB)."""
    for name, v in (("tile_m", tile_m), ("head_dim", head_dim), ("out_bytes", out_bytes)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    return int(tile_m) * int(head_dim) * int(out_bytes)


def fa_burst_volume(num_producers: int, tile_m: int, head_dim: int, out_bytes: int) -> int:
    """Worst-case aligned aggregate burst V = K·Bt (all K producers finish a tile together)."""
    if not isinstance(num_producers, (int, np.integer)) or num_producers <= 0:
        raise ValueError(f"num_producers: must be a positive integer, got {num_producers!r}")
    return int(num_producers) * fa_tile_burst_bytes(tile_m, head_dim, out_bytes)


def fa4_tile_shape(head_dim: int, causal: bool = False) -> tuple[int, int]:
    """(tile_m, tile_n) of FA4's SM90 forward for this head dim (head_dim_v = head_dim, no local
    window), as the kernel layer reads FA4's own table (cute_kernels.fa4.fa4_sm90_config; imported
    lazily, so that the model's arithmetic does not load it). For d = 128: (128, 128)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
        raise ValueError(f"head_dim: expected a positive integer, got {head_dim!r}")
    from cute_kernels.fa4 import fa4_sm90_config

    cfg = fa4_sm90_config(int(head_dim), bool(causal))
    return cfg.tile_m, cfg.tile_n


@dataclass(frozen=True)
class FaTiles:
    """The output tiles of one FA forward on `num_sms` SMs with one tile per CTA (FA4 SM90's
    SingleTileScheduler, non-causal): they run in `waves` waves; each CTA's Q-loop walks
    `kv_tiles` KV tiles and then stores its tile, a burst of Bt = tile_m·head_dim·out_bytes bytes.
    Build it with FaTiles.fa4(...) to take FA4's own tile shape."""

    seqlen: int
    heads: int
    head_dim: int
    batch: int
    out_bytes: int
    num_sms: int
    tile_m: int
    tile_n: int

    def __post_init__(self):
        for name in ("seqlen", "heads", "head_dim", "batch", "out_bytes", "num_sms", "tile_m", "tile_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")

    @classmethod
    def fa4(cls, seqlen: int, heads: int, head_dim: int, *, num_sms: int, batch: int = 1, out_bytes: int = 2,
            causal: bool = False) -> "FaTiles":
        tile_m, tile_n = fa4_tile_shape(head_dim, causal)
        return cls(seqlen, heads, head_dim, batch, out_bytes, num_sms, tile_m, tile_n)

    @property
    def tiles(self) -> int:
        return self.batch * self.heads * math.ceil(self.seqlen / self.tile_m)

    @property
    def waves(self) -> int:
        return math.ceil(self.tiles / self.num_sms)

    @property
    def kv_tiles(self) -> int:
        return math.ceil(self.seqlen / self.tile_n)

    @property
    def producers(self) -> int:
        """K: CTAs that finish a tile together (a full wave, or all tiles when fewer)."""
        return min(self.num_sms, self.tiles)

    @property
    def burst_bytes(self) -> int:
        return fa_tile_burst_bytes(self.tile_m, self.head_dim, self.out_bytes)

    @property
    def volume(self) -> int:
        """V = K·Bt: the worst-case aligned burst (fa_burst_volume)."""
        return fa_burst_volume(self.producers, self.tile_m, self.head_dim, self.out_bytes)

    def wave_volumes(self) -> list:
        """Bytes each wave stores when its tiles finish (the last wave may be partial)."""
        full, last = divmod(self.tiles, self.num_sms)
        return [self.num_sms * self.burst_bytes] * full + ([last * self.burst_bytes] if last else [])

    def sigma_from_time(self, t_fa: float) -> float:
        """Q-loop time per KV tile from a measured forward time: T_FA / (waves · KV tiles), the
        per-tile fixed part included (use a long sequence, where it matters least)."""
        return _check_positive("t_fa", t_fa) / (self.waves * self.kv_tiles)

    def sigma_from_flops(self, flops_per_s: float) -> float:
        """Q-loop time per KV tile of one CTA when the GPU runs `flops_per_s` over `num_sms` SMs:
        4·tile_m·tile_n·head_dim FLOP per KV tile (QK^T and PV)."""
        rate = _check_positive("flops_per_s", flops_per_s) / self.num_sms
        return 4 * self.tile_m * self.tile_n * self.head_dim / rate

    def wave_drain_bound(self, t_fa: float, drain_rate: float) -> float:
        """Finish time of FA with its stores if the SMs never waited for them: wave w's tiles finish
        at (w + 1)·T_FA/waves and the destination drains the bursts one after another at R, so
        done = max(done, finish_w) + V_w/R and the bound is max(T_FA, done). Example (one H200,
        windows in pinned host memory, 2026-12-03): M = 8192, H_loc = 3: 192 tiles on 132 SMs, T_FA
        184.5 us, R 52 GB/s: the first wave's 4.3 MB drains from 92 to 175 us, the second's 2.0 MB
        from 184.5 to 222 us: T_bound = 222 us."""
        t = _check_positive("t_fa", t_fa)
        r = _check_positive("drain_rate", drain_rate)
        done = 0.0
        for w, v in enumerate(self.wave_volumes()):
            done = max(done, (w + 1) * t / self.waves) + v / r
        return max(t, done)
