"""The fused Flux, QwenImage and Flux2 attention processors (fa_a2a.models.flux, fa_a2a.models.dit_blocks) on one
GPU: 2 processes share it (bf16).

Tiny Flux (2 double- + 2 single-stream blocks), QwenImage (2 double-stream blocks) and Flux2 (2
double- + 2 single-stream blocks) at FA4's head dim (4 x 128 heads, 1024 image tokens) under
diffusers' `enable_parallelism(ContextParallelConfig(ulysses_degree=2))`, on even shards (64 text
tokens: 32 + 512 rows a rank) and on ulysses_anything's uneven ones (63 text tokens: 32 + 512 and
31 + 512 rows, as shard_rows). Each rank runs the single-device model in fp32 (ref, on the same
bf16 weights) and in bf16 (base: diffusers' SDPA), the CP model with the attention-only fused
backend (diffusers' projection in torch, then fa_a2a.ulysses_attention), then with the fused
processors installed (enable_fused_projection: the fused projection/pre-A2A and the fused
FA4/post-A2A of fa_a2a.block) for the backend's impl "fused" and "serial".
Checks: every attention call took the fused block (each processor's route counts; the backend saw
no call); block "fused" == block "serial" bit for bit (same arithmetic); FA4's rule against ref:
max|out - ref| <= 2 max|base - ref| + atol (and the same for the means); and the block within
2 max|base - ref| + atol of the attention-only path: the two differ only in the projection's
rounding (the fused epilogue rounds q/k to bf16 once, diffusers after the Linear, the RMSNorm and
the RoPE), an error of the bf16 model's own size. One copy of the weights: every fused module's
q/k/v Linears (the image rows' to_*, the text rows' add_*; Flux2's single-stream: to_qkv_mlp_proj's
first 3*inner rows) are views of the processor's gathered weight of their rows (proj, joint_proj),
the memory held grows by at most 5% of the q/k/v weights, and diffusers' processors on the views
give the attention-only output of before the gathering bit for bit.

Test shims: diffusers' gathers of the model output go through host memory (gloo, CUDA tensors;
uneven ones padded), and logger.warning_once is defined when absent. FA_A2A_DIT_BLOCKS_JSON: a
path for rank 0's errors and weight bytes per model and case.
"""

import copy
import importlib.util
import json
import logging
import os

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fa_a2a.models.diffusers_backend import _all_gather_anything_padded  # noqa: E402
from tests.gpu.test_dit import _errors, _flux, _on  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "flux_block_memory", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "flux_block_memory.py"))
memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)

HEADS, HEAD_DIM = 4, 128
CASES = ((False, 64), (True, 63))  # (ulysses_anything, text tokens)
IMPLS = ("fused", "serial")
H = W = 32  # 1024 image tokens


def _flux_inputs(J, g):  # (the model: test_dit's tiny Flux, 2 + 2 blocks of 4 x 128 heads)
    ids = torch.zeros(H, W, 3)
    ids[..., 1], ids[..., 2] = torch.arange(H)[:, None], torch.arange(W)[None, :]
    return dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                encoder_hidden_states=torch.randn(1, J, 64, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.rand(1, generator=g),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(J, 3))


def _qwen():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=1, in_channels=16, out_channels=16, num_layers=2,
                                       attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=64,
                                       axes_dims_rope=(16, 56, 56))


def _qwen_inputs(J, g):
    return dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                encoder_hidden_states=torch.randn(1, J, 64, generator=g),
                timestep=torch.rand(1, generator=g), img_shapes=[[(1, H, W)]])


def _flux2():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=64,
                                   axes_dims_rope=(32, 32, 32, 32), guidance_embeds=False)


def _flux2_inputs(J, g):
    ids = torch.zeros(H, W, 4)
    ids[..., 1], ids[..., 2] = torch.arange(H)[:, None], torch.arange(W)[None, :]
    txt = torch.zeros(1, J, 4)
    txt[..., 3] = torch.arange(J)
    return dict(hidden_states=torch.randn(1, H * W, 16, generator=g),
                encoder_hidden_states=torch.randn(1, J, 64, generator=g), timestep=torch.rand(1, generator=g),
                img_ids=ids.reshape(1, -1, 4), txt_ids=txt)


