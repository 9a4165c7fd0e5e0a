"""FlashAttention-4 SM90 forward with the Ulysses post-attention All-to-All in its epilogue.

Rank r of P holds q, k, v as [B, S, H_loc, D] (the full sequence S = P * S_loc, its own H_loc
heads). FA4 computes the output tile (b, m_block, h); this kernel's epilogue stores that tile
straight into the rank that owns its rows: row s goes to destination d = s // S_loc at
out_d[b, s % S_loc, r * H_loc + h, :], the Ulysses output layout [B, S_loc, H, D].

The destinations are one "rank window" tensor: P buffers at one uniform stride W in this
process's address space (peer memory mapped with CUDA VMM, or P local buffers when ranks are
emulated). The kernel sees it as (S_loc, D, H_loc, (B, P)) with strides (H*D, 1, D, (S_loc*H*D, W)),
so a single TMA descriptor addresses every rank and FA4's own TMA store of O is the remote store.
Two O paths (compile-time `o_store`):
- "tma": FA4's TMA store, one descriptor for all ranks. Needs S_loc % tile_m == 0 (every tile
  inside one rank). A tile that straddles a rank boundary would need a negative TMA row
  coordinate for its upper rank; on the H200 that faulted (illegal instruction, 2026-12-02).
- "st": FA4's per-thread 16-byte stores from smem (its non-TMA epilogue), issued once per rank
  the tile touches with each row predicated on 0 <= local row < S_loc: straddling tiles and
  S_loc < tile_m are written exactly once.
fa_a2a.fused picks "tma" when S_loc % tile_m == 0 and "st" otherwise.

The log-sum-exp rows (optional, fp32 windows (P, B, H, S_loc)) take the same route, one scalar
store per row, from the thread that owns the row.

Ordering: the storing warp waits only until the bulk store has *read* shared memory
(cp.async.bulk.wait_group.read), exactly as FA4 does before sO (aliased with sQ) is reused; it
never waits for the remote writes to land. They drain while the next tile's Q-loop runs. The
consumer learns that the data is visible from a barrier kernel launched after this one on the
same stream (system-scope release/acquire flags, cute_kernels/signal.py): kernel completion
orders every store of this grid before that barrier's release.

Measured (H200, 2026-12-02, bf16, D=128, H_loc=3, emulated P=8, CUDA-graph replays; details in
notes/measurements.md): `python -m fa_a2a.bench`, per-trial paired T_fused / T_FA4 = 0.999, 1.003,
0.996, 0.998, 0.998 at M = 8K, 16K, 32K, 48K, 64K (medians: 1.000, 1.001, 1.003, 0.998, 0.997);
`examples/fused_speed.py` (lower of two medians) gave 1.0006, 1.0012, 1.0015, 1.0079 at 8K-64K,
its two 64K repeats of the fused kernel 0.7% apart. The per-thread-store path costs 1.008-1.013.
Output bit-identical to FA4's output moved by the reference A2A (tests/gpu/test_fused_a2a.py).
"""

import inspect
from contextlib import contextmanager
from functools import lru_cache
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

import flash_attn.cute.flash_fwd_sm90 as _fa4_sm90
from flash_attn.cute import utils
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.tile_scheduler import StaticPersistentTileScheduler
from flash_attn.cute.utils import AuxData

from cute_kernels.remote_store import bulk_store_s2g
from quack import copy_utils, layout_utils


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


@lru_cache(maxsize=None)
def _persistent_scheduler(num_ctas: int):
    """FA4's static persistent scheduler with a grid of min(num_ctas, tiles) CTAs.

    FA4's own get_grid_shape asks the driver for the SM count while tracing; here the count is a
    compile-time fact (part of the compile key), so the kernel also compiles without a GPU.
    """

    class PersistentTileScheduler(StaticPersistentTileScheduler):
        @staticmethod
        def get_grid_shape(params, *, loc=None, ip=None):
            return (cutlass.min(Int32(num_ctas), params.total_blocks_cluster), Int32(1), Int32(1))

    return PersistentTileScheduler


