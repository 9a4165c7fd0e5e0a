"""Memory of the fused Flux processor's weights: one copy of the attention weights, not two.

Needs the [dit] extra (diffusers: `pip install -e ".[dit]"`) and room for the model: the whole
Flux.1 transformer (the default) is ~24 GB of bf16 weights, in GPU memory or, with --device cpu
(the default without a GPU), in RAM; --attention-only ~5 GB (5.02 GB held in the run below).
The model's size is worked out before anything is allocated: where it does not fit in the free
memory, the script says so in one line and exits with status 2.

fa_a2a.models.flux's processor gathers each FluxAttention's q/k/v weights in destination order at
the module's first fused call (fused_base.attention_weights), and the module's Linears become
views of them. This builds a Flux.1-size transformer (19 double- + 38 single-stream blocks, 24
heads x 128, random bf16 weights), installs the processor (enable_fused_projection) and gathers
every module's weights as that first call does, for P = --world-size ranks, then prints:
  qkv_bytes        the q/k/v weights of all attention modules (Flux.1: 4.3 GB)
  before / after   unique storage bytes of the model's parameters and buffers plus the tensors the
                   gathered weights hold, before and after the gathering
  extra            after - before, and as a fraction of qkv_bytes
  on CUDA          torch.cuda.memory_allocated before and after, max_memory_allocated during
  on CPU           the growth of the process's peak resident set (ru_maxrss) during the gathering
--copy gathers a copy beside the Linears instead (share_weights=False: what the processor kept
before the Linears became views). --attention-only builds the 57 attention modules alone (the
whole transformer is ~24 GB in bf16, more than a small CPU machine holds).

    python examples/flux_block_memory.py                        # a GPU: the whole Flux.1 transformer
    python examples/flux_block_memory.py --copy                 # the same with the old copy
    MALLOC_MMAP_THRESHOLD_=131072 python examples/flux_block_memory.py --device cpu --attention-only

On CPU set MALLOC_MMAP_THRESHOLD_ as above: otherwise glibc keeps the freed original weights
(18.9 MB blocks, under its dynamic mmap threshold) in its heap and the resident set counts them
(2.89 GB of peak growth in the run below without it).

Measured (CPU, 2 cores, --attention-only: Flux.1's 57 attention modules, P = 8): q/k/v weights
4.303 GB; held bytes 5.022 -> 5.024 GB with the Linears as views (extra 1.87 MB, 0.04%: the fp32
norm vectors), peak resident set growth 0.119 GB (2.8%: one module's gathering at a time);
with --copy 5.022 -> 9.329 GB (extra 4.307 GB, 100.08%), peak growth 4.367 GB. Not yet run on a
GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys

from fa_a2a.tools.cli import cannot_run, no_gpu, out_file

TOOL = "examples/flux_block_memory.py"


def _parse(argv):
    p = argparse.ArgumentParser(prog="python examples/flux_block_memory.py", description=__doc__.split("\n\n")[0],
                                epilog=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cuda (default when available) or cpu")
    p.add_argument("--world-size", type=int, default=8, help="P, the ranks the weights are gathered for")
    p.add_argument("--attention-only", action="store_true", help="the attention modules alone")
    p.add_argument("--copy", action="store_true", help="a copy beside the Linears (share_weights=False)")
    p.add_argument("--layers", type=int, default=19, help="double-stream blocks (Flux.1: 19)")
    p.add_argument("--single-layers", type=int, default=38, help="single-stream blocks (Flux.1: 38)")
    p.add_argument("--heads", type=int, default=24, help="attention heads (Flux.1: 24)")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="head dim (Flux.1: 128)")
    p.add_argument("--json", type=out_file(), default=None, help="also write the numbers to this file")
    args = p.parse_args(argv)
    for name in ("world_size", "layers", "single_layers", "heads"):
        value = getattr(args, name)
        if not 0 <= value <= 4096 or (value == 0 and name in ("world_size", "heads")):
            p.error(f"--{name.replace('_', '-')}: expected an int in [1, 4096] ([0, 4096] for layer counts), "
                    f"got {value}")
    return args


def _build(args, device):
    """The transformer (or its attention modules) on `device`, random bf16 weights, norms' weights 1."""
    import torch

    model = _meta_model(args).to_empty(device=device)
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.rsplit(".", 2)[-2].startswith("norm") and t.dim() == 1:
                t.fill_(1)
            elif t.is_floating_point():
                t.normal_(0, 0.02, generator=g)
    return model.eval()


