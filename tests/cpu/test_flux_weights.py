"""The fused Flux processor's weights (fa_a2a.models.flux): one copy of the attention weights.

The processor gathers a FluxAttention's q/k/v weights in destination order and makes the module's
Linears views of them (UlyssesQKVAttention.from_linear(share_weights=True)): the model computes as
before (diffusers' own processor, the fallback, reads the views), its Parameter objects stay, and
the memory held grows by the gathered extras only (padding heads, fp32 norm vectors), not by a
second copy. A later load_state_dict / dtype change is gathered again. Tiny bf16 Flux on CPU (the
gathering needs no GPU; the fused kernels run in tests/gpu/test_dit_blocks.py).
"""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a.models import base as fused_base, diffusers_backend as backend, flux as flux_block, registry  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "flux_block_memory", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "flux_block_memory.py"))
memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)

HEADS, D = 6, 64


def _model(seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=D, num_attention_heads=HEADS, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(8, 28, 28))
    for m in model.modules():  # RMSNorm weights away from 1, so a wrong gather shows
        if isinstance(m, torch.nn.RMSNorm):
            torch.nn.init.normal_(m.weight, 1.0, 0.1)
    return model.to(torch.bfloat16).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    h = w = 4
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(1, h * w, 16, generator=g).bfloat16(),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=g).bfloat16(),
                pooled_projections=torch.randn(1, 16, generator=g).bfloat16(),
                timestep=torch.rand(1, generator=g).bfloat16(), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3),
                return_dict=False)


def _attns(model):
    return [m for m in model.modules() if isinstance(m, flux_block.FluxAttention)]


def _gathered(attn, proj, layers):
    """proj holds the layers' rows in order (Flux: heads split evenly or padded at the end)."""
    rows = [proj.column_range(t)[0] for t in range(3)]
    return all(torch.equal(proj.weight[r:r + m.out_features], m.weight) for r, m in zip(rows, layers))


def _shares(proj, layers):
    ptr = proj.weight.untyped_storage().data_ptr()
    return all(m.weight.untyped_storage().data_ptr() == ptr and m.bias.untyped_storage().data_ptr()
               == proj.bias.untyped_storage().data_ptr() for m in layers)


@torch.no_grad()
def test_processor_weights_are_the_linears_and_the_model_computes_as_before():
    model = registry.enable_fused_projection(_model())
    x = _inputs()
    backend.route_counts(flux_block.ROUTE_NAME, reset=True)
    before = model(**x)[0]
    values = {n: p.clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    held = memory.storage_bytes(memory.held_tensors(model, []))
    mods = []
    for attn in _attns(model):
        mod = attn.processor._weights(attn, None)  # what a fused call builds (group None: P = 1)
        for (layers, _), proj in zip(fused_base._layers(attn), (mod.proj, mod.joint_proj)):
            assert _shares(proj, layers) and _gathered(attn, proj, layers)
        assert attn.processor._weights(attn, None) is mod  # built once
        mods.append(mod)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    after = model(**x)[0]  # diffusers' processor (the fallback: no context parallelism) on the views
    assert torch.equal(after, before)
    assert backend.route_counts(flux_block.ROUTE_NAME) == {"fallback": 4}
    extra = memory.storage_bytes(memory.held_tensors(model, mods)) - held
    qkv = sum(m.weight.nbytes for a in _attns(model) for layers, _ in fused_base._layers(a) for m in layers)
    assert 0 < extra <= 0.05 * qkv, (extra, qkv)  # the fp32 norm vectors (and nothing of the weights' size)


@pytest.mark.parametrize("P,limit", [(2, 0.05), (3, 0.05), (4, 0.34)])
def test_memory_of_the_gathered_weights(P, limit):
    """The example's measure on tiny dims: views keep the extra within 5% of the q/k/v weights when P
    divides the heads; with P = 4 the 2 zero padding heads of 8 (1/3 of 6 heads' rows) are the extra; a
    copy beside the Linears (the old way) adds the whole q/k/v weights."""
    args = memory._parse(["--device", "cpu", "--layers", "2", "--single-layers", "2", "--heads", str(HEADS),
                          "--head-dim", str(D), "--world-size", str(P)])
    r = memory.measure(args)
    assert r["linears_are_views"] and 0 < r["extra_of_qkv"] <= limit, r
    r = memory.measure(memory._parse(["--device", "cpu", "--layers", "1", "--single-layers", "0", "--heads",
                                      str(HEADS), "--head-dim", str(D), "--world-size", str(P), "--copy"]))
    assert not r["linears_are_views"] and r["extra_of_qkv"] >= 1.0, r


@torch.no_grad()
def test_padding_heads_and_rebuilds():
    """P = 4 ranks for 6 heads (2 zero padding heads at the end of q's block, k/v's last head
    replicated): the Linears are still views; the padding rows are zero. load_state_dict writes into
    the views and is gathered again (version change); a dtype change makes new tensors, gathered and
    shared again."""
    model = _model()
    attn = _attns(model)[0]  # double-stream: image and text layers
    mod = fused_base.attention_weights(attn, world_size=4)
    for (layers, _), proj in zip(fused_base._layers(attn), (mod.proj, mod.joint_proj)):
        assert _shares(proj, layers) and _gathered(attn, proj, layers)
        assert proj.heads_loc == 2 and not proj.weight[HEADS * D:proj.column_range(1)[0]].any()

    registry.enable_fused_projection(model)
    proc = attn.processor
    first = proc._weights(attn, None)
    other = _model(seed=5)
    model.load_state_dict(other.state_dict())
    assert torch.equal(attn.to_k.weight, _attns(other)[0].to_k.weight)
    again = proc._weights(attn, None)
    assert again is not first and _shares(again.proj, fused_base._layers(attn)[0][0])
    assert torch.equal(again.proj.weight[HEADS * D:2 * HEADS * D], _attns(other)[0].to_k.weight)
    assert torch.equal(again.proj.norm_weight[:D], _attns(other)[0].norm_q.weight.float())

    model.to(torch.float16)
    half = proc._weights(attn, None)
    assert half.proj.weight.dtype == torch.float16 and _shares(half.proj, fused_base._layers(attn)[0][0])
    assert torch.equal(attn.add_v_proj.weight, _attns(other)[0].add_v_proj.weight.half())
