"""The attention block's engine (under fa_a2a.block): its QKV projection stage and its prepared rank call.

The projection (`project`, `_Projection`): rank r's fused QKV projection + pre-A2A into the
in-windows (dq, dk, dv) of the op's window plan, routed and bound once per signature:
`segment_writes` says which rows of x go to which window rows (q rows at r*S_loc, k/v rows in the
layout's key order, the padding rows from zero rows, the joint rows into the rank's own window),
`auto_tiles` picks each launch's tiles and launch split, and each launch is a bound
cute_kernels.qkv_a2a_sm90.qkv_a2a_launcher. The rotary: `_rope_source` (rope_table's checks, no
conversion; fa_a2a.block's checks call it), `_rope_operand` (what the epilogue reads: a (cos, sin)
pair as it is, or stacked into a `_RopeTable` every call). Rows and segments as fa_a2a.block's
docstring says.

The prepared call (`_RankBlock`): one rank's block calls of one checked signature, the op's
prepared call (fa_a2a.engine.forward.RankCall) with the projection as its stage; `_rank_block`
(one rank of a group) and `_emulated_blocks` (P emulated ranks in one process) keep them per
signature through fa_a2a.engine.forward.prepared_call, as the op's calls are kept;
`_auto_block_problem`: impl "auto" of the block (fa_a2a.engine.autotune).

Arrows point down: fa_a2a.block imports this module; it imports the engine's other modules,
cute_kernels and ulysses.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from cute_kernels.limits import tma_table


# ---- the rotary operand ------------------------------------------------------------------------------
def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether t is on `device`; "cuda" without an index means the current CUDA device (any index
    where CUDA is not available: compiling with fake tensors)."""
    here = t.device
    if here == device:
        return True
    if here.type != device.type:
        return False
    index = device.index
    if index is None and device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return index is None or here.index is None or here.index == index


def _rope_source(rotary, rows: int, head_dim: int, device, name: str):
    """fa_a2a.block.rope_table's checks without its conversion -> None, the table, or the (cos, sin)
    pair; raises what rope_table raises (a pair off `device`: the message of the table it would make
    there)."""
    if rotary is None:
        return None
    if type(device) is not torch.device:
        device = torch.device(device)
    if isinstance(rotary, (tuple, list)):
        if len(rotary) != 2 or not all(isinstance(t, torch.Tensor) for t in rotary):
            raise ValueError(f"{name}: expected a (cos, sin) pair of tensors or a table, got {len(rotary)} items")
        cos, sin = rotary
        if cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim):
            raise ValueError(f"{name}: expected cos, sin of shape [{rows}, {head_dim}], got "
                             f"{tuple(cos.shape)}, {tuple(sin.shape)}")
        for t in (cos, sin):
            if not _on(t, device):
                raise ValueError(f"{name}: expected a contiguous float32 [{rows}, {head_dim}] table on {device}, "
                                 f"got {torch.float32} {(rows, head_dim)} on {t.device}")
        return cos, sin
    if not isinstance(rotary, torch.Tensor):
        raise ValueError(f"{name}: expected None, a (cos, sin) pair or a float32 table, got {type(rotary).__name__}")
    if (rotary.dtype != torch.float32 or tuple(rotary.shape) != (rows, head_dim)
            or not _on(rotary, device) or not rotary.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous float32 [{rows}, {head_dim}] table on {device}, got "
                         f"{rotary.dtype} {tuple(rotary.shape)} on {rotary.device}")
    return rotary


PAIR_ROWS_MAX = 576


def _rope_operand(src, table: Optional["_RopeTable"] = None):
    """A checked rope source (None, the fp32 table or the (cos, sin) pair) as the projection's
    epilogue reads it. A pair of up to PAIR_ROWS_MAX rows goes in as it is (the pair epilogue, no
    per-call conversion: ~14 us of host time per segment on the H200 machine); a longer one is
    stacked into `table` (_rope_table_for), quack's table, which the epilogue reads in one load:
    measured (H200, 2026-12-04, Flux shapes, examples/qkv_speed.py fused-nr) the pair epilogue equal
    at 576 rows (91.9 vs 92.5 us) and 5.7% slower at 4096 (377.4 vs 357.0 us), where the call is
    GPU-bound and the conversion's host time hidden. Each tensor as it is where it is float32 with
    rows the TMA loads (a 16-byte aligned base and row stride: diffusers' tables and their row
    views), else a float32 copy."""
    if src is None:
        return None
    if not isinstance(src, tuple):
        return _tma_table(src)
    if table is not None:
        return table(*src)
    return _tma_table(src[0]), _tma_table(src[1])


