"""What the command-line tools share (argparse only at import: no torch, so a bad flag is refused
at once, with argparse's usage line and exit status 2).

Bounded numeric argument types:

    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--fa-tflops", type=float_in(0, 1e5), default=...)   # positive, finite, <= 1e5

A value out of range reads "argument --world-size: expected an integer in [1, 1024], got '0'".
Output files the same way: `ap.add_argument("--json", type=out_file())`, refused while parsing where the
file could not be written at the end ("argument --json: expected a file, got the folder 'runs'").

Sequence lengths, the same way in every tool: `--seqlens` parsed by SEQLEN (the range), then
check_seqlens (multiples of what the tool needs, no repeats), whose ValueError the tool hands to
`ap.error`: "argument --seqlens: expected multiples of 8 (the world size P), got 100".

No GPU: a tool that needs one prints one line (no_gpu) and exits with NO_GPU_EXIT; only
`python -m fa_a2a.bench` runs without one (it prints the model's predictions and exits 0).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Iterable

from cute_kernels.limits import HEAD_DIMS as KERNEL_HEAD_DIMS  # the fused kernels' head dims (torch-free)

# Sane maxima shared by the tools (far above any real run, low enough to catch a typo).
MAX_SEQLEN = 1 << 22  # tokens per rank or in all
MAX_WORLD_SIZE = 1024
MAX_HEADS = 1024
MAX_HIDDEN = 1 << 16
MAX_REPEATS = 100_000  # trials, calls, steps

# Exit status of a tool that cannot run on this machine (a GPU-only tool without a CUDA GPU, a
# missing extra): argparse's status for a command line that cannot run, as for a bad flag; 0 = it ran.
NO_GPU_EXIT = 2


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


SEQLEN = int_in(1, MAX_SEQLEN)  # argparse type of every --seqlens entry


def _named(flag: str) -> str:
    """The start of a path check's message: "--flag: ", or nothing for an argparse type (argparse names it)."""
    return f"{flag}: " if flag else ""


def check_out_dir(path, flag: str = "--out") -> None:
    """An output folder, checked before any measurement (the results would be lost when they are written
    at the end): refused (ValueError naming the flag) where the path is empty or an existing file, or its
    nearest existing folder above is a file or not writable."""
    import os

    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{_named(flag)}expected a folder (new or existing), got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{_named(flag)}expected a folder (new or existing), got the file {path!r}")
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ValueError(f"{_named(flag)}{path!r} cannot be made: {here!r} is a file")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"{_named(flag)}{path!r} cannot be written: {here!r} is not writable here")


def check_out_file(path, flag: str, *, make_folder: bool = False) -> None:
    """An output file, checked before any work (a run's results would be lost when they are written at the
    end): refused (ValueError naming the flag) where the path is empty or a folder, or its folder does not
    exist (make_folder: cannot be made, as check_out_dir says) or is not writable."""
    import os

    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{_named(flag)}expected a file path, got {path!r}")
    if os.path.isdir(path):
        raise ValueError(f"{_named(flag)}expected a file, got the folder {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if make_folder:
        check_out_dir(folder, flag)
        return
    if not os.path.isdir(folder):
        raise ValueError(f"{_named(flag)}{path!r} cannot be written: its folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{_named(flag)}{path!r} cannot be written: its folder {folder!r} is not writable here")


def out_file(*, make_folder: bool = False):
    """argparse type: a file path that can be written, checked as check_out_file says while the command
    line is parsed ("argument --json: expected a file, got the folder 'runs'")."""
    def parse(text: str) -> str:
        try:
            check_out_file(text, "", make_folder=make_folder)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    parse.__name__ = "path"
    return parse


def check_seqlens(values: Iterable, multiple: int = 1, of: str = "", *, flag: str = "--seqlens") -> tuple:
    """The tools' one check of a list of sequence lengths, after argparse: each an integer in
    [1, MAX_SEQLEN] (as SEQLEN says it; a parser that must raise ValueError instead of exiting
    takes the flag's text, type=str, and leaves it all to this), a multiple of `multiple` (`of` says
    what it is, e.g. "the world size P"), no value twice. Returns them as a tuple of ints;
    ValueError "argument --seqlens: ..." otherwise (hand it to ap.error)."""
    values = tuple(values)
    for v in values:
        text = v if isinstance(v, str) else str(v) if type(v) is int else repr(v)
        try:
            SEQLEN(text)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"argument {flag}: {e}") from None
    values = tuple(int(v) for v in values)
    for v in values:
        if v % multiple:
            raise ValueError(f"argument {flag}: expected multiples of {multiple}{f' ({of})' if of else ''}, got {v}")
    if len(set(values)) != len(values):
        raise ValueError(f"argument {flag}: expected distinct values, got {list(values)}")
    return values


def no_gpu(tool: str, what: str = "it", needs: str = "a CUDA GPU (SM90)") -> int:
    """A GPU-only tool on a machine without one: prints its one line to stderr (under torchrun rank 0
    only) and returns NO_GPU_EXIT, for `return no_gpu(...)` / `raise SystemExit(no_gpu(...))`."""
    return cannot_run(tool, f"no CUDA GPU found; {what} needs {needs}")


def rank_from_env() -> int:
    """This process's rank as torchrun sets it ($RANK; 0 when unset or not an int)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def cannot_run(tool: str, reason: str) -> int:
    """A tool that cannot run on this machine (no GPU, a missing extra, too little memory): one line
    "<tool>: <reason>. Nothing measured, nothing written." on stderr (rank 0 only), NO_GPU_EXIT."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{tool}: {reason}. Nothing measured, nothing written.", file=sys.stderr, flush=True)
    return NO_GPU_EXIT


def add_block_shape_args(ap) -> None:
    """The projection/block benchmarks' shape and repeat flags (Flux shapes by default, emulated P = 8)."""
    ap.add_argument("--seqlens", type=SEQLEN, nargs="+", default=[576, 1024, 4096],
                    help="S_loc values")
    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--heads", type=int_in(1, MAX_HEADS), default=24, help="a multiple of --world-size")
    ap.add_argument("--head-dim", type=int, choices=KERNEL_HEAD_DIMS, default=128)
    ap.add_argument("--hidden", type=int_in(1, MAX_HIDDEN), default=3072)
    ap.add_argument("--calls", type=int_in(1, MAX_REPEATS), default=20, help="calls per captured graph")
    ap.add_argument("--trials", type=int_in(1, MAX_REPEATS), default=11)
