"""FlashAttention-4 SM90 backward with the Ulysses post-A2A of the gradients (heads -> sequence) in
its kernels: the mirror of cute_kernels/fa4_a2a_sm90.py for dQ, dK and dV.

Rank r of P holds q, o, dO as [B, N, H_loc, D] and k, v as [B, N, H_kv_loc, D] (its heads over the
full sequence, N = P * S_loc, rows in slot order). FA4's SM90 backward (flash_attn.cute.interface.
_flash_attn_bwd) is three kernels: a preprocess (dPsum = rowsum(dO * O), the LSE in base 2, dq_accum
zeroed), the main kernel (flash_bwd_sm90.FlashAttentionBackwardSm90: per KV block, dK and dV finished
in registers, dQ added in fp32 into dq_accum by bulk reduce-adds) and a postprocess per fp32
accumulator (flash_bwd_postprocess.FlashAttentionBackwardPostprocess: fp32 -> bf16). Here every row
of dq, dk, dv is stored straight into the rank that owns it, as the forward stores O: row s of head h
goes to window d = s // S_loc at [b, s % S_loc, r * h_loc + h, :] (h_loc = H_loc for dQ, H_kv_loc for
dK, dV). A window tensor is P buffers at one uniform stride W (peer memory mapped with CUDA VMM, or P
local buffers for emulated ranks), [P, B, S_loc, P * h_loc, D], seen by the kernels as the forward's
(S_loc, D, h_loc, (B, P)) with strides (P*h_loc*D, 1, D, (S_loc*P*h_loc*D, W)) (rank_window_o).

- dK, dV without GQA (qhead_per_kvhead == 1): FlashAttentionA2ABackwardSm90, FA4's main kernel with
  its epilogue_dKV (the one store of each finished KV block) routed. Two paths (compile-time
  `dkv_store`): "tma", FA4's own epilogue and TMA store given rank dst's window (needs S_loc % tile_n
  == 0 and no seqused_k: every tile inside one rank, no row past the valid keys); "st", FA4's
  registers -> smem staging, then per-thread 16-byte stores issued once per rank the tile touches,
  each row predicated on 0 <= local row < S_loc and row < seqused_k (any S_loc). FA4's main kernel
  hands its epilogue a TMA coordinate tensor for dK/dV, not memory (flash_bwd_sm90.py:583, 4.0.0b36),
  so the "st" path takes the two window tensors through FA4's aux-tensor slot (unused without
  score_mod / mask_mod: its only effect is FA4 precomputing two unused fast divisors), as the
  forward's stamps and pacer do. FA4 makes dK/dV ragged TMA tensors when seqused_k is given
  (flash_bwd_sm90.py:374, 493-502); the windows never are (varlen_k reads False here).
- dK, dV with GQA (qhead_per_kvhead > 1): FA4 accumulates them in fp32 (dk_accum / dv_accum, one
  bulk reduce-add per query head of the group, flash_bwd_sm90.py:1724-1801),
  so the main kernel is FA4's unchanged and the postprocess below routes the conversion.
- dQ (and GQA's dK, dV): FlashAttentionA2ABackwardPostprocessSm90, FA4's postprocess whose store goes
  to the windows. FA4's postprocess kernel is one method (flash_bwd_postprocess.py:472-741, with the
  SM80/SM100/varlen/learnable-sink branches and the store inline at its end, 722-741); this subclass
  restates its SM90 path (683-720: the accumulator tile g2s -> MMA fragment -> scaled bf16 -> smem,
  then 16-byte rows) and
  stores each row predicated per rank like "st" above, so every S_loc works (FA4's backward tile_m is
  80 at D=128 non-causal, which seldom divides S_loc). Scale, conversion and rounding are FA4's.

Joint (text) rows (compile-time `joint`, "st" dK/dV stores; SM100: cute_kernels.fa4_bwd_a2a_sm100): the rows are then N = P * S_loc
+ J, query rows [sequence slots, J joint] and key rows [S sequence keys, J joint, padding keys]
(ulysses.layout with suffix padding; S = seqused_k - J, or P * S_loc without padding keys). store_rows
takes the rank's own [B, J, h, D] tensor: rows seqlen - J .. seqlen - 1 (seqlen: N for dQ, seqused_k or
N for dK, dV) go there, only rows before them to the windows. The joint rows' grads are the rank's own
(every rank holds all joint rows; ulysses' backward sums them over the ranks), so they are never sent.

Values are FA4's bit for bit: the same kernels compute them, only where they are stored differs. FA4's
dQ (and GQA's dK, dV) sums are fp32 bulk reduce-adds whose order varies between runs unless
`deterministic` (FA4's semaphore-ordered mode), as in FA4's own backward.
Rows >= seqused_k of dK, dV (padding keys, whose gradient is zero) are not written, as FA4 writes
none there: the caller zeroes them (fa_a2a.engine.backward does).

Ordering: as in the forward, no kernel waits for its remote writes to land. TMA stores are waited for
only until they have read shared memory; per-thread stores are fire-and-forget. The consumer learns
that all of dq, dk, dv are visible from a barrier kernel launched after the last of these kernels
(the postprocess) on the same stream (system-scope release/acquire flags, cute_kernels/signal.py):
kernel completion orders every store of the earlier grids before that barrier's release.

Launch: cute_kernels.fa4_bwd_a2a.fa4_bwd_a2a_launcher (FA4's preprocess, the main kernel, the
postprocesses; compiled once per key through cute_kernels.compile_cache, launched on the current stream
through TVM-FFI; graph-capturable).

Measured (one H200, 2026-12-05, bf16): tests/gpu/test_bwd_a2a.py, 15 passed: the windows equal FA4's
own backward moved by the reference exchange bit for bit (P 2-8, D 64 / 128, causal, both dK/dV store
paths, S_loc below and not a multiple of the tile, GQA, padded keys left unwritten). In the op
(fa_a2a.engine.backward, `python -m fa_a2a.bench --backward --quick`, D 128, H 24): two processes
under MPS, forward + backward of the whole call / FA4's forward + backward alone 1.012 at S 16384 and
1.503 at 4608 (the backward alone 0.995 / 1.398); emulated P = 8 (eager, all 8 ranks' host work
included), backward / 8 x FA4's 1.023 at M 16384, 1.109 at 8192.
The kernels' own cost (one H100, 2026-12-06, bf16, D 128, H_loc 3, emulated P 8, rank 0's backward,
CUDA-graph replays paired per trial, 15 trials; `python examples/fused_speed.py --backward --seqlens 8192
16384 32768`): fused / FA4's backward 1.0000 / 0.9993 / 0.9992 with dK, dV by TMA and 1.0061 / 1.0064 /
1.0066 stored per thread, against 1.0002 / 0.9993 / 1.0001 for a second graph of FA4's backward: the three
gradients' A2A costs nothing measurable on the TMA path, ~0.6% on the per-thread one.
"""

