"""CPU tier of the fused Flux, QwenImage and Flux2 attention processors (fa_a2a.models.flux,
fa_a2a.models.dit_blocks), no kernels.

- q, k, v: what the block's segments give through the torch chain (Linear -> per-head RMSNorm ->
  RoPE, TorchQKV, with the segments' rotary as the block's fp32 table; heads, normed, rotated, rows
  in the block's order) against what diffusers' own processor hands to its attention call
  (dispatch_attention_fn recorded), for QwenImage's double-stream and Flux2's double- and
  single-stream attention: in fp32 from the module's Linears, and in bf16 from the weights the
  processor gathers for the block (QKVWeights for P = 2, the single-stream one a view of
  to_qkv_mlp_proj), single process.
- Under diffusers' context parallelism (gloo, 2 and 3 processes, fp32 tiny Flux, QwenImage and
  Flux2, even shards and ulysses_anything's uneven ones): with enable_fused_projection (after
  enable_parallelism on even shards, before it on uneven ones: the processors take the config
  when it comes) the model falls back on CPU (the fa-a2a backend of impl "reference") and gives
  diffusers' output exactly (a copy of the model that keeps diffusers' processors) and its native
  CP output to 1e-5, the reason counted per processor, every call through the backend; the fused
  path's plumbing with the block replaced by a torch reference of it (segments -> chain -> the
  Ulysses op of impl "reference") gives diffusers' native CP output to 1e-5, every call's segments
  are the module's (text rows with add_*, then image rows with to_*, in double-stream blocks; one
  segment of all rows in single-stream ones) with its rows and shard_rows, and every call's q, k, v
  (the rank's rows [text shard; image shard]) equal those diffusers' processor computes on the
  same rank.
- Flux's weights gathered for the group (text rows: add_*, image rows: to_*), rebuilt when a weight
  changes; the fallback reasons (those every processor shares, those special to QwenImage's and
  Flux2's); enable_fused_projection's install table and its refusal.
The kernels run in tests/gpu/test_dit_blocks.py.
"""

import copy
import functools
import types

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a import block  # noqa: E402
from fa_a2a.models import (base as fused_base, diffusers_backend as backend, dit_blocks, flux as flux_block,  # noqa: E402
                           registry)
from tests.cpu.test_dit_cpu import ATOL, EVEN, UNEVEN, _flux, _flux_inputs, _qwen, _qwen_inputs  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

QKV_ATOL = 1e-5  # fp32 q/k/v (measured on this CPU: 0, bit for bit)


def _flux2(heads=6, head_dim=16):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=24,
                                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)


def _flux2_inputs(shape, J, g):
    _, h, w = shape
    ids = torch.zeros(h, w, 4)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    txt = torch.zeros(J, 4)
    txt[:, 3] = torch.arange(J)
    return dict(hidden_states=torch.randn(2, h * w, 8, generator=g),
                encoder_hidden_states=torch.randn(2, J, 24, generator=g), timestep=torch.rand(2, generator=g),
                img_ids=ids.reshape(1, -1, 4).expand(2, -1, -1), txt_ids=txt[None].expand(2, -1, -1),
                return_dict=False)


def _randomize_norms(model):
    """q/k RMSNorm weights away from 1, so that a norm applied wrongly (or not at all) shows."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if "RMSNorm" in type(m).__name__ and getattr(m, "weight", None) is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
    return model


# name -> (builder, inputs, {fused processor: calls per forward = its modules}, transformer module (its
# dispatch_attention_fn))
def _models():
    from diffusers.models.transformers import transformer_flux, transformer_flux2, transformer_qwenimage

    return {
        "flux": (_flux, _flux_inputs, {flux_block.FusedFluxAttnProcessor: 2}, transformer_flux),
        "qwenimage": (_qwen, _qwen_inputs, {dit_blocks.FusedQwenImageAttnProcessor: 2}, transformer_qwenimage),
        "flux2": (_flux2, _flux2_inputs, {dit_blocks.FusedFlux2AttnProcessor: 1,
                                          dit_blocks.FusedFlux2ParallelSelfAttnProcessor: 1}, transformer_flux2),
    }


# ---- the torch chain of the block's weights -------------------------------------------------------------------
def _chain(q, k, v, nq, nk, heads, D):
    bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
    return block.TorchQKV(torch.cat([q.weight, k.weight, v.weight]), bias, nq.weight, nk.weight, heads, heads, D)


def _chains(self, attn, group):
    """The module's projections as torch chains (what the processor gathers as QKVWeights)."""
    D = fused_base._head_dim(attn)
    if isinstance(attn, dit_blocks.Flux2ParallelSelfAttention):
        lin, n = attn.to_qkv_mlp_proj, attn.inner_dim
        q, k, v = (dit_blocks._row_linear(lin, t * n, n) for t in range(3))
        return types.SimpleNamespace(proj=_chain(q, k, v, attn.norm_q, attn.norm_k, attn.heads, D), joint_proj=None)
    (layers, norms), *text = fused_base._layers(attn)
    joint = _chain(*text[0][0], *text[0][1], attn.heads, D) if text else None
    return types.SimpleNamespace(proj=_chain(*layers, *norms, attn.heads, D), joint_proj=joint)


