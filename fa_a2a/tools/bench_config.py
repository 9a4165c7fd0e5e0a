"""The settings of `python -m fa_a2a.bench`, shared by its per-kernel benchmark (fa_a2a.tools.bench) and
its whole-call benchmark under torchrun (fa_a2a.tools.bench_call): BenchConfig (what the command line
resolves to, fa_a2a.tools.bench.make_config), its defaults, the element types, and the platform model
behind the Burst-Gap predictions (the paper's calibration unless --platform names one).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from fa_a2a.tools.xstage import GB, US, PlatformModel

DEFAULT_SEQLENS = (8192, 16384, 32768, 49152, 65536)
QUICK_SEQLENS = (8192, 16384)
CALL_SEQLENS = (4608, 16384)  # the whole-call benchmark under torchrun (fa_a2a.tools.bench_call), --quick too
DEFAULT_WORLD_SIZE = 8
DTYPES = {"bf16": 2, "fp16": 2}  # name -> bytes per element (torch is imported after the arguments are parsed)
DESTS = ("hbm", "host")
EAGER_TRIALS = 3
# The paper's calibration of its 8xB200 node (K=148 producers, 32 KB bursts): used for the
# no-GPU predictions when --platform is not given. Not a measurement of this machine.
PAPER_PLATFORM = PlatformModel(t_iss0=0.76 * US, drain_rate=717 * GB, capacity=4.25 * 2**20)
PAPER_SOURCE = "the paper's 8xB200 calibration (T_iss0 0.76 us, R 717 GB/s, Q 4.25 MiB), not this machine"
# FA4 SM90 forward throughput measured on an H200 (bf16, D=128, non-causal, 16K-64K, 2026-12-02):
# the no-GPU predictions turn it into the Q-loop time per KV tile (notes/measurements.md checks it
# against the measured time per KV tile).
H200_FA4_TFLOPS = 690.0
H200_NUM_SMS = 132


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclasses.dataclass
class BenchConfig:
    seqlens: tuple
    heads: int
    head_dim: int
    batch: int
    world_size: int
    real_ranks: bool
    dtype: str
    causal: bool
    trials: int
    warmup: int
    calls: Optional[int]
    target_ms: float
    methods: tuple
    dests: tuple
    quick: bool
    out: str
    platform: Optional[str]
    seed: int
    plots: bool
    num_sms: int
    fa_tflops: float
    mps_share: Optional[float] = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of every rank, when given
    per_kernel: bool = False  # torchrun: the kernel methods instead of the whole call
    out_proj: int = 0  # --backward: C_out of the attention's output projection timed with it (0: none)
    joint: int = 0  # --backward: joint (text) rows replicated on every rank (0: none)
    breakdown: bool = False  # --backward: each method's kernel time by kind (torch.profiler) after the timing

    @property
    def whole_call(self) -> bool:
        """torchrun runs the whole-call benchmark (fa_a2a.tools.bench_call) unless --per-kernel."""
        return self.real_ranks and not self.per_kernel

    @property
    def heads_local(self) -> int:
        return self.heads // self.world_size


def load_platform(path: Optional[str]) -> tuple:
    """(PlatformModel, description) from a calibration JSON, or the paper's 8xB200 calibration.
    Bad contents raise ValueError naming --platform."""
    if path is None:
        return PAPER_PLATFORM, PAPER_SOURCE
    if not Path(path).is_file():
        raise ValueError(f"--platform: expected a platform model JSON file, got {path!r} (no such file)")
    try:
        model = PlatformModel.from_json(Path(path))
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--platform: {path} is not a platform model ({type(e).__name__}: {e})") from None
    return model, f"calibration {path}"