import inspect
from contextlib import contextmanager
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

import flash_attn.cute.flash_bwd_sm90 as _fa4_bwd
from flash_attn.cute import utils
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.named_barrier import NamedBarrierBwd
from flash_attn.cute.tile_scheduler import SingleTileScheduler, TileSchedulerArguments
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils

from cute_kernels.fa4_a2a_sm90 import _assume_nested_aligned, rank_window_o
from cute_kernels.limits import HEAD_DIMS

DKV_STORES = ("tma", "st")


@contextmanager
def _nested_stride_alignment():
    """While FA4's backward __call__ is traced, let its alignment helper accept nested strides."""
    saved = _fa4_bwd.assume_tensor_aligned
    _fa4_bwd.assume_tensor_aligned = _assume_nested_aligned
    try:
        yield
    finally:
        _fa4_bwd.assume_tensor_aligned = saved


@cute.jit
def store_rows(
    tiled_copy: cute.TiledCopy,
    tidx: Int32,
    sX: cute.Tensor,  # (tile_rows, tile_cols) in smem: rows row0.. of the sequence
    mX: cute.Tensor,  # ((b, p), s_loc, h, d): the windows
    tile_rows: cutlass.Constexpr[int],
    tile_cols: cutlass.Constexpr[int],
    row0: Int32,
    head_idx: Int32,
    batch_idx: Int32,
    seqlen: Int32,
    mJoint: Optional[cute.Tensor] = None,  # (b, j, h, d): this rank's joint rows, its own memory
):
    """A tile from smem into the windows: 16-byte per-thread stores, issued once per rank the tile
    touches, each row predicated on 0 <= local row < S_loc and row < seqlen. With mJoint (J rows) the
    last J rows before seqlen are joint rows: row seqlen - J + j goes to mJoint[b, j], and only rows
    before them to the windows."""
    seqlen_loc = mX.shape[1]
    num_ranks = mX.shape[0][1]
    seq_end = seqlen
    if const_expr(mJoint is not None):
        seq_end = seqlen - mJoint.shape[1]
    thr = tiled_copy.get_slice(tidx)
    tXsX = thr.partition_S(sX)
    tXrX = cute.make_fragment_like(tXsX)
    cute.autovec_copy(tXsX, tXrX)
    tXcX = thr.partition_S(cute.make_identity_tensor((tile_rows, tile_cols)))
    dst_first = row0 // seqlen_loc
    dst_last = (row0 + tile_rows - 1) // seqlen_loc
    if dst_last > num_ranks - 1:
        dst_last = num_ranks - 1
    for dst in cutlass.range(dst_first, dst_last + 1, unroll=1):
        row_off = row0 - dst * seqlen_loc  # local row of tile row 0 (may be < 0)
        gX = cute.local_tile(
            cute.domain_offset((row_off, 0), mX[(batch_idx, dst), None, head_idx, None]),
            (tile_rows, tile_cols),
            (0, 0),
        )
        tXgX = thr.partition_D(gX)
        for rest_m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
            row = tXcX[0, rest_m, 0][0]
            if row_off + row >= 0 and row_off + row < seqlen_loc and row0 + row < seq_end:
                cute.copy(tiled_copy, tXrX[None, rest_m, None], tXgX[None, rest_m, None])
    if const_expr(mJoint is not None):
        joint_off = row0 - seq_end  # joint row of tile row 0 (may be < 0)
        if joint_off + tile_rows > 0:
            gJ = cute.local_tile(
                cute.domain_offset((joint_off, 0), mJoint[batch_idx, None, head_idx, None]),
                (tile_rows, tile_cols),
                (0, 0),
            )
            tXgJ = thr.partition_D(gJ)
            for rest_m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
                row = tXcX[0, rest_m, 0][0]
                if joint_off + row >= 0 and row0 + row < seqlen:
                    cute.copy(tiled_copy, tXrX[None, rest_m, None], tXgJ[None, rest_m, None])


