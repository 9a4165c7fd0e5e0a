"""FlashAttention-4 SM100 (Blackwell) backward with the Ulysses post-A2A of dQ, dK, dV in its kernels:
the SM100 counterpart of cute_kernels/fa4_bwd_a2a_sm90.py, with the same contract.

Rank r of P holds q, o, dO as [B, N, H_loc, D] and k, v as [B, N, H_kv_loc, D] (N = P * S_loc, rows in
slot order); row s of head h of dq (dk, dv) goes to window d = s // S_loc at [b, s % S_loc, r * h_loc
+ h, :]. The windows are seen as the forward's ((B, P), S_loc, h_loc, D) (rank_window_o). FA4's SM100
backward (flash_attn.cute.interface._flash_attn_bwd on SM100, 4.0.0b36) is FA4's preprocess, the
main kernel (flash_bwd_sm100.FlashAttentionBackwardSm100: tile_m = tile_n = 128, 2-CTA MMA for
D >= 128 unless FA_DISABLE_2CTA; per KV block dK and dV finished in TMEM, dQ added in fp32 into
dq_accum) and a postprocess per fp32 accumulator.

- dK, dV without GQA: FlashAttentionA2ABackwardSm100. FA4's compute warps load each finished dV,
  then dK, TMEM -> registers with 32x32b loads: one thread holds one row (its TMEM lane), the two
  warp groups split the columns. FA4 has two epilogues: TMA (its default) and per-thread 16-byte
  stores from registers (epilogue_dKV, what it runs for varlen keys). The routed build always takes
  the per-thread one (`use_tma_store` held False) and gives every thread's store the window of the
  rank that owns its row: dst = s // S_loc, local row s - dst * S_loc, predicated on s < seqused_k
  (any S_loc, no smem staging, one row per thread so no tile splits over ranks inside a thread).
  Joint (text) rows (compile-time `joint`), the SM90 file's contract: key rows seqused_k - J ..
  seqused_k - 1 go to the rank's own [B, J, h, D] tensors instead (the thread's row, one predicate);
  the tensors reach the compute warps through FA4's aux slot (its __call__ -> compute_loop), as the
  SM90 build passes its windows.
  Scaling (dK by softmax_scale), conversion and rounding are FA4's lines; the pipeline release is
  FA4's, with the consumer state advanced after dK as well as after dV (FA4's epilogue_dKV returns
  it after dK un-advanced; its TMA epilogue advances after both: the state has two stages, dV's and
  dK's, so a CTA that takes a second tile needs the advance).
- dQ and GQA's dK, dV: FlashAttentionA2ABackwardPostprocessSm100, FA4's postprocess (one method
  with the store inline, flash_bwd_postprocess.py) whose SM100 steps are restated: the accumulator
  tile straight from gmem into registers in the writer's tile order (AccumTileOrder: the 2-CTA dQ
  is read in TMEM fragment order, thread = row), scaled bf16 into smem (FA4's sdQ), then the
  SM90 file's store_rows: 16-byte per-thread rows, each predicated per rank.

Values are FA4's bit for bit (the same kernels compute them); only where they are stored differs.
Ordering as on SM90: no kernel waits for its remote writes; the barrier kernel launched after the
last postprocess on the same stream publishes them (cute_kernels/signal.py).

Status (2026-12-05; joint rows 2026-12-06): compiled for sm_100a on CPU only
(tests/cpu/test_bwd_a2a_compile_sm100.py); it has not run on a Blackwell GPU (none is lent). ptxas 13.0 (sm_100a, 2026-12-05): the main kernel uses 128
registers; D 128 with 2-CTA MMA spills 8 bytes, as FA4's own kernel of that configuration does (8 bytes
with its TMA epilogue, 16 with its per-thread one); D 128 1-CTA and D 64 spill none; the postprocesses
58-96 registers, no spill. tests/gpu/test_bwd_a2a.py checks it against FA4's own
SM100 backward moved by the reference exchange on an SM100 device.
"""

import inspect
import math
from contextlib import contextmanager
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils_basic
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05
from cutlass.utils import LayoutEnum

import flash_attn.cute.flash_bwd_sm100 as _fa4_bwd_sm100
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100
from flash_attn.cute.tile_scheduler import SingleTileScheduler
from flash_attn.cute.utils import AuxData

from cute_kernels.fa4_a2a_sm90 import _assume_nested_aligned, rank_window_o
from cute_kernels.fa4_bwd_a2a_sm90 import RoutedPostprocess, store_rows
from cute_kernels.limits import HEAD_DIMS


