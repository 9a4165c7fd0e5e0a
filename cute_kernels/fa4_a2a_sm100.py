"""FlashAttention-4 SM100 (Blackwell) forward with the Ulysses post-attention All-to-All in its epilogue.

The SM100 counterpart of cute_kernels/fa4_a2a_sm90.py, with the same contract: rank r of P holds
q, k, v as [B, S, H_loc, D] (S = P * S_loc); row s of head h goes to rank d = s // S_loc at
out_d[b, s % S_loc, r * H_loc + h, :]. The destinations are one rank-window tensor, seen by the
kernel as (S_loc, D, H_loc, (B, P)) with strides (H*D, 1, D, (S_loc*H*D, W)) (the SM90 file's
nested batch mode, and its alignment helper for nested strides).

FA4's SM100 forward (flash_attn.cute.flash_fwd_sm100) computes two 128-row Q tiles per CTA
(q_stage = 2; one when S <= 128), with 2-CTA MMA for D=128 non-causal. The correction warps move
each finished O stage TMEM -> registers -> sO and signal the epilogue warp (warp 13), which
stores it. Only that warp's `epilogue_s2g` is replaced here; the CTA v, stage s of work tile
m_block owns rows [t*128, t*128 + 128) with t = (m_block * q_stage + s) * cta_group_size + v.
Two O paths (compile-time `o_store`), both issued by warp 13:
- "tma": one TMA store per stage into rank t*128 // S_loc, through one descriptor for all ranks.
  Needs S_loc % 128 == 0 (every stage inside one rank, as on SM90).
- "st": per-thread predicated 16-byte stores from sO, once per rank the stage touches, each row
  stored where 0 <= local row < S_loc. FA4's own non-TMA store loads the whole stage into
  registers first (64 x 16 B per lane with one warp); this path streams one row's share at a time
  (2 x 16 B at D=128). ptxas 13.4 for sm_100a (CPU, 2026-12-03, D=128, 2-CTA): 128 registers,
  0 bytes spilled, for both paths and for FA4's own forward.
Tiles past the sequence (row >= S) store nothing. The warp waits only for the bulk store's smem
read before releasing the stage (as FA4 does); visibility to other ranks comes from the barrier
kernel launched after this one (cute_kernels/signal.py).

The log-sum-exp (optional, fp32 windows (P, B, H, S_loc)) is written by FA4's correction warps in
128-row tiles of the row mode; the row mode here is (S_loc, P) with strides (1, window stride),
which FA4's tiling addresses correctly only when S_loc % 128 == 0, so cute_kernels.fa4 refuses LSE
windows for other S_loc on SM100 (ValueError) rather than writing wrong rows.

Rank-rotated tile order (compile-time `rotate`, as in the SM90 file; __call__ then takes the
rank): FA4's non-causal static persistent scheduler walks linear tiles t = c, c + grid, ... with
t = (head, batch) * m_blocks + i, i the work tile of q_stage * cta_group_size * 128 rows (512 for
D=128 with 2-CTA MMA); the rotated one (RankRotatedStaticPersistentTileScheduler) computes work
tile (i + k) mod m_blocks, k = floor(((r + 1) mod P) * S_loc / (q_stage * cta_group_size * 128)).
FA4's single-tile scheduler, which it takes when not persistent, is rotated the same way. Same
tiles, same output. Refused (ValueError) for causal and for FA4's CLC scheduler (both
LPT-ordered).

Status (2026-12-03): compiled for sm_100a on CPU only (tests/cpu/test_fused_compile_sm100.py);
it has not run on a Blackwell GPU. tests/gpu/test_fused_a2a_sm100.py checks it bit for bit
against FA4's SM100 forward plus the reference A2A on an SM100 device.
"""

from contextlib import contextmanager
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

import flash_attn.cute.flash_fwd_sm100 as _fa4_sm100
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100
from quack import copy_utils

from cute_kernels.fa4_a2a_sm90 import (
    _assume_nested_aligned,
    check_rank_window_options,
    check_rotatable,
    rank_rotated_scheduler,
    rank_rotation_shift,
    rank_window_o,
)


@contextmanager
def _nested_stride_alignment():
    """While FA4's __call__ is traced, let its alignment helper accept nested strides."""
    saved = _fa4_sm100.assume_tensor_aligned
    _fa4_sm100.assume_tensor_aligned = _assume_nested_aligned
    try:
        yield
    finally:
        _fa4_sm100.assume_tensor_aligned = saved


