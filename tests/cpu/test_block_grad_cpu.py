"""The attention block with grad (fa_a2a.block._attention_with_grad): hidden states or joint rows that
require grad take the projection as the torch chain of the block's weights (global_chain) and the
differentiable op; the weights stay refused. CPU: emulated ranks and gloo ranks (the op's reference /
nccl impls), bf16."""
import pytest
import torch

from fa_a2a import block
from fa_a2a.op import ulysses_attention_emulated
from ulysses.reference import full_attention

from tests.multiproc import run_on_gloo_groups

# (P, H, H_kv, D, C, J): even heads; GQA with KV heads replicated across ranks; padding heads, joint
CASES = [(2, 4, 4, 64, 64, 0), (4, 8, 2, 64, 64, 0), (4, 6, 6, 64, 32, 3)]
S_LOC, B = 8, 1


def _chain(H, H_kv, D, C, seed):
    g = torch.Generator().manual_seed(seed)
    n = (H + 2 * H_kv) * D
    return block.TorchQKV((torch.randn(n, C, generator=g) / C ** 0.5).to(torch.bfloat16),
                          (0.1 * torch.randn(n, generator=g)).to(torch.bfloat16),
                          1 + 0.2 * torch.randn(D, generator=g), 1 + 0.2 * torch.randn(D, generator=g), H, H_kv, D)


def _inputs(case, seed=1):
    P, H, H_kv, D, C, J = case
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, S_LOC, C, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(P)]
    rot = [block.rotary_pair(torch.arange(r * S_LOC, (r + 1) * S_LOC), D) for r in range(P)]
    joint = torch.randn(B, J, C, generator=g).to(torch.bfloat16).requires_grad_() if J else None
    jrot = block.rotary_pair(torch.arange(J), D) if J else None
    douts = [torch.randn(B, S_LOC, H, D, generator=g).to(torch.bfloat16) for _ in range(P)]
    return xs, rot, joint, jrot, douts


@pytest.mark.parametrize("case", CASES, ids=str)
def test_global_chain_is_the_chain_the_weights_were_gathered_from(case):
    P, H, H_kv, D, C, _ = case
    chain = _chain(H, H_kv, D, C, 0)
    got = block.global_chain(block.block_weights(chain, P))
    assert (got.num_heads, got.num_kv_heads, got.head_dim) == (H, H_kv, D)
    for name in ("weight", "bias", "q_norm", "k_norm"):
        assert torch.equal(getattr(got, name), getattr(chain, name)), name


@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_block_with_grad_is_the_chain_then_the_op(case):
    """Outputs and input grads: bit for bit the torch chain of the module's weights followed by the
    emulated op; close to the fp64 chain + full attention on the unsplit sequence."""
    P, H, H_kv, D, C, J = case
    chain = _chain(H, H_kv, D, C, 0)
    proj = block.block_weights(chain, P)
    xs, rot, joint, jrot, douts = _inputs(case)
    res = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot, joint=joint, joint_rotary=jrot)
    outs = res[0] if J else res
    torch.autograd.backward(outs, douts)
    got = [x.grad.clone() for x in xs] + ([joint.grad.clone()] if J else [])

    for x in xs + ([joint] if J else []):
        x.grad = None
    tab = lambda rotary, rows: block.rope_table(rotary, rows, D, "cpu")  # noqa: E731
    qkv = [chain(x, tab(r, S_LOC)) for x, r in zip(xs, rot)]
    jt = chain(joint, tab(jrot, J)) if J else None
    want = ulysses_attention_emulated(*([t[i] for t in qkv] for i in range(3)), joint=jt, impl="reference")
    want_outs = want[0] if J else want
    torch.autograd.backward(want_outs, douts)
    for a, b in zip(outs, want_outs):
        assert torch.equal(a, b)
    for a, b in zip(got, [x.grad for x in xs] + ([joint.grad] if J else [])):
        assert torch.equal(a, b)

    # fp64 oracle: the chain in fp64 on the unsplit sequence, full attention
    x64 = torch.cat([x.detach() for x in xs], 1).double().requires_grad_()
    c64 = block.TorchQKV(chain.weight.double(), chain.bias.double(), chain.q_norm.double(), chain.k_norm.double(),
                         H, H_kv, D)
    cos, sin = (torch.cat([r[i] for r in rot]) for i in range(2))
    q, k, v = c64(x64, block.rope_table((cos, sin), P * S_LOC, D, "cpu").double(), torch.float64)
    jt64 = None
    if J:
        j64 = joint.detach().double().requires_grad_()
        jt64 = c64(j64, tab(jrot, J).double(), torch.float64)
    ref = full_attention(q, k, v, joint=jt64)
    ref_out = ref[0] if J else ref
    ref_out.backward(torch.cat(douts, 1).double())
    err = max((torch.cat(got[:P], 1).double() - x64.grad).abs().max().item(), 0.0)
    assert err <= 0.05 * x64.grad.abs().max().item() + 1e-2, err


