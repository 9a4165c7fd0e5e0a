"""Ulysses attention as torch ops: pre-A2A -> attention -> post-A2A over rank windows.

Layers (DESIGN.md "Style to follow"): kernel classes (cute_kernels.a2a, cute_kernels.signal,
cute_kernels.fa4_a2a_sm90) -> cached compiles (cute_kernels.a2a / .signal, fa_a2a.fused) ->
torch.library custom ops that write preallocated outputs (`fa_a2a::ulysses_attention`,
`fa_a2a::ulysses_attention_emulated`, `fa_a2a::post_a2a`; each has a fake implementation, so
torch.compile traces through them) -> the public functions below and fa_a2a.attention.

impl (one rank r of P; rows and heads as in ulysses/layout.py):
  "fused"      pre-A2A kernel (q, k, v in one launch, 16-byte peer stores) -> barrier ->
               fa_a2a.fused.fa4_a2a_forward (FA4 whose epilogue stores O tiles into the peers'
               output windows) -> barrier -> copy of this rank's window into the output.
  "serial"     pre-A2A -> barrier -> fa4_forward -> post-A2A kernel -> barrier -> copy.
  "nccl"       permute + torch.distributed.all_to_all_single around fa4_forward: the baseline
               users run today (yunchang, xDiT, DeepSpeed-Ulysses). On CPU tensors (gloo) the
               local attention is ulysses.reference.local_attention (fp32).
  "reference"  ulysses.reference.ulysses_reference_attention (serial, fp32 attention, any device).
Joint (text) tokens: the joint query rows go through fa4_forward (they are not sent: every rank
holds all of them) and their outputs are all-gathered over heads by the PostA2A kernel in
broadcast mode, inside the same barrier.
Output rows >= seq_len (padding of an uneven S) are zero in every impl.

Timing: not measured yet (fa_a2a.bench measures the pieces).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = [
    "IMPLS",
    "ulysses_attention",
    "ulysses_attention_emulated",
    "pre_a2a",
    "post_a2a",
]

IMPLS = ("fused", "serial", "nccl", "reference")
EMULATED_IMPLS = ("fused", "serial", "reference")  # nccl needs one rank per GPU
_KERNEL_IMPLS = ("fused", "serial")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


# ---- validation --------------------------------------------------------------------------------
def _check_tensor(t, name: str, ndim: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")


def _check_problem(q, k, v, joint, impl: str, causal, softmax_scale, seq_len, world_size: int):
    """Validate one rank's arguments; returns (UlyssesLayout, joint tuple or None)."""
    from ulysses.layout import UlyssesLayout

    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, name)
    B, S_loc, H, D = q.shape
    if min(B, S_loc, H, D) < 1:
        raise ValueError(f"q: every dim of [B, S_loc, H, D] must be >= 1, got {tuple(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q: expected a floating-point dtype, got {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, S_loc, D):
        raise ValueError(f"k: expected [{B}, {S_loc}, H_kv, {D}] like q {tuple(q.shape)}, got {tuple(k.shape)}")
    H_kv = k.shape[2]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"k: {H_kv} KV heads do not divide q's {H} heads")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must equal q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} must equal q's {q.device}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale: expected a positive finite float or None, got {softmax_scale!r}")
    J = 0
    if joint is not None:
        if not isinstance(joint, (tuple, list)) or len(joint) != 3:
            raise ValueError("joint: expected a tuple (joint_q, joint_k, joint_v)")
        for name, t, heads in (("joint[0] (q)", joint[0], H), ("joint[1] (k)", joint[1], H_kv),
                               ("joint[2] (v)", joint[2], H_kv)):
            _check_tensor(t, name)
            if (t.shape[0], t.shape[2], t.shape[3]) != (B, heads, D) or t.shape[1] != joint[0].shape[1]:
                raise ValueError(f"{name}: expected [{B}, J, {heads}, {D}], got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name}: expected {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
        J = joint[0].shape[1]
        if J == 0:
            joint = None
        elif causal:
            raise ValueError("joint: causal masking with joint tokens is not defined (MMDiT attention is not causal)")
        else:
            joint = tuple(joint)
    if impl in _KERNEL_IMPLS or (impl == "nccl" and q.is_cuda):
        if not q.is_cuda:
            raise ValueError(f"q: impl={impl!r} needs CUDA tensors, got device {q.device}")
        if q.dtype not in _KERNEL_DTYPES:
            raise ValueError(f"q: dtype must be bfloat16 or float16 for impl={impl!r}, got {q.dtype}")
        if D not in (64, 128):
            raise ValueError(f"q: head dim must be 64 or 128 for impl={impl!r}, got {D}")
        if (D * q.element_size()) % 16:
            raise ValueError(f"q: head dim {D} is not a multiple of 16 bytes")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the head dim must be contiguous (stride 1)")
    layout = UlyssesLayout.from_shard(S_loc, H, H_kv, world_size, seq_len=seq_len, joint_len=J)
    return layout, joint


def _check_seq_len(seq_len) -> None:
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise ValueError(f"seq_len: expected an int or None, got {seq_len!r}")


def _scale(softmax_scale, D: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)


def _zero_padding_rows(out: torch.Tensor, layout, rank: int) -> None:
    valid = layout.valid_rows(rank)
    if valid < out.shape[1]:
        out[:, valid:].zero_()


def _contiguous16(t: torch.Tensor) -> torch.Tensor:
    """t itself when the A2A kernels can read it (16-byte base and strides), else a copy."""
    es = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned base


# ---- rank windows: plan of one problem on one transport ------------------------------------------
def _head_maps(layout, device):
    q_map = [h if h < layout.num_heads else -1 for row in layout.q_head_index for h in row]
    kv_map = [h for row in layout.kv_head_index for h in row]
    return (torch.tensor(q_map, dtype=torch.int32, device=device),
            torch.tensor(kv_map, dtype=torch.int32, device=device))


class _WindowPlan:
    """Windows, head maps and scratch of one (layout, B, D, dtype) on one transport, built once.

    in-windows (one allocation per rank): q [B, N, H_loc, D] | k [B, N, H_kv_loc, D] | v (same),
    N = S_pad + J; out-windows [B, S_loc, H_pad, D]; joint out-windows [B, J, H_pad, D].
    """

    def __init__(self, transport, layout, B: int, D: int, dtype: torch.dtype):
        N = layout.num_rows
        h, hk = layout.heads_loc, layout.kv_heads_loc
        self.transport, self.layout, self.B, self.D, self.dtype = transport, layout, B, D, dtype
        nq, nk = B * N * h * D, B * N * hk * D
        flat = transport.windows("ulysses.in", (nq + 2 * nk,), dtype)
        self.dq = flat[:, :nq].unflatten(1, (B, N, h, D))
        self.dk = flat[:, nq:nq + nk].unflatten(1, (B, N, hk, D))
        self.dv = flat[:, nq + nk:].unflatten(1, (B, N, hk, D))
        self.out_w = transport.windows("ulysses.out", (B, layout.seq_loc, layout.heads_pad, D), dtype)
        self.jout_w = (transport.windows("ulysses.joint_out", (B, layout.joint_len, layout.heads_pad, D), dtype)
                       if layout.joint_len else None)
        self.q_map, self.kv_map = _head_maps(layout, transport.device)
        self._seqused: dict = {}
        self._scratch: dict = {}

    def seqused_k(self, causal: bool):
        n = self.layout.seqused_k(causal)
        if n is None:
            return None
        if n not in self._seqused:
            self._seqused[n] = torch.full((self.B,), n, dtype=torch.int32, device=self.transport.device)
        return self._seqused[n]

    def scratch(self, kind: str, rank: int, rows: int) -> torch.Tensor:
        key = (kind, rank)
        if key not in self._scratch:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("scratch buffers are allocated during CUDA-graph capture: "
                                   "run the call once eagerly before capturing")
            self._scratch[key] = torch.empty(self.B, rows, self.layout.heads_loc, self.D,
                                             dtype=self.dtype, device=self.transport.device)
        return self._scratch[key]

    # one rank's steps; barriers between them are the caller's
    def pre(self, rank: int, q, k, v, joint) -> None:
        from cute_kernels.a2a import launch_pre_a2a

        q, k, v = (_contiguous16(t) for t in (q, k, v))
        joint = tuple(_contiguous16(t) for t in joint) if joint is not None else None
        launch_pre_a2a(q, k, v, self.dq, self.dk, self.dv, self.q_map, self.kv_map, rank,
                       self.layout.seq_len, joint)

    def attend(self, rank: int, impl: str, causal: bool, scale: float) -> None:
        from cute_kernels.a2a import launch_post_a2a
        from fa_a2a.fused import fa4_a2a_forward, fa4_forward

        lay = self.layout
        q, k, v = self.dq[rank], self.dk[rank], self.dv[rank]
        seqused = self.seqused_k(causal)
        if impl == "fused":
            fa4_a2a_forward(q[:, :lay.seq_pad], k, v, self.out_w, rank, causal=causal,
                            softmax_scale=scale, seqused_k=seqused)
            if lay.joint_len:
                jo = self.scratch("joint", rank, lay.joint_len)
                fa4_forward(q[:, lay.seq_pad:], k, v, jo, causal=False, softmax_scale=scale, seqused_k=seqused)
                launch_post_a2a(jo, self.jout_w, rank, broadcast=True)
        elif impl == "serial":
            o = self.scratch("out", rank, lay.num_rows)
            fa4_forward(q, k, v, o, causal=causal, softmax_scale=scale, seqused_k=seqused)
            launch_post_a2a(o[:, :lay.seq_pad], self.out_w, rank)
            if lay.joint_len:
                launch_post_a2a(o[:, lay.seq_pad:], self.jout_w, rank, broadcast=True)
        else:
            raise ValueError(f"impl: {impl!r} does not use rank windows")

    def finish(self, rank: int, out: torch.Tensor, joint_out: Optional[torch.Tensor]) -> None:
        H = self.layout.num_heads
        out.copy_(self.out_w[rank][:, :, :H])
        _zero_padding_rows(out, self.layout, rank)
        if joint_out is not None:
            joint_out.copy_(self.jout_w[rank][:, :, :H])


_plans: dict = {}


def _plan(transport, layout, B: int, D: int, dtype) -> _WindowPlan:
    for stale in [k for k, p in _plans.items() if p.transport.closed]:
        del _plans[stale]
    key = (id(transport), layout, B, D, dtype)
    if key not in _plans:
        _plans[key] = _WindowPlan(transport, layout, B, D, dtype)
    return _plans[key]


# ---- the NCCL baseline -------------------------------------------------------------------------
def _local_attention(q, k, v, *, causal, softmax_scale, seqused_k: Optional[int]):
    """FA4 on CUDA tensors (the NCCL baseline's attention), the fp32 reference on CPU ones."""
    if q.is_cuda:
        from fa_a2a.fused import fa4_forward

        used = None if seqused_k is None else torch.full((q.shape[0],), seqused_k, dtype=torch.int32, device=q.device)
        return fa4_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                           softmax_scale=softmax_scale, seqused_k=used)
    from ulysses.reference import local_attention

    return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k)


