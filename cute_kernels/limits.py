"""What the kernels take: the one home of their dtype and head-dim limits, the 16-byte rule of their
TMA and vector accesses (aligned16, with a tensor's address and whether it is fake), and the
projection's norm eps.

The SM90 / SM100 attention kernels (cute_kernels.fa4) and the QKV projection GEMM (qkv_a2a_sm90) take
these; fa_a2a.engine.problem, the diffusers backend and the Flux processor check or route calls on them,
and the command lines offer HEAD_DIMS. Importing this module loads neither torch nor the CuTe DSL
(the command lines refuse a bad flag before torch loads): DTYPES imports torch on first use.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

HEAD_DIMS = (64, 128)
MAX_WORLD_SIZE = 32  # ranks the barrier kernel (cute_kernels.signal) and so every transport take
EPS = 1e-6  # the QKV projection's RMSNorm eps (quack's HeadRstd in its qk epilogues): Flux's and Wan's
ALIGN_BYTES = 16  # TMA and 16-byte vector loads / stores: base addresses and strides in multiples of this
FP32_MAX = float.fromhex("0x1.fffffep+127")  # torch.finfo(torch.float32).max: the kernels take the scale as fp32


def check_softmax_scale(softmax_scale, limit: float = FP32_MAX) -> None:
    """softmax_scale None or a positive number up to limit: fp32's range for the kernels, which take it as
    fp32 (beyond it, inf); math.inf for the reference, which computes in the inputs' dtype up to fp64
    (finite only). NaN, inf, 10**400 and bools are refused."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not 0 < softmax_scale <= limit or softmax_scale == math.inf):
        bound = f"a positive float up to {limit:.4g} (fp32's range)" if limit < math.inf else "a positive finite float"
        raise ValueError(f"softmax_scale: expected {bound} or None, got {softmax_scale!r}")


def aligned16(t, address: Optional[int] = None, dims: Optional[Sequence[int]] = None) -> bool:
    """The 16-byte rule of TMA and vector loads / stores: t's last dim contiguous, its base address
    (`address`, default t.data_ptr(); a fake tensor's is its storage offset in bytes; 0: the strides
    alone) and the byte strides of `dims` (default: every dim but the last) multiples of ALIGN_BYTES."""
    st = t.stride()
    if st[-1] != 1 or (t.data_ptr() if address is None else address) % ALIGN_BYTES:
        return False
    # element sizes are powers of two: every byte stride is a multiple of 16 iff their gcd's is (one
    # call into Python's C code on the op's eager path, which checks every input tensor)
    return math.gcd(*(st[:-1] if dims is None else [st[d] for d in dims])) * t.element_size() % ALIGN_BYTES == 0


_fake_tensor_class = None  # torch's FakeTensor, imported at the first is_fake (this module loads no torch)


def is_fake(t) -> bool:
    """Whether t is a fake tensor (compiling without a GPU: shapes and strides only)."""
    global _fake_tensor_class
    if _fake_tensor_class is None:
        from torch._subclasses.fake_tensor import FakeTensor

        _fake_tensor_class = FakeTensor
    return isinstance(t, _fake_tensor_class)


def address(t) -> int:
    """Device address of t's first element (a fake tensor's: its storage offset in bytes)."""
    return t.storage_offset() * t.element_size() if is_fake(t) else t.data_ptr()


def tma_table(t, address: int) -> bool:
    """Whether a float32 [M, D] RoPE table at `address` (t.data_ptr()) is what the QKV projection's
    epilogue loads by TMA: contiguous rows, a 16-byte aligned base and row stride."""
    return aligned16(t, address)


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        globals()["DTYPES"] = dtypes = (torch.bfloat16, torch.float16)
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
