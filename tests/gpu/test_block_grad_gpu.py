"""The attention block's weight gradients on one SM90 GPU: UlyssesQKVAttention.from_linear in training.

Layers that require grad (to_q, to_k, to_v with biases, per-head RMSNorms on q and k: Flux's) get
their gradients through the module (its grad path: the layers' own torch chain, then the
differentiable op with FA4's backward). Rule (FA4's, as tests/gpu/test_backward_gpu.py): every
parameter's grad against an fp64 oracle (the same layers in fp64 on the unsplit sequence, RoPE,
full attention) within 2x the error of the same-precision baseline (the same bf16 layers on the
unsplit sequence, then FA4's own forward + backward) + P bf16 roundings of the largest grad: the
split sequence gives each parameter P partial grads, each rounded to the parameter's bf16 and summed
(autograd's accumulation for emulated ranks, an all-reduce for real ones), where the unsplit baseline
rounds once. Emulated P = 2, 4, 8 (impl fused and serial: the same grads bit for bit under
deterministic mode) and 2 rank processes under MPS (each rank's partial grads summed over the ranks).

    python -m pytest -q tests/gpu/test_block_grad_gpu.py
"""

import pytest
import torch
import torch.distributed as dist

from fa_a2a import block
from ulysses.reference import full_attention

from tests.helpers import deterministic
from tests.multiproc import run_on_gloo_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an SM90 GPU (FA4's SM90 backward)")

DTYPE = torch.bfloat16
# (P, S_loc, H, H_kv, D, C)
CASES = [(2, 256, 4, 4, 128, 512), (4, 200, 8, 2, 64, 384), (8, 128, 24, 24, 128, 1024)]


def _layers(case, seed):
    P, S_loc, H, H_kv, D, C = case
    torch.manual_seed(seed)
    lin = [torch.nn.Linear(C, n * D, dtype=DTYPE, device="cuda") for n in (H, H_kv, H_kv)]
    norms = [torch.nn.RMSNorm(D, eps=1e-6, dtype=torch.float32, device="cuda") for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.add_(0.2 * torch.randn(D, device="cuda"))
    return lin, norms


def _params(lin, norms):
    return [m.weight for m in lin] + [m.bias for m in lin] + [n.weight for n in norms]


def _inputs(case, seed):
    P, S_loc, H, H_kv, D, C = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(1, S_loc, C, device="cuda", generator=g).to(DTYPE) for _ in range(P)]
    douts = [torch.randn(1, S_loc, H, D, device="cuda", generator=g).to(DTYPE) for _ in range(P)]
    rot = [block.rotary_pair(torch.arange(r * S_loc, (r + 1) * S_loc, device="cuda"), D) for r in range(P)]
    return xs, douts, rot


def _unsplit_grads(case, lin, norms, xs, douts, rot, dtype):
    """The layers (copied, in `dtype`) on the unsplit sequence, then full attention: fp64 through the
    reference (the oracle), bf16 through FA4's own forward + backward (the baseline)."""
    P, S_loc, H, H_kv, D, C = case
    params = [p.detach().to(dtype).requires_grad_() for p in _params(lin, norms)]
    if dtype == DTYPE:  # the norms stay fp32 as in the layers
        params[6:] = [p.detach().clone().requires_grad_() for p in _params(lin, norms)[6:]]
    chain = block.TorchQKV(torch.cat(params[:3]), torch.cat(params[3:6]), params[6], params[7], H, H_kv, D, eps=1e-6)
    cos, sin = (torch.cat([r[i] for r in rot]) for i in range(2))
    table = block.rope_table((cos, sin), P * S_loc, D, "cuda")
    x = torch.cat(xs, 1).to(dtype)
    q, k, v = chain(x, table.to(dtype) if dtype == torch.float64 else table, dtype)
    if dtype == torch.float64:
        out = full_attention(q, k, v)
    else:
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.cat(douts, 1).to(dtype))
    return [p.grad.double() for p in params]


def _check(case, got, lin, norms, xs, douts, rot):
    P = case[0]
    oracle = _unsplit_grads(case, lin, norms, xs, douts, rot, torch.float64)
    base = _unsplit_grads(case, lin, norms, xs, douts, rot, DTYPE)
    names = ("to_q.weight", "to_k.weight", "to_v.weight", "to_q.bias", "to_k.bias", "to_v.bias", "norm_q", "norm_k")
    for name, g, ref, b in zip(names, got, oracle, base):
        assert g is not None and torch.isfinite(g).all(), name
        err = (g.double() - ref).abs().max().item()
        base_err = (b - ref).abs().max().item()
        roundings = P * 2.0 ** -8 * ref.abs().max().item()
        assert err <= 2 * base_err + roundings + 1e-3, (name, err, base_err, roundings)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_module_trains_its_layers(case):
    """Emulated ranks: the layers' grads within the rule; impl fused and serial bit for bit."""
    P, S_loc, H, H_kv, D, C = case
    xs, douts, rot = _inputs(case, seed=sum(case))
    grads = {}
    with deterministic():
        for impl in ("fused", "serial"):
            lin, norms = _layers(case, seed=P)
            mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=norms[0], norm_k=norms[1],
                                                        world_size=P, impl=impl)
            outs = mod.forward_emulated([x.clone() for x in xs], rotary=rot)
            torch.autograd.backward(outs, douts)
            grads[impl] = [p.grad for p in _params(lin, norms)]
    for a, b in zip(grads["fused"], grads["serial"]):
        assert torch.equal(a, b)
    lin, norms = _layers(case, seed=P)
    _check(case, grads["fused"], lin, norms, xs, douts, rot)


def _real_ranks(P, group, rank):
    case = (P, 256, 4, 4, 128, 512)
    xs, douts, rot = _inputs(case, seed=7)
    lin, norms = _layers(case, seed=3)
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=case[4], norm_q=norms[0], norm_k=norms[1],
                                                group=group, impl="fused")
    out = mod(xs[rank], rotary=rot[rank])
    out.backward(douts[rank])
    got = []
    for p in _params(lin, norms):
        total = p.grad.float()
        dist.all_reduce(total, group=group)
        got.append(total)
    fresh, fresh_norms = _layers(case, seed=3)
    _check(case, got, fresh, fresh_norms, xs, douts, rot)


def test_real_ranks_module_trains_its_layers():
    """2 rank processes sharing the GPU (MPS), impl fused: each rank's partial grads of its layers,
    summed over the ranks, within the rule."""
    from ulysses.transport import close_transports

    run_on_gloo_groups(_real_ranks, (2,), cuda=True, timeout_s=300, teardown=close_transports)
