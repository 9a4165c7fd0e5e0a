"""Ulysses attention as torch ops: the public functions and the torch.library custom ops behind them.

Layers: kernel classes with their cached compiles and launches
(cute_kernels/, cute_kernels.fa4) -> the forwards of one rank or of P emulated ranks
(fa_a2a.engine.forward) -> torch.library custom ops that write preallocated outputs
(`fa_a2a::ulysses_attention`, `fa_a2a::ulysses_attention_emulated`, `fa_a2a::post_a2a`; each has
a fake implementation, so torch.compile traces through them) -> the public functions below and
fa_a2a.attention. The op's arguments are checked in fa_a2a.engine.problem (once per signature,
agreed across ranks), which the block's checks call too. The impls are described in fa_a2a.engine.forward.

Eager calls go straight to the forward: torch.library's dispatch costs ~0.5 ms of host time per
call with list arguments (H200 host, 2026-12-03), more than the kernels of a small problem. Under
torch.compile the public functions call the custom ops instead, so the graph holds one opaque op.
Calls with inputs that require grad (grad mode on) go to fa_a2a.engine.backward: eagerly an
autograd.Function, under torch.compile its functional custom op with a registered backward.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from cute_kernels.limits import DTYPES as KERNEL_DTYPES
from ulysses.layout import check_rank

from fa_a2a.engine.backward import wants_grad
from fa_a2a.engine.forward import contiguous16, forward, forward_emulated, head_maps
from fa_a2a.engine.pacing import check_pace, decode_pace, encode_pace
from fa_a2a.engine.problem import (EMULATED_IMPLS, IMPLS, check_call, check_tensor, group_by_name, group_facts,
                                   refuse_on_every_rank, resolve, resolve_emulated, RECHECK)

__all__ = [
    "IMPLS",
    "EMULATED_IMPLS",
    "ulysses_attention",
    "ulysses_attention_emulated",
    "ulysses_attention_out_proj",
    "ulysses_attention_out_proj_emulated",
    "pre_a2a",
    "post_a2a",
]


def _outputs(q, joint):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    joint_out = torch.empty_like(joint[0], memory_format=torch.contiguous_format) if joint is not None else None
    return out, joint_out


def _result(out, joint_out, given_joint: bool):
    """out, or (out, joint_out) when the caller passed joint (J = 0 rows: an empty joint output)."""
    if not given_joint:
        return out
    if joint_out is None:
        joint_out = out.new_empty(out.shape[0], 0, out.shape[2], out.shape[3])
    return out, joint_out


# ---- custom ops (what torch.compile sees) ----------------------------------------------------------
@torch.library.custom_op("fa_a2a::ulysses_attention", mutates_args=("out", "joint_out"))
def _ulysses_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    joint_q: Optional[torch.Tensor], joint_k: Optional[torch.Tensor], joint_v: Optional[torch.Tensor],
    joint_out: Optional[torch.Tensor], group_name: str, impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int], shard_rows: Optional[list[int]],
    refusal: Optional[str] = None, pace: str = "auto",
) -> None:
    """refusal: the ValueError the traced call found (raised here, on every rank of the group).
    pace: fa_a2a.engine.pacing.encode_pace's text."""
    group, group_name, P, rank = group_by_name(group_name)
    joint = (joint_q, joint_k, joint_v) if joint_q is not None else None
    problem, joint = resolve(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size=P,
                             rank=rank, group=group, group_name=group_name, refusal=refusal, pace=decode_pace(pace))
    forward(problem, q, k, v, joint, group, rank, out, joint_out)


@_ulysses_attention_op.register_fake
def _(q, k, v, out, joint_q, joint_k, joint_v, joint_out, group_name, impl, causal, softmax_scale, seq_len,
      shard_rows, refusal=None, pace="auto"):
    return None


