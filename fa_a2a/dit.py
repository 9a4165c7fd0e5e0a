"""Ulysses sequence parallelism for diffusers' Flux transformer, without editing the model's code.

`parallelize_flux(model, group=..., impl=...)` installs two things on a FluxTransformer2DModel:

  UlyssesFluxAttnProcessor on every FluxAttention (in place of diffusers' FluxAttnProcessor).
      A rank holds its shard of the image tokens and all text tokens (replicated, as in xDiT's
      USP for MMDiT). The processor projects q/k/v, applies the QK norms and the rotary
      embedding exactly as diffusers does (per token: a shard's rows get the shard's positions),
      then calls fa_a2a.op.ulysses_attention(img_q, img_k, img_v, joint=(txt_q, txt_k, txt_v)):
      image rows go through pre-A2A -> attention -> post-A2A, the text rows join every rank's
      gathered sequence with that rank's heads and their outputs are all-gathered over heads.
      It returns diffusers' layout, so the blocks around the attention run unchanged.

  Hooks on the model's input and output (xDiT's sequence split). Before forward, the image
      tokens `hidden_states` [B, S, C] and their position ids `img_ids` [S, 3] are cut to the
      rank's rows [r*S_loc, (r+1)*S_loc), S_loc = ceil(S/P), zero-padded when P does not divide S
      (ulysses.layout's convention; padded keys are masked through seq_len). Text stays whole.
      Flux builds its rotary table from cat(txt_ids, img_ids), so sharded ids give each rank the
      rotary rows of its own tokens. After forward, the ranks' output rows are all-gathered
      along the sequence and the padding dropped: every rank returns the full [B, S, C_out].

Everything outside the attention is per token (linears, norms, timestep modulation, MLPs) or per
sample (timestep and pooled-text embeddings), so each rank computes its rows of every activation
as the single-device model does; only the attention mixes tokens, and it is the Ulysses op.

Emulated ranks (`parallelize_flux(model, emulated_ranks=P)`): one process plays all P ranks in
one forward. The hook stacks the P shards along the batch ([P*B, S_loc, C], shard-major; text,
pooled projections and timesteps repeated), the processor applies each shard's rotary rows and
calls fa_a2a.op.ulysses_attention_emulated (the real kernels over one local buffer of P windows),
and the output hook unstacks. Used for single-GPU tests; impl "fused", "serial" or "reference".

Tested with diffusers 0.42.1. Not supported: attention masks, ControlNet residuals, IP-Adapter
(its processor is replaced like the others).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fa_a2a.op import EMULATED_IMPLS, IMPLS

__all__ = [
    "UlyssesFluxAttnProcessor",
    "FluxUlysses",
    "parallelize_flux",
    "shard_rows",
    "gather_rows",
]


def _check_impl(impl: str, emulated: bool) -> str:
    allowed = EMULATED_IMPLS if emulated else IMPLS
    if impl not in allowed:
        raise ValueError(f"impl: expected one of {allowed}{' with emulated ranks' if emulated else ''}, got {impl!r}")
    return impl


def _group_rank_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group: torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_rows(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rows [rank*n, (rank+1)*n) of x along `dim`, n = ceil(len/world_size), zero-padded to n rows."""
    total = x.shape[dim]
    n = -(-total // world_size)
    start = min(rank * n, total)
    stop = min(start + n, total)
    part = x.narrow(dim, start, stop - start)
    if stop - start < n:
        pad_shape = list(x.shape)
        pad_shape[dim] = n - (stop - start)
        part = torch.cat([part, x.new_zeros(pad_shape)], dim=dim)
    return part.contiguous()


def gather_rows(x: torch.Tensor, seq_len: int, *, group=None, dim: int = 1) -> torch.Tensor:
    """All-gather the ranks' shards along `dim` and keep the first seq_len rows.

    gloo cannot gather CUDA tensors (ranks sharing one GPU use a gloo group): then the shard goes
    through host memory, once per forward, for the model's output only.
    """
    _, world_size = _group_rank_size(group)
    if world_size == 1:
        return x.narrow(dim, 0, seq_len)
    send = x.contiguous()
    through_host = send.is_cuda and dist.get_backend(group) == "gloo"
    if through_host:
        send = send.cpu()
    parts = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(parts, send, group=group)
    full = torch.cat(parts, dim=dim).narrow(dim, 0, seq_len)
    return full.to(x.device) if through_host else full


@dataclass
class _ShardState:
    """Facts of the current forward: set by the input hook, read by the processors."""

    text_len: int | None = None    # J: text tokens, replicated on every rank
    seq_len: int | None = None     # S: valid image tokens of the full sequence
    batch: int | None = None       # B of the caller (emulated ranks stack P*B rows)
    rotary: list = field(default_factory=list)  # emulated ranks: (cos, sin) of each shard


class UlyssesFluxAttnProcessor:
    """Drop-in for diffusers' FluxAttnProcessor that runs the attention under Ulysses.

    Called on a rank's shard: `hidden_states` holds the rank's image rows (double-stream blocks,
    text in `encoder_hidden_states`) or cat(text, image rows) (single-stream blocks; the text
    length J comes from `state.text_len`, set by the model's input hook). `image_rotary_emb` must
    hold the rotary rows of exactly those tokens, text first: what Flux computes from sharded
    img_ids. Returns what FluxAttnProcessor returns, for the same rows.
    emulated_ranks=P: the batch holds P stacked shards (see the module docstring).
    """

    def __init__(self, *, group=None, impl: str = "fused", emulated_ranks: int | None = None,
                 state: _ShardState | None = None):
        self.emulated = emulated_ranks is not None
        if self.emulated:
            if group is not None:
                raise ValueError("group: must be None with emulated_ranks")
            if isinstance(emulated_ranks, bool) or not isinstance(emulated_ranks, int) or emulated_ranks < 1:
                raise ValueError(f"emulated_ranks: expected an int >= 1, got {emulated_ranks!r}")
            self.rank, self.world_size = 0, emulated_ranks
        else:
            self.rank, self.world_size = _group_rank_size(group)
        self.group = group
        self.impl = _check_impl(impl, self.emulated)
        self.state = state if state is not None else _ShardState()

    # ---- the attention core ----------------------------------------------------------------
    def _attention(self, q, k, v, joint, seq_len):
        """q/k/v [B', S_loc, H, D] (B' = P*B when emulated), joint or None -> (out, joint_out or None)."""
        if not self.emulated:
            from fa_a2a.op import ulysses_attention

            res = ulysses_attention(q, k, v, group=self.group, impl=self.impl, joint=joint, seq_len=seq_len)
            return res if joint is not None else (res, None)
        from fa_a2a.op import ulysses_attention_emulated

        P = self.world_size
        qs, ks, vs = (list(t.chunk(P, dim=0)) for t in (q, k, v))
        if joint is not None:
            B = q.shape[0] // P
            joint = tuple(t[:B] for t in joint)  # every shard's text rows are the same
            outs, jouts = ulysses_attention_emulated(qs, ks, vs, impl=self.impl, joint=joint, seq_len=seq_len)
            return torch.cat(outs, dim=0), torch.cat(jouts, dim=0)
        outs = ulysses_attention_emulated(qs, ks, vs, impl=self.impl, seq_len=seq_len)
        return torch.cat(outs, dim=0), None

    def _rotary(self, x, image_rotary_emb):
        from diffusers.models.embeddings import apply_rotary_emb

        if self.emulated and self.state.rotary:
            parts = x.chunk(self.world_size, dim=0)
            return torch.cat([apply_rotary_emb(p, emb, sequence_dim=1)
                              for p, emb in zip(parts, self.state.rotary)], dim=0)
        if image_rotary_emb[0].shape[0] != x.shape[1]:
            raise ValueError(f"image_rotary_emb: {image_rotary_emb[0].shape[0]} rows for {x.shape[1]} "
                             "tokens (img_ids must be sharded like the image tokens)")
        return apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        if attention_mask is not None:
            raise ValueError("attention_mask: not supported by UlyssesFluxAttnProcessor")
        query, key, value, enc_q, enc_k, enc_v = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if encoder_hidden_states is not None:
            if attn.added_kv_proj_dim is None:
                raise ValueError("encoder_hidden_states: given to an attention without added KV projections")
            J = encoder_hidden_states.shape[1]
            enc_q = attn.norm_added_q(enc_q.unflatten(-1, (-1, attn.head_dim)))
            enc_k = attn.norm_added_k(enc_k.unflatten(-1, (-1, attn.head_dim)))
            enc_v = enc_v.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([enc_q, query], dim=1)
            key = torch.cat([enc_k, key], dim=1)
            value = torch.cat([enc_v, value], dim=1)
        else:
            # Single-stream block: hidden_states = cat(text, image rows); the input hook knows J.
            J = self.state.text_len
            if J is None:
                raise ValueError("state.text_len: unknown in a single-stream block; run the model through "
                                 "parallelize_flux (or set processor.state.text_len)")
            if not 0 <= J <= hidden_states.shape[1]:
                raise ValueError(f"state.text_len: {J} exceeds the {hidden_states.shape[1]} rows of hidden_states")

        # FluxAttnProcessor's per-token rotary, on [text | this rank's image rows].
        if image_rotary_emb is not None:
            query = self._rotary(query, image_rotary_emb)
            key = self._rotary(key, image_rotary_emb)

        q, k, v = (t[:, J:].contiguous() for t in (query, key, value))
        seq_len = self.state.seq_len if self.state.seq_len is not None else q.shape[1] * self.world_size
        joint = tuple(t[:, :J].contiguous() for t in (query, key, value)) if J else None
        out, joint_out = self._attention(q, k, v, joint, seq_len)  # padding rows come back as zeros
        if joint_out is not None:
            out = torch.cat([joint_out, out], dim=1)
        hidden_states = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [J, hidden_states.shape[1] - J], dim=1)
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


