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
cute_kernels.fa4 picks "tma" when S_loc % tile_m == 0 and "st" otherwise.

The log-sum-exp rows (optional, fp32 windows (P, B, H, S_loc)) take the same route, one scalar
store per row, from the thread that owns the row.

The forward that keeps what its backward reads (compile-time `keep_o`; fa_a2a.engine.backward): every
O tile is also stored into the rank's own O [B, S, H_loc, D] in FA4's layout, per thread from the
staged tile as FA4's non-TMA epilogue stores it, beside the routed store; its LSE rows go to the
rank's own [B, H_loc, S] through the LSE path above (cute_kernels.fa4 views it as P windows). Both
are FA4's O and LSE bit for bit, so FA4's backward reads them as it reads its own. On the TMA path
every epilogue thread then waits at the epilogue barrier until the whole tile is staged (without
keep_o only the storing warp does). On an H100 (2026-12-06, tests/gpu/test_fused_a2a.py -k keeping):
O and LSE equal FA4's bit for bit (both O paths, causal, S_loc < tile_m, GQA, padded keys); it costs
1.0212 / 1.0177 / 1.0136 x the plain fused kernel at M 8192 / 16384 / 32768 (emulated P 8, H_loc 3, D 128,
examples/fused_speed.py, paired in CUDA graphs).

Rank-rotated tile order (compile-time `rotate`, default off; __call__ then takes the source rank).
FA4's non-causal SM90 scheduler (SingleTileScheduler) runs one tile per CTA, m_block = blockIdx.x,
and CTAs start in blockIdx order (x fastest), so every source rank's first wave stores into the
same destination ranks at once: at M = 64K, H_loc = 3, tile_m = 128 on 132 SMs the first wave is
m-blocks 0-131 of head 0, rows 0-16.9K, i.e. ranks 0-2 of 8 (incast from all P sources). With
`rotate`, CTA blockIdx.x = i computes m-block (i + k) mod m_blocks of its head, k =
floor(((r + 1) mod P) * S_loc / tile_m) (rank_rotation_shift): rank r starts on rank r + 1's rows,
so the P sources' first waves go to P different destinations. When tile_m does not divide S_loc,
k is the tile that holds rank r + 1's first row (it may begin in rank r's rows). The tiles are
the same, only their order changes, so the output is bit-identical; the cost is an add and a
select on the block index per tile (RankRotatedSingleTileScheduler; the SM100 kernel rotates its
schedulers the same way). Refused (ValueError) for causal: FA4 orders causal tiles longest-first
(SingleTileLPTScheduler) for load balance, and a rotation would break that order.
Measured on one GPU (H200, 2026-12-03, bf16, D=128, H_loc=3, emulated P=8, rank 0,
`examples/fused_speed.py`, 15 trials): paired T_rotated / T_unrotated = 1.0026, 0.9986, 1.0047,
0.9956 at M = 8K, 16K, 32K, 64K, against 0.9997, 1.0001, 1.0092, 1.0000 for a second graph of
the unrotated kernel (per-trial spread about +-3% in both): no cost measurable. Whether it helps
needs P GPUs over NVLink (not measured); hence off by default.

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

