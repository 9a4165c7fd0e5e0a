"""The cross-rank barrier kernel (its ordering, timeout and error mirror: cute_kernels.signal, the
host side that compiles and launches it)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from cute_kernels.limits import MAX_WORLD_SIZE


class BarrierKernel:
    """Configuration: world size P and the number of ranks one launch plays (num_local)."""

    def __init__(self, world_size: int, num_local: int = 1):
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size: must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
        if not 1 <= num_local <= world_size:
            raise ValueError(f"num_local: must be in [1, world_size={world_size}], got {num_local}")
        self.world_size = world_size
        self.num_local = num_local
        self.num_threads = 32

    @cute.jit
    def __call__(
        self,
        mSignal: cute.Tensor,  # (P, P) int32, dim-0 stride = window stride
        mEpoch: cute.Tensor,  # (num_local,) int32
        mError: cute.Tensor,  # (num_local, P) int32
        error_host_addr: Int64,  # (num_local, P) int32 mirror in mapped pinned host memory, or 0
        rank_base: Int32,
        timeout_ns: Int64,
        stream,
    ):
        self.kernel(mSignal, mEpoch, mError, error_host_addr, rank_base, timeout_ns).launch(
            grid=[self.num_local, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mSignal: cute.Tensor,
        mEpoch: cute.Tensor,
        mError: cute.Tensor,
        error_host_addr: Int64,
        rank_base: Int32,
        timeout_ns: Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        j, _, _ = cute.arch.block_idx()
        P = const_expr(self.world_size)
        rank = rank_base + j
        e = mEpoch[j] + 1
        prev_error = Int32(0)
        if tidx < P:
            prev_error = mError[j, tidx]
        poisoned = cute.arch.vote_any_sync(prev_error != 0)
        if tidx < P:
            # 1. release: this rank's earlier stores, then the flag in peer tidx's pad.
            cute.arch.fence_acq_rel_sys()
            out_flag = mSignal.iterator + cute.crd2idx((tidx, rank), mSignal.layout)
            cute.arch.store(out_flag, e, sem="release", scope="sys")
            # 2. acquire: wait for peer tidx's flag in this rank's pad, bounded.
            if not poisoned:
                in_flag = mSignal.iterator + cute.crd2idx((rank, tidx), mSignal.layout)
                seen = cute.arch.load(in_flag, Int32, sem="acquire", scope="sys")
                start = cute.arch.globaltimer()
                timed_out = False
                while seen - e < 0 and not timed_out:
                    seen = cute.arch.load(in_flag, Int32, sem="acquire", scope="sys")
                    timed_out = cute.arch.globaltimer() - start > timeout_ns
                if seen - e < 0:
                    mError[j, tidx] = e
                    if error_host_addr != 0:
                        host = cute.make_ptr(Int32, error_host_addr, cute.AddressSpace.gmem, assumed_align=4)
                        cute.arch.store(host + (j * P + tidx), e, sem="relaxed", scope="sys")
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_sys()
        if tidx == 0:
            mEpoch[j] = e
