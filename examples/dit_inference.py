"""DiT inference with the Ulysses attention: a random Flux transformer, P ranks vs one device.

Builds a diffusers FluxTransformer2DModel from a config (random weights, nothing downloaded), runs
a flow-matching Euler loop of --steps transformer calls on one device (diffusers' own attention)
and under Ulysses (fa_a2a.dit.parallelize_flux) for each --impls entry, and prints a table: error
of the final latents against the single-device bf16 run and against an fp32 single-device run
(the bf16 noise floor), and the latency per step (median over steps, max over ranks, eager).

How the P ranks run:
  python examples/dit_inference.py --nproc 2      P processes sharing GPU 0; peers' buffers mapped
                                                   with CUDA IPC (ulysses.transport.VmmTransport),
                                                   a gloo group for host-side collectives. "nccl"
                                                   is skipped (NCCL refuses two ranks on one GPU).
  torchrun --nproc-per-node=8 examples/dit_inference.py
                                                   one rank per GPU, NCCL group; all impls.
  python examples/dit_inference.py --emulated --nproc 4
                                                   one process plays the P ranks (one forward over
                                                   P stacked shards); fused / serial only.
On ranks sharing one GPU the latencies are those of time-shared kernels: they check the code
path, they do not predict multi-GPU speed.

Defaults: --size small (Flux widths: 24 heads x 128, joint dim 4096; 2 double + 4 single
blocks), 64 x 64 image tokens (a 1024 px image), 512 text tokens, 4 steps. Measured: not yet.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

SIZES = {
    # heads, head_dim, double blocks, single blocks, in_channels, joint dim, pooled dim
    "tiny": dict(num_attention_heads=4, attention_head_dim=128, num_layers=1, num_single_layers=1,
                 in_channels=64, joint_attention_dim=256, pooled_projection_dim=128),
    "small": dict(num_attention_heads=24, attention_head_dim=128, num_layers=2, num_single_layers=4,
                  in_channels=64, joint_attention_dim=4096, pooled_projection_dim=768),
    # FLUX.1's transformer (about 12B parameters, 24 GB in bf16 per rank).
    "flux": dict(num_attention_heads=24, attention_head_dim=128, num_layers=19, num_single_layers=38,
                 in_channels=64, joint_attention_dim=4096, pooled_projection_dim=768),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks P when not under torchrun (default 2)")
    ap.add_argument("--emulated", action="store_true", help="one process plays the P ranks")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--double-layers", type=int, default=None, help="override the preset's double-stream blocks")
    ap.add_argument("--single-layers", type=int, default=None, help="override the preset's single-stream blocks")
    ap.add_argument("--height", type=int, default=64, help="image token rows (packed latents)")
    ap.add_argument("--width", type=int, default=64, help="image token columns")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps (transformer calls) timed")
    ap.add_argument("--impls", default="fused,serial,nccl", help="comma-separated: fused, serial, nccl, reference")
    ap.add_argument("--no-fp32-ref", action="store_true", help="skip the fp32 single-device run")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke test of the wiring (impls reference and nccl = permute + gloo all_to_all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    for name in ("nproc", "height", "width", "text_len", "batch", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [s for s in args.impls if s not in ("fused", "serial", "nccl", "reference")]
    if bad or not args.impls:
        ap.error(f"--impls: unknown {bad or 'empty list'}")
    return args


def build_model(args, device):
    from diffusers import FluxTransformer2DModel

    cfg = dict(SIZES[args.size])
    if args.double_layers is not None:
        cfg["num_layers"] = args.double_layers
    if args.single_layers is not None:
        cfg["num_single_layers"] = args.single_layers
    cfg["axes_dims_rope"] = (16, 56, 56) if cfg["attention_head_dim"] == 128 else (8, 28, 28)
    # Same seed on every rank, initialised on the device: identical weights (checked below).
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg)
    return model.eval().to(torch.bfloat16), cfg


def make_inputs(args, cfg, device):
    g = torch.Generator().manual_seed(args.seed + 1)
    H, W, J, B = args.height, args.width, args.text_len, args.batch
    ids = torch.zeros(H, W, 3)
    ids[..., 1] = torch.arange(H)[:, None]
    ids[..., 2] = torch.arange(W)[None, :]
    return dict(
        latents=torch.randn(B, H * W, cfg["in_channels"], generator=g).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(B, J, cfg["joint_attention_dim"], generator=g).to(device, torch.bfloat16),
        pooled_projections=torch.randn(B, cfg["pooled_projection_dim"], generator=g).to(device, torch.bfloat16),
        img_ids=ids.reshape(-1, 3).to(device),
        txt_ids=torch.zeros(J, 3, device=device),
    )


def _timed(fn, device):
    """(result of fn(), elapsed ms): CUDA events on the current stream, or the host clock on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        res = fn()
        return res, 1e3 * (time.perf_counter() - t0)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    res = fn()
    stop.record()
    stop.synchronize()
    return res, start.elapsed_time(stop)


def denoise(model, inputs, steps, dtype, *, sync=None):
    """Flow-matching Euler over `steps` transformer calls; returns (final latents, ms per call)."""
    x = inputs["latents"].to(dtype)
    cond = {k: (v.to(dtype) if k in ("encoder_hidden_states", "pooled_projections") else v)
            for k, v in inputs.items() if k != "latents"}
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    times = []
    for i in range(steps):
        t = torch.full((x.shape[0],), sigmas[i], device=x.device, dtype=dtype)
        if sync is not None:
            sync()
        v, ms = _timed(lambda: model(hidden_states=x, timestep=t, **cond).sample, x.device)
        times.append(ms)
        x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(dtype)
    return x, times


