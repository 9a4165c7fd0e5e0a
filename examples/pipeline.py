"""A diffusers pipeline under Ulysses on P ranks: the fa-a2a backend against diffusers' own.

    torchrun --nproc-per-node=8 examples/pipeline.py --model black-forest-labs/FLUX.1-dev \\
        --prompt "a photo of an astronaut riding a horse" --steps 28 --out flux.png

Loads a pipeline (--model: a hub repo id or a local folder, DiffusionPipeline.from_pretrained),
puts its transformer under diffusers' context parallelism with Ulysses over the P = torchrun ranks,
and runs the whole pipeline (text encoders, denoising loop, VAE) once per --impl:

  auto       fa-a2a's default: the fastest of fused / serial / nccl on this machine, timed at the
             first call (fa_a2a.engine.autotune; its decision is logged)
  fused      fa_a2a.enable_ulysses(transformer, impl="fused") and fa_a2a.enable_fused_projection:
             the post-attention All-to-All in FA4's epilogue and, for Flux, Flux2 and QwenImage, the
             QKV projection with the pre-attention All-to-All in its epilogue
  serial     the same modules with the All-to-Alls as kernels of their own (same arithmetic)
  nccl       fa-a2a's op with NCCL's all_to_all around FA4
  reference  fa-a2a's op with an all-to-all around the fp32 reference attention (runs on CPU)
  native     diffusers' own Ulysses (its "native" backend: all_to_all around SDPA)

Each impl runs once to compile and warm up (--warmup-steps), then timed: the table gives the
median time of a denoising step (max over ranks; the first step, which also encodes the prompt,
left out), seconds per image, which path each attention call took (fa_a2a.models.diffusers_backend.
route_counts) and the image rank 0 saved (--out with the impl before the extension).

Every rank builds the same pipeline and passes the same seed, as diffusers' context parallelism
expects. One GPU per rank: an NCCL group. Ranks sharing a GPU (P processes on one GPU, under
`python -m fa_a2a.mps`): a gloo group, where nccl and native are skipped (NCCL refuses two ranks
on one GPU). Without a GPU: CPU ranks over gloo, fp32, impls reference and native (a test of the
wiring, fa_a2a.models.diffusers_backend.cpu_testbed; fused and serial need an SM90 GPU).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

from fa_a2a.tools.cli import MAX_REPEATS, float_in, int_in, out_file

IMPLS = ("auto", "fused", "serial", "nccl", "reference", "native")
GPU_DEFAULT, CPU_DEFAULT = ("fused", "serial", "native"), ("reference", "native")
CPU_IMPLS = ("reference", "native")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node=P examples/pipeline.py",
                                 description=__doc__.split("\n\n")[0],
                                 epilog="Install: pip install -e \".[dit]\" (diffusers, transformers).")
    ap.add_argument("--model", required=True, help="the pipeline: a hub repo id or a local folder")
    ap.add_argument("--impl", nargs="+", choices=IMPLS, default=None,
                    help=f"default: {' '.join(GPU_DEFAULT)} on GPUs, {' '.join(CPU_DEFAULT)} on CPU")
    ap.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    ap.add_argument("--steps", type=int_in(1, MAX_REPEATS), default=28, help="denoising steps (default 28)")
    ap.add_argument("--warmup-steps", type=int_in(0, MAX_REPEATS), default=2,
                    help="steps of the untimed first run per impl, which compiles the kernels (0: none)")
    ap.add_argument("--height", type=int_in(16, 1 << 14), default=None, help="pixels (default: the pipeline's)")
    ap.add_argument("--width", type=int_in(16, 1 << 14), default=None, help="pixels (default: the pipeline's)")
    ap.add_argument("--guidance-scale", type=float_in(0, 1e3, lo_inclusive=True), default=None,
                    help="default: the pipeline's")
    ap.add_argument("--max-sequence-length", type=int_in(1, 1 << 16), default=None,
                    help="text tokens, for pipelines that take it (default: the pipeline's)")
    ap.add_argument("--seed", type=int_in(0, 2 ** 63 - 1), default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when a CUDA GPU is present, else cpu")
    ap.add_argument("--ulysses-anything", action="store_true", help="allow token counts that P does not divide")
    ap.add_argument("--out", default="pipeline.png", type=out_file(make_folder=True),
                    help="image path; the impl goes before the extension")
    ap.add_argument("--json", type=out_file(), default=None, help="also write the table (rank 0) to this file")
    args = ap.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        ap.error("expected torchrun with P >= 2 ranks: torchrun --nproc-per-node=P examples/pipeline.py ...")
    if args.device == "cpu" and args.impl and set(args.impl) - set(CPU_IMPLS):
        ap.error(f"--impl: on CPU only {' '.join(CPU_IMPLS)} run (auto, fused, serial and nccl need a GPU), "
                 f"got {' '.join(args.impl)}")
    return ap, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # a bad flag is refused before torch and diffusers load

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ranks import init_ranks, pick_device  # noqa: E402


def setup(ap, args):
    """(rank, world size, device, process-group backend) of this torchrun rank (_ranks), with the
    impls that run there."""
    world, device, backend = pick_device(ap, args)
    if device.type == "cpu" and args.impl and set(args.impl) - set(CPU_IMPLS):
        ap.error(f"--impl: no CUDA GPU found, and on CPU only {' '.join(CPU_IMPLS)} run, got {' '.join(args.impl)}")
    if args.impl is None:
        args.impl = list(GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    return init_ranks(device, backend), world, device, backend


def call_kwargs(pipe, args, steps, on_step):
    """The pipeline call's arguments: only those its __call__ takes."""
    params = inspect.signature(pipe.__call__).parameters
    kw = dict(prompt=args.prompt, num_inference_steps=steps)
    for name in ("height", "width", "guidance_scale", "max_sequence_length"):
        if getattr(args, name) is not None:
            if name not in params:
                raise ValueError(f"--{name.replace('_', '-')}: {type(pipe).__name__} does not take {name}")
            kw[name] = getattr(args, name)
    if "callback_on_step_end" in params:
        kw["callback_on_step_end"] = on_step
    return kw