@torch.library.custom_op("fa_a2a::ulysses_attention_emulated", mutates_args=("outs", "joint_outs"))
def _ulysses_attention_emulated_op(
    qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], outs: list[torch.Tensor],
    joint: list[torch.Tensor], joint_outs: list[torch.Tensor], impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int], shard_rows: Optional[list[int]], pace: str = "auto",
) -> None:
    joint = tuple(joint) if joint else None
    problem, joint = resolve_emulated(qs, ks, vs, joint, impl, causal, softmax_scale, seq_len, shard_rows,
                                      decode_pace(pace))
    forward_emulated(problem, qs, ks, vs, joint, outs, joint_outs)


@_ulysses_attention_emulated_op.register_fake
def _(qs, ks, vs, outs, joint, joint_outs, impl, causal, softmax_scale, seq_len, shard_rows, pace="auto"):
    return None


@torch.library.custom_op("fa_a2a::post_a2a", mutates_args=("out_windows",))
def _post_a2a_op(o: torch.Tensor, out_windows: torch.Tensor, rank: int, broadcast: bool) -> None:
    from cute_kernels.a2a import launch_post_a2a

    launch_post_a2a(o, out_windows, rank, broadcast=broadcast)


@_post_a2a_op.register_fake
def _(o, out_windows, rank, broadcast):
    return None


