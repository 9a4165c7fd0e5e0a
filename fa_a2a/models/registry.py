"""enable_fused_projection: the fused processor of every model fa-a2a serves, installed on a model.

A model is one module that names its (attention module class, diffusers' processor class, fused
processor class) triples in INSTALLS: fa_a2a.models.flux (Flux), fa_a2a.models.dit_blocks
(QwenImage, Flux2); MODELS lists those modules.
"""

from __future__ import annotations

from fa_a2a.models import dit_blocks, flux

__all__ = ["MODELS", "enable_fused_projection"]

MODELS = (flux, dit_blocks)


def _installs() -> tuple:
    """(attention module class, diffusers' processor class, fused processor class) of every model."""
    return tuple(triple for model in MODELS for triple in model.INSTALLS)


def enable_fused_projection(model):
    """Install the fused processor on every attention module of `model` whose processor is diffusers'
    own: FusedFluxAttnProcessor for FluxAttnProcessor (Flux), and fa_a2a.models.dit_blocks' for Flux2's
    Flux2AttnProcessor / Flux2ParallelSelfAttnProcessor and QwenImage's
    QwenDoubleStreamAttnProcessor2_0 (others, e.g. IP-Adapter or KV-cache processors, are left as
    they are), keeping the processor's attention backend and parallel config (so before or after
    set_attention_backend / enable_parallelism / enable_ulysses). Returns the model; ValueError
    when no module qualifies."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a diffusers model (an nn.Module), got {type(model).__name__}")
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
