"""Ulysses attention from the hidden states: both All-to-Alls inside the two compute kernels.

One rank r of P holds x [B, S_loc, C] (its rows of the sequence, every channel). The block runs

    QKV projection (+ bias, per-head RMSNorm of q and k, interleaved RoPE of q and k), whose GEMM
    epilogue stores each output tile into the destination rank's in-window (the pre-A2A;
    cute_kernels/qkv_a2a_sm90.py)  ->  barrier  ->  FA4 whose epilogue stores each O tile into
    the destination rank's out-window (the post-A2A; plan.attend, impl "fused")  ->  barrier
    ->  out [B, S_loc, H, D] (this rank's rows, every head)

on the window plan of fa_a2a.engine.forward (the op's own windows, head maps and barriers), so the
attention half is exactly the op's. The projection weights are QKVWeights gathered for the
layout's head map (head padding, GQA replication; `block_weights`).

Rows (ulysses/layout.py): q rows of rank r go to [r*S_loc, (r+1)*S_loc) of every q window; k/v
rows to the key order: the valid rows compacted at key_rows(r)[0], the padding rows of an uneven S
at key_rows(r)[1] (after the joint rows). Where the two differ the projection runs as separate
launches for q and for k|v (segment_writes). The rows of x past the rank's valid rows are never
read: its padding rows are projected from zero rows (their k/v are masked keys, but 0 * NaN = NaN
would still reach P @ V).
Segments: a rank's rows may come as consecutive row ranges with their own weights and rotary
(Segment): Flux under diffusers' context parallelism shards its text rows too, and each rank
holds [text shard (add_q/k/v_proj, norm_added_q/k); image shard (to_q/k/v, norm_q/k)]. Each
segment's launches write at its row offset inside the rank's rows (q at r*S_loc + offset, k/v at
key_rows(r)[0] + offset); to the attention they are one sequence (fa_a2a.models.flux).
Joint (text) rows, replicated on every rank, with their own weights (Flux's double-stream
add_q/k/v_proj; the same weights for its single-stream blocks): rank r projects them with its own
heads' weights (QKVWeights.rank_slice) into its own window only, q at S_pad and k/v at S;
FA4 and the broadcast post-A2A of the op then return the joint outputs of every head to every rank.

Fallback (not fused): a q/k RMSNorm over all heads of a row (Wan's rms_norm_across_heads) needs the
whole row, which one output tile (one head) does not see. UlyssesQKVAttention then runs the torch
chain (Linear -> RMSNorm -> RoPE, `TorchQKV`) and the attention-only fused op (fa_a2a.op).

Measured (one H200, 2026-12-03, Flux shapes C = 3072, H = 24, D = 128, bf16, emulated P = 8, one
source rank's work, CUDA-graph medians; python -m fa_a2a.bench_block): the block (config_for tiles,
one_launch) takes 118.4 / 268.2 / 2377.4 us at S_loc = 576 / 1024 / 4096 against 252.0 / 484.9 /
3264.6 for the eager torch chain -> pre-A2A kernel -> FA4 -> post-A2A kernel (0.47 / 0.55 / 0.73)
and 176.6 / 373.5 / 2836.8 with that chain under torch.compile (0.67 / 0.72 / 0.84). At 1024 and
4096 the two-launch default (block-fused) was faster: 261.9 / 2316.3 us.

Argument checks: the attention facts through fa_a2a.engine.problem (check_call on stand-in q/k/v of the
block's shapes, agreed across ranks), the block's own (x, weights, rotary) before the agreement, so
a bad argument on one rank makes every rank raise the same ValueError; x and joint whose elements
share memory are refused every call (their strides are not in the signature). FA_A2A_CHECK_JOINT=1
adds a checksum of the joint rows to the agreement, as the op's. After the agreement a rank's
call runs on what was prepared for its signature (fa_a2a.engine.projection._RankBlock around the op's
fa_a2a.engine.forward.RankCall): transport, window plan, bound attention launch and the projection's
routing and bound launches (fa_a2a.engine.projection._Projection over
cute_kernels.qkv_a2a_sm90.qkv_a2a_launcher).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from cute_kernels.limits import EPS

from fa_a2a.op import traced_refusals
from fa_a2a.engine.problem import (BLOCK_IMPLS, check_call, check_no_overlap, check_tensor, checked_and_agreed, lookup,
                                   joint_check, refuse_on_every_rank, remember, signature_fields, signature_word,
                                   split_impl)
from fa_a2a.engine.projection import _emulated_blocks, _rank_block, _rope_source, segment_writes

__all__ = ["TorchQKV", "block_weights", "ulysses_qkv_attention", "ulysses_qkv_attention_emulated",
           "UlyssesQKVAttention", "rope_table", "rotary_pair", "Segment", "segment_writes"]


# ---- the torch chain: the unfused projection (fallback, baseline, reference) ----------------------
@dataclasses.dataclass(frozen=True)
class TorchQKV:
    """Projection weights in nn.Linear form: weight [(H + 2*H_kv)*D, C] = [W_q; W_k; W_v] (global
    head order), bias or None; q_norm / k_norm: RMSNorm weights [D] (per head) or [H*D] / [H_kv*D]
    (across_heads, Wan), or None."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    across_heads: bool = False
    eps: float = EPS

    def __call__(self, x: torch.Tensor, rope_cs: Optional[torch.Tensor] = None, dtype=None):
        """Linear -> RMSNorm (q, k) -> interleaved RoPE (q, k) -> q [B, S, H, D], k, v [B, S, H_kv, D].
        Computed in `dtype` (default x's; each step rounded to it, norm and RoPE in fp32 inside as
        diffusers does); float32 gives the reference."""
        dtype = dtype or x.dtype
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        y = torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype),
                                       None if self.bias is None else self.bias.to(dtype))
        q, k, v = y.split([H * D, Hk * D, Hk * D], dim=-1)
        if self.q_norm is not None:
            if self.across_heads:
                q, k = (torch.nn.functional.rms_norm(t.float(), (t.shape[-1],), w.float(), self.eps).to(dtype)
                        for t, w in ((q, self.q_norm), (k, self.k_norm)))
        q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (Hk, D)), v.unflatten(-1, (Hk, D))
        if self.q_norm is not None and not self.across_heads:
            q, k = (torch.nn.functional.rms_norm(t.float(), (D,), w.float(), self.eps).to(dtype)
                    for t, w in ((q, self.q_norm), (k, self.k_norm)))
        if rope_cs is not None:
            q, k = apply_rope(q, rope_cs), apply_rope(k, rope_cs)
        return q, k, v


