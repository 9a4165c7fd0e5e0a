"""Training through fa-a2a's diffusers backend on CPU (gloo ranks, fp32), and examples/train.py.

- The backend's templated local op: _local_backward_op against autograd of SDPA (its Ulysses form,
  with a mask) and, summed over K/V chunks, against the whole attention's gradient (its ring form,
  GQA, a softmax_scale).
- Tiny random Flux and QwenImage transformers, 2 gloo ranks: every parameter's .grad (summed over
  the ranks, as sequence-parallel training all-reduces replicated parameters) equals the
  single-process model's within 1e-4 of its largest magnitude, on each route: the Ulysses op (impl
  "reference"), diffusers' templated Ulysses with the backend's local op (impl "serial" on CPU
  tensors, and QwenImage's text mask), diffusers' templated ring (ring degree 2). The route counts
  say which route ran.
- Refusals with grad: ulysses_anything on the templated route (diffusers has no backward there),
  named by a ValueError on every rank; ranks that disagree on requires_grad get the same
  ValueError on both routes (never a hang).
- examples/train.py under torchrun on 2 CPU ranks and in one process: the per-step losses agree
  to rtol 1e-4; its argument errors exit 2.
"""

import copy
import json
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a.models import diffusers_backend as backend  # noqa: E402
from tests.cpu.test_dit_cpu import HEAD_DIM, HEADS, TXT_DIM, _flux  # noqa: E402
from tests.cpu.test_dit_cpu import _flux_inputs as dit_inputs, _qwen_inputs as qwen_inputs  # noqa: E402
from tests.helpers import repo_env  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL = 1e-4


# ---- the templated route's local op ------------------------------------------------------------------------
def _ctx():
    ctx = types.SimpleNamespace()
    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
    return ctx


def _sdpa_grads(q, k, v, do, mask=None, scale=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                                         scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return torch.autograd.grad(o.transpose(1, 2), (q, k, v), do)


def test_local_backward_op_matches_autograd():
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 7, 4, 8
    q, k, v, do = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.4
    mask[..., 0] = True
    ctx = _ctx()
    out = backend._local_forward_op(ctx, q, k, v, mask, scale=0.3)
    assert torch.allclose(out, backend._local_attention(q, k, v, mask, scale=0.3), atol=0)
    for got, want in zip(backend._local_backward_op(ctx, do), _sdpa_grads(q, k, v, do, mask, 0.3)):
        assert (got - want).abs().max().item() < 1e-12
    # ring: K/V in two chunks (GQA: 2 K/V heads for 4 query heads), the merged out and lse of all of them
    kv = [torch.randn(B, S, 2, D, generator=g, dtype=torch.float64) for _ in range(2)]
    out, lse = backend._local_attention(q, *kv, scale=0.3, return_lse=True)
    ctx = _ctx()
    backend._local_forward_op(ctx, q, kv[0][:, :3], kv[1][:, :3], scale=0.3, return_lse=True)
    parts = [backend._local_backward_op(ctx, do, query=q, key=kv[0][:, c], value=kv[1][:, c], out=out, lse=lse)
             for c in (slice(0, 3), slice(3, S))]
    got = (parts[0][0] + parts[1][0], torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts], 1))
    for a, b in zip(got, _sdpa_grads(q, *kv, do, scale=0.3)):
        assert (a - b).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="query, key, value, out and lse together"):
        backend._local_backward_op(ctx, do, query=q)


# ---- models under diffusers' context parallelism, 2 gloo ranks ---------------------------------------------------
def _flux_inputs(g, w=6):
    """test_dit_cpu's Flux inputs: a 6 x w image grid and 6 text tokens."""
    return dit_inputs((1, 6, w), 6, g)


def _qwen():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=1, in_channels=8, out_channels=8, num_layers=1,
                                       attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                       joint_attention_dim=TXT_DIM, axes_dims_rope=(4, 6, 6))


def _qwen_inputs(g):
    """test_dit_cpu's QwenImage inputs, 6 x 6 grid, 6 text tokens; sample 1's last two text tokens
    padded (a text mask: the templated path)."""
    return qwen_inputs((1, 6, 6), 6, g, mask=True)


def _loss(model, x, target):
    return torch.nn.functional.mse_loss(model(**x)[0], target)


def _summed_grads(model, group):
    import torch.distributed as dist

    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[n] = g
    return grads


def _check_grads(what, model, single, x, group):
    """The CP model's loss and its ranks' summed grads against the single-process model's."""
    target = torch.randn(x["hidden_states"].shape, generator=torch.Generator().manual_seed(7))  # out: in's shape
    for m in (model, single):
        m.train().zero_grad(set_to_none=True)
    ref = _loss(single, x, target)
    ref.backward()
    loss = _loss(model, x, target)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= RTOL * abs(ref.item()), f"{what}: loss {loss.item()} vs {ref.item()}"
    grads = _summed_grads(model, group)
    worst = 0.0
    for n, p in single.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        scale = want.abs().max().item()
        err = (grads[n] - want).abs().max().item()
        assert err <= RTOL * scale + 1e-9, f"{what}: grad of {n} differs by {err:.3g} (largest |grad| {scale:.3g})"
        worst = max(worst, err / scale if scale else 0.0)
    assert sum(p.grad is not None for p in single.parameters()) > 20, f"{what}: too few parameters got a grad"
    return worst


def _cp(make, name, **config):
    from diffusers import ContextParallelConfig

    torch.manual_seed(0)
    model = make()
    single = copy.deepcopy(model)
    model.set_attention_backend(name)
    single.set_attention_backend("native")  # set_attention_backend also sets diffusers' process-wide default
    model.enable_parallelism(config=ContextParallelConfig(**config))
    return model, single


