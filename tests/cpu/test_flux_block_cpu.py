"""CPU tier of the fused Flux attention processor (fa_a2a.flux_block), on diffusers' own context
parallelism (gloo, 2 and 3 processes, the tiny fp32 Flux of test_dit_cpu).

- Fallback: with FusedFluxAttnProcessor installed (after enable_parallelism on even shards,
  before it on ulysses_anything's uneven ones) and the fa-a2a backend of impl "reference", every
  call takes diffusers' processor: the output equals diffusers' native CP output to 1e-5.
- Plumbing of the fused path: the same model with the block call replaced by a torch reference of
  the block (each Segment's rows through its own Linear -> RMSNorm -> RoPE chain, concatenated, the
  Ulysses op of impl "reference") equals the native output to 1e-5; the segments it saw (text
  rows then image rows in double-stream blocks, one segment in single-stream ones) and shard_rows
  are checked. The kernels themselves run in tests/gpu/test_flux_block.py.
- The weights the processor gathers for the group (text rows: add_*, image rows: to_*), rebuilt
  when a weight changes; the fallback reasons; enable_fused_projection's refusal.
"""

import types

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a import block, diffusers_backend as backend, flux_block  # noqa: E402
from tests.cpu.test_dit_cpu import ATOL, EVEN, UNEVEN, _flux, _flux_inputs  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402


def _chains(self, attn, group):
    """The module's projections as fp32 torch chains (what the processor gathers as QKVWeights)."""
    def chain(q, k, v, nq, nk):
        return block.TorchQKV(torch.cat([q.weight, k.weight, v.weight]), torch.cat([q.bias, k.bias, v.bias]),
                              nq.weight, nk.weight, attn.heads, attn.heads, attn.head_dim)

    joint = None
    if attn.added_kv_proj_dim is not None:
        joint = chain(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q, attn.norm_added_k)
    return types.SimpleNamespace(proj=chain(attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k),
                                 joint_proj=joint)


