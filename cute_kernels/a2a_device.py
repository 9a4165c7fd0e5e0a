"""The kernels of the device-initiated Ulysses all-to-all copies (the host side, their compiles and
launchers: cute_kernels.a2a): every thread moves 16-byte vectors straight into
the destination rank's window (a peer store when the window is remote).

Row conventions are those of ulysses/layout.py (sequence layout [B, S_loc, H, D] on each rank,
head layout [B, N, H_loc, D] with N = S_pad + J):

PreA2A (seq -> head), q, k and v in ONE launch. Rank r writes, for every destination d,
  dq[d, b, r*S_loc + s, j]  = q[b, s, q_map[d*H_loc + j]]          (q_map < 0: zero head)
  dk[d, b, kv_row(s), j] = k[b, s, kv_map[d*H_kv_loc + j]]  (same for v)
with kv_row(s) = key_base + s for the rank's n_r valid rows (s < n_r) and pad_base + s - n_r for
its padding rows (ulysses.layout.UlyssesLayout.key_rows: valid keys compacted in [0, S), padded
keys after the J joint rows; with the default ceil split kv_row(s) = g if g < S else g + J for
g = r*S_loc + s), and with joint tokens
(replicated, never sent) into its own window only:
  dq[r, b, S_pad + t, j] = jq[b, t, q_map[r*H_loc + j]],  dk[r, b, S + t, j] = jk[b, t, kv_map[...]].
Padded sequence rows (s >= seq_len) are copied like any row (whatever the caller holds there):
they are masked as keys (seqused_k) and dropped as queries. kv_map repeats a KV head for every
rank that needs it (GQA replication); q_map entries < 0 are zero-filled padding heads.

PostA2A (head -> seq), rank r's o [B, P*S_loc, H_loc, D]:
  scatter:   out[s // S_loc, b, s % S_loc, r*H_loc + h] = o[b, s, h]
  broadcast: out[d, b, t, r*H_loc + h] = o[b, t, h] for every d (joint rows: all-gather of heads)

Every window tensor is [P, ...] with a dim-0 stride (the window stride) that is a multiple of
16 bytes; each window itself is contiguous. The kernels only issue stores: cross-rank
visibility comes from the barrier kernel (cute_kernels/signal.py) that follows them.

One thread per 16-byte vector; its coordinate comes from its flat index by cute.idx2crd (one
helper, dynamic shapes) with the destination's (vector, head) pair as the fastest modes, so a warp
writes 512 contiguous bytes of one destination row group.

Measured (H200, 2026-12-02, `python -m fa_a2a.bench`, emulated P = 8, notes/measurements.md):
PostA2A alone moves one rank's O (bf16, H_loc = 3, D = 128) in 5.5 µs at M = 8192 (6.3 MB) and
34.5 µs at M = 65536 (50 MB), ~2.3 TB/s of writes into local windows; peer (NVLink) bandwidth
needs several GPUs and has not been measured.
"""


from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def vec_elems(dtype) -> int:
    return 128 // dtype.width


class _RowCopy:
    """Shared helpers: one 16-byte vector from src to dst (or zeros)."""

    def __init__(self, dtype, head_dim: int, num_threads: int = 256):
        self.dtype = dtype
        self.head_dim = head_dim
        self.vec = vec_elems(dtype)
        if head_dim % self.vec:
            raise ValueError(f"head_dim: must be a multiple of {self.vec} (16 bytes), got {head_dim}")
        self.nvec = head_dim // self.vec
        self.num_threads = num_threads

    def _thread_coord(self, blk, tidx, shape):
        """(in range, coordinate) of this thread's flat index in `shape`, first mode fastest."""
        i = blk * self.num_threads + tidx
        return i < cute.size(shape), cute.idx2crd(i, shape)

    @cute.jit
    def _copy_vec(self, mSrc: cute.Tensor, src_crd, mDst: cute.Tensor, dst_crd, valid_src: cutlass.Boolean):
        """One 16-byte vector: mSrc[src_crd] (4-D, the last coordinate counts vectors of the head
        dim) -> mDst[dst_crd] (5-D, likewise); zeros when not valid_src."""
        gSrc = cute.zipped_divide(mSrc, (1, 1, 1, self.vec))
        gDst = cute.zipped_divide(mDst, (1, 1, 1, 1, self.vec))
        self._move(gSrc[(0, 0, 0, None), src_crd], gDst[(0, 0, 0, 0, None), dst_crd], valid_src)

    @cute.jit
    def _move(self, src_vec: cute.Tensor, dst_vec: cute.Tensor, valid_src: cutlass.Boolean):
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor((self.vec,), self.dtype)
        if valid_src:
            cute.copy(atom, src_vec, frag)
        else:
            frag.fill(0.0)
        cute.copy(atom, frag, dst_vec)