A slow destination does not get hidden (H200, 2026-12-03, bf16, D=128, H_loc=3, emulated P=8,
windows in pinned host memory reached over PCIe at 52 GB/s; `examples/host_window_hiding.py`,
CUDA-graph medians, fused == serial bit for bit). T_FA4 / T_A2A-only / T_serial / T_fused, us:
M=8K 184.5 / 121.8 / 308.4 / 296.0 (hiding H = 10%), 16K 562.4 / 247.7 / 801.1 / 776.3 (10%),
32K 2248.5 / 491.1 / 2727.0 / 2643.5 (17%); the wave bound (SMs never wait, each wave's O drains
at the A2A-only rate after the previous one's) is 222.5 / 639.8 / 2317.6 us (H = 69 / 68 / 86%).
Per-tile %globaltimer stamps (the `timestamps` debug build) say why, at M=8K: first-wave CTAs
wait 0.7-54 us (median 29) for the bulk store's smem read; the next CTA on an SM starts 0.6 us
after the previous one ends; but the second wave's mainloops take 138-164 us (median 162) against
89 us with windows in HBM. While the first wave's 4.3 MB drain (~83 us), those tiles compute at
~11% speed. The stall is global, not the CTA's: a one-wave attention kernel on 66 SMs that stores
only to HBM has mainloops of 88.2 us alone, 88.4 us beside the post-A2A kernel writing to HBM
from the other SMs, and 197.9 us (193.8-201.0) beside it writing to host memory (contention probe
of the same script). Pending PCIe writes stall every SM's loads, so no ordering inside the CTA
can hide them; only keeping the issue rate below the link's would. Two levers that take the
store off the CTA's path were measured and dropped:
- persistent CTAs (FA4's static persistent scheduler, grid = SM count), O in its own smem buffer,
  the store's read waited for only before the next tile's O is staged (commit 536c050): the CTA
  moves on at once (0.1 us) but its next mainloop takes 161 us (88 in HBM); T = 294.9 / 774.2 /
  2730.8 us on host, and T / T_FA4 = 1.006 / 1.013 / 1.018 at 8K / 16K / 32K in HBM;
- the same with O's rows sent by bulk copies evenly over the next tile's KV loop, at about the
  link's per-SM share (commit 1dfa76e): next mainloop 163 us on host, and the per-iteration issue
  in the MMA warp slows the mainloop itself (115 vs 89 us in HBM): T = 304.9 / 848.8 / 2806.5 us
  on host, T / T_FA4 = 1.19 - 1.22 in HBM at 8K-64K.
The per-thread "st" path (no bulk read to wait for) is no better than "tma": 297.5 vs 296.2 us
at 8K on host. With windows in HBM the default path is unchanged: T / T_FA4 = 0.995 at 8K and
0.985 at 64K in the same run (FA4 9879 us; 1.017 in an earlier one, FA4 9506 us: clock noise).
"""

import contextlib
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, fields
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
from flash_attn.cute.tile_scheduler import (
    SingleTileScheduler,
    StaticPersistentTileScheduler,
    WorkTileInfo,
)
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils


def rank_window_o(mOWindows: cute.Tensor) -> cute.Tensor:
    """The P output windows (p, b, s_loc, h, dv) as FA4's O (b, s, h, dv) with a nested batch mode:
    ((b, p), s_loc, h, dv), so that O row s_loc of batch (b, p) is row p * S_loc + s_loc of FA4's
    sequence (shared by the SM90 and SM100 kernels)."""
    w = mOWindows.layout
    return cute.make_tensor(
        mOWindows.iterator,
        cute.make_layout(
            ((w.shape[1], w.shape[0]), w.shape[2], w.shape[3], w.shape[4]),
            stride=((w.stride[1], w.stride[0]), w.stride[2], w.stride[3], w.stride[4]),
        ),
    )


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


def rank_rotation_shift(rank, num_ranks, seqlen_loc, block_rows: int):
    """First m-block of source rank `rank` in the rank-rotated order: the block that holds the
    first row of rank (rank + 1) % P, floor((rank + 1) % P * S_loc / block_rows). When blocks
    straddle rank boundaries (block_rows does not divide S_loc) that block may begin in the
    previous rank's rows; any shift in [0, m_blocks) is a permutation of the same tiles, so the
    output does not depend on it (shared by the SM90 and SM100 kernels)."""
    return ((rank + 1) % num_ranks) * seqlen_loc // block_rows


def _rotate(m_block, block_shift, num_block):
    # both operands < num_block: one conditional subtract, no division
    m_block = m_block + block_shift
    return cutlass.select_(m_block >= num_block, m_block - num_block, m_block)


def _params_with(base_params, params_cls, **extra):
    return params_cls(**{f.name: getattr(base_params, f.name) for f in fields(base_params)}, **extra)


class _RankRotatedWork:
    """Mixin before one of FA4's static schedulers: its work tile's m-block is rotated by
    params.block_shift modulo the params field named by _num_block_field (the m-blocks it walks)."""

    _block_shift = None  # bound by rank_rotated_scheduler (a host value of the jit trace)
    _num_block_field = "num_block"

    def get_current_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        work = super().get_current_work(loc=loc, ip=ip)
        m_block, head_idx, batch_idx, split_idx = work.tile_idx
        m_block = _rotate(m_block, self.params.block_shift, getattr(self.params, self._num_block_field))
        return WorkTileInfo((m_block, head_idx, batch_idx, split_idx), work.is_valid_tile)


class RankRotatedSingleTileScheduler(_RankRotatedWork, SingleTileScheduler):
    """FA4's SingleTileScheduler (one tile per CTA) whose CTA blockIdx.x = i computes m-block
    (i + block_shift) mod num_block of its (head, batch): every head's order starts at the shift.
    Use rank_rotated_scheduler() to bind the shift."""

    @dataclass
    class Params(SingleTileScheduler.Params):
        block_shift: Optional[Int32] = None

    @classmethod
    def to_underlying_arguments(cls, args, **kwargs):
        base = SingleTileScheduler.to_underlying_arguments(args, **kwargs)
        return _params_with(base, cls.Params, block_shift=cls._block_shift)

    @classmethod
    def create(cls, params, ctx=None, *, loc=None, ip=None):
        return cls(params, SingleTileScheduler.create(params, ctx, loc=loc, ip=ip)._blk_coord, loc=loc, ip=ip)

    def __new_from_mlir_values__(self, values):
        base = super().__new_from_mlir_values__(values)
        scheduler = type(self)(base.params, base._blk_coord, loc=self._loc)
        scheduler._is_first_block = self._is_first_block
        return scheduler


class RankRotatedStaticPersistentTileScheduler(_RankRotatedWork, StaticPersistentTileScheduler):
    """FA4's StaticPersistentTileScheduler whose linear tile t = (hb, i) (i the m-block of head and
    batch hb, in clusters) computes m-block (i + block_shift) mod num_block_cluster: the grid's
    walk over tiles is FA4's, every head's m-blocks start at the shift.
    Use rank_rotated_scheduler() to bind the shift."""

    _num_block_field = "num_block_cluster"

    @dataclass
    class Params(StaticPersistentTileScheduler.Params):
        num_block_cluster: Optional[Int32] = None
        block_shift: Optional[Int32] = None

    @classmethod
    def to_underlying_arguments(cls, args, **kwargs):
        base = StaticPersistentTileScheduler.to_underlying_arguments(args, **kwargs)
        num_block_cluster = cute.ceil_div(args.num_block, cute.size(args.cluster_shape_mn))
        return _params_with(base, cls.Params, num_block_cluster=num_block_cluster,
                            block_shift=cls._block_shift)

    @classmethod
    def create(cls, params, ctx=None, *, loc=None, ip=None):
        base = StaticPersistentTileScheduler.create(params, ctx, loc=loc, ip=ip)
        return cls(params, base._tile_idx, loc=loc, ip=ip)

    def __new_from_mlir_values__(self, values):
        base = super().__new_from_mlir_values__(values)
        return type(self)(base.params, base._tile_idx, loc=self._loc)


_RANK_ROTATED = {
    SingleTileScheduler: RankRotatedSingleTileScheduler,
    StaticPersistentTileScheduler: RankRotatedStaticPersistentTileScheduler,
}


def check_rotatable(scheduler_cls) -> None:
    """ValueError unless `scheduler_cls` is one of FA4's two static schedulers that rotate (not
    LPT, which orders causal tiles longest-first, nor CLC or the varlen schedulers)."""
    if scheduler_cls not in _RANK_ROTATED:
        raise ValueError(f"rotate: needs FA4's SingleTileScheduler or StaticPersistentTileScheduler, "
                         f"this configuration uses {scheduler_cls.__name__}")


def rank_rotated_scheduler(scheduler_cls, block_shift):
    """FA4's static scheduler class `scheduler_cls` with each head's m-block order rotated by
    block_shift (a value of the __call__ trace, carried into the kernel in the scheduler's Params)."""
    check_rotatable(scheduler_cls)
    rotated = _RANK_ROTATED[scheduler_cls]
    return type(rotated.__name__, (rotated,), {"_block_shift": block_shift})


@contextmanager
def _rank_rotated_sm90_scheduler(block_shift):
    """While FA4's SM90 __call__ is traced, its non-causal scheduler is the rank-rotated one."""
    saved = _fa4_sm90.SingleTileScheduler
    _fa4_sm90.SingleTileScheduler = rank_rotated_scheduler(SingleTileScheduler, block_shift)
    try:
        yield
    finally:
        _fa4_sm90.SingleTileScheduler = saved


O_STORES = ("tma", "st")


def check_rank_window_options(o_store: str, rotate: bool, kwargs: dict) -> None:
    """What both rank-window subclasses (SM90, SM100) refuse of FA4's constructor arguments `kwargs`,
    then pack_gqa set off in them (the epilogue routes whole rows)."""
    if kwargs.get("pack_gqa", False):
        raise ValueError("pack_gqa: the rank-window epilogue routes whole rows; use pack_gqa=False")
    if o_store not in O_STORES:
        raise ValueError(f"o_store: one of {O_STORES}, got {o_store!r}")
    if rotate and (kwargs.get("is_causal", False) or kwargs.get("is_local", False)):
        raise ValueError("rotate: the rank-rotated order is for non-causal attention (FA4 orders causal "
                         f"tiles longest-first), got is_causal={kwargs.get('is_causal', False)}, "
                         f"is_local={kwargs.get('is_local', False)}")
    kwargs["pack_gqa"] = False
_MMA_SIGNATURE = inspect.signature(FlashAttentionForwardSm90.mma)
TIMESTAMP_FIELDS = ("smid", "cta", "cta_start", "epilogue", "sO_free", "store_issued", "end")


class FlashAttentionA2AForwardSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward whose output epilogue routes each O tile to its Ulysses rank.

    Everything but the output path is FA4's (mainloop, softmax, scheduler, pipelines). The
    tile configuration is FA4's own choice for the head dim (see cute_kernels.fa4).
    timestamps: compile in per-tile %globaltimer stamps (a debug variant; see TIMESTAMP_FIELDS).
    rotate: the rank-rotated tile order (see the module docstring); __call__ then takes `rank`.
    keep_o: every O tile also stored into this rank's own O in FA4's layout (__call__'s mOLocal), per
    thread from the staged tile, beside its routed store (see the module docstring).
    """

    def __init__(self, *args, o_store: str = "tma", timestamps: bool = False, rotate: bool = False,
                 keep_o: bool = False, **kwargs):
        check_rank_window_options(o_store, rotate, kwargs)
        self.o_store = o_store
        self.timestamps = timestamps
        self.rotate = rotate
        self.keep_o = keep_o
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
        rank: Optional[Int32] = None,  # this source rank, when rotate
        mPace: Optional[cute.Tensor] = None,  # int64 [3] store pacer (the paced subclass), or None
        mOLocal: Optional[cute.Tensor] = None,  # (b, s, h_loc, dv): this rank's own O, when keep_o
        stream: cuda.CUstream = None,
    ):
        mO = rank_window_o(mOWindows)
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
        # the stamps, the local O and the pacer ride in FA4's aux-tensor slot (unused without score_mod /
        # mask_mod), in this order (mma() finds them there)
        aux_tensors = []
        if const_expr(self.timestamps):
            aux_tensors.append(mTimes)
        if const_expr(self.keep_o):
            if const_expr(mOLocal is None):
                raise ValueError("mOLocal: the keep_o build stores every O tile there too")
            aux_tensors.append(assume_tensor_aligned(mOLocal))
        if const_expr(mPace is not None):
            aux_tensors.append(mPace)
        aux_data = AuxData(aux_tensors, None) if const_expr(len(aux_tensors) > 0) else AuxData()
        rotation = contextlib.nullcontext()
        if const_expr(self.rotate):
            if const_expr(rank is None):
                raise ValueError("rank: the rank-rotated build needs the source rank")
            block_shift = rank_rotation_shift(rank, mOWindows.shape[0], mOWindows.shape[2], self.tile_m)
            rotation = _rank_rotated_sm90_scheduler(block_shift)
        with _nested_stride_alignment(), rotation:
            # FA4's __call__ named: the DSL re-executes this body, where super() would follow type(self)
            FlashAttentionForwardSm90.__call__(
                self, mQ, mK, mV, mO, mLSE, softmax_scale, mSeqUsedK=mSeqUsedK, aux_data=aux_data,
                stream=stream,
            )

    def mma(self, *args, **kwargs):
        """FA4's consumer warp groups; the stamped build notes the CTA's start for its epilogues, the
        keep_o build finds its local O."""
        if const_expr(self.timestamps or self.keep_o):
            aux = _MMA_SIGNATURE.bind(self, *args, **kwargs).arguments["aux_data"].tensors
            if const_expr(self.keep_o):
                self._o_local = aux[1 if self.timestamps else 0]
            if const_expr(self.timestamps):
                self._times = aux[0]
                self._t_cta_start = cute.arch.globaltimer()
        super().mma(*args, **kwargs)

    @cute.jit
    def _store_o_local(self, tOrO: cute.Tensor, gmem_tiled_copy_O: cute.TiledCopy, tidx: Int32, m_block: Int32,
                       head_idx: Int32, batch_idx: Int32, seqlen):
        """keep_o: this thread's part of the staged O tile (tOrO, FA4's per-thread partition of sO) into the
        rank's own O at the tile's rows (rows past seqlen_q skipped), as FA4's per-thread O store does."""
        mO_cur = self._o_local[batch_idx, None, head_idx, None]  # (s, dv)
        gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOgO = gmem_thr_copy_O.partition_D(gO)
        tOcO = gmem_thr_copy_O.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        for rest_m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if m_block * self.tile_m + tOcO[0, rest_m, 0][0] < seqlen.seqlen_q:
                cute.copy(gmem_tiled_copy_O, tOrO[None, rest_m, None], tOgO[None, rest_m, None])

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
        # all MMA threads are done reading V (sO aliases sQ)
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
            if const_expr(self.keep_o):  # every thread reads sO below: all of it written first
                cute.arch.barrier(
                    barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads
                )
            else:
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrierFwd.Epilogue),
                    number_of_threads=self.num_epilogue_threads + cute.arch.WARP_SIZE,
                )
            if warp_idx == 4:
                if const_expr(not self.keep_o):
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
            if const_expr(self.keep_o):
                gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
                tOsO = gmem_thr_copy_O.partition_S(sO)
                tOrO = cute.make_fragment_like(tOsO, self.dtype)
                cute.autovec_copy(tOsO, tOrO)
                self._store_o_local(tOrO, gmem_tiled_copy_O, tidx, m_block, head_idx, batch_idx, seqlen)
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
            if const_expr(self.keep_o):
                self._store_o_local(tOrO, gmem_tiled_copy_O, tidx, m_block, head_idx, batch_idx, seqlen)
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
