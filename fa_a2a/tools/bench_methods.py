"""The methods `python -m fa_a2a.bench` times kernel by kernel: the rows of METHODS (the paper's
Sec. 5.3 set, the baseline users run today, and the Ulysses op itself).

A method is a builder and a row of METHODS: the builder gets a _Point (the sizes, rank and
allocators of one (M, destination)) and one input set and returns (call, output); the row names
it, says what it measures and where it applies (ranks, hbm_only; not_applicable gives the table's
cell where it does not). --methods, --help, the tables, the plots and the JSON take the methods
from METHODS.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Callable, Optional

from fa_a2a.tools.bench_config import BenchConfig, torch_dtype

if TYPE_CHECKING:
    import torch

NA_REAL = "n/a (needs real ranks)"
NA_EMULATED = "n/a (emulated ranks only)"
NA_HOST = "n/a (its windows are in HBM)"


class _Point:
    """What a method's builder needs for one (M, destination): sizes, rank, and allocators."""

    def __init__(self, cfg: "BenchConfig", M: int, dest: str, ctx: dict, gen: torch.Generator):
        self.cfg, self.M, self.dest = cfg, M, dest
        self.dev, self.group, self.rank = ctx["device"], ctx["group"], ctx["rank"]
        self.dtype = torch_dtype(cfg.dtype)
        self.S_loc = M // cfg.world_size
        self.gen = gen
        self.keep = []  # pinned host buffers behind host windows: alive as long as the point

    def randn(self, *shape):
        import torch

        return torch.randn(*shape, device=self.dev, dtype=self.dtype, generator=self.gen)

    def windows(self, name: str, shape=None) -> torch.Tensor:
        """[P, B, S_loc, H, D] output windows of all ranks (or [P, *shape]: B, rows, H, D), filled
        with random values."""
        cfg, P, H_loc = self.cfg, self.cfg.world_size, self.cfg.heads_local
        shape = (P, cfg.batch, self.S_loc, cfg.heads, cfg.head_dim) if shape is None else (P, *shape)
        H_loc = shape[3] // P
        if cfg.real_ranks:  # peer buffers mapped at one stride (collective)
            from ulysses.transport import get_transport

            w = get_transport(self.group).windows(f"fa_a2a.tools.bench.{name}", shape[1:], self.dtype)
            w.narrow(3, self.rank * H_loc, H_loc).copy_(self.randn(P, *shape[1:3], H_loc, shape[4]))
            return w
        if self.dest == "host":
            from ulysses.transport import pinned_on_device

            w, host = pinned_on_device(math.prod(shape), self.dtype, self.dev)
            self.keep.append(host)
            w = w.view(shape)
            w.copy_(self.randn(*shape))
            return w
        return self.randn(*shape)

    def mine(self, w: torch.Tensor) -> torch.Tensor:
        """The part of the windows this rank writes."""
        H_loc = self.cfg.heads_local
        return w.narrow(3, self.rank * H_loc, H_loc)


# A builder takes (point, input set {"i": index, "q", "k", "v", "o_in"}) and returns (call, output): the call launches one call of
# the method; the output is the tensor it writes (NaN-poisoned before the timed replays and
# checked after them), or None to check the call's return value on an eager call after the run.
def _build_fa(pt, s):
    import torch

    from cute_kernels.fa4 import fa4_forward

    o = torch.empty_like(s["q"])
    return (lambda: fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal)), o


def _build_a2a(pt, s):
    from fa_a2a.op import post_a2a

    w = pt.windows(f"a2a.{s['i']}")
    return (lambda: post_a2a(s["o_in"], w, pt.rank)), pt.mine(w)


def _build_serial(pt, s):
    import torch

    from cute_kernels.fa4 import fa4_forward
    from fa_a2a.op import post_a2a

    o, w = torch.empty_like(s["q"]), pt.windows(f"serial.{s['i']}")
    return (lambda: (fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal),
                     post_a2a(o, w, pt.rank))), pt.mine(w)