def apply_rope(x: torch.Tensor, rope_cs: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of x [B, S, h, D] with the table rope_cs [S, D] (cos, sin pairs), in fp32."""
    c, s = rope_cs[:, None, 0::2], rope_cs[:, None, 1::2]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)


def rotary_pair(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple:
    """diffusers' RoPE (cos, sin) pair of these positions, fp32 [rows, head_dim], each frequency
    theta^(-i / (D/2)) twice in a row (interleaved): a DiT's `rotary` of those rows (the benchmarks'
    and examples' one home of it)."""
    freqs = theta ** (-torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32) / (head_dim // 2))
    ang = positions.to(torch.float32)[:, None] * freqs[None]
    return ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)


def rope_table(rotary, rows: int, head_dim: int, device, name: str = "rotary") -> Optional[torch.Tensor]:
    """rotary -> the kernel's fp32 [rows, D] table: None, the table itself, or diffusers' (cos, sin)
    pair [rows, D] (each frequency repeated for the adjacent pair) converted into a new table."""
    from cute_kernels.qkv_a2a_sm90 import interleaved_cos_sin

    src = _rope_source(rotary, rows, head_dim, device, name)
    return interleaved_cos_sin(*src) if isinstance(src, tuple) else src


# ---- weights -------------------------------------------------------------------------------------
def _layout_heads(num_heads: int, num_kv_heads: int, world_size: int):
    from ulysses.layout import UlyssesLayout

    lay = UlyssesLayout(world_size, num_heads, num_kv_heads, world_size)  # head maps do not depend on S
    return lay.q_head_index, lay.kv_head_index


def block_weights(chain: TorchQKV, world_size: int):
    """chain's weights gathered in destination order for P = world_size ranks (the layout's head
    map: padding heads, GQA replication), as the fused projection takes them."""
    if chain.across_heads:
        raise ValueError("chain: per-head q/k norms expected (an RMSNorm across heads cannot be fused), "
                         "got across_heads=True")
    H, Hk, D = chain.num_heads, chain.num_kv_heads, chain.head_dim
    b = (None,) * 3 if chain.bias is None else chain.bias.split([H * D, Hk * D, Hk * D])
    return _gather_weights(chain.weight.split([H * D, Hk * D, Hk * D]), b, chain.q_norm, chain.k_norm, D, world_size)


def _gather_weights(w, b, q_norm, k_norm, D: int, world_size: int):
    """(W_q, W_k, W_v), (b_q, b_k, b_v) or Nones in nn.Linear form -> QKVWeights in destination
    order for world_size ranks (the layout's head map)."""
    from cute_kernels.qkv_a2a_sm90 import QKVWeights

    qi, ki = _layout_heads(w[0].shape[0] // D, w[1].shape[0] // D, world_size)
    return QKVWeights.from_linear(*w, head_dim=D, world_size=world_size, bq=b[0], bk=b[1], bv=b[2],
                                  q_norm_weight=q_norm, k_norm_weight=k_norm, q_head_index=qi, kv_head_index=ki)


def _share_weights(proj, layers: Sequence[nn.Linear], names: Sequence[str]) -> None:
    """Point the weights and biases of layers (q, k, v nn.Linear, proj gathered from them) at their
    rows of proj, so that the layers and the fused projection hold one copy: the layers compute as
    before (the same values; their Parameter objects stay). Each of q/k/v's heads must lie in order
    at the start of its destination block: padding heads at the end are fine, GQA replication of
    KV heads is not (ValueError, nothing changed)."""
    H, Hk, q_index, kv_index = proj.head_map
    rows = []
    for t, (layer, name, heads, index) in enumerate(zip(layers, names, (H, Hk, Hk), (q_index, kv_index, kv_index))):
        if [h for r in index for h in r][:heads] != list(range(heads)):
            raise ValueError(f"share_weights: expected {name}'s heads in order at the start of its destination "
                             f"block (no GQA replication), got the head map {index}")
        w = layer.weight
        if (not isinstance(w, nn.Parameter) or w.shape != (heads * proj.head_dim, proj.weight.shape[1])
                or w.dtype != proj.weight.dtype or w.device != proj.weight.device):
            raise ValueError(f"{name}: expected an nn.Parameter weight [{heads * proj.head_dim}, "
                             f"{proj.weight.shape[1]}] {proj.weight.dtype} on {proj.weight.device} (the one "
                             f"proj was gathered from), got {type(w).__name__} {tuple(w.shape)} {w.dtype} on {w.device}")
        lo = proj.column_range(t)[0]
        rows.append(slice(lo, lo + heads * proj.head_dim))
    for layer, r in zip(layers, rows):
        layer.weight.data = proj.weight[r]
        if layer.bias is not None and proj.bias is not None and proj.bias.dtype == layer.bias.dtype:
            layer.bias.data = proj.bias[r]


# ---- checks --------------------------------------------------------------------------------------
def _check_x(x, name: str, proj) -> None:
    from cute_kernels.qkv_a2a_sm90 import QKVWeights

    check_tensor(x, name, 3)
    if not isinstance(proj, QKVWeights):
        raise ValueError(f"proj: expected a QKVWeights (fa_a2a.block.block_weights), got {type(proj).__name__}")
    w = proj.weight
    if x.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor (SM90), got device {x.device}")
    if x.device != w.device or x.dtype != w.dtype:
        raise ValueError(f"{name}: expected the weights' {w.dtype} on {w.device}, got {x.dtype} on {x.device}")
    if x.shape[2] != w.shape[1]:
        raise ValueError(f"{name}: expected C = {w.shape[1]} channels (the weights'), got {x.shape[2]}")
    if x.shape[0] < 1:
        raise ValueError(f"{name}: expected [B >= 1, rows, C], got {tuple(x.shape)}")


def _check_proj(proj, name: str, layout, world_size: int) -> None:
    want = (layout.num_heads, layout.num_kv_heads, layout.q_head_index, layout.kv_head_index)
    if proj.world_size != world_size or proj.head_map != want:
        got = "no head map" if proj.head_map is None else f"H = {proj.head_map[0]}, H_kv = {proj.head_map[1]}"
        raise ValueError(f"{name}: expected weights gathered for P = {world_size} ranks, H = {want[0]}, H_kv = "
                         f"{want[1]} (block_weights(chain, {world_size})), got world_size={proj.world_size}, {got}")


def _check_no_grad(projs, names, joint, joint_proj) -> None:
    """Under grad mode, refuse weights that require grad (projs: the QKVWeights of the rank's segments,
    names(): their names, built only for the refusal; joint_proj with joint rows): the block's weights
    are copies gathered in destination order (block_weights), a gradient there would never reach the
    model's layers; never cut autograd silently. (Hidden states and joint rows that require grad take
    _attention_with_grad.)"""
    if not torch.is_grad_enabled():
        return
    projs = list(projs) + ([joint_proj] if joint is not None and joint_proj is not None else [])
    for i, p in enumerate(projs):
        for field in ("weight", "bias", "norm_weight"):
            t = getattr(p, field, None)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                n = (list(names()) + ["joint_proj"])[i]
                raise ValueError(f"{n}.{field}: requires grad, but the block's weights are fixed copies in "
                                 "destination order (block_weights): pass detached weights, and train the model's "
                                 "own layers (diffusers' processor with fa_a2a.ulysses_attention, differentiable: "
                                 "the fused processors route there when weights require grad)")


def _proj_names(names) -> list:
    """The proj names of segments whose x names are `names` (x -> proj, x[i].x -> x[i].proj)."""
    return [n[:-2] + ".proj" if n.endswith(".x") else "proj" for n in names]


def _inputs_want_grad(xs, joint) -> bool:
    """Grad mode on and a hidden-state tensor (xs: tensors or Segment lists) or the joint rows requiring grad."""
    if not torch.is_grad_enabled():
        return False
    for x in xs:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                return True
        elif isinstance(x, (list, tuple)) and any(getattr(getattr(s, "x", None), "requires_grad", False) for s in x):
            return True
    return bool(getattr(joint, "requires_grad", False))


def _out_weights(out_proj, joint):
    """out_proj as (weight [C_out, H * D], bias or None): an nn.Linear or a (weight, bias) pair; None for
    none. Not with joint rows (their output projection is another layer: project them yourself)."""
    if out_proj is None:
        return None
    if joint is not None:
        raise ValueError("out_proj: not with joint rows (they take another output projection: pass out_proj=None "
                         "and project the block's two outputs yourself)")
    if isinstance(out_proj, nn.Linear):
        return out_proj.weight, out_proj.bias
    if isinstance(out_proj, (tuple, list)) and len(out_proj) == 2 and isinstance(out_proj[0], torch.Tensor):
        return out_proj[0], out_proj[1]
    raise ValueError(f"out_proj: expected None, an nn.Linear or a (weight, bias) pair, got {type(out_proj).__name__}")


def _projected(out, weights):
    """The block's output [B, rows, H, D] through its output projection (torch's linear; differentiable in
    the weights and, where out is, in out), or out without one."""
    if weights is None:
        return out
    from fa_a2a.op import _check_out_proj

    _check_out_proj(*weights, out)
    return torch.nn.functional.linear(out.flatten(2), *weights)


def global_chain(proj) -> TorchQKV:
    """The projection of proj (QKVWeights with a head map) as the torch chain in global head order:
    each head's first copy of its rows (views of proj's tensors through index_select: differentiable,
    never cached), its per-head norm weights, the kernel's eps."""
    from ulysses.layout import index_tensor

    H, Hk = proj.head_map[:2]
    D = proj.head_dim
    first, nq = _first_copies(proj.head_map, D)
    rows = index_tensor(first, proj.weight.device)
    norms = (None, None) if proj.norm_weight is None else (proj.norm_weight[:D], proj.norm_weight[nq * D:(nq + 1) * D])
    return TorchQKV(proj.weight.index_select(0, rows), None if proj.bias is None else proj.bias.index_select(0, rows),
                    *norms, H, Hk, D)


@functools.lru_cache(maxsize=64)
def _first_copies(head_map: tuple, D: int) -> tuple:
    """(the destination-order rows of each global q, k, v head's first copy, q slots) of a head map:
    built once per layout, not per call."""
    H, Hk, q_index, kv_index = head_map
    q_slots, kv_slots = [h for r in q_index for h in r], [h for r in kv_index for h in r]
    nq, nk = len(q_slots), len(kv_slots)
    first = ([q_slots.index(h) for h in range(H)] + [nq + kv_slots.index(h) for h in range(Hk)]
             + [nq + nk + kv_slots.index(h) for h in range(Hk)])
    return tuple(slot * D + c for slot in first for c in range(D)), nq


def _chain_rows(x, proj, rotary, name: str, rotary_name: str) -> tuple:
    """q, k, v [B, rows, ., D] of x [B, rows, C] through global_chain(proj) with rotary (checked by name)."""
    from cute_kernels.qkv_a2a_sm90 import QKVWeights

    check_tensor(x, name, 3)
    if not isinstance(proj, QKVWeights) or proj.head_map is None:
        raise ValueError(f"{_proj_names([name])[0]}: expected a QKVWeights with a head map (block_weights), got "
                         f"{type(proj).__name__}")
    w = proj.weight
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"{name}: expected the weights' {w.dtype} on {w.device}, got {x.dtype} on {x.device}")
    return _chain_qkv(x, rotary, global_chain(proj), name, rotary_name)


def _chain_qkv(x, rotary, chain: TorchQKV, name: str = "x", rotary_name: str = "rotary") -> tuple:
    """q, k, v of x [B, rows, C] through the torch chain with rotary (x and rotary checked by name)."""
    check_tensor(x, name, 3)
    if x.shape[2] != chain.weight.shape[1]:
        raise ValueError(f"{name}: expected C = {chain.weight.shape[1]} channels, got {x.shape[2]}")
    return chain(x, rope_table(rotary, x.shape[1], chain.head_dim, x.device, rotary_name))


def _attention_with_grad(x, proj, rotary, joint, joint_proj, joint_rotary, name: str):
    """One rank's block call whose hidden states or joint rows require grad: the projection as the torch
    chain of its weights (global_chain: linear, per-head RMSNorm, RoPE, differentiable), the weights
    refused if they require grad -> (q, k, v over the rank's rows in segment order, joint (q, k, v) or
    None) for the differentiable op (fa_a2a.ulysses_attention / _emulated): correct, not fused."""
    segs, names = _as_segments(x, proj, rotary, name)
    _check_no_grad([s.proj for s in segs], lambda: _proj_names([n for n, _, _ in names]), joint, joint_proj)
    parts = [_chain_rows(s.x, s.proj, s.rotary, n, rn) for s, (n, _, rn) in zip(segs, names)]
    q, k, v = (torch.cat([part[i] for part in parts], dim=1) for i in range(3))
    jt = None
    if joint is not None:
        jt = _chain_rows(joint, joint_proj if joint_proj is not None else segs[0].proj, joint_rotary, "joint",
                         "joint_rotary")
    return (q, k, v), jt


def _world_size(group, world_size) -> int:
    """UlyssesQKVAttention's P: world_size, default the group's size (1 without a process group)."""
    from fa_a2a.engine.problem import group_facts

    from cute_kernels.limits import MAX_WORLD_SIZE

    if world_size is None:
        return group_facts(group)[2]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int or None, got {world_size!r}")
    if world_size > MAX_WORLD_SIZE:  # the transports' bound (ulysses.transport), which the op meets with its group
        raise ValueError(f"world_size: expected at most {MAX_WORLD_SIZE} ranks (the transports' bound), got "
                         f"{world_size}")
    return world_size


def _check_biases(names, layers) -> list:
    """A bias on all three q/k/v layers or on none (ValueError naming them) -> the names of those with one."""
    with_bias = [n for n, m in zip(names, layers) if m.bias is not None]
    if len(with_bias) not in (0, 3):
        raise ValueError(f"{', '.join(names[:3])}: expected a bias on all three or on none, got one on "
                         f"{', '.join(with_bias)} only")
    return with_bias


def _check_fused_dtype(name: str, dtype: torch.dtype) -> None:
    """The fused projection's weights: the kernels' dtypes (from_linear, and again when the layers change)."""
    from cute_kernels.limits import DTYPES as KERNEL_DTYPES

    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: expected bfloat16/float16 weights (the fused projection's; from_linear with "
                         f"across_heads=True runs the torch chain on others), got {dtype}")


def _check_linears(names, layers, norms, D: int, across_heads: bool) -> tuple:
    """from_linear's checks of one q/k/v group, named as the caller passed them (names: q, k, v,
    q norm, k norm) -> ((H, H_kv), (b_q, b_k, b_v) or None, (q, k norm weights) or Nones, eps)."""
    for name, m in zip(names, layers):
        if not isinstance(m, nn.Linear):
            raise ValueError(f"{name}: expected an nn.Linear, got {type(m).__name__}")
    q, k, v = layers
    w = q.weight
    if not across_heads:
        _check_fused_dtype(names[0], w.dtype)
    for name, m in zip(names[1:3], (k, v)):
        if m.weight.dtype != w.dtype or m.weight.device != w.device:
            raise ValueError(f"{name}: expected {names[0]}'s {w.dtype} on {w.device}, got {m.weight.dtype} on "
                             f"{m.weight.device}")
        if m.in_features != q.in_features:
            raise ValueError(f"{name}: expected in_features = {q.in_features} ({names[0]}'s), got {m.in_features}")
    for name, m in zip(names, layers):
        if m.in_features < 1 or m.out_features < 1:
            raise ValueError(f"{name}: expected in_features >= 1 and out_features >= head_dim = {D} (one head or "
                             f"more), got {m.in_features} and {m.out_features}")
        if m.out_features % D:
            raise ValueError(f"{name}: expected out_features a multiple of head_dim = {D}, got {m.out_features}")
    if v.out_features != k.out_features:
        raise ValueError(f"{names[2]}: expected out_features = {k.out_features} ({names[1]}'s), got {v.out_features}")
    H, Hk = q.out_features // D, k.out_features // D
    if H % Hk:
        raise ValueError(f"{names[1]}: expected a head count (out_features / head_dim) dividing {names[0]}'s {H}, "
                         f"got {Hk}")
    with_bias = _check_biases(names, layers)
    for name, m in zip(names, layers):
        if m.bias is not None and (m.bias.dtype != w.dtype or m.bias.device != w.device):
            raise ValueError(f"{name}: expected its bias in {w.dtype} on {w.device}, got {m.bias.dtype} on "
                             f"{m.bias.device}")
    bias = tuple(m.bias.detach() for m in layers) if with_bias else None
    nq_name, nk_name = names[3:]
    if (norms[0] is None) != (norms[1] is None):
        raise ValueError(f"{nq_name}, {nk_name}: both or neither expected")
    if norms[0] is None:
        return (H, Hk), bias, (None, None), EPS
    weights, eps = [], []
    for name, n, heads in ((nq_name, norms[0], H), (nk_name, norms[1], Hk)):
        if isinstance(n, nn.Module) and not is_rms_norm(n):
            raise ValueError(f"{name}: expected an RMSNorm (torch's, or diffusers' without bias) or its weight tensor, "
                             f"got {type(n).__name__}: the projection computes RMSNorm only (models with other q/k "
                             "norms: diffusers' processor with the attention backend, as enable_fused_projection "
                             "routes them)")
        t = n.weight if isinstance(n, nn.Module) else n
        size = heads * D if across_heads else D
        if isinstance(n, nn.Module) and t is None:
            raise ValueError(f"{name}: expected an RMSNorm with a weight, got one without (elementwise_affine=False); "
                             f"pass a weight tensor of ones [{size}] instead")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (size,) or t.device != w.device:
            got = f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected an RMSNorm or a weight tensor, [{size}] on {w.device} ("
                             f"{'across heads' if across_heads else 'per head'}), got {got}")
        e = getattr(n, "eps", EPS) if isinstance(n, nn.Module) else EPS
        if not across_heads and e != EPS:
            raise ValueError(f"{name}: expected eps {EPS} (the fused epilogue's), got {e}")
        weights.append(t.detach())
        eps.append(e)
    if eps[0] != eps[1]:
        raise ValueError(f"{nk_name}: expected {nq_name}'s eps {eps[0]}, got {eps[1]}")
    return (H, Hk), bias, tuple(weights), eps[0]


def is_rms_norm(n) -> bool:
    """Whether module n is an RMSNorm the projection's epilogue computes (its weight and eps checked
    apart): torch's nn.RMSNorm, or diffusers' RMSNorm without bias (diffusers is not imported here)."""
    if isinstance(n, nn.RMSNorm):
        return True
    cls = type(n)
    return cls.__name__ == "RMSNorm" and cls.__module__.startswith("diffusers.") and getattr(n, "bias", None) is None


def _stand_in(x: torch.Tensor, rows: int, heads: int, D: int) -> torch.Tensor:
    """A [B, rows, heads, D] tensor of x's dtype and device for problem.check_call (D elements)."""
    return x.new_empty(1, 1, 1, D).expand(x.shape[0], rows, heads, D)


# ---- segments: a rank's rows with their own weights --------------------------------------------------
class Segment(NamedTuple):
    """Consecutive rows of one rank's shard with their own projection: x [B, rows, C] (its own C),
    proj (QKVWeights gathered for the group's P), rotary of these rows ((cos, sin) [rows, D], the
    fp32 table, or None). Flux under diffusers' context parallelism: [text shard (add_q/k/v_proj,
    norm_added_q/k); image shard (to_q/k/v, norm_q/k)]."""

    x: torch.Tensor
    proj: object
    rotary: object = None


def _as_segments(x, proj, rotary, name: str) -> tuple:
    """x [B, rows, C] with proj and rotary, or a sequence of Segment (proj, rotary None) -> (segments,
    their (x, proj, rotary) argument names)."""
    if isinstance(x, torch.Tensor):
        return (Segment(x, proj, rotary),), ((name, "proj", "rotary"),)
    if not isinstance(x, (list, tuple)) or not x or not all(isinstance(s, Segment) for s in x):
        raise ValueError(f"{name}: expected a [B, rows, C] tensor or a non-empty list of Segment, got "
                         f"{type(x).__name__}")
    for arg, value in (("proj", proj), ("rotary", rotary)):
        if value is not None:
            raise ValueError(f"{arg}: expected None with segments (each Segment has its own proj and rotary), "
                             f"got {type(value).__name__}")
    return tuple(x), _segment_names(name, len(x))


@functools.lru_cache(maxsize=64)
def _segment_names(name: str, n: int) -> tuple:
    """The (x, proj, rotary) argument names of n segments of argument `name` (error messages)."""
    return tuple((f"{name}[{i}].x", f"{name}[{i}].proj", f"{name}[{i}].rotary") for i in range(n))


def _check_block_args(impl, joint, joint_proj, joint_rotary, config, one_launch) -> None:
    """A block call's arguments that every path checks alike (the fused projection, and the torch chain
    of hidden states that require grad, where config / one_launch do not apply): a call accepted in
    training must not be refused at inference."""
    from cute_kernels.qkv_a2a_sm90 import GemmConfig

    split_impl(impl, BLOCK_IMPLS)
    if joint is None and (joint_proj is not None or joint_rotary is not None):
        raise ValueError("joint: expected the joint rows x with joint_proj / joint_rotary, got None")
    if not (config is None or (isinstance(config, str) and config == "auto") or isinstance(config, GemmConfig)):
        raise ValueError(f"config: expected 'auto', None or a GemmConfig, got {config!r}")
    if not isinstance(one_launch, bool):
        raise ValueError(f"one_launch: expected a bool, got {one_launch!r}")


def _check_rank_call(x, proj, rotary, joint, joint_proj, joint_rotary, impl, causal, softmax_scale, seq_len,
                     shard_rows, P: int, rank: int, name: str = "x", pace=None):
    """Every local check of rank `rank`'s block call -> its Problem (the rotaries checked as
    rope_table checks them, not converted)."""
    segs, names = _as_segments(x, proj, rotary, name)
    for s, (xn, pn, _) in zip(segs, names):
        _check_x(s.x, xn, s.proj)
        if s.proj.head_map is None:
            raise ValueError(f"{pn}: expected weights with a head map (block_weights or QKVWeights.from_linear), "
                             "got a QKVWeights built directly")
    x0, p0 = segs[0].x, segs[0].proj
    for s, (xn, pn, _) in zip(segs[1:], names[1:]):
        if s.x.shape[0] != x0.shape[0] or s.x.dtype != x0.dtype or s.x.device != x0.device:
            raise ValueError(f"{xn}: expected [{x0.shape[0]}, rows, C] {x0.dtype} on {x0.device} like {names[0][0]}, "
                             f"got {tuple(s.x.shape)} {s.x.dtype} on {s.x.device}")
    D, (H, Hk) = p0.head_dim, p0.head_map[:2]
    jq = None
    if joint is not None:
        if joint_proj is None:
            joint_proj = p0
        _check_x(joint, "joint", joint_proj)
        if joint.shape[0] != x0.shape[0] or joint.dtype != x0.dtype:
            raise ValueError(f"joint: expected [{x0.shape[0]}, J, C] {x0.dtype} like x, got {tuple(joint.shape)} "
                             f"{joint.dtype}")
        J = joint.shape[1]
        jq = (_stand_in(joint, J, H, D), _stand_in(joint, J, Hk, D), _stand_in(joint, J, Hk, D))
    rows = sum(s.x.shape[1] for s in segs)
    if shard_rows is not None and isinstance(shard_rows, (list, tuple)) and len(shard_rows) == P \
            and isinstance(shard_rows[rank], int) and rows != shard_rows[rank]:
        raise ValueError(f"{name}: expected shard_rows[{rank}] = {shard_rows[rank]} rows on rank {rank}, got {rows}")
    problem, _ = check_call(_stand_in(x0, rows, H, D), _stand_in(x0, rows, Hk, D), _stand_in(x0, rows, Hk, D), jq,
                            impl, causal, softmax_scale, seq_len, P, shard_rows, rank, pace, stand_ins=True)
    lay = problem.layout
    for s, (_, pn, _) in zip(segs, names):
        _check_proj(s.proj, pn, lay, P)
    if joint is not None:
        _check_proj(joint_proj, "joint_proj", lay, P)
    ropes = tuple(_rope_source(s.rotary, s.x.shape[1], D, x0.device, rn) for s, (_, _, rn) in zip(segs, names))
    if len({r is None for r in ropes}) > 1:
        raise ValueError(f"{names[0][2]}: expected a rotary on every segment or on none (one epilogue for the "
                         f"rank's rows), got {['set' if r is not None else None for r in ropes]}")
    jrope = _rope_source(joint_rotary, joint.shape[1], D, x0.device, "joint_rotary") if joint is not None else None
    if joint is not None and (ropes[0] is None) != (jrope is None):
        raise ValueError("joint_rotary: expected a table exactly when rotary is given (one epilogue for the "
                         f"sequence and joint rows), got rotary={'set' if ropes[0] is not None else None}, "
                         f"joint_rotary={'set' if jrope is not None else None}")
    return problem


# ---- public functions ------------------------------------------------------------------------------
def _signature(x, proj, rotary, joint, joint_proj, joint_rotary, args):
    """The cache key of a checked call: facts every rank shares for a valid call (the rank's total
    rows, never how its rows split between segments, which is its own: a key that one rank finds
    and another misses would leave the agreement collective to some ranks only)."""
    try:
        if isinstance(x, torch.Tensor):  # the usual call: its facts read once, no Segment objects
            rows, seg_facts = x.shape[1], (x.shape, x.dtype, x.device, _proj_facts(proj), _facts(rotary))
        else:
            segs, _ = _as_segments(x, proj, rotary, "x")
            rows, seg_facts = 0, []
            for s in segs:  # each segment's facts without its rows (how a rank splits its rows is its own)
                sh, r = s.x.shape, s.rotary
                rows += sh[1]
                seg_facts.append((sh[0], sh[2], s.x.dtype, s.x.device, _proj_facts(s.proj), _facts(r, False)))
            seg_facts = tuple(seg_facts)
        types = tuple(map(type, args))
        if list in types:
            args = tuple(tuple(a) if type(a) is list else a for a in args)
        return ("ulysses_qkv_attention", rows, seg_facts, _facts(joint), _proj_facts(joint_proj), _facts(joint_rotary),
                types, args)
    except (TypeError, AttributeError, ValueError):
        return None


def _facts(t, rows: bool = True):
    """A signature's facts of a tensor (shape, without its rows unless `rows`; dtype; device), of a
    tuple or list of them, or None."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        if rows:
            return (t.shape, t.dtype, t.device)
        s = tuple(t.shape)  # (plain tuples slice faster than torch.Size)
        return (s[:-2] + s[-1:], t.dtype, t.device)
    if isinstance(t, (tuple, list)):
        return tuple([_facts(u, rows) for u in t])
    raise TypeError


_HEAD_MAPS: dict = {}  # head map -> a small int standing for it in signatures (hashed every call)


def _proj_facts(proj):
    """The signature's facts of a weights object, computed at its first call and kept on it (its
    fields are frozen)."""
    if proj is None:
        return None
    facts = proj.__dict__.get("_block_facts")
    if facts is None:
        w = proj.weight
        facts = proj.__dict__["_block_facts"] = (
            type(proj), w.shape, w.dtype, w.device, proj.bias is None, proj.norm_weight is None, proj.world_size,
            proj.heads_loc, proj.kv_heads_loc, proj.head_dim, _HEAD_MAPS.setdefault(proj.head_map, len(_HEAD_MAPS)))
    return facts


def _rank_segments(x, proj, rotary, name: str = "x") -> tuple:
    """(x, proj, rope source: None, the table or the (cos, sin) pair) per segment of a checked call
    (rope_table's checks, every call; the conversion is the prepared call's)."""
    if isinstance(x, torch.Tensor):  # the usual call, without Segment objects
        return ((x, proj, _rope_source(rotary, x.shape[1], proj.head_dim, x.device, "rotary")),)
    segs, names = _as_segments(x, proj, rotary, name)
    return tuple((s.x, s.proj, _rope_source(s.rotary, s.x.shape[1], s.proj.head_dim, s.x.device, rn))
                 for s, (_, _, rn) in zip(segs, names))


def _named_inputs(x, joint, name: str = "x") -> list:
    """(name, tensor, or anything else: the checks skip it) of a block call's hidden states (x, or each
    Segment's x) and joint rows, as its refusals name them."""
    if isinstance(x, (list, tuple)):
        xs = [getattr(s, "x", None) for s in x]
        named = [(f"{name}[{i}].x" if len(xs) > 1 else name, t) for i, t in enumerate(xs)]
    else:
        named = [(name, x)]
    return named + [("joint", joint)]


