"""QwenImage's and Flux2's attention under diffusers' context parallelism as the fused attention block.

The same as fa_a2a.models.flux does for Flux (whose glue these processors share: the route counts
and fallback log, the gathered weights as views, the block call on the rank's rows), installed by
the one entry `fa_a2a.enable_fused_projection(model)`:

- QwenImage (QwenImageTransformer2DModel): QwenDoubleStreamAttnProcessor2_0 ->
  FusedQwenImageAttnProcessor. Two segments as Flux's double-stream blocks: the rank's text shard
  (add_q/k/v_proj, norm_added_q/k) then its image shard (to_q/k/v, norm_q/k); the q/k norms are
  diffusers' RMSNorm over head_dim (per head: the epilogue's). RoPE: diffusers passes complex64
  frequencies (img_freqs [I_r, D/2], txt_freqs [J_r, D/2]; its _cp_plan shards both) applied to the
  adjacent pairs (2j, 2j+1) of each head, the interleaved convention of the epilogue: the block's
  fp32 table is view_as_real of them (cos_j, sin_j at columns 2j, 2j+1), the same fp32 values.
  A text mask (encoder_hidden_states_mask) falls back.
- Flux2 double-stream (Flux2Attention): Flux2AttnProcessor -> FusedFlux2AttnProcessor, Flux's
  double-stream segments ((cos, sin) over the rank's [text; image] rows, torch.nn.RMSNorm per head,
  no biases); the output as diffusers returns it (to_out on the image rows, to_add_out on the text
  rows; to_out on all rows without text).
- Flux2 single-stream (Flux2ParallelSelfAttention): Flux2ParallelSelfAttnProcessor ->
  FusedFlux2ParallelSelfAttnProcessor. Its one Linear to_qkv_mlp_proj projects q|k|v and the
  MLP input together. The block's epilogue takes the q/k/v rows (rows [0, 3*inner) of its weight:
  [W_q; W_k; W_v]); the MLP rows (SwiGLU's gate and linear halves, no norm, no RoPE, no A2A) stay
  a torch GEMM on the rest of the weight, as diffusers computes them, then SwiGLU, concatenation
  with the attention output and to_out. The fused path thus runs two GEMMs where diffusers runs
  one (the same FLOPs). One copy of the weights: the block's q/k/v weight is a view of the
  Linear's first 3*inner rows, which is the destination order only when the ranks split the heads
  evenly; with padding heads (P not dividing the heads) the call falls back (counted) instead of
  holding a second copy.

Fallback (diffusers' own processor, then the registered backend), counted per processor
(fa_a2a.models.diffusers_backend.route_counts(<class>.ROUTE_NAME)) and logged once per reason: every
reason of the Flux processor (fa_a2a.models.flux's module docstring), and QwenImage's text mask or
rotary frequencies other than complex64 [rows, D/2], Flux2's single-stream heads that the ranks
do not split evenly. Flux2's KV-cache processors (Flux2KV*) are left as they are.

CPU-tested (tests/cpu/test_dit_blocks_cpu.py; gloo, 2 and 3 ranks, fp32, even and uneven shards):
the q, k, v the block's segments give through the torch chain equal those diffusers' processors
hand to the attention; the fallback gives diffusers' output exactly; the fused path's plumbing
with the block replaced by a torch reference of it equals diffusers' native CP output. Not yet run
on a GPU (tests/gpu/test_dit_blocks.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_flux2 import (Flux2Attention, Flux2AttnProcessor,
                                                             Flux2ParallelSelfAttention, Flux2ParallelSelfAttnProcessor)
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from fa_a2a.block import Segment, UlyssesQKVAttention, weight_facts
from fa_a2a.models.base import (_FusedBlockProcessor, _head_dim, _layers, _why_not_block, _why_not_fused,
                               _why_not_layers)

__all__ = ["FusedQwenImageAttnProcessor", "FusedFlux2AttnProcessor", "FusedFlux2ParallelSelfAttnProcessor",
           "parallel_attention_weights", "INSTALLS"]


# ---- QwenImage ---------------------------------------------------------------------------------------------
def _why_not_qwen(proc, attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                  image_rotary_emb) -> Optional[str]:
    if encoder_hidden_states is None:
        return "no encoder_hidden_states"  # (diffusers' processor raises)
    why = _why_not_block(proc, attn, hidden_states, encoder_hidden_states, attention_mask)
    if why is not None:
        return why
    if encoder_hidden_states_mask is not None:
        return "encoder_hidden_states_mask (a text mask)"
    if attn.added_kv_proj_dim is None:
        return "encoder_hidden_states without add_q/k/v_proj"
    if image_rotary_emb is not None and not (
            isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2
            and all(isinstance(f, torch.Tensor) and f.dtype == torch.complex64 for f in image_rotary_emb)):
        return "image_rotary_emb not a pair of complex64 frequencies"
    groups = _layers(attn)
    linears = [m for layers, _ in groups for m in layers]
    return _why_not_layers(attn, hidden_states, linears, [n for _, norms in groups for n in norms],
                           [attn.heads * _head_dim(attn)] * len(linears))


def _qwen_tables(image_rotary_emb, J: int, I: int, head_dim: int):
    """QwenImage's (img_freqs [I, D/2], txt_freqs [J, D/2]) complex64 -> the block's fp32 tables
    (text's, image's) [rows, D]: (cos_j, sin_j) = (real, imag) of frequency j at columns (2j, 2j+1)."""
    if image_rotary_emb is None:
        return None, None
    img, txt = image_rotary_emb
    tables = []
    for name, f, rows in (("image_rotary_emb[1] (txt_freqs)", txt, J), ("image_rotary_emb[0] (img_freqs)", img, I)):
        if tuple(f.shape) != (rows, head_dim // 2):
            raise ValueError(f"{name}: expected complex64 [{rows}, {head_dim // 2}] (the rank's rows, head_dim / 2), "
                             f"got {tuple(f.shape)}")
        tables.append(torch.view_as_real(f).flatten(1).contiguous())
    return tuple(tables)


class FusedQwenImageAttnProcessor(_FusedBlockProcessor, QwenDoubleStreamAttnProcessor2_0):
    """QwenDoubleStreamAttnProcessor2_0 whose joint attention under diffusers' Ulysses context
    parallelism is the fused block; diffusers' processor where the block cannot run (the Flux
    processor's reasons, a text mask, rotary frequencies other than complex64)."""

    ROUTE_NAME = "FusedQwenImageAttnProcessor"

    def __call__(self, attn: Attention, hidden_states: torch.FloatTensor,
                 encoder_hidden_states: torch.FloatTensor = None, encoder_hidden_states_mask: torch.FloatTensor = None,
                 attention_mask: Optional[torch.FloatTensor] = None, image_rotary_emb=None):
        why = _why_not_qwen(self, attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                            attention_mask, image_rotary_emb)
        if why is not None:
            self._fallback(why)
            return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                    attention_mask, image_rotary_emb)
        out = self._attend(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        J = encoder_hidden_states.shape[1]
        text, image = out[:, :J], out[:, J:]
        image = attn.to_out[0](image.contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)  # dropout
        return image, attn.to_add_out(text.contiguous())

    @staticmethod
    def _segments(mod, hidden_states, encoder_hidden_states, image_rotary_emb) -> list:
        """[text (add_*); image (to_*)], each with its rows' RoPE table."""
        J, I = encoder_hidden_states.shape[1], hidden_states.shape[1]
        text_rot, image_rot = _qwen_tables(image_rotary_emb, J, I, mod.proj.head_dim)
        return [Segment(encoder_hidden_states.contiguous(), mod.joint_proj, text_rot),
                Segment(hidden_states.contiguous(), mod.proj, image_rot)]


# ---- Flux2 double-stream -----------------------------------------------------------------------------------
def _why_not_flux2(proc, attn, hidden_states, encoder_hidden_states, attention_mask) -> Optional[str]:
    return _why_not_fused(proc, attn, hidden_states, encoder_hidden_states, attention_mask)


class FusedFlux2AttnProcessor(_FusedBlockProcessor, Flux2AttnProcessor):
    """Flux2AttnProcessor (Flux2's double-stream blocks) whose attention under diffusers' Ulysses
    context parallelism is the fused block; diffusers' processor where it cannot run (the Flux
    processor's reasons)."""

    ROUTE_NAME = "FusedFlux2AttnProcessor"

    def __call__(self, attn: Flux2Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb=None):
        why = _why_not_flux2(self, attn, hidden_states, encoder_hidden_states, attention_mask)
        if why is not None:
            self._fallback(why)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        out = self._attend(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        J = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        text, image = out[:, :J], out[:, J:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        if encoder_hidden_states is None:
            return image
        return image, attn.to_add_out(text.contiguous())


# ---- Flux2 single-stream (QKV + MLP in one Linear) ---------------------------------------------------------
def _why_not_parallel(proc, attn, hidden_states, attention_mask) -> Optional[str]:
    why = _why_not_block(proc, attn, hidden_states, None, attention_mask)
    if why is not None:
        return why
    lin = attn.to_qkv_mlp_proj
    if attn.inner_dim != attn.heads * attn.head_dim:
        return "heads split by tensor parallelism"
    why = _why_not_layers(attn, hidden_states, [lin], [attn.norm_q, attn.norm_k],
                          [3 * attn.inner_dim + attn.mlp_hidden_dim * attn.mlp_mult_factor])
    if why is not None:
        return why
    P = proc._parallel_config.context_parallel_config.ulysses_degree
    if attn.heads % P:
        return (f"{attn.heads} heads on {P} ranks (padding heads: the fused QKV+MLP weight's q/k/v rows are the "
                "block's weights only when the ranks split the heads evenly)")
    return None


def _row_linear(lin: torch.nn.Linear, lo: int, n: int) -> torch.nn.Linear:
    """A Linear over rows [lo, lo + n) of lin (views of its weight and bias)."""
    m = torch.nn.Linear(lin.in_features, n, bias=lin.bias is not None, device="meta")
    m.weight = torch.nn.Parameter(lin.weight.detach()[lo:lo + n], requires_grad=False)
    if lin.bias is not None:
        m.bias = torch.nn.Parameter(lin.bias.detach()[lo:lo + n], requires_grad=False)
    return m


def parallel_attention_weights(attn: Flux2ParallelSelfAttention, **kwargs) -> UlyssesQKVAttention:
    """The q/k/v rows of attn.to_qkv_mlp_proj ([W_q; W_k; W_v; W_mlp]) as the fused block's weights
    for the group's P (kwargs: group or world_size): destination order is [W_q; W_k; W_v] itself
    when the ranks split the heads evenly, so the block's weight (and bias) is a view of the
    Linear's first 3*inner rows (one copy; the gathering's own copy is dropped). ValueError when
    they do not (padding heads)."""
    lin, inner, D = attn.to_qkv_mlp_proj, attn.inner_dim, attn.head_dim
    mod = UlyssesQKVAttention.from_linear(*(_row_linear(lin, t * inner, inner) for t in range(3)), head_dim=D,
                                          norm_q=attn.norm_q, norm_k=attn.norm_k, **kwargs)
    proj, n = mod.proj, 3 * inner
    H, H_kv, q_index, kv_index = proj.head_map
    plain = list(range(H))
    if proj.weight.shape[0] != n or [h for r in q_index for h in r] != plain or [h for r in kv_index for h in r] != plain:
        raise ValueError(f"attn: expected heads that the {proj.world_size} ranks split evenly (the q/k/v rows of "
                         f"to_qkv_mlp_proj in destination order), got {H} heads")
    mod.proj = dataclasses.replace(proj, weight=lin.weight.detach()[:n],
                                   bias=None if lin.bias is None else lin.bias.detach()[:n])
    return mod


def _parallel_facts(attn) -> tuple:
    lin = attn.to_qkv_mlp_proj
    return weight_facts(t for t in (lin.weight, lin.bias, attn.norm_q.weight, attn.norm_k.weight) if t is not None)


class FusedFlux2ParallelSelfAttnProcessor(_FusedBlockProcessor, Flux2ParallelSelfAttnProcessor):
    """Flux2ParallelSelfAttnProcessor (Flux2's single-stream blocks) whose attention under diffusers'
    Ulysses context parallelism is the fused block on the q/k/v rows of to_qkv_mlp_proj, its MLP rows
    a torch GEMM (the module docstring); diffusers' processor where the block cannot run (the Flux
    processor's reasons, heads that the ranks do not split evenly)."""

    ROUTE_NAME = "FusedFlux2ParallelSelfAttnProcessor"

    def __call__(self, attn: Flux2ParallelSelfAttention, hidden_states: torch.Tensor,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb=None) -> torch.Tensor:
        why = _why_not_parallel(self, attn, hidden_states, attention_mask)
        if why is not None:
            self._fallback(why)
            return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)
        out = self._attend(attn, hidden_states, None, image_rotary_emb)
        lin, n = attn.to_qkv_mlp_proj, 3 * attn.inner_dim
        mlp = torch.nn.functional.linear(hidden_states, lin.weight[n:], None if lin.bias is None else lin.bias[n:])
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))

    @staticmethod
    def _gather(attn, group) -> UlyssesQKVAttention:
        return parallel_attention_weights(attn, group=group)

    @staticmethod
    def _weight_facts(attn) -> tuple:
        return _parallel_facts(attn)


# (module class, diffusers' processor, fused processor): enable_fused_projection's table (registry._installs)
INSTALLS = ((Flux2Attention, Flux2AttnProcessor, FusedFlux2AttnProcessor),
            (Flux2ParallelSelfAttention, Flux2ParallelSelfAttnProcessor, FusedFlux2ParallelSelfAttnProcessor),
            (Attention, QwenDoubleStreamAttnProcessor2_0, FusedQwenImageAttnProcessor))