def run_once(pipe, args, steps, device):
    """One pipeline call: (first image as a PIL image, seconds per call, step ends in seconds)."""
    ends = []

    def on_step(_pipe, _i, _t, callback_kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
        return callback_kwargs

    generator = torch.Generator("cpu").manual_seed(args.seed)  # the same latents on every rank
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = pipe(**call_kwargs(pipe, args, steps, on_step), generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    image = result.images[0] if hasattr(result, "images") else result.frames[0][0]
    if not hasattr(image, "save"):  # a numpy frame in [0, 1]
        from PIL import Image

        image = Image.fromarray((image * 255).round().clip(0, 255).astype("uint8"))
    return image, seconds, ends


def max_over_ranks(values, device, backend):
    t = torch.tensor(values, dtype=torch.float64, device=device if backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def route_summary(pipe, names) -> dict:
    """Calls per path since the last reset: of the fa-a2a backend and of each fused processor."""
    from fa_a2a.models.diffusers_backend import route_counts

    procs = {getattr(type(getattr(m, "processor", None)), "ROUTE_NAME", None) for m in pipe.transformer.modules()}
    return {n: c for n in [*names, *sorted(p for p in procs if p)] if (c := route_counts(n, reset=True))}


def backend_name(impl: str) -> str:
    """This example's backend name of an impl (one name per impl: a name keeps its impl)."""
    return "fa_a2a" if impl == "fused" else f"fa_a2a_{impl}"


def out_path(out: str, impl: str) -> str:
    root, ext = os.path.splitext(out)
    return f"{root}-{impl}{ext or '.png'}"


def main(ap, args):
    rank, world, device, backend = setup(ap, args)
    from diffusers import ContextParallelConfig, DiffusionPipeline

    import fa_a2a
    from fa_a2a.models.diffusers_backend import register_diffusers_backend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    fa_impls = [i for i in args.impl if i != "native"]
    if fa_impls:  # the backend, diffusers' context parallelism; then the fused block where the model has one
        fa_a2a.enable_ulysses(transformer, impl=fa_impls[0], name=backend_name(fa_impls[0]),
                              ulysses_anything=args.ulysses_anything)
        try:
            fa_a2a.enable_fused_projection(transformer)
        except ValueError as e:  # a model without Flux / Flux2 / QwenImage attention: the attention-only op
            if rank == 0:
                print(f"enable_fused_projection: {e}; attention runs as the fused op alone")
    else:
        transformer.set_attention_backend("native")
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world,
                                                                    ulysses_anything=args.ulysses_anything))
    rows, images = [], {}
    for impl in args.impl:
        if impl in ("nccl", "native") and device.type == "cuda" and backend != "nccl":
            if rank == 0:
                print(f"skipping --impl {impl}: needs one rank per GPU (NCCL refuses two ranks on one GPU)")
            continue
        name = "native" if impl == "native" else register_diffusers_backend(backend_name(impl), impl)
        transformer.set_attention_backend(name)
        if args.warmup_steps:
            run_once(pipe, args, args.warmup_steps, device)
        route_summary(pipe, [name])  # reset: count the timed run only
        image, seconds, ends = run_once(pipe, args, args.steps, device)
        steps = [b - a for a, b in zip(ends, ends[1:])] or [seconds / args.steps]
        steps = max_over_ranks(steps, device, backend)
        seconds = max_over_ranks([seconds], device, backend)[0]
        routes = route_summary(pipe, [name] if impl != "native" else [])
        path = out_path(args.out, impl)
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            image.save(path)
        images[impl] = image
        rows.append(dict(impl=impl, ms_per_step=1e3 * statistics.median(steps), seconds=seconds, routes=routes,
                         image=path))
    if rank == 0:
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"\n{card}; {args.model} ({type(pipe).__name__}, {type(transformer).__name__}), {dtype}; "
              f"P = {world} ranks, {backend} group; {args.steps} steps")
        print("| impl | ms/step (median, max over ranks) | s per image | routes | image |")
        print("|---|---|---|---|---|")
        for r in rows:
            routes = "; ".join(f"{n}: {dict(c)}" for n, c in r["routes"].items()) or "-"
            print(f"| {r['impl']} | {r['ms_per_step']:.1f} | {r['seconds']:.2f} | {routes} | {r['image']} |")
        if "fused" in images and "serial" in images:
            same = images["fused"].tobytes() == images["serial"].tobytes()
            print(f"fused and serial images identical: {same}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=card, model=args.model, world_size=world, group=backend, steps=args.steps,
                               rows=rows), f, indent=1)
    dist.barrier()
    if device.type == "cuda" and any(i in ("fused", "serial") for i in args.impl):
        from ulysses.transport import close_transports

        close_transports()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(PARSER, ARGS)
