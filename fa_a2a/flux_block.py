"""Flux's attention under diffusers' context parallelism as the fused attention block.

With the fa-a2a backend (fa_a2a.diffusers_backend) diffusers' FluxAttnProcessor projects q/k/v in
torch (three Linears, RMSNorm, RoPE) and the backend runs the pre-A2A, FA4 and the post-A2A.
`enable_fused_projection(model)` installs FusedFluxAttnProcessor on every FluxAttention of the
model instead, which hands the hidden states to fa_a2a.block: the QKV projection with the
pre-A2A in its GEMM epilogue (bias, per-head RMSNorm, RoPE), then FA4 with the post-A2A in its
epilogue, both A2As inside the two compute kernels.

    enable_ulysses(model)                 # fa_a2a.diffusers_backend: backend + diffusers' CP
    enable_fused_projection(model)        # this module (before or after enable_ulysses)

QwenImage's and Flux2's processors (fa_a2a.dit_blocks) share this module's glue (_FusedBlockProcessor:
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
(hidden states that require grad: the fused block has no backward); fused to_qkv projections; q/k norms
that are not RMSNorm with weight and eps 1e-6 (the epilogue's); channels not a multiple of 8; heads
split by tensor parallelism. Every fact is the same on all ranks, so all ranks take the same path;
each reason is logged once and the calls per path are counted
(fa_a2a.diffusers_backend.route_counts(ROUTE_NAME)).

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
split, output projections) with the block replaced by a torch reference of it, likewise. Not yet
run on a GPU (tests/gpu/test_flux_block.py; the block's segments: tests/gpu/test_block.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

from cute_kernels.limits import DTYPES as KERNEL_DTYPES, HEAD_DIMS as KERNEL_HEAD_DIMS
from fa_a2a import diffusers_backend
from fa_a2a.block import EPS, Segment, UlyssesQKVAttention, is_rms_norm, ulysses_qkv_attention
from fa_a2a.problem import BLOCK_IMPLS, split_impl

__all__ = ["FusedFluxAttnProcessor", "attention_weights", "enable_fused_projection", "ROUTE_NAME"]

logger = logging.getLogger(__name__)

ROUTE_NAME = "FusedFluxAttnProcessor"  # its calls per path: diffusers_backend.route_counts(ROUTE_NAME)
_logged: set = set()


def _backend_name(backend) -> str:
    """The name of attention backend `backend` (an AttentionBackendName, or None: diffusers' active one)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if backend is None:
        backend, _ = _AttentionBackendRegistry.get_active_backend()
    return getattr(backend, "value", backend)


def _backend_impl(backend) -> Optional[str]:
    """The impl of the fa-a2a backend `backend`, None when it is not a registered fa-a2a backend."""
    return diffusers_backend.backend_impl(_backend_name(backend))


def _head_dim(attn) -> int:
    """attn's head dim: Flux's and Flux2's head_dim; diffusers' Attention (QwenImage) has none: inner_dim / heads."""
    d = getattr(attn, "head_dim", None)
    return d if isinstance(d, int) else attn.inner_dim // attn.heads


def _norm_ok(norm, head_dim: int) -> bool:
    """A per-head RMSNorm the epilogue computes: torch's RMSNorm or diffusers' (no bias), with a weight
    of [head_dim] and eps 1e-6 (anything else, LayerNorm included: diffusers' processor)."""
    return (is_rms_norm(norm) and norm.weight is not None and norm.eps == EPS
            and tuple(norm.weight.shape) == (head_dim,))


def _why_not_block(proc, attn, hidden_states, encoder_hidden_states, attention_mask) -> Optional[str]:
    """The reasons every fused processor shares (context parallelism, backend, device, dtype, head
    dim, mask, autograd); None: the block can run as far as these go. Only facts every rank shares."""
    cp = proc._parallel_config.context_parallel_config if proc._parallel_config is not None else None
    if cp is None or cp.ulysses_degree * cp.ring_degree == 1:
        return "no context parallelism"
    if cp.ring_degree > 1:
        return "ring degree > 1"
    impl = _backend_impl(proc._attention_backend)
    if impl is None or split_impl(impl)[0] not in BLOCK_IMPLS:
        return (f"attention backend {getattr(proc._attention_backend, 'value', proc._attention_backend)!r} is not "
                f"an fa-a2a backend with impl in {BLOCK_IMPLS} (impl {impl!r})")
    x = hidden_states
    if not x.is_cuda:
        return "CPU tensors"
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not SM90 (the fused projection is an SM90 kernel)"
    if x.dtype not in KERNEL_DTYPES:
        return f"{x.dtype} tensors (the kernels take bfloat16/float16)"
    if _head_dim(attn) not in KERNEL_HEAD_DIMS:
        return f"head dim {_head_dim(attn)} (the kernels take 64 or 128)"
    if attention_mask is not None:
        return "attention mask"
    if torch.is_grad_enabled() and (x.requires_grad or (encoder_hidden_states is not None
                                                        and encoder_hidden_states.requires_grad)):
        return "autograd (the fused block has no backward)"
    return None


def _why_not_layers(attn, x, linears, norms, widths) -> Optional[str]:
    """The reasons in attn's projection layers: q/k norms the epilogue cannot compute, heads split by
    tensor parallelism (a Linear narrower than `widths`, its out_features unsharded), weights of
    another dtype/device, channels not a multiple of 8."""
    if not all(_norm_ok(n, _head_dim(attn)) for n in norms):
        return f"q/k norms other than a per-head RMSNorm with weight and eps {EPS}"
    if any(lin.out_features != w for lin, w in zip(linears, widths)):
        return "heads split by tensor parallelism"
    if any(lin.weight.dtype != x.dtype or lin.weight.device != x.device for lin in linears):
        return "weights of another dtype or device than the hidden states"
    if any(lin.in_features % 8 for lin in linears):
        return "channels not a multiple of 8"
    return None


def _why_not_fused(proc, attn, hidden_states, encoder_hidden_states, attention_mask) -> Optional[str]:
    """Why this call runs diffusers' processor instead of the fused block (None: it can run fused):
    Flux's and Flux2's double-stream (and Flux's single-stream) attention. Only facts that every
    rank shares."""
    why = _why_not_block(proc, attn, hidden_states, encoder_hidden_states, attention_mask)
    if why is not None:
        return why
    if getattr(attn, "fused_projections", False):
        return "fused to_qkv projections"
    joint = encoder_hidden_states is not None
    if joint and attn.added_kv_proj_dim is None:
        return "encoder_hidden_states without add_q/k/v_proj"
    groups = _layers(attn)[:2 if joint else 1]
    linears = [m for layers, _ in groups for m in layers]
    return _why_not_layers(attn, hidden_states, linears, [n for _, norms in groups for n in norms],
                           [attn.heads * _head_dim(attn)] * len(linears))


class _FusedBlockProcessor:
    """What the fused processors share (this one, fa_a2a.dit_blocks'): the route count and the
    fallback log (`_fallback`), the module's gathered weights (`_weights`), the block call on the
    rank's rows (`_attend`). A subclass names its ROUTE_NAME and how its rows become segments."""

    ROUTE_NAME: str = ""
    _block = None  # (key, UlyssesQKVAttention): the gathered weights of the module

    def _fallback(self, why: str) -> None:
        diffusers_backend.count_route(self.ROUTE_NAME, "fallback")
        if (self.ROUTE_NAME, why) not in _logged:
            _logged.add((self.ROUTE_NAME, why))
            base = type(self).__mro__[2].__name__  # diffusers' processor (after this mixin)
            logger.warning("%s: %s -> diffusers' %s (projection in torch, then the attention backend); logged once",
                           type(self).__name__, why, base)

    def _attend(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor],
                rotary) -> torch.Tensor:
        """The fused block on the rank's [text shard; image shard] rows -> [B, J + I, H*D]."""
        diffusers_backend.count_route(self.ROUTE_NAME, "fused")
        cp = self._parallel_config.context_parallel_config
        group = cp._ulysses_mesh.get_group()
        impl = _backend_impl(self._attention_backend)
        J = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        rows = J + hidden_states.shape[1]
        shard_rows = _shard_rows(rows, group, cp.ulysses_anything)
        segments = self._segments(self._weights(attn, group), hidden_states, encoder_hidden_states, rotary)
        pace = diffusers_backend.backend_pace(_backend_name(self._attention_backend))
        return ulysses_qkv_attention(segments, group=group, impl=impl, shard_rows=shard_rows, pace=pace).flatten(2, 3)

    @staticmethod
    def _segments(mod, hidden_states, encoder_hidden_states, image_rotary_emb) -> list:
        """Flux's and Flux2's rows as the block's segments: [text (add_*); image (to_*)], RoPE (cos,
        sin) over the rank's [text; image] rows."""
        J = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        rot = _split_rotary(image_rotary_emb, J, J + hidden_states.shape[1])
        segments = [Segment(hidden_states.contiguous(), mod.proj, rot[1])]
        if encoder_hidden_states is not None:
            segments.insert(0, Segment(encoder_hidden_states.contiguous(), mod.joint_proj, rot[0]))
        return segments

    def _weights(self, attn, group) -> UlyssesQKVAttention:
        """The module's weights gathered for the group (built once; rebuilt when a weight changes).
        The module's Linears then hold views of them (attention_weights): one copy."""
        key = (id(group), self._weight_facts(attn))
        if self._block is None or self._block[0] != key:
            self._block = None  # the old gathered weights go as the Linears move to the new ones
            mod = self._gather(attn, group)
            self._block = ((id(group), self._weight_facts(attn)), mod)  # (the Linears' pointers changed)
        return self._block[1]

    @staticmethod
    def _gather(attn, group) -> UlyssesQKVAttention:
        return attention_weights(attn, group=group)

    @staticmethod
    def _weight_facts(attn) -> tuple:
        return _weight_facts(attn)


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


