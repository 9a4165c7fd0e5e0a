"""Serial Ulysses reference: pre-A2A -> attention -> post-A2A, and the full-attention oracle.

Three forms of one computation, all built on ulysses.layout:
  full_attention                 one process, unsplit [B, S, H, D] tensors (the oracle).
  emulated_ulysses_attention     one process, explicit lists of P per-rank shards (no process
                                 group); emulated_pre_a2a / emulated_post_a2a are its halves, for
                                 tests that run a kernel on the head-layout tensors in between.
  ulysses_reference_attention    called by each rank of a torch.distributed group with its shard.
The emulated and distributed forms run the same local attention on the same head-layout tensors,
so their outputs are bit-identical.

The local attention is torch SDPA in fp32 (fp64 for fp64 inputs) with the padded keys dropped,
result cast back to the input dtype before the post-A2A.

Collectives: gloo (torch 2.13, CPU) supports all_to_all_single, all_to_all and all_gather; the A2As
here use all_to_all_single (also on NCCL), the joint outputs all_gather.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cute_kernels.limits import check_softmax_scale

from .layout import (UlyssesLayout, _check_rank_list, gather_heads, head_to_seq, seq_to_head,
                     take_heads)

__all__ = [
    "local_attention",
    "local_attention_backward",
    "full_attention",
    "emulated_pre_a2a",
    "emulated_post_a2a",
    "emulated_ulysses_attention",
    "dist_seq_to_head",
    "dist_head_to_seq",
    "dist_gather_heads",
    "ulysses_reference_attention",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_local(q, k, v, softmax_scale, seqused_k) -> tuple:
    """local_attention's (and its backward's) argument checks -> (scale, seqused_k or None)."""
    import operator

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [B, N, H, D] tensor")
    B, Nq, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape != v.shape:
        raise ValueError(f"k and v must be [{B}, N, Hk, {D}] and equal, got {list(k.shape)}, {list(v.shape)}")
    Nk, Hk = k.shape[1], k.shape[2]
    if Hk < 1 or D < 1 or Nk < 1 or Hq % Hk:
        raise ValueError(f"k: expected >= 1 rows, heads dividing q's {Hq} and head dim >= 1, got {list(k.shape)}")
    check_softmax_scale(softmax_scale, limit=math.inf)  # the fp64 reference: any finite scale
    if seqused_k is not None:
        try:
            used = None if isinstance(seqused_k, bool) else operator.index(seqused_k)
        except TypeError:
            used = None
        if used is None or not 1 <= used <= Nk:
            raise ValueError(f"seqused_k must be an int in [1, {Nk}], got {seqused_k!r}")
        seqused_k = used
    return (D ** -0.5 if softmax_scale is None else float(softmax_scale)), seqused_k


def local_attention(q, k, v, *, causal=False, softmax_scale=None, seqused_k=None, dtype=None):
    """softmax(q k^T * scale) v for q [B, Nq, Hq, D], k/v [B, Nk, Hk, D] with Hk dividing Hq.

    Query head j reads KV head j // (Hq // Hk). Keys >= seqused_k are masked; causal: query row i
    reads keys <= i (top-left aligned). Computed in `dtype` (default fp32, fp64 for fp64 inputs)
    and returned in that dtype.
    """
    scale, seqused_k = _check_local(q, k, v, softmax_scale, seqused_k)
    Hq, Hk = q.shape[2], k.shape[2]
    dtype = dtype or _compute_dtype(q.dtype)
    q, k, v = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v))
    if seqused_k is not None:
        # masked keys dropped, not masked: a NaN in a padding key or value row cannot leak
        k, v = k[:, :seqused_k], v[:, :seqused_k]
    if Hq != Hk:
        k, v = (x.repeat_interleave(Hq // Hk, dim=2) for x in (k, v))
    # torch SDPA in `dtype` (is_causal is top-left aligned)
    q = q.transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale)
    # SDPA's CPU kernel turns a NaN query row into zeros (torch 2.13, fewer than 8 keys): add 0 * the
    # row's sum, so that a NaN in q reaches its output row on every path (tests/cpu/test_reliability.py);
    # out of place under autograd (SDPA's backward reads its output)
    nan_rows = q.sum(-1, keepdim=True)
    o = o.add(nan_rows, alpha=0) if o.requires_grad else o.add_(nan_rows, alpha=0)
    return o.transpose(1, 2)


def local_attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, seqused_k=None, dtype=None):
    """(dq, dk, dv) of local_attention(q, k, v, ...) against its output's gradient `do` [B, Nq, Hq, D],
    in the inputs' dtypes: the probabilities recomputed in `dtype` (default fp32, fp64 for fp64
    inputs), then the softmax backward, dS = P * (dO V^T - rowsum(dO * O)). Keys >= seqused_k get
    zeros; a KV head read by several query heads gets the sum of their parts. Explicit rather than
    autograd: it also runs inside a custom op's body (fa_a2a.engine.backward), where autograd is off."""
    scale, seqused_k = _check_local(q, k, v, softmax_scale, seqused_k)
    if not isinstance(do, torch.Tensor) or do.shape != q.shape:
        raise ValueError(f"do: expected q's shape {list(q.shape)}, got {list(getattr(do, 'shape', [])) or do!r}")
    B, Nq, Hq, D = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    dtype = dtype or _compute_dtype(q.dtype)
    used = Nk if seqused_k is None else seqused_k
    qf, kf, vf, dof = (x.to(dtype).transpose(1, 2) for x in (q, k[:, :used], v[:, :used], do))  # [B, H, N, D]
    group = Hq // Hk
    if group > 1:
        kf, vf = (x.repeat_interleave(group, dim=1) for x in (kf, vf))
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:  # top-left aligned, as SDPA's is_causal
        s = s.masked_fill(~torch.ones(Nq, used, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * (p @ vf)).sum(-1, keepdim=True))
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale
    dv = p.transpose(-1, -2) @ dof
    if group > 1:
        dk, dv = (x.unflatten(1, (Hk, group)).sum(2) for x in (dk, dv))
    grads = [dq.transpose(1, 2).to(q.dtype)]
    for x, like in ((dk, k), (dv, v)):
        full = x.new_zeros(B, Hk, Nk, D)
        full[:, :, :used] = x
        grads.append(full.transpose(1, 2).to(like.dtype))
    return tuple(grads)