def _models():
    from fa_a2a.models import dit_blocks
    from fa_a2a.models import flux as flux_block
    from fa_a2a.models import base as fused_base
    from fa_a2a.models import registry

    # name -> (builder, inputs, {fused processor: attention calls per forward = its modules})
    return {"flux": (_flux, _flux_inputs, {flux_block.FusedFluxAttnProcessor: 4}),
            "qwenimage": (_qwen, _qwen_inputs, {dit_blocks.FusedQwenImageAttnProcessor: 2}),
            "flux2": (_flux2, _flux2_inputs, {dit_blocks.FusedFlux2AttnProcessor: 2,
                                              dit_blocks.FusedFlux2ParallelSelfAttnProcessor: 2})}


def _gather_anything_through_host(tensor, dim, group):
    return _all_gather_anything_padded(tensor.cpu(), dim, group).to(tensor.device)


def _counts(procs):
    from fa_a2a.models import diffusers_backend as backend

    return {cls.__name__: backend.route_counts(cls.ROUTE_NAME) for cls in procs}


def _check(P, group, rank):
    import diffusers.hooks.context_parallel as cp_hooks
    from diffusers import ContextParallelConfig

    from fa_a2a.models import diffusers_backend as backend
    from fa_a2a.models import flux as flux_block
    from fa_a2a.models import base as fused_base
    from fa_a2a.models import registry
    from ulysses.transport import close_transports

    backend.gather_cuda_over_gloo()
    cp_hooks._all_gather_anything = _gather_anything_through_host
    if not hasattr(logging.Logger, "warning_once"):  # diffusers' CP calls it; transformers adds it on import
        logging.Logger.warning_once = logging.Logger.warning
    names = {impl: backend.register_diffusers_backend(f"fa_a2a_{impl}", impl) for impl in IMPLS}
    results = {}
    torch.set_grad_enabled(False)
    for model_name, (build, inputs, procs) in _models().items():
        n_attn = sum(procs.values())
        for anything, J in CASES:
            case = f"{model_name} ulysses_anything={anything} J={J}"
            torch.manual_seed(0)
            model = build().eval().to("cuda", torch.bfloat16)
            x = inputs(J, torch.Generator().manual_seed(1))
            ref = copy.deepcopy(model).float()(**_on(x, torch.float32), return_dict=False)[0]
            base = model(**_on(x, torch.bfloat16), return_dict=False)[0]
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P, ulysses_anything=anything))
            model.set_attention_backend(names["fused"])
            backend.route_counts(names["fused"], reset=True)
            attn_only = model(**_on(x, torch.bfloat16), return_dict=False)[0]
            assert backend.route_counts(names["fused"]) == {"ulysses": n_attn}, case
            results[f"{case} attention-only"] = e_attn = _errors(attn_only, base, ref)
            registry.enable_fused_projection(model)
            outs = {}
            for impl, name in names.items():
                model.set_attention_backend(name)
                for cls in procs:
                    backend.route_counts(cls.ROUTE_NAME, reset=True)
                backend.route_counts(name, reset=True)
                out = model(**_on(x, torch.bfloat16), return_dict=False)[0]
                what = f"rank {rank} {case} block {impl}"
                counts = _counts(procs)
                assert counts == {cls.__name__: {"fused": n} for cls, n in procs.items()}, (what, counts)
                assert backend.route_counts(name) == {}, (what, backend.route_counts(name))
                assert torch.isfinite(out).all(), f"{what}: non-finite output"
                e = _errors(out, base, ref)
                e["max_diff_attention_only"] = (out.float() - attn_only.float()).abs().max().item()
                results[f"{case} block {impl}"] = e
                assert e["max_err"] <= 2 * e["base_max_err"] + e["atol"], (what, e)
                assert e["mean_err"] <= 2 * e["base_mean_err"] + e["atol"], (what, e)
                assert e["max_diff_attention_only"] <= 2 * e_attn["base_max_err"] + e_attn["atol"], (what, e)
                outs[impl] = out
            assert torch.equal(outs["fused"], outs["serial"]), f"rank {rank} {case}: block fused and serial differ"
            results[f"{case} weights"] = _check_one_copy(model, x, attn_only, procs, names["fused"],
                                                         f"rank {rank} {case}")
    torch.cuda.synchronize()
    close_transports()
    if rank == 0 and os.environ.get("FA_A2A_DIT_BLOCKS_JSON"):
        with open(os.environ["FA_A2A_DIT_BLOCKS_JSON"], "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), P=P, results=results), f, indent=1)


def _qkv_groups(attn):
    """The Linears whose weights the block's q/k/v weights are (views of), one list per gathered
    weight: the image rows' (proj), then the text rows' (joint_proj) where the module has them."""
    from fa_a2a.models import dit_blocks
    from fa_a2a.models import flux as flux_block
    from fa_a2a.models import base as fused_base
    from fa_a2a.models import registry

    if isinstance(attn, dit_blocks.Flux2ParallelSelfAttention):
        return [[attn.to_qkv_mlp_proj]]
    return [list(layers) for layers, _ in fused_base._layers(attn)]


def _check_one_copy(model, x, attn_only, procs, backend_name, what):
    """The processors' gathered weights are the model's Linears (views: each of proj, joint_proj
    shares its storage with its rows' Linears): the memory held grows by at most 5% of the q/k/v
    weights, and diffusers' own processors on the views (the attention-only backend, as attn_only
    ran before the gathering) give attn_only bit for bit. One fused module per attention call."""
    from fa_a2a.models import flux as flux_block
    from fa_a2a.models import base as fused_base
    from fa_a2a.models import registry

    fused = {cls: base for _, base, cls in registry._installs()}
    attns = [m for m in model.modules() if type(getattr(m, "processor", None)) in fused]
    found = {cls: sum(type(a.processor) is cls for a in attns) for cls in {type(a.processor) for a in attns}}
    assert found == procs, (what, found)
    mods = [a.processor._block[1] for a in attns]
    qkv = 0
    for a, mod in zip(attns, mods):
        projs = [p for p in (mod.proj, mod.joint_proj) if p is not None]
        groups = _qkv_groups(a)
        assert len(groups) == len(projs), (what, type(a).__name__, len(groups), len(projs))
        for layers, proj in zip(groups, projs):
            ptr = proj.weight.untyped_storage().data_ptr()
            assert all(m.weight.untyped_storage().data_ptr() == ptr for m in layers), f"{what}: not views"
            # the q/k/v weights: the smaller of the gathered weight and its Linears (Flux2's to_qkv_mlp_proj
            # also holds the MLP rows)
            qkv += min(proj.weight.nbytes, sum(m.weight.nbytes for m in layers))
    extra = memory.storage_bytes(memory.held_tensors(model, mods)) - memory.storage_bytes(memory.held_tensors(model, []))
    assert extra <= 0.05 * qkv, (what, extra, qkv)
    for a in attns:  # back to diffusers' processors, keeping the backend and the parallel config
        old = a.processor
        new = fused[type(old)]()
        new._attention_backend, new._parallel_config = old._attention_backend, old._parallel_config
        a.set_processor(new)
    model.set_attention_backend(backend_name)
    again = model(**_on(x, torch.bfloat16), return_dict=False)[0]
    assert torch.equal(again, attn_only), f"{what}: diffusers' processors on the views differ from before"
    return dict(qkv_bytes=qkv, extra_bytes=extra)


def test_dit_fused_blocks_two_processes_one_gpu():
    os.environ.setdefault("FA_A2A_TIMEOUT_S", "600")  # first calls compile kernels while the peer waits
    run_on_gloo_groups(_check, (2,), cuda=True, timeout_s=600)