class PreA2A(_RowCopy):
    """Sequence layout -> head layout for q, k, v (and joint q, k, v) in one launch."""

    def __init__(self, dtype, head_dim: int, world_size: int, has_joint: bool, num_threads: int = 256):
        super().__init__(dtype, head_dim, num_threads)
        self.world_size = world_size
        self.has_joint = has_joint

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, S_loc, H, D)
        mK: cute.Tensor,  # (B, S_loc, H_kv, D)
        mV: cute.Tensor,
        mDQ: cute.Tensor,  # (P, B, N, H_loc, D)
        mDK: cute.Tensor,  # (P, B, N, H_kv_loc, D)
        mDV: cute.Tensor,
        mQMap: cute.Tensor,  # (P * H_loc,) int32
        mKVMap: cute.Tensor,  # (P * H_kv_loc,) int32
        mJQ: cute.Tensor | None,  # (B, J, H, D)
        mJK: cute.Tensor | None,  # (B, J, H_kv, D)
        mJV: cute.Tensor | None,
        rank: Int32,
        seq_len: Int32,
        valid_rows: Int32,
        key_base: Int32,
        pad_base: Int32,
        stream,
    ):
        B, S_loc = mQ.shape[0], mQ.shape[1]
        H_loc, H_kv_loc = mDQ.shape[3], mDK.shape[3]
        P = const_expr(self.world_size)
        per_row = B * S_loc * P * self.nvec
        blocks_q = cute.ceil_div(per_row * H_loc, self.num_threads)
        blocks_kv = cute.ceil_div(per_row * H_kv_loc, self.num_threads)
        blocks_jq = Int32(0)
        blocks_jkv = Int32(0)
        if const_expr(self.has_joint):
            J = mJQ.shape[1]
            blocks_jq = cute.ceil_div(B * J * H_loc * self.nvec, self.num_threads)
            blocks_jkv = cute.ceil_div(B * J * H_kv_loc * self.nvec, self.num_threads)
        grid = blocks_q + 2 * blocks_kv + blocks_jq + 2 * blocks_jkv
        self.kernel(
            mQ, mK, mV, mDQ, mDK, mDV, mQMap, mKVMap, mJQ, mJK, mJV, rank, seq_len,
            valid_rows, key_base, pad_base, blocks_q, blocks_kv, blocks_jq, blocks_jkv,
        ).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDV: cute.Tensor,
        mQMap: cute.Tensor,
        mKVMap: cute.Tensor,
        mJQ: cute.Tensor | None,
        mJK: cute.Tensor | None,
        mJV: cute.Tensor | None,
        rank: Int32,
        seq_len: Int32,
        valid_rows: Int32,
        key_base: Int32,
        pad_base: Int32,
        blocks_q: Int32,
        blocks_kv: Int32,
        blocks_jq: Int32,
        blocks_jkv: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # Regions of the grid: q | k | v | joint q | joint k | joint v.
        if bidx < blocks_q:
            self._seq_rows(mQ, mDQ, mQMap, rank, (valid_rows, key_base, pad_base), False, bidx, tidx)
        elif bidx < blocks_q + blocks_kv:
            self._seq_rows(mK, mDK, mKVMap, rank, (valid_rows, key_base, pad_base), True, bidx - blocks_q, tidx)
        elif bidx < blocks_q + 2 * blocks_kv:
            self._seq_rows(mV, mDV, mKVMap, rank, (valid_rows, key_base, pad_base), True,
                           bidx - blocks_q - blocks_kv, tidx)
        else:
            if const_expr(self.has_joint):
                b0 = bidx - blocks_q - 2 * blocks_kv
                if b0 < blocks_jq:
                    self._joint_rows(mJQ, mDQ, mQMap, rank, seq_len, False, b0, tidx)
                elif b0 < blocks_jq + blocks_jkv:
                    self._joint_rows(mJK, mDK, mKVMap, rank, seq_len, True, b0 - blocks_jq, tidx)
                else:
                    self._joint_rows(mJV, mDV, mKVMap, rank, seq_len, True, b0 - blocks_jq - blocks_jkv, tidx)

    @cute.jit
    def _seq_rows(self, mX, mD, mMap, rank, key_rows, is_kv: cutlass.Constexpr, blk, tidx):
        """Rows of this rank's shard to every destination; index order (b, s, d, j, v)."""
        B, S_loc = mX.shape[0], mX.shape[1]
        P = const_expr(self.world_size)
        H_loc = mD.shape[3]
        in_range, (v, j, d, s, b) = self._thread_coord(blk, tidx, (self.nvec, H_loc, P, S_loc, B))
        if in_range:
            row = rank * S_loc + s
            src_head = mMap[d * H_loc + j]
            if const_expr(is_kv):
                valid_rows, key_base, pad_base = key_rows
                row = key_base + s
                if s >= valid_rows:
                    row = pad_base + (s - valid_rows)  # padded key rows go after the joint rows
                    src_head = Int32(-1)  # stored as zeros: masked keys, but 0 * NaN = NaN in P @ V
            valid = src_head >= 0
            h_read = src_head if valid else 0
            self._copy_vec(mX, (b, s, h_read, v), mD, (d, b, row, j, v), valid)

    @cute.jit
    def _joint_rows(self, mX, mD, mMap, rank, seq_len, is_kv: cutlass.Constexpr, blk, tidx):
        """Joint rows (replicated) into this rank's own window; index order (b, t, j, v)."""
        B, J = mX.shape[0], mX.shape[1]
        H_loc = mD.shape[3]
        N = mD.shape[2]
        in_range, (v, j, tj, b) = self._thread_coord(blk, tidx, (self.nvec, H_loc, J, B))
        if in_range:
            row = (N - J) + tj  # q: S_pad + t
            if const_expr(is_kv):
                row = seq_len + tj  # k, v: S + t
            src_head = mMap[rank * H_loc + j]
            valid = src_head >= 0
            h_read = src_head if valid else 0
            self._copy_vec(mX, (b, tj, h_read, v), mD, (rank, b, row, j, v), valid)