def _check_joint(joint, B, D, H, Hkv, dtype, device):
    if joint is None:
        return 0
    if not isinstance(joint, (tuple, list)) or len(joint) != 3:
        raise ValueError("joint must be a tuple (joint_q, joint_k, joint_v)")
    jq, jk, jv = joint
    for name, t, heads in (("joint q", jq, H), ("joint k", jk, Hkv), ("joint v", jv, Hkv)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [B, J, H, D] tensor")
        if (t.shape[0], t.shape[2], t.shape[3]) != (B, heads, D) or t.shape[1] != jq.shape[1]:
            raise ValueError(f"{name} must be [{B}, J, {heads}, {D}], got {list(t.shape)}")
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    return jq.shape[1]


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [B, S, H, D] tensor")
    B, S, H, D = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (B, S, D):
        raise ValueError(f"k and v must both be [{B}, {S}, H_kv, {D}], got {list(k.shape)} and {list(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must share dtype and device")
    return B, S, H, k.shape[2], D


def full_attention(q, k, v, *, joint=None, causal=False, softmax_scale=None, dtype=torch.float64):
    """Oracle on the unsplit sequence: q [B, S, H, D], k/v [B, S, H_kv, D], joint (q, k, v) [B, J, ., D].

    Joint rows attend to and are attended by every sequence row (MMDiT). Returns the output
    [B, S, H, D] in `dtype`, or (output, joint output [B, J, H, D]) when joint is given.
    """
    B, S, H, Hkv, D = _check_qkv(q, k, v)
    if H % Hkv:
        raise ValueError(f"k heads ({Hkv}) must divide q heads ({H})")
    J = _check_joint(joint, B, D, H, Hkv, q.dtype, q.device)
    if joint is not None:
        if causal:
            raise ValueError("causal masking with joint tokens is not defined")
        q, k, v = (torch.cat([x, j], dim=1) for x, j in zip((q, k, v), joint))
    out = local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype)
    return out if joint is None else (out[:, :S], out[:, S:S + J])


# ---- emulated ranks ---------------------------------------------------------------------------
def _shard_layout(qs, ks, vs, joint, seq_len):
    B, S_loc, H, D = _check_rank_list(qs, "qs")
    kshape = _check_rank_list(ks, "ks")
    if _check_rank_list(vs, "vs") != kshape or len(ks) != len(qs) or len(vs) != len(qs):
        raise ValueError("ks and vs must be lists of len(qs) tensors of one shape")
    if (kshape[0], kshape[1], kshape[3]) != (B, S_loc, D):
        raise ValueError(f"ks[r] must be [{B}, {S_loc}, H_kv, {D}], got {list(kshape)}")
    if ks[0].dtype != qs[0].dtype or ks[0].device != qs[0].device:
        raise ValueError("qs, ks and vs must share dtype and device")
    J = _check_joint(joint, B, D, H, kshape[2], qs[0].dtype, qs[0].device)
    return UlyssesLayout.from_shard(S_loc, H, kshape[2], len(qs), seq_len=seq_len, joint_len=J)


