"""The torchrun rank set-up of the examples (pipeline.py, train.py, dit_inference.py): this rank's
device and process-group backend, then the group itself with diffusers' context parallelism made to
run on it.
Imported after the flags are parsed (it loads torch)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def pick_device(ap, args) -> tuple:
    """(world size, this rank's device, its process-group backend). --device left out (set on args):
    cuda when a CUDA GPU is present, else cpu. One GPU per rank: NCCL; ranks sharing a GPU (under
    `python -m fa_a2a.mps`): gloo, as NCCL refuses two ranks on one GPU; CPU ranks: gloo."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU found (leave --device out, or --device cpu, for CPU ranks)")
    if args.device == "cpu":
        return world, torch.device("cpu"), "gloo"
    from fa_a2a.tools.mps import rank_device

    shared = torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = rank_device(local)  # cuda:(local rank % GPUs); ranks sharing one run under python -m fa_a2a.mps
    return world, device, "gloo" if shared else "nccl"


def init_ranks(device, backend: str) -> int:
    """Join the torchrun ranks' process group on `backend` and let diffusers' context parallelism run
    over it (on CPU ranks; ranks sharing a GPU gather its output through host memory) -> this rank."""
    os.environ.setdefault("FA_A2A_TIMEOUT_S", "300")  # first calls compile kernels while the peers wait
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    if device.type == "cpu":
        from fa_a2a.models.diffusers_backend import cpu_testbed

        cpu_testbed()  # diffusers' context parallelism assumes a GPU; this lets it run on CPU ranks
    elif backend == "gloo":
        from fa_a2a.models.diffusers_backend import gather_cuda_over_gloo

        gather_cuda_over_gloo()  # diffusers' output gather through host memory (no NCCL on a shared GPU)
    return dist.get_rank()