def _gathered_chain(proj, heads):
    """A TorchQKV over the gathered QKVWeights (heads split evenly: destination order is global order)."""
    D = proj.head_dim
    H, Hk, qi, ki = proj.head_map
    assert (H, Hk) == (heads, heads) and [h for r in qi for h in r] == list(range(H)) == [h for r in ki for h in r]
    qn, kn = proj.norm_weight[:D], proj.norm_weight[H * D:H * D + D]
    assert torch.equal(proj.norm_weight, torch.cat([qn.repeat(H), kn.repeat(H)]))
    return block.TorchQKV(proj.weight, proj.bias, qn, kn, H, H, D)


def _segment_qkv(segments, dtype=None):
    """The block's q, k, v over the segments' rows in order, through each segment's torch chain."""
    parts = [s.proj(s.x, block.rope_table(s.rotary, s.x.shape[1], s.proj.head_dim, s.x.device), dtype=dtype)
             for s in segments]
    return tuple(torch.cat(t, 1) for t in zip(*parts))


class _RecordDispatch:
    """Wraps a transformer module's dispatch_attention_fn: records each call's q, k, v."""

    def __init__(self, module):
        self.module, self.fn, self.qkv = module, module.dispatch_attention_fn, []
        module.dispatch_attention_fn = self

    def __call__(self, q, k, v, *args, **kwargs):
        self.qkv.append((q, k, v))
        return self.fn(q, k, v, *args, **kwargs)

    def restore(self):
        self.module.dispatch_attention_fn = self.fn


class _ReferenceBlock:
    """ulysses_qkv_attention's contract in torch: segments -> [B, rows, H, D]; records each call's
    segment rows, shard_rows, q, k, v and segment weights."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, proj=None, *, group=None, impl="fused", shard_rows=None, pace="auto", **kwargs):
        import fa_a2a

        # the backend's impl and pace (the reference backend's: the default), passed on
        assert proj is None and not kwargs and impl == "reference" and pace == "auto", (impl, pace, kwargs)
        q, k, v = _segment_qkv(x)
        self.calls.append(([s.x.shape[1] for s in x], shard_rows, (q, k, v), [s.proj for s in x]))
        return fa_a2a.ulysses_attention(q, k, v, group=group, impl="reference", shard_rows=shard_rows)


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# ---- single process: q, k, v against diffusers' processors ---------------------------------------------------
def _attention_inputs(name, dtype, J=5, hw=(3, 4)):
    """(attention modules with their fused processors' classes, hidden states, text states, rotary)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    h, w = hw
    if name == "qwenimage":
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

        model = _randomize_norms(QwenImageModel(heads=4, head_dim=64))
        rot = QwenEmbedRope(theta=10000, axes_dim=[16, 24, 24], scale_rope=True)([(1, h, w)], max_txt_seq_len=J,
                                                                               device=torch.device("cpu"))
        attns = [(model.transformer_blocks[0].attn, dit_blocks.FusedQwenImageAttnProcessor)]
    else:
        from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

        model = _randomize_norms(_flux2(heads=4, head_dim=64))
        ids = torch.zeros(J + h * w, 4)
        ids[J:, 1], ids[J:, 2] = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        ids[:J, 3] = torch.arange(J)
        rot = Flux2PosEmbed(theta=2000, axes_dim=(16, 16, 16, 16))(ids)
        attns = [(model.transformer_blocks[0].attn, dit_blocks.FusedFlux2AttnProcessor),
                 (model.single_transformer_blocks[0].attn, dit_blocks.FusedFlux2ParallelSelfAttnProcessor)]
    model = model.to(dtype)
    C = model.inner_dim
    x, e = (torch.randn(2, n, C, generator=g).to(dtype) for n in (h * w, J))
    return attns, x, e, rot


def QwenImageModel(heads, head_dim):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=1, in_channels=8, out_channels=8, num_layers=1,
                                       attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=24,
                                       axes_dims_rope=(16, 24, 24))


