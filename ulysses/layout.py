"""Ulysses index math: the sequence <-> head partition of [B, S, H, D] tensors over P ranks.

The one place that says where every element goes; transports, kernels and the reference import it.

Sequence layout (before the pre-A2A, after the post-A2A): rank r holds the slot of global rows
[r*S_loc, (r+1)*S_loc) of every head, of which its first n_r = shard_rows[r] are valid and the
rest padding. By default S_loc = ceil(S/P) and the padding is a suffix of the sequence (every rank
full but the last ones); explicit shard_rows (uneven shards, e.g. diffusers' ulysses_anything:
36 and 34 rows) give S_loc = max n_r, S = sum n_r, and padding at the end of each short slot. How
many rows are valid is always explicit (`seq_len` or `shard_rows`), never inferred from shapes.

Head layout (between the two A2As): rank r holds all S_pad rows of query heads
[r*H_loc, (r+1)*H_loc), H_loc = ceil(H/P). Heads H <= h < H_pad = P*H_loc are zero padding: they
are computed and dropped (the post-A2A output has H_pad heads; callers keep the first H).

GQA (H = g*H_kv, query head h reads KV head h // g). Query heads are never padded beyond H_pad and
KV heads are never padded: each rank receives exactly the KV heads its query heads read, replicated
across ranks where needed, in an order that a local attention with a uniform
qhead_per_kvhead (local query head j reads local KV head j // qhead_per_kvhead, FA4's rule) can use.
qhead_per_kvhead is the largest divisor of H_loc for which that holds on every rank, which makes
H_kv_loc = H_loc / qhead_per_kvhead the smallest such count. Consequences:
  - H_kv % P == 0: a plain split, H_kv_loc = H_kv / P, qhead_per_kvhead = g, nothing replicated;
  - H_kv < P with H_loc dividing g: one KV head per rank, replicated over g / H_loc ranks;
  - otherwise (e.g. H=12, H_kv=6, P=4: rank 0 reads KV heads 0, 0, 1): qhead_per_kvhead may drop
    to 1 and each rank receives one KV head per query head. The alternative, padding whole KV
    groups (H_kv -> P*ceil(H_kv/P)), moves fewer KV bytes but pads query heads (compute); not
    taken here.

Joint (text) tokens, as in xDiT's USP for MMDiT: J joint rows are replicated on every rank and
never split over the sequence. Rank r takes its heads of the joint q/k/v (the same head indices
as for the sequence) and adds the J rows to its gathered sequence; the joint outputs of its heads
return to all ranks by an all-gather over heads. Rows of the head layout, N = S_pad + J:
  q (and the attention output):  [0, S_pad) sequence (rows >= S padding), [S_pad, N) joint.
  k, v:  [0, S) the valid sequence rows (rank by rank, compacted), [S, S+J) joint, [S+J, N) the
         padded sequence rows (rank by rank).
The key order puts every padded key in a suffix, so one seqused_k = S + J masks them (FA4 masks
keys only as a suffix); the query order keeps rows [0, S_pad) in slot order for the fused
post-A2A epilogue. Without padding both orders are the same. Joint tokens with causal masking
are rejected (MMDiT attention is not causal), and so is causal masking over uneven shards (the
compacted key order would no longer match the query order).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = [
    "check_shard_rows",
    "UlyssesLayout",
    "take_heads",
    "seq_to_head",
    "head_to_seq",
    "gather_heads",
    "split_seq",
    "gather_seq",
]


# Row counts that torch.compile may trace as symbolic (dynamic shapes): they stay so in a traced layout, where
# operator.index would fix them to the traced value (a graph per sequence length, a failure at torch's
# recompile limit under fullgraph=True). Head counts and the world size are fixed per graph as before.
_ROWS = ("seq_len", "seq_loc", "joint_len", "shard_rows")


def traced_count(value, name: str) -> bool:
    """Whether value is a row count (_ROWS) while torch.compile traces (an int or SymInt, not a bool): taken
    as it is, checked by comparisons, never by operator.index (which would fix a symbolic one)."""
    return (name in _ROWS and isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
            and torch.compiler.is_compiling())


def _as_int(value, name: str, minimum: int) -> int:
    if traced_count(value, name):
        if value >= minimum:
            return value
    elif not isinstance(value, bool):
        try:
            index = operator.index(value)
            if index >= minimum:
                return index
        except TypeError:
            pass
    raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def check_rank(rank, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    return rank


def check_shard_rows(rows, world_size: int) -> tuple:
    """Every rank's row count (uneven shards) as a tuple of ints, at least one of them > 0. rows in rank
    order: a list, tuple or 1-D array (a set or a dict has no rank order)."""
    from collections.abc import Mapping, Set

    world_size = _as_int(world_size, "world_size", 1)
    if (isinstance(rows, (str, bytes, torch.Tensor, Set, Mapping)) or not hasattr(rows, "__len__")
            or len(rows) != world_size):
        raise ValueError(f"shard_rows: expected {world_size} row counts (one per rank), got {rows!r}")
    rows = tuple(_as_int(n, "shard_rows", 0) for n in rows)
    if max(rows) < 1:
        raise ValueError(f"shard_rows: expected at least one rank with rows, got {list(rows)}")
    return rows


def _gqa_kv_heads(num_heads: int, num_kv_heads: int, world_size: int, heads_loc: int):
    """(qhead_per_kvhead, kv_head_index) for the local attention; see the module docstring."""
    group = num_heads // num_kv_heads

    def index_for(qpk):
        index = []
        for rank in range(world_size):
            row = []
            for first in range(rank * heads_loc, (rank + 1) * heads_loc, qpk):
                kv = {h // group for h in range(first, first + qpk) if h < num_heads}
                if len(kv) > 1:
                    return None
                # A block of padding heads only: any KV head serves; take the last one.
                row.append(kv.pop() if kv else num_kv_heads - 1)
            index.append(tuple(row))
        return tuple(index)

    for qpk in range(heads_loc, 0, -1):
        if heads_loc % qpk == 0 and (index := index_for(qpk)) is not None:
            return qpk, index
    raise AssertionError("unreachable: qhead_per_kvhead = 1 always fits")


@functools.lru_cache(maxsize=64)
def _kv_row_source(layout: "UlyssesLayout", device: torch.device) -> torch.Tensor:
    """UlyssesLayout.kv_row_source: valid slot rows (rank by rank), joint rows, padded slot rows."""
    slots = torch.arange(layout.seq_pad).view(layout.world_size, layout.seq_loc)
    valid = torch.arange(layout.seq_loc) < torch.tensor(layout.shard_rows)[:, None]
    joint = torch.arange(layout.seq_pad, layout.seq_pad + layout.joint_len)
    return torch.cat([slots[valid], joint, slots[~valid]]).to(device)


@dataclass(frozen=True)
class UlyssesLayout:
    """Partition of a [B, S, H, D] attention (k, v: [B, S, H_kv, D]) over `world_size` ranks.

    num_kv_heads=None means H_kv = H. shard_rows: valid rows per rank (default: the ceil split of
    seq_len; stored normalized). Derived fields: seq_loc (S_loc), seq_pad (S_pad), heads_loc
    (H_loc), heads_pad (H_pad), kv_heads_loc, qhead_per_kvhead (for the local attention),
    q_head_index / kv_head_index ([P][H_loc] / [P][H_kv_loc] global heads each rank holds;
    q entries >= H are zero padding heads).
    """

    seq_len: int
    num_heads: int
    num_kv_heads: int | None
    world_size: int
    joint_len: int = 0
    shard_rows: tuple | None = None
    is_suffix_padded: bool = field(init=False)
    seq_loc: int = field(init=False)
    seq_pad: int = field(init=False)
    heads_loc: int = field(init=False)
    heads_pad: int = field(init=False)
    kv_heads_loc: int = field(init=False)
    qhead_per_kvhead: int = field(init=False)
    q_head_index: tuple = field(init=False, repr=False)
    kv_head_index: tuple = field(init=False, repr=False)

    def __post_init__(self):
        seq_len = _as_int(self.seq_len, "seq_len", 1)
        num_heads = _as_int(self.num_heads, "num_heads", 1)
        kv = num_heads if self.num_kv_heads is None else _as_int(self.num_kv_heads, "num_kv_heads", 1)
        world_size = _as_int(self.world_size, "world_size", 1)
        joint_len = _as_int(self.joint_len, "joint_len", 0)
        if num_heads % kv:
            raise ValueError(f"num_kv_heads ({kv}) must divide num_heads ({num_heads})")
        ceil_loc = -(-seq_len // world_size)
        ceil_rows = tuple(max(0, min(ceil_loc, seq_len - r * ceil_loc)) for r in range(world_size))
        rows = ceil_rows if self.shard_rows is None else check_shard_rows(self.shard_rows, world_size)
        if sum(rows) != seq_len:
            raise ValueError(f"shard_rows: expected rows summing to seq_len ({seq_len}), got {list(rows)}")
        seq_loc = max(rows)
        heads_loc = -(-num_heads // world_size)
        qpk, kv_index = _gqa_kv_heads(num_heads, kv, world_size, heads_loc)
        q_index = tuple(tuple(range(r * heads_loc, (r + 1) * heads_loc)) for r in range(world_size))
        values = dict(
            seq_len=seq_len, num_heads=num_heads, num_kv_heads=kv, world_size=world_size,
            joint_len=joint_len, shard_rows=rows, is_suffix_padded=rows == ceil_rows,
            seq_loc=seq_loc, seq_pad=world_size * seq_loc,
            heads_loc=heads_loc, heads_pad=world_size * heads_loc,
            kv_heads_loc=heads_loc // qpk, qhead_per_kvhead=qpk,
            q_head_index=q_index, kv_head_index=kv_index,
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_shard(cls, seq_loc: int, num_heads: int, num_kv_heads: int | None, world_size: int,
                   *, seq_len: int | None = None, joint_len: int = 0) -> "UlyssesLayout":
        """Layout of per-rank shards of `seq_loc` rows; seq_len (valid rows) defaults to P*seq_loc."""
        seq_loc = _as_int(seq_loc, "seq_loc", 1)
        world_size = _as_int(world_size, "world_size", 1)
        if seq_len is None:
            seq_len = seq_loc * world_size
        seq_len = _as_int(seq_len, "seq_len", 1)
        if -(-seq_len // world_size) != seq_loc:
            raise ValueError(
                f"seq_len ({seq_len}) does not fit shards of {seq_loc} rows on {world_size} ranks: "
                f"need {world_size * (seq_loc - 1)} < seq_len <= {world_size * seq_loc}")
        return cls(seq_len, num_heads, num_kv_heads, world_size, joint_len)

    @classmethod
    def from_shard_rows(cls, shard_rows, num_heads: int, num_kv_heads: int | None, world_size: int,
                        *, seq_len: int | None = None, joint_len: int = 0) -> "UlyssesLayout":
        """Layout of uneven shards: rank r holds shard_rows[r] valid rows; seq_len defaults to their sum."""
        rows = check_shard_rows(shard_rows, _as_int(world_size, "world_size", 1))
        return cls(sum(rows) if seq_len is None else seq_len, num_heads, num_kv_heads, world_size, joint_len,
                   shard_rows=rows)

    # ---- sequence rows ----------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows of a head-layout tensor: S_pad + J."""
        return self.seq_pad + self.joint_len

    def seq_owner(self, s: int) -> tuple[int, int]:
        """Global row s (padding rows included) -> (rank, local row) in the sequence layout."""
        s = self._check_range(s, "s", self.seq_pad)
        return s // self.seq_loc, s % self.seq_loc

    def seq_row(self, rank: int, row: int) -> int:
        """Inverse of seq_owner."""
        rank = self._check_range(rank, "rank", self.world_size)
        row = self._check_range(row, "row", self.seq_loc)
        return rank * self.seq_loc + row

    def valid_rows(self, rank: int) -> int:
        """How many of rank's S_loc shard rows are real (the rest is padding)."""
        return self.shard_rows[self._check_range(rank, "rank", self.world_size)]

    def key_rows(self, rank: int) -> tuple[int, int]:
        """(first head-layout key row of rank's valid rows, first of its padding rows)."""
        rank = self._check_range(rank, "rank", self.world_size)
        valid_before = sum(self.shard_rows[:rank])
        pad_before = rank * self.seq_loc - valid_before
        return valid_before, self.seq_len + self.joint_len + pad_before

    def pad_shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of its n_r valid rows [B, n_r, ...] -> its slot [B, S_loc, ...] (zero rows
        appended; x itself when the slot is full). For explicit shard_rows (uneven shards)."""
        n = self.valid_rows(rank)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != n:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected [B, {n}, ...] (shard_rows[{rank}] rows), got {shape}")
        if n == self.seq_loc:
            return x
        return torch.cat([x, x.new_zeros(x.shape[0], self.seq_loc - n, *x.shape[2:])], dim=1)

    def zero_padding(self, x, rank: int):
        """x [B, S_loc, ...] of `rank` with its padding rows (>= valid_rows(rank)) zeroed: a copy
        when the rank holds padding, x itself otherwise. Keys there are masked (probability 0), but
        0 * NaN = NaN: whatever the caller left in its padding rows must not reach P @ V."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"x: expected a [B, S_loc, ...] tensor, got {type(x).__name__}")
        n = self.valid_rows(rank)
        if n >= x.shape[1]:
            return x
        y = x.clone()
        y[:, n:] = 0
        return y

    def q_row(self, s: int) -> int:
        """Head-layout row of global query row s (< S_pad): s."""
        return self._check_range(s, "s", self.seq_pad)

    def q_joint_row(self, j: int) -> int:
        """Head-layout row of joint query row j: S_pad + j."""
        return self.seq_pad + self._check_range(j, "j", self.joint_len)

    def kv_row(self, s: int) -> int:
        """Head-layout row of slot row s (< S_pad): valid rows compacted in [0, S), padding rows after
        the joint rows (with the default split: s if s < S else s + J)."""
        rank, i = self.seq_owner(s)
        valid_base, pad_base = self.key_rows(rank)
        n = self.shard_rows[rank]
        return valid_base + i if i < n else pad_base + i - n

    def kv_joint_row(self, j: int) -> int:
        """Head-layout row of joint key/value row j: S + j."""
        return self.seq_len + self._check_range(j, "j", self.joint_len)

    def kv_row_source(self, device=None) -> torch.Tensor:
        """int64 [N]: for each head-layout key row, its index in cat([seq slot rows (S_pad), joint (J)]).
        Built once per (layout, device) and cached: treat it as read-only."""
        return _kv_row_source(self, torch.device("cpu" if device is None else device))

    def seqused_k(self, causal: bool = False) -> int | None:
        """Keys a local attention must read (a suffix mask), or None when none need masking.

        Causal: None. Valid queries (s < S) never reach the padded keys, and a shorter seqused_k
        would shift FA4's causal diagonal (it aligns the bottom-right corner).
        """
        if causal:
            if self.joint_len:
                raise ValueError("causal masking with joint tokens (joint_len > 0) is not defined")
            if not self.is_suffix_padded:
                raise ValueError("causal masking over uneven shard_rows is not supported (keys are compacted)")
            return None
        return None if self.seq_pad == self.seq_len else self.seq_len + self.joint_len

    # ---- heads ------------------------------------------------------------------------------
    def head_owner(self, h: int) -> tuple[int, int]:
        """Query head h (padding heads included) -> (rank, local head) in the head layout."""
        h = self._check_range(h, "h", self.heads_pad)
        return h // self.heads_loc, h % self.heads_loc

    def head_global(self, rank: int, j: int) -> int:
        """Inverse of head_owner."""
        rank = self._check_range(rank, "rank", self.world_size)
        j = self._check_range(j, "j", self.heads_loc)
        return rank * self.heads_loc + j

    def kv_heads_of(self, rank: int) -> tuple[int, ...]:
        """Global KV heads rank holds in the head layout (local KV head i = entry i)."""
        return self.kv_head_index[self._check_range(rank, "rank", self.world_size)]

    # ---- tensors of one rank (head layout) -----------------------------------------------------
    def joint_q_heads(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's heads of a replicated joint q [B, J, H, D] -> [B, J, H_loc, D]."""
        self._check_joint(x, "joint q", self.num_heads)
        return take_heads(x, self.q_head_index[self._check_range(rank, "rank", self.world_size)])

    def joint_kv_heads(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's heads of a replicated joint k or v [B, J, H_kv, D] -> [B, J, H_kv_loc, D]."""
        self._check_joint(x, "joint k/v", self.num_kv_heads)
        return take_heads(x, self.kv_heads_of(rank))

    def assemble_q(self, seq: torch.Tensor, joint: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S_pad, H_loc, D] gathered sequence (+ [B, J, H_loc, D] joint) -> [B, N, H_loc, D]."""
        return self._assemble(seq, joint, self.heads_loc, None)

    def assemble_kv(self, seq: torch.Tensor, joint: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S_pad, H_kv_loc, D] (+ joint [B, J, H_kv_loc, D]) -> [B, N, H_kv_loc, D], key row order."""
        return self._assemble(seq, joint, self.kv_heads_loc, self.kv_row_source)

    def split_out(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head-layout output [B, N, H_loc, D] -> (sequence rows [B, S_pad, ...], joint rows [B, J, ...])."""
        if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1] != self.num_rows:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be [B, {self.num_rows}, H_loc, D], got {got}")
        return out[:, : self.seq_pad], out[:, self.seq_pad:]

    # ---- checks -----------------------------------------------------------------------------
    @staticmethod
    def _check_range(value, name: str, end: int) -> int:
        value = _as_int(value, name, 0)
        if value >= end:
            raise ValueError(f"{name} must be < {end}, got {value}")
        return value

    def _check_joint(self, x, name: str, heads: int):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a [B, J, H, D] tensor")
        if x.shape[1] != self.joint_len or x.shape[2] != heads:
            raise ValueError(f"{name} must have J={self.joint_len} rows and {heads} heads, "
                             f"got shape {tuple(x.shape)}")

    def _assemble(self, seq, joint, heads, row_source):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 4 or seq.shape[1:3] != (self.seq_pad, heads):
            shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise ValueError(f"seq must be [B, {self.seq_pad}, {heads}, D], got {shape}")
        if joint is None:
            if self.joint_len:
                raise ValueError(f"joint is required: the layout has joint_len={self.joint_len}")
            if row_source is None or self.is_suffix_padded:
                return seq
            return seq.index_select(1, row_source(seq.device))  # uneven shards: compact the keys
        expect = (seq.shape[0], self.joint_len, heads, seq.shape[3])
        if not isinstance(joint, torch.Tensor):
            raise ValueError(f"joint must be None or a {list(expect)} tensor, got {type(joint).__name__}")
        if tuple(joint.shape) != expect or joint.dtype != seq.dtype or joint.device != seq.device:
            raise ValueError(f"joint must be {list(expect)} {seq.dtype} on {seq.device}, "
                             f"got {list(joint.shape)} {joint.dtype} on {joint.device}")
        both = torch.cat([seq, joint], dim=1)
        return both if row_source is None else both.index_select(1, row_source(seq.device))


# ---- emulated ranks: explicit lists of per-rank tensors ---------------------------------------
def take_heads(x: torch.Tensor, heads: Sequence[int]) -> torch.Tensor:
    """x[..., heads, :] for x [..., H, D]; an entry >= H selects a zero (padding) head."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a [..., H, D] tensor, got {type(x).__name__}")
    if isinstance(heads, (str, bytes, torch.Tensor)) or not hasattr(heads, "__iter__"):
        raise ValueError(f"heads: expected a sequence of head indices, got {heads!r}")
    heads = [_as_int(h, "heads", 0) for h in heads]  # (2.5 is no head; int() would take head 2)
    H = x.shape[-2]
    extra = max(heads, default=-1) + 1 - H
    if extra > 0:
        x = torch.cat([x, x.new_zeros(*x.shape[:-2], extra, x.shape[-1])], dim=-2)
    return x.index_select(-2, index_tensor(tuple(heads), x.device))


def index_tensor(index: tuple, device: torch.device) -> torch.Tensor:
    """int64 `index` on `device` (read-only). On a CUDA device built once per (index, device): no
    host-to-device copy per call, which CUDA-graph capture refuses; under a fake mode (tracing, the
    CPU tier's compiles) built afresh, as a fake tensor must be."""
    if torch.device(device).type != "cuda" or torch._guards.detect_fake_mode() is not None:
        return torch.tensor(index, dtype=torch.long, device=device)
    return _cuda_index(index, torch.device(device))


@functools.lru_cache(maxsize=1024)
def _cuda_index(index: tuple, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even when first built under inference_mode
        return torch.tensor(index, dtype=torch.long, device=device)


def _check_rank_list(xs, name: str) -> tuple[int, ...]:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"{name} must be a non-empty list of per-rank [B, S, H, D] tensors")
    first = xs[0]
    for r, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}[{r}] must be a 4-D [B, S, H, D] tensor")
        if x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{name}[{r}] is {list(x.shape)} {x.dtype} on {x.device}, "
                             f"{name}[0] is {list(first.shape)} {first.dtype} on {first.device}")
    return tuple(first.shape)