def _output_likes(x, proj, joint) -> list:
    """Tensors shaped like a block call's outputs, [B, rows, H, D] (and [B, J, H, D] with joint), where x
    (a tensor) and proj say them, else like x: stand-ins while tracing a refused call."""
    like = x if isinstance(x, torch.Tensor) else torch.empty(0)
    if like.dim() == 3 and getattr(proj, "head_map", None) is not None:
        like = like.new_empty(like.shape[0], like.shape[1], proj.head_map[0], proj.head_dim)
    if joint is None:
        return [like]
    rows = joint.shape[1] if isinstance(joint, torch.Tensor) and joint.dim() == 3 and like.dim() == 4 else 0
    return [like, like.new_empty(like.shape[0], rows, *like.shape[2:])]


def _block_stand_ins(refused, x, proj=None, *args, joint=None, **kwargs):
    outs = refused(_output_likes(x, proj, joint))
    return outs[0] if joint is None else tuple(outs)


def _emulated_block_stand_ins(refused, xs, proj=None, *args, joint=None, **kwargs):
    xs = list(xs) if isinstance(xs, (list, tuple)) else []
    likes = [_output_likes(x, proj, joint) for x in xs]
    outs = refused([t for rank in likes for t in rank])
    if joint is None:
        return outs
    return outs[0::2], outs[1::2]


