"""DiT inference under diffusers' own Ulysses with the fa-a2a backend, against one device.

Builds a diffusers Flux, Wan or QwenImage transformer (--model; tiny random weights by default,
nothing downloaded; --pretrained PATH loads real weights with from_pretrained), runs a
flow-matching Euler loop of --steps transformer calls on one device (diffusers' SDPA) and then
under `enable_parallelism(ContextParallelConfig(ulysses_degree=P))` with each --impls entry:
  fused | serial | nccl | reference   the fa-a2a attention backend with that impl of the op
  diffusers                           diffusers' own Ulysses (backend "native": permute +
                                      all_to_all_single around SDPA)
and prints a table: error of the final latents against the single-device bf16 run and against
an fp32 single-device run (the bf16 noise floor), and the latency per step (median over steps,
max over ranks, eager).

How the P ranks run:
  torchrun --nproc-per-node=8 examples/dit_inference.py --model wan
                                     one rank per GPU, NCCL group; all impls.
  python examples/dit_inference.py --nproc 2
                                     P processes sharing GPU 0: peers' buffers mapped through the
                                     project's VMM/IPC transport, a gloo group for the host-side
                                     collectives. "nccl" and "diffusers" are skipped (they need
                                     NCCL, which refuses two ranks on one GPU). diffusers' gather
                                     of the model output goes through host memory (gloo).
  python examples/dit_inference.py --device cpu --nproc 2
                                     a CPU smoke test of the wiring (fp32, gloo, impls reference,
                                     nccl, diffusers): what runs by default on a machine without a
                                     CUDA GPU (fa_a2a.models.diffusers_backend.cpu_testbed() lets diffusers'
                                     context parallelism run there, --ulysses-anything included).
On ranks sharing one GPU the latencies are those of time-shared kernels: they check the code
path, they do not predict multi-GPU speed. --ulysses-anything lets P not divide the token
counts (uneven shards: the op takes them as shard_rows).

Measured (NVIDIA H200, 2026-12-03, `--model flux --nproc 2 --impls fused,serial --steps 3`: tiny
Flux, 4096 image + 512 text tokens, bf16, 2 processes sharing the GPU): max error of the final
latents against the fp32 single-device run 0.0362 for the single-device bf16 model, fused and
serial alike (bit-identical latents); 6.38 ms/step on one device, 15.41 (fused) and 15.10
(serial) ms/step time-shared.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time

from fa_a2a.tools.cli import MAX_REPEATS, MAX_SEQLEN, MAX_WORLD_SIZE, int_in, out_file

# Per model: the diffusers class, presets (tiny: 4 heads x 128; small: 24 heads x 128, a few blocks),
# and the default token grid (image/video latents after patching; text tokens).
MODELS = {
    "flux": dict(cls="FluxTransformer2DModel", presets=dict(
        tiny=dict(num_attention_heads=4, attention_head_dim=128, num_layers=1, num_single_layers=1, in_channels=64,
                  joint_attention_dim=256, pooled_projection_dim=128, axes_dims_rope=(16, 56, 56)),
        small=dict(num_attention_heads=24, attention_head_dim=128, num_layers=2, num_single_layers=4, in_channels=64,
                   joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))),
        frames=1, height=64, width=64, text_len=512),
    "wan": dict(cls="WanTransformer3DModel", presets=dict(
        tiny=dict(num_attention_heads=4, attention_head_dim=128, num_layers=2, in_channels=16, out_channels=16,
                  text_dim=256, ffn_dim=1024, patch_size=(1, 2, 2)),
        small=dict(num_attention_heads=12, attention_head_dim=128, num_layers=4, in_channels=16, out_channels=16,
                   text_dim=4096, ffn_dim=8960, patch_size=(1, 2, 2))),
        frames=4, height=30, width=52, text_len=512),  # 480x832 px, 13 frames: 4 x 30 x 52 tokens after patching
    "qwenimage": dict(cls="QwenImageTransformer2DModel", presets=dict(
        tiny=dict(num_attention_heads=4, attention_head_dim=128, num_layers=2, in_channels=64, out_channels=16,
                  joint_attention_dim=256, axes_dims_rope=(16, 56, 56)),
        small=dict(num_attention_heads=24, attention_head_dim=128, num_layers=4, in_channels=64, out_channels=16,
                   joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))),
        frames=1, height=64, width=64, text_len=512),
}
FA_IMPLS = ("auto", "fused", "serial", "nccl", "reference")


CPU_IMPLS = ("reference", "nccl", "diffusers")  # what runs on CPU (gloo); fused and serial need SM90
MAX_GRID = 1 << 12  # latent frames, rows, columns


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="flux")
    ap.add_argument("--pretrained", default=None, help="path (or hub id) of the transformer's weights; default random")
    ap.add_argument("--size", choices=("tiny", "small"), default="tiny", help="preset of the random model")
    ap.add_argument("--nproc", type=int_in(2, MAX_WORLD_SIZE), default=2,
                    help="ranks P when not under torchrun (default 2)")
    ap.add_argument("--frames", type=int_in(1, MAX_GRID), default=None, help="latent frames (Wan)")
    ap.add_argument("--height", type=int_in(1, MAX_GRID), default=None, help="latent token rows")
    ap.add_argument("--width", type=int_in(1, MAX_GRID), default=None, help="latent token columns")
    ap.add_argument("--text-len", type=int_in(1, MAX_SEQLEN), default=None)
    ap.add_argument("--batch", type=int_in(1, 1024), default=1)
    ap.add_argument("--steps", type=int_in(1, MAX_REPEATS), default=4, help="denoising steps (transformer calls) timed")
    ap.add_argument("--impls", default=None, help="comma-separated: fused, serial, nccl, reference, diffusers "
                    "(default fused,serial,nccl,diffusers on a GPU, reference,nccl,diffusers on CPU)")
    ap.add_argument("--ulysses-anything", action="store_true", help="allow token counts P does not divide")
    ap.add_argument("--no-fp32-ref", action="store_true", help="skip the fp32 single-device run")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when a CUDA GPU is present, else cpu")
    ap.add_argument("--seed", type=int_in(0, 2 ** 63 - 1), default=0)
    ap.add_argument("--json", type=out_file(), default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    spec = MODELS[args.model]
    for name in ("frames", "height", "width", "text_len"):
        if getattr(args, name) is None:
            setattr(args, name, spec[name])
    if args.model != "wan" and args.frames != 1:
        ap.error("--frames: only Wan takes video latents")
    if args.frames * args.height * args.width > MAX_SEQLEN:
        ap.error(f"--frames x --height x --width: at most {MAX_SEQLEN} latent tokens expected, "
                 f"got {args.frames * args.height * args.width}")
    P = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else args.nproc
    split = {"--frames x --height x --width (image tokens)": args.frames * args.height * args.width}
    if args.model != "wan":  # (Wan's text rows stay whole: its cross-attention keys)
        split["--text-len"] = args.text_len
    for flag, n in split.items():  # the tokens diffusers' context parallelism splits over the P ranks
        if args.ulysses_anything and n < P:
            ap.error(f"{flag}: expected at least one token per rank ({P}), got {n}")
        if not args.ulysses_anything and n % P:
            ap.error(f"{flag}: expected a multiple of the {P} ranks (diffusers splits them evenly; "
                     f"--ulysses-anything takes any count), got {n}")
    if args.impls is not None:
        args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
        bad = [s for s in args.impls if s not in FA_IMPLS + ("diffusers",)]
        if bad or not args.impls:
            ap.error(f"--impls: a comma-separated list of {', '.join(FA_IMPLS + ('diffusers',))} expected, "
                     f"got {bad or 'an empty list'}")
        if args.device == "cpu" and set(args.impls) - set(CPU_IMPLS):
            ap.error(f"--impls: with --device cpu only {','.join(CPU_IMPLS)} run (auto, fused and serial need an SM90 GPU), "
                     f"got {','.join(args.impls)}")
    return ap, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # a bad flag is refused before torch and diffusers load

import _ranks  # noqa: E402  (the examples' rank set-up: pick_device, init_ranks)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def pick_device_and_impls(ap, args) -> None:
    """--device / --impls left out: a CUDA GPU when there is one, else the CPU with the impls that run
    there (said in one line). Asked for explicitly: cuda without a GPU, or a GPU impl on CPU, is refused."""
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        ap.error("--device cuda: no CUDA GPU found (--device cpu, or leave it out, for the CPU smoke test)")
    if args.device is None:
        args.device = "cuda" if has_gpu else "cpu"
        if args.device == "cpu" and args.impls is not None and set(args.impls) - set(CPU_IMPLS):
            ap.error(f"--impls: no CUDA GPU found, and only {','.join(CPU_IMPLS)} run on CPU "
                     f"(fused and serial need an SM90 GPU), got {','.join(args.impls)}")
    if args.impls is None:
        args.impls = list(CPU_IMPLS) if args.device == "cpu" else ["fused", "serial", "nccl", "diffusers"]
        if not has_gpu:
            print(f"no CUDA GPU: running on CPU (fp32, gloo) with impls {','.join(args.impls)}", flush=True)


def build_model(args, device, dtype):
    import diffusers

    cls = getattr(diffusers, MODELS[args.model]["cls"])
    if args.pretrained:
        model = cls.from_pretrained(args.pretrained, torch_dtype=dtype)
    else:
        torch.manual_seed(args.seed)  # same seed on every rank: identical weights (checked in run())
        with torch.device(device):
            model = cls(**MODELS[args.model]["presets"][args.size])
    return model.eval().to(device, dtype)


def make_inputs(args, model, device, dtype):
    """(initial latents, conditioning kwargs, timestep scale) for one model call."""
    g = torch.Generator().manual_seed(args.seed + 1)
    cfg = model.config
    B, F, H, W, J = args.batch, args.frames, args.height, args.width, args.text_len

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if args.model == "flux":
        ids = torch.zeros(H, W, 3)
        ids[..., 1], ids[..., 2] = torch.arange(H)[:, None], torch.arange(W)[None, :]
        cond = dict(encoder_hidden_states=rnd(B, J, cfg.joint_attention_dim),
                    pooled_projections=rnd(B, cfg.pooled_projection_dim),
                    img_ids=ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(J, 3, device=device))
        if cfg.guidance_embeds:
            cond["guidance"] = torch.full((B,), 3.5, device=device, dtype=dtype)
        return rnd(B, H * W, cfg.in_channels), cond, 1.0
    if args.model == "wan":
        p = cfg.patch_size
        latents = rnd(B, cfg.in_channels, F * p[0], H * p[1], W * p[2])
        return latents, dict(encoder_hidden_states=rnd(B, J, cfg.text_dim)), 1000.0
    cond = dict(encoder_hidden_states=rnd(B, J, cfg.joint_attention_dim), img_shapes=[[(F, H, W)]] * B)
    return rnd(B, F * H * W, cfg.in_channels), cond, 1.0


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


def denoise(model, latents, cond, t_scale, steps, dtype, *, sync=None):
    """Flow-matching Euler over `steps` transformer calls; returns (final latents, ms per call)."""
    x = latents.to(dtype)
    cond = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith("_ids")
                else v) for k, v in cond.items()}
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    times = []
    for i in range(steps):
        t = torch.full((x.shape[0],), sigmas[i] * t_scale, device=x.device, dtype=dtype)
        if sync is not None:
            sync()
        v, ms = _timed(lambda: model(hidden_states=x, timestep=t, **cond, return_dict=False)[0], x.device)
        times.append(ms)
        x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(dtype)
    return x, times


def run(rank, world_size, args, device, group_backend):
    """One rank's runs, its process group joined (_ranks.init_ranks); rank 0 prints the table."""
    from diffusers import ContextParallelConfig

    from fa_a2a.models.diffusers_backend import register_diffusers_backend, route_counts

    def host_barrier():
        dist.barrier()

    def all_max(value):
        t = torch.tensor([value], dtype=torch.float64, device=device if group_backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args, device, dtype)
    sums = torch.tensor([sum(p.double().sum().item() for p in model.parameters())], dtype=torch.float64)
    sums = sums.to(device) if group_backend == "nccl" else sums
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if lo.item() != hi.item():
        raise RuntimeError("ranks built different weights (seeded init differs across devices)")
    latents, cond, t_scale = make_inputs(args, model, device, dtype)
    results = []
    with torch.no_grad():
        ref32 = None
        if rank == 0 and not args.no_fp32_ref:
            ref32, _ = denoise(copy.deepcopy(model).float(), latents, cond, t_scale, args.steps, torch.float32)
        base = None
        if rank == 0:
            denoise(model, latents, cond, t_scale, 1, dtype)  # warm-up
            base, base_times = denoise(model, latents, cond, t_scale, args.steps, dtype)
            results.append(dict(impl="1 device (SDPA)", times=base_times, out=base))
        host_barrier()
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size,
                                                              ulysses_anything=args.ulysses_anything))
        outs, routes = {}, {}
        for impl in args.impls:
            if impl in ("nccl", "diffusers") and device.type == "cuda" and group_backend != "nccl":
                if rank == 0:
                    print(f"skipping impl={impl}: needs one rank per GPU with an NCCL group")
                continue
            name = "native" if impl == "diffusers" else register_diffusers_backend(
                "fa_a2a" if impl == "fused" else f"fa_a2a_{impl}", impl)
            model.set_attention_backend(name)
            denoise(model, latents, cond, t_scale, 1, dtype)  # compile
            if device.type == "cuda":
                torch.cuda.synchronize()
            host_barrier()
            route_counts(name, reset=True)
            out, times = denoise(model, latents, cond, t_scale, args.steps, dtype, sync=host_barrier)
            routes[impl] = route_counts(name) if impl != "diffusers" else {}
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
        row = dict(impl=r["impl"], max_err_vs_1dev=d.max().item(), mean_err_vs_1dev=d.mean().item(),
                   ms_per_step=statistics.median(r["times"]), ms_steps=r["times"], routes=routes.get(r["impl"], {}))
        if ref32 is not None:
            d32 = (out - ref32.float()).abs()
            row.update(max_err_vs_fp32=d32.max().item(), mean_err_vs_fp32=d32.mean().item())
        rows.append(row)
    same = torch.equal(outs["fused"], outs["serial"]) if "fused" in outs and "serial" in outs else None
    mode = (f"P={world_size} processes, {group_backend} group"
            + (", one GPU shared (CUDA VMM/IPC)" if group_backend == "gloo" and device.type == "cuda" else ""))
    params = sum(p.numel() for p in model.parameters())
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tokens = args.frames * args.height * args.width
    print(f"\n{card}; {args.model} ({args.pretrained or args.size}), {params / 1e9:.2f} B params, {dtype}; "
          f"{tokens} latent + {args.text_len} text tokens, B = {args.batch}; {args.steps} steps; {mode}")
    print("| impl | max err vs 1-dev | mean err | max err vs fp32 | mean err vs fp32 | ms/step (median) | routes |")
    print("|" + "---|" * 7)
    for row in rows:
        e32 = (f"{row['max_err_vs_fp32']:.3g} | {row['mean_err_vs_fp32']:.3g}" if "max_err_vs_fp32" in row
               else "- | -")
        print(f"| {row['impl']} | {row['max_err_vs_1dev']:.3g} | {row['mean_err_vs_1dev']:.3g} | {e32} | "
              f"{row['ms_per_step']:.2f} | {row['routes'] or '-'} |")
    if same is not None:
        print(f"fused and serial final latents bit-identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=card, mode=mode, model=args.model, tokens=tokens, text_len=args.text_len,
                           steps=args.steps, fused_equals_serial=same, rows=rows), f, indent=1)
    return rows


def _serve(world_size, args, device, backend):
    """This rank: join the process group (_ranks.init_ranks), run, leave."""
    rank = _ranks.init_ranks(device, backend)
    try:
        run(rank, world_size, args, device, backend)
        if device.type == "cuda":
            from ulysses.transport import close_transports

            close_transports()
    finally:
        dist.destroy_process_group()


def _spawned(rank, world_size, port, args):
    """One of --nproc processes on this host (sharing GPU 0, or CPU ranks): a gloo group over a TCP
    rendezvous on 127.0.0.1:port, set up as a torchrun rank's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _serve(world_size, args, device, "gloo")


def main(ap, args):
    pick_device_and_impls(ap, args)
    t0 = time.time()
    if "WORLD_SIZE" in os.environ:  # torchrun: this rank's device and backend as the other examples pick them
        world_size, device, backend = _ranks.pick_device(ap, args)
        _serve(world_size, args, device, backend)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main(PARSER, ARGS)