def _check_routes(P, group, rank):
    backend.cpu_testbed()
    names = {impl: backend.register_diffusers_backend(f"fa_a2a_{impl}", impl) for impl in ("reference", "serial")}
    cases = (  # (what, model, inputs, backend, config, expected route counts)
        ("flux ulysses op", _flux, _flux_inputs, names["reference"], dict(ulysses_degree=P), {"ulysses": 2}),
        ("flux templated ulysses (impl serial on CPU tensors)", _flux, _flux_inputs, names["serial"],
         dict(ulysses_degree=P), {"templated": 2}),
        ("qwenimage templated ulysses (text mask)", _qwen, _qwen_inputs, names["reference"], dict(ulysses_degree=P),
         {"templated": 1}),
        ("flux templated ring", _flux, _flux_inputs, names["reference"], dict(ring_degree=P), {"templated": 2}),
    )
    for what, make, inputs, name, config, routes in cases:
        model, single = _cp(make, name, **config)
        backend.route_counts(name, reset=True)
        _check_grads(f"rank {rank} {what}", model, single, inputs(torch.Generator().manual_seed(1)), group)
        assert backend.route_counts(name) == routes, f"rank {rank} {what}: routes {backend.route_counts(name)}"
    _check_refusals(P, rank, names)


def _check_refusals(P, rank, names):
    # ulysses_anything on the templated route: diffusers' TemplatedUlyssesAnythingAttention has no backward
    model, _ = _cp(_flux, names["serial"], ulysses_degree=P, ulysses_anything=True)
    with pytest.raises(ValueError, match=r"^ulysses_anything: the inputs require grad, but the call takes "
                                         r"diffusers' templated path \(CPU tensors"):
        model(**_flux_inputs(torch.Generator().manual_seed(1), w=7))
    with torch.no_grad():  # forward-only: still runs
        model(**_flux_inputs(torch.Generator().manual_seed(1), w=7))
    # requires_grad on rank 0 only: the same ValueError on both ranks, on both routes
    for name, match in ((names["serial"], r"^requires_grad: rank\(s\) \[0\] of group ranks \[0, 1\] call attention "
                                          r"with inputs that require grad"),
                        (names["reference"], "requires_grad")):
        model, _ = _cp(_flux, name, ulysses_degree=P)
        with torch.set_grad_enabled(rank == 0), pytest.raises(ValueError, match=match):
            model(**_flux_inputs(torch.Generator().manual_seed(1)))


def test_grads_under_the_backend_match_one_process():
    """Also: the refusals with grad (ulysses_anything on the templated route, requires_grad on one rank)."""
    run_on_gloo_groups(_check_routes, (2,), timeout_s=240)


# ---- examples/train.py ----------------------------------------------------------------------------------------------
def _env():
    env = repo_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _run_example(tmp_path, nproc, *extra):
    out = tmp_path / f"losses-{nproc}.json"
    script = os.path.join(ROOT, "examples", "train.py")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    p = subprocess.run([*launch, script, "--steps", "4", "--json", str(out), *extra], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text()), p.stdout


def test_train_example_two_ranks_match_one_process(tmp_path):
    two, stdout = _run_example(tmp_path, 2, "--world-size-1-reference")
    one, _ = _run_example(tmp_path, 1)
    assert (two["world_size"], two["group"], two["impl"], two["device"]) == (2, "gloo", "reference", "cpu")
    assert (one["world_size"], one["impl"]) == (1, None)
    assert len(two["losses"]) == len(one["losses"]) == 4
    assert two["reference_losses"] == pytest.approx(one["losses"], rel=0, abs=0), "P = 1 runs differ"
    assert two["losses"] == pytest.approx(one["losses"], rel=RTOL)
    assert one["losses"][-1] < one["losses"][0], f"the loss did not fall: {one['losses']}"
    backend_name = "fa_a2a_reference"
    assert two["routes"] == {backend_name: {"ulysses": 2 * 4}}, two["routes"]  # 2 attention calls per step
    for step, loss in enumerate(two["losses"]):
        assert f"step {step} loss {loss:.6f}" in stdout


def test_train_example_argument_errors(tmp_path):
    script = os.path.join(ROOT, "examples", "train.py")
    env = _env()
    (tmp_path / "afile").write_text("")
    for args, message in ((["--steps", "0"], "argument --steps: expected an integer in"),
                          (["--impl", "fused", "--device", "cpu"], "--impl: on CPU only reference runs"),
                          (["--json", str(tmp_path / "missing" / "x.json")], "--json: "),  # (checked before training)
                          (["--json", str(tmp_path)], "--json: expected a file, got the folder"),
                          (["--json", ""], "--json: expected a file path")):
        p = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr.splitlines()[-1], p.stderr
    env["WORLD_SIZE"] = "2"
    p = subprocess.run([sys.executable, script, "--heads", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--heads: expected a multiple of the 2 ranks, got 3" in p.stderr.splitlines()[-1], \
        p.stderr


def test_train_example_fails_when_a_loss_is_not_finite(tmp_path):
    """A learning rate that blows the loss up ends the run with exit status 1 and says so (it printed NaN losses
    and exited 0)."""
    script = os.path.join(ROOT, "examples", "train.py")
    p = subprocess.run([sys.executable, script, "--steps", "3", "--lr", "1000"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "step 2 loss nan" in p.stdout
    assert "train.py: a loss is not finite (NaN or inf) at SGD lr 1000.0: lower --lr" in p.stderr.splitlines()[-1]