def _rope_table_for(src, head_dim: int) -> Optional["_RopeTable"]:
    """The buffer a (cos, sin) pair of more than PAIR_ROWS_MAX rows is stacked into every call, or
    None (no rotary, a table, or a pair the epilogue reads as it is)."""
    if not isinstance(src, tuple) or src[0].shape[0] <= PAIR_ROWS_MAX:
        return None
    return _RopeTable(src[0].shape[0], head_dim, src[0].device)


class _RopeTable:
    """Where a diffusers (cos, sin) pair [rows, D] becomes the kernel's fp32 table, every call: one
    stack into this buffer (interleaved_cos_sin's values, each element cast to fp32 once). The two
    strided views the stack reads are kept for the pair last seen and rebuilt only when a tensor's
    address, strides or dtype change (a view costs ~7 us of host time on the H200 machine, the
    check ~1 us; a kept view holds its storage, so an unchanged address is the same memory)."""

    def __init__(self, rows: int, head_dim: int, device):
        self.table = torch.empty(rows, head_dim, dtype=torch.float32, device=device)
        self._out = self.table.view(rows, head_dim // 2, 2)
        self._key = self._views = None

    def __call__(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        key = (cos.data_ptr(), cos.stride(), cos.dtype, sin.data_ptr(), sin.stride(), sin.dtype)
        if key != self._key:
            self._key, self._views = key, [cos[:, 0::2], sin[:, 0::2]]
        torch.stack(self._views, dim=-1, out=self._out)
        return self.table


def _tma_table(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32 and tma_table(t, t.data_ptr()):
        return t
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


def _rope_rows(rope, n: int):
    """The first n rows of a rope operand (None, a table or a (cos, sin) pair)."""
    if rope is None:
        return None
    return (rope[0][:n], rope[1][:n]) if isinstance(rope, tuple) else rope[:n]


# ---- the projection's routing -------------------------------------------------------------------
def segment_writes(layout, rank: int, rows: Sequence[int]) -> list:
    """The projection launches of rank `rank` whose rows come as consecutive segments of rows[i]
    rows: [(segment, n, tensors, window row)], segment i's first n rows (i = len(rows): n zero rows,
    the rank's padding rows) into window rows [row, row + n) of q ("q"), of k and v ("kv") or of all
    three ("qkv"). Only the rank's first valid_rows(rank) rows are read (a suffix of the segments
    past them is never projected). Slot row s of the rank goes to q row rank*S_loc + s; a valid one
    to key row key_rows(rank)[0] + s, a padding one to key_rows(rank)[1] + s - valid (the layout's
    row order). Pure index math."""
    S_loc, valid = layout.seq_loc, layout.valid_rows(rank)
    if sum(rows) < valid:
        raise ValueError(f"x: expected rows summing to >= {valid} (rank {rank}'s valid rows), got {list(rows)}")
    q0 = rank * S_loc
    kv0, pad0 = layout.key_rows(rank)
    pieces, start = [], 0  # (segment, rows, first slot row, first key row)
    for i, n in enumerate(rows):
        n = min(n, valid - start)
        if n > 0:
            pieces.append((i, n, start, kv0 + start))
            start += n
    if valid < S_loc:
        pieces.append((len(rows), S_loc - valid, valid, pad0))
    writes = []
    for i, n, s, kv in pieces:
        writes += [(i, n, "qkv", kv)] if q0 + s == kv else [(i, n, "q", q0 + s), (i, n, "kv", kv)]
    return writes


# ---- one rank's projection into the in-windows -----------------------------------------------------
def project(windows, layout, rank: int, x, proj=None, rope=None, joint_x=None, joint_proj=None, joint_rope=None, *,
            config="auto", one_launch: bool = False, pacer=None) -> None:
    """Rank `rank`'s fused projection + pre-A2A into windows = (dq, dk, dv) [P, B, N, h, D]
    (rows as in fa_a2a.block's docstring). x [B, rows, C]: the rank's rows, projected with proj and
    rope (None, the fp32 [rows, D] table or a (cos, sin) pair, as qkv_a2a_launcher's rope_cs); or
    segments: a list of (x_i, proj_i, rope_i), the rank's rows in order, each with its own weights
    (proj and rope None). Rows past the rank's valid rows are not
    read; its padding rows are projected from zero rows with the last segment's weights (segment_writes).
    joint_proj: the rank's own slice (QKVWeights.rank_slice). config "auto": auto_tiles by each
    launch's rows; else config and one_launch for every launch. pacer: every launch's stores paced
    by this state (qkv_a2a_launcher's pacer), None: unpaced."""
    segs = [(x, proj, rope)] if isinstance(x, torch.Tensor) else list(x)
    joint = (joint_x, joint_proj, joint_rope) if joint_x is not None else None
    _Projection(windows, layout, rank, segs, joint, config=config, one_launch=one_launch, pacer=pacer)(segs, joint)


_JOINT = -1  # _Projection's segment index of the joint rows


class _Projection:
    """Rank `rank`'s projection launches into `windows`, routed and bound once: segment_writes' list,
    each launch's (config, one_launch) (auto_tiles), the zero stand-in rows of its padding rows and
    each launch's qkv_a2a_launcher (checked, compiled, window views made). Built from one call's
    segments (x, proj, rope) and joint (x, proj, rope) or None; a call of the same shapes and kinds
    (the block's signature) launches with its own tensors (`__call__`). pacer: one pacer state for
    all its launches (qkv_a2a_launcher's), None: unpaced."""

    def __init__(self, windows, layout, rank: int, segs, joint=None, *, config="auto", one_launch: bool = False,
                 pacer=None):
        from cute_kernels import qkv_a2a_sm90

        bind = functools.partial(qkv_a2a_sm90.qkv_a2a_launcher, pacer=pacer)
        dq, dk, dv = windows
        pick = {"q": (dq, None, None), "kv": (None, dk, dv), "qkv": (dq, dk, dv)}
        auto = isinstance(config, str) and config == "auto"

        def tiles(rows, proj, rope):
            return auto_tiles(rows, proj, rope) if auto else (config, one_launch)

        # (segment index (len(segs): the zero rows, _JOINT), rows to slice to or None, bound launch)
        self.launches, self.zeros = [], None
        for i, n, which, row0 in segment_writes(layout, rank, [s[0].shape[1] for s in segs]):
            sx, sp, sr = segs[min(i, len(segs) - 1)]
            if i == len(segs) and self.zeros is None:
                # the padding rows: their k/v are masked keys, but 0 * NaN = NaN would reach P @ V
                self.zeros = (sx.new_zeros(sx.shape[0], n, sx.shape[2]),
                              None if sr is None else sx.new_zeros(n, (sr[0] if isinstance(sr, tuple) else sr).shape[1],
                                                                   dtype=torch.float32))
            cut = n if i < len(segs) and n < sx.shape[1] else None  # (the rows past the valid ones: never read)
            if i == len(segs):
                sx, sr = self.zeros
            elif cut is not None:
                sx, sr = sx[:, :cut], _rope_rows(sr, cut)
            cfg, one = tiles(n, sp, sr)
            self.launches.append((i, cut, bind(sx, sp, pick[which], row0, rope_cs=sr, config=cfg, one_launch=one)))
        if joint is None:
            return
        own = [w[rank:rank + 1] for w in windows]
        S, S_pad = layout.seq_len, layout.seq_pad
        jx, jp, jr = joint
        cfg, one = tiles(jx.shape[1], jp, jr)
        targets = [(tuple(own), S_pad)] if S == S_pad else [((own[0], None, None), S_pad), ((None, own[1], own[2]), S)]
        for which, row0 in targets:
            self.launches.append((_JOINT, None, bind(jx, jp, which, row0, rope_cs=jr, config=cfg, one_launch=one)))

    def __call__(self, segs, joint=None) -> None:
        """Launch the projection of segs ((x, proj, rope) per segment) and joint ((x, proj, rope),
        present exactly when it was at build) with the routing built."""
        n_segs = len(segs)
        for i, cut, launch in self.launches:
            if i == _JOINT:
                sx, sp, sr = joint
            elif i == n_segs:
                (sx, sr), sp = self.zeros, segs[-1][1]
            else:
                sx, sp, sr = segs[i]
                if cut is not None:
                    sx, sr = sx[:, :cut], _rope_rows(sr, cut)
            launch(sx, sp, sr)


ONE_LAUNCH_ROWS = 576  # up to this many rows a bias + norm + RoPE projection is one launch with any tile


def auto_tiles(rows: int, proj, rope) -> tuple:
    """(config, one_launch) for a rank's `rows`: config_for's 192-row tile where it pads fewer rows
    than 128-row tiles, else quack's default tiles (None); q|k|v in one launch when the epilogue is
    bias + norm + RoPE and the tile is 192 rows or the rows are at most ONE_LAUNCH_ROWS. Measured
    (H200, 2026-12-03, Flux shapes, bench_block): at S_loc = 576 the block took 118.4 us this way
    against 147.9 with the default; at 1024 and 4096 (where config_for keeps 128-row tiles) the
    default two launches were faster than one launch of 128x128 tiles (261.9 vs 268.2, 2316.3 vs
    2377.4 us). Up to 576 rows one launch of the default tiles is faster (H200, 2026-12-04,
    examples/qkv_speed.py: 43.0 vs 50.1 us at 128 rows, 38.6 vs 47.6 at 256; 88.7 vs 89.4 at 576 on
    2026-12-03), and the eager block at P = 1, S 128 takes 75.4 us against 104.3 with two launches
    (examples/eager_host_cost.py)."""
    from cute_kernels.qkv_a2a_sm90 import config_for

    epilogue = proj.norm_weight is not None or rope is not None
    one = proj.bias is not None and proj.norm_weight is not None and rope is not None
    cfg = config_for(rows, min(proj.widths), proj.head_dim, epilogue)
    if cfg.tile_m != 192 or any(w % cfg.tile_n for w in proj.widths):
        return None, one and rows <= ONE_LAUNCH_ROWS
    return cfg, one


# ---- the prepared call -------------------------------------------------------------------------
class _RankBlock:
    """One rank's block calls of one checked signature, prepared once: the op's prepared call
    (fa_a2a.engine.forward.RankCall: the window plan, the bound attention launch) with the routed projection
    (_Projection) and the rank's joint weight slice. With no transport (P = 1, no group) the
    projection writes into buffers of the in-windows' layout and FA4 runs on them as the op's P = 1
    path does: no barrier, post-A2A or copy (before, P = 1 ran an emulated one-rank transport: two
    barrier launches, the fused kernel into its own window and a copy out of it). A steady-state
    call neither re-reads the transport's settings nor hashes the layout, re-routes the projection
    or allocates (its output aside; and a float32 copy of a rotary the epilogue cannot read as it
    is, _rope_operand).

    The projection's epilogue reads each call's rotary itself: diffusers' (cos, sin) pair of up to
    PAIR_ROWS_MAX rows as it is, nothing converted or cached per call; a longer pair is stacked
    every call into a table buffer of this object (_RopeTable; _rope_operand says why). Caching the
    converted table keyed by the inputs' (data_ptr, _version, shape, dtype) is not safe: writes that
    bypass the version counter (.data, a CUDA-graph replay, a custom kernel) leave the key as it
    was, a freed input's address comes back with a fresh version 0, inference tensors have no
    version counter, and a hit during capture would leave the conversion out of the graph."""

    def __init__(self, transport, problem, rank: int, segs, joint, joint_proj, joint_rotary, config,
                 one_launch: bool):
        """segs: the call's segments (fa_a2a.block._rank_segments); joint, joint_proj, joint_rotary: as
        the call has them."""
        from fa_a2a.engine.forward import RankCall, in_windows

        p, lay = problem, problem.layout
        self.transport, self.rank, self.head_dim, self.problem = transport, rank, p.head_dim, p
        if transport is None:  # P = 1: q, k, v stay on this GPU
            self.call = self.plan = None
            device = segs[0][0].device
            windows = in_windows(lambda n: torch.empty(1, n, dtype=p.dtype, device=device), lay, p.batch, p.head_dim)
        else:  # the op's prepared call (its attention compiles before the 1st barrier); its stage: the projection
            self.call = RankCall(transport, p, rank)
            self.plan = plan = self.call.plan
            windows = (plan.dq, plan.dk, plan.dv)
        self.windows = windows
        # P = 1: the attention launch, checked and bound once (_local_attention)
        self._attend = self._bind_attention() if transport is None else None
        self.rows = sum(s[0].shape[1] for s in segs)
        self.joint_rows = joint.shape[1] if joint is not None else 0
        self.joint_src = self.joint_versions = self.joint_slice = None
        self.tables = [_rope_table_for(r, p.head_dim) for _, _, r in segs]
        self.joint_table = None
        if self.joint_rows:
            joint_rope = _rope_source(joint_rotary, self.joint_rows, p.head_dim, segs[0][0].device, "joint_rotary")
            self.joint_table = _rope_table_for(joint_rope, p.head_dim)
            joint = (joint, self._joint_proj(joint_proj or segs[0][1]), _rope_operand(joint_rope, self.joint_table))
        self.pacing = None if transport is None else self._projection_pacing(segs)
        pacer = None
        if self.pacing is not None:
            from fa_a2a.engine.pacing import projection_pacer

            pacer = projection_pacer(self.pacing, transport.device)
        self.project = _Projection(windows, lay, rank,
                                   [(x, w, _rope_operand(r, t)) for (x, w, r), t in zip(segs, self.tables)],
                                   joint if self.joint_rows else None, config=config, one_launch=one_launch,
                                   pacer=pacer)

    def _projection_pacing(self, segs):
        """The projection's store pacing (fa_a2a.engine.pacing.plan_projection_pacing) from the call's pace:
        "auto" decides from the input windows' link (collective the first time: every rank builds its
        _RankBlock at the same call); a rate paces at that rate where the input windows sit behind
        the attention's link, and decides as "auto" where they do not (Transport.split_links). The
        GEMM is estimated from all the rank's rows with the first segment's weights and width."""
        from fa_a2a.engine.pacing import link_gbps, plan_projection_pacing

        t, p = self.transport, self.problem
        if p.pace is None:
            return None
        pace = "auto" if t.split_links else p.pace
        proj = segs[0][1]
        return plan_projection_pacing(pace, lambda: link_gbps(t, "in"), self.rows + self.joint_rows,
                                      proj.weight.shape[0], segs[0][0].shape[2], p.dtype,
                                      ranks_per_gpu=t.ranks_per_gpu)

    @property
    def closed(self) -> bool:
        """Whether its transport was closed (a call with no transport, P = 1, never is)."""
        return self.transport is not None and self.transport.closed

    def _joint_proj(self, src):
        """The rank's slice of the joint weights (a copy), kept for the next call while src and its data
        are the same (QKVWeights.versions: an in-place update of the weights makes a new slice)."""
        versions = src.versions()
        if src is not self.joint_src or versions != self.joint_versions:
            self.joint_src, self.joint_versions, self.joint_slice = src, versions, src.rank_slice(self.rank)
        return self.joint_slice

    def launch_projection(self, segs, joint, joint_rotary, joint_proj) -> None:
        """This call's projection into the in-windows: the bound launches with this call's x, weights
        and rotaries (the first step of a call)."""
        segs = [(x, w, _rope_operand(r, t)) for (x, w, r), t in zip(segs, self.tables)]
        jt = None
        if self.joint_rows:
            r = _rope_source(joint_rotary, self.joint_rows, self.head_dim, segs[0][0].device, "joint_rotary")
            jt = (joint, self._joint_proj(joint_proj or segs[0][1]), _rope_operand(r, self.joint_table))
        self.project(segs, jt)

    def __call__(self, segs, joint, joint_rotary, joint_proj):
        if self.call is None:
            self.launch_projection(segs, joint, joint_rotary, joint_proj)
            out, joint_out = self._local_attention()
        else:
            out, joint_out = self.call(lambda: self.launch_projection(segs, joint, joint_rotary, joint_proj), self.rows)
        return out if joint is None else (out, _joint_result(out, joint_out))

    def _local_attention(self):
        """P = 1: FA4 on the projected rows into a fresh output, as the op's P = 1 path runs it
        (forward._single_rank: the same kernel and values; no barrier, post-A2A or copy), its launch
        checked and bound once (the windows are this object's)."""
        from fa_a2a.engine.forward import _deliver

        lay = self.problem.layout
        o = self._attend()
        return _deliver(lay, 0, lay.split_out(o) if lay.joint_len else (o, None), self.rows)

    def _bind_attention(self):
        from cute_kernels.fa4 import fa4_fresh_launcher
        from fa_a2a.engine.forward import seqused_tensor

        p = self.problem
        q, k, v = (w.select(0, 0) for w in self.windows)  # [B, N, h, D] (contiguous): sequence rows, then joint
        return fa4_fresh_launcher(q, k, v, causal=p.causal, softmax_scale=p.scale,
                                  seqused_k=seqused_tensor(p.layout.seqused_k(p.causal), q.shape[0], q.device))


def _rank_block(calls: dict, group, P: int, rank: int, problem, segs, joint, joint_proj, joint_rotary, config,
                one_launch: bool) -> _RankBlock:
    """The prepared _RankBlock of this call, from `calls` (its signature's, keyed there by the current
    device and the rank's segment rows; the signature holds the group name and the rank), built on
    a miss or once its transport was closed (fa_a2a.engine.forward.prepared_call, as the op's)."""
    from fa_a2a.engine.forward import prepared_call

    def build_block():
        from ulysses.transport import get_transport

        transport, p = (None if P == 1 else get_transport(group)), problem
        if transport is not None and p.impl == "auto":
            def build(candidate):
                return _RankBlock(transport, candidate, rank, segs, joint, joint_proj, joint_rotary, config, one_launch)

            p = _auto_block_problem(p, transport, segs[0][0], build, lambda b: b(segs, joint, joint_rotary, joint_proj))
        return _RankBlock(transport, p, rank, segs, joint, joint_proj, joint_rotary, config, one_launch)

    return prepared_call(calls, (torch.cuda.current_device(), tuple([s[0].shape[1] for s in segs])), build_block)


def _auto_block_problem(problem, transport, x, build, run):
    """impl "auto" of the block (fa_a2a.engine.autotune; candidates fused TMA / st and serial, the projection
    fused in each): the problem with the decided path. build(problem) -> the prepared call(s) of a
    candidate (collective: every rank builds the same candidates in the same order); run(prepared)
    makes one whole call of them on this call's inputs."""
    from fa_a2a.engine import autotune

    prepared: dict = {}

    def time_one(label):
        if label not in prepared:
            prepared[label] = build(autotune.concrete(problem, label))
        run(prepared[label])

    choice = autotune.decide_path(problem, transport, time_one, x, entry="ulysses_qkv_attention")
    return autotune.concrete(problem, choice.label)


def _joint_result(out, joint_out):
    return joint_out if joint_out is not None else out.new_empty(out.shape[0], 0, out.shape[2], out.shape[3])


def _emulated_blocks_call(blocks, segs, joint, joint_rotary, joint_proj):
    """One emulated call of the P ranks' prepared blocks (fa_a2a.engine.forward.emulated_calls, as the
    emulated op): every projection, barrier, every attention, barrier, every rank's outputs."""
    from fa_a2a.engine.forward import emulated_calls

    stages = [lambda b=b, s=s: b.launch_projection(s, joint, joint_rotary, joint_proj) for b, s in zip(blocks, segs)]
    done = emulated_calls([b.call for b in blocks], stages, [b.rows for b in blocks])
    outs = [o for o, _ in done]
    return outs if joint is None else (outs, [_joint_result(o, j) for o, j in done])


class _EmulatedBlocks(list):
    """The P emulated ranks' _RankBlocks of one call, prepared together on one transport: a call runs
    them in lock step (_emulated_blocks_call)."""

    @property
    def closed(self) -> bool:
        """Whether their transport was closed."""
        return self[0].closed

    def __call__(self, segs, joint, joint_rotary, joint_proj):
        return _emulated_blocks_call(self, segs, joint, joint_rotary, joint_proj)


def _emulated_blocks(calls: dict, problem, segs, joint, joint_proj, joint_rotary, config,
                     one_launch: bool) -> _EmulatedBlocks:
    """The P emulated ranks' prepared _RankBlocks of this call (segs: every rank's segments),
    from `calls` (its signature's, keyed there by the device and every rank's segment rows), built
    on a miss or once their transport was closed (fa_a2a.engine.forward.prepared_call, as the op's)."""
    from fa_a2a.engine.forward import prepared_call

    P, device = len(segs), segs[0][0][0].device

    def build_blocks():
        from fa_a2a.engine.forward import emulated_transport

        transport, p = emulated_transport(P, device), problem

        def build(candidate):
            return _EmulatedBlocks(_RankBlock(transport, candidate, r, segs[r], joint, joint_proj, joint_rotary,
                                              config, one_launch) for r in range(P))

        if p.impl == "auto":
            p = _auto_block_problem(p, transport, segs[0][0][0], build,
                                    lambda b: b(segs, joint, joint_rotary, joint_proj))
        return build(p)

    # (list comprehensions, not generators: inlined by Python 3.12, no frame per rank on the eager path)
    key = (device, tuple([tuple([seg[0].shape[1] for seg in rank_segs]) for rank_segs in segs]))
    return prepared_call(calls, key, build_blocks)