@torch.library.custom_op("fa_a2a::refusal", mutates_args=())
def _refusal_op(message: str, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    raise ValueError(message)


@_refusal_op.register_fake
def _(message, likes):
    return [torch.empty_like(t) for t in likes]


def traced_refusals(stand_ins):
    """Decorator of a public function that cannot pass its refusal into a custom op as ulysses_attention
    does: under torch.compile a ValueError raised while tracing it would reach the caller only as the
    __cause__ of dynamo's "Observed exception". Instead the graph gets an op raising the plain
    ValueError when it runs; while tracing the call returns stand_ins(likes_op, *args, **kwargs),
    where likes_op(likes) gives that op's stand-in outputs, shaped like the tensors `likes` (never
    read: the op raises first). Eager calls go straight to the function."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except ValueError as e:
                message = str(e)
                # detached: the stand-ins never reach a backward (the op raises first)
                return stand_ins(lambda likes: _refusal_op(message, [t.detach() for t in likes]), *args, **kwargs)
        return traced
    return wrap


def _emulated_stand_ins(refused, qs, *args, joint=None, **kwargs):
    """ulysses_attention_emulated's outputs as refused(likes) stand-ins: like each q (and joint[0])."""
    qs = list(qs) if isinstance(qs, (list, tuple)) and all(isinstance(q, torch.Tensor) for q in qs) else []
    given_joint = joint is not None
    jq = joint[0] if given_joint and isinstance(joint, (list, tuple)) and len(joint) == 3 else None
    jq = [jq] * len(qs) if isinstance(jq, torch.Tensor) else []
    outs = refused(qs + jq)
    return (outs[:len(qs)], outs[len(qs):]) if given_joint else outs


# ---- public functions ------------------------------------------------------------------------------
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    impl: str = "auto",
    joint: Optional[Sequence[torch.Tensor]] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seq_len: Optional[int] = None,
    shard_rows: Optional[Sequence[int]] = None,
    pace="auto",
):
    """Ulysses sequence-parallel attention, called by every rank of `group` with its shard.

    q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D] (H_kv divides H: GQA): rows
    [rank*S_loc, (rank+1)*S_loc) of the full sequence. seq_len: valid rows of the full sequence
    (default P*S_loc; the padding rows of the last shards are masked as keys and come back as
    zeros). joint: replicated (q, k, v) [B, J, H(_kv), D] text tokens (MMDiT), attended to and
    attending every row. Returns [B, S_loc, H, D], or (that, joint output [B, J, H, D]) with joint.
    shard_rows: uneven shards instead (e.g. diffusers' ulysses_anything): the list of every rank's
    row count, the same on every rank; rank r passes and gets back shard_rows[r] rows, the next
    ones of the sequence after those of ranks < r (not with causal=True).
    group=None: the default group (a single process without torch.distributed is P = 1).
    Every argument except the tensors' data must be the same on every rank, and joint's data too:
    every call checks the arguments across ranks before any data moves (every rank raises the
    same ValueError otherwise; fa_a2a.engine.problem says how, FA_A2A_CHECK_JOINT=1 checks joint's data).
    impl: "auto" (default: the fastest of fused with TMA or st O-stores, serial and nccl, timed on
    this machine at the signature's first call, kept on disk; fa_a2a.engine.autotune), "fused",
    "fused:tma" / "fused:st" (fused with that O-store path), "serial", "nccl" or "reference"
    (fa_a2a.engine.forward describes each). Every impl but reference gives the same bits.
    pace: the fused kernel's O-store pacing for slow links: "auto" (decided from the transport's
    measured link and FA4's tiles, logged once), None / "off", or a rate in GB/s (fa_a2a.engine.pacing).
    The first call per shape allocates the rank windows (collective, host-synchronous; with
    pace="auto" it also times the link once per transport, with impl="auto" its candidates):
    make it before CUDA-graph capture.
    Differentiable (fa_a2a.engine.backward): with grad mode on and an input that requires grad, the call
    keeps its heads-layout q, k, v (and FA4's O and LSE) for a backward that every rank must run,
    as it runs the forward; whether a call requires grad must be the same on every rank. Joint
    inputs get the grads of this rank's heads (summed over the ranks: the full gradient).
    """
    group, group_name, P, rank = group_facts(group)
    given_joint = joint is not None
    grad = wants_grad(q, k, v, joint)
    tracing = torch.compiler.is_compiling()
    if tracing:
        # The op's body checks and agrees at run time. A bad call is not refused while tracing:
        # under torch.compile(fullgraph=True) dynamo would report its own "Observed exception"
        # instead of the ValueError; the op's body raises the plain ValueError when it runs.
        refusal = None
        try:
            problem, joint = check_call(q, k, v, joint, impl, causal, softmax_scale, seq_len, P, shard_rows, rank,
                                        pace)
            softmax_scale = problem.softmax_scale
        except ValueError as e:
            # the op's body checks again and raises what it finds: a message naming sizes that torch.compile
            # traced as dynamic (symbolic) is no constant the graph could carry
            refusal = RECHECK
            joint = tuple(joint) if isinstance(joint, (tuple, list)) and len(joint) == 3 else None
        try:
            pace = encode_pace(check_pace(pace))
        except ValueError as e:
            refusal, pace = refusal or str(e), "off"
        if grad and refusal is None:  # the functional op with its backward (torch.library.register_autograd)
            from fa_a2a.engine.backward import traced_attention_with_grad

            out, joint_out = traced_attention_with_grad(q, k, v, joint, group_name, impl, causal, softmax_scale,
                                                        seq_len, shard_rows, pace)
        else:
            out, joint_out = _outputs(q, joint)
            jq, jk, jv = joint if joint is not None else (None, None, None)
            _ulysses_attention_op(q, k, v, out, jq, jk, jv, joint_out, group_name, impl, causal, softmax_scale,
                                  seq_len, None if shard_rows is None else list(shard_rows), refusal, pace)
    else:  # checks and the agreement of this call (requires_grad included) with every rank
        problem, joint = resolve(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size=P,
                                 rank=rank, group=group, group_name=group_name, pace=pace, grad=grad)
        if grad:
            from fa_a2a.engine.backward import attention_with_grad

            out, joint_out = attention_with_grad(problem, q, k, v, joint, group, rank)
        else:
            out, joint_out = forward(problem, q, k, v, joint, group, rank)
    return _result(out, joint_out, given_joint)