_MMA_SIGNATURE = inspect.signature(FlashAttentionBackwardSm90.mma)


class FlashAttentionA2ABackwardSm90(FlashAttentionBackwardSm90):
    """FA4's SM90 backward whose dK/dV epilogue stores each finished KV block into the windows of the
    ranks that own its rows (module docstring). Everything else (the preprocess contract, mainloop,
    dQ accumulation, scheduler, deterministic mode) is FA4's. No GQA: FA4 accumulates GQA's dK, dV in
    fp32, and FlashAttentionA2ABackwardPostprocessSm90 routes them instead."""

    def __init__(self, *args, dkv_store: str = "st", joint: bool = False, **kwargs):
        if dkv_store not in DKV_STORES:
            raise ValueError(f"dkv_store: one of {DKV_STORES}, got {dkv_store!r}")
        if joint and dkv_store != "st":
            raise ValueError("dkv_store: joint rows are stored per thread ('st'), got 'tma'")
        super().__init__(*args, **kwargs)
        if self.qhead_per_kvhead != 1:
            raise ValueError(
                f"qhead_per_kvhead: {self.qhead_per_kvhead} > 1 (GQA) makes FA4 accumulate dK, dV in fp32 "
                "across the query heads; run FA4's FlashAttentionBackwardSm90 and route them with "
                "FlashAttentionA2ABackwardPostprocessSm90")
        if self.check_hdim_oob or self.check_hdim_v_oob or self.dKV_swapAB:
            raise ValueError(f"head_dim: the routed epilogue takes head dims {HEAD_DIMS}")
        self.dkv_store, self.joint = dkv_store, joint

    # FA4 sets varlen_k in __call__ (seqused_k) to make dK/dV ragged TMA tensors; the windows never are
    # (a ragged view would add a sixth TMA mode): this epilogue predicates the rows itself.
    @property
    def varlen_k(self) -> bool:
        return False

    @varlen_k.setter
    def varlen_k(self, _value) -> None:
        pass

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, n, h_loc, d)
        mK: cute.Tensor,  # (b, n, h_loc, d)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (b, n, h_loc, d)
        mLSE: cute.Tensor,  # (b, h_loc, n_rounded) fp32, base 2 (FA4's preprocess)
        mdPsum: cute.Tensor,  # (b, h_loc, n_rounded) fp32
        mdQaccum: cute.Tensor,  # (b, h_loc, n_rounded * d) fp32, zeroed by the preprocess
        mdKWindows: cute.Tensor,  # (p, b, s_loc, h_loc, d): this rank's head slice of every window
        mdVWindows: cute.Tensor,
        softmax_scale: Float32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # (b,) valid keys (a suffix mask)
        mdQ_semaphore: Optional[cute.Tensor] = None,  # deterministic: (b, h_loc, m_blocks, 1) int32
        mdKJoint: Optional[cute.Tensor] = None,  # joint: (b, j, h_loc, d), the rank's joint key rows' dK
        mdVJoint: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,
    ):
        mdK, mdV = rank_window_o(mdKWindows), rank_window_o(mdVWindows)
        aux_data = AuxData()
        if const_expr(self.dkv_store == "st"):
            aux = [_assume_nested_aligned(mdK), _assume_nested_aligned(mdV)]
            if const_expr(self.joint):
                aux += [assume_tensor_aligned(mdKJoint), assume_tensor_aligned(mdVJoint)]
            aux_data = AuxData(aux, None)
        with _nested_stride_alignment():
            # FA4's __call__ named: the DSL re-executes this body, where super() would follow type(self)
            FlashAttentionBackwardSm90.__call__(
                self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale,
                None, None, None, mSeqUsedK, None, None, mdQ_semaphore, None, None, aux_data, None, None,
                stream=stream,
            )

    def mma(self, *args, **kwargs):
        """FA4's consumer warp groups; the "st" build takes the windows from the aux slot."""
        if const_expr(self.dkv_store == "st"):
            self._dkv_windows = _MMA_SIGNATURE.bind(self, *args, **kwargs).arguments["aux_data"].tensors
        FlashAttentionBackwardSm90.mma(self, *args, **kwargs)

    @cute.jit
    def epilogue_dKV(
        self,
        acc_dV: cute.Tensor,
        mdV: cute.Tensor,  # TMA coordinates (s_loc, d, h_loc, (b, p))
        sV: cute.Tensor,
        acc_dK: cute.Tensor,
        mdK: cute.Tensor,
        sK: cute.Tensor,
        seqlen,
        tma_atom_dK: cute.CopyAtom,
        tma_atom_dV: cute.CopyAtom,
        tiled_mma_dK: cute.TiledMma,
        tiled_mma_dV: cute.TiledMma,
        tidx: Int32,
        n_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        qhead_per_kvhead_divmod=None,
        mdK_semaphore: Optional[cute.Tensor] = None,
        mdV_semaphore: Optional[cute.Tensor] = None,
    ):
        row0 = n_block * self.tile_n
        if const_expr(self.dkv_store == "tma"):
            # S_loc % tile_n == 0: the whole block belongs to rank dst. FA4's epilogue (staging, TMA
            # store), given rank dst's window shifted so that its row n_block * tile_n is the block's
            # first local row.
            seqlen_loc = mdK.shape[0]
            dst = row0 // seqlen_loc
            mdK_dst = cute.domain_offset((-dst * seqlen_loc, 0, 0, 0), mdK[None, None, None, (None, dst)])
            mdV_dst = cute.domain_offset((-dst * seqlen_loc, 0, 0, 0), mdV[None, None, None, (None, dst)])
            FlashAttentionBackwardSm90.epilogue_dKV(
                self, acc_dV, mdV_dst, sV, acc_dK, mdK_dst, sK, seqlen, tma_atom_dK, tma_atom_dV,
                tiled_mma_dK, tiled_mma_dV, tidx, n_block, head_idx, batch_idx,
            )
        else:
            # FA4's registers -> smem staging (sK, sV are free once every MMA thread is here), then
            # the per-thread stores
            epi_barrier = cutlass.pipeline.NamedBarrier(
                barrier_id=int(NamedBarrierBwd.Epilogue), num_threads=self.num_mma_threads
            )
            copy_dV_r2s, _, _ = copy_utils.get_smem_store_C(tiled_mma_dV, sV, tidx, position_independent=True)
            copy_dK_r2s, _, _ = copy_utils.get_smem_store_C(tiled_mma_dK, sK, tidx, position_independent=True)
            epi_barrier.arrive_and_wait()
            copy_dV_r2s(acc_dV, dst_idx=None)
            copy_dK_r2s(acc_dK, dst_idx=None)
            epi_barrier.arrive_and_wait()
            mdK_win, mdV_win = self._dkv_windows[0], self._dkv_windows[1]
            mdK_joint = self._dkv_windows[2] if const_expr(self.joint) else None
            mdV_joint = self._dkv_windows[3] if const_expr(self.joint) else None
            copy_elems = 128 // self.dtype.width
            gmem_copy = copy_utils.tiled_copy_2d(
                self.dtype, self.tile_hdim // copy_elems, self.num_mma_threads, copy_elems
            )
            store_rows(gmem_copy, tidx, sV, mdV_win, self.tile_n, self.tile_hdimv, row0, head_idx, batch_idx,
                       seqlen.seqlen_k, mdV_joint)
            store_rows(gmem_copy, tidx, sK, mdK_win, self.tile_n, self.tile_hdim, row0, head_idx, batch_idx,
                       seqlen.seqlen_k, mdK_joint)