def _nccl_forward(q, k, v, joint, layout, group, rank, causal, scale, out, joint_out):
    """The baseline users run today (yunchang, xDiT): permute + all_to_all_single around FA4."""
    from ulysses.reference import ulysses_reference_attention

    res = ulysses_reference_attention(q, k, v, group=group, joint=joint, causal=causal, softmax_scale=scale,
                                      seq_len=layout.seq_len, attention=_local_attention)
    o, jo = res if joint is not None else (res, None)
    out.copy_(o)
    _zero_padding_rows(out, layout, rank)
    if joint is not None:
        joint_out.copy_(jo)


# ---- one rank of a process group -----------------------------------------------------------------
def _resolve_group(group_name: str):
    import torch.distributed as dist

    if not group_name:
        return None
    return dist.distributed_c10d._resolve_process_group(group_name)


def _world(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _forward(q, k, v, out, joint, joint_out, group, impl, causal, softmax_scale, seq_len):
    P, rank = _world(group)
    layout, joint = _check_problem(q, k, v, joint, impl, causal, softmax_scale, seq_len, P)
    scale = _scale(softmax_scale, q.shape[-1])
    if P == 1:
        # One rank: no communication (all heads, no padding rows), the same local attention.
        jq, jk, jv = joint if joint is not None else (None, None, None)
        qa, ka, va = layout.assemble_q(q, jq), layout.assemble_kv(k, jk), layout.assemble_kv(v, jv)
        if impl == "reference" or not q.is_cuda:
            from ulysses.reference import local_attention

            o = local_attention(qa, ka, va, causal=causal, softmax_scale=scale,
                                seqused_k=layout.seqused_k(causal)).to(q.dtype)
        else:
            o = _local_attention(qa, ka, va, causal, scale, layout.seqused_k(causal))
        o_seq, o_joint = layout.split_out(o)
        out.copy_(o_seq)
        if joint is not None:
            joint_out.copy_(o_joint)
        return
    if impl == "reference":
        from ulysses.reference import ulysses_reference_attention

        res = ulysses_reference_attention(q, k, v, group=group, joint=joint, causal=causal,
                                          softmax_scale=softmax_scale, seq_len=layout.seq_len)
        o, jo = res if joint is not None else (res, None)
        out.copy_(o)
        _zero_padding_rows(out, layout, rank)
        if joint is not None:
            joint_out.copy_(jo)
        return
    if impl == "nccl":
        _nccl_forward(q, k, v, joint, layout, group, rank, causal, scale, out, joint_out)
        return
    from ulysses.transport import get_transport

    transport = get_transport(group)
    plan = _plan(transport, layout, q.shape[0], q.shape[-1], q.dtype)
    plan.pre(rank, q, k, v, joint)
    transport.barrier()
    plan.attend(rank, impl, causal, scale)
    transport.barrier()
    plan.finish(rank, out, joint_out)


# ---- custom ops ------------------------------------------------------------------------------------
@torch.library.custom_op("fa_a2a::ulysses_attention", mutates_args=("out", "joint_out"))
def _ulysses_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    joint_q: Optional[torch.Tensor], joint_k: Optional[torch.Tensor], joint_v: Optional[torch.Tensor],
    joint_out: Optional[torch.Tensor], group_name: str, impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int],
) -> None:
    joint = (joint_q, joint_k, joint_v) if joint_q is not None else None
    _forward(q, k, v, out, joint, joint_out, _resolve_group(group_name), impl, causal, softmax_scale, seq_len)