def seq_to_head(xs: Sequence[torch.Tensor], head_index: Sequence[Sequence[int]] | None = None):
    """Pre-A2A on emulated ranks: P tensors [B, S_loc, H, D] -> P tensors [B, P*S_loc, h, D].

    Output d holds rows [s*S_loc, (s+1)*S_loc) from xs[s], heads head_index[d] (entries >= H are
    zero heads). head_index=None: the contiguous split with zero head padding, h = ceil(H/P);
    pass layout.q_head_index or layout.kv_head_index for GQA. Padding rows move like any row.
    """
    _, _, H, _ = _check_rank_list(xs, "xs")
    P = len(xs)
    if head_index is None:
        h_loc = -(-H // P)
        head_index = [range(r * h_loc, (r + 1) * h_loc) for r in range(P)]
    if len(head_index) != P or len({len(row) for row in head_index}) != 1:
        raise ValueError(f"head_index must hold {P} rows of equal length")
    return [torch.cat([take_heads(x, row) for x in xs], dim=1) for row in head_index]


def head_to_seq(ys: Sequence[torch.Tensor], num_heads: int | None = None):
    """Post-A2A on emulated ranks: P tensors [B, S_pad, H_loc, D] -> P tensors [B, S_loc, H, D].

    Output d holds rows [d*S_loc, (d+1)*S_loc) and heads [s*H_loc, (s+1)*H_loc) from ys[s];
    num_heads (default P*H_loc) keeps the first heads and drops the padding heads.
    """
    B, S_pad, H_loc, D = _check_rank_list(ys, "ys")
    P = len(ys)
    if S_pad % P:
        raise ValueError(f"ys rows ({S_pad}) must be a multiple of the number of ranks ({P})")
    if num_heads is None:
        num_heads = P * H_loc
    num_heads = _as_int(num_heads, "num_heads", 1)
    if num_heads > P * H_loc:
        raise ValueError(f"num_heads ({num_heads}) exceeds the {P}*{H_loc} heads of ys")
    s_loc = S_pad // P
    return [torch.cat([y[:, d * s_loc:(d + 1) * s_loc] for y in ys], dim=2)[:, :, :num_heads]
            for d in range(P)]


def gather_heads(ys: Sequence[torch.Tensor], num_heads: int | None = None) -> torch.Tensor:
    """All-gather over heads on emulated ranks (joint outputs): P [B, J, H_loc, D] -> [B, J, H, D]."""
    _, _, H_loc, _ = _check_rank_list(ys, "ys")
    total = len(ys) * H_loc
    num_heads = total if num_heads is None else _as_int(num_heads, "num_heads", 1)
    if num_heads > total:
        raise ValueError(f"num_heads ({num_heads}) exceeds the {total} heads of ys")
    return torch.cat(list(ys), dim=2)[:, :, :num_heads]


def split_seq(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Full [B, S, ...] -> P shards [B, ceil(S/P), ...]; the padding rows of the shards are zeros."""
    world_size = _as_int(world_size, "world_size", 1)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] < 1:
        raise ValueError("x must be a [B, S, ...] tensor with S >= 1")
    S = x.shape[1]
    s_loc = -(-S // world_size)
    pad = world_size * s_loc - S
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    return [t.contiguous() for t in x.split(s_loc, dim=1)]


def gather_seq(xs: Sequence[torch.Tensor], seq_len: int | None = None) -> torch.Tensor:
    """P shards [B, S_loc, ...] -> [B, seq_len, ...] (the padding rows dropped)."""
    if isinstance(xs, torch.Tensor) or not xs:
        raise ValueError("xs must be a non-empty list of per-rank tensors")
    full = torch.cat(list(xs), dim=1)
    if seq_len is not None:
        seq_len = _as_int(seq_len, "seq_len", 1)
        if seq_len > full.shape[1]:
            raise ValueError(f"seq_len ({seq_len}) exceeds the {full.shape[1]} rows of xs")
        full = full[:, :seq_len]
    return full