def _build_fused(pt, s):
    from cute_kernels.fa4 import fa4_a2a_forward

    w = pt.windows(f"fused.{s['i']}")
    return (lambda: fa4_a2a_forward(s["q"], s["k"], s["v"], w, pt.rank, causal=pt.cfg.causal)), pt.mine(w)


def _build_fused_st(pt, s):
    from cute_kernels.fa4 import fa4_a2a_forward

    w = pt.windows(f"fused_st.{s['i']}")
    return (lambda: fa4_a2a_forward(s["q"], s["k"], s["v"], w, pt.rank, causal=pt.cfg.causal, o_store="st")), \
        pt.mine(w)


def _build_fused_auto(pt, s):
    """The fused kernel paced as the op's pace="auto" decides (fa_a2a.engine.pacing.fused_pacer, the op's
    path), the link measured once per point: real ranks' from their transport (link_gbps, as the op)
    with its ranks per GPU; emulated ranks' (one kernel at a time, the whole GPU) into windows where
    this point's windows are."""
    from cute_kernels.fa4 import fa4_a2a_forward
    from fa_a2a.engine.pacing import fused_pacer

    cfg = pt.cfg
    first = not hasattr(pt, "pacing_link")
    if first:
        pt.pacing_link, pt.ranks_per_gpu = _pacing_link(pt)
    pacing, pacer = fused_pacer("auto", pt.pacing_link, s["q"], pt.S_loc, pt.M, cfg.heads_local, cfg.batch,
                                cfg.causal, ranks_per_gpu=pt.ranks_per_gpu)
    if first:
        print(f"[fused_auto M={pt.M} {pt.dest}] {pacing.reason}", flush=True)
    w = pt.windows(f"fused_auto.{s['i']}")
    return (lambda: fa4_a2a_forward(s["q"], s["k"], s["v"], w, pt.rank, causal=pt.cfg.causal, pacer=pacer)), pt.mine(w)


def _pacing_link(pt) -> tuple:
    """(link(): the point's link in GB/s, measured at its first call; ranks per GPU) for the pacing."""
    from fa_a2a.engine.pacing import link_gbps, measure_store_rate, probe_shape

    if pt.cfg.real_ranks:
        from ulysses.transport import get_transport

        t = get_transport(pt.group)
        return (lambda: link_gbps(t)), t.ranks_per_gpu
    return functools.cache(lambda: measure_store_rate(pt.windows("pacing.link", probe_shape(pt.cfg.world_size)),
                                                      pt.rank)), 1


def _nccl_buffers(pt):
    import torch

    cfg = pt.cfg
    send = torch.empty(cfg.world_size, cfg.batch, pt.S_loc, cfg.heads_local, cfg.head_dim, device=pt.dev,
                       dtype=pt.dtype)
    out = torch.empty(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim, device=pt.dev, dtype=pt.dtype)
    return send, torch.empty_like(send), out


def _build_a2a_nccl(pt, s):
    from ulysses.reference import dist_head_to_seq  # permute + all_to_all_single

    bufs = _nccl_buffers(pt)
    return (lambda: dist_head_to_seq(s["o_in"], group=pt.group, buffers=bufs)), bufs[2]


def _build_serial_nccl(pt, s):
    import torch

    from cute_kernels.fa4 import fa4_forward
    from ulysses.reference import dist_head_to_seq

    bufs, o = _nccl_buffers(pt), torch.empty_like(s["q"])
    return (lambda: (fa4_forward(s["q"], s["k"], s["v"], out=o, causal=pt.cfg.causal),
                     dist_head_to_seq(o, group=pt.group, buffers=bufs))), bufs[2]


def _layer_builder(impl: str):
    def build(pt, s):
        from fa_a2a.op import ulysses_attention

        cfg = pt.cfg
        x = [pt.randn(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim) for _ in range(3)]
        return (lambda: ulysses_attention(*x, group=pt.group, impl=impl, causal=cfg.causal)), None
    return build