@traced_refusals(_block_stand_ins)
def ulysses_qkv_attention(x, proj=None, *, group=None, rotary=None, joint: Optional[torch.Tensor] = None,
                          joint_proj=None, joint_rotary=None, impl: str = "auto", causal: bool = False,
                          softmax_scale: Optional[float] = None, seq_len: Optional[int] = None,
                          shard_rows: Optional[Sequence[int]] = None, config="auto", one_launch: bool = False,
                          pace="auto", out_proj=None):
    """One rank's Ulysses attention block from its hidden states: x [B, S_loc, C] -> [B, S_loc, H, D]
    (or (that, joint output [B, J, H, D]) with joint), or [B, S_loc, C_out] with out_proj.

    proj: block_weights(chain, P) (P = the group's size). rotary: this rank's rows' RoPE, (cos, sin)
    [S_loc, D] diffusers-style or the fp32 table (rope_table), None for none. x may instead be a
    list of Segment(x_i, proj_i, rotary_i): the rank's rows in order, each range with its own
    weights and rotary (proj and rotary None then): Flux's sharded text and image rows; the output
    has their rows in the same order. joint: the replicated
    text rows [B, J, C_j] (every rank the same), projected with joint_proj (default proj), RoPE
    joint_rotary [J, D]. impl: "auto" (default: the fastest of fused with TMA or st O-stores and
    serial, timed on this machine at the signature's first call: fa_a2a.engine.autotune), "fused" (FA4 with
    the post-A2A in its epilogue; "fused:tma" / "fused:st" force its O-store path) or "serial" (FA4,
    then the post-A2A kernel); the projection is always the fused one. seq_len / shard_rows /
    causal / softmax_scale / pace as in fa_a2a.ulysses_attention. config / one_launch: the projection's
    tile configuration and launch split (cute_kernels.qkv_a2a_sm90); config "auto" (default) picks
    both by each launch's rows (fa_a2a.engine.projection.auto_tiles), None is quack's default tiles with
    one_launch as given.
    The windows are the op's (collective, host-synchronous allocation at the first call of a shape:
    before graph capture). Hidden states or joint rows that require grad (grad mode on) backpropagate:
    the projection then runs as the torch chain of proj (global_chain) before the differentiable op
    (fa_a2a.ulysses_attention, same impl): correct, not fused; config / one_launch do not apply. Weights
    that require grad are refused (ValueError): they are copies in destination order.
    out_proj: the block's output projection (an nn.Linear of in_features H * D, or its (weight, bias);
    not with joint rows) applied to every row of the output; its weights may require grad. With hidden
    states that require grad the call is fa_a2a.ulysses_attention_out_proj on the chain's q, k, v: its
    fused backward takes dO from the projection's GEMM (stored straight to its owners).
    """
    from fa_a2a.engine.problem import group_facts

    weights = _out_weights(out_proj, joint)
    if _inputs_want_grad([x], joint):
        from fa_a2a.op import ulysses_attention, ulysses_attention_out_proj

        try:
            _check_block_args(impl, joint, joint_proj, joint_rotary, config, one_launch)
            qkv, jt = _attention_with_grad(x, proj, rotary, joint, joint_proj, joint_rotary, "x")
        except ValueError as e:
            refuse_on_every_rank(e, group)
        kw = dict(group=group, impl=impl, causal=causal, softmax_scale=softmax_scale, seq_len=seq_len,
                  shard_rows=shard_rows, pace=pace)
        if weights is not None:
            return ulysses_attention_out_proj(*qkv, *weights, **kw)
        return ulysses_attention(*qkv, joint=jt, **kw)
    group, group_name, P, rank = group_facts(group)
    args = (impl, causal, softmax_scale, seq_len, shard_rows, config, one_launch, P, rank, group_name, type(pace), pace)
    key = _signature(x, proj, rotary, joint, joint_proj, joint_rotary, args)
    collective = P > 1 and group is not None

    def checks():  # once per signature; memory and grad every call (strides are not in the key)
        check_no_overlap(_named_inputs(x, joint))
        hashable, entry = lookup(key)
        if entry is None:
            _check_block_args(impl, joint, joint_proj, joint_rotary, config, one_launch)
            problem = _check_rank_call(x, proj, rotary, joint, joint_proj, joint_rotary, impl, causal,
                                       softmax_scale, seq_len, shard_rows, P, rank, pace=pace)
            fields = None
            if collective:
                fields = signature_fields(problem, "ulysses_qkv_attention", group_name,
                                          None if joint is None else (joint,))
            entry = (problem, fields, fields and signature_word(fields), {})  # {}: its prepared calls
            # (fa_a2a.engine.projection._rank_block)
            remember(hashable, entry)
        problem, fields, word, calls = entry
        if collective and joint_check(joint is not None, fields):  # FA_A2A_CHECK_JOINT=1: this call's joint rows
            fields = signature_fields(problem, "ulysses_qkv_attention", group_name, (joint,))
            word = signature_word(fields)
        segs = _rank_segments(x, proj, rotary)
        _check_no_grad([s[1] for s in segs], lambda: _proj_names([f"x[{i}].x" if len(segs) > 1 else "x"
                                                                  for i in range(len(segs))]), joint, joint_proj)
        return (problem, segs, calls), fields, word

    problem, segs, calls = checked_and_agreed(checks, group if collective else None)
    call = _rank_block(calls, group, P, rank, problem, segs, joint, joint_proj, joint_rotary, config, one_launch)
    return _projected(call(segs, joint, joint_rotary, joint_proj), weights)