def _layers(attn) -> tuple:
    """attn's (q, k, v Linears, q/k norms) groups: the image rows' (to_*), the text rows' (add_*)
    (diffusers' names: FluxAttention, Flux2Attention, QwenImage's Attention)."""
    groups = [((attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))]
    if attn.added_kv_proj_dim is not None:
        groups.append(((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), (attn.norm_added_q, attn.norm_added_k)))
    return tuple(groups)


def _weight_facts(attn) -> tuple:
    """What the gathered weights depend on: every weight's and bias's pointer, version, dtype and device."""
    modules = [m for layers, norms in _layers(attn) for m in layers + norms]
    tensors = [t for m in modules for t in (m.weight, getattr(m, "bias", None)) if t is not None]
    return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)


def attention_weights(attn, share_weights: bool = True, **kwargs) -> UlyssesQKVAttention:
    """attn's q/k/v projections (and the text rows' add_*) as the fused block's weights in
    destination order (UlyssesQKVAttention.from_linear): with share_weights the Linears' weights
    and biases become views of them, so the model and the block hold one copy. kwargs: group or
    world_size (the ranks the weights are gathered for)."""
    (layers, norms), *text = _layers(attn)
    extra = {}
    if text:
        (tq, tk, tv), (tnq, tnk) = text[0]
        extra = dict(add_q=tq, add_k=tk, add_v=tv, norm_added_q=tnq, norm_added_k=tnk)
    return UlyssesQKVAttention.from_linear(*layers, head_dim=_head_dim(attn), norm_q=norms[0], norm_k=norms[1],
                                           share_weights=share_weights, **extra, **kwargs)


