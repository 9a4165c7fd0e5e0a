"""What a second hostile pass found (2026-12-05): inputs for which a CPU-runnable path gave a silent wrong
answer or an unclear error, each now right or refused by name on every rank. Every numeric check is
against a plain fp64 torch oracle."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fa_a2a import ulysses_attention
from fa_a2a.block import UlyssesQKVAttention
from tests.helpers import fp64_attention
from tests.multiproc import run_gloo_case


def test_from_linear_module_follows_weights_updated_through_data():
    """A layer weight updated through .data (diffusers' EMAModel.copy_to: param.data.copy_) must reach the module."""
    torch.manual_seed(0)
    S, H, D, C = 6, 2, 8, 16
    lq, lk, lv = (nn.Linear(C, H * D) for _ in range(3))
    module = UlyssesQKVAttention.from_linear(lq, lk, lv, head_dim=D, across_heads=True, world_size=1)
    x = torch.randn(1, S, C)

    def want():
        q, k, v = (layer(x).unflatten(-1, (H, D)) for layer in (lq, lk, lv))
        return fp64_attention(q, k, v)

    with torch.no_grad():
        assert (module(x).double() - want()).abs().max() < 1e-5
        lq.weight.data.copy_(torch.randn_like(lq.weight))  # no _version bump on the Parameter
        got = module(x).double()
        assert (got - want()).abs().max() < 1e-5, "the module ran its stale copy of to_q's weight"


def test_compiled_from_linear_module_follows_an_in_place_weight_update():
    """torch.compile(module) after an in-place layer update (load_state_dict, optimizer step) must not run stale copies."""
    torch.manual_seed(0)
    S, H, D, C = 6, 2, 8, 16
    lq, lk, lv = (nn.Linear(C, H * D) for _ in range(3))
    module = UlyssesQKVAttention.from_linear(lq, lk, lv, head_dim=D, across_heads=True, world_size=1)
    compiled = torch.compile(module, backend="aot_eager")
    x = torch.randn(1, S, C)

    def want():
        q, k, v = (layer(x).unflatten(-1, (H, D)) for layer in (lq, lk, lv))
        return fp64_attention(q, k, v)

    with torch.no_grad():
        assert (compiled(x).double() - want()).abs().max() < 1e-5
        lq.weight.copy_(torch.randn_like(lq.weight))  # bumps _version: the eager module would refresh
        got = compiled(x).double()
        assert (got - want()).abs().max() < 1e-5, "the compiled module ran its stale copy of to_q's weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_scale_beyond_fp32_range_is_refused_or_exact(dtype):
    """softmax_scale=1e39 is accepted as 'finite' but overflows the fp32 compute: refuse it by name, or be right."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=dtype) for _ in range(3))
    try:
        out = ulysses_attention(q, k, v, softmax_scale=1e39)
    except ValueError as e:
        assert "softmax_scale" in str(e)
        return
    assert not out.isnan().any(), "softmax_scale=1e39 returned NaN with no error"
    assert (out.double() - fp64_attention(q, k, v, 1e39)).abs().max() < 1e-2


def test_double_backward_through_the_op_is_exact_or_refused():
    """A gradient penalty (create_graph=True, loss o.sum()) must not silently drop the op's second-order term."""
    torch.manual_seed(0)
    S, H, D, C = 4, 2, 4, 6
    x = torch.randn(1, S, C, dtype=torch.float64)
    k, v = (torch.randn(1, S, H, D, dtype=torch.float64) for _ in range(2))

    def weight_grad(attention):
        w = torch.randn(H * D, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        xx = x.clone().requires_grad_()
        out = attention(torch.nn.functional.linear(xx, w).unflatten(-1, (H, D)), k, v)
        g, = torch.autograd.grad(out.sum(), xx, create_graph=True)
        (g ** 2).sum().backward()
        return w.grad

    want = weight_grad(fp64_attention)
    try:
        got = weight_grad(lambda q, k, v: ulysses_attention(q, k, v))
    except ValueError as e:  # refused by name: fine
        assert str(e).startswith("create_graph: fa_a2a's attention has no double backward"), e
        return
    assert (got - want).abs().max() < 1e-8, "double backward silently dropped the attention's second-order term"


# ---- a bad argument on one rank: every rank must raise the ValueError naming it (not a TimeoutError) ----------
def _one_rank_bad_argument(rank, P):
    from fa_a2a import UlyssesAttention, ulysses_attention_out_proj

    os.environ["FA_A2A_TIMEOUT_S"] = "5"
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    calls = {
        "out_weight": lambda: ulysses_attention_out_proj(
            q, k, v, torch.randn(3, 16, dtype=torch.float64 if rank == 1 else torch.float32), impl="reference"),
        "q": lambda: UlyssesAttention(impl="reference")(q if rank == 0 else q[0], k, v),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=name) as info:
            call()
        assert not isinstance(info.value, TimeoutError), f"rank {rank}: {name}: {info.value!r}"
        dist.barrier()


def test_a_bad_out_proj_weight_or_module_input_on_one_rank_reaches_every_rank():
    """ulysses_attention_out_proj / UlyssesAttention check locally before the agreement: the other ranks time out."""
    run_gloo_case(_one_rank_bad_argument, 2, deadline_s=60)


def test_reload_weights_after_a_data_write_reaches_the_fused_copies():
    """A `.data` write is not versioned, so the fused path's gathered copies cannot see it by themselves:
    fa_a2a.reload_weights(model) rebuilds them (and resets the fused processors' gathered weights)."""
    import fa_a2a
    from fa_a2a import block

    torch.manual_seed(0)
    H, D, C = 4, 64, 32
    lq, lk, lv = (nn.Linear(C, H * D, dtype=torch.bfloat16) for _ in range(3))
    norms = [nn.RMSNorm(D, eps=1e-6) for _ in range(2)]
    mod = UlyssesQKVAttention.from_linear(lq, lk, lv, head_dim=D, norm_q=norms[0], norm_k=norms[1], world_size=2)

    class Processor:
        reloaded = 0

        def reload_weights(self):
            self.reloaded += 1

    model = nn.ModuleDict({"attn": mod, "other": nn.Linear(2, 2)})
    model["other"].processor = Processor()
    with torch.no_grad():
        lq.weight.data.copy_(torch.randn_like(lq.weight))
        norms[1].weight.data.copy_(torch.rand(D) + 0.5)
    mod._refresh()  # the facts did not change: the copies stay as they were
    fresh = block.block_weights(block.TorchQKV(torch.cat([m.weight.detach() for m in (lq, lk, lv)]),
                                               torch.cat([m.bias.detach() for m in (lq, lk, lv)]),
                                               norms[0].weight.detach(), norms[1].weight.detach(), H, H, D), 2)
    assert not torch.equal(mod.proj.weight, fresh.weight)
    fa_a2a.reload_weights(model)
    for name in ("weight", "bias", "norm_weight"):
        assert torch.equal(getattr(mod.proj, name), getattr(fresh, name)), name
    assert model["other"].processor.reloaded == 1


def _one_rank_bad_block_input(rank, P):
    """The block's checks that run before the op (the torch chain of a module on the chain path, the
    functional block's grad path) refuse a bad input on one rank on every rank."""
    from fa_a2a import block

    os.environ["FA_A2A_TIMEOUT_S"] = "5"
    torch.manual_seed(0)
    H, D, C = 2, 8, 16
    lin = [nn.Linear(C, H * D) for _ in range(3)]
    wan = UlyssesQKVAttention.from_linear(*lin, head_dim=D, across_heads=True, norm_q=nn.RMSNorm(H * D),
                                          norm_k=nn.RMSNorm(H * D))
    x = torch.randn(1, 4, C if rank == 0 else C + 1)
    with torch.no_grad(), pytest.raises(ValueError, match="x: expected C = 16 channels") as info:
        wan(x)
    assert not isinstance(info.value, TimeoutError)
    dist.barrier()
    D = 64
    chain = block.TorchQKV(torch.randn(3 * H * D, C).to(torch.bfloat16), None, None, None, H, H, D)
    proj = block.block_weights(chain, P)
    xg = torch.randn(1, 4, C if rank == 0 else C + 1, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="channels") as info:
        block.ulysses_qkv_attention(xg, proj)
    assert not isinstance(info.value, TimeoutError)
    dist.barrier()


def test_a_bad_block_input_on_one_rank_reaches_every_rank():
    run_gloo_case(_one_rank_bad_block_input, 2, deadline_s=60)