def emulated_plan(world_size: int, layout, B: int, D: int, dtype, device):
    """The window plan the emulated block uses for (layout, B, D, dtype) (tests poison its windows)."""
    from fa_a2a.engine.forward import emulated_transport, window_plan

    return window_plan(emulated_transport(world_size, device), layout, B, D, dtype)


def per_rank_rotary(rotary, P: int) -> list:
    """An emulated call's rotary: None or a list of P per-rank rotaries -> that list. A tuple of two
    tensors is refused: one rank's (cos, sin) pair, or two ranks' tables (P = 2 cannot tell them apart)."""
    if rotary is None:
        return [None] * P
    if isinstance(rotary, tuple) and len(rotary) == 2 and all(isinstance(t, torch.Tensor) for t in rotary):
        raise ValueError(f"rotary: expected None or a list of {P} per-rank rotaries, got a tuple of two tensors "
                         "(one rank's (cos, sin) pair? pass a list, one entry per rank)")
    if isinstance(rotary, torch.Tensor) or not isinstance(rotary, (list, tuple)) or len(rotary) != P:
        got = f"{len(rotary)} entries" if isinstance(rotary, (list, tuple)) else type(rotary).__name__
        raise ValueError(f"rotary: expected None or a list of {P} per-rank rotaries, got {got}")
    return list(rotary)