def _emulated_builder(impl: str):
    def build(pt, s):
        from fa_a2a.op import ulysses_attention_emulated

        cfg = pt.cfg
        qs, ks, vs = ([pt.randn(cfg.batch, pt.S_loc, cfg.heads, cfg.head_dim) for _ in range(cfg.world_size)]
                      for _ in range(3))
        return (lambda: ulysses_attention_emulated(qs, ks, vs, impl=impl, causal=cfg.causal)), None
    return build


@dataclasses.dataclass(frozen=True)
class Method:
    key: str
    label: str
    what: str
    build: Callable
    ranks: str = "any"      # "any" | "real" (torchrun, one GPU per rank) | "emulated" (one process)
    hbm_only: bool = False  # allocates its own windows in HBM: --dest host does not apply


METHODS = (
    Method("fa", "FA4-only", "cute_kernels.fa4.fa4_forward on q, k, v [B, M, H_loc, D]", _build_fa),
    Method("a2a", "A2A-only", "our post-A2A kernel alone, fa_a2a.op.post_a2a(o, windows, rank)", _build_a2a),
    Method("a2a_nccl", "A2A-only NCCL", "permute + all_to_all_single + permute", _build_a2a_nccl, "real", True),
    Method("serial", "Serial", "FA4, then our post-A2A", _build_serial),
    Method("serial_nccl", "Serial-NCCL", "FA4, then permute + all_to_all_single (yunchang / xDiT / DeepSpeed)",
           _build_serial_nccl, "real", True),
    Method("fused", "Fused", "FA4 with the post-A2A in its epilogue: cute_kernels.fa4.fa4_a2a_forward", _build_fused),
    Method("fused_st", "Fused st", "the fused kernel with per-thread O stores (o_store='st')", _build_fused_st),
    Method("fused_auto", "Fused auto-paced", "the fused kernel with its stores paced as pace='auto' decides "
           "(fa_a2a.engine.pacing: the link measured into this row's windows, FA4's tiles)", _build_fused_auto),
    Method("layer_fused", "Layer fused", "whole Ulysses layer (pre-A2A + attention + post-A2A), impl='fused'",
           _layer_builder("fused"), "real", True),
    Method("layer_fused_st", "Layer fused st", "the same layer with impl='fused:st'", _layer_builder("fused:st"),
           "real", True),
    Method("layer_serial", "Layer serial", "the same layer with impl='serial'", _layer_builder("serial"), "real", True),
    Method("layer_nccl", "Layer NCCL", "the same layer with impl='nccl'", _layer_builder("nccl"), "real", True),
    Method("layer_auto", "Layer auto", "the same layer with impl='auto' (the path fa_a2a.engine.autotune picked)",
           _layer_builder("auto"), "real", True),
    Method("op_emulated", "Op emulated", "fa_a2a.ulysses_attention_emulated, impl='fused': all P ranks' work "
           "(pre-A2A, fused attention, barrier) in one process", _emulated_builder("fused"), "emulated", True),
    Method("op_emulated_st", "Op emulated st", "the same with impl='fused:st'", _emulated_builder("fused:st"),
           "emulated", True),
    Method("op_emulated_serial", "Op emulated serial", "the same with impl='serial'", _emulated_builder("serial"),
           "emulated", True),
    Method("op_emulated_auto", "Op emulated auto", "the same with impl='auto' (the path fa_a2a.engine.autotune picked)",
           _emulated_builder("auto"), "emulated", True),
)
BY_KEY = {m.key: m for m in METHODS}


def not_applicable(m: Method, real_ranks: bool, dest: str) -> Optional[str]:
    """Why method m does not run in this setting (a table cell), or None."""
    if m.ranks == "real" and not real_ranks:
        return NA_REAL
    if m.ranks == "emulated" and real_ranks:
        return NA_EMULATED
    if m.hbm_only and dest != "hbm":
        return NA_HOST
    return None
