"""A few training steps of a tiny Flux transformer under Ulysses with the fa-a2a backend.

    torchrun --nproc-per-node=2 examples/train.py --steps 8 --world-size-1-reference
    python examples/train.py --steps 8                      # one process: no parallelism

Every rank builds the same FluxTransformer2DModel of random weights (--heads x --head-dim, one
double- and one single-stream block), the same random inputs and a fixed random target, and runs
--steps optimizer steps (SGD) of loss = MSE(model output, target). Under torchrun with P >= 2
ranks the model runs under diffusers' context parallelism with fa-a2a's backend
(fa_a2a.enable_ulysses(model, impl=...)): diffusers shards the tokens, the backend's attention
(the Ulysses op, differentiable) exchanges them, and every rank computes the loss of the gathered
output; each rank's parameter grads then cover its shard's rows, and their sum over the ranks
(an all-reduce) is the full gradient, which every rank applies. One process: the same steps
without parallelism. --world-size-1-reference: under torchrun, also the same steps of the model
without parallelism on every rank, for comparison (the loss of each step, and the largest
relative difference).

Rank 0 prints the loss of every step ("step N loss X"); a loss that is not finite (a learning rate too
high) ends the run with exit status 1. One GPU per rank: NCCL and impl "auto";
ranks sharing a GPU (under `python -m fa_a2a.mps`): gloo (diffusers' output gather through host
memory); the model's weights stay fp32 and --dtype bfloat16 (the default on GPUs) runs the forward
under autocast, so the attention gets bf16 q, k, v (the fused kernels' dtypes). Without a GPU:
CPU ranks over gloo, fp32, impl "reference" (fa_a2a.models.diffusers_backend.cpu_testbed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from fa_a2a.tools.cli import MAX_HEADS, MAX_REPEATS, float_in, int_in, out_file

IMPLS = ("auto", "fused", "fused:tma", "fused:st", "serial", "nccl", "reference")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node=P examples/train.py",
                                 description=__doc__.split("\n\n")[0],
                                 epilog="Install: pip install -e \".[dit]\" (diffusers).")
    ap.add_argument("--steps", type=int_in(1, MAX_REPEATS), default=8, help="optimizer steps (default 8)")
    ap.add_argument("--lr", type=float_in(0, 1e3), default=0.5, help="SGD learning rate (default 0.5)")
    ap.add_argument("--impl", choices=IMPLS, default=None,
                    help="the Ulysses op's impl; default: auto on GPUs, reference on CPU")
    ap.add_argument("--heads", type=int_in(1, MAX_HEADS), default=4, help="attention heads (a multiple of P)")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=64)
    ap.add_argument("--image-size", type=int_in(1, 256), default=16,
                    help="image tokens per side (default 16: 256 image tokens)")
    ap.add_argument("--text-tokens", type=int_in(1, 4096), default=32)
    ap.add_argument("--seed", type=int_in(0, 2 ** 63 - 1), default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when a CUDA GPU is present, else cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="the forward's dtype (bfloat16: autocast over fp32 weights); default bfloat16 on GPUs, "
                         "float32 on CPU (CPU runs float32 only)")
    ap.add_argument("--world-size-1-reference", action="store_true",
                    help="under torchrun, also run the same steps without parallelism and compare")
    ap.add_argument("--json", type=out_file(), default=None, help="also write the losses (rank 0) to this file")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.heads % world:
        ap.error(f"--heads: expected a multiple of the {world} ranks, got {args.heads}")
    if (args.image_size ** 2) % world or args.text_tokens % world:
        ap.error(f"--image-size, --text-tokens: expected token counts the {world} ranks divide, got "
                 f"{args.image_size ** 2} image and {args.text_tokens} text tokens")
    if args.device == "cpu" and args.impl not in (None, "reference"):
        ap.error(f"--impl: on CPU only reference runs (the other impls run CUDA kernels), got {args.impl}")
    if args.device == "cpu" and args.dtype == "bfloat16":
        ap.error("--dtype: on CPU only float32 runs")
    return ap, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # a bad flag is refused before torch and diffusers load

import copy  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ranks import init_ranks, pick_device  # noqa: E402


# the P = 1 runs' attention: SDPA's math kernel (on one H200, torch 2.11, bf16 autocast, diffusers'
# "native" choice gave NaN losses from the second step on, 2026-12-05; which kernel SDPA picked there
# was not checked)
REFERENCE_BACKEND = "_native_math"


def setup(ap, args):
    """(rank, world size, device, process-group backend or None for one process) of this rank
    (_ranks), with the impl and dtype that run there."""
    world, device, backend = pick_device(ap, args)
    if args.device == "cpu" and args.impl not in (None, "reference"):
        ap.error(f"--impl: no CUDA GPU found, and on CPU only reference runs, got {args.impl}")
    if args.device == "cpu" and args.dtype == "bfloat16":
        ap.error("--dtype: no CUDA GPU found, and on CPU only float32 runs")
    if args.impl is None:
        args.impl = "auto" if args.device == "cuda" else "reference"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if world == 1:
        return 0, 1, device, None
    return init_ranks(device, backend), world, device, backend


def tiny_flux(args, device):
    from diffusers import FluxTransformer2DModel

    D = args.head_dim
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=D, num_attention_heads=args.heads, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(D // 8, 7 * D // 16, 7 * D // 16))
    return model.to(device)


def batch(args, device):
    """(model inputs, target): the same on every rank (diffusers shards them)."""
    n, J = args.image_size, args.text_tokens
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.zeros(n, n, 3)
    ids[..., 1], ids[..., 2] = torch.arange(n)[:, None], torch.arange(n)[None, :]
    x = dict(hidden_states=torch.randn(1, n * n, 16, generator=g),
             encoder_hidden_states=torch.randn(1, J, 32, generator=g),
             pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.rand(1, generator=g),
             img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(J, 3))
    target = torch.randn(1, n * n, 16, generator=g)
    return {k: v.to(device) for k, v in x.items()}, target.to(device)


def train(model, x, target, args, device, group=None) -> list:
    """args.steps SGD steps; group: the ranks whose grads are summed (None: one process). -> losses."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            out = model(**x, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        if group is not None:  # each rank's grads cover its shard's rows: their sum is the full gradient
            for p in model.parameters():
                if p.grad is not None:  # the same parameters on every rank (the same graph)
                    dist.all_reduce(p.grad, group=group)
        opt.step()
        losses.append(loss.item())
    return losses