@_ulysses_attention_op.register_fake
def _(q, k, v, out, joint_q, joint_k, joint_v, joint_out, group_name, impl, causal, softmax_scale, seq_len):
    return None


def _emulated_transport(world_size: int, device: torch.device):
    from ulysses.transport import EmulatedTransport

    key = ("emulated", world_size, device)
    if key not in _emulated or _emulated[key].closed:
        _emulated[key] = EmulatedTransport(world_size, device)
    return _emulated[key]


_emulated: dict = {}


def _forward_emulated(qs, ks, vs, outs, joint, joint_outs, impl, causal, softmax_scale, seq_len):
    P = len(qs)
    if impl not in EMULATED_IMPLS:
        raise ValueError(f"impl: emulated ranks support 'fused', 'serial' and 'reference', got {impl!r}")
    layouts = [_check_problem(q, k, v, joint, impl, causal, softmax_scale, seq_len, P)
               for q, k, v in zip(qs, ks, vs)]
    layout, joint = layouts[0]
    for r in range(1, P):
        if (layouts[r][0] != layout or qs[r].shape != qs[0].shape or ks[r].shape != ks[0].shape
                or qs[r].dtype != qs[0].dtype or qs[r].device != qs[0].device):
            raise ValueError(f"qs[{r}]: every rank's q, k, v must match rank 0's shapes, dtype and device")
    scale = _scale(softmax_scale, qs[0].shape[-1])
    if impl == "reference":
        from ulysses.reference import emulated_ulysses_attention

        res = emulated_ulysses_attention(list(qs), list(ks), list(vs), joint=joint, causal=causal,
                                         softmax_scale=softmax_scale, seq_len=layout.seq_len)
        o, jo = res if joint is not None else (res, None)
        for r in range(P):
            outs[r].copy_(o[r])
            _zero_padding_rows(outs[r], layout, r)
            if joint is not None:
                joint_outs[r].copy_(jo)
        return
    transport = _emulated_transport(P, qs[0].device)
    plan = _plan(transport, layout, qs[0].shape[0], qs[0].shape[-1], qs[0].dtype)
    for r in range(P):
        plan.pre(r, qs[r], ks[r], vs[r], joint)
    transport.barrier()
    for r in range(P):
        plan.attend(r, impl, causal, scale)
    transport.barrier()
    for r in range(P):
        plan.finish(r, outs[r], joint_outs[r] if joint is not None else None)