@traced_refusals(_emulated_block_stand_ins)
def ulysses_qkv_attention_emulated(xs: Sequence, proj=None, *, rotary=None,
                                   joint: Optional[torch.Tensor] = None, joint_proj=None, joint_rotary=None,
                                   impl: str = "auto", causal: bool = False, softmax_scale: Optional[float] = None,
                                   seq_len: Optional[int] = None, shard_rows: Optional[Sequence[int]] = None,
                                   config="auto", one_launch: bool = False, pace="auto", out_proj=None):
    """All P ranks' blocks in one process (the real kernels and barriers over local windows): xs, the
    P ranks' hidden states -> list of P outputs (and list of P joint outputs with joint). rotary: a
    list of P per-rank rotaries (or None); xs[r] may be a list of Segment (then rotary[r] None, proj
    None); joint, joint_rotary: as one rank takes them. Checked once per signature (the P ranks'
    ulysses_qkv_attention signatures), each rank's call prepared once (fa_a2a.engine.projection._RankBlock),
    as a real rank's. out_proj: as ulysses_qkv_attention's (with grad: ulysses_attention_out_proj_emulated,
    the weights' grads summed over the P ranks' rows)."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"xs: expected a non-empty list of per-rank tensors, got {type(xs).__name__}")
    P = len(xs)
    rotary = per_rank_rotary(rotary, P)
    weights = _out_weights(out_proj, joint)
    if _inputs_want_grad(xs, joint):
        from fa_a2a.op import ulysses_attention_emulated, ulysses_attention_out_proj_emulated

        _check_block_args(impl, joint, joint_proj, joint_rotary, config, one_launch)
        ranks = [_attention_with_grad(x, proj, rotary[r], None if r else joint, joint_proj, joint_rotary, f"xs[{r}]")
                 for r, x in enumerate(xs)]  # (the joint rows once: every rank's are the same)
        qkvs = ([qkv[i] for qkv, _ in ranks] for i in range(3))
        kw = dict(impl=impl, causal=causal, softmax_scale=softmax_scale, seq_len=seq_len, shard_rows=shard_rows,
                  pace=pace)
        if weights is not None:
            return ulysses_attention_out_proj_emulated(*qkvs, *weights, **kw)
        return ulysses_attention_emulated(*qkvs, joint=ranks[0][1], **kw)
    args = (impl, causal, softmax_scale, seq_len, shard_rows, config, one_launch, P, type(pace), pace)
    check_no_overlap([n for r, x in enumerate(xs) for n in _named_inputs(x, None, f"xs[{r}]")[:-1]]
                     + [("joint", joint)])
    keys = tuple([_signature(x, proj, rotary[r], joint, joint_proj, joint_rotary, args) for r, x in enumerate(xs)])
    keys, entry = lookup(None if None in keys else ("ulysses_qkv_attention_emulated", keys))
    if entry is None:  # (Problem, {(device, rows per rank): the P ranks' _RankBlocks}: engine.projection)
        _check_block_args(impl, joint, joint_proj, joint_rotary, config, one_launch)
        entry = remember(keys, _check_emulated(xs, proj, rotary, joint, joint_proj, joint_rotary, impl, causal,
                                               softmax_scale, seq_len, shard_rows, pace))
    p, prepared = entry
    segs = [_rank_segments(x, proj, rotary[r], f"xs[{r}]") for r, x in enumerate(xs)]
    for r, x in enumerate(xs):
        _check_no_grad([s[1] for s in segs[r]], lambda: _proj_names([
            f"xs[{r}]" if isinstance(x, torch.Tensor) else f"xs[{r}][{i}].x" for i in range(len(segs[r]))]),
            joint, joint_proj)
    blocks = _emulated_blocks(prepared, p, segs, joint, joint_proj, joint_rotary, config, one_launch)
    res = blocks(segs, joint, joint_rotary, joint_proj)
    return res if weights is None else [_projected(o, weights) for o in res]


def _check_emulated(xs, proj, rotary, joint, joint_proj, joint_rotary, impl, causal, softmax_scale, seq_len,
                    shard_rows, pace) -> tuple:
    """Every rank's local checks (names xs[r]) and rank 0's batch, dtype and device on every rank ->
    (Problem, {} for the prepared calls)."""
    P = len(xs)
    problems = [_check_rank_call(x, proj, rotary[r], joint, joint_proj, joint_rotary, impl, causal, softmax_scale,
                                 seq_len, shard_rows, P, r, f"xs[{r}]", pace) for r, x in enumerate(xs)]
    p = problems[0]
    first = [x if isinstance(x, torch.Tensor) else x[0].x for x in xs]  # each rank's first rows
    for r in range(1, P):
        if problems[r] != p:
            a, b = first[0], first[r]
            raise ValueError(f"xs[{r}]: expected rank 0's batch, dtype and device ({tuple(a.shape)} "
                             f"{a.dtype} on {a.device}), got {tuple(b.shape)} {b.dtype} on {b.device}")
    return p, {}


def not_plain(modules) -> Optional[tuple]:
    """(index, reason) of the first of `modules` whose call is more than its weights (from_linear and the
    fused processors read the weights, never call the layers: what a call adds would be dropped), else
    None. Reasons: "wrapper" (not an nn.Linear / RMSNorm's own forward: a LoRA adapter or another
    wrapper), "hooks" (forward (pre-)hooks, a forward set on the instance as diffusers' HookRegistry and
    accelerate's hooks do, or torch's global module hooks: index -1). Non-modules (weight tensors, None)
    are skipped; a module other than nn.Linear is the caller's to refuse."""
    from torch.nn.modules import module as torch_module

    for i, m in enumerate(modules):
        if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward:
            return i, "wrapper"
        if isinstance(m, nn.Module) and (m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)):
            return i, "hooks"
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return -1, "hooks"
    return None


def _check_plain(names, modules) -> None:
    """from_linear's layers (and norms) as not_plain says: ValueError naming the layer."""
    found = not_plain(modules)
    if found is None:
        return
    i, why = found
    if i < 0:
        raise ValueError(f"{', '.join(n for n, m in zip(names, modules) if isinstance(m, nn.Module))}: torch's global "
                         "module forward hooks are registered, which the block would not run (it reads the "
                         "layers' weights)")
    what = (f"{type(modules[i]).__name__} computes more than its weight (a forward of its own: a LoRA adapter or "
            "another wrapper)" if why == "wrapper" else "has forward hooks (or a forward set on the instance)")
    raise ValueError(f"{names[i]}: {what}, which the block would not run (it reads the layers' weights)")


def weight_facts(tensors) -> tuple:
    """What copies of these tensors depend on: each one's pointer, version, dtype and device (an
    optimizer step in place bumps the version; `.data = ...`, `.to()` and a new Parameter change the
    others). The module's refresh and the model processors' cached blocks compare them."""
    return tuple([(t.data_ptr(), t._version, t.dtype, t.device) for t in tensors])


class _Layers(NamedTuple):
    """One q/k/v group of from_linear's layers, kept by reference: the module's chain from the layers'
    live parameters (differentiable: their grads) and the facts (weight_facts) that tell when its
    copies are stale."""

    names: tuple  # the from_linear argument names: q, k, v, q norm, k norm
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    q_norm: object  # an RMSNorm module, its weight tensor, or None
    k_norm: object
    num_heads: int
    num_kv_heads: int
    head_dim: int
    across_heads: bool
    eps: float

    def tensors(self) -> list:
        """The layers' parameters (read from the modules' parameter dicts: this runs every call)."""
        norms = [n._parameters.get("weight") if isinstance(n, nn.Module) else n for n in (self.q_norm, self.k_norm)]
        return [t for m in (self.q, self.k, self.v) for t in m._parameters.values() if t is not None] + \
            [t for t in norms if isinstance(t, torch.Tensor)]

    def facts(self) -> tuple:
        return weight_facts(self.tensors())

    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.tensors())

    def check_plain(self) -> None:
        """Every call (hooks can be added later): the layers' calls are their weights' (_check_plain)."""
        _check_plain(self.names, (self.q, self.k, self.v, self.q_norm, self.k_norm))

    def check_shapes(self) -> None:
        """Wherever the chain is taken (a changed layer changes its weight_facts): the layers' shapes as
        from_linear took them, a bias on all three or none (ValueError naming the layer)."""
        layers = (self.q, self.k, self.v)
        widths = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        for name, m, heads in zip(self.names, layers, widths):
            if tuple(m.weight.shape) != (heads * self.head_dim, self.q.weight.shape[1]):
                raise ValueError(f"{name}: expected its weight [{heads * self.head_dim}, {self.q.weight.shape[1]}] as "
                                 f"from_linear took it, got {tuple(m.weight.shape)} (build the module again)")
        _check_biases(self.names, layers)

    def chain(self) -> TorchQKV:
        """The torch chain of the layers' parameters as they are now (torch.cat: differentiable)."""
        self.check_shapes()
        layers = (self.q, self.k, self.v)
        bias = None if self.q.bias is None else torch.cat([m.bias for m in layers])
        q_norm, k_norm = (n.weight if isinstance(n, nn.Module) else n for n in (self.q_norm, self.k_norm))
        return TorchQKV(torch.cat([m.weight for m in layers]), bias, q_norm, k_norm, self.num_heads,
                        self.num_kv_heads, self.head_dim, self.across_heads, self.eps)