def test_weights_that_require_grad_are_refused_on_the_grad_path_too():
    P, H, H_kv, D, C, J = CASES[0]
    proj = block.block_weights(_chain(H, H_kv, D, C, 0), P)
    proj = type(proj)(**{**proj.__dict__, "weight": proj.weight.clone().requires_grad_()})
    xs, rot, _, _, _ = _inputs(CASES[0])
    with pytest.raises(ValueError, match="proj.weight: requires grad, but the block's weights are fixed copies"):
        block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot)
    with torch.no_grad(), pytest.raises(ValueError, match="expected a CUDA tensor"):  # no graph: the flag does
        block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot)  # not matter (the fused block needs CUDA)


def test_module_forward_emulated_backpropagates_to_the_hidden_states():
    P, H, H_kv, D, C, _ = CASES[0]
    lin = [torch.nn.Linear(C, H * D, dtype=torch.bfloat16) for _ in range(3)]
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P)
    xs, rot, _, _, douts = _inputs(CASES[0])
    torch.autograd.backward(mod.forward_emulated(xs, rotary=rot), douts)
    assert all(x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0 for x in xs)


def _gloo_ranks(P, group, rank):
    case = next(c for c in CASES if c[0] == P)
    _, H, H_kv, D, C, J = case
    proj = block.block_weights(_chain(H, H_kv, D, C, 0), P)
    xs, rot, joint, jrot, douts = _inputs(case)
    res = block.ulysses_qkv_attention(xs[rank], proj, group=group, rotary=rot[rank], joint=joint,
                                      joint_rotary=jrot)
    out = res[0] if J else res
    out.backward(douts[rank])
    xe, _, je, _, _ = _inputs(case)
    want = block.ulysses_qkv_attention_emulated(xe, proj, rotary=rot, joint=je, joint_rotary=jrot)
    torch.autograd.backward(want[0] if J else want, douts)
    assert torch.allclose(out.float(), (want[0] if J else want)[rank].float(), atol=2e-2, rtol=0)
    assert torch.allclose(xs[rank].grad.float(), xe[rank].grad.float(), atol=2e-2, rtol=0)


def test_gloo_ranks_block_with_grad_matches_the_emulated_ranks():
    run_on_gloo_groups(_gloo_ranks, (2,), timeout_s=120)


def _one_rank_with_grad(P, group, rank):
    case = next(c for c in CASES if c[0] == P)
    _, H, H_kv, D, C, _ = case
    proj = block.block_weights(_chain(H, H_kv, D, C, 0), P)
    xs, rot, _, _, _ = _inputs(case)
    x = xs[rank] if rank == 0 else xs[rank].detach()  # rank 0 takes the grad path, rank 1 the fused block's
    # on CPU rank 1's own refusal (the fused block needs CUDA) reaches both; on a GPU the entry points differ
    with pytest.raises(ValueError, match="entry point|requires_grad|x: expected a CUDA tensor"):
        block.ulysses_qkv_attention(x, proj, group=group, rotary=rot[rank])


def test_ranks_that_differ_in_requires_grad_raise_alike():
    """A rank whose hidden states require grad (the op's path) and one whose do not (the fused block's):
    both raise a ValueError from the per-call agreement instead of waiting on each other."""
    run_on_gloo_groups(_one_rank_with_grad, (2,), timeout_s=60)