@torch.library.custom_op("fa_a2a::ulysses_attention_emulated", mutates_args=("outs", "joint_outs"))
def _ulysses_attention_emulated_op(
    qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], outs: list[torch.Tensor],
    joint: list[torch.Tensor], joint_outs: list[torch.Tensor], impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int],
) -> None:
    _forward_emulated(qs, ks, vs, outs, tuple(joint) if joint else None, joint_outs, impl, causal,
                      softmax_scale, seq_len)


@_ulysses_attention_emulated_op.register_fake
def _(qs, ks, vs, outs, joint, joint_outs, impl, causal, softmax_scale, seq_len):
    return None


@torch.library.custom_op("fa_a2a::post_a2a", mutates_args=("out_windows",))
def _post_a2a_op(o: torch.Tensor, out_windows: torch.Tensor, rank: int, broadcast: bool) -> None:
    from cute_kernels.a2a import launch_post_a2a

    launch_post_a2a(o, out_windows, rank, broadcast=broadcast)


@_post_a2a_op.register_fake
def _(o, out_windows, rank, broadcast):
    return None


# ---- public functions ------------------------------------------------------------------------------
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    impl: str = "fused",
    joint: Optional[Sequence[torch.Tensor]] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seq_len: Optional[int] = None,
):
    """Ulysses sequence-parallel attention, called by every rank of `group` with its shard.

    q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D] (H_kv divides H: GQA): rows
    [rank*S_loc, (rank+1)*S_loc) of the full sequence. seq_len: valid rows of the full sequence
    (default P*S_loc; the padding rows of the last shards are masked as keys and come back as
    zeros). joint: replicated (q, k, v) [B, J, H(_kv), D] text tokens (MMDiT), attended to and
    attending every row. Returns [B, S_loc, H, D], or (that, joint output [B, J, H, D]) with joint.
    group=None: the default group (a single process without torch.distributed is P = 1).
    The first call per shape allocates the rank windows (collective, host-synchronous): make it
    before CUDA-graph capture.
    """
    if group is not None and not hasattr(group, "group_name"):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    group_name = ""
    if group is not None:
        group_name = group.group_name
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group_name = dist.group.WORLD.group_name
    _check_seq_len(seq_len)
    # Full validation here too: errors name the argument before the op's schema sees it.
    given_joint = joint is not None
    _, joint = _check_problem(q, k, v, joint, impl, causal, softmax_scale, seq_len, _world(group)[0])
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    jq = jk = jv = joint_out = None
    if joint is not None:
        jq, jk, jv = joint
        joint_out = torch.empty_like(jq, memory_format=torch.contiguous_format)
    _ulysses_attention_op(q, k, v, out, jq, jk, jv, joint_out, group_name, impl, causal,
                          None if softmax_scale is None else float(softmax_scale), seq_len)
    if not given_joint:
        return out
    if joint_out is None:  # joint with J = 0 rows
        joint_out = q.new_empty(q.shape[0], 0, q.shape[2], q.shape[3])
    return out, joint_out