def _diffusers_and_block_qkv(name, dtype, gathered):
    """Per attention module: (diffusers' q, k, v before its attention call, the block's q, k, v)."""
    attns, x, e, rot = _attention_inputs(name, dtype)
    module = _models()[name][3]
    out = []
    for attn, cls in attns:
        single = cls is dit_blocks.FusedFlux2ParallelSelfAttnProcessor
        xs, es = (torch.cat([e, x], 1), None) if single else (x, e)
        rec = _RecordDispatch(module)
        try:
            with torch.no_grad():
                attn(hidden_states=xs, encoder_hidden_states=es, image_rotary_emb=rot) if not single else \
                    attn(hidden_states=xs, image_rotary_emb=rot)
        finally:
            rec.restore()
        (theirs,) = rec.qkv
        if gathered:  # the weights the processor gathers for the block (P = 2), read as a chain
            mod = (dit_blocks.parallel_attention_weights(attn, world_size=2) if single
                   else fused_base.attention_weights(attn, world_size=2))
            chains = types.SimpleNamespace(proj=_gathered_chain(mod.proj, attn.heads),
                                           joint_proj=mod.joint_proj and _gathered_chain(mod.joint_proj, attn.heads))
            if single:  # a view of the fused Linear's q/k/v rows, not a copy
                assert mod.proj.weight.data_ptr() == attn.to_qkv_mlp_proj.weight.data_ptr()
        else:
            chains = _chains(None, attn, None)
        with torch.no_grad():
            segments = cls._segments(chains, xs, es, rot)
            ours, ref = _segment_qkv(segments), _segment_qkv(segments, dtype=torch.float32)
        out.append((cls.__name__, theirs, ours, ref))
    return out


@pytest.mark.parametrize("name", ["qwenimage", "flux2"])
def test_block_qkv_equal_diffusers_fp32(name):
    for proc, theirs, ours, _ in _diffusers_and_block_qkv(name, torch.float32, gathered=False):
        assert [t.shape for t in ours] == [t.shape for t in theirs], proc
        err = _max_diff(ours, theirs)
        print(f"{name} {proc} fp32: max |block - diffusers| q/k/v = {err:.3g}")
        assert err <= QKV_ATOL, (proc, err)


@pytest.mark.parametrize("name", ["qwenimage", "flux2"])
def test_block_qkv_equal_diffusers_bf16_gathered_weights(name):
    """bf16: the block's chain rounds q/k after the norm and after RoPE; diffusers' RMSNorm
    (QwenImage's) rounds once more inside the norm, so the two may differ by bf16 ulps there. Both
    are held to the fp32 chain on the same bf16 weights (ref): the block's error at most twice
    diffusers' own (the bf16 rule); v (no norm, no RoPE) bit for bit."""
    for proc, theirs, ours, ref in _diffusers_and_block_qkv(name, torch.bfloat16, gathered=True):
        assert all(t.dtype == torch.bfloat16 for t in ours + theirs), proc
        for what, a, b, r in zip("qkv", ours, theirs, ref):
            e_ours, e_theirs = (a.float() - r).abs().max().item(), (b.float() - r).abs().max().item()
            print(f"{name} {proc} bf16 {what}: max |block - fp32| {e_ours:.3g}, max |diffusers - fp32| "
                  f"{e_theirs:.3g}, max |block - diffusers| {(a.float() - b.float()).abs().max().item():.3g}, "
                  f"bit-equal {(a == b).float().mean().item():.4f}")
            assert e_ours <= 2 * e_theirs + 1e-6, (proc, what, e_ours, e_theirs)
            if what == "v":  # no norm, no RoPE: the same bf16 Linear
                assert torch.equal(a, b), proc


# ---- under diffusers' context parallelism ---------------------------------------------------------------------
def _counts(procs):
    return {cls: backend.route_counts(cls.ROUTE_NAME) for cls in procs}