def reload_weights(model: nn.Module) -> None:
    """After writing a model's weights through `.data` (diffusers' EMAModel.copy_to, `p.data.copy_(...)`),
    which torch does not version: every UlyssesQKVAttention in `model` rebuilds its fused copies, and every
    fused attention processor (fa_a2a.enable_fused_projection) gathers its weights again, before their next
    call. Other changes (optimizer steps, load_state_dict, `.data =`, `.to()`) need no call: they are seen."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    for m in model.modules():
        if isinstance(m, UlyssesQKVAttention):
            m.reload_weights()
        processor = getattr(m, "processor", None)
        if callable(getattr(processor, "reload_weights", None)):
            processor.reload_weights()


# ---- module --------------------------------------------------------------------------------------
class UlyssesQKVAttention(nn.Module):
    """The attention block of a DiT under Ulysses, from hidden states to per-head outputs.

    Built from the model's projection weights (`from_linear`); forward(x [B, S_loc, C], rotary=...,
    joint=...) -> [B, S_loc, H, D] (and the joint output). With per-head q/k norms (Flux, QwenImage,
    Flux2) the projection is the fused kernel (block_weights for the group's P, built once);
    with norms across heads (Wan) the torch chain runs first and then the attention-only fused op
    (fa_a2a.ulysses_attention): correct, not fused. The module holds the weights in the form its
    path uses (the gathered QKVWeights, or the chain's). Built by from_linear it keeps the layers too:
    under grad mode with a layer parameter that requires grad (training) it runs the torch chain of
    the layers themselves and then the differentiable op, so the layers get their gradients (correct,
    not fused); and before every call its copies are rebuilt where a layer parameter changed in place
    (an optimizer step), so no path runs stale weights (a `.data` write, which torch does not version,
    needs reload_weights()). Under torch.compile, and on the chain path, it runs the layers' chain (no
    copy there). Otherwise hidden states that require grad backpropagate through the copies
    (ulysses_qkv_attention), which take no gradient.
    Either chain (a TorchQKV; gathered here when its norms are per head) or proj (QKVWeights
    already gathered for world_size ranks: block_weights) with joint_chain / joint_proj alike.
    out_proj: the attention's output projection (an nn.Linear, in_features H * D; its parameters are the
    module's only ones and train): forward then returns [B, S_loc, C_out] (not with joint rows), and
    with grad its fused backward takes dO from that GEMM (fa_a2a.ulysses_attention_out_proj).
    """

    def __init__(self, chain: Optional[TorchQKV] = None, *, joint_chain: Optional[TorchQKV] = None, proj=None,
                 joint_proj=None, group=None, world_size: Optional[int] = None, impl: str = "auto",
                 causal: bool = False, softmax_scale: Optional[float] = None, config="auto",
                 one_launch: bool = False, pace="auto", out_proj: Optional[nn.Linear] = None):
        super().__init__()
        from fa_a2a.engine.pacing import check_pace

        from cute_kernels.qkv_a2a_sm90 import QKVWeights

        if (chain is None) == (proj is None):
            raise ValueError(f"chain, proj: expected exactly one (a TorchQKV, or a QKVWeights from block_weights), "
                             f"got {type(chain).__name__} and {type(proj).__name__}")
        split_impl(impl, BLOCK_IMPLS)
        self.group = group
        self.world_size = _world_size(group, world_size)
        self.impl, self.causal, self.softmax_scale, self.pace = impl, causal, softmax_scale, check_pace(pace)
        self.config, self.one_launch = config, one_launch
        if out_proj is not None and not isinstance(out_proj, nn.Linear):
            raise ValueError(f"out_proj: expected None or an nn.Linear, got {type(out_proj).__name__}")
        self.out_proj = out_proj
        self._layers = None  # from_linear's layers (_Layers per q/k/v group), with the versions of their copies
        self._shared, self._facts = False, None
        if proj is not None:
            if joint_chain is not None:
                raise ValueError("joint_chain: expected None with proj (pass joint_proj), got a TorchQKV")
            for name, p in (("proj", proj), ("joint_proj", joint_proj)):
                if p is None and name == "joint_proj":
                    continue
                if not isinstance(p, QKVWeights) or p.head_map is None or p.world_size != self.world_size:
                    raise ValueError(f"{name}: expected a QKVWeights gathered for world_size = {self.world_size} "
                                     f"(block_weights), got {type(p).__name__} of world_size "
                                     f"{getattr(p, 'world_size', None)}")
            if joint_proj is not None and (joint_proj.head_map[:2], joint_proj.head_dim) != (proj.head_map[:2],
                                                                                           proj.head_dim):
                raise ValueError(f"joint_proj: expected proj's heads {proj.head_map[:2]} and head dim {proj.head_dim}, "
                                 f"got {joint_proj.head_map[:2]} and {joint_proj.head_dim}")
            self.fused, self.chain, self.joint_chain = True, None, None
            self.proj, self.joint_proj = proj, joint_proj
            return
        if joint_proj is not None:
            raise ValueError("joint_proj: expected None with chain (pass joint_chain), got a QKVWeights")
        if not isinstance(chain, TorchQKV):
            raise ValueError(f"chain: expected a TorchQKV, got {type(chain).__name__}")
        if joint_chain is not None and (not isinstance(joint_chain, TorchQKV) or joint_chain.across_heads
                                        != chain.across_heads or (joint_chain.num_heads, joint_chain.num_kv_heads,
                                                                  joint_chain.head_dim)
                                        != (chain.num_heads, chain.num_kv_heads, chain.head_dim)):
            raise ValueError("joint_chain: expected a TorchQKV with chain's heads, head dim and norm kind")
        self.fused = not chain.across_heads
        self.chain, self.joint_chain = chain, joint_chain
        self.proj = self.joint_proj = None
        if self.fused:
            self.proj = block_weights(chain, self.world_size)
            self.joint_proj = block_weights(joint_chain, self.world_size) if joint_chain is not None else None
            self.chain = self.joint_chain = None  # the gathered weights only (no second copy)

    @classmethod
    def from_linear(cls, to_q: nn.Linear, to_k: nn.Linear, to_v: nn.Linear, *, head_dim: int,
                    norm_q=None, norm_k=None, across_heads: bool = False, add_q: Optional[nn.Linear] = None,
                    add_k: Optional[nn.Linear] = None, add_v: Optional[nn.Linear] = None,
                    norm_added_q=None, norm_added_k=None, share_weights: bool = False,
                    **kwargs) -> "UlyssesQKVAttention":
        """From a DiT attention's layers (diffusers names: to_q/to_k/to_v, norm_q/norm_k; Flux's
        double-stream text projections add_q/add_k/add_v (add_q_proj, ...), norm_added_q/k). norm_*:
        RMSNorm modules (their .weight and .eps) or weight tensors; across_heads: Wan's norms over
        all heads (fallback path). kwargs: the constructor's (group, world_size, impl, ...).
        share_weights (per-head norms only): the layers' weights and biases become views of the
        gathered weights (the same values, one copy in memory instead of two; their Parameter objects
        stay); a later in-place change of a layer's weight then reaches the module's weights too,
        but a new tensor assigned to a layer does not (rebuild the module then: fa_a2a.models.flux
        does). Needs each of q/k/v's heads in order at the start of its destination block: no GQA
        replication (H_kv < H with H_kv not a multiple of the ranks)."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
        for name, flag in (("across_heads", across_heads), ("share_weights", share_weights)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {flag!r}")
        if share_weights and across_heads:
            raise ValueError("share_weights: expected False with across_heads=True (the torch chain holds the "
                             "weights concatenated), got True")
        joint = (add_q, add_k, add_v, norm_added_q, norm_added_k)
        joint_names = ("add_q", "add_k", "add_v", "norm_added_q", "norm_added_k")
        if (add_q is None) != (add_k is None) or (add_q is None) != (add_v is None):
            raise ValueError(f"add_q, add_k, add_v: expected all three or none, got "
                             f"{[type(m).__name__ for m in joint[:3]]}")
        if add_q is None and (norm_added_q is not None or norm_added_k is not None):
            raise ValueError("norm_added_q, norm_added_k: expected None without add_q/add_k/add_v")
        groups = [(("to_q", "to_k", "to_v", "norm_q", "norm_k"), (to_q, to_k, to_v, norm_q, norm_k))]
        sources = []
        if add_q is not None:
            groups.append((joint_names, joint))
        world_size = None if across_heads else _world_size(kwargs.get("group"), kwargs.get("world_size"))
        if share_weights:  # a tensor of two layers can be a view of one block's rows only
            seen = {}
            for names, layers in groups:
                for name, m in zip(names[:3], layers[:3]):
                    for t in (m.weight, m.bias) if isinstance(m, nn.Module) else ():
                        if t is not None and id(t) in seen:
                            raise ValueError(f"share_weights: expected layers with weights of their own, got "
                                             f"{seen[id(t)]} and {name} sharing one (tied layers)")
                        if t is not None:
                            seen[id(t)] = name
        made = []
        for names, (q, k, v, nq, nk) in groups:
            heads, bias, norms, eps = _check_linears(names, (q, k, v), (nq, nk), head_dim, across_heads)
            _check_plain(names, (q, k, v, nq, nk))
            if made and heads != made[0][0]:
                raise ValueError(f"{names[0]}, {names[1]}: expected to_q's and to_k's heads {made[0][0]}, got {heads}")
            if made and (q.weight.dtype, q.weight.device) != (to_q.weight.dtype, to_q.weight.device):
                raise ValueError(f"{names[0]}: expected to_q's {to_q.weight.dtype} on {to_q.weight.device}, got "
                                 f"{q.weight.dtype} on {q.weight.device}")
            sources.append(_Layers(names, q, k, v, nq, nk, *heads, head_dim, across_heads, eps))
            if across_heads:  # the constructor's chain (dropped below: the layers' own runs at every call)
                with torch.no_grad():
                    made.append((heads, sources[-1].chain()))
                continue
            w = [m.weight.detach() for m in (q, k, v)]
            b = (None,) * 3 if bias is None else bias
            proj = _gather_weights(w, b, *norms, head_dim, world_size)
            del w, b
            if share_weights:  # before the next group's gathering: one layer's copy at a time
                _share_weights(proj, (q, k, v), names[:3])
            made.append((heads, proj))
        built = [m for _, m in made]
        if across_heads:
            module = cls(built[0], joint_chain=built[1] if len(built) > 1 else None, **kwargs)
        else:
            module = cls(proj=built[0], joint_proj=built[1] if len(built) > 1 else None, **kwargs)
        module._layers, module._shared = tuple(sources), share_weights
        module._facts = tuple(g.facts() for g in sources)
        if across_heads:  # the layers' own chain runs at every call (_chains): no copy kept
            module.chain = module.joint_chain = None
        return module

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, impl={self.impl!r}, fused_projection={self.fused}, "
                f"joint_weights={self._has_joint_weights()}")

    def _has_joint_weights(self) -> bool:
        return self.joint_proj is not None or self.joint_chain is not None or len(self._layers or ()) > 1

    def _kw(self):
        return dict(impl=self.impl, causal=self.causal, softmax_scale=self.softmax_scale, pace=self.pace)

    def _refresh(self) -> None:
        """The fused path's copies rebuilt from from_linear's layers where a parameter of theirs changed since
        they were taken (weight_facts: an optimizer step in place, .to(), new data; a `.data` write is not
        versioned: reload_weights). With share_weights the layers are pointed at the new copies again.
        Not while torch.compile traces (a tensor's version is no value it can guard on): the compiled
        module runs the layers' own chains instead (_chains)."""
        if (self._layers is None or not self.fused or torch.compiler.is_compiling()
                or self._facts == tuple([g.facts() for g in self._layers])):
            return
        for g in self._layers:
            _check_fused_dtype(g.names[0], g.q.weight.dtype)
        with torch.no_grad():
            projs = [block_weights(g.chain(), self.world_size) for g in self._layers]
            if self._shared:
                for g, p in zip(self._layers, projs):
                    _share_weights(p, (g.q, g.k, g.v), g.names[:3])
            self.proj, self.joint_proj = projs[0], (projs[1] if len(projs) > 1 else None)
        self._facts = tuple(g.facts() for g in self._layers)

    def reload_weights(self) -> None:
        """Rebuild the fused path's copies from from_linear's layers now. Needed only after a change torch
        does not version: an in-place write through `.data` (diffusers' EMAModel.copy_to, `p.data.copy_`),
        which leaves a tensor's pointer and version as they were; every other change (optimizer steps,
        load_state_dict, `.data =`, `.to()`) is seen before the next call. (fa_a2a.reload_weights(model)
        does it for every module and fused processor of a model.)"""
        if self._layers is not None and self.fused:
            self._facts = None
            self._refresh()

    def _chains(self) -> Optional[list]:
        """The torch chains of from_linear's layers themselves (their live parameters, differentiable), or
        None (the module's fused copies): on the chain path (norms across heads: the module keeps no copy
        of the layers' weights, so even a `.data` write is seen), under grad mode with a layer parameter
        requiring grad (the copies would cut the layers' gradients), and while torch.compile traces (the
        compiled graph would keep the copies it traced: the layers' parameters are its inputs, so it
        reads their values at every call)."""
        if self._layers is None:
            return None
        compiling = torch.compiler.is_compiling()
        training = torch.is_grad_enabled() and any(g.requires_grad() for g in self._layers)
        if self.fused and not training and not compiling:
            return None
        import logging

        from fa_a2a.engine.log import log_once

        if training and not compiling:  # (not while tracing: a log call would break the graph)
            log_once(logging.getLogger(__name__), "UlyssesQKVAttention: the layers' chain", logging.INFO,
                     "UlyssesQKVAttention: its layers' parameters require grad under grad mode (training): the "
                     "torch chain of the layers runs, then the differentiable op (not the fused projection); for "
                     "inference call it under torch.no_grad() or torch.inference_mode()")
        return [g.chain() for g in self._layers]

    def _chain_pair(self, chains) -> tuple:
        """(the torch chain of the rows, of the joint rows): the layers' (chains) or the module's own."""
        main, *text = chains or (self.chain, self.joint_chain)
        return main, (text[0] if text and text[0] is not None else main)

    def _layers_now(self) -> Optional[list]:
        """from_linear's layers checked (_Layers.check_plain), the copies refreshed -> _chains()."""
        for g in self._layers or ():
            g.check_plain()
        self._refresh()
        return self._chains()

    def forward(self, x: torch.Tensor, *, rotary=None, joint: Optional[torch.Tensor] = None, joint_rotary=None,
                seq_len: Optional[int] = None, shard_rows: Optional[Sequence[int]] = None):
        try:  # (a refusal goes to every rank: the others are at the call's agreement)
            chains = self._layers_now()
        except ValueError as e:
            refuse_on_every_rank(e, self.group)
        if chains is None and self.fused:
            return ulysses_qkv_attention(x, self.proj, group=self.group, rotary=rotary, joint=joint,
                                         joint_proj=self.joint_proj, joint_rotary=joint_rotary, seq_len=seq_len,
                                         shard_rows=shard_rows, config=self.config, one_launch=self.one_launch,
                                         out_proj=self.out_proj, **self._kw())
        from fa_a2a.op import ulysses_attention, ulysses_attention_out_proj

        main, joint_chain = self._chain_pair(chains)
        try:  # (checked before the op's own agreement: a refusal goes to every rank)
            weights = _out_weights(self.out_proj, joint)
            q, k, v = _chain_qkv(x, rotary, main)
            jt = None if joint is None else _chain_qkv(joint, joint_rotary, joint_chain, "joint", "joint_rotary")
        except ValueError as e:
            refuse_on_every_rank(e, self.group)
        kw = dict(group=self.group, seq_len=seq_len, shard_rows=shard_rows, **self._kw())
        if weights is not None:
            return ulysses_attention_out_proj(q, k, v, *weights, **kw)
        return ulysses_attention(q, k, v, joint=jt, **kw)

    def forward_emulated(self, xs: Sequence[torch.Tensor], *, rotary=None, joint: Optional[torch.Tensor] = None,
                         joint_rotary=None, seq_len: Optional[int] = None,
                         shard_rows: Optional[Sequence[int]] = None):
        """All world_size ranks in one process (module built with world_size=P, group None)."""
        if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
            raise ValueError(f"xs: expected a non-empty list of per-rank tensors, got {type(xs).__name__}")
        if len(xs) != self.world_size:
            raise ValueError(f"xs: expected {self.world_size} per-rank tensors (world_size), got {len(xs)}")
        chains = self._layers_now()
        if chains is None and self.fused:
            return ulysses_qkv_attention_emulated(xs, self.proj, rotary=rotary, joint=joint,
                                                  joint_proj=self.joint_proj, joint_rotary=joint_rotary,
                                                  seq_len=seq_len, shard_rows=shard_rows, config=self.config,
                                                  one_launch=self.one_launch, out_proj=self.out_proj, **self._kw())
        from fa_a2a.op import ulysses_attention_emulated, ulysses_attention_out_proj_emulated

        main, joint_chain = self._chain_pair(chains)
        weights = _out_weights(self.out_proj, joint)
        qkv = [_chain_qkv(x, rot, main) for x, rot in zip(xs, per_rank_rotary(rotary, len(xs)))]
        qs, ks, vs = ([t[i] for t in qkv] for i in range(3))
        kw = dict(seq_len=seq_len, shard_rows=shard_rows, **self._kw())
        if weights is not None:
            return ulysses_attention_out_proj_emulated(qs, ks, vs, *weights, **kw)
        jt = None if joint is None else _chain_qkv(joint, joint_rotary, joint_chain, "joint", "joint_rotary")
        return ulysses_attention_emulated(qs, ks, vs, joint=jt, **kw)