@contextmanager
def _tile_scheduler(kernel, scheduler_cls):
    """While FA4's __call__ is traced, the kernel schedules its tiles with `scheduler_cls`."""
    saved = kernel.TileScheduler
    kernel.TileScheduler = scheduler_cls
    try:
        yield
    finally:
        kernel.TileScheduler = saved


def lse_rows(mLSEWindows: cute.Tensor) -> cute.Tensor:
    """(p, b, h, s_loc) LSE windows -> FA4's (b, h, s) with s = (s_loc, p): a flat row index s
    addresses rank s // s_loc. FA4 tiles that row mode by 128; the tiles are exact only when 128
    divides s_loc (tests/cpu/test_fused_compile_sm100.py evaluates the tiling)."""
    l = mLSEWindows.layout
    return cute.make_tensor(
        mLSEWindows.iterator,
        cute.make_layout(
            (l.shape[1], l.shape[2], (l.shape[3], l.shape[0])),
            stride=(l.stride[1], l.stride[2], (l.stride[3], l.stride[0])),
        ),
    )


class FlashAttentionA2AForwardSm100(FlashAttentionForwardSm100):
    """FA4's SM100 forward whose epilogue warp routes each O stage to its Ulysses rank.

    Everything but the epilogue warp's store is FA4's (warp roles, TMEM, pipelines, schedulers,
    the correction warps' LSE). Tile configuration: FA4's own (see cute_kernels.fa4).
    rotate: the rank-rotated tile order (see the module docstring); __call__ then takes `rank`.
    """

    def __init__(self, *args, o_store: str = "tma", rotate: bool = False, **kwargs):
        if kwargs.get("is_varlen_q", False) or kwargs.get("is_split_kv", False):
            raise ValueError("is_varlen_q, is_split_kv: the rank-window epilogue takes dense q only")
        check_rank_window_options(o_store, rotate, kwargs)
        self.o_store = o_store
        self.rotate = rotate
        super().__init__(*args, **kwargs)
        # FA4 picked TMA O (dense q, no pack_gqa): warp 13 is the epilogue warp. "st" keeps that
        # warp and its pipeline but has FA4 build a per-thread gmem copy instead of a TMA atom.
        assert self.use_tma_O and not self.use_correction_warps_for_epi
        self.use_tma_O = o_store == "tma"
        if rotate:
            check_rotatable(self.TileScheduler)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s, h_loc, d): full sequence, this rank's heads
        mK: cute.Tensor,  # (b, s_k, h_kv_loc, d)
        mV: cute.Tensor,  # (b, s_k, h_kv_loc, dv)
        mOWindows: cute.Tensor,  # (p, b, s_loc, h_loc, dv): this rank's head slice of every window
        mLSEWindows: Optional[cute.Tensor],  # (p, b, h_loc, s_loc) fp32, or None
        softmax_scale: Float32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # (b,) valid keys (padded sequences)
        rank: Optional[Int32] = None,  # this source rank, when rotate
        stream: cuda.CUstream = None,
    ):
        mO = rank_window_o(mOWindows)
        mLSE = lse_rows(mLSEWindows) if const_expr(mLSEWindows is not None) else None
        scheduler = self.TileScheduler
        if const_expr(self.rotate):
            if const_expr(rank is None):
                raise ValueError("rank: the rank-rotated build needs the source rank")
            # a work tile (cluster) covers q_stage * cta_group_size * 128 rows
            block_rows = self.cta_tiler[0] * self.cta_group_size
            block_shift = rank_rotation_shift(rank, mOWindows.shape[0], mOWindows.shape[2], block_rows)
            scheduler = rank_rotated_scheduler(scheduler, block_shift)
        with _nested_stride_alignment(), _tile_scheduler(self, scheduler):
            super().__call__(mQ, mK, mV, mO, mLSE, softmax_scale, mSeqUsedK=mSeqUsedK, stream=stream)

    @cute.jit
    def epilogue_s2g(
        self,
        mO: cute.Tensor,  # (s_loc, dv, h_loc, (b, p)): TMA coordinates ("tma") or gmem ("st")
        sO: cute.Tensor,  # (128, dv, q_stage)
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        pipeline_o_epi: pipeline.PipelineAsync,
        pipeline_load_epi: Optional[pipeline.PipelineAsync],
        block_info: BlockInfo,
        num_splits: int,
        SeqlenInfoCls: Callable,
        mma_tile_coord_v: Int32 = 0,
        blocksparse_tensors=None,
        tile_scheduler=None,
    ):
        epi_consumer_phase = Int32(0)
        load_epi_producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, 1
        )
        seqlen_loc = mO.shape[0]
        num_ranks = mO.shape[3][1]
        tile = (self.m_block_size, self.head_dim_v_padded)
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, split_idx = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            n_block_min, n_block_max = block_info.get_n_block_min_max(
                seqlen, m_block, split_idx=split_idx, num_splits=num_splits,
            )
            if const_expr(self.use_block_sparsity) or self.process_work_tile(
                block_info, seqlen, n_block_min, n_block_max
            ):
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipeline_o_epi.consumer_wait_w_index_phase(stage, epi_consumer_phase)
                    m_tile_idx = (m_block * self.q_stage + stage) * self.cta_group_size + mma_tile_coord_v
                    row0 = m_tile_idx * self.m_block_size
                    dst_first = row0 // seqlen_loc
                    if const_expr(self.o_store == "tma"):
                        # S_loc % 128 == 0: the stage is inside rank dst_first, or past the sequence
                        if row0 < seqlen.seqlen_q:
                            mO_dst = mO[None, None, head_idx, (batch_idx, dst_first)]
                            gO = cute.local_tile(
                                cute.domain_offset((row0 - dst_first * seqlen_loc, 0), mO_dst), tile, (0, 0)
                            )
                            store_O, _, _ = copy_utils.tma_get_copy_fn(
                                tma_atom_O, 0, cute.make_layout(1), sO[None, None, stage], gO,
                                single_stage=True,
                            )
                            store_O()
                        cute.arch.cp_async_bulk_commit_group()
                    else:
                        self._store_stage_to_ranks(
                            sO[None, None, stage], mO, gmem_tiled_copy_O, row0, dst_first,
                            seqlen_loc, num_ranks, head_idx, batch_idx,
                        )
                        pipeline_o_epi.consumer_release_w_index(stage)
                if const_expr(self.o_store == "tma"):
                    for stage in cutlass.range_constexpr(self.q_stage):
                        # smem read, not the (remote) writes landed: then sO's stage is free
                        cute.arch.cp_async_bulk_wait_group(self.q_stage - 1 - stage, read=True)
                        pipeline_o_epi.consumer_release_w_index(stage)
                epi_consumer_phase ^= 1

            if const_expr(pipeline_load_epi is not None):
                pipeline_load_epi.producer_acquire(load_epi_producer_state)
                with cute.arch.elect_one():
                    pipeline_load_epi.producer_commit(load_epi_producer_state)
                load_epi_producer_state.advance()
            work_tile = tile_scheduler.advance_to_next_work()

    @cute.jit
    def _store_stage_to_ranks(
        self,
        sO_stage: cute.Tensor,
        mO: cute.Tensor,
        gmem_tiled_copy_O: cute.TiledCopy,
        row0: Int32,
        dst_first: Int32,
        seqlen_loc: Int32,
        num_ranks: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """Per-thread 16-byte stores of one 128-row stage, each row to its rank, one chunk at a time."""
        tidx = cute.arch.thread_idx()[0] % (cute.arch.WARP_SIZE * len(self.epilogue_warp_ids))
        tile = (self.m_block_size, self.head_dim_v_padded)
        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO_stage)
        tOcO = gmem_thr_copy_O.partition_S(cute.make_identity_tensor(tile))
        tOrO = cute.make_fragment_like(tOsO[None, 0, None], self.o_dtype)
        dst_last = (row0 + self.m_block_size - 1) // seqlen_loc
        if dst_last > num_ranks - 1:
            dst_last = num_ranks - 1
        for dst in cutlass.range(dst_first, dst_last + 1, unroll=1):
            row_off = row0 - dst * seqlen_loc  # local row of tile row 0 (may be < 0)
            mO_dst = mO[None, None, head_idx, (batch_idx, dst)]
            gO = cute.local_tile(cute.domain_offset((row_off, 0), mO_dst), tile, (0, 0))
            tOgO = gmem_thr_copy_O.partition_D(gO)
            for rest_m in cutlass.range(cute.size(tOsO.shape[1]), unroll=1):
                local_row = row_off + tOcO[0, rest_m, 0][0]
                if local_row >= 0 and local_row < seqlen_loc:
                    cute.autovec_copy(tOsO[None, rest_m, None], tOrO)
                    cute.copy(gmem_tiled_copy_O, tOrO, tOgO[None, rest_m, None])