def _check(model_name, P, group, rank):
    from diffusers import ContextParallelConfig

    backend.cpu_testbed()
    name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
    torch.set_grad_enabled(False)
    build, inputs, procs, module = _models()[model_name]
    n_calls = sum(procs.values())
    for anything, (shape, J) in ((False, EVEN), (True, UNEVEN)):
        what = f"rank {rank} P={P} {model_name} ulysses_anything={anything}"
        torch.manual_seed(0)
        model = _randomize_norms(build().eval())
        x = inputs(shape, J, torch.Generator().manual_seed(1))
        ref = model(**x)[0]
        plain_model = copy.deepcopy(model)  # diffusers' processors throughout
        if anything:  # installed before diffusers' CP: the processors take the config when it comes
            registry.enable_fused_projection(model)
        for m in (model, plain_model):
            m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P, ulysses_anything=anything))
        model.set_attention_backend("native")
        native = model(**x)[0]
        assert (native - ref).abs().max().item() <= ATOL, what
        plain_model.set_attention_backend(name)
        rec = _RecordDispatch(module)
        try:
            plain = plain_model(**x)[0]  # diffusers' processors, fa-a2a's reference backend
        finally:
            rec.restore()
        model.set_attention_backend(name)
        if not anything:
            registry.enable_fused_projection(model)
        attns = [m for m in model.modules() if hasattr(m, "processor")]  # (in call order)
        found = {cls: sum(type(m.processor) is cls for m in attns) for cls in {type(m.processor) for m in attns}}
        assert found == procs, (what, found)
        assert all(m.processor._parallel_config is not None and m.processor._attention_backend.value == name
                   for m in attns), what
        for cls in procs:
            backend.route_counts(cls.ROUTE_NAME, reset=True)
        backend.route_counts(name, reset=True)
        out = model(**x)[0]
        assert torch.equal(out, plain), f"{what} fallback: not diffusers' output"
        err = (out - native).abs().max().item()
        assert err <= ATOL, f"{what} fallback: max error {err:.3g} against diffusers' native CP"
        assert _counts(procs) == {cls: {"fallback": n} for cls, n in procs.items()}, what
        assert backend.route_counts(name) == {"ulysses": n_calls}, (what, backend.route_counts(name))

        # the fused path's plumbing, the block call replaced by its torch reference
        whys = ((flux_block, "_why_not_fused"), (dit_blocks, "_why_not_qwen"), (dit_blocks, "_why_not_flux2"),
                (dit_blocks, "_why_not_parallel"))
        saved = ([getattr(m, w) for m, w in whys], [cls.__dict__.get("_weights") for cls in procs],
                 fused_base.ulysses_qkv_attention)
        ref_block = _ReferenceBlock()
        for m, w in whys:
            setattr(m, w, lambda *a: None)
        for cls in procs:
            cls._weights = _chains
        fused_base.ulysses_qkv_attention = ref_block
        try:
            for cls in procs:
                backend.route_counts(cls.ROUTE_NAME, reset=True)
            backend.route_counts(name, reset=True)
            out = model(**x)[0]
        finally:
            for (m, w), f in zip(whys, saved[0]):
                setattr(m, w, f)
            for cls, f in zip(procs, saved[1]):
                if f is None:
                    del cls._weights
                else:
                    cls._weights = f
            fused_base.ulysses_qkv_attention = saved[2]
        err = (out - native).abs().max().item()
        assert err <= ATOL, f"{what} fused plumbing: max error {err:.3g} against diffusers' native CP"
        assert _counts(procs) == {cls: {"fused": n} for cls, n in procs.items()}, what
        assert backend.route_counts(name) == {}, (what, backend.route_counts(name))  # the block, not the backend
        t, i = _rows(J, P), _rows(shape[0] * shape[1] * shape[2], P)
        every = [a + b for a, b in zip(t, i)]
        shard_rows = every if len(set(every)) > 1 else None
        assert len(ref_block.calls) == len(rec.qkv) == len(attns) == n_calls, what
        for attn, (rows, got_shard_rows, ours, projs), theirs in zip(attns, ref_block.calls, rec.qkv):
            chains = _chains(None, attn, None)
            if getattr(attn, "added_kv_proj_dim", None) is not None:  # double-stream: text rows, then image rows
                assert rows == [t[rank], i[rank]], (what, rows)
                want = [chains.joint_proj, chains.proj]
            else:  # single-stream: the rank's [text; image] rows as one segment
                assert rows == [every[rank]], (what, rows)
                want = [chains.proj]
            assert len(projs) == len(want) and all(torch.equal(p.weight, w.weight) for p, w in zip(projs, want)), what
            assert got_shard_rows == shard_rows, (what, got_shard_rows, shard_rows)
            err = _max_diff(ours, theirs)
            assert err <= QKV_ATOL, f"{what}: block q/k/v differ from diffusers' by {err:.3g}"


