"""What the attention tests share: named cases, poisoned inputs, oracles and FA4's tolerance rule."""

import contextlib
import os
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ulysses.layout import split_seq
from ulysses.reference import full_attention

ROOT = Path(__file__).resolve().parents[1]  # the repository root


def repo_env(**extra) -> dict:
    """The environment for a child process that imports the repository: os.environ with `extra`, and
    PYTHONPATH = the repository root, then extra's PYTHONPATH (if given), then the environment's.

    Prepending rather than replacing keeps what the machine's own PYTHONPATH adds (on some machines
    the packages are importable only through it)."""
    paths = [str(ROOT), extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for s in paths for p in str(s).split(os.pathsep) if p)
    return env


class Case(NamedTuple):
    """One Ulysses problem: P ranks, q [B, S, H, D], k/v [B, S, H_kv, D], J joint rows."""

    P: int
    B: int
    S: int
    H: int
    H_kv: int
    D: int
    J: int = 0
    causal: bool = False


def make_inputs(case: Case, seed: int, *, dtype=torch.float32, device="cpu", poison=1e3, nan=False):
    """Fresh random (full q, k, v), joint (or None) and per-rank shards [q_shards, k_shards, v_shards].

    The padding rows of the shards hold `poison` * randn (and NaN in one element with nan=True):
    an unmasked padded key, or one whose 0 weight meets a NaN, shows in the output."""
    case = Case(*case)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    full = tuple(randn(case.B, case.S, h, case.D) for h in (case.H, case.H_kv, case.H_kv))
    joint = tuple(randn(case.B, case.J, h, case.D) for h in (case.H, case.H_kv, case.H_kv)) if case.J else None
    shards = []
    for x in full:
        parts = split_seq(x, case.P)
        for r, t in enumerate(parts):
            n = max(0, min(t.shape[1], case.S - r * t.shape[1]))
            t[:, n:] = poison * randn(*t[:, n:].shape)
            if nan and n < t.shape[1]:
                t[:, n:, :1, :1] = float("nan")
        shards.append(parts)
    return full, joint, shards


def pair(res, joint):
    """ulysses_attention's result as (out, joint_out or None) whether or not joint was given."""
    return res if joint is not None else (res, None)


def oracles(full, joint, causal: bool, base_dtype=torch.float32):
    """((fp64 oracle, its joint rows), (the same attention in base_dtype, its joint rows))."""
    ref = pair(full_attention(*full, joint=joint, causal=causal), joint)
    base = pair(full_attention(*full, joint=joint, causal=causal, dtype=base_dtype), joint)
    return ref, base


def check_attention(out, ref, base, atol: float, what: Optional[object] = None) -> None:
    """FA4's rule: max |out - ref| <= 2 * max |base - ref| + atol (ref fp64, base the same-precision baseline)."""
    assert torch.isfinite(out).all(), what
    err = (out.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + atol, (what, err, base_err)


def fp64_attention(q, k, v, scale=None, mask=None):
    """A plain fp64 oracle, independent of the library: softmax(q k^T * scale) v for q [B, S, H, D], k/v
    [B, S_k, H_kv, D] (GQA by repeat); mask: boolean (True keeps) or additive, broadcast to [B, H, S, S_k]."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(g, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms on (FA4's deterministic backward) for the block, off after."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def poison_allocated(transport, ranks=None) -> None:
    """NaN into the ranks' (default: every rank's) windows of every float allocation on transport so far:
    the staging sets and the lent sets 1.. alike (a call takes the lowest set free, so poisoning set 0
    alone would leave an earlier call's rows in the set the next results come from), but for a window a
    lent tensor alive starts at (results the test still holds: the next call takes another set). A set
    allocated later starts zero-filled."""
    for w in transport.allocated_windows():
        if w.is_floating_point():
            for r in range(w.shape[0]) if ranks is None else ranks:
                if not transport.lent(w[r].data_ptr()):
                    w[r].fill_(float("nan"))
