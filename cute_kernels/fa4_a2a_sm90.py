"""FlashAttention-4 SM90 forward with the Ulysses post-attention All-to-All in its epilogue.

Rank r of P holds q, k, v as [B, S, H_loc, D] (the full sequence S = P * S_loc, its own H_loc
heads). FA4 computes the output tile (b, m_block, h); this kernel's epilogue stores that tile
straight into the rank that owns its rows: row s goes to destination d = s // S_loc at
out_d[b, s % S_loc, r * H_loc + h, :], the Ulysses output layout [B, S_loc, H, D].

The destinations are one "rank window" tensor: P buffers at one uniform stride W in this
process's address space (peer memory mapped with CUDA VMM, or P local buffers when ranks are
emulated). The kernel sees it as (S_loc, D, H_loc, (B, P)) with strides (H*D, 1, D, (S_loc*H*D, W)),
so a single TMA descriptor addresses every rank and FA4's own TMA store of O is the remote store.
A tile whose 128 rows straddle a rank boundary (S_loc not a multiple of tile_m) is stored once
per rank it touches, each store's row coordinate shifted by -d * S_loc: the TMA unit drops the
rows that fall outside [0, S_loc) of that rank, so every row is written exactly once.

Ordering: the storing warp waits only until the bulk store has *read* shared memory
(cp.async.bulk.wait_group.read), exactly as FA4 does before sO (aliased with sQ) is reused; it
never waits for the remote writes to land. They drain while the next tile's Q-loop runs. The
consumer learns that the data is visible from a barrier kernel launched after this one on the
same stream (system-scope release/acquire flags, cute_kernels/signal.py): kernel completion
orders every store of this grid before that barrier's release.

Measured: see notes/measurements.md (T_fused / T_FA4 on an H200, emulated ranks).
"""

from contextlib import contextmanager
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

import flash_attn.cute.flash_fwd_sm90 as _fa4_sm90
from flash_attn.cute import utils
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd
from quack import copy_utils


def _assume_nested_aligned(t, *, canonicalize_singletons=False, align_bits=128):
    """FA4's alignment assumption, extended to hierarchical (nested) strides.

    FA4 marks every stride but the last divisible by 16 bytes; the rank-window output has a
    nested batch mode ((B, P) with strides (S_loc*H*D, W)), which FA4's helper does not take.
    Both strides are multiples of 16 bytes by construction (checked on the host).
    """
    if t is None or all(not isinstance(s, tuple) for s in t.stride):
        return assume_tensor_aligned(
            t, canonicalize_singletons=canonicalize_singletons, align_bits=align_bits
        )
    divby = align_bits // t.element_type.width

    def assume(s):
        if isinstance(s, tuple):
            return tuple(assume(x) for x in s)
        return s if isinstance(s, int) else cute.assume(s, divby=divby)

    strides = tuple(assume(s) for s in t.stride[:-1]) + (t.stride[-1],)
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=strides))


@contextmanager
def _nested_stride_alignment():
    """While FA4's __call__ is traced, let its alignment helper accept nested strides."""
    saved = _fa4_sm90.assume_tensor_aligned
    _fa4_sm90.assume_tensor_aligned = _assume_nested_aligned
    try:
        yield
    finally:
        _fa4_sm90.assume_tensor_aligned = saved


class FlashAttentionA2AForwardSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward whose output epilogue routes each O tile to its Ulysses rank.

    Everything but the output path is FA4's (mainloop, softmax, scheduler, pipelines). The
    tile configuration is FA4's own choice for the head dim (see fa_a2a.fused).
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("pack_gqa", False):
            raise ValueError("pack_gqa: the rank-window epilogue routes whole rows; use pack_gqa=False")
        kwargs["pack_gqa"] = False
        super().__init__(*args, **kwargs)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s, h_loc, d): full sequence, this rank's heads
        mK: cute.Tensor,  # (b, s, h_kv_loc, d)
        mV: cute.Tensor,  # (b, s, h_kv_loc, dv)
        mOWindows: cute.Tensor,  # (p, b, s_loc, h_loc, dv): this rank's head slice of every window
        softmax_scale: Float32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # (b,) valid keys (padded sequences)
        stream: cuda.CUstream = None,
    ):
        w = mOWindows.layout
        # (p, b, s_loc, h, dv) -> ((b, p), s_loc, h, dv): FA4's (b, s, h, dv) with a nested batch mode
        mO = cute.make_tensor(
            mOWindows.iterator,
            cute.make_layout(
                ((w.shape[1], w.shape[0]), w.shape[2], w.shape[3], w.shape[4]),
                stride=((w.stride[1], w.stride[0]), w.stride[2], w.stride[3], w.stride[4]),
            ),
        )
        with _nested_stride_alignment():
            super().__call__(
                mQ, mK, mV, mO, None, softmax_scale, mSeqUsedK=mSeqUsedK, stream=stream
            )

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,  # TMA coordinate tensor (s_loc, dv, h_loc, (b, p))
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        assert self.use_tma_O, "the rank-window epilogue stores O with TMA"
        # registers -> smem, as FA4 does
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # all MMA threads are done reading V (sO aliases sQ)
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads
        )
        smem_copy_atom_O = utils.get_smem_store_atom(
            self.arch.major * 10 + self.arch.minor, self.dtype
        )
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        # smem writes visible to the TMA unit, then one warp issues the stores
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(
            barrier_id=int(NamedBarrierFwd.Epilogue),
            number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
        )
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 4:
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.Epilogue),
                number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
            )
            seqlen_loc = mO.shape[0]
            num_ranks = mO.shape[3][1]
            row0 = m_block * self.tile_m
            dst_first = row0 // seqlen_loc
            dst_last = (row0 + self.tile_m - 1) // seqlen_loc
            if dst_last > num_ranks - 1:
                dst_last = num_ranks - 1
            for dst in cutlass.range(dst_first, dst_last + 1, unroll=1):
                mO_dst = mO[None, None, head_idx, (batch_idx, dst)]
                # tile row i lands on local row (row0 - dst*s_loc + i); TMA drops rows outside [0, s_loc)
                mO_dst = cute.domain_offset((row0 - dst * seqlen_loc, 0), mO_dst)
                gO = cute.local_tile(mO_dst, (self.tile_m, self.tile_hdimv), (0, 0))
                store_O, _, _ = copy_utils.tma_get_copy_fn(
                    tma_atom_O, 0, cute.make_layout(1), sO, gO, single_stage=True
                )
                store_O()
            cute.arch.cp_async_bulk_commit_group()
            # wait until smem has been read, not until the (remote) writes are visible
            cute.arch.cp_async_bulk_wait_group(0, read=True)