class PostA2A(_RowCopy):
    """Head layout -> sequence layout (scatter), or an all-gather of heads (broadcast)."""

    def __init__(self, dtype, head_dim: int, world_size: int, broadcast: bool = False, num_threads: int = 256):
        super().__init__(dtype, head_dim, num_threads)
        self.world_size = world_size
        self.broadcast = broadcast

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, R, H_loc, D): R = P*S_loc rows (scatter) or J rows (broadcast)
        mOut: cute.Tensor,  # (P, B, S_loc or J, H_pad, D)
        rank: Int32,
        stream,
    ):
        B, R, H_loc = mO.shape[0], mO.shape[1], mO.shape[2]
        total = B * R * H_loc * self.nvec
        if const_expr(self.broadcast):
            total = total * self.world_size
        grid = cute.ceil_div(total, self.num_threads)
        self.kernel(mO, mOut, rank).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mOut: cute.Tensor, rank: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        B, R, H_loc = mO.shape[0], mO.shape[1], mO.shape[2]
        P = const_expr(self.world_size)
        rows_out = mOut.shape[2]
        if const_expr(not self.broadcast):
            # index order (b, s, h, v): a warp reads/writes contiguous (h, v) runs.
            in_range, (v, h, s, b) = self._thread_coord(bidx, tidx, (self.nvec, H_loc, R, B))
            if in_range:
                self._copy_vec(mO, (b, s, h, v), mOut, (s // rows_out, b, s % rows_out, rank * H_loc + h, v), True)
        else:
            # index order (b, t, d, h, v)
            in_range, (v, h, d, s, b) = self._thread_coord(bidx, tidx, (self.nvec, H_loc, P, R, B))
            if in_range:
                self._copy_vec(mO, (b, s, h, v), mOut, (d, b, s, rank * H_loc + h, v), True)


def cute_dtype(torch_dtype):
    import torch

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
    if torch_dtype not in table:
        raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {torch_dtype}")
    return table[torch_dtype]


def fake_tensor(dtype, shape, div):
    from quack.compile_utils import make_fake_tensor

    return make_fake_tensor(dtype, shape, divisibility=div)
