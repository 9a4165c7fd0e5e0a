"""UlyssesAttention: a drop-in for the attention core of a DiT block under Ulysses parallelism.

It replaces the `F.scaled_dot_product_attention(q, k, v)` call of an attention processor, on
sequence shards: every rank of `group` calls it with its rows of the sequence, as the block's
projections produced them. Two tensor layouts:
  layout="bshd" (default): q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D] (FA / xDiT convention);
  layout="bhsd": q [B, H, S_loc, D], k/v [B, H_kv, S_loc, D] (the SDPA call in diffusers'
  processors); transposed in and out (one copy each way).
The output has q's layout. MMDiT joint (text) tokens, replicated on every rank, go in
`joint=(joint_q, joint_k, joint_v)` in the same layout; forward then returns (out, joint_out).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from fa_a2a.op import ulysses_attention
from fa_a2a.engine.problem import split_impl

__all__ = ["UlyssesAttention"]

_LAYOUTS = ("bshd", "bhsd")


class UlyssesAttention(nn.Module):
    """Ulysses sequence-parallel attention with a selectable implementation (see fa_a2a.op).

    impl: "auto" (default: the fastest path, timed on this machine once: fa_a2a.engine.autotune), "fused"
    (FA4 with the post-A2A in its epilogue; "fused:tma" / "fused:st" force its O-store path),
    "serial", "nccl" (permute + all_to_all_single baseline) or "reference". causal / softmax_scale as in SDPA (scale
    default 1/sqrt(D)). seq_len (forward): valid rows of the full sequence when P does not
    divide it (the last shards end in padding rows; their outputs are zeros); shard_rows (forward):
    uneven shards instead, every rank's row count (as ulysses_attention takes it). pace: the fused
    kernel's store pacing, "auto" (default), None or GB/s (fa_a2a.engine.pacing). Differentiable, as
    ulysses_attention (fa_a2a.engine.backward): every rank runs the backward of every call with grad.
    """

    def __init__(self, group=None, *, impl: str = "auto", causal: bool = False,
                 softmax_scale: Optional[float] = None, layout: str = "bshd", pace="auto"):
        super().__init__()
        from fa_a2a.engine.pacing import check_pace

        split_impl(impl)
        if not isinstance(causal, bool):
            raise ValueError(f"causal: expected a bool, got {causal!r}")
        self.group = group
        self.impl = impl
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.layout = layout
        self.pace = check_pace(pace)

    @property
    def layout(self) -> str:
        return self._layout

    @layout.setter
    def layout(self, layout: str) -> None:  # checked when set (in forward it would raise on one rank alone)
        if layout not in _LAYOUTS:
            raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")
        self._layout = layout

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, causal={self.causal}, layout={self.layout!r}"

    def _in(self, x):
        """bhsd -> bshd (and back); anything but a 4-D tensor as it is, for ulysses_attention to refuse
        by name on every rank (a check here would raise on this rank alone and leave the others waiting)."""
        return x.transpose(1, 2) if self.layout == "bhsd" and isinstance(x, torch.Tensor) and x.dim() == 4 else x

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                joint: Optional[Sequence[torch.Tensor]] = None, seq_len: Optional[int] = None,
                shard_rows: Optional[Sequence[int]] = None):
        if isinstance(joint, (tuple, list)):
            joint = tuple(self._in(t) for t in joint)
        res = ulysses_attention(self._in(q), self._in(k), self._in(v), group=self.group, impl=self.impl,
                                joint=joint, causal=self.causal, softmax_scale=self.softmax_scale,
                                seq_len=seq_len, shard_rows=shard_rows, pace=self.pace)
        return self._in(res) if joint is None else (self._in(res[0]), self._in(res[1]))
