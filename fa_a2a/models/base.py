"""What every fused model processor shares (FusedFluxAttnProcessor in fa_a2a.models.flux, QwenImage's
and Flux2's in fa_a2a.models.dit_blocks): the routing rules every rank decides alike (_why_not_block,
_why_not_fused), the base class (_FusedBlockProcessor: route counts, the fallback's log, the weights
gathered as views, the block call), the q/k/v layers of diffusers' attention modules and their
gathered weights (attention_weights), the rotary split and the ranks' row counts.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from cute_kernels.limits import DTYPES as KERNEL_DTYPES, HEAD_DIMS as KERNEL_HEAD_DIMS
from fa_a2a.block import (EPS, Segment, UlyssesQKVAttention, is_rms_norm, not_plain, ulysses_qkv_attention,
                          weight_facts)
from fa_a2a.engine.log import log_once
from fa_a2a.engine.problem import BLOCK_IMPLS, split_impl
from fa_a2a.models import diffusers_backend

__all__ = ["attention_weights"]

logger = logging.getLogger(__name__)

AUTOGRAD = "autograd (the fused block has no backward: diffusers' projection and the differentiable op)"


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
        return f"head dim {_head_dim(attn)} (the kernels take {' or '.join(map(str, KERNEL_HEAD_DIMS))})"
    if attention_mask is not None:
        return "attention mask"
    if torch.is_grad_enabled() and (x.requires_grad or (encoder_hidden_states is not None
                                                        and encoder_hidden_states.requires_grad)):
        return AUTOGRAD
    return None


def _why_not_layers(attn, x, linears, norms, widths) -> Optional[str]:
    """The reasons in attn's projection layers: layers other than plain nn.Linear (a LoRA adapter's
    wrapper computes more than its base weight), weights that require grad under grad mode (the
    fused block would cut their gradient), q/k norms the epilogue cannot compute, heads split by
    tensor parallelism (a Linear narrower than `widths`, its out_features unsharded), weights of
    another dtype/device, channels not a multiple of 8."""
    odd = [type(lin).__name__ for lin in linears if not isinstance(lin, torch.nn.Linear)]
    found = not_plain((*linears, *norms))  # the fused block reads the weights, not the layers' calls
    if odd or (found is not None and found[1] == "wrapper"):
        name = odd[0] if odd else type((*linears, *norms)[found[0]]).__name__
        return f"projection layers other than plain nn.Linear ({name}: a LoRA adapter or another wrapper)"
    if found is not None:
        return "projection layers with forward hooks (or a forward of their own)"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for m in (*linears, *norms)
                                       for t in (getattr(m, "weight", None), getattr(m, "bias", None))):
        return AUTOGRAD
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
    """What the fused processors share (this one, fa_a2a.models.dit_blocks'): the route count and the
    fallback log (`_fallback`), the module's gathered weights (`_weights`), the block call on the
    rank's rows (`_attend`). A subclass names its ROUTE_NAME and how its rows become segments."""

    ROUTE_NAME: str = ""
    _block = None  # (key, UlyssesQKVAttention): the gathered weights of the module

    def reload_weights(self) -> None:
        """Gather the module's weights again at the next call (after a `.data` write that weight_facts cannot
        see; fa_a2a.reload_weights(model) calls this)."""
        self._block = None

    def _fallback(self, why: str) -> None:
        diffusers_backend.count_route(self.ROUTE_NAME, "fallback")
        base = type(self).__mro__[2].__name__  # diffusers' processor (after this mixin)
        log_once(logger, ("processor fallback", self.ROUTE_NAME, why), logging.WARNING,
                 "%s: %s -> diffusers' %s (projection in torch, then the attention backend); logged once",
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


def _layers(attn) -> tuple:
    """attn's (q, k, v Linears, q/k norms) groups: the image rows' (to_*), the text rows' (add_*)
    (diffusers' names: FluxAttention, Flux2Attention, QwenImage's Attention)."""
    groups = [((attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))]
    if attn.added_kv_proj_dim is not None:
        groups.append(((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), (attn.norm_added_q, attn.norm_added_k)))
    return tuple(groups)


def _weight_facts(attn) -> tuple:
    """What the gathered weights depend on (fa_a2a.block.weight_facts of every weight and bias)."""
    modules = [m for layers, norms in _layers(attn) for m in layers + norms]
    return weight_facts(t for m in modules for t in (m.weight, getattr(m, "bias", None)) if t is not None)


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
    from fa_a2a.models import diffusers_backend

    every = [q for q, _ in diffusers_backend.rows_per_rank(rows, rows, group, ulysses_anything=ulysses_anything)]
    return every if len(set(every)) > 1 else None