def emulated_pre_a2a(layout: UlyssesLayout, qs, ks, vs, joint=None):
    """Per-rank shards [B, S_loc, ., D] -> per-rank (q, k, v) in head layout [B, N, ., D].

    Rows and heads as in ulysses.layout: q rows [seq S_pad | joint J], k/v rows
    [seq S | joint J | padding], q heads layout.q_head_index[r], k/v heads layout.kv_head_index[r].
    """
    qh = seq_to_head(qs, layout.q_head_index)
    kh = seq_to_head([layout.zero_padding(k, r) for r, k in enumerate(ks)], layout.kv_head_index)
    vh = seq_to_head([layout.zero_padding(v, r) for r, v in enumerate(vs)], layout.kv_head_index)
    ranks = []
    for r in range(layout.world_size):
        jq = jk = jv = None
        if joint is not None:
            jq = layout.joint_q_heads(joint[0], r)
            jk = layout.joint_kv_heads(joint[1], r)
            jv = layout.joint_kv_heads(joint[2], r)
        ranks.append((layout.assemble_q(qh[r], jq), layout.assemble_kv(kh[r], jk),
                      layout.assemble_kv(vh[r], jv)))
    return ranks


def emulated_post_a2a(layout: UlyssesLayout, outs):
    """Per-rank head-layout outputs [B, N, H_loc, D] -> (per-rank [B, S_loc, H, D], joint [B, J, H, D] or None)."""
    if len(outs) != layout.world_size:
        raise ValueError(f"outs must hold {layout.world_size} tensors, got {len(outs)}")
    parts = [layout.split_out(o) for o in outs]
    seq = head_to_seq([p[0] for p in parts], layout.num_heads)
    joint = gather_heads([p[1] for p in parts], layout.num_heads) if layout.joint_len else None
    return seq, joint


def emulated_ulysses_attention(qs, ks, vs, *, joint=None, causal=False, softmax_scale=None,
                               seq_len=None, shard_rows=None):
    """The reference on emulated ranks: lists of P shards [B, S_loc, H(_kv), D] -> P outputs.

    seq_len: valid rows of the full sequence (default P*S_loc); rows >= seq_len of the outputs
    are padding with unspecified values. shard_rows: uneven shards instead, rank r's tensors have
    shard_rows[r] rows (and so has its output). joint: replicated (q, k, v) [B, J, H(_kv), D].
    Returns the list of outputs, or (list, joint output [B, J, H, D]) when joint is given.
    """
    if shard_rows is None:
        layout = _shard_layout(qs, ks, vs, joint, seq_len)
    else:
        J = 0 if joint is None else joint[0].shape[1]
        layout = UlyssesLayout.from_shard_rows(shard_rows, qs[0].shape[2], ks[0].shape[2], len(qs), seq_len=seq_len,
                                               joint_len=J)
        qs, ks, vs = ([layout.pad_shard(x, r) for r, x in enumerate(xs)] for xs in (qs, ks, vs))
        _shard_layout(qs, ks, vs, joint, None)  # shapes, dtypes and joint of the padded shards
    used = layout.seqused_k(causal)
    outs = [local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, seqused_k=used).to(q.dtype)
            for q, k, v in emulated_pre_a2a(layout, qs, ks, vs, joint)]
    seq, jout = emulated_post_a2a(layout, outs)
    if shard_rows is not None:
        seq = [o[:, :n] for o, n in zip(seq, layout.shard_rows)]
    return seq if joint is None else (seq, jout)


