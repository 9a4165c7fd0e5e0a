"""The `pace` option: whether and how fast the fused kernel paces its O-tile stores, and the block's
QKV projection its epilogue's stores (the pre-A2A: decide_projection, at the end of this module).

Why: over a slow link (peers behind PCIe, a congested switch; on one GPU: windows in pinned host
memory) a wave of FA4 tiles issues its O stores at once, the write backlog stalls every SM's loads,
and the fused kernel runs at serial speed. The paced kernel (cute_kernels.fa4_a2a_paced_sm90)
spreads the stores at a rate below the link's and keeps the next wave's Q-loop running.

pace (ulysses_attention, UlyssesAttention, ulysses_qkv_attention, the diffusers backend; it must be
the same on every rank and is agreed with the call):
  "auto"        (default) decided once per call signature by the rule below, logged once;
  None / "off"  never paced;
  a number      pace at that many GB/s (this rank's stores, grid-wide), refused where the paced
                kernel cannot run (not SM90).

The automatic rule (`decide`), from two facts:
  link R     GB/s at which this rank's post-A2A kernel alone stores 32 MiB into the transport's
             windows, measured once per transport with every rank storing at once (ranks that
             share a link measure their share) and agreed as the minimum over the ranks, so every
             rank decides alike (`link_gbps`);
  FA4 tiles  the call's tiles on this rank's share of the SMs (engine.tiles.FaTiles: waves, a wave's O
             burst V = producers x tile bytes, the next wave's Q-loop G = KV tiles x sigma, sigma
             from FA4_TFLOPS).
  - one wave: off (no Q-loop follows the stores to hide them);
  - V / R <= QUEUE_FRACTION x G: off (the link drains a wave's burst early in the next Q-loop,
    HBM: pacing would only add its atomics);
  - otherwise pace at PACE_FRACTION x R: unpaced, each wave would lose about V / R (the backlog
    stalls every SM's loads while it drains), more than pacing costs.
  - ranks sharing one GPU (P processes under MPS): pace only where this rank's kernel makes O at
    most SHARED_GPU_MAX_LOAD of the paced rate (O bytes / (waves x G) / rate), see below.
The paced kernel is SM90's (both O paths): SM100 stays unpaced.

Measured (one H200, 2026-12-03, rank 0's work of emulated P = 8, H_loc = 3, D = 128, bf16, windows
in pinned host memory, A2A kernel alone 52 GB/s): paced at 44-48 GB/s (85-92% of it) hid 60-87% of
the A2A, at the link's rate the backlog built again (35-62%), unpaced 7-20%; windows in HBM: fused
x0.998-1.001 of FA4, paced at 800-960 GB/s x0.997-1.006. Hence PACE_FRACTION = 0.88. Unpaced over
host memory each wave lost about its drain time (32K: +405 us over 6 waves, 67 us each, drain 83 us;
a wave's drain is 20% of its Q-loop there, 82% at 8K), while HBM drains a wave in ~3% of an 8K
Q-loop and fused costs nothing: QUEUE_FRACTION = 0.08 paces host memory up to S = 64K (10%) and
leaves HBM unpaced down to S = 4K (~7%). Links in between (NVLink class, ~400 GB/s: ~11% at 8K)
get paced: not measured here (no multi-GPU machine yet). This rule, measured the same way
(`python -m fa_a2a.bench --dest host hbm --methods fa serial fused fused_auto`): host memory paced at
44.2-45.6 GB/s, hiding 63 / 68 / 90% at M 8K / 16K / 32K (within 1% of the best hand-set rate); HBM
unpaced, x0.990-0.999 of FA4 at 8K-64K.

Real ranks sharing the H200 under MPS over the host transport (2026-12-03, H = 24, D = 128, bf16,
graph replay, max over ranks; hiding of what serial spends beyond FA4-local): paced at 88% of each
rank's share of the link (P 2: 28.9 GB/s each, P 4: 14.9) vs unpaced: P 2 at S 8K/16K/32K 3/48/60%
vs 9/28/51%, P 4 -57/-27/73% vs 13/28/55% (O made at 92/41/21% and 89/40/20% of the paced rate).
Pacing cost more than it hid wherever O came faster than a quarter of the paced rate at P 4 (one
kernel at a time, emulated, paced well at 76%: the concurrent ranks' slot waits, which hold their
SMs, are the suspect, not yet measured). Hence SHARED_GPU_MAX_LOAD = 0.25 for ranks sharing a GPU:
of these rows it paces the 32K ones only, and keeps P 2's 16K gain off the table.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Callable, Optional, Union

import torch

from fa_a2a.engine.log import log_once

__all__ = ["PACE_FRACTION", "QUEUE_FRACTION", "FA4_TFLOPS", "GEMM_TFLOPS", "Pacing", "check_pace", "encode_pace",
           "decode_pace", "decide", "measure_store_rate", "link_gbps", "pace_path", "plan_pacing", "launch_pacer",
           "fused_pacer", "decide_projection", "plan_projection_pacing", "projection_pacer"]

logger = logging.getLogger(__name__)

PACE_FRACTION = 0.88  # of the measured A2A rate: 85-92% was best on the H200's host link
QUEUE_FRACTION = 0.08  # a wave's drain above this share of the next Q-loop: pace
FA4_TFLOPS = 700.0  # FA4 SM90 forward, bf16 D = 128, H200: 729 TFLOP/s at S 8192, 672 at 64K (B 1, H 24)
SHARED_GPU_MAX_LOAD = 0.25  # ranks sharing a GPU: pace only kernels making O below this share of the rate
BURST_TILES = 8  # the pacer's burst tolerance (the probe's setting)
LINK_PROBE_BYTES = 32 << 20  # smaller probes under-read fast links (8 MiB on HBM: launch cost ~ store time)
MAX_RATE_GBPS = 1e6
# 1 MB/s, below any link: the pacer holds at most 1 s per tile (cute_kernels.pacer.MAX_DT_NS), and the
# largest it paces, FA4's 192 x 128 O tile or the projection's UNIT_BYTES, is far under 1 MB
MIN_RATE_GBPS = 1e-3

Pace = Union[None, str, float]


def check_pace(pace) -> Pace:
    """pace as the op takes it -> None (off), "auto", or a float rate in GB/s. Raises ValueError."""
    if pace is None or pace == "off":
        return None
    if pace == "auto":
        return "auto"
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not MIN_RATE_GBPS <= pace <= MAX_RATE_GBPS:
        # (the comparisons refuse NaN, inf and ints past float range, where a float conversion overflows)
        raise ValueError(f"pace: expected 'auto', None/'off' or a rate in [{MIN_RATE_GBPS:g}, {MAX_RATE_GBPS:g}] GB/s, "
                         f"got {pace!r}")
    return float(pace)


def encode_pace(pace: Pace) -> str:
    """A checked pace as the custom op's string argument ("off", "auto" or the rate)."""
    return "off" if pace is None else pace if isinstance(pace, str) else repr(float(pace))