class _ReferenceBlock:
    """ulysses_qkv_attention's contract in torch: segments -> [B, rows, H, D] (records its calls)."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, proj=None, *, group=None, impl="fused", shard_rows=None, **kwargs):
        import fa_a2a

        assert proj is None and not kwargs and impl == "reference"  # the backend's impl, passed on
        self.calls.append(([(s.x.shape[1], s.proj) for s in x], shard_rows))
        parts = [s.proj(s.x, block.rope_table(s.rotary, s.x.shape[1], s.proj.head_dim, s.x.device)) for s in x]
        q, k, v = (torch.cat(t, 1) for t in zip(*parts))
        return fa_a2a.ulysses_attention(q, k, v, group=group, impl="reference", shard_rows=shard_rows)


def _rows(n, P):
    return [len(c) for c in torch.arange(n).tensor_split(P)]


def _check(P, group, rank):
    from diffusers import ContextParallelConfig

    backend.cpu_testbed()
    name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
    torch.set_grad_enabled(False)
    for anything, (shape, J) in ((False, EVEN), (True, UNEVEN)):
        what = f"rank {rank} P={P} ulysses_anything={anything}"
        torch.manual_seed(0)
        model = _flux().eval()
        x = _flux_inputs(shape, J, torch.Generator().manual_seed(1))
        ref = model(**x)[0]
        if anything:  # installed before diffusers' CP: the processors take the config when it comes
            flux_block.enable_fused_projection(model)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P, ulysses_anything=anything))
        model.set_attention_backend("native")
        native = model(**x)[0]
        assert (native - ref).abs().max().item() <= ATOL, what
        model.set_attention_backend(name)
        if not anything:
            flux_block.enable_fused_projection(model)
        procs = [m.processor for m in model.modules() if isinstance(m, flux_block.FluxAttention)]
        assert len(procs) == 2 and all(type(p) is flux_block.FusedFluxAttnProcessor for p in procs), what
        assert all(p._parallel_config is not None and p._attention_backend.value == name for p in procs), what

        backend.route_counts(flux_block.ROUTE_NAME, reset=True)
        backend.route_counts(name, reset=True)
        out = model(**x)[0]
        err = (out - native).abs().max().item()
        assert err <= ATOL, f"{what} fallback: max error {err:.3g} against diffusers' native CP"
        assert backend.route_counts(flux_block.ROUTE_NAME) == {"fallback": 2}, what
        assert backend.route_counts(name) == {"ulysses": 2}, what

        # the fused path's plumbing, the block call replaced by its torch reference
        saved = flux_block._why_not_fused, flux_block.FusedFluxAttnProcessor._weights, flux_block.ulysses_qkv_attention
        ref_block = _ReferenceBlock()
        flux_block._why_not_fused = lambda *a: None
        flux_block.FusedFluxAttnProcessor._weights = _chains
        flux_block.ulysses_qkv_attention = ref_block
        try:
            backend.route_counts(flux_block.ROUTE_NAME, reset=True)
            out = model(**x)[0]
        finally:
            flux_block._why_not_fused, flux_block.FusedFluxAttnProcessor._weights, \
                flux_block.ulysses_qkv_attention = saved
        err = (out - native).abs().max().item()
        assert err <= ATOL, f"{what} fused plumbing: max error {err:.3g} against diffusers' native CP"
        assert backend.route_counts(flux_block.ROUTE_NAME) == {"fused": 2}, what
        t, i = _rows(J, P), _rows(shape[0] * shape[1] * shape[2], P)
        every = [a + b for a, b in zip(t, i)]
        shard_rows = every if len(set(every)) > 1 else None
        (double, double_rows), (single, single_rows) = ref_block.calls
        double_attn, single_attn = (m for m in model.modules() if isinstance(m, flux_block.FluxAttention))
        assert [n for n, _ in double] == [t[rank], i[rank]], what
        assert [n for n, _ in single] == [every[rank]], what
        assert torch.equal(double[0][1].weight, _chains(None, double_attn, None).joint_proj.weight), what
        assert torch.equal(double[1][1].weight, _chains(None, double_attn, None).proj.weight), what
        assert torch.equal(single[0][1].weight, _chains(None, single_attn, None).proj.weight), what
        assert double_rows == single_rows == shard_rows, (what, double_rows, shard_rows)
    _check_weights(P, group)


def _check_weights(P, group):
    """The gathered weights for P ranks: Flux's heads split evenly, so destination order is
    [W_q; W_k; W_v] itself; the text rows' are the add_* projections'. Built once; rebuilt when a
    weight changes in place."""
    from diffusers.models.transformers.transformer_flux import FluxAttention

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
def test_fused_flux_processor_under_diffusers_cp(P):
    run_on_gloo_groups(_check, (P,), timeout_s=240)


# ---- single process ------------------------------------------------------------------------------------------
def _config(ulysses, ring=1):
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=ulysses,
                                                                               ring_degree=ring))


def test_fallback_reasons(monkeypatch):
    """The reasons that send a call to diffusers' processor (all shared by the ranks)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)  # registration needs a GPU's count

    attn = _flux().transformer_blocks[0].attn
    x, e = torch.randn(1, 8, attn.query_dim), torch.randn(1, 2, attn.query_dim)
    fused = AttentionBackendName(backend.register_diffusers_backend("fa_a2a", "fused"))
    reference = AttentionBackendName(backend.register_diffusers_backend("fa_a2a_reference", "reference"))
    proc = flux_block.FusedFluxAttnProcessor()
    why = lambda: flux_block._why_not_fused(proc, attn, x, e, None)  # noqa: E731
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


def test_enable_fused_projection():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model = _flux()
    assert flux_block.enable_fused_projection(model) is model
    procs = [m.processor for m in model.modules() if isinstance(m, flux_block.FluxAttention)]
    assert len(procs) == 2 and all(type(p) is flux_block.FusedFluxAttnProcessor for p in procs)
    flux_block.enable_fused_projection(model)  # again: the same processors
    assert [m.processor for m in model.modules() if isinstance(m, flux_block.FluxAttention)] == procs
    assert issubclass(flux_block.FusedFluxAttnProcessor, FluxAttnProcessor)
    with pytest.raises(ValueError, match="model: expected FluxAttention modules"):
        flux_block.enable_fused_projection(torch.nn.Linear(2, 2))