@traced_refusals(_emulated_stand_ins)
def ulysses_attention_emulated(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    impl: str = "auto",
    joint: Optional[Sequence[torch.Tensor]] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seq_len: Optional[int] = None,
    shard_rows: Optional[Sequence[int]] = None,
    pace="auto",
):
    """One process plays all P ranks: lists of P shards (as ulysses_attention takes) -> P outputs.

    Windows are P slices of one local buffer (ulysses.transport.EmulatedTransport); the kernels
    and barriers are the real ones. impl: "auto" (default; its candidates fused TMA / st and
    serial), "fused", "fused:tma", "fused:st", "serial" or "reference". pace: as
    ulysses_attention's (the emulated ranks' attentions run in turn, each alone on the link).
    Returns the list of outputs, or (list, list of P joint outputs) with joint.
    Differentiable eagerly, as ulysses_attention (the one joint tuple gets the full gradient);
    under torch.compile inputs that require grad are refused.
    """
    given_joint = joint is not None
    problem, joint = resolve_emulated(qs, ks, vs, joint, impl, causal, softmax_scale, seq_len, shard_rows, pace)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*qs, *ks, *vs, *(joint or ())))
    if grad and torch.compiler.is_compiling():
        raise ValueError("qs: inputs that require grad: emulated ranks are differentiable eagerly only, call "
                         "ulysses_attention_emulated outside torch.compile or under torch.no_grad()")
    if grad:
        from fa_a2a.engine.backward import attention_emulated_with_grad

        outs, joint_outs = attention_emulated_with_grad(problem, qs, ks, vs, joint)
    elif torch.compiler.is_compiling():
        pairs = [_outputs(q, joint) for q in qs]
        outs, joint_outs = [o for o, _ in pairs], [j for _, j in pairs if j is not None]
        _ulysses_attention_emulated_op(list(qs), list(ks), list(vs), outs, list(joint or ()), joint_outs, impl,
                                       causal, problem.softmax_scale, seq_len,
                                       None if shard_rows is None else list(shard_rows), encode_pace(problem.pace))
    else:
        outs, joint_outs = forward_emulated(problem, qs, ks, vs, joint)
    if not given_joint:
        return outs
    if not joint_outs:  # joint with J = 0 rows
        joint_outs = [_result(o, None, True)[1] for o in outs]
    return outs, joint_outs


def _check_out_proj(weight, bias, q) -> None:
    check_tensor(q, "q")
    HD = q.shape[2] * q.shape[3]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != HD:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"out_weight: expected a [C_out, H * D = {HD}] tensor (nn.Linear's weight), got {got}")
    if weight.dtype != q.dtype or weight.device != q.device:
        raise ValueError(f"out_weight: expected q's {q.dtype} on {q.device}, got {weight.dtype} on {weight.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)
                             or bias.dtype != q.dtype or bias.device != q.device):
        got = (f"{tuple(bias.shape)} {bias.dtype} on {bias.device}" if isinstance(bias, torch.Tensor)
               else type(bias).__name__)
        raise ValueError(f"out_bias: expected None or a [{weight.shape[0]}] {q.dtype} tensor on {q.device}, got {got}")