# ---- UlyssesQKVAttention.from_linear in training: the layers' own gradients, never stale copies -----------
def _layers(H, H_kv, D, C, seed, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    lin = [torch.nn.Linear(C, n * D, dtype=dtype) for n in (H, H_kv, H_kv)]
    norms = [torch.nn.RMSNorm(D, eps=1e-6, dtype=torch.float32) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.add_(0.2 * torch.randn(D))
    return lin, norms


def test_module_from_linear_trains_its_layers():
    """Layers whose parameters require grad (as in training) get their gradients through the module
    (the silent hole before: the module ran its detached copies, to_q.weight.grad stayed None), close
    to an fp64 oracle: the same layers in fp64 on the unsplit sequence, full attention."""
    P, H, H_kv, D, C, _ = CASES[1]
    lin, norms = _layers(H, H_kv, D, C, 0)
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=norms[0], norm_k=norms[1], world_size=P)
    xs, rot, _, _, douts = _inputs(CASES[1])
    torch.autograd.backward(mod.forward_emulated(xs, rotary=rot), douts)
    params = [m.weight for m in lin] + [m.bias for m in lin] + [n.weight for n in norms]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in params)

    x64 = torch.cat([x.detach() for x in xs], 1).double()
    p64 = [p.detach().double().requires_grad_() for p in params]
    c64 = block.TorchQKV(torch.cat(p64[:3]), torch.cat(p64[3:6]), p64[6], p64[7], H, H_kv, D, eps=1e-6)
    cos, sin = (torch.cat([r[i] for r in rot]) for i in range(2))
    q, k, v = c64(x64, block.rope_table((cos, sin), P * S_LOC, D, "cpu").double(), torch.float64)
    full_attention(q, k, v).backward(torch.cat(douts, 1).double())
    for i, (p, e) in enumerate(zip(params, p64)):
        err = (p.grad.double() - e.grad).abs().max().item()
        assert err <= 0.05 * e.grad.abs().max().item() + 1e-2, (i, err)


def test_module_copies_follow_in_place_updates_of_its_layers():
    """An optimizer step changes the layers in place (or new data is set): the module's copies are rebuilt
    before its next call (fused: the gathered weights, also with share_weights, the layers then views of them again;
    Wan's chain: the concatenated weights), equal to a module built afresh from the updated layers."""
    P, H, H_kv, D, C, _ = CASES[0]
    for share in (False, True):
        lin, norms = _layers(H, H_kv, D, C, 1)
        mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=norms[0], norm_k=norms[1],
                                                    world_size=P, share_weights=share)
        mod._refresh()
        before = mod.proj
        assert mod.proj is before  # nothing changed: nothing rebuilt
        opt = torch.optim.SGD([p for m in lin + norms for p in m.parameters()], lr=0.1)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        opt.step()
        mod._refresh()
        fresh = block.block_weights(block.TorchQKV(torch.cat([m.weight.detach() for m in lin]),
                                                   torch.cat([m.bias.detach() for m in lin]), norms[0].weight.detach(),
                                                   norms[1].weight.detach(), H, H_kv, D), P)
        for name in ("weight", "bias", "norm_weight"):
            assert torch.equal(getattr(mod.proj, name), getattr(fresh, name)), (share, name)
        if share:  # the layers are views of the rebuilt copies again
            base = mod.proj.weight.untyped_storage().data_ptr()
            assert all(m.weight.untyped_storage().data_ptr() == base for m in lin)
    lin, _ = _layers(H, H_kv, D, C, 2)
    wan = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P, across_heads=True,
                                                norm_q=torch.nn.RMSNorm(H * D), norm_k=torch.nn.RMSNorm(H_kv * D))
    xs = [torch.randn(1, S_LOC, C).to(torch.bfloat16) for _ in range(P)]
    for change in (lambda: lin[0].weight.mul_(-1),  # in place: the version
                   lambda: setattr(lin[1].weight, "data", torch.randn_like(lin[1].weight))):  # new data: the pointer
        with torch.no_grad():
            change()
            got = wan.forward_emulated(xs)
            want = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, world_size=P, across_heads=True,
                                                         norm_q=torch.nn.RMSNorm(H * D),
                                                         norm_k=torch.nn.RMSNorm(H_kv * D)).forward_emulated(xs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_module_from_linear_trains_its_text_layers_too():
    """Flux's double-stream text projections (add_q, add_k, add_v, norm_added_*) take their gradients
    from the joint rows as to_q/k/v do from the image rows."""
    P, H, H_kv, D, C, J = CASES[2]
    lin, norms = _layers(H, H_kv, D, C, 3)
    add, add_norms = _layers(H, H_kv, D, C, 4)
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=norms[0], norm_k=norms[1], add_q=add[0],
                                                add_k=add[1], add_v=add[2], norm_added_q=add_norms[0],
                                                norm_added_k=add_norms[1], world_size=P)
    xs, rot, joint, jrot, douts = _inputs(CASES[2])
    outs, jouts = mod.forward_emulated(xs, rotary=rot, joint=joint, joint_rotary=jrot)
    torch.autograd.backward(list(outs) + list(jouts), douts + [torch.ones_like(j) for j in jouts])
    for m in lin + add + norms + add_norms:
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0, m
