"""What the kernels take: the one home of their dtype and head-dim limits (and the projection's norm eps).

The SM90 / SM100 attention kernels (cute_kernels.fa4) and the QKV projection GEMM (qkv_a2a_sm90) take
these; fa_a2a.engine.problem, the diffusers backend and the Flux processor check or route calls on them,
and the command lines offer HEAD_DIMS. Importing this module loads neither torch nor the CuTe DSL
(the command lines refuse a bad flag before torch loads): DTYPES imports torch on first use.
"""

from __future__ import annotations

HEAD_DIMS = (64, 128)
MAX_WORLD_SIZE = 32  # ranks the barrier kernel (cute_kernels.signal) and so every transport take
EPS = 1e-6  # the QKV projection's RMSNorm eps (quack's HeadRstd in its qk epilogues): Flux's and Wan's


def tma_table(t, address: int) -> bool:
    """Whether a float32 [M, D] RoPE table at `address` (t.data_ptr()) is what the QKV projection's
    epilogue loads by TMA: contiguous rows, a 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and (t.stride(0) * 4) % 16 == 0 and address % 16 == 0


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        globals()["DTYPES"] = dtypes = (torch.bfloat16, torch.float16)
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