def decode_pace(text: str) -> Pace:
    return check_pace(text if text in ("off", "auto") else float(text))


@dataclasses.dataclass(frozen=True)
class Pacing:
    """A decision: rate_gbps (None: unpaced) and why, in words."""

    rate_gbps: Optional[float]
    reason: str


def _check_link(link) -> None:
    if isinstance(link, bool) or not isinstance(link, (int, float)) or not 0 < link <= MAX_RATE_GBPS:
        raise ValueError(f"link: expected a positive rate in GB/s, at most {MAX_RATE_GBPS:g}, got {link!r}")


def decide(link: float, tiles, fa_tflops: float = FA4_TFLOPS, gpu_sms: Optional[int] = None,
           shared_gpu: bool = False) -> Pacing:
    """The automatic rule (module docstring) for a link of `link` GB/s and FA4's tiles
    (engine.tiles.FaTiles on this rank's share of the SMs; gpu_sms: the whole GPU's, default the same;
    shared_gpu: other ranks' kernels run at once on this GPU)."""
    _check_link(link)
    one = one_wave(tiles)
    if one is not None:
        return one
    drain_us = tiles.volume / (link * 1e3)  # bytes / (GB/s) = ns
    sigma = dataclasses.replace(tiles, num_sms=gpu_sms or tiles.num_sms).sigma_from_flops(fa_tflops * 1e12)
    qloop_us = tiles.kv_tiles * sigma * 1e6  # one SM's share of the whole GPU's FA4 rate
    facts = (f"a wave's O ({tiles.volume / 1e6:.2f} MB) drains in {drain_us:.1f} us at the link's {link:.1f} GB/s, "
             f"the next wave's Q-loop takes ~{qloop_us:.0f} us")
    if drain_us <= QUEUE_FRACTION * qloop_us:
        return Pacing(None, f"{facts}: within {QUEUE_FRACTION:.0%} of it, the link keeps up")
    rate = PACE_FRACTION * link
    if shared_gpu:
        load = tiles.tiles * tiles.burst_bytes / (tiles.waves * qloop_us * 1e3) / rate  # O made / pace
        if load > SHARED_GPU_MAX_LOAD:
            return Pacing(None, f"{facts}; but this rank's kernel makes O at {load:.0%} of the paced rate "
                                f"while other ranks' kernels share the GPU: unpaced (pacing above "
                                f"{SHARED_GPU_MAX_LOAD:.0%} cost more than it hid there)")
    return Pacing(rate, f"{facts}: paced at {PACE_FRACTION:.0%} of the link, {rate:.1f} GB/s")