def _meta_model(args):
    """The transformer (or its attention modules) in bf16 on the meta device: shapes, no memory."""
    import torch
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux import FluxAttention

    dim, D = args.heads * args.head_dim, args.head_dim
    with torch.device("meta"):
        if args.attention_only:
            model = torch.nn.ModuleList(
                [FluxAttention(query_dim=dim, added_kv_proj_dim=dim, dim_head=D, heads=args.heads, out_dim=dim,
                               context_pre_only=False, bias=True, eps=1e-6) for _ in range(args.layers)]
                + [FluxAttention(query_dim=dim, dim_head=D, heads=args.heads, out_dim=dim, bias=True, eps=1e-6,
                                 pre_only=True) for _ in range(args.single_layers)])
        else:
            model = FluxTransformer2DModel(num_layers=args.layers, num_single_layers=args.single_layers,
                                           attention_head_dim=D, num_attention_heads=args.heads,
                                           axes_dims_rope=(D // 8, 7 * D // 16, 7 * D // 16))
    return model.to(torch.bfloat16)


def model_bytes(args) -> int:
    """Bytes of the model's parameters and buffers (bf16), from its meta-device twin."""
    model = _meta_model(args)
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def free_bytes(device) -> int:
    """Free memory where the model would go: the GPU's (cudaMemGetInfo) or the host's MemAvailable."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def held_tensors(model, gathered) -> list:
    """The model's parameters and buffers and the tensors of the gathered weights (UlyssesQKVAttention)."""
    out = list(model.parameters()) + list(model.buffers())
    for mod in gathered:
        for proj in (mod.proj, mod.joint_proj):
            if proj is not None:
                out += [proj.weight, proj.bias, proj.norm_weight]
    return out


def measure(args) -> dict:
    import torch
    from diffusers.models.transformers.transformer_flux import FluxAttention

    from fa_a2a.models import flux as flux_block
    from fa_a2a.models import base as fused_base
    from fa_a2a.models import registry

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _build(args, device)
    if not args.attention_only:
        registry.enable_fused_projection(model)
    attns = [m for m in model.modules() if isinstance(m, FluxAttention)]
    qkv = [lin.weight for a in attns for layers, _ in fused_base._layers(a) for lin in layers]
    r = dict(device=str(device), world_size=args.world_size, attention_only=args.attention_only, copy=args.copy,
             attention_modules=len(attns), qkv_bytes=storage_bytes(qkv))
    r["before"] = storage_bytes(held_tensors(model, []))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        r["cuda_allocated_before"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    import cute_kernels.qkv_a2a_sm90  # noqa: F401  (the gathering's imports, before the resident set is read)
    import fa_a2a.op  # noqa: F401
    import ulysses.layout  # noqa: F401

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with torch.no_grad():  # each module's first fused call, for P = world_size ranks
        gathered = [fused_base.attention_weights(a, share_weights=not args.copy, world_size=args.world_size)
                    for a in attns]
    r["after"] = storage_bytes(held_tensors(model, gathered))
    r["extra"] = r["after"] - r["before"]
    r["extra_of_qkv"] = r["extra"] / r["qkv_bytes"]
    if cuda:
        torch.cuda.synchronize(device)
        r["cuda_allocated_after"] = torch.cuda.memory_allocated(device)
        r["cuda_max_allocated_during"] = torch.cuda.max_memory_allocated(device)
        r["cuda_peak_extra"] = r["cuda_max_allocated_during"] - r["cuda_allocated_before"]
        r["cuda_peak_extra_of_qkv"] = r["cuda_peak_extra"] / r["qkv_bytes"]
    else:
        r["cpu_peak_rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    shared = all(lin.weight.untyped_storage().data_ptr() == mod.proj.weight.untyped_storage().data_ptr()
                 for a, mod in zip(attns, gathered) for lin in fused_base._layers(a)[0][0])
    r["linears_are_views"] = shared
    return r


def main(argv=None) -> int:
    args = _parse(argv)
    if importlib.util.find_spec("diffusers") is None:
        return cannot_run(TOOL, 'needs diffusers, the [dit] extra (pip install -e ".[dit]")')
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return no_gpu(TOOL, "--device cuda", "a CUDA GPU")
    need, free = model_bytes(args), free_bytes(device)
    what = "Flux.1's attention modules" if args.attention_only else "the Flux.1 transformer"
    if need * 1.15 > free:  # the weights, plus one module's gathering and the process itself
        return cannot_run(TOOL, f"{what} needs ~{need / 1e9:.1f} GB on {device}, {free / 1e9:.1f} GB free here"
                          + ("" if args.attention_only else "; --attention-only builds the attention modules alone"))
    print(f"building {what}: {need / 1e9:.1f} GB of bf16 weights on {device} ({free / 1e9:.1f} GB free)", flush=True)
    args.device = str(device)
    r = measure(args)
    gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
    print(f"{r['attention_modules']} attention modules on {r['device']}, P = {r['world_size']}, "
          f"{'copy beside the Linears' if r['copy'] else 'Linears as views'}")
    print(f"q/k/v weights {gb(r['qkv_bytes'])}; model + gathered weights {gb(r['before'])} -> {gb(r['after'])}: "
          f"extra {gb(r['extra'])} ({100 * r['extra_of_qkv']:.2f}% of q/k/v); Linears are views: "
          f"{r['linears_are_views']}")
    if "cuda_allocated_before" in r:
        print(f"torch.cuda.memory_allocated {gb(r['cuda_allocated_before'])} -> {gb(r['cuda_allocated_after'])}, "
              f"max_memory_allocated during the gathering {gb(r['cuda_max_allocated_during'])} "
              f"(peak extra {gb(r['cuda_peak_extra'])}, {100 * r['cuda_peak_extra_of_qkv']:.2f}% of q/k/v)")
    else:
        print(f"peak resident set growth during the gathering {gb(r['cpu_peak_rss_growth'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