def _split_rotary(image_rotary_emb, J: int, rows: int):
    """diffusers' (cos, sin) over the rank's [text; image] rows -> (text's, image's) pairs (None, None
    without RoPE)."""
    if image_rotary_emb is None:
        return None, None
    if not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2:
        raise ValueError(f"image_rotary_emb: expected None or a (cos, sin) pair, got {type(image_rotary_emb).__name__}")
    cos, sin = image_rotary_emb
    if cos.shape[0] != rows or sin.shape[0] != rows:
        raise ValueError(f"image_rotary_emb: expected cos, sin of {rows} rows (the rank's text and image rows), got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    return (cos[:J], sin[:J]), (cos[J:], sin[J:])


def _shard_rows(rows: int, group, ulysses_anything: bool) -> Optional[list]:
    """Every rank's rows (uneven shards of ulysses_anything) as shard_rows, None when all are equal.
    Exchanged on every call, as the backend does: ranks that disagree on ulysses_anything raise
    the same ValueError here (diffusers_backend.rows_per_rank) instead of parting ways later."""
    from fa_a2a import diffusers_backend

    every = [q for q, _ in diffusers_backend.rows_per_rank(rows, rows, group, ulysses_anything=ulysses_anything)]
    return every if len(set(every)) > 1 else None


def _installs() -> tuple:
    """(attention module class, diffusers' processor class, fused processor class) of every model
    the fused block serves: Flux here, Flux2 and QwenImage in fa_a2a.dit_blocks."""
    from fa_a2a import dit_blocks

    return ((FluxAttention, FluxAttnProcessor, FusedFluxAttnProcessor),) + dit_blocks.INSTALLS


def enable_fused_projection(model):
    """Install the fused processor on every attention module of `model` whose processor is diffusers'
    own: FusedFluxAttnProcessor for FluxAttnProcessor (Flux), and fa_a2a.dit_blocks' for Flux2's
    Flux2AttnProcessor / Flux2ParallelSelfAttnProcessor and QwenImage's
    QwenDoubleStreamAttnProcessor2_0 (others, e.g. IP-Adapter or KV-cache processors, are left as
    they are), keeping the processor's attention backend and parallel config (so before or after
    set_attention_backend / enable_parallelism / enable_ulysses). Returns the model; ValueError
    when no module qualifies."""
    installs = _installs()
    n = 0
    for module in model.modules():
        for module_cls, base, fused in installs:
            if isinstance(module, module_cls) and type(module.processor) in (base, fused):
                old = module.processor
                if type(old) is base:
                    new = fused()
                    new._attention_backend, new._parallel_config = old._attention_backend, old._parallel_config
                    module.set_processor(new)
                n += 1
                break
    if n == 0:
        raise ValueError(f"model: expected FluxAttention modules (or Flux2's, QwenImage's attention) with diffusers' "
                         f"processors (a Flux, Flux2 or QwenImage transformer), found none in {type(model).__name__}")
    return model
