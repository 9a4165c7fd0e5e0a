"""The grid-wide store pacer's state (host side: torch only), shared by the paced kernels: the fused
FA4 + post-A2A kernel (cute_kernels.fa4_a2a_paced_sm90, one slot per O tile) and the QKV
projection's epilogue (cute_kernels.qkv_a2a_sm90, a slot per epilogue subtile worth its bytes).
The device side (the slot claim and wait) is cute_kernels.pacer_device.

One int64 word in global memory holds the next slot time TAT (%globaltimer ns); a store of one
tile's bytes lifts TAT to at least now - tau, takes TAT and adds dt, and waits until then (dt =
tile bytes / the rate, tau = the burst tolerance). TAT left by an earlier launch lies in the past
and acts as "now": no reset between launches or CUDA-graph replays.
"""

import torch

PACER_FIELDS = ("tat_ns", "dt_ns", "tau_ns")  # the pacer tensor, int64 [3]
UNIT_BYTES = 1 << 16  # the projection's pacer counts in these (its launch groups' tiles differ in size)
MAX_RATE_GBPS = 1e6  # 1 PB/s: past any link (100000 already never waits on an H200's HBM)
MAX_TILE_BYTES = 2**30
MAX_BURST_TILES = 2**20
MAX_DT_NS = 10**9  # one tile a second at the slowest: the tile time and TAT stay far inside int64


def make_pacer(device, rate_gbps: float, tile_bytes: int, burst_tiles: int = 8) -> torch.Tensor:
    """Pacer state for `rate_gbps` (GB/s, 1e9 bytes) of `tile_bytes` tiles with a burst tolerance of
    `burst_tiles` tiles: int64 [3] = (TAT 0, dt ns, tau ns) on `device`. Bounds: 0 < rate_gbps <=
    1e6 with at most 1 s per tile (dt = tile_bytes / rate_gbps ns <= 1e9), 1 <= tile_bytes <= 2**30,
    0 <= burst_tiles <= 2**20 (bools refused). check_pacer takes only a state made here and not
    written since (its dt and tau are checked here, not read back from the device on every launch)."""
    if isinstance(rate_gbps, bool) or not isinstance(rate_gbps, (int, float)) or not 0 < rate_gbps <= MAX_RATE_GBPS:
        # (the comparison refuses NaN, inf and ints past float range, where a float conversion overflows)
        raise ValueError(f"rate_gbps: expected a number in (0, {MAX_RATE_GBPS:g}] GB/s, got {rate_gbps!r}")
    if isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or not 1 <= tile_bytes <= MAX_TILE_BYTES:
        raise ValueError(f"tile_bytes: expected an int in [1, 2**30], got {tile_bytes!r}")
    if isinstance(burst_tiles, bool) or not isinstance(burst_tiles, int) or not 0 <= burst_tiles <= MAX_BURST_TILES:
        raise ValueError(f"burst_tiles: expected an int in [0, 2**20], got {burst_tiles!r}")
    dt = tile_bytes / rate_gbps  # bytes / (GB/s) = ns
    if dt > MAX_DT_NS:
        raise ValueError(f"rate_gbps: expected at least tile_bytes / 1e9 = {tile_bytes / MAX_DT_NS:g} GB/s (at most "
                         f"1 s per tile of {tile_bytes} bytes), got {rate_gbps!r}")
    dt = max(1, round(dt))
    with torch.inference_mode(False):  # a tensor with a version counter, also made under inference mode
        pacer = torch.tensor([0, dt, burst_tiles * dt], dtype=torch.int64, device=device)
    pacer._fa_a2a_pacer_version = pacer._version
    return pacer


def check_pacer(pacer, device) -> None:
    """pacer: the int64 [3] state make_pacer returns, on `device`, not written by torch since (the
    kernel's own atomics on TAT do not count): its dt and tau were bounded there."""
    if (not isinstance(pacer, torch.Tensor) or pacer.dtype != torch.int64 or tuple(pacer.shape) != (3,)
            or pacer.device != torch.device(device)):
        raise ValueError(f"pacer: expected an int64 tensor [3] on {device} (make_pacer), got "
                         f"{getattr(pacer, 'dtype', type(pacer).__name__)} {tuple(getattr(pacer, 'shape', ()))} on "
                         f"{getattr(pacer, 'device', None)}")
    if getattr(pacer, "_fa_a2a_pacer_version", None) != pacer._version:
        raise ValueError("pacer: expected the state make_pacer returned, unchanged since (its dt and tau are "
                         "checked there), got a tensor built or written elsewhere")