def ulysses_attention_emulated(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    impl: str = "fused",
    joint: Optional[Sequence[torch.Tensor]] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seq_len: Optional[int] = None,
):
    """One process plays all P ranks: lists of P shards (as ulysses_attention takes) -> P outputs.

    Windows are P slices of one local buffer (ulysses.transport.EmulatedTransport); the kernels
    and barriers are the real ones. impl: "fused", "serial" or "reference". Returns the list of
    outputs, or (list, list of P joint outputs) with joint.
    """
    for name, xs in (("qs", qs), ("ks", ks), ("vs", vs)):
        if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
            raise ValueError(f"{name}: expected a non-empty list of per-rank tensors")
    if not len(qs) == len(ks) == len(vs):
        raise ValueError(f"ks, vs: expected {len(qs)} tensors like qs, got {len(ks)} and {len(vs)}")
    for r, q in enumerate(qs):
        _check_tensor(q, f"qs[{r}]")
    _check_seq_len(seq_len)
    for r in range(len(qs)):
        _check_problem(qs[r], ks[r], vs[r], joint, "reference", causal, softmax_scale, seq_len, len(qs))
    outs = [torch.empty_like(q, memory_format=torch.contiguous_format) for q in qs]
    joint_list, joint_outs = [], []
    if joint is not None:
        if not isinstance(joint, (tuple, list)) or len(joint) != 3:
            raise ValueError("joint: expected a tuple (joint_q, joint_k, joint_v)")
        _check_tensor(joint[0], "joint[0] (q)")
        joint_list = list(joint)
        joint_outs = [torch.empty_like(joint[0], memory_format=torch.contiguous_format) for _ in qs]
    _ulysses_attention_emulated_op(list(qs), list(ks), list(vs), outs, joint_list, joint_outs, impl,
                                   causal, None if softmax_scale is None else float(softmax_scale), seq_len)
    return outs if joint is None else (outs, joint_outs)