def main(ap, args):
    rank, world, device, backend = setup(ap, args)
    import fa_a2a
    from fa_a2a.models.diffusers_backend import route_counts

    model = tiny_flux(args, device)
    x, target = batch(args, device)
    reference = copy.deepcopy(model) if world > 1 and args.world_size_1_reference else None
    name = None
    if world == 1:  # one process: the reference, on the same attention as the P = 1 run beside P ranks
        model.set_attention_backend(REFERENCE_BACKEND)
    if world > 1:
        name = "fa_a2a" if args.impl == "auto" else f"fa_a2a_{args.impl}".replace(":", "_")  # enable_ulysses' rule
        fa_a2a.enable_ulysses(model, impl=args.impl, name=name)
        route_counts(name, reset=True)
    losses = train(model, x, target, args, device, dist.group.WORLD if world > 1 else None)
    routes = {name: route_counts(name)} if name else {}
    ref_losses = None
    if reference is not None:
        reference.set_attention_backend(REFERENCE_BACKEND)
        ref_losses = train(reference, x, target, args, device)
    if rank == 0:
        what = (f"P = {world} ranks ({backend} group), fa-a2a backend impl {args.impl}" if world > 1
                else "one process, no parallelism")
        print(f"tiny Flux ({args.heads} x {args.head_dim} heads, {args.image_size ** 2} image + {args.text_tokens} "
              f"text tokens), {args.dtype} on {device.type}; {what}; SGD lr {args.lr}")
        for step, loss in enumerate(losses):
            print(f"step {step} loss {loss:.6f}" + (f"   (P = 1: {ref_losses[step]:.6f})" if ref_losses else ""))
        if ref_losses:
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            print(f"largest relative difference to P = 1: {worst:.3g}")
        if world > 1:
            print(f"attention routes (rank 0): {routes}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=device.type, world_size=world, group=backend,
                               impl=args.impl if world > 1 else None, dtype=args.dtype, lr=args.lr, losses=losses,
                               reference_losses=ref_losses, routes=routes), f, indent=1)
    if world > 1:
        dist.barrier()
        if device.type == "cuda":
            from ulysses.transport import close_transports

            close_transports()
        dist.destroy_process_group()
    if not all(math.isfinite(v) for v in losses + (ref_losses or [])):  # (every rank computes the same losses)
        sys.exit(f"train.py: a loss is not finite (NaN or inf) at SGD lr {args.lr}: lower --lr")


if __name__ == "__main__":
    main(PARSER, ARGS)
