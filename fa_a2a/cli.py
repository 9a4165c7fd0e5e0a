"""Bounded numeric argument types for the command-line tools (argparse only: no torch, so a bad
flag is refused at once, with argparse's usage line and exit status 2).

    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--fa-tflops", type=float_in(0, 1e5), default=...)   # positive, finite, <= 1e5

A value out of range reads "argument --world-size: expected an integer in [1, 1024], got '0'".
"""

from __future__ import annotations

import argparse
import math

from cute_kernels.limits import HEAD_DIMS as KERNEL_HEAD_DIMS  # the fused kernels' head dims (torch-free)

# Sane maxima shared by the tools (far above any real run, low enough to catch a typo).
MAX_SEQLEN = 1 << 22  # tokens per rank or in all
MAX_WORLD_SIZE = 1024
MAX_HEADS = 1024
MAX_HIDDEN = 1 << 16
MAX_REPEATS = 100_000  # trials, calls, steps


def int_in(lo: int, hi: int):
    """argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_in(lo: float, hi: float, *, lo_inclusive: bool = False):
    """argparse type: a finite number in (lo, hi] ([lo, hi] with lo_inclusive)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value >= lo if lo_inclusive else value > lo) and value <= hi
        if not ok:
            interval = f"{'[' if lo_inclusive else '('}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def add_block_shape_args(ap) -> None:
    """The projection/block benchmarks' shape and repeat flags (Flux shapes by default, emulated P = 8)."""
    ap.add_argument("--seqlens", type=int_in(1, MAX_SEQLEN), nargs="+", default=[576, 1024, 4096],
                    help="S_loc values")
    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--heads", type=int_in(1, MAX_HEADS), default=24, help="a multiple of --world-size")
    ap.add_argument("--head-dim", type=int, choices=KERNEL_HEAD_DIMS, default=128)
    ap.add_argument("--hidden", type=int_in(1, MAX_HIDDEN), default=3072)
    ap.add_argument("--calls", type=int_in(1, MAX_REPEATS), default=20, help="calls per captured graph")
    ap.add_argument("--trials", type=int_in(1, MAX_REPEATS), default=11)