def _rows(n, P):
    return [len(c) for c in torch.arange(n).tensor_split(P)]


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("model_name", ["flux", "qwenimage", "flux2"])
def test_fused_processors_under_diffusers_cp(model_name, P):
    run_on_gloo_groups(functools.partial(_check, model_name), (P,), timeout_s=240)


def _check_flux_weights(P, group, rank):
    """The gathered weights for P ranks: Flux's heads split evenly, so destination order is
    [W_q; W_k; W_v] itself; the text rows' are the add_* projections'. Built once; rebuilt when a
    weight changes in place."""
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.set_grad_enabled(False)
    torch.manual_seed(0)  # (the fused kernels' head dims: 64 or 128)
    attn = FluxAttention(query_dim=128, heads=6, dim_head=64, added_kv_proj_dim=128, bias=True, eps=1e-6,
                         context_pre_only=False).to(torch.bfloat16)
    proc = flux_block.FusedFluxAttnProcessor()
    mod = proc._weights(attn, group)
    assert mod.proj.world_size == P and mod.joint_proj.world_size == P
    for proj, (q, k, v, nq, nk) in ((mod.proj, (attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)),
                                    (mod.joint_proj, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                                      attn.norm_added_q, attn.norm_added_k))):
        assert torch.equal(proj.weight, torch.cat([q.weight, k.weight, v.weight]))
        assert torch.equal(proj.bias, torch.cat([q.bias, k.bias, v.bias]))
        assert torch.equal(proj.norm_weight, torch.cat([nq.weight.float().repeat(attn.heads),
                                                        nk.weight.float().repeat(attn.heads)]))
    assert proc._weights(attn, group) is mod
    attn.add_k_proj.weight.add_(1)
    again = proc._weights(attn, group)
    assert again is not mod and torch.equal(again.joint_proj.weight[attn.heads * attn.head_dim:][:1],
                                            attn.add_k_proj.weight[:1])


@pytest.mark.parametrize("P", [2, 3])
def test_flux_weights_gathered_for_the_group(P):
    run_on_gloo_groups(_check_flux_weights, (P,), timeout_s=240)


# ---- single process: reasons, install ---------------------------------------------------------------------------
def _config(ulysses, ring=1):
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=ulysses,
                                                                               ring_degree=ring))


