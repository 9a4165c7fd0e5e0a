"""The fused Flux attention processor (fa_a2a.flux_block) on one GPU: 2 processes share it (bf16).

Tiny Flux at FA4's head dim (4 x 128 heads, 2 double- + 2 single-stream blocks, 1024 image
tokens) under diffusers' `enable_parallelism(ContextParallelConfig(ulysses_degree=2))`, on even
shards (64 text tokens: 32 + 512 rows a rank) and on ulysses_anything's uneven ones (63 text
tokens: 32 + 512 and 31 + 512 rows, as shard_rows). Each rank runs the single-device model in
fp32 (ref, on the same bf16 weights) and in bf16 (base: diffusers' SDPA), the CP model with the
attention-only fused backend (diffusers' projection in torch, then fa_a2a.ulysses_attention), then
with FusedFluxAttnProcessor installed (enable_fused_projection: the fused projection/pre-A2A and
the fused FA4/post-A2A of fa_a2a.block) for the backend's impl "fused" and "serial".
Checks: every attention call took the fused block (the processor's route counts; the backend
saw no call); block "fused" == block "serial" bit for bit (same arithmetic); FA4's rule against
ref: max|out - ref| <= 2 max|base - ref| + atol (and the same for the means); and the block
within 2 max|base - ref| + atol of the attention-only path: the two differ only in the
projection's rounding (the fused epilogue rounds q/k to bf16 once, diffusers after the Linear,
the RMSNorm and the RoPE), an error of the bf16 model's own size. One copy of the weights: the
model's q/k/v Linears are views of the processors' gathered weights (the memory held grows by at
most 5% of the q/k/v weights), and diffusers' processor on them gives the attention-only output of
before the gathering bit for bit.

Test shims: diffusers' gathers of the model output go through host memory (gloo, CUDA tensors;
uneven ones padded), and logger.warning_once is defined when absent.
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

from fa_a2a.diffusers_backend import _all_gather_anything_padded  # noqa: E402
from tests.gpu.test_dit import _errors, _on  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "flux_block_memory", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "flux_block_memory.py"))
memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)

HEADS, HEAD_DIM = 4, 128
N_ATTN = 4  # 2 double-stream + 2 single-stream attention calls per forward
CASES = ((False, 64), (True, 63))  # (ulysses_anything, text tokens)
IMPLS = ("fused", "serial")


def _flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                  attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=64,
                                  pooled_projection_dim=32, axes_dims_rope=(16, 56, 56))


def _inputs(J, g):
    h = w = 32
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(1, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(1, J, 64, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.rand(1, generator=g),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(J, 3))


def _gather_anything_through_host(tensor, dim, group):
    return _all_gather_anything_padded(tensor.cpu(), dim, group).to(tensor.device)


def _check(P, group, rank):
    import diffusers.hooks.context_parallel as cp_hooks
    from diffusers import ContextParallelConfig

    from fa_a2a import diffusers_backend as backend, flux_block
    from ulysses.transport import close_transports

    backend.gather_cuda_over_gloo()
    cp_hooks._all_gather_anything = _gather_anything_through_host
    if not hasattr(logging.Logger, "warning_once"):  # diffusers' CP calls it; transformers adds it on import
        logging.Logger.warning_once = logging.Logger.warning
    names = {impl: backend.register_diffusers_backend(f"fa_a2a_{impl}", impl) for impl in IMPLS}
    results = {}
    torch.set_grad_enabled(False)
    for anything, J in CASES:
        case = f"ulysses_anything={anything} J={J}"
        torch.manual_seed(0)
        model = _flux().eval().to("cuda", torch.bfloat16)
        x = _inputs(J, torch.Generator().manual_seed(1))
        ref = copy.deepcopy(model).float()(**_on(x, torch.float32), return_dict=False)[0]
        base = model(**_on(x, torch.bfloat16), return_dict=False)[0]
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P, ulysses_anything=anything))
        model.set_attention_backend(names["fused"])
        backend.route_counts(names["fused"], reset=True)
        attn_only = model(**_on(x, torch.bfloat16), return_dict=False)[0]
        assert backend.route_counts(names["fused"]) == {"ulysses": N_ATTN}, case
        results[f"{case} attention-only"] = e_attn = _errors(attn_only, base, ref)
        flux_block.enable_fused_projection(model)
        outs = {}
        for impl, name in names.items():
            model.set_attention_backend(name)
            backend.route_counts(flux_block.ROUTE_NAME, reset=True)
            backend.route_counts(name, reset=True)
            out = model(**_on(x, torch.bfloat16), return_dict=False)[0]
            what = f"rank {rank} {case} block {impl}"
            counts = backend.route_counts(flux_block.ROUTE_NAME)
            assert counts == {"fused": N_ATTN}, (what, counts)
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
        results[f"{case} weights"] = _check_one_copy(model, x, attn_only, names["fused"], f"rank {rank} {case}")
    torch.cuda.synchronize()
    close_transports()
    if rank == 0 and os.environ.get("FA_A2A_FLUX_BLOCK_JSON"):
        with open(os.environ["FA_A2A_FLUX_BLOCK_JSON"], "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), P=P, results=results), f, indent=1)


def _check_one_copy(model, x, attn_only, backend_name, what):
    """The processors' gathered weights are the model's Linears (views of one buffer): the memory held
    grows by at most 5% of the q/k/v weights, and diffusers' own processor on the views (the
    attention-only backend, as attn_only ran before the gathering) gives attn_only bit for bit."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from fa_a2a import flux_block

    attns = [m for m in model.modules() if isinstance(m, flux_block.FluxAttention)]
    mods = [a.processor._block[1] for a in attns]
    for a, mod in zip(attns, mods):
        for (layers, _), proj in zip(flux_block._layers(a), (mod.proj, mod.joint_proj)):
            ptr = proj.weight.untyped_storage().data_ptr()
            assert all(m.weight.untyped_storage().data_ptr() == ptr for m in layers), f"{what}: not views"
    qkv = sum(m.weight.nbytes for a in attns for layers, _ in flux_block._layers(a) for m in layers)
    extra = memory.storage_bytes(memory.held_tensors(model, mods)) - memory.storage_bytes(memory.held_tensors(model, []))
    assert extra <= 0.05 * qkv, (what, extra, qkv)
    for a in attns:  # back to diffusers' processor, keeping the backend and the parallel config
        old, new = a.processor, FluxAttnProcessor()
        new._attention_backend, new._parallel_config = old._attention_backend, old._parallel_config
        a.set_processor(new)
    model.set_attention_backend(backend_name)
    again = model(**_on(x, torch.bfloat16), return_dict=False)[0]
    assert torch.equal(again, attn_only), f"{what}: diffusers' processor on the views differs from before"
    return dict(qkv_bytes=qkv, extra_bytes=extra)


def test_flux_fused_block_two_processes_one_gpu():
    os.environ.setdefault("FA_A2A_TIMEOUT_S", "600")  # first calls compile kernels while the peer waits
    run_on_gloo_groups(_check, (2,), cuda=True, timeout_s=600)
