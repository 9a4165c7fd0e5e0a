"""Flux's attention under diffusers' context parallelism as the fused attention block.

With the fa-a2a backend (fa_a2a.models.diffusers_backend) diffusers' FluxAttnProcessor projects q/k/v in
torch (three Linears, RMSNorm, RoPE) and the backend runs the pre-A2A, FA4 and the post-A2A.
`enable_fused_projection(model)` installs FusedFluxAttnProcessor on every FluxAttention of the
model instead, which hands the hidden states to fa_a2a.block: the QKV projection with the
pre-A2A in its GEMM epilogue (bias, per-head RMSNorm, RoPE), then FA4 with the post-A2A in its
epilogue, both A2As inside the two compute kernels.

    enable_ulysses(model)                 # fa_a2a.models.diffusers_backend: backend + diffusers' CP
    enable_fused_projection(model)        # this module (before or after enable_ulysses)

QwenImage's and Flux2's processors (fa_a2a.models.dit_blocks) share this module's glue (_FusedBlockProcessor:
route counts, fallback log, gathered weights as views, the block call); enable_fused_projection installs
all of them.

Rows: diffusers' Flux `_cp_plan` shards the text rows as well as the image rows, so rank r holds
[text shard (J_r rows); image shard (I_r rows)], and image_rotary_emb holds the RoPE of exactly
those rows (txt_ids and img_ids are sharded too). The double-stream processor gives the block two
segments (fa_a2a.block.Segment): the text rows with add_q/k/v_proj + norm_added_q/k, the image
rows with to_q/k/v + norm_q/k, each with its rotary rows; the single-stream processor one segment
(to_q/k/v over the concatenated rows). Non-causal unmasked attention does not depend on the order
of the keys, so the ranks' [text; image] rows are one sequence to the block, as they are to the
backend. Uneven shards (ulysses_anything): every rank's row count is gathered as the backend does
(diffusers_backend.rows_per_rank) and passed as shard_rows. The block's output is split back
into text and image rows and goes through to_add_out and to_out (double-stream); the
single-stream block gets the attention output as diffusers' processor returns it.

Fallback: diffusers' own FluxAttnProcessor (projection in torch, then the registered backend) when
the fused block cannot run: no context parallelism or ring degree > 1; the attention backend not a
registered fa-a2a backend with impl "auto", "fused" or "serial" (impl "reference" / "nccl" run no kernels);
CPU tensors; not SM90 (the projection kernel is SM90's); dtype not bfloat16/float16, or weights of
another dtype/device than the hidden states; head dim not 64/128; an attention mask; autograd
(hidden states or q/k/v weights that require grad under grad mode: the fused block has no backward);
projection layers other than plain nn.Linear (a LoRA adapter); fused to_qkv projections; q/k norms
that are not RMSNorm with weight and eps 1e-6 (the epilogue's); channels not a multiple of 8; heads
split by tensor parallelism. Every fact is the same on all ranks, so all ranks take the same path;
each reason is logged once and the calls per path are counted
(fa_a2a.models.diffusers_backend.route_counts(ROUTE_NAME)).

Memory: the block's weights are the module's q/k/v weights gathered in destination order
(UlyssesQKVAttention.from_linear, attention_weights), and the module's Linears are made views of
them (their Parameter objects stay, with the same values): one copy of the attention weights
(for Flux.1: 19 double-stream blocks with 6 and 38 single-stream blocks with 3 matrices of 3072 x
3072, bf16, 4.3 GB), not two. Built at the first fused call of a module; rebuilt when a weight
changes (data pointer or version: model.to(...), load_state_dict, an in-place update), which
gathers the current values into a new buffer and moves the views there. Measured on CPU
(examples/flux_block_memory.py, Flux.1's attention modules, P = 8): 1.87 MB held beyond the model
(0.04% of the 4.303 GB of q/k/v weights; the copy held 4.307 GB), peak growth 0.119 GB while
gathering.

Inference only. CPU-tested (gloo, 2 and 3 ranks, fp32 tiny Flux): the fallback equals diffusers'
native CP output to 1e-5; the fused path's plumbing (segments, rotary rows, shard_rows, output
split, output projections) with the block replaced by a torch reference of it, likewise. On the
H200: tests/gpu/test_dit_blocks.py (every call fused, fused == serial bit for bit; the block's
segments: tests/gpu/test_block.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

from fa_a2a.models.base import _FusedBlockProcessor, _why_not_fused

__all__ = ["FusedFluxAttnProcessor", "ROUTE_NAME", "INSTALLS"]


ROUTE_NAME = "FusedFluxAttnProcessor"  # its calls per path: diffusers_backend.route_counts(ROUTE_NAME)


class FusedFluxAttnProcessor(_FusedBlockProcessor, FluxAttnProcessor):
    """FluxAttnProcessor whose attention under diffusers' Ulysses context parallelism is the fused
    block (fa_a2a.block: projection + pre-A2A fused, attention + post-A2A fused); diffusers' own
    processor (projection in torch, then the backend) where the block cannot run: no context
    parallelism or ring degree > 1, a backend other than fa-a2a's "auto"/"fused"/"serial" (impl
    "reference" / "nccl"), CPU tensors, not SM90, dtype not bf16/fp16, head dim not 64/128, an
    attention mask, autograd, fused to_qkv, q/k norms other than RMSNorm(eps 1e-6) with weight,
    tensor parallelism (the module docstring). Install with enable_fused_projection(model)."""

    ROUTE_NAME = ROUTE_NAME

    def __call__(self, attn: FluxAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb=None) -> torch.Tensor:
        why = _why_not_fused(self, attn, hidden_states, encoder_hidden_states, attention_mask)
        if why is not None:
            self._fallback(why)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        out = self._attend(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        if encoder_hidden_states is None:
            return out
        J = encoder_hidden_states.shape[1]
        text, image = out[:, :J], out[:, J:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


INSTALLS = ((FluxAttention, FluxAttnProcessor, FusedFluxAttnProcessor),)  # fa_a2a.models.registry installs it