class RoutedPostprocess(FlashAttentionBackwardPostprocess):
    """FA4's postprocess (fp32 accumulator -> bf16/fp16, scaled) whose kernel stores each row into the
    window of the rank that owns it: the launch of both architectures' routed postprocesses (this file's
    SM90 one, cute_kernels.fa4_bwd_a2a_sm100's); a subclass names its kernel's copies (_kernel_copies)."""

    def _kernel_copies(self) -> tuple:
        raise NotImplementedError

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (b, h_loc, n_rounded * d) fp32: FA4's accumulator tiles
        mWindows: cute.Tensor,  # (p, b, s_loc, h_loc, d): this rank's head slice of every window
        scale: Float32,
        mSeqUsed: Optional[cute.Tensor] = None,  # (b,) rows to write (dK, dV: seqused_k)
        mJoint: Optional[cute.Tensor] = None,  # (b, j, h_loc, d): the rank's joint rows (store_rows)
        stream: cuda.CUstream = None,
    ):
        if const_expr(mWindows.element_type not in [cutlass.Float16, cutlass.BFloat16]):
            raise TypeError("Only Float16 or BFloat16 is supported")
        if const_expr(mAccum.element_type != Float32):
            raise TypeError("The accumulator must be Float32")
        mAccum = assume_tensor_aligned(mAccum)
        mOut = _assume_nested_aligned(rank_window_o(mWindows))  # ((b, p), s_loc, h_loc, d)
        self.tiled_mma = self._get_tiled_mma()
        self._setup_attributes()
        smem_size = max(
            cute.size_in_bytes(Float32, self.sdQaccum_layout),
            cute.size_in_bytes(self.dtype, self.sdQ_layout),
        )
        seqlen = mWindows.shape[0] * mWindows.shape[2]
        if const_expr(mJoint is not None):
            mJoint = assume_tensor_aligned(mJoint)
            seqlen = seqlen + mJoint.shape[1]
        sched_args = TileSchedulerArguments(
            num_block=cute.ceil_div(seqlen, self.tile_m),
            num_head=mWindows.shape[3],
            num_batch=mWindows.shape[1],
            num_splits=1,
            seqlen_k=0,
            headdim=mWindows.shape[4],
            headdim_v=0,
            total_q=seqlen,
            tile_shape_mn=(self.tile_m, 1),
        )
        sched_params = SingleTileScheduler.to_underlying_arguments(sched_args)
        self.kernel(
            mAccum, mOut, mSeqUsed, mJoint, scale, self.tiled_mma, self.sdQaccum_layout, self.sdQ_layout,
            *self._kernel_copies(), sched_params,
        ).launch(
            grid=SingleTileScheduler.get_grid_shape(sched_params),
            block=[self.num_threads, 1, 1],
            smem=smem_size,
            stream=stream,
        )