def one_wave(tiles) -> Optional[Pacing]:
    """The decision for tiles that run in one wave (unpaced, whatever the link), else None."""
    if tiles.waves >= 2:
        return None
    return Pacing(None, f"{tiles.tiles} tiles on {tiles.num_sms} SMs run in one wave: no Q-loop follows the stores "
                        "to hide them")


def measure_store_rate(windows: torch.Tensor, rank: int, barrier=None, trials: int = 5) -> float:
    """GB/s at which `rank`'s post-A2A kernel alone stores into `windows` [P, B, rows, H, D] (its
    B x P*rows x H/P x D source; median of `trials` launches timed with CUDA events, each after
    `barrier()` when given so ranks that share a link store at once)."""
    from cute_kernels.a2a import post_a2a_launcher

    P, B, rows, H, D = windows.shape
    src = torch.randn(B, P * rows, H // P, D, device=windows.device).to(windows.dtype)
    launch = post_a2a_launcher(src, windows, rank)
    launch()  # compiled and warm
    times = []
    for _ in range(trials):
        if barrier is not None:
            barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def probe_shape(world_size: int) -> tuple:
    """The link probe's window shape [B, rows, H, D] (bf16): LINK_PROBE_BYTES from one rank."""
    return (1, max(LINK_PROBE_BYTES // (world_size * 128 * 2), 1), world_size, 128)


def link_gbps(transport, side: str = "out") -> float:
    """The transport's link rate for pacing (GB/s): measure_store_rate of LINK_PROBE_BYTES from its
    first local rank into windows of its own, every rank at once, minimum over the ranks; measured
    once per transport and side (collective the first time: every rank calls it at the same point).
    side "out": the post-A2A's (output) windows, the fused attention's; "in": the pre-A2A's, the
    projection's: the same link and measurement unless the transport puts them apart
    (Transport.split_links: HostTransport's input windows are GPU memory). The probe's windows stay
    allocated with the transport: LINK_PROBE_BYTES per rank and side (P of them for emulated ranks)."""
    if side not in ("out", "in"):
        raise ValueError(f"side: expected 'out' or 'in', got {side!r}")
    attr, name = "pacing_link_gbps", "fa_a2a.engine.pacing.link"
    if side == "in" and transport.split_links:
        attr, name = "pacing_in_link_gbps", "fa_a2a.engine.pacing.in_link"
    rate = getattr(transport, attr, None)
    if rate is None:
        P, D = transport.world_size, 128
        windows = transport.windows(name, probe_shape(P), torch.bfloat16)
        from cute_kernels.a2a import compile_post_a2a

        compile_post_a2a(torch.bfloat16, D, P)  # every rank compiled before the first timed store
        transport.host_barrier()
        mine = measure_store_rate(windows, transport.local_ranks[0], barrier=transport.barrier)
        rate = min(transport.host_allgather(f"pacing link rate ({side})", mine))
        setattr(transport, attr, rate)
    return rate


def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pace_path(q: torch.Tensor, seq_loc: int, head_dim: int, causal: bool) -> tuple:
    """(rows of the fused kernel's output tile for this call, None where the paced kernel can run
    it, else why not, in words). The paced kernel has both O paths (TMA and st), so any S_loc."""
    from cute_kernels.fa4 import device_arch, tile_m_for

    arch = device_arch(q)
    tile_m = tile_m_for(head_dim, causal, arch)
    if arch != 90:
        return tile_m, f"the paced kernel is SM90's (this GPU is SM{arch})"
    return tile_m, None


def plan_pacing(pace: Pace, link: Callable[[], float], device, seqlen: int, heads_loc: int, batch: int,
                head_dim: int, dtype: torch.dtype, causal: bool, tile_m: int, pace_path: Optional[str], *,
                ranks_per_gpu: int = 1) -> Pacing:
    """The pacing of one fused attention launch: pace as checked by check_pace; link() the link's
    GB/s (called only where the rule needs it: link_gbps(transport) for the op); seqlen, heads_loc:
    this rank's attention; pace_path as pace_path() returns it; ranks_per_gpu: rank processes whose
    kernels share this GPU. A rate where the paced kernel cannot run: ValueError."""
    if pace is None:
        return Pacing(None, "pace off")
    if pace_path is not None:
        if pace == "auto":
            return Pacing(None, f"unpaced: {pace_path}")
        raise ValueError(f"pace: a rate needs the paced kernel, and {pace_path}; pass pace='auto' or None")
    if pace != "auto":
        return Pacing(pace, f"pace {pace:g} GB/s given")
    from fa_a2a.engine.tiles import FaTiles, fa4_tile_shape

    sms = sm_count(device)
    share = max(sms // ranks_per_gpu, 1)
    tile_n = fa4_tile_shape(head_dim, causal)[1]
    out_bytes = torch.empty(0, dtype=dtype).element_size()
    tiles = FaTiles(seqlen, heads_loc, head_dim, batch, out_bytes, share, tile_m, tile_n)
    # one wave: decided without probing the link
    decision = one_wave(tiles) or decide(link(), tiles, gpu_sms=sms, shared_gpu=ranks_per_gpu > 1)
    log_once(logger, ("pace", seqlen, heads_loc, batch, head_dim, dtype, causal, share, decision), logging.INFO,
             "fa_a2a pace='auto' (S %d, H_loc %d, D %d, %d of %d SMs): %s", seqlen, heads_loc, head_dim, share, sms,
             decision.reason)
    return decision


def launch_pacer(decision: Pacing, device, tile_m: int, head_dim: int, dtype: torch.dtype):
    """The fused launch's store pacer for a decision (cute_kernels.pacer.make_pacer),
    None where it is unpaced."""
    if decision.rate_gbps is None:
        return None
    from cute_kernels.pacer import make_pacer

    tile_bytes = tile_m * head_dim * torch.empty(0, dtype=dtype).element_size()
    return make_pacer(device, decision.rate_gbps, tile_bytes, BURST_TILES)


def fused_pacer(pace: Pace, link: Callable[[], float], q: torch.Tensor, seq_loc: int, seqlen: int, heads_loc: int,
                batch: int, causal: bool, *, ranks_per_gpu: int = 1) -> tuple:
    """(decision, pacer) of one fused attention launch, the one path of the op and the benchmarks:
    pace_path, plan_pacing and launch_pacer on q's device, dtype and head dim (q: the launch's query
    rows, any shape); seq_loc: the output rows per rank; the other arguments as plan_pacing's."""
    head_dim = q.shape[-1]
    tile_m, path = pace_path(q, seq_loc, head_dim, causal)
    decision = plan_pacing(pace, link, q.device, seqlen, heads_loc, batch, head_dim, q.dtype, causal, tile_m, path,
                           ranks_per_gpu=ranks_per_gpu)
    return decision, launch_pacer(decision, q.device, tile_m, head_dim, q.dtype)


# ---- the QKV projection's stores (the block's pre-A2A, cute_kernels.qkv_a2a_sm90's pacer) -------
GEMM_TFLOPS = 700.0  # the projection's GEMM, bf16, Flux shapes, H200: 750 TFLOP/s at S_loc 2304
PROJECTION_BURST_UNITS = 4  # the projection pacer's burst tolerance, in UNIT_BYTES (256 KiB)
PROJECTION_GEMM_SHARES = (0.6, 2.0)  # pace only where the GEMM takes this many times its stores' link time
PROJECTION_PACE_FRACTION = 0.85  # of the link: the best of 40 / 44 / 48 GB/s at 2304 rows in 4 runs of 4


def decide_projection(link: float, out_bytes: int, flops: float, gemm_tflops: float = GEMM_TFLOPS,
                      shared_gpu: bool = False) -> Pacing:
    """The automatic rule for the projection's stores (out_bytes into the windows, its GEMM of
    `flops` at gemm_tflops), from the GEMM's share = GEMM time / the link's time for the stores
    (out_bytes / link), with (lo, hi) = PROJECTION_GEMM_SHARES:
      - share > hi: off (a fast link: its stores do not queue, and the pacer's slots only hold the
        epilogues);
      - share < lo: off (the stores are link-bound: the pacer's slots stretch them past the link's
        own time by more than the GEMM it could hide);
      - otherwise paced at PROJECTION_PACE_FRACTION of the link; unpaced where other ranks' kernels
        share the GPU (not measured there).
    Measured (one H200, 2026-12-04, examples/qkv_speed.py --world-size 2 --paced-gbps, N 9216, fused
    q|k|v + bias against unpaced, S_loc 576 / 2304). Windows in pinned host memory (link 51-52 GB/s),
    paced at 88% of the link: share 0.22 (C 3072): +18% / -3%; 0.46 (C 6144): +6% / -7%; 0.69
    (C 9216): -7% / -7%; 0.9 (C 12288): -15% / -13%, -17% in a second run; 1.8 (C 24576, 2304 rows):
    -16%, though the link carries the stores in 56% of the GEMM's time (they queue in bursts, as
    FA4's O tiles do). Paced at 44 GB/s (85% of the link) instead, at 2304 rows: -13% (C 9216), -22%
    and -24% (C 12288), -23% and -20% (C 24576); at 576 rows 48 GB/s did best (-19% at C 12288,
    -11% at C 9216, where 85% gave -13% and -4%). Windows in HBM (link 1257-1295 GB/s), paced at
    88%: share 2.8 (C 1536) +33% at 576 rows, 5.6 (C 3072) +9.5%."""
    _check_link(link)
    lo, hi = PROJECTION_GEMM_SHARES
    gemm_us = flops / (gemm_tflops * 1e6)
    drain_us = out_bytes / (link * 1e3)
    share = gemm_us / drain_us
    facts = (f"the projection's {out_bytes / 1e6:.2f} MB take {drain_us:.1f} us at the link's {link:.1f} GB/s, "
             f"its GEMM ~{gemm_us:.0f} us ({share:.2f}x)")
    if share > hi:
        return Pacing(None, f"{facts}: above {hi:g}x, the link keeps up")
    if share < lo:
        return Pacing(None, f"{facts}: below {lo:g}x, the stores are link-bound and pacing would stretch them more "
                            "than it hides")
    if shared_gpu:
        return Pacing(None, f"{facts}; other ranks' kernels share the GPU: unpaced (not measured there)")
    rate = PROJECTION_PACE_FRACTION * link
    return Pacing(rate, f"{facts}: paced at {PROJECTION_PACE_FRACTION:.0%} of the link, {rate:.1f} GB/s")


def plan_projection_pacing(pace: Pace, link: Callable[[], float], rows: int, columns: int, hidden: int,
                           dtype: torch.dtype, *, ranks_per_gpu: int = 1) -> Pacing:
    """The pacing of one rank's projection (rows x columns outputs from `hidden` inputs): pace as
    check_pace returns it (a rate: that rate; "auto": decide_projection with link(), called only
    then). Logged once per decision."""
    if pace is None:
        return Pacing(None, "pace off")
    if pace != "auto":
        return Pacing(pace, f"pace {pace:g} GB/s given")
    out_bytes = rows * columns * torch.empty(0, dtype=dtype).element_size()
    decision = decide_projection(link(), out_bytes, 2.0 * rows * columns * hidden, shared_gpu=ranks_per_gpu > 1)
    log_once(logger, ("pace projection", rows, columns, hidden, dtype, ranks_per_gpu, decision), logging.INFO,
             "fa_a2a pace='auto', projection (%d rows, %d columns, C %d): %s", rows, columns, hidden, decision.reason)
    return decision


def projection_pacer(decision: Pacing, device):
    """The projection's store pacer for a decision (cute_kernels.pacer.make_pacer in UNIT_BYTES),
    None where it is unpaced."""
    if decision.rate_gbps is None:
        return None
    from cute_kernels.pacer import UNIT_BYTES, make_pacer

    return make_pacer(device, decision.rate_gbps, UNIT_BYTES, PROJECTION_BURST_UNITS)