def ulysses_attention_out_proj(q, k, v, out_weight, out_bias=None, *, group=None, impl: str = "auto",
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               seq_len: Optional[int] = None, shard_rows: Optional[Sequence[int]] = None, pace="auto"):
    """ulysses_attention followed by the attention block's output projection: this rank's rows
    out.flatten(2) @ out_weight^T + out_bias -> [B, S_loc, C_out] (out_weight [C_out, H * D], nn.Linear's
    weight; no joint rows). The same values as the two in torch; the difference is the backward:
    with inputs that require grad and the fused backward (impl "fused", or "auto" deciding it), dO's
    sequence -> heads A2A is the epilogue of the projection's input-gradient GEMM (dO = dY @ out_weight,
    stored straight into the ranks' dO windows) in place of the pre-A2A kernel on dO
    (fa_a2a.engine.backward._FusedRank.project_dout). out_weight's and out_bias's gradients are this
    rank's rows' part, as nn.Linear on sharded rows gives them. Under torch.compile, or when q, k, v
    need no grad, it is ulysses_attention then torch's linear."""
    import torch.nn.functional as F

    try:
        _check_out_proj(out_weight, out_bias, q)
    except ValueError as e:
        refuse_on_every_rank(e, group)
    kw = dict(impl=impl, causal=causal, softmax_scale=softmax_scale, seq_len=seq_len, shard_rows=shard_rows, pace=pace)
    if not wants_grad(q, k, v) or torch.compiler.is_compiling():
        return F.linear(ulysses_attention(q, k, v, group=group, **kw).flatten(2), out_weight, out_bias)
    from fa_a2a.engine.backward import projected_with_grad

    group, group_name, P, rank = group_facts(group)
    problem, _ = resolve(q, k, v, None, impl, causal, softmax_scale, seq_len, shard_rows, world_size=P, rank=rank,
                         group=group, group_name=group_name, pace=pace, grad=True)
    return projected_with_grad(problem, [q], [k], [v], out_weight, out_bias, group, rank)[0]


def ulysses_attention_out_proj_emulated(qs, ks, vs, out_weight, out_bias=None, *, impl: str = "auto",
                                        causal: bool = False, softmax_scale: Optional[float] = None,
                                        seq_len: Optional[int] = None, shard_rows: Optional[Sequence[int]] = None,
                                        pace="auto") -> list:
    """ulysses_attention_out_proj for P emulated ranks in one process (as ulysses_attention_emulated takes
    them) -> P outputs [B, rows, C_out]; the weight's and bias's gradients summed over the P ranks' rows."""
    import torch.nn.functional as F

    if not isinstance(qs, (list, tuple)) or not qs:
        raise ValueError(f"qs: expected a non-empty list of per-rank tensors, got {type(qs).__name__}")
    _check_out_proj(out_weight, out_bias, qs[0])
    kw = dict(impl=impl, causal=causal, softmax_scale=softmax_scale, seq_len=seq_len, shard_rows=shard_rows, pace=pace)
    if torch.compiler.is_compiling():
        return [F.linear(o.flatten(2), out_weight, out_bias) for o in ulysses_attention_emulated(qs, ks, vs, **kw)]
    problem, _ = resolve_emulated(qs, ks, vs, None, impl, causal, softmax_scale, seq_len, shard_rows, pace)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (*qs, *ks, *vs))):
        return [F.linear(o.flatten(2), out_weight, out_bias) for o in ulysses_attention_emulated(qs, ks, vs, **kw)]
    from fa_a2a.engine.backward import projected_with_grad

    return projected_with_grad(problem, qs, ks, vs, out_weight, out_bias, None, None)