def run(rank, world_size, args, device, group_backend):
    from fa_a2a.dit import parallelize_flux

    distributed = world_size > 1 and not args.emulated
    P = args.nproc if args.emulated else world_size

    def host_barrier():
        if distributed:
            dist.barrier()

    def all_max(value):
        if not distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device if group_backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    model, cfg = build_model(args, device)
    if distributed:  # every rank must hold the same weights
        sums = torch.tensor([sum(p.double().sum().item() for p in model.parameters())], dtype=torch.float64)
        sums = sums.to(device) if group_backend == "nccl" else sums
        lo, hi = sums.clone(), sums.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if lo.item() != hi.item():
            raise RuntimeError("ranks built different weights (seeded init differs across devices)")
    inputs = make_inputs(args, cfg, device)
    S = args.height * args.width
    results = []
    with torch.no_grad():
        ref32 = None
        if rank == 0 and not args.no_fp32_ref:
            ref32, _ = denoise(copy.deepcopy(model).float(), inputs, args.steps, torch.float32)
        base, base_times = None, [0.0]
        if rank == 0:
            denoise(model, inputs, 1, torch.bfloat16)  # warm-up
            base, base_times = denoise(model, inputs, args.steps, torch.bfloat16)
        if rank == 0:
            results.append(dict(impl="1 device (SDPA)", times=base_times, out=base))
        host_barrier()
        outs = {}
        for impl in args.impls:
            if impl == "nccl" and (args.emulated or (device.type == "cuda" and group_backend != "nccl")):
                if rank == 0:
                    print("skipping impl=nccl: needs one rank per GPU with an NCCL group")
                continue
            handle = parallelize_flux(model, group=None, impl=impl,
                                      emulated_ranks=P if args.emulated else None)
            try:
                x = inputs["latents"]
                t = torch.full((x.shape[0],), 1.0, device=device, dtype=torch.bfloat16)
                model(hidden_states=x, timestep=t, **{k: v for k, v in inputs.items() if k != "latents"})  # compile
                if device.type == "cuda":
                    torch.cuda.synchronize()
                host_barrier()
                out, times = denoise(model, inputs, args.steps, torch.bfloat16, sync=host_barrier)
            finally:
                handle.remove()
            times = [all_max(v) for v in times]
            outs[impl] = out
            if rank == 0:
                results.append(dict(impl=impl, times=times, out=out))
    if rank != 0:
        return None
    rows = []
    for r in results:
        out = r["out"].float()
        d = (out - base.float()).abs()
        row = dict(impl=r["impl"], max_err_vs_bf16=d.max().item(), mean_err_vs_bf16=d.mean().item(),
                   ms_per_step=statistics.median(r["times"]), ms_steps=r["times"])
        if ref32 is not None:
            d32 = (out - ref32.float()).abs()
            row.update(max_err_vs_fp32=d32.max().item(), mean_err_vs_fp32=d32.mean().item())
        rows.append(row)
    if "fused" in outs and "serial" in outs:
        same = torch.equal(outs["fused"], outs["serial"])
    else:
        same = None
    mode = (f"emulated P={P} in one process" if args.emulated else
            f"P={P} processes, {group_backend} group"
            + (", one GPU shared (CUDA IPC)" if group_backend == "gloo" and device.type == "cuda" else ""))
    params = sum(p.numel() for p in model.parameters())
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{card}; Flux '{args.size}' {cfg['num_layers']}+{cfg['num_single_layers']} "
          f"blocks, {params / 1e9:.2f} B params, bf16; S = {S} image + {args.text_len} text tokens, "
          f"B = {args.batch}; {args.steps} steps; {mode}")
    head = "| impl | max err vs 1-dev bf16 | mean err | max err vs fp32 | mean err vs fp32 | ms/step (median) |"
    print(head)
    print("|" + "---|" * 6)
    for row in rows:
        e32 = (f"{row['max_err_vs_fp32']:.3g} | {row['mean_err_vs_fp32']:.3g}" if "max_err_vs_fp32" in row
               else "- | -")
        print(f"| {row['impl']} | {row['max_err_vs_bf16']:.3g} | {row['mean_err_vs_bf16']:.3g} | {e32} | "
              f"{row['ms_per_step']:.2f} |")
    if same is not None:
        print(f"fused and serial final latents bit-identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=card, mode=mode, config=cfg, S=S,
                           text_len=args.text_len, steps=args.steps, fused_equals_serial=same, rows=rows), f, indent=1)
    return rows


def _spawned(rank, world_size, port, args):
    os.environ.setdefault("FA_A2A_TIMEOUT_S", "300")  # first calls compile kernels while peers wait
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        run(rank, world_size, args, device, "gloo")
        if device.type == "cuda":
            from ulysses.transport import close_transports

            close_transports()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (SM90 for the fused and serial impls); --device cpu for a smoke test")
    if args.device == "cpu" and set(args.impls) - {"reference", "nccl"}:
        raise SystemExit("--device cpu: only --impls reference,nccl run on CPU")
    t0 = time.time()
    if "WORLD_SIZE" in os.environ and not args.emulated:  # torchrun
        world_size, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda":
            shared = torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            device = torch.device("cuda", 0 if shared else local)
            torch.cuda.set_device(device)
            backend = "gloo" if shared else "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        os.environ.setdefault("FA_A2A_TIMEOUT_S", "300")
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        try:
            run(dist.get_rank(), world_size, args, device, backend)
            if device.type == "cuda":
                from ulysses.transport import close_transports

                close_transports()
        finally:
            dist.destroy_process_group()
    elif args.emulated or args.nproc == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        run(0, 1, args, device, "none")
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