@contextmanager
def _nested_stride_alignment():
    """While FA4's SM100 backward __call__ is traced, let its alignment helper accept nested strides."""
    saved = _fa4_bwd_sm100.assume_tensor_aligned
    _fa4_bwd_sm100.assume_tensor_aligned = _assume_nested_aligned
    try:
        yield
    finally:
        _fa4_bwd_sm100.assume_tensor_aligned = saved


_COMPUTE_SIGNATURE = inspect.signature(FlashAttentionBackwardSm100.compute_loop)


class FlashAttentionA2ABackwardSm100(FlashAttentionBackwardSm100):
    """FA4's SM100 backward whose dK/dV epilogue stores each thread's row into the window of the rank
    that owns it (module docstring). Everything else (warp roles, TMEM, pipelines, dQ accumulation,
    scheduler, deterministic mode) is FA4's. No GQA: FA4 accumulates GQA's dK, dV in fp32 and
    FlashAttentionA2ABackwardPostprocessSm100 routes them."""

    def __init__(self, *args, joint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.joint = joint
        if self.qhead_per_kvhead != 1:
            raise ValueError(
                f"qhead_per_kvhead: {self.qhead_per_kvhead} > 1 (GQA) makes FA4 accumulate dK, dV in fp32; "
                "run FA4's FlashAttentionBackwardSm100 and route them with FlashAttentionA2ABackwardPostprocessSm100")
        if self.check_hdim_oob or self.check_hdim_v_oob or self.acc_m64:
            raise ValueError(f"head_dim: the routed epilogue takes head dims {HEAD_DIMS} with FA4's 128-row "
                             "KV tile per CTA")

    # FA4 sets use_tma_store in __call__ (TMA unless varlen keys); the routed epilogue is the
    # per-thread one, whatever the keys
    @property
    def use_tma_store(self) -> bool:
        return False

    @use_tma_store.setter
    def use_tma_store(self, _value) -> None:
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
        mdQ_semaphore: Optional[cute.Tensor] = None,  # deterministic: (b, h_loc, m_blocks, cluster) int32
        mdKJoint: Optional[cute.Tensor] = None,  # joint: (b, j, h_loc, d), the rank's joint key rows' dK
        mdVJoint: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,
    ):
        mdK, mdV = rank_window_o(mdKWindows), rank_window_o(mdVWindows)
        aux_data = AuxData()
        if const_expr(self.joint):  # to the compute warps' epilogue through FA4's aux slot (compute_loop)
            aux_data = AuxData([assume_tensor_aligned(mdKJoint), assume_tensor_aligned(mdVJoint)], None)
        with _nested_stride_alignment():
            # FA4's __call__ named: the DSL re-executes this body, where super() would follow type(self)
            FlashAttentionBackwardSm100.__call__(
                self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale,
                None, None, None, mSeqUsedK, None, None, mdQ_semaphore, None, None, aux_data, None, None,
                stream=stream,
            )

    def compute_loop(self, *args, **kwargs):
        """FA4's compute warps; the joint build takes the joint tensors from the aux slot."""
        self._dkv_joint = (None, None)
        if const_expr(self.joint):
            self._dkv_joint = tuple(_COMPUTE_SIGNATURE.bind(self, *args, **kwargs).arguments["aux_data"].tensors)
        return FlashAttentionBackwardSm100.compute_loop(self, *args, **kwargs)

    @cute.jit
    def epilogue_dKV(
        self,
        tidx: Int32,  # the thread's index in its warp group (FA4's dp_idx)
        warp_idx: Int32,
        batch_idx: Int32,
        head_idx: Int32,
        n_block: Int32,
        seqlen,
        thr_mma_dV: cute.ThrMma,
        thr_mma_dK: cute.ThrMma,
        tdVtdV: cute.Tensor,
        tdKtdK: cute.Tensor,
        mdV: cute.Tensor,  # the windows (s_loc, d, h_loc, (b, p))
        mdK: cute.Tensor,
        pipeline_dKV,
        consumer_state_dKV: cutlass.pipeline.PipelineState,
        softmax_scale: Float32,
    ):
        wg_idx = (cute.arch.thread_idx()[0] % (cute.arch.WARP_SIZE * len(self.compute_warp_ids))) // 128
        num_wg = cute.arch.WARP_SIZE * len(self.compute_warp_ids) // 128
        pipeline_dKV.consumer_wait(consumer_state_dKV)
        self._store_rows_routed(tidx, wg_idx, num_wg, thr_mma_dV, tdVtdV, mdV,
                                (self.mma_tiler_pdo[0], self.tile_hdimv), self.dv_dtype, None,
                                n_block, head_idx, batch_idx, seqlen.seqlen_k, self._dkv_joint[1])
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            pipeline_dKV.consumer_release(consumer_state_dKV)
        consumer_state_dKV.advance()
        pipeline_dKV.consumer_wait(consumer_state_dKV)
        self._store_rows_routed(tidx, wg_idx, num_wg, thr_mma_dK, tdKtdK, mdK,
                                (self.mma_tiler_dsq[0], self.tile_hdim), self.dk_dtype, softmax_scale,
                                n_block, head_idx, batch_idx, seqlen.seqlen_k, self._dkv_joint[0])
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            pipeline_dKV.consumer_release(consumer_state_dKV)
        consumer_state_dKV.advance()
        return consumer_state_dKV

    @cute.jit
    def _store_rows_routed(
        self,
        tidx: Int32,
        wg_idx: Int32,
        num_wg: cutlass.Constexpr[int],
        thr_mma: cute.ThrMma,
        tXtX: cute.Tensor,  # the finished dV or dK of the cluster tile in TMEM
        mX: cute.Tensor,  # the windows (s_loc, d, h_loc, (b, p))
        tile: cutlass.Constexpr,  # (cluster rows, head dim)
        dtype: cutlass.Constexpr,
        scale: Optional[Float32],
        n_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        seqlen_k: Int32,
        mJoint: Optional[cute.Tensor] = None,  # (b, j, h_loc, d): the rank's joint key rows, its own memory
    ):
        """FA4's epilogue_dKV for one tensor (TMEM -> registers, scaled, converted), its row stored into
        the window of the rank that owns it; with mJoint (J rows) the last J rows before seqlen_k are joint
        rows: row seqlen_k - J + j goes to mJoint[b, j] (as store_rows does on SM90)."""
        rep = math.gcd(16, tile[1] // num_wg)
        tiled_tmem_ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(rep)), Float32), tXtX
        )
        thr_tmem_ld = tiled_tmem_ld.get_slice(tidx)
        tXtX_t2r = self.split_wg(thr_tmem_ld.partition_S(tXtX), wg_idx, num_wg)
        tXcX = thr_mma.partition_C(cute.make_identity_tensor(tile))
        tXcX_t2r = self.split_wg(
            thr_tmem_ld.partition_D(cute.make_tensor(tXcX.iterator, tXcX.layout)), wg_idx, num_wg
        )
        tXrX_acc = cute.make_rmem_tensor(tXcX_t2r.shape, Float32)
        cute.copy(thr_tmem_ld, tXtX_t2r, tXrX_acc)
        cute.arch.fence_view_async_tmem_load()
        tXrX = cute.make_rmem_tensor(tXrX_acc.shape, dtype)
        for i in cutlass.range_constexpr(cute.size(tXrX_acc, mode=[1])):
            vec = tXrX_acc[(None, i, 0, 0)].load()
            if const_expr(scale is not None):
                vec = vec * scale
            tXrX[(None, i, 0, 0)].store(vec.to(dtype))
        gmem_store = cute.make_tiled_copy(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
            layout_tv=tiled_tmem_ld.layout_dst_tv_tiled,
            tiler_mn=tiled_tmem_ld.tiler_mn,
        )
        # the thread's row: FA4's gmem tile of this cluster block starts at row0; the partition's
        # coordinates are the cluster tile's (this CTA's half with 2-CTA MMA)
        row0 = (n_block // self.cta_group_size) * tile[0]
        row = row0 + tXcX_t2r[0][0]
        seq_end = seqlen_k
        if const_expr(mJoint is not None):
            seq_end = seqlen_k - mJoint.shape[1]
            if row >= seq_end and row < seqlen_k:
                gJ = cute.local_tile(
                    cute.domain_offset((row0 - seq_end, 0), mJoint[batch_idx, None, head_idx, None]), tile, (0, 0)
                )
                tXgJ = self.split_wg(thr_tmem_ld.partition_D(thr_mma.partition_C(gJ)), wg_idx, num_wg)
                cute.copy(gmem_store, tXrX, tXgJ)
        if row < seq_end:
            seqlen_loc = mX.shape[0]
            dst = row // seqlen_loc
            gX = cute.local_tile(
                cute.domain_offset((row0 - dst * seqlen_loc, 0), mX[None, None, head_idx, (batch_idx, dst)]),
                tile,
                (0, 0),
            )
            tXgX = self.split_wg(thr_tmem_ld.partition_D(thr_mma.partition_C(gX)), wg_idx, num_wg)
            cute.copy(gmem_store, tXrX, tXgX)


class FlashAttentionA2ABackwardPostprocessSm100(RoutedPostprocess):
    """FA4's SM100 postprocess (fp32 accumulator -> bf16/fp16, scaled) storing each row into the window
    of the rank that owns it (module docstring): dQ from dq_accum (use_2cta_instrs as the main kernel's),
    GQA's dK, dV from dk_accum, dv_accum. FA4's copies and layouts (_get_tiled_mma, _setup_attributes,
    the writer's accum_order); no varlen, no sink."""

    def __init__(self, dtype, head_dim: int, tile_m: int, use_2cta_instrs: bool, accum_order):
        super().__init__(dtype, head_dim, 100, tile_m, 128, 1, False, use_2cta_instrs=use_2cta_instrs,
                         accum_order=accum_order)
        if self.check_hdim_oob:
            raise ValueError(f"head_dim: the routed postprocess takes head dims {HEAD_DIMS}")

    def _kernel_copies(self) -> tuple:
        return self.gmem_tiled_copy_dQ, self.g2r_tiled_copy_dQaccum, self.r2s_tiled_copy_dQ

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,
        mOut: cute.Tensor,
        mSeqUsed: Optional[cute.Tensor],
        mJoint: Optional[cute.Tensor],  # (b, j, h_loc, d): the rank's joint rows (store_rows)
        scale: Float32,
        tiled_mma: cute.TiledMma,
        sAccum_layout: cute.Layout,
        sOut_layout: cute.ComposedLayout,
        gmem_tiled_copy: cute.TiledCopy,
        g2r_tiled_copy: Optional[cute.TiledCopy],
        r2s_tiled_copy: Optional[cute.TiledCopy],
        sched_params: SingleTileScheduler.Params,
    ):
        smem = cutlass.utils.SmemAllocator()
        sAccum = smem.allocate_tensor(Float32, sAccum_layout, byte_alignment=1024)
        # FA4's SM100 sdQ has a stage mode
        sOut = cute.make_tensor(
            cute.recast_ptr(sAccum.iterator, sOut_layout.inner, dtype=self.dtype), sOut_layout.outer
        )[None, None, 0]
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
        gAccum_mn = cute.make_tensor(gAccum.iterator, self._dQaccum_tile_layout())
        if const_expr(self.use_2cta_instrs):
            # FA4's 2-CTA step: the gmem tile in the 2-CTA producer's fragment order (thread tidx owns
            # row tidx, 16 B per load), scaled and converted, registers -> smem in TMEM-copy order
            thr_mma = tiled_mma.get_slice(tidx)
            tAtA = thr_mma.make_fragment_C(thr_mma.partition_shape_C((self.tile_m, self.tile_hdim)))
            tAtA = cute.make_tensor(tAtA.iterator, tAtA.layout)
            tiled_tmem_ld = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.dQ_reduce_ncol)),
                                    Float32),
                tAtA,
            )
            thr_tmem_ld = tiled_tmem_ld.get_slice(tidx)
            r2s_2cta = cute.make_tiled_copy(
                sm100_utils_basic.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32, tiled_tmem_ld),
                layout_tv=tiled_tmem_ld.layout_dst_tv_tiled,
                tiler_mn=tiled_tmem_ld.tiler_mn,
            )
            tOsO_r2s = thr_tmem_ld.partition_D(thr_mma.partition_C(sOut))
            tOrO_r2s = cute.make_rmem_tensor(tOsO_r2s.shape, self.dtype)
            g2r = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
                cute.make_layout((self.num_threads, 1)),
                cute.make_layout((1, 128 // Float32.width)),
            ).get_slice(tidx)
            tAgA = g2r.partition_S(gAccum_mn)
            tArA = cute.make_rmem_tensor(tAgA.shape, Float32)
            cute.copy(g2r, tAgA, tArA)
            tOrO_r2s.store((cute.make_tensor(tArA.iterator, cute.make_layout(tOrO_r2s.shape)).load() * scale)
                           .to(self.dtype))
            cute.copy(r2s_2cta, tOrO_r2s[None, None, None, 0], tOsO_r2s[None, None, None, 0])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=8, number_of_threads=self.num_threads)
        else:
            # FA4's SM100 step: the gmem tile in its storage order straight into registers, scaled
            # and converted, the same thread -> coordinates map into smem
            g2r = g2r_tiled_copy.get_slice(tidx)
            tAgA = g2r.partition_S(gAccum_mn)
            tArA = cute.make_fragment_like(tAgA, Float32)
            cute.copy(g2r_tiled_copy, tAgA, tArA)
            rOut = cute.make_fragment_like(tArA, self.dtype)
            rOut.store((tArA.load() * scale).to(self.dtype))
            tOsO = r2s_tiled_copy.get_slice(tidx).partition_D(sOut)
            cute.copy(r2s_tiled_copy, cute.make_tensor(rOut.iterator, cute.make_layout(tOsO.shape)), tOsO)
        cute.arch.barrier()  # the tile is in smem
        store_rows(gmem_tiled_copy, tidx, sOut, mOut, self.tile_m, self.tile_hdim, m_block * self.tile_m,
                   head_idx, batch_idx, seqlen, mJoint)