@contextmanager
def _fa4_patched(persistent_ctas: Optional[int]):
    """While FA4's __call__ is traced: let its alignment helper accept nested strides and, for a
    persistent kernel, let its non-causal scheduler be the static persistent one."""
    saved = _fa4_sm90.assume_tensor_aligned, _fa4_sm90.SingleTileScheduler
    _fa4_sm90.assume_tensor_aligned = _assume_nested_aligned
    if persistent_ctas is not None:
        _fa4_sm90.SingleTileScheduler = _persistent_scheduler(persistent_ctas)
    try:
        yield
    finally:
        _fa4_sm90.assume_tensor_aligned, _fa4_sm90.SingleTileScheduler = saved


O_STORES = ("tma", "st", "paced")
_MMA_SIGNATURE = inspect.signature(FlashAttentionForwardSm90.mma)
_OVERLAP_SIGNATURE = inspect.signature(FlashAttentionForwardSm90.mma_one_n_block_intrawg_overlap)
_ONE_BLOCK_SIGNATURE = inspect.signature(FlashAttentionForwardSm90.mma_one_n_block)
TIMESTAMP_FIELDS = ("smid", "cta", "cta_start", "epilogue", "sO_free", "store_issued", "end")


class FlashAttentionA2AForwardSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward whose output epilogue routes each O tile to its Ulysses rank.

    Everything but the output path (and, for "paced", the tile scheduler) is FA4's (mainloop,
    softmax, pipelines). The tile configuration is FA4's own choice for the head dim (see
    fa_a2a.fused). o_store "paced" needs persistent_ctas (the SM count): see the module docstring.
    timestamps: compile in per-tile %globaltimer stamps (a debug variant; see TIMESTAMP_FIELDS).
    """

    def __init__(self, *args, o_store: str = "tma", persistent_ctas: Optional[int] = None,
                 timestamps: bool = False, **kwargs):
        if kwargs.get("pack_gqa", False):
            raise ValueError("pack_gqa: the rank-window epilogue routes whole rows; use pack_gqa=False")
        if o_store not in O_STORES:
            raise ValueError(f"o_store: one of {O_STORES}, got {o_store!r}")
        if (o_store == "paced") != (persistent_ctas is not None):
            raise ValueError(f"persistent_ctas: an int >= 1 exactly when o_store='paced', got {persistent_ctas!r}")
        if persistent_ctas is not None:
            if isinstance(persistent_ctas, bool) or not isinstance(persistent_ctas, int) or persistent_ctas < 1:
                raise ValueError(f"persistent_ctas: expected an int >= 1, got {persistent_ctas!r}")
            if kwargs.get("is_causal", False):
                raise ValueError("o_store: 'paced' runs persistent CTAs; FA4 schedules causal tiles "
                                 "longest-first, one per CTA")
        kwargs["pack_gqa"] = False
        self.o_store = o_store
        self.persistent_ctas = persistent_ctas
        self.timestamps = timestamps
        super().__init__(*args, **kwargs)

    # FA4 sets use_tma_O in __call__; here the O path is this kernel's own choice.
    @property
    def use_tma_O(self) -> bool:
        return self.o_store == "tma"

    @use_tma_O.setter
    def use_tma_O(self, _value) -> None:
        pass

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s, h_loc, d): full sequence, this rank's heads
        mK: cute.Tensor,  # (b, s, h_kv_loc, d)
        mV: cute.Tensor,  # (b, s, h_kv_loc, dv)
        mOWindows: cute.Tensor,  # (p, b, s_loc, h_loc, dv): this rank's head slice of every window
        mLSEWindows: Optional[cute.Tensor],  # (p, b, h_loc, s_loc) fp32, or None
        softmax_scale: Float32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # (b,) valid keys (padded sequences)
        mTimes: Optional[cute.Tensor] = None,  # (b, h_loc, m_blocks, 7) int64 when timestamps
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
        mLSE = None
        if const_expr(mLSEWindows is not None):
            l = mLSEWindows.layout
            # (p, b, h, s_loc) -> (b, h, (s_loc, p)): a flat row index s addresses rank s // s_loc
            mLSE = cute.make_tensor(
                mLSEWindows.iterator,
                cute.make_layout(
                    (l.shape[1], l.shape[2], (l.shape[3], l.shape[0])),
                    stride=(l.stride[1], l.stride[2], (l.stride[3], l.stride[0])),
                ),
            )
        # the stamps ride in FA4's aux-tensor slot (unused without score_mod / mask_mod)
        aux_data = AuxData([mTimes], None) if const_expr(self.timestamps) else AuxData()
        with _fa4_patched(self.persistent_ctas):
            super().__call__(
                mQ, mK, mV, mO, mLSE, softmax_scale, mSeqUsedK=mSeqUsedK, aux_data=aux_data,
                stream=stream,
            )

    def mma(self, *args, **kwargs):
        """FA4's consumer warp groups; "paced" adds its O buffer, pending-tile slot and final flush."""
        bound = _MMA_SIGNATURE.bind(self, *args, **kwargs)
        a = bound.arguments
        if const_expr(self.timestamps):
            self._times = a["aux_data"].tensors[0]
            self._t_cta_start = cute.arch.globaltimer()
        if const_expr(self.o_store == "paced"):
            smem = cutlass.memory.SmemAllocator()
            # O staging of its own (sQ is refilled with the next tile's Q while O drains); rows
            # padded by 16 bytes: unswizzled rows for the row copies, no bank conflicts for stmatrix
            row_elems = self.tile_hdimv + 128 // self.dtype.width
            a["sO"] = self._sO = smem.allocate_tensor(
                self.dtype, cute.make_layout((self.tile_m, self.tile_hdimv), stride=(row_elems, 1)),
                byte_alignment=128,
            )
            self._row_bytes = row_elems * self.dtype.width // 8
            # (m_block, head, batch, valid) of the tile whose O waits in sO, read by warp 4 only
            self._pending = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
            self._mO = a["mO"]
            self._clear_pending(self._pending)
        super().mma(*bound.args[1:], **bound.kwargs)
        if const_expr(self.o_store == "paced"):
            # the CTA's last tile: its rows leave at once; smem must be read before the CTA exits
            self._flush_pending(self._pending, a["sO"], Int32(0))

    @cute.jit
    def _clear_pending(self, pending: cute.Tensor):
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
            pending[3] = Int32(0)

    @cute.jit
    def _store_rows(self, pending: cute.Tensor, sO: cute.Tensor, r_lo: Int32, r_hi: Int32):
        """Warp 4 copies rows [r_lo, r_hi) of the pending tile from sO to their ranks, one bulk
        copy (cp.async.bulk, row_bytes of O) per row, lane l taking rows r_lo + l, r_lo + l + 32, ...;
        rows past the sequence are skipped. Each lane commits its copies as one bulk group."""
        mO = self._mO  # (s_loc, dv, h_loc, (b, p)) gmem
        seqlen_loc = mO.shape[0]
        num_ranks = mO.shape[3][1]
        st = mO.layout.stride
        m_block, head, batch = pending[0], pending[1], pending[2]
        o_base = mO.iterator.toint()
        s_base = sO.iterator.toint()
        nbytes = Int32(self.tile_hdimv * self.dtype.width // 8)
        for r in cutlass.range(r_lo + cute.arch.lane_idx(), r_hi, cute.arch.WARP_SIZE, unroll=1):
            row = m_block * self.tile_m + r
            if row < seqlen_loc * num_ranks:
                dst = row // seqlen_loc
                off = (Int64(row - dst * seqlen_loc) * Int64(st[0]) + Int64(head) * Int64(st[2])
                       + Int64(batch) * Int64(st[3][0]) + Int64(dst) * Int64(st[3][1]))
                bulk_store_s2g(o_base + off * (self.dtype.width // 8), s_base + r * self._row_bytes, nbytes)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _flush_pending(self, pending: cute.Tensor, sO: cute.Tensor, r_lo: Int32):
        """Warp 4: copy the pending tile's rows from r_lo on, then wait until every copy has read sO."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
            if pending[3] != 0:
                self._store_rows(pending, sO, r_lo, Int32(self.tile_m))
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _pace_rows(self, pending: cute.Tensor, sO: cute.Tensor, n_block: Int32, seqlen):
        """After KV block n_block of the current tile (non-causal: blocks n_iter-1 down to 0, the
        first one handled before the loop), warp 4 copies the pending tile's rows of iteration
        i = n_iter-1-n_block: rows [ceil((i-1)*tile_m/(n_iter-1)), ceil(i*tile_m/(n_iter-1))),
        so that its O leaves evenly over iterations 1 .. n_iter-1."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
            if pending[3] != 0:
                span = cute.ceil_div(seqlen.seqlen_k, self.tile_n) - 1
                i = span - n_block
                if i >= 1:
                    r_lo = ((i - 1) * self.tile_m + span - 1) // span
                    r_hi = (i * self.tile_m + span - 1) // span
                    self._store_rows(pending, sO, r_lo, r_hi)

    def mma_one_n_block_intrawg_overlap(self, *args, **kwargs):
        bound = _OVERLAP_SIGNATURE.bind(self, *args, **kwargs)
        out = super().mma_one_n_block_intrawg_overlap(*bound.args[1:], **bound.kwargs)
        if const_expr(self.o_store == "paced"):
            a = bound.arguments
            self._pace_rows(self._pending, self._sO, a["n_block"], a["seqlen"])
        return out

    def mma_one_n_block(self, *args, **kwargs):
        bound = _ONE_BLOCK_SIGNATURE.bind(self, *args, **kwargs)
        out = super().mma_one_n_block(*bound.args[1:], **bound.kwargs)
        if const_expr(self.o_store == "paced"):
            a = bound.arguments
            self._pace_rows(self._pending, self._sO, a["n_block"], a["seqlen"])
        return out

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,  # (s_loc, dv, h_loc, (b, p)): TMA coordinates or gmem
        mLSE: Optional[cute.Tensor],  # ((s_loc, p), h_loc, b) fp32, or None
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
        t_epilogue = cute.arch.globaltimer() if const_expr(self.timestamps) else None
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # registers -> smem, as FA4 does
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.o_store == "paced"):
            # the previous tile's rows not yet sent (all of them when this tile had a single KV
            # block) leave now, and warp 4 waits until every row copy has read sO
            r_sent = Int32(self.tile_m)
            if cute.ceil_div(seqlen.seqlen_k, self.tile_n) < 2:
                r_sent = Int32(0)
            self._flush_pending(self._pending, sO, r_sent)
        # all MMA threads are done reading V (sO aliases sQ) or, "paced", the previous tile's O
        # has left its own sO
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads
        )
        t_free = cute.arch.globaltimer() if const_expr(self.timestamps) else None
        smem_copy_atom_O = utils.get_smem_store_atom(
            self.arch.major * 10 + self.arch.minor, self.dtype
        )
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        seqlen_loc = mO.shape[0]
        num_ranks = mO.shape[3][1]
        row0 = m_block * self.tile_m
        if const_expr(mLSE is not None):
            # one scalar per row, from the thread that holds column 0 of that row; the flat row
            # index into the (s_loc, p) mode lands in rank row // s_loc, row row % s_loc
            mLSE_cur = mLSE[None, head_idx, batch_idx]
            cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
            taccOcO = layout_utils.reshape_acc_to_mn(tiled_mma.get_slice(tidx).partition_C(cO))
            if taccOcO[0, 0][1] == 0:
                for m in cutlass.range(cute.size(taccOcO, mode=[0]), unroll_full=True):
                    row = row0 + taccOcO[m, 0][0]
                    if row < seqlen.seqlen_q:
                        mLSE_cur[row] = lse[m]
        dst_first = row0 // seqlen_loc
        dst_last = (row0 + self.tile_m - 1) // seqlen_loc
        if dst_last > num_ranks - 1:
            dst_last = num_ranks - 1
        t_issued = t_free
        if const_expr(self.o_store == "tma"):
            # smem writes visible to the TMA unit, then one warp issues the store
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrierFwd.Epilogue),
                number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
            )
            if warp_idx == 4:
                cute.arch.barrier(
                    barrier_id=int(NamedBarrierFwd.Epilogue),
                    number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
                )
                # S_loc % tile_m == 0: the whole tile belongs to rank dst_first
                mO_dst = mO[None, None, head_idx, (batch_idx, dst_first)]
                gO = cute.local_tile(
                    cute.domain_offset((row0 - dst_first * seqlen_loc, 0), mO_dst),
                    (self.tile_m, self.tile_hdimv),
                    (0, 0),
                )
                store_O, _, _ = copy_utils.tma_get_copy_fn(
                    tma_atom_O, 0, cute.make_layout(1), sO, gO, single_stage=True
                )
                store_O()
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.timestamps):
                    t_issued = cute.arch.globaltimer()
                # wait until smem has been read, not until the (remote) writes are visible
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        elif const_expr(self.o_store == "paced"):
            # sO complete and visible to the bulk-copy proxy; warp 4 marks it pending: its rows
            # leave during the next tile's KV loop (_pace_rows) or at the CTA's end
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrierFwd.Epilogue),
                number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
            )
            pending = self._pending
            if warp_idx == 4:
                cute.arch.barrier(
                    barrier_id=int(NamedBarrierFwd.Epilogue),
                    number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
                )
                pending[0] = m_block
                pending[1] = head_idx
                pending[2] = batch_idx
                pending[3] = Int32(1)
                if const_expr(self.timestamps):
                    t_issued = cute.arch.globaltimer()
        else:
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.Epilogue),
                number_of_threads=self.num_epilogue_threads,
            )
            gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
            tOsO = gmem_thr_copy_O.partition_S(sO)
            tOrO = cute.make_fragment_like(tOsO, self.dtype)
            cute.autovec_copy(tOsO, tOrO)
            tOcO = gmem_thr_copy_O.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
            for dst in cutlass.range(dst_first, dst_last + 1, unroll=1):
                row_off = row0 - dst * seqlen_loc  # local row of tile row 0 (may be < 0)
                mO_dst = mO[None, None, head_idx, (batch_idx, dst)]
                gO = cute.local_tile(
                    cute.domain_offset((row_off, 0), mO_dst), (self.tile_m, self.tile_hdimv), (0, 0)
                )
                tOgO = gmem_thr_copy_O.partition_D(gO)
                for rest_m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
                    local_row = row_off + tOcO[0, rest_m, 0][0]
                    if local_row >= 0 and local_row < seqlen_loc:
                        cute.copy(
                            gmem_tiled_copy_O, tOrO[None, rest_m, None], tOgO[None, rest_m, None]
                        )
            if const_expr(self.timestamps):
                t_issued = cute.arch.globaltimer()
        if const_expr(self.timestamps):
            t_end = cute.arch.globaltimer()
            mTimes = self._times[batch_idx, head_idx, m_block, None]
            bx, by, bz = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            stamps = (Int64(cute.arch.smid()), Int64(bx) + Int64(gx) * (Int64(by) + Int64(gy) * Int64(bz)),
                      self._t_cta_start,
                      t_epilogue, t_free, t_issued, t_end)
            if tidx == 0:
                for i in cutlass.range_constexpr(len(TIMESTAMP_FIELDS)):
                    mTimes[i] = stamps[i]