def test_fallback_reasons_shared(monkeypatch):
    """The reasons that send a call to diffusers' processor, every fused processor's (all shared by
    the ranks), on Flux's."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)  # registration needs a GPU's count

    attn = _flux().transformer_blocks[0].attn
    x, e = torch.randn(1, 8, attn.query_dim), torch.randn(1, 2, attn.query_dim)
    fused = AttentionBackendName(backend.register_diffusers_backend("fa_a2a", "fused"))
    reference = AttentionBackendName(backend.register_diffusers_backend("fa_a2a_reference", "reference"))
    proc = flux_block.FusedFluxAttnProcessor()
    why = lambda: fused_base._why_not_fused(proc, attn, x, e, None)  # noqa: E731
    assert why() == "no context parallelism"
    proc._parallel_config = _config(1)
    assert why() == "no context parallelism"
    proc._parallel_config = _config(2, 2)
    assert why() == "ring degree > 1"
    proc._parallel_config = _config(2)
    proc._attention_backend = reference
    assert "impl 'reference'" in why()
    proc._attention_backend = AttentionBackendName("native")
    assert "impl None" in why()
    proc._attention_backend = fused
    assert why() == "CPU tensors"


def test_fallback_reasons(monkeypatch):
    """The reasons special to QwenImage's and Flux2's processors (the shared ones:
    test_fallback_reasons_shared)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)  # registration needs a GPU's count
    fused = AttentionBackendName(backend.register_diffusers_backend("fa_a2a", "fused"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # past the device checks:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # the model's own facts

    qwen = _randomize_norms(QwenImageModel(heads=4, head_dim=64)).to(torch.bfloat16).transformer_blocks[0].attn
    x, e = torch.randn(1, 8, qwen.query_dim, dtype=torch.bfloat16), torch.randn(1, 3, qwen.query_dim,
                                                                                   dtype=torch.bfloat16)
    proc = dit_blocks.FusedQwenImageAttnProcessor()
    proc._parallel_config, proc._attention_backend = _config(2), fused
    freqs = (torch.ones(8, 32, dtype=torch.complex64), torch.ones(3, 32, dtype=torch.complex64))
    why = lambda mask=None, rot=freqs: dit_blocks._why_not_qwen(proc, qwen, x, e, mask, None, rot)  # noqa: E731
    assert why() == fused_base.AUTOGRAD  # weights that require grad under grad mode: never cut their gradient
    with torch.no_grad():
        assert why() is None
    qwen.requires_grad_(False)
    assert why() is None
    to_q = qwen.to_q

    class Adapter(torch.nn.Linear):  # a LoRA-style wrapper: computes more than its weight
        def forward(self, x):
            return super().forward(x) + 1

    qwen.to_q = Adapter(to_q.in_features, to_q.out_features, dtype=torch.bfloat16)
    assert why() == "projection layers other than plain nn.Linear (Adapter: a LoRA adapter or another wrapper)"
    qwen.to_q = torch.nn.Module()  # peft's lora.Linear is no nn.Linear at all
    qwen.to_q.in_features, qwen.to_q.out_features, qwen.to_q.weight = to_q.in_features, to_q.out_features, to_q.weight
    assert why().startswith("projection layers other than plain nn.Linear (Module")
    qwen.to_q = to_q
    assert why(mask=torch.ones(1, 3, dtype=torch.bool)) == "encoder_hidden_states_mask (a text mask)"
    assert why(rot=tuple(f.to(torch.complex128) for f in freqs)) == "image_rotary_emb not a pair of complex64 frequencies"
    assert dit_blocks._why_not_qwen(proc, qwen, x, None, None, None, freqs) == "no encoder_hidden_states"
    qwen.norm_added_k.eps = 1e-5
    assert why().startswith("q/k norms other than a per-head RMSNorm")

    flux2 = _randomize_norms(_flux2(heads=6, head_dim=64)).to(torch.bfloat16).requires_grad_(False)
    single = flux2.single_transformer_blocks[0].attn
    x = torch.randn(1, 8, single.query_dim, dtype=torch.bfloat16)
    proc = dit_blocks.FusedFlux2ParallelSelfAttnProcessor()
    proc._attention_backend = fused
    proc._parallel_config = _config(2)
    assert dit_blocks._why_not_parallel(proc, single, x, None) is None
    proc._parallel_config = _config(4)
    assert dit_blocks._why_not_parallel(proc, single, x, None).startswith("6 heads on 4 ranks (padding heads")
    with pytest.raises(ValueError, match="attn: expected heads that the 4 ranks split evenly"):
        dit_blocks.parallel_attention_weights(single, world_size=4)
    double = flux2.transformer_blocks[0].attn
    proc = dit_blocks.FusedFlux2AttnProcessor()
    proc._parallel_config, proc._attention_backend = _config(2), fused
    assert dit_blocks._why_not_flux2(proc, double, x, x[:, :3], None) is None
    assert dit_blocks._why_not_flux2(proc, double, x.float(), x[:, :3].float(), None).startswith("torch.float32")


def test_qwen_rotary_table_is_exact():
    """The block's table from QwenImage's complex64 frequencies holds their real and imaginary parts
    at columns (2j, 2j+1): RoPE through it equals diffusers' complex product to fp32 rounding."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    g = torch.Generator().manual_seed(0)
    f = torch.polar(torch.ones(7, 32), torch.randn(7, 32, generator=g) * 10)
    t, i = dit_blocks._qwen_tables((f[3:], f[:3]), 3, 4, 64)
    assert torch.equal(torch.cat([t, i]), torch.stack([f.real, f.imag], -1).flatten(1))
    x = torch.randn(2, 7, 3, 64, generator=g)
    err = (block.apply_rope(x, torch.cat([t, i])) - apply_rotary_emb_qwen(x, torch.cat([f[:3], f[3:]]), use_real=False))
    assert err.abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"image_rotary_emb\[1\] \(txt_freqs\): expected complex64 \[4, 32\]"):
        dit_blocks._qwen_tables((f[3:], f[:3]), 4, 3, 64)


@pytest.mark.parametrize("model_name", ["flux", "qwenimage", "flux2"])
def test_enable_fused_projection_installs_each_models_processors(model_name):
    build, _, procs, _ = _models()[model_name]
    model = build()
    assert registry.enable_fused_projection(model) is model
    found = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert {cls: sum(type(p) is cls for p in found) for cls in {type(p) for p in found}} == procs
    registry.enable_fused_projection(model)  # again: the same processors
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == found
    assert all(issubclass(fused, base) for _, base, fused in registry._installs())
    with pytest.raises(ValueError, match="model: expected FluxAttention modules"):
        registry.enable_fused_projection(torch.nn.Linear(2, 2))