def post_a2a(o: torch.Tensor, out_windows: torch.Tensor, rank: int, *, broadcast: bool = False) -> None:
    """Post-attention A2A kernel alone: stores only (a barrier makes them visible to peers).

    o [B, P*S_loc, H_loc, D] (this rank's heads, all rows) -> out_windows [P, B, S_loc, H, D]:
    out_windows[s // S_loc][b, s % S_loc, rank*H_loc + h] = o[b, s, h] (H >= P*H_loc).
    broadcast=True (joint rows): o [B, J, H_loc, D] -> out_windows[d][b, t, rank*H_loc + h] for all d.
    """
    _check_tensor(o, "o")
    _check_tensor(out_windows, "out_windows", 5)
    P, B, rows, H, D = out_windows.shape
    if o.dtype != out_windows.dtype or o.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"o: dtype {o.dtype} must be bfloat16/float16 and equal out_windows' {out_windows.dtype}")
    if o.device != out_windows.device or not o.is_cuda:
        raise ValueError(f"o: must be a CUDA tensor on out_windows' device {out_windows.device}, got {o.device}")
    if not isinstance(rank, int) or not 0 <= rank < P:
        raise ValueError(f"rank: expected an int in [0, {P}), got {rank!r}")
    H_loc = o.shape[2]
    expect_rows = rows if broadcast else P * rows
    if o.shape[0] != B or o.shape[1] != expect_rows or o.shape[3] != D:
        raise ValueError(f"o: expected [{B}, {expect_rows}, H_loc, {D}] for out_windows {tuple(out_windows.shape)}, "
                         f"got {tuple(o.shape)}")
    if P * H_loc > H:
        raise ValueError(f"out_windows: {H} heads cannot hold P*H_loc = {P}*{H_loc}")
    if out_windows.stride()[1:] != (rows * H * D, H * D, D, 1):
        raise ValueError("out_windows: each window out_windows[d] must be a contiguous [B, S_loc, H, D]")
    _post_a2a_op(_contiguous16(o), out_windows, rank, broadcast)


def pre_a2a(q, k, v, in_windows, rank: int, *, seq_len: Optional[int] = None, joint=None) -> None:
    """Pre-attention A2A kernel alone (q, k, v in one launch): stores only.

    q [B, S_loc, H, D], k/v [B, S_loc, H_kv, D]; in_windows: a tensor [P, 3, B, N, H_loc, D]
    (no GQA: H_kv = H) or a tuple (dq [P, B, N, H_loc, D], dk, dv [P, B, N, H_kv_loc, D]) with
    N = S_pad + J and heads as ulysses.layout.UlyssesLayout assigns them. Writes rank `rank`'s
    rows into every rank's window (see cute_kernels/a2a.py for the row order).
    """
    if isinstance(in_windows, torch.Tensor):
        _check_tensor(in_windows, "in_windows", 6)
        if in_windows.shape[1] != 3:
            raise ValueError(f"in_windows: dim 1 must be 3 (q, k, v), got {tuple(in_windows.shape)}")
        dq, dk, dv = in_windows[:, 0], in_windows[:, 1], in_windows[:, 2]
    elif isinstance(in_windows, (tuple, list)) and len(in_windows) == 3:
        dq, dk, dv = in_windows
        for name, t in (("in_windows[0]", dq), ("in_windows[1]", dk), ("in_windows[2]", dv)):
            _check_tensor(t, name, 5)
    else:
        raise ValueError("in_windows: expected a [P, 3, B, N, H_loc, D] tensor or a tuple (dq, dk, dv)")
    P = dq.shape[0]
    layout, joint = _check_problem(q, k, v, joint, "serial", False, None, seq_len, P)
    B, D = q.shape[0], q.shape[3]
    if not isinstance(rank, int) or not 0 <= rank < P:
        raise ValueError(f"rank: expected an int in [0, {P}), got {rank!r}")
    for name, t, heads in (("in_windows (q)", dq, layout.heads_loc), ("in_windows (k)", dk, layout.kv_heads_loc),
                           ("in_windows (v)", dv, layout.kv_heads_loc)):
        if tuple(t.shape) != (P, B, layout.num_rows, heads, D):
            raise ValueError(f"{name}: expected {(P, B, layout.num_rows, heads, D)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
        if t.stride()[1:] != (layout.num_rows * heads * D, heads * D, D, 1):
            raise ValueError(f"{name}: each window must be contiguous")
    q_map, kv_map = _head_maps(layout, q.device)
    from cute_kernels.a2a import launch_pre_a2a

    q, k, v = (_contiguous16(t) for t in (q, k, v))
    joint = tuple(_contiguous16(t) for t in joint) if joint is not None else None
    launch_pre_a2a(q, k, v, dq, dk, dv, q_map, kv_map, rank, layout.seq_len, joint)
