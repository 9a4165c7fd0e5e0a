"""fa-a2a: FlashAttention-4 with the Ulysses post-attention All-to-All fused into its epilogue.

Public names are imported lazily, so `import fa_a2a` (and the CPU-only tools such as
`python -m fa_a2a.bench` without a GPU) do not load the CuTe DSL.
"""

_EXPORTS = {
    "ulysses_attention": "fa_a2a.op",
    "ulysses_attention_emulated": "fa_a2a.op",
    "ulysses_attention_out_proj": "fa_a2a.op",
    "ulysses_attention_out_proj_emulated": "fa_a2a.op",
    "pre_a2a": "fa_a2a.op",
    "post_a2a": "fa_a2a.op",
    "UlyssesAttention": "fa_a2a.attention",
    "UlyssesQKVAttention": "fa_a2a.block",
    "ulysses_qkv_attention": "fa_a2a.block",
    "reload_weights": "fa_a2a.block",
    "fa4_forward": "cute_kernels.fa4",
    "fa4_a2a_forward": "cute_kernels.fa4",
    "PlatformModel": "fa_a2a.tools.xstage",
    "register_diffusers_backend": "fa_a2a.models.diffusers_backend",
    "enable_ulysses": "fa_a2a.models.diffusers_backend",
    "enable_fused_projection": "fa_a2a.models.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fa_a2a' has no attribute {name!r}")