class FlashAttentionA2ABackwardPostprocessSm90(RoutedPostprocess):
    """FA4's SM90 postprocess (fp32 accumulator -> bf16/fp16, scaled) storing each row into the window
    of the rank that owns it (module docstring): dQ from dq_accum, and GQA's dK, dV from dk_accum,
    dv_accum. FA4's copies and layouts (_get_tiled_mma, _setup_attributes); no varlen, no sink."""

    def __init__(self, dtype, head_dim: int, tile_m: int, num_threads: int, atom_layout: int, swap_ab: bool):
        super().__init__(dtype, head_dim, 90, tile_m, num_threads, atom_layout, swap_ab)
        if self.check_hdim_oob:
            raise ValueError(f"head_dim: the routed postprocess takes head dims {HEAD_DIMS}")

    def _kernel_copies(self) -> tuple:
        return self.g2s_tiled_copy_dQaccum, self.s2r_tiled_copy_dQaccum, self.gmem_tiled_copy_dQ

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,
        mOut: cute.Tensor,
        mSeqUsed: Optional[cute.Tensor],
        mJoint: Optional[cute.Tensor],
        scale: Float32,
        tiled_mma: cute.TiledMma,
        sAccum_layout: cute.Layout,
        sOut_layout: cute.ComposedLayout,
        g2s_tiled_copy: cute.TiledCopy,
        s2r_tiled_copy: cute.TiledCopy,
        gmem_tiled_copy: cute.TiledCopy,
        sched_params: SingleTileScheduler.Params,
    ):
        smem = cutlass.memory.SmemAllocator()
        sAccum = smem.allocate_tensor(Float32, sAccum_layout, byte_alignment=1024)
        sAccum_flat = cute.make_tensor(sAccum.iterator, cute.make_layout(cute.size(sAccum)))
        sOut = cute.make_tensor(cute.recast_ptr(sAccum.iterator, dtype=self.dtype), sOut_layout)
        tidx, _, _ = cute.arch.thread_idx()
        # one tile per CTA, the grid exactly the tiles
        work_tile = SingleTileScheduler.create(sched_params).initial_work_tile_info()
        m_block, head_idx, batch_idx, _ = work_tile.tile_idx
        seqlen = mOut.shape[1] * mOut.shape[0][1]
        if const_expr(mJoint is not None):
            seqlen = seqlen + mJoint.shape[1]
        if const_expr(mSeqUsed is not None):
            seqlen = mSeqUsed[batch_idx]
        gAccum = cute.local_tile(mAccum[batch_idx, head_idx, None], (self.tile_m * self.tile_hdim,), (m_block,))
        # FA4's SM90 steps: the accumulator tile gmem -> smem -> MMA fragment, scaled and converted,
        # fragment -> smem (FA4's dQ layout)
        g2s = g2s_tiled_copy.get_slice(tidx)
        cute.copy(g2s_tiled_copy, g2s.partition_S(gAccum), g2s.partition_D(sAccum_flat))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        tAsA = s2r_tiled_copy.get_slice(tidx).partition_S(sAccum)
        tile_shape = (self.tile_m, self.tile_hdim)
        acc = cute.make_rmem_tensor(
            tiled_mma.partition_shape_C(tile_shape if const_expr(not self.dQ_swapAB) else tile_shape[::-1]),
            Float32,
        )
        cute.autovec_copy(tAsA, cute.make_tensor(acc.iterator, cute.make_layout(tAsA.shape)))
        rOut = cute.make_fragment_like(acc, self.dtype)
        rOut.store((acc.load() * scale).to(self.dtype))
        cute.arch.barrier()  # every thread has read its accumulator values (sOut aliases sAccum)
        r2s = cute.make_tiled_copy_C(
            utils.get_smem_store_atom(self.arch, self.dtype, transpose=self.dQ_swapAB), tiled_mma
        ).get_slice(tidx)
        sOut_mma = sOut if const_expr(not self.dQ_swapAB) else layout_utils.transpose_view(sOut)
        cute.copy(r2s, r2s.retile(rOut), r2s.partition_D(sOut_mma))
        cute.arch.barrier()  # the tile is in smem
        store_rows(gmem_tiled_copy, tidx, sOut, mOut, self.tile_m, self.tile_hdim, m_block * self.tile_m,
                   head_idx, batch_idx, seqlen, mJoint)
