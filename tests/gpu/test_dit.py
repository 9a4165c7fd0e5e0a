"""Flux under Ulysses on one GPU (bf16): emulated ranks in one process, and 2 processes over CUDA IPC.

FA4's tolerance rule on the model's final output: with ref = the single-device model in fp32 and
base = the single-device model in bf16 (diffusers' own attention, SDPA), the Ulysses output must
satisfy max|out - ref| <= 2 * max|base - ref| + atol. "fused" and "serial" run the same FA4
arithmetic (the fused kernel's output is bit-identical to FA4's moved by the A2A), so their
model outputs must be bit-identical too.
"""

import copy
import os
import socket

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a import dit  # noqa: E402

# Flux widths at head dim 128 (FA4's), 6 heads so that P = 4 pads heads, few layers.
CFG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=128,
           num_attention_heads=6, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(16, 56, 56))
TEXT_LEN = 77


def _models():
    """(bf16 model, fp32 copy of the same bf16 weights): the reference sees no weight rounding."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CFG).eval().to(device="cuda", dtype=torch.bfloat16)
    return model, copy.deepcopy(model).float()


def _inputs(height, width, dtype=torch.bfloat16, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    x = dict(
        hidden_states=torch.randn(batch, height * width, CFG["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, TEXT_LEN, CFG["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(batch, CFG["pooled_projection_dim"], generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(TEXT_LEN, 3),
    )
    return {k: (v.to("cuda", dtype) if k not in ("img_ids", "txt_ids") else v.cuda()) for k, v in x.items()}


def _check_fa4_rule(out, base, ref, what):
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    ref = ref.float()
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    base_err = (base.float() - ref).abs().max().item()
    assert err <= 2 * base_err + atol, f"{what}: max error {err:.4g} > 2 * {base_err:.4g} + {atol:.2g}"
    mean, base_mean = (out.float() - ref).abs().mean().item(), (base.float() - ref).abs().mean().item()
    assert mean <= 2 * base_mean + atol, f"{what}: mean error {mean:.4g} > 2 * {base_mean:.4g}"


@pytest.fixture(scope="module")
def models():
    return _models()


# (P, height, width): S = 1024 over 2 ranks; S = 1020 over 4 ranks (S_loc = 255, padded rows, 6 heads -> 8).
CASES = [(2, 32, 32), (4, 30, 34)]


@pytest.mark.parametrize("P,height,width", CASES)
def test_flux_emulated_ranks(models, P, height, width):
    model, model32 = models
    x = _inputs(height, width)
    with torch.no_grad():
        ref = model32(**{k: (v.float() if v.is_floating_point() else v) for k, v in x.items()}).sample
        base = model(**x).sample
        outs = {}
        for impl in ("fused", "serial"):
            handle = dit.parallelize_flux(model, impl=impl, emulated_ranks=P)
            try:
                outs[impl] = model(**x).sample.clone()
            finally:
                handle.remove()
            torch.cuda.synchronize()
            _check_fa4_rule(outs[impl], base, ref, f"P={P} S={height * width} impl={impl}")
    assert torch.equal(outs["fused"], outs["serial"]), "fused and serial model outputs differ"


def _ipc_worker(rank, world_size, port, height, width, failures):
    import torch.distributed as dist

    # First calls compile kernels while the peer may already wait at a barrier: allow for it.
    os.environ.setdefault("FA_A2A_TIMEOUT_S", "300")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        from ulysses.transport import close_transports

        model, model32 = _models()
        x = _inputs(height, width)
        with torch.no_grad():
            ref = model32(**{k: (v.float() if v.is_floating_point() else v) for k, v in x.items()}).sample
            base = model(**x).sample
            handle = dit.parallelize_flux(model, impl="fused")
            out = model(**x).sample
            out2 = model(**x).sample  # windows reused across calls
            handle.remove()
        torch.cuda.synchronize()
        _check_fa4_rule(out, base, ref, f"rank {rank} IPC P={world_size}")
        if not torch.equal(out, out2):
            failures.put(f"rank {rank}: two identical forwards differ")
        close_transports()
    except BaseException as exc:  # reported by the parent
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def test_flux_ipc_two_processes_one_gpu():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failures = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_ipc_worker, args=(2, port, 30, 34, failures), nprocs=2, start_method="spawn")
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert not found, "\n".join(found)