class FluxUlysses:
    """Handle of a Flux model running under Ulysses; `remove()` restores the model.

    Installs UlyssesFluxAttnProcessor on every attention, a forward pre-hook that shards the
    image tokens and img_ids, and a forward hook that gathers the output sample.
    """

    def __init__(self, model, *, group=None, impl: str = "fused", emulated_ranks: int | None = None):
        from diffusers import FluxTransformer2DModel

        if not isinstance(model, FluxTransformer2DModel):
            raise ValueError(f"model: expected a diffusers FluxTransformer2DModel, got {type(model).__name__}")
        self.model = model
        self.group = group
        self.state = _ShardState()
        self.processor = UlyssesFluxAttnProcessor(group=group, impl=impl, emulated_ranks=emulated_ranks,
                                                  state=self.state)
        self.rank, self.world_size = self.processor.rank, self.processor.world_size
        self.emulated = self.processor.emulated
        self._signature = inspect.signature(model.forward)
        self._saved = dict(model.attn_processors)
        model.set_attn_processor(self.processor)
        self._hooks = [
            model.register_forward_pre_hook(self._shard_inputs, with_kwargs=True),
            model.register_forward_hook(self._gather_output),
        ]

    @property
    def impl(self) -> str:
        return self.processor.impl

    @impl.setter
    def impl(self, value: str) -> None:
        self.processor.impl = _check_impl(value, self.emulated)

    def _shard_inputs(self, module, args, kwargs):
        bound = self._signature.bind(*args, **kwargs)
        a = bound.arguments
        hs, enc = a.get("hidden_states"), a.get("encoder_hidden_states")
        img_ids, txt_ids = a.get("img_ids"), a.get("txt_ids")
        if not isinstance(hs, torch.Tensor) or hs.dim() != 3:
            raise ValueError("hidden_states: expected image tokens [B, S, C]")
        if not isinstance(enc, torch.Tensor) or enc.dim() != 3:
            raise ValueError("encoder_hidden_states: expected text tokens [B, J, C]")
        if not isinstance(img_ids, torch.Tensor) or not isinstance(txt_ids, torch.Tensor):
            raise ValueError("img_ids, txt_ids: required (position ids [S, 3] and [J, 3])")
        img_ids = img_ids[0] if img_ids.dim() == 3 else img_ids  # deprecated batched form: Flux takes [0]
        txt_ids = txt_ids[0] if txt_ids.dim() == 3 else txt_ids
        B, S = hs.shape[:2]
        if img_ids.dim() != 2 or img_ids.shape[0] != S:
            raise ValueError(f"img_ids: expected [{S}, n_axes], got {list(img_ids.shape)}")
        for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if a.get(name) is not None:
                raise ValueError(f"{name}: not supported under Ulysses")
        P = self.world_size
        self.state.text_len, self.state.seq_len, self.state.batch = enc.shape[1], S, B
        if not self.emulated:
            a["hidden_states"] = shard_rows(hs, 1, self.rank, P)
            a["img_ids"] = shard_rows(img_ids, 0, self.rank, P)
            return bound.args, bound.kwargs
        # Emulated ranks: P shards stacked along the batch, shard-major; per-sample inputs repeated.
        a["hidden_states"] = torch.cat([shard_rows(hs, 1, r, P) for r in range(P)], dim=0)
        a["encoder_hidden_states"] = enc.repeat(P, 1, 1)
        for name in ("pooled_projections", "timestep", "guidance"):
            t = a.get(name)
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == B:
                a[name] = t.repeat(P, *([1] * (t.dim() - 1)))
        shards = [shard_rows(img_ids, 0, r, P) for r in range(P)]
        a["img_ids"], a["txt_ids"] = shards[0], txt_ids
        self.state.rotary = [self.model.pos_embed(torch.cat([txt_ids, s], dim=0)) for s in shards]
        return bound.args, bound.kwargs

    def _unshard(self, sample: torch.Tensor) -> torch.Tensor:
        S = self.state.seq_len
        if not self.emulated:
            return gather_rows(sample, S, group=self.group)
        P, B = self.world_size, self.state.batch
        return sample.unflatten(0, (P, B)).transpose(0, 1).flatten(1, 2)[:, :S]

    def _gather_output(self, module, args, output):
        self.state.rotary = []
        if isinstance(output, tuple):
            return (self._unshard(output[0]), *output[1:])
        output.sample = self._unshard(output.sample)
        return output

    def remove(self) -> None:
        """Put the original processors back and remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.model.set_attn_processor(dict(self._saved))


def parallelize_flux(model, *, group=None, impl: str = "fused", emulated_ranks: int | None = None) -> FluxUlysses:
    """Run a diffusers FluxTransformer2DModel under Ulysses on `group` (default: the world).

    Every rank calls the model with the same full inputs; each computes its shard and returns the
    full output. impl: "fused" (FA4 with the post-A2A in its epilogue), "serial" (A2A kernels
    around FA4), "nccl" (permute + all_to_all_single around FA4: ranks on distinct GPUs),
    "reference" (torch attention in fp32, any device; gloo or NCCL). emulated_ranks=P: one
    process plays P ranks (group must be None). Returns a handle; `handle.remove()` undoes it.
    """
    return FluxUlysses(model, group=group, impl=impl, emulated_ranks=emulated_ranks)