def post_a2a(o: torch.Tensor, out_windows: torch.Tensor, rank: int, *, broadcast: bool = False) -> None:
    """Post-attention A2A kernel alone: stores only (a barrier makes them visible to peers).

    o [B, P*S_loc, H_loc, D] (this rank's heads, all rows) -> out_windows [P, B, S_loc, H, D]:
    out_windows[s // S_loc][b, s % S_loc, rank*H_loc + h] = o[b, s, h] (H >= P*H_loc).
    broadcast=True (joint rows): o [B, J, H_loc, D] -> out_windows[d][b, t, rank*H_loc + h] for all d.
    """
    if not isinstance(broadcast, bool):
        raise ValueError(f"broadcast: expected a bool, got {broadcast!r}")
    check_tensor(o, "o")
    check_tensor(out_windows, "out_windows", 5)
    P, B, rows, H, D = out_windows.shape
    if o.dtype != out_windows.dtype or o.dtype not in KERNEL_DTYPES:
        raise ValueError(f"o: expected bfloat16/float16 equal to out_windows' {out_windows.dtype}, got {o.dtype}")
    if o.device != out_windows.device or not o.is_cuda:
        raise ValueError(f"o: expected a CUDA tensor on out_windows' device {out_windows.device}, got {o.device}")
    check_rank(rank, P)
    H_loc = o.shape[2]
    expect_rows = rows if broadcast else P * rows
    if o.shape[0] != B or o.shape[1] != expect_rows or o.shape[3] != D:
        raise ValueError(f"o: expected [{B}, {expect_rows}, H_loc, {D}] for out_windows {tuple(out_windows.shape)}, "
                         f"got {tuple(o.shape)}")
    if P * H_loc > H:
        raise ValueError(f"out_windows: expected at least P*H_loc = {P}*{H_loc} heads, got {H}")
    if out_windows.stride()[1:] != (rows * H * D, H * D, D, 1):
        raise ValueError(f"out_windows: expected each window out_windows[d] a contiguous [B, S_loc, H, D], "
                         f"got strides {out_windows.stride()}")
    _post_a2a_op(contiguous16(o), out_windows, rank, broadcast)


def pre_a2a(q, k, v, in_windows, rank: int, *, seq_len: Optional[int] = None, joint=None) -> None:
    """Pre-attention A2A kernel alone (q, k, v in one launch): stores only.

    q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D]; in_windows: a tensor [P, 3, B, N, H_loc, D]
    (no GQA: H_kv = H) or a tuple (dq [P, B, N, H_loc, D], dk, dv [P, B, N, H_kv_loc, D]) with
    N = S_pad + J and heads as ulysses.layout.UlyssesLayout assigns them. Writes rank `rank`'s
    rows into every rank's window (see cute_kernels/a2a_device.py for the row order).
    """
    if isinstance(in_windows, torch.Tensor):
        check_tensor(in_windows, "in_windows", 6)
        if in_windows.shape[1] != 3:
            raise ValueError(f"in_windows: expected dim 1 = 3 (q, k, v), got shape {tuple(in_windows.shape)}")
        dq, dk, dv = in_windows[:, 0], in_windows[:, 1], in_windows[:, 2]
    elif isinstance(in_windows, (tuple, list)) and len(in_windows) == 3:
        dq, dk, dv = in_windows
        for name, t in (("in_windows[0]", dq), ("in_windows[1]", dk), ("in_windows[2]", dv)):
            check_tensor(t, name, 5)
    else:
        raise ValueError(f"in_windows: expected a [P, 3, B, N, H_loc, D] tensor or a tuple (dq, dk, dv), "
                         f"got {type(in_windows).__name__}")
    P = dq.shape[0]
    problem, joint = check_call(q, k, v, joint, "serial", False, None, seq_len, P)
    layout = problem.layout
    B, D = q.shape[0], q.shape[3]
    check_rank(rank, P)
    for name, t, heads in (("in_windows (q)", dq, layout.heads_loc), ("in_windows (k)", dk, layout.kv_heads_loc),
                           ("in_windows (v)", dv, layout.kv_heads_loc)):
        if tuple(t.shape) != (P, B, layout.num_rows, heads, D):
            raise ValueError(f"{name}: expected {(P, B, layout.num_rows, heads, D)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
        if t.stride()[1:] != (layout.num_rows * heads * D, heads * D, D, 1):
            raise ValueError(f"{name}: expected each window contiguous, got strides {t.stride()}")
    q_map, kv_map = head_maps(layout, q.device)
    from cute_kernels.a2a import launch_pre_a2a

    q, k, v = (contiguous16(t) for t in (q, k, v))
    joint = tuple(contiguous16(t) for t in joint) if joint is not None else None
    launch_pre_a2a(q, k, v, dq, dk, dv, q_map, kv_map, rank, layout.seq_len,
                   (layout.valid_rows(rank), *layout.key_rows(rank)), joint)