# ---- torch.distributed -----------------------------------------------------------------------
def dist_seq_to_head(x: torch.Tensor, head_index: Sequence[Sequence[int]], *, group=None) -> torch.Tensor:
    """Pre-A2A of one rank: shard [B, S_loc, H, D] -> [B, P*S_loc, h, D], heads head_index[rank].

    The distributed twin of layout.seq_to_head (entries >= H are zero heads).
    """
    P = dist.get_world_size(group)
    if x.dim() != 4:
        raise ValueError(f"x must be a 4-D [B, S_loc, H, D] tensor, got {list(x.shape)}")
    if len(head_index) != P or len({len(row) for row in head_index}) != 1:
        raise ValueError(f"head_index must hold {P} rows of equal length")
    send = torch.stack([take_heads(x, row) for row in head_index]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    B, S_loc, h, D = recv.shape[1:]
    return recv.transpose(0, 1).reshape(B, P * S_loc, h, D)


def dist_head_to_seq(y: torch.Tensor, *, group=None, num_heads: int | None = None,
                     buffers=None) -> torch.Tensor:
    """Post-A2A of one rank: [B, S_pad, H_loc, D] -> [B, S_loc, num_heads, D] (twin of layout.head_to_seq).

    Permute, all_to_all_single, permute: the post-A2A as yunchang/xDiT run it. buffers: optional
    preallocated (send, recv [P, B, S_loc, H_loc, D], out [B, S_loc, P*H_loc, D]) so the call
    allocates nothing (CUDA-graph capture); out is returned (all P*H_loc heads)."""
    P = dist.get_world_size(group)
    if y.dim() != 4 or y.shape[1] % P:
        raise ValueError(f"y must be [B, S_pad, H_loc, D] with S_pad a multiple of {P}, got {list(y.shape)}")
    B, S_pad, H_loc, D = y.shape
    num_heads = P * H_loc if num_heads is None else num_heads
    if not 1 <= num_heads <= P * H_loc:
        raise ValueError(f"num_heads must be in [1, {P * H_loc}], got {num_heads}")
    per_rank = y.view(B, P, S_pad // P, H_loc, D).transpose(0, 1)
    if buffers is None:
        send = per_rank.contiguous()
        recv = torch.empty_like(send)
    else:
        send, recv, out = buffers
        send.copy_(per_rank)
    dist.all_to_all_single(recv, send, group=group)
    if buffers is None:
        return recv.permute(1, 2, 0, 3, 4).reshape(B, S_pad // P, P * H_loc, D)[:, :, :num_heads]
    out.view(B, S_pad // P, P, H_loc, D).copy_(recv.permute(1, 2, 0, 3, 4))
    return out


def dist_gather_heads(y: torch.Tensor, *, group=None, num_heads: int | None = None) -> torch.Tensor:
    """All-gather over heads (joint outputs): [B, J, H_loc, D] -> [B, J, num_heads, D] on every rank."""
    P = dist.get_world_size(group)
    parts = [torch.empty_like(y) for _ in range(P)]
    dist.all_gather(parts, y.contiguous(), group=group)
    return gather_heads(parts, num_heads)


def ulysses_reference_attention(q, k, v, *, group=None, joint=None, causal=False, softmax_scale=None,
                                seq_len=None, shard_rows=None, attention=None):
    """Serial Ulysses attention called by every rank of `group` with its shard.

    q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D]: rows [rank*S_loc, (rank+1)*S_loc) of the full
    sequence; seq_len = valid rows of the full sequence (default P*S_loc; the padding rows of the
    last shards are masked as keys, and their outputs are unspecified). joint: (q, k, v)
    [B, J, H(_kv), D], the same on every rank. Returns [B, S_loc, H, D] in q's dtype, or
    (that, joint output [B, J, H, D]) when joint is given. attention: the local attention,
    attention(q, k, v, causal=, softmax_scale=, seqused_k=) (default: local_attention in fp32); the
    NCCL baseline of fa_a2a.op passes FA4. shard_rows: uneven shards instead of seq_len, the same
    list on every rank; rank r passes (and gets back) shard_rows[r] rows.
    """
    B, S_loc, H, Hkv, D = _check_qkv(q, k, v)
    J = _check_joint(joint, B, D, H, Hkv, q.dtype, q.device)
    P = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if shard_rows is None:
        layout = UlyssesLayout.from_shard(S_loc, H, Hkv, P, seq_len=seq_len, joint_len=J)
    else:
        layout = UlyssesLayout.from_shard_rows(shard_rows, H, Hkv, P, seq_len=seq_len, joint_len=J)
        q, k, v = (layout.pad_shard(x, rank) for x in (q, k, v))
    used = layout.seqused_k(causal)
    qh = dist_seq_to_head(q, layout.q_head_index, group=group)
    kh = dist_seq_to_head(layout.zero_padding(k, rank), layout.kv_head_index, group=group)
    vh = dist_seq_to_head(layout.zero_padding(v, rank), layout.kv_head_index, group=group)
    jq = jk = jv = None
    if joint is not None:
        jq = layout.joint_q_heads(joint[0], rank)
        jk, jv = (layout.joint_kv_heads(t, rank) for t in joint[1:])
    attention = attention or local_attention
    out = attention(layout.assemble_q(qh, jq), layout.assemble_kv(kh, jk), layout.assemble_kv(vh, jv),
                    causal=causal, softmax_scale=softmax_scale, seqused_k=used).to(q.dtype)
    out_seq, out_joint = layout.split_out(out)
    out = dist_head_to_seq(out_seq, group=group, num_heads=H)[:, :S_loc]
    if joint is None:
        return out
    return out, dist_gather_heads(out_joint.contiguous(), group=group, num_heads=H)
