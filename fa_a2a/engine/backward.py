"""Gradients through the Ulysses op: the backward of ulysses_attention, of its emulated form and so
of UlyssesAttention (issue 39).

The backward mirrors the forward (rows and heads as in ulysses/layout.py; rank r of P):
  dO [B, S_loc, H, D], its padding rows zeroed (the forward's output there is the constant 0)
  --seq -> heads exchange, with the joint rows' dO: every rank sends each rank its joint-output
    grads of that rank's heads, summed there (the mirror of the forward's all-gather over heads)-->
  dO heads [B, N, H_loc, D] --the attention backward on the rank's heads over the whole sequence-->
  dq, dk, dv heads (keys back from the key-row order to slot order) --heads -> seq exchange, the
  three in one--> dq [B, S_loc, H, D], dk, dv [B, S_loc, H_kv, D]. With GQA the KV heads that a
  rank received several times, or that several ranks received, get the sum of their parts (fp32).
Padding rows (seq_len padding, uneven shards) get zero grads: their q, k, v rows are zeroed before
the forward's exchange (only on this path), so a NaN the caller left there cannot reach the
backward's sums, and their dO rows are zero.
Joint (replicated) inputs: rank r's joint grads hold the heads rank r computed, zero elsewhere.
That is the derivative of what each rank computes; summed over the ranks (the all-reduce that
sequence-parallel training runs on replicated parameters anyway, since each rank's loss sees only
its shard) it is the full gradient. Emulated ranks share one joint tuple: it gets that sum.

What the forward keeps, in storage of its own (the rank windows and scratch are reused every
call): the heads-layout q, k, v of the rank, and where FA4 runs its O [B, N, H_loc, D] and LSE
[B, H_loc, N] fp32 (FA4's backward reads both; recomputing them would cost a second forward).
Per layer and rank (saved_bytes; bf16, B = 1, no GQA) that is 4 * N*H_loc*D*2 bytes + the LSE,
what a single-GPU FlashAttention keeps (q, k, v, out, lse) for the rank's share of the heads:
Flux at 1024^2 (4096 image + 512 text tokens, 24 heads, D 128) 113.7 MB at P = 1, 56.8 at P = 2,
28.4 at P = 4, 14.2 at P = 8; Wan 2.1 14B at 720p (75600 tokens, 40 heads, D 128) 3.11 GB at
P = 1, 1.55 GB at P = 2, 777 MB at P = 4, 389 MB at P = 8; Wan 2.1 1.3B at 480p (32760 tokens, 12
heads) 404 MB at P = 1, 67.4 MB at P = 8 (12 heads over 8 ranks: 2 per rank, 4 of them padding).

Where each impl runs (real ranks; emulated ranks the same in one process):
  "reference", "nccl" on CPU  one all_to_all_single moves q, k, v (seq -> heads), the fp32
                              reference attention, one moves O back (and all-gathers the joint
                              rows); the backward recomputes the reference attention's probabilities
                              (ulysses.reference.local_attention_backward).
  "nccl" on CUDA              the same exchanges, FA4 with its LSE; the backward FA4's own
                              (flash_attn.cute.interface._flash_attn_bwd, SM90 or SM100).
  "serial", "fused"           the op's pre-A2A kernel into the rank windows -> barrier -> FA4 with
                              its LSE into a fresh O and LSE -> a copy of the rank's q | k | v ->
                              post-A2A kernel -> barrier. "fused" on SM90 (unpaced): the fused
                              kernel in place of FA4 + the post-A2A, which also stores every O tile
                              and LSE row into the fresh O and LSE (cute_kernels.fa4_a2a_sm90,
                              keep_o): FA4's O and LSE bit for bit, so fused and serial give the
                              same gradients bit for bit (_GradAttend).
                              The backward of "serial" (the reference the fused one must equal):
                              FA4's backward between two all_to_all_single exchanges over the group.
                              The backward of "fused" (fused_backward_applies: CUDA SM90/SM100,
                              suffix padding; otherwise the exchanges
                              above): no
                              torch.distributed collective at all, the ranks meet in the
                              transport's barriers. dO (padding rows zeroed) -> the pre-A2A kernel
                              into the forward's q in-windows (its q part alone: the k, v part gets
                              no heads) -> barrier -> cute_kernels.fa4_bwd_a2a (FA4's SM90 / SM100
                              backward whose kernels store dq, dk, dv rows into the owners'
                              windows "ulysses.dq" / "ulysses.dk" / "ulysses.dv": dK, dV in its
                              epilogue, dQ and GQA's dK, dV in the postprocess) -> barrier -> the
                              rank's own windows read out (dq's first H heads; dk, dv summed over
                              the ranks' KV heads as the exchange path sums them; rows >=
                              valid_rows zeroed). They are delivered as the forward delivers its
                              output (forward.Slots: the ranks agree on a set of gradient
                              windows free on every rank; the grads are lent out of it as they are
                              where contiguous, and the set is taken again only once none of them
                              is alive; set 0 is copied out), real and emulated ranks alike.
                              dK, dV are stored per thread where the call's forward stored O so
                              (impl "fused:st", or "auto" that timed it faster: Spec.dkv_store),
                              else by TMA where the shape allows.
                              Joint rows: each rank's joint-output grads of each rank's heads
                              go to that rank's "ulysses.djout" window with the pre-A2A; after the
                              barrier each rank sums them (as the exchange path does) into dO's
                              joint rows; the kernels store the joint rows' dq, dk, dv into the
                              rank's own tensors (its joint grads, never sent).
                              Emulated ranks: every rank's pre-A2A, one barrier, every rank's
                              backward, one barrier. The backward kernels are bound per call (they
                              read that call's saved tensors) and compiled at the first, before
                              the first barrier; the ranks then line up on the host once.
  impl "auto" decides as the forward does (fa_a2a.engine.forward); its choices all run FA4 on CUDA,
  and where it decides "fused" the backward is the fused one above.
  With the output projection (fa_a2a.ulysses_attention_out_proj: _ProjectedFunction) the fused
  backward's dO comes from the projection's input-gradient GEMM dO = dY @ W, whose epilogue stores it
  into the same dO windows (the QKV projection's kernel, q part alone: _FusedRank.project_dout) in
  place of the pre-A2A kernel; elsewhere dO = dY @ W in torch, then the backward above. Tested on an
  H100 (2026-12-05, tests/gpu/test_out_proj_gpu.py); not timed yet.
Every rank must run the backward of every call that required grad, in the same order (it is
collective, as the forward is): a rank whose loss does not reach an output still backpropagates
through it (e.g. loss + 0 * out.sum()). Each backward is agreed across ranks like a forward
(fa_a2a.engine.problem.agree_call): ranks whose backwards differ raise the same ValueError, a rank that
never comes makes the others raise TimeoutError (FA_A2A_TIMEOUT_S), never a hang.
FA4's backward accumulates dQ with atomics: its bits vary from run to run unless
torch.use_deterministic_algorithms(True) (then FA4's deterministic mode, in the fused backward too;
the ranks agree on that mode with the rest of the backward's signature).

Autograd: eagerly a torch.autograd.Function calls the Python paths below directly (the op's eager
host cost, fa_a2a.op); under torch.compile the public function calls the functional custom op
`fa_a2a::ulysses_attention_grad_v2`, whose backward (torch.library.register_autograd) is the custom
op `fa_a2a::ulysses_attention_grad_backward_v2` (fused where the forward op's run decided so: its
arguments are fixed at trace time, impl "auto" is decided at run time). Inputs that do not require
grad (or no_grad / inference_mode) never come here. Double backward is not supported.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from cute_kernels.limits import DTYPES as KERNEL_DTYPES, HEAD_DIMS as KERNEL_HEAD_DIMS
from ulysses.layout import UlyssesLayout, index_tensor, take_heads
from ulysses.reference import local_attention as reference_attention
from ulysses.reference import local_attention_backward as reference_attention_backward

from .problem import KERNEL_IMPLS, Problem, group_by_name

__all__ = ["Saved", "Spec", "wants_grad", "fused_backward_applies", "forward_saving", "forward_emulated_saving",
           "backward", "attention_with_grad", "attention_emulated_with_grad", "traced_attention_with_grad",
           "saved_bytes"]


class Saved(NamedTuple):
    """One rank's heads-layout tensors the backward reads: q [B, N, H_loc, D], k, v [B, N, H_kv_loc, D]
    (key-row order), and where FA4 ran, o like q and lse [B, H_loc, N] fp32 (None otherwise)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]


class Spec(NamedTuple):
    """What the backward of one call needs besides tensors: fa4 = FA4's backward (else the reference's);
    fused = the fused backward (cute_kernels.fa4_bwd_a2a through the transport's windows; else FA4's
    backward between two exchanges); dkv_store "st": the fused backward stores dK, dV per thread, as the
    call's forward stored O (impl "fused:st", or "auto" that timed per-thread stores faster on this
    machine: remote TMA stores are the kind that can collapse into cross-process peer mappings), None:
    the launcher's rule (TMA where the shape allows)."""

    layout: UlyssesLayout
    causal: bool
    scale: float
    fa4: bool
    fused: bool = False
    dkv_store: Optional[str] = None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _capability_of(device) -> tuple:
    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _fused_arch(device) -> bool:
    """Whether `device` is a CUDA device the fused backward's kernels take: compute capability 9.0
    (SM90) or 10.x (SM100 / SM103: compiled in CI, not yet run on a Blackwell GPU)."""
    if torch.device(device).type != "cuda":
        return False
    major, minor = _capability_of(device)
    return (major, minor) == (9, 0) or major == 10


def fused_backward_applies(p: Problem, device) -> bool:
    """Whether the backward of p's call (p: impl decided, "auto" resolved) on tensors of `device` is the
    fused one (cute_kernels.fa4_bwd_a2a): impl "fused" on several ranks (real or emulated), FA4 on an
    SM90 or SM100 GPU, the padding a suffix (the ceil split), so that the saved keys are the sequence's in
    slot order, then the joint ones (the launcher's rows: N = P * S_loc + J). Every other call's backward is
    FA4's (or the reference's) between two exchanges."""
    lay = p.layout
    return (p.impl == "fused" and p.world_size > 1 and p.device_type == "cuda"
            and lay.is_suffix_padded and p.dtype in KERNEL_DTYPES and p.head_dim in KERNEL_HEAD_DIMS
            and device is not None and _fused_arch(device))


def spec_of(p: Problem, device=None) -> Spec:
    """The backward's Spec of p's call (impl decided); device: its tensors' (None: never the fused backward)."""
    fused = fused_backward_applies(p, device)
    return Spec(p.layout, p.causal, p.scale, p.device_type == "cuda" and p.impl != "reference", fused,
                "st" if fused and p.o_store == "st" else None)


def wants_grad(q, k, v, joint=None) -> bool:
    """Whether this call builds a graph: grad mode on and an input that requires grad (the one
    check the op's eager path makes for the backward; inputs not yet validated)."""
    if not torch.is_grad_enabled():
        return False
    if getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False):
        return True
    return isinstance(joint, (tuple, list)) and any(getattr(t, "requires_grad", False) for t in joint)


def saved_bytes(B: int, S: int, J: int, H: int, H_kv: int, D: int, P: int, element_size: int = 2) -> int:
    """Bytes one call keeps per rank for the backward where FA4 runs: q, o [B, N, H_loc, D], k, v
    [B, N, H_kv_loc, D] and the LSE [B, H_loc, N] fp32, N = P * ceil(S / P) + J."""
    lay = UlyssesLayout(S, H, H_kv, P, J)
    N = lay.num_rows
    return B * N * D * element_size * (2 * lay.heads_loc + 2 * lay.kv_heads_loc) + B * lay.heads_loc * N * 4


# ---- exchanges: sends[d] = the tensors for rank d -> recv[s] = those rank s sent -------------------
def _pack(parts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in parts])


def _unpack(flat: torch.Tensor, like) -> tuple:
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return tuple(out)


def dist_exchange(sends, group) -> list:
    """One all_to_all_single over group: sends [P] of tuples (same shapes for every destination)."""
    send = torch.stack([_pack(s) for s in sends])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [_unpack(row, sends[0]) for row in recv]


def _transpose(all_sends) -> list:
    """The exchange of ranks in one process: all_sends[r][d] -> recvs[r][s] = all_sends[s][r]."""
    return [[all_sends[s][r] for s in range(len(all_sends))] for r in range(len(all_sends))]


def _exchanger(group):
    """exchange(list over local ranks of their sends) -> list over local ranks of their receipts."""
    if group is None:  # P = 1 or emulated ranks: every rank is local
        return _transpose
    return lambda all_sends: [dist_exchange(all_sends[0], group)]


# ---- one rank's phases (ulysses.layout's rows and heads) --------------------------------------------
def _padded(lay: UlyssesLayout, r: int, x: torch.Tensor) -> torch.Tensor:
    """Rank r's shard [B, rows, ...] as its slot [B, S_loc, ...] with the padding rows zeroed."""
    if x.shape[1] != lay.seq_loc:
        x = lay.pad_shard(x, r)
    return lay.zero_padding(x, r)


def _qkv_sends(lay, q, k, v) -> list:
    return [(take_heads(q, lay.q_head_index[d]), take_heads(k, lay.kv_head_index[d]),
             take_heads(v, lay.kv_head_index[d])) for d in range(lay.world_size)]


def _heads_inputs(lay, r: int, recv, joint) -> tuple:
    q, k, v = (torch.cat([x[i] for x in recv], dim=1) for i in range(3))
    jq = jk = jv = None
    if joint is not None:
        jq = lay.joint_q_heads(joint[0], r)
        jk, jv = (lay.joint_kv_heads(t, r) for t in joint[1:])
    return lay.assemble_q(q, jq), lay.assemble_kv(k, jk), lay.assemble_kv(v, jv)


def _out_sends(lay, o) -> list:
    seq, joint = lay.split_out(o)
    S = lay.seq_loc
    return [(seq[:, d * S:(d + 1) * S], joint) for d in range(lay.world_size)]


def _shard_out(lay, recv) -> tuple:
    H = lay.num_heads

    def heads(t):  # (the padding heads dropped; no view of the cat where there are none)
        return t if t.shape[2] == H else t[:, :, :H]

    out = heads(torch.cat([x[0] for x in recv], dim=2))
    return out, (heads(torch.cat([x[1] for x in recv], dim=2)) if lay.joint_len else None)


def _own(t):
    """An output of an autograd Function as a tensor of its own: a view (of a buffer made in the forward)
    copied, since autograd refuses an in-place change of a Function's view output (out.add_(x)), which
    the same call without grad allows."""
    return t if t is None or t._base is None else t.clone()


def _dout_sends(lay, r: int, dout, djout) -> list:
    dout = _padded(lay, r, dout)
    return [(take_heads(dout, lay.q_head_index[d]),) + ((take_heads(djout, lay.q_head_index[d]),)
                                                        if lay.joint_len else ()) for d in range(lay.world_size)]


def _heads_dout(lay, recv) -> torch.Tensor:
    seq = torch.cat([x[0] for x in recv], dim=1)
    joint = None
    if lay.joint_len:  # every rank's joint-output grads of these heads, summed
        joint = _sum_ranks([x[1] for x in recv])
    return lay.assemble_q(seq, joint)


def _grad_sends(lay, dq, dk, dv) -> tuple:
    """(sends of dq, dk, dv heads to the ranks owning their rows, this rank's joint-row grads)."""
    dq_seq, dq_joint = lay.split_out(dq)
    src = lay.kv_row_source(dk.device)  # key row i holds cat([slot rows, joint rows])[src[i]]
    dk, dv = (x.new_zeros(x.shape).index_copy_(1, src, x) for x in (dk, dv))
    S = lay.seq_loc
    sends = [(dq_seq[:, d * S:(d + 1) * S], dk[:, d * S:(d + 1) * S], dv[:, d * S:(d + 1) * S])
             for d in range(lay.world_size)]
    return sends, (dq_joint, dk[:, lay.seq_pad:], dv[:, lay.seq_pad:])


def _each_head_once(rows, num_heads: int) -> bool:
    """Whether the parts holding global heads rows[i] are heads 0 .. num_heads - 1, each once, in order
    (their head-sum is a plain concatenation)."""
    return [h for row in rows for h in row] == list(range(num_heads))


def _sum_heads(parts, rows, num_heads: int) -> torch.Tensor:
    """Head-sum: parts[i] [B, n, h, D] holds global heads rows[i] -> [B, n, num_heads, D] (sums in fp32)."""
    if _each_head_once(rows, num_heads):  # a plain split
        return torch.cat(parts, dim=2)
    flat = [h for row in rows for h in row]
    B, n, _, D = parts[0].shape
    acc = parts[0].new_zeros(B, n, num_heads, D, dtype=torch.promote_types(parts[0].dtype, torch.float32))
    acc.index_add_(2, index_tensor(tuple(flat), acc.device), torch.cat(parts, dim=2).to(acc.dtype))
    return acc.to(parts[0].dtype)


def _sum_ranks(parts) -> torch.Tensor:
    """The ranks' joint grads (a list, or already stacked on dim 0) summed in rank order (in fp32 at least),
    in their dtype."""
    stacked = parts if isinstance(parts, torch.Tensor) else torch.stack(parts)
    return stacked.sum(0, dtype=torch.promote_types(stacked.dtype, torch.float32)).to(stacked.dtype)


def _shard_grads(lay, r: int, recv, rows: int) -> tuple:
    H, H_kv = lay.num_heads, lay.num_kv_heads
    dq = torch.cat([x[0] for x in recv], dim=2)[:, :, :H]
    dk = _sum_heads([x[1] for x in recv], lay.kv_head_index, H_kv)
    dv = _sum_heads([x[2] for x in recv], lay.kv_head_index, H_kv)
    n = lay.valid_rows(r)
    grads = []
    for g in (dq, dk, dv):
        if n < g.shape[1]:  # zero already (dO and the inputs are zero there); kept exact whatever the kernel left
            g[:, n:] = 0
        grads.append(g[:, :rows])
    return tuple(grads)


def _joint_grads(lay, r: int, joint) -> tuple:
    dq, dk, dv = joint
    B, J, h, D = dq.shape
    djq = dq.new_zeros(B, J, lay.heads_pad, D)
    djq[:, :, r * h:(r + 1) * h] = dq
    return (djq[:, :, :lay.num_heads], _sum_heads([dk], [lay.kv_head_index[r]], lay.num_kv_heads),
            _sum_heads([dv], [lay.kv_head_index[r]], lay.num_kv_heads))


# ---- the attention on one rank's heads, and its backward --------------------------------------------
def _attention(spec: Spec, q, k, v) -> tuple:
    """(o, Saved) of the local attention on heads-layout q, k, v (FA4 with its LSE, or the reference)."""
    used = spec.layout.seqused_k(spec.causal)
    if spec.fa4:
        from cute_kernels.fa4 import fa4_forward

        from .forward import seqused_tensor

        B, N, H, _ = q.shape
        lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        q, k, v = (t.contiguous() for t in (q, k, v))
        o = fa4_forward(q, k, v, causal=spec.causal, softmax_scale=spec.scale,
                        seqused_k=seqused_tensor(used, B, q.device), lse=lse)
        return o, Saved(q, k, v, o, lse)
    o = reference_attention(q, k, v, causal=spec.causal, softmax_scale=spec.scale, seqused_k=used).to(q.dtype)
    return o, Saved(q, k, v, None, None)


def _attention_backward(spec: Spec, s: Saved, do) -> tuple:
    """(dq, dk, dv) heads layout; keys beyond seqused_k get zeros."""
    used = spec.layout.seqused_k(spec.causal)
    if spec.fa4:
        from flash_attn.cute.interface import _flash_attn_bwd

        from .forward import seqused_tensor

        dq, dk, dv = _flash_attn_bwd(s.q, s.k, s.v, s.o, do.contiguous(), s.lse, spec.scale, spec.causal,
                                     seqused_k=seqused_tensor(used, s.q.shape[0], s.q.device),
                                     deterministic=torch.are_deterministic_algorithms_enabled())
        if used is not None:  # rows FA4's varlen backward does not write (narrow: also on fake tensors of
            # torch's CPU build, where indexing a CUDA tensor fails)
            for t in (dk, dv):
                t.narrow(1, used, t.shape[1] - used).zero_()
        return dq, dk, dv
    return reference_attention_backward(s.q, s.k, s.v, do, causal=spec.causal, softmax_scale=spec.scale,
                                        seqused_k=used)


# ---- forwards that keep what the backward reads -----------------------------------------------------
def _collective_forward(spec: Spec, ranks, qs, ks, vs, joint, exchange) -> list:
    """The exchange pipeline for these local ranks (padded, zeroed shards) -> [((o, jo), Saved)]."""
    lay = spec.layout
    recvs = exchange([_qkv_sends(lay, q, k, v) for q, k, v in zip(qs, ks, vs)])
    done = [_attention(spec, *_heads_inputs(lay, r, recv, joint)) for r, recv in zip(ranks, recvs)]
    recvs = exchange([_out_sends(lay, o) for o, _ in done])
    return [(_shard_out(lay, recv), saved) for recv, (_, saved) in zip(recvs, done)]


class _GradAttend:
    """A rank's attention from its in-window that keeps what its backward reads: a fresh O [B, N, H_loc, D]
    and LSE [B, H_loc, N] of each call (kept for the backward as they are) and one copy of the rank's
    q | k | v (the in-window: one allocation, forward.in_windows), launched by WindowPlan.complete
    between its two barriers. The copy of the in-window is queued before the second barrier: peers'
    next pre-A2A stores into it once they have passed that barrier.
    fused (impl "fused" on SM90, unpaced): the fused kernel routes O to its owners and also stores it and
    its LSE into the fresh O and LSE (cute_kernels.fa4.fa4_a2a_keeping_launcher: FA4's bits); the joint
    rows: FA4 into the fresh O's and LSE's joint rows, then their post-A2A. Otherwise (serial, or fused
    paced or on SM100): FA4 into the fresh O and LSE, then the post-A2A kernel(s) from that O."""

    def __init__(self, plan, rank: int, causal: bool, scale: float, fused: bool = False, o_store=None):
        from cute_kernels.fa4 import fa4_into_launcher

        lay = plan.layout
        self.plan, self.rank, self.causal, self.scale = plan, rank, causal, scale
        self.fused, self.o_store = fused, o_store
        q, k, v = plan.dq[rank], plan.dk[rank], plan.dv[rank]
        es = q.element_size()
        if not (k.data_ptr() == q.data_ptr() + q.numel() * es and v.data_ptr() == k.data_ptr() + k.numel() * es
                and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            raise RuntimeError("in-windows: each rank's q | k | v expected in one allocation (forward.in_windows)")
        self.qkv = q.as_strided((q.numel() + k.numel() + v.numel(),), (1,))  # the rank's q | k | v
        self.parts = [(0, q.numel(), q.shape), (q.numel(), k.numel(), k.shape),
                      (q.numel() + k.numel(), v.numel(), v.shape)]  # (offset, size, shape) in it
        # the layouts of the fresh O and LSE (each call's are empty_like these)
        self.o_like = plan.scratch("out", rank, lay.num_rows)
        self.lse_like = torch.empty(plan.B, lay.heads_loc, lay.num_rows, dtype=torch.float32, device=q.device)
        self.seqused = None if causal else plan.seqused
        rows = slice(lay.seq_pad, None) if fused else slice(None)  # the rows FA4 itself computes
        self.fa4 = None
        if not fused or lay.joint_len:
            self.fa4 = fa4_into_launcher(q[:, rows], k, v, self.o_like[:, rows], causal=causal and not fused,
                                         softmax_scale=scale, seqused_k=self.seqused,
                                         lse_like=self.lse_like[:, :, rows])
        self.fa4_rows = rows
        self.per_slot: dict = {}
        self.saved: Optional[Saved] = None

    def _steps(self, slot: int) -> list:
        """[(launch, rows)] into out-slot `slot`: the fused kernel (launch(o rows, lse rows)) or the
        post-A2A kernels (launch(o rows)) of FA4's O rows."""
        from cute_kernels.a2a import post_a2a_launcher

        if slot not in self.per_slot:
            lay, plan, o = self.plan.layout, self.plan, self.o_like
            seq, joint = slice(0, lay.seq_pad), slice(lay.seq_pad, None)
            if self.fused:
                from cute_kernels.fa4 import fa4_a2a_keeping_launcher

                q, k, v = plan.dq[self.rank], plan.dk[self.rank], plan.dv[self.rank]
                steps = [(fa4_a2a_keeping_launcher(q[:, seq], k, v, plan.slot_window(slot), self.rank, o[:, seq],
                                                   self.lse_like[:, :, seq], causal=self.causal,
                                                   softmax_scale=self.scale, seqused_k=self.seqused,
                                                   o_store=self.o_store), seq)]
            else:
                steps = [(post_a2a_launcher(o[:, seq], plan.slot_window(slot), self.rank), seq)]
            if lay.joint_len:
                steps.append((post_a2a_launcher(o[:, joint], plan.jout_w, self.rank, broadcast=True), joint))
            self.per_slot[slot] = steps
        return self.per_slot[slot]

    def __call__(self, slot: int = 0) -> None:
        o, lse = torch.empty_like(self.o_like), torch.empty_like(self.lse_like)
        steps = self._steps(slot)
        if self.fused:
            (keeping, seq), *posts = steps
            keeping(o[:, seq], lse[:, :, seq])
        else:
            posts = steps
        if self.fa4 is not None:
            rows = self.fa4_rows
            self.fa4(o[:, rows], lse[:, :, rows])
        qkv = self.qkv.clone()
        self.saved = Saved(*[qkv[at:at + n].view(shape) for at, n, shape in self.parts], o, lse)
        for launch, rows in posts:
            launch(o[:, rows])

    def take(self) -> Saved:
        saved, self.saved = self.saved, None
        return saved

    @property
    def closed(self) -> bool:
        return self.plan.transport.closed


_grad_attends: dict = {}  # (plan, rank, causal, scale, impl, o_store, pace) -> _GradAttend


def _keeps_fused(p: Problem, plan, rank: int) -> bool:
    """Whether the forward with grad of p runs the fused kernel that keeps O and LSE (SM90, impl "fused",
    its stores unpaced: the paced kernel has no LSE path) rather than FA4 + the post-A2A."""
    device = plan.transport.device
    return (p.impl == "fused" and device.type == "cuda" and _capability_of(device) == (9, 0)
            and plan.pacer(rank, p.causal, p.pace) is None)


def _grad_attend(plan, rank: int, p: Problem) -> _GradAttend:
    """Built once per (plan, rank, causal, scale, impl, o_store, pace) (fa_a2a.engine.forward.prepared_call);
    the ranks line up after the first build (its compiles), as WindowPlan.attend_launch does."""
    from .forward import prepared_call

    def build():
        fused = _keeps_fused(p, plan, rank)
        attend = _GradAttend(plan, rank, p.causal, p.scale, fused, p.o_store if fused else None)
        plan.transport.host_barrier()
        return attend

    return prepared_call(_grad_attends, (plan, rank, p.causal, p.scale, p.impl, p.o_store, p.pace), build)


def _kernel_forward(p: Problem, q, k, v, joint, group, rank: int) -> tuple:
    """serial / fused on real ranks: -> (out, joint out or None, Saved)."""
    from ulysses.transport import get_transport

    from .forward import window_plan

    plan = window_plan(get_transport(group), p.layout, p.batch, p.head_dim, p.dtype)
    attend = _grad_attend(plan, rank, p)
    lay, rows = p.layout, q.shape[1]
    plan.pre(rank, *(_padded(lay, rank, x) for x in (q, k, v)), joint)
    out, jout = plan.complete(rank, rows, attend)
    return out, jout, attend.take()


def _decided(p: Problem, q, k, v, joint, group, rank: int) -> Problem:
    """impl "auto" decided as the forward decides it (fa_a2a.engine.forward)."""
    if p.impl != "auto" or p.world_size == 1:
        return p
    from .forward import _auto_problem

    return _auto_problem(p, q, k, v, joint, group, rank)


def forward_saving(p: Problem, q, k, v, joint, group, rank: int) -> tuple:
    """One rank's forward that keeps what its backward reads -> (out, joint out or None, Saved, the
    backward's Spec: impl "auto" decided, fused or not, the call's number: forward_call)."""
    from .forward import _deliver

    p = _decided(p, q, k, v, joint, group, rank)
    spec = spec_of(p, q.device)
    if p.world_size > 1 and p.impl in KERNEL_IMPLS:
        out, jout, saved = _kernel_forward(p, q, k, v, joint, group, rank)
    else:
        lay, rows = p.layout, q.shape[1]
        padded = [_padded(lay, rank, x) for x in (q, k, v)]
        [(res, saved)] = _collective_forward(spec, [rank], *([x] for x in padded), joint,
                                             _exchanger(group if p.world_size > 1 else None))
        out, jout = _deliver(lay, rank, res, rows)
    return out, jout, saved, spec, forward_call(group) if p.world_size > 1 else 0


def forward_call(group) -> int:
    """The number of the forward call that just ran on the group: the count of the group channel's exchanges,
    the same on every rank (every rank agrees the same calls in the same order). The call's backward carries
    it (its autograd node's ctx, or the traced op's saved outputs) and agrees it: two calls of one signature
    whose backwards run in another order on each rank move the same bytes, and would give each rank the
    other call's gradients. Carried with the node, not looked up by a saved tensor's address: saved-tensor
    hooks (activation offloading, torch.autograd.graph.save_on_cpu) hand the backward copies. Under
    reentrant activation checkpointing the forward runs again in the backward's order and gets a new
    number there: a misorder between ranks is then not seen (non-reentrant checkpointing keeps the node)."""
    from ulysses.channel import get_channel

    return get_channel(group).calls


def _kernel_forward_emulated(p: Problem, qs, ks, vs, joint, rows) -> tuple:
    """serial / fused on P emulated ranks (padded, zeroed shards) -> ([(out, joint out)] per rank, [Saved])."""
    from .forward import emulated_transport, window_plan

    lay, P = p.layout, p.world_size
    transport = emulated_transport(P, qs[0].device)
    plan = window_plan(transport, lay, p.batch, p.head_dim, p.dtype)
    attends = [_grad_attend(plan, r, p) for r in range(P)]
    for r in range(P):
        plan.pre(r, qs[r], ks[r], vs[r], joint)
    slot = plan.choose_slot()
    transport.barrier()
    for attend in attends:
        attend(slot)
    transport.barrier()
    return [plan.finish(r, rows[r], slot=slot) for r in range(P)], [a.take() for a in attends]


def forward_emulated_saving(p: Problem, qs, ks, vs, joint) -> tuple:
    """All P emulated ranks -> (outs, joint outs or None, [Saved] per rank, the backward's Spec)."""
    from .forward import _auto_problem_emulated, _deliver

    if p.impl == "auto":
        p = _auto_problem_emulated(p, qs, ks, vs, joint)
    lay, P = p.layout, p.world_size
    spec = spec_of(p, qs[0].device)
    rows = [q.shape[1] for q in qs]
    qs, ks, vs = ([_padded(lay, r, x) for r, x in enumerate(xs)] for xs in (qs, ks, vs))
    if p.impl in KERNEL_IMPLS:
        done, saved = _kernel_forward_emulated(p, qs, ks, vs, joint, rows)
    else:
        results = _collective_forward(spec, range(P), qs, ks, vs, joint, _transpose)
        done = [_deliver(lay, r, res, rows[r]) for r, (res, _) in enumerate(results)]
        saved = [s for _, s in results]
    return [o for o, _ in done], (None if joint is None else [j for _, j in done]), saved, spec


# ---- the backward -------------------------------------------------------------------------------------
def _agree_backward(spec: Spec, saved: Saved, group, refusal: Optional[str] = None, call: int = 0) -> None:
    """Every real rank's backward of a call agrees like a forward (problem.agree_call): its shapes
    (the layout's, and the saved q's batch, head dim and dtype), the forward call it belongs to
    (`call`, forward_call: two calls whose backwards run in another order on each rank must not meet in
    exchanges), its path (fused or the exchanges: they meet in different collectives) and FA4's
    deterministic mode (the fused backward's first build lines the ranks up per mode)."""
    from ulysses.channel import WORD_BITS

    from .problem import agree_call, signature_word

    deterministic = torch.are_deterministic_algorithms_enabled()
    B, _, _, D = saved.q.shape
    key = (spec, group.group_name, deterministic, B, D, saved.q.dtype)
    entry = _backward_words.get(key)
    if entry is None:
        lay = spec.layout
        fields = dict(entry="ulysses_attention (backward)", group=group.group_name, world_size=lay.world_size,
                      seq_len=lay.seq_len, shard_rows=lay.shard_rows, batch=B, num_heads=lay.num_heads,
                      num_kv_heads=lay.num_kv_heads, head_dim=D, dtype=str(saved.q.dtype).replace("torch.", ""),
                      joint_len=lay.joint_len, causal=spec.causal,
                      softmax_scale=spec.scale, impl=("exchange backward" if not spec.fused else "fused backward"
                                                      + (", per-thread dK/dV stores" if spec.dkv_store else "")),
                      deterministic=deterministic)
        entry = _backward_words[key] = (fields, signature_word(fields))
    fields, word = entry
    word = ((word ^ (call * 0x9E3779B97F4A7C15)) & ((1 << WORD_BITS) - 1)) or 1  # (signature words are never 0)
    agree_call(dict(fields, forward_call=call), word, refusal, group)


_backward_words: dict = {}


# ---- the fused backward (fused_backward_applies) ------------------------------------------------------
def _no_heads(w: torch.Tensor) -> torch.Tensor:
    """In-windows w [P, B, N, h, D] with no heads: the pre-A2A kernel launches no block for them. A single
    batch gets B stride 0, the contiguous pattern after an empty dim: a DLPack export that normalizes the
    strides of size-1 dims where they break that pattern would also set the empty dim's stride to 1,
    which the kernel's 16-byte stride check refuses."""
    P, B, N, _, D = w.shape
    st = w.stride()
    return w.as_strided((P, B, N, 0, D), (st[0], 0 if B == 1 else st[1], st[2], st[3], st[4]), w.storage_offset())


class _FusedRank:
    """One rank's fused backward on one window plan, built once: dO's pre-A2A into the plan's q
    in-windows (the forward's; free once the forward's attention copied them out), and the gradient
    windows [P, B, S_loc, P * h, D] the backward kernels store into (h = H_loc for dq, H_kv_loc for dk,
    dv). The backward kernels themselves are bound per call (launcher): they read that call's saved
    tensors."""

    def __init__(self, plan, rank: int):
        from cute_kernels.a2a import pre_a2a_launcher

        lay, t = plan.layout, plan.transport
        self.plan, self.rank = plan, rank
        # the pre-A2A kernel's q part alone: its k, v windows (and head map) get no heads, so it launches
        # no block for them (the sources it is handed there are never read)
        none = [_no_heads(w) for w in (plan.dk, plan.dv)]
        self._pre = pre_a2a_launcher(plan.dq, *none, plan.q_map, plan.kv_map.narrow(0, 0, 0), rank, lay.seq_len,
                                     plan.key_rows[rank], False)
        self.dout = plan.dq[rank]  # [B, N, H_loc, D], N = S_pad + J: dO of the rank's heads
        B, S, D, P = plan.B, lay.seq_loc, plan.D, lay.world_size
        # the gradient windows: sets of (dq, dk, dv), delivered as the forward delivers its output (a set's
        # grads lent out as they are where every rank has it free; set 0 is copied out)
        kv_shape = (B, S, P * lay.kv_heads_loc, D)
        self.sets = plan.slots((("ulysses.dq", (B, S, lay.heads_pad, D)), ("ulysses.dk", kv_shape),
                                ("ulysses.dv", kv_shape)))  # one for the process's ranks
        # joint rows: djout_w[d][s] = rank s's joint-output grads of rank d's heads (summed on rank d)
        self.djout_w = (t.windows("ulysses.djout", (P, B, lay.joint_len, lay.heads_loc, D), plan.dtype)
                        if lay.joint_len else None)
        self._joint_grads = None  # this call's (djq, djk, djv) heads-layout joint rows (launcher)
        self._kv_in_order = _each_head_once(lay.kv_head_index, lay.num_kv_heads)
        self._built: set = set()
        self._dout_key = None  # the projected dO stage (project_dout), built at its first call

    @property
    def closed(self) -> bool:
        return self.plan.transport.closed

    def pre(self, dout, djout=None) -> None:
        """Launch the pre-A2A of this rank's dO [B, S_loc, H, D] (padding rows zero) into every rank's dO
        window; with joint rows, this rank's joint-output grads djout [B, J, H, D] of each rank's heads into
        that rank's djout window (its slot self.rank)."""
        from .forward import contiguous16

        dout = contiguous16(dout)
        self._pre(dout, dout, dout, None)
        if self.djout_w is not None:  # one copy into every rank's slot: rank d's heads are d * H_loc .. (+ H_loc)
            lay = self.plan.layout
            B, J, H, D = djout.shape
            if H < lay.heads_pad:  # the padding heads' grads: zero
                djout = torch.nn.functional.pad(djout, (0, 0, 0, lay.heads_pad - H))
            heads = djout.reshape(B, J, lay.world_size, lay.heads_loc, D).permute(2, 0, 1, 3, 4)
            self.djout_w[:, self.rank].copy_(heads)

    def joint_dout(self) -> None:
        """After the barrier (every rank's djout slot written): dO's joint rows of this rank's heads, the ranks'
        joint-output grads summed as the exchange backward sums them (_sum_ranks, the ranks in order)."""
        if self.djout_w is not None:
            self.dout[:, self.plan.layout.seq_pad:].copy_(_sum_ranks(self.djout_w[self.rank]))

    def project_dout(self, dy, weight) -> None:
        """Launch dO = dy @ weight (the attention's output projection y = o @ weight^T + b: its input
        gradient) for this rank's rows dy [B, rows, C_out] with the pre-A2A in the GEMM's epilogue, into
        every rank's dO window: the QKV projection's kernel (cute_kernels.qkv_a2a_sm90) with the q part
        alone. Its weight rows in destination order are weight^T [H * D, C_out] read in place (an N-major
        B operand, qkv_a2a_sm90.weight_major) where every head is real; with padding heads, weight^T is
        copied each call into [H_pad * D, C_out] rows whose padding heads' rows are zero. The layout's
        padding rows get zero stand-in rows, as pre() does."""
        from cute_kernels.qkv_a2a_sm90 import weight_major

        from .projection import _Projection

        dy = dy.contiguous()
        lay, D = self.plan.layout, self.plan.D
        rows = weight.t()
        in_place = lay.heads_pad == lay.num_heads and weight_major(rows) == "n"
        key = (tuple(dy.shape), dy.dtype, tuple(weight.shape), in_place)
        if self._dout_key != key:
            if not in_place:
                self._weight_t = weight.new_zeros(lay.heads_pad * D, weight.shape[0])
            proj = self._dout_weights = self._dout_rows(rows if in_place else self._weight_t)
            self._dout_proj = _Projection((self.plan.dq, None, None), lay, self.rank, [(dy, proj, None)], config=None)
            self._dout_key = key
        if in_place:
            kept = self._dout_weights.weight
            if kept.data_ptr() != rows.data_ptr() or kept.stride() != rows.stride():  # another weight, same shape
                self._dout_weights = self._dout_rows(rows)
        else:
            self._weight_t[:weight.shape[1]].copy_(rows)
        self._dout_proj([(dy, self._dout_weights, None)])

    def _dout_rows(self, rows):
        from cute_kernels.qkv_a2a_sm90 import QKVWeights

        lay = self.plan.layout
        return QKVWeights(rows, None, None, lay.world_size, lay.heads_loc, 0, self.plan.D)

    def launcher(self, spec: Spec, s: Saved, deterministic: bool, j: int = 0):
        """FA4's fused backward of this call (saved tensors s) into gradient set j (Slots.choose), checked and
        bound; compiled at its first build, after which the ranks line up on the host (as the forward's
        attention launch does)."""
        from cute_kernels.fa4_bwd_a2a import fa4_bwd_a2a_launcher

        joint = None
        if self.djout_w is not None:  # the joint rows' grads stay here: fresh tensors of this call
            seq_pad = self.plan.layout.seq_pad
            joint = self._joint_grads = tuple(torch.empty_like(t[:, seq_pad:]) for t in (s.q, s.k, s.v))
        launch = fa4_bwd_a2a_launcher(s.q, s.k, s.v, s.o, self.dout, s.lse, *self.sets.windows(j),
                                      self.rank, causal=spec.causal, softmax_scale=spec.scale,
                                      seqused_k=None if spec.causal else self.plan.seqused,
                                      deterministic=deterministic, joint=joint, dkv_store=spec.dkv_store)
        key = (spec.causal, spec.scale, deterministic, spec.dkv_store)
        if key not in self._built:
            self._built.add(key)
            self.plan.transport.host_barrier()
        return launch

    def grads(self, rows: int, j: int = 0) -> tuple:
        """(dq, dk, dv) [B, rows, ., D] of this rank out of its own windows of gradient set j: lent as they are
        where j > 0 and they are contiguous, else copies (the peers store into set 0 again at the next call);
        rows >= valid_rows zero (dk, dv rows >= seqused_k are not written by the kernels); then the joint
        grads (as the exchange backward gives them) or 3 x None."""
        lay, r = self.plan.layout, self.rank
        dq_w, dk_w, dv_w = self.sets.windows(j)
        self.sets.delivered(j, dq_w.device)
        dq = self.sets.lend_or_copy(j, dq_w[r][:, :rows, :lay.num_heads])
        if self._kv_in_order:  # each KV head once, in order (no GQA head sent twice): the rank's rows as they
            # are, not a head-sum (torch.cat of the P parts: 54 us per tensor at P 2, S_loc 4096, 24 heads,
            # H100, 2026-12-05, a strided gather)
            dk, dv = (self.sets.lend_or_copy(j, w[r][:, :rows]) for w in (dk_w, dv_w))
        else:
            hk = lay.kv_heads_loc
            dk, dv = (_sum_heads(list(w[r][:, :rows].split(hk, dim=2)), lay.kv_head_index, lay.num_kv_heads)
                      for w in (dk_w, dv_w))
        n = lay.valid_rows(r)
        for g in (dq, dk, dv):
            if n < rows:
                g[:, n:] = 0
        joint = (None,) * 3
        if self.djout_w is not None:
            joint, self._joint_grads = _joint_grads(lay, r, self._joint_grads), None
        return (dq, dk, dv) + joint


_fused_ranks: dict = {}  # (plan, rank) -> _FusedRank


def _fused_rank(plan, rank: int) -> _FusedRank:
    from .forward import prepared_call

    return prepared_call(_fused_ranks, (plan, rank), lambda: _FusedRank(plan, rank))


def _fused_backward(spec: Spec, ranks, saved, douts, djouts, rows, group, project=None) -> list:
    """The fused backward of these local ranks' calls (group: the real ranks' group; None: P emulated ranks) -> per
    rank (dq, dk, dv, djq, djk, djv; None without joint rows). The kernels are bound (compiled at the first call)
    before the first barrier; then every local rank's dO pre-A2A -> barrier (every dO row of every rank's heads is
    in its window) -> every local rank's backward -> barrier (every gradient row is in its owner's window) -> each
    rank's grads lent or copied out of its own windows of the gradient set the ranks chose first (Slots).
    project = (weight, dys): douts are None and each rank's dO comes from the output projection's input-gradient
    GEMM of dys[i] instead of the pre-A2A (_FusedRank.project_dout).
    With joint rows every rank also sends its joint-output grads of each rank's heads (pre), and after the first
    barrier each rank sums those of its heads into dO's joint rows (joint_dout) before its backward; the joint grads
    stay on the rank (the kernels' joint tensors)."""
    from .forward import emulated_transport, window_plan

    lay, s0 = spec.layout, saved[0]
    if group is None:
        transport = emulated_transport(lay.world_size, s0.q.device)
    else:
        from ulysses.transport import get_transport

        transport = get_transport(group)
    B, _, _, D = s0.q.shape
    plan = window_plan(transport, lay, B, D, s0.q.dtype)
    deterministic = torch.are_deterministic_algorithms_enabled()
    fused = [_fused_rank(plan, r) for r in ranks]
    j = fused[0].sets.choose()  # the gradient set every rank has free, else 0 (the ranks here share the Slots)
    launches = [f.launcher(spec, s, deterministic, j) for f, s in zip(fused, saved)]
    if project is not None and _capability_of(s0.q.device) != (9, 0):
        # the projection's GEMM with the pre-A2A epilogue is SM90's (quack): dO in torch, then the pre-A2A
        douts, project = _projected_douts(lay, *project), None
    if project is None:
        for f, r, do, djo in zip(fused, ranks, douts, djouts):
            f.pre(_padded(lay, r, do), djo)
    else:
        weight, dys = project
        for f, dy in zip(fused, dys):
            f.project_dout(dy, weight)
    transport.barrier()
    for f, launch in zip(fused, launches):
        f.joint_dout()
        launch()
    transport.barrier()
    return [f.grads(n, j) for f, n in zip(fused, rows)]


def _projected_douts(lay, weight, dys) -> list:
    """Each rank's dO [B, rows, H, D] = dys[i] @ weight (the output projection's input gradient) in torch."""
    return [(dy @ weight).unflatten(-1, (lay.num_heads, -1)) for dy in dys]


def backward(spec: Spec, ranks, saved, douts, djouts, rows, group=None, project=None, refusal=None,
             call: int = 0) -> list:
    """The backward of these local ranks' calls (group: the real ranks' group, None for P = 1 or
    emulated ranks) -> per rank (dq, dk, dv, djq, djk, djv), joint grads None without joint rows.
    spec.fused: the fused backward (no torch.distributed collective); else FA4's (or the reference's)
    backward between two exchanges. project = (weight, dys) in place of douts: each rank's dO is
    dys[i] @ weight (the output projection's input gradient), which the fused backward's dO stage
    computes itself (_FusedRank.project_dout), the exchanges' in torch. refusal: a ValueError message
    this rank's backward must raise (SECOND_ORDER), on every rank alike. call: the forward call's number
    (forward_call; real ranks)."""
    lay = spec.layout
    if group is not None:
        _agree_backward(spec, saved[0], group, refusal, call)
    elif refusal is not None:
        raise ValueError(refusal)
    if spec.fused:
        return _fused_backward(spec, ranks, saved, douts, djouts, rows, group, project)
    if project is not None:
        douts = _projected_douts(lay, *project)
    exchange = _exchanger(group)
    recvs = exchange([_dout_sends(lay, r, do, djo) for r, do, djo in zip(ranks, douts, djouts)])
    grads = [_attention_backward(spec, s, _heads_dout(lay, recv)) for s, recv in zip(saved, recvs)]
    packs = [_grad_sends(lay, *g) for g in grads]
    recvs = exchange([sends for sends, _ in packs])
    return [_shard_grads(lay, r, recv, n) + (_joint_grads(lay, r, jp) if lay.joint_len else (None,) * 3)
            for r, recv, n, (_, jp) in zip(ranks, recvs, rows, packs)]


# ---- autograd: eager (autograd.Function) ----------------------------------------------------------------
class _Call(NamedTuple):
    problem: Problem
    group: object
    rank: int


SECOND_ORDER = ("create_graph: fa_a2a's attention has no double backward (its gradients cannot be differentiated "
                "again); run this backward without create_graph=True")


def _first_order(backward_fn):
    """A backward refused under create_graph=True (grad mode on in the backward), on every rank alike
    (backward(refusal=...): the backward's agreement carries it). Its gradients would have no second-order
    term: once_differentiable returns constants from a constant dO (loss = out.sum()), and torch's
    DelayedError on detached outputs raised only for a later .backward() over every node, never for
    autograd.grad(..., inputs) or autograd.functional.hessian, which skip it (a gradient penalty's weight
    gradient, the Hessian, silently without the attention's term)."""

    @functools.wraps(backward_fn)
    def wrapper(ctx, *grads):
        ctx.refusal = SECOND_ORDER if torch.is_grad_enabled() else None
        with torch.no_grad():
            return backward_fn(ctx, *grads)

    return wrapper


class _UlyssesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, jq, jk, jv):
        joint = None if jq is None else (jq, jk, jv)
        out, jout, saved, spec, number = forward_saving(call.problem, q, k, v, joint, call.group, call.rank)
        ctx.spec, ctx.group, ctx.rank, ctx.rows, ctx.call = spec, call.group, call.rank, q.shape[1], number
        ctx.has_joint = joint is not None
        ctx.save_for_backward(*saved)
        return _own(out), _own(jout)

    @staticmethod
    @_first_order
    def backward(ctx, dout, djout):
        group = ctx.group if ctx.spec.layout.world_size > 1 else None
        [grads] = backward(ctx.spec, [ctx.rank], [Saved(*ctx.saved_tensors)], [dout], [djout], [ctx.rows], group,
                           refusal=ctx.refusal, call=ctx.call)
        return (None, *grads[:3], *(grads[3:] if ctx.has_joint else (None,) * 3))


def attention_with_grad(p: Problem, q, k, v, joint, group, rank: int) -> tuple:
    """ulysses_attention's eager call with grad: (out, joint out or None), differentiable."""
    jq, jk, jv = joint if joint is not None else (None, None, None)
    return _UlyssesFunction.apply(_Call(p, group, rank), q, k, v, jq, jk, jv)


class _EmulatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: Problem, *tensors):
        P = p.world_size
        qs, ks, vs = tensors[:P], tensors[P:2 * P], tensors[2 * P:3 * P]
        joint = tuple(tensors[3 * P:]) or None
        outs, jouts, saved, spec = forward_emulated_saving(p, qs, ks, vs, joint)
        ctx.spec, ctx.rows, ctx.n_saved = spec, [q.shape[1] for q in qs], len(saved[0])
        ctx.save_for_backward(*(t for s in saved for t in s))
        return tuple(_own(t) for t in (*outs, *(jouts or ())))

    @staticmethod
    @_first_order
    def backward(ctx, *grads):
        spec, P = ctx.spec, ctx.spec.layout.world_size
        flat, n = ctx.saved_tensors, ctx.n_saved
        saved = [Saved(*flat[r * n:(r + 1) * n]) for r in range(P)]
        djouts = grads[P:] if spec.layout.joint_len else [None] * P
        res = backward(spec, range(P), saved, grads[:P], djouts, ctx.rows, refusal=ctx.refusal)
        per_input = [[g[i] for g in res] for i in range(3)]
        joint = [_sum_ranks([g[i] for g in res]) for i in range(3, 6)] if spec.layout.joint_len else []
        return (None, *per_input[0], *per_input[1], *per_input[2], *joint)


def attention_emulated_with_grad(p: Problem, qs, ks, vs, joint) -> tuple:
    """ulysses_attention_emulated with grad: (outs, joint outs or None), differentiable."""
    P = p.world_size
    res = _EmulatedFunction.apply(p, *qs, *ks, *vs, *(joint or ()))
    return list(res[:P]), (list(res[P:]) if joint is not None else None)


# ---- the attention with its output projection (eager) ---------------------------------------------------
class _Projected(NamedTuple):
    problem: Problem
    group: object
    rank: Optional[int]  # None: the problem's P emulated ranks


def _rows(parts) -> torch.Tensor:
    """The local ranks' rows stacked: a real rank's one part as it is (torch.cat copies even one part;
    the two cats of the weight gradient took 49 us per call at emulated P 2, M 8192, C_out 3072, H200)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _ProjectedFunction(torch.autograd.Function):
    """Per local rank y = o.flatten(2) @ weight^T + bias after the op's call(s) (no joint rows). The
    backward: weight's and bias's grads summed over the local ranks' rows (a real rank: its own rows'
    part, as nn.Linear on sharded rows gives), then the attention's backward with dO = dy @ weight: in
    the fused backward the GEMM's epilogue stores it to its owners (_FusedRank.project_dout), else
    dO in torch and the backward's own dO exchange."""

    @staticmethod
    def forward(ctx, call: _Projected, weight, bias, *tensors):
        n = len(tensors) // 3
        qs, ks, vs = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        number = 0
        if call.rank is None:
            outs, _, saved, spec = forward_emulated_saving(call.problem, qs, ks, vs, None)
            ranks, group = list(range(n)), None
        else:
            out, _, one, spec, number = forward_saving(call.problem, qs[0], ks[0], vs[0], None, call.group,
                                                       call.rank)
            outs, saved, ranks = [out], [one], [call.rank]
            group = call.group if spec.layout.world_size > 1 else None
        ctx.spec, ctx.ranks, ctx.group, ctx.n_saved, ctx.call = spec, ranks, group, len(saved[0]), number
        ctx.rows, ctx.has_bias = [q.shape[1] for q in qs], bias is not None
        ctx.save_for_backward(weight, *outs, *(t for one in saved for t in one))
        return tuple(torch.nn.functional.linear(o.flatten(2), weight, bias) for o in outs)

    @staticmethod
    @_first_order
    def backward(ctx, *dys):
        weight, *rest = ctx.saved_tensors
        n = len(ctx.ranks)
        outs, flat = rest[:n], rest[n:]
        saved = [Saved(*flat[i * ctx.n_saved:(i + 1) * ctx.n_saved]) for i in range(n)]
        dys = [dy.contiguous() for dy in dys]
        dweight = dbias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # nn.Linear's backward on all local rows
            dy_rows = _rows([dy.flatten(0, 1) for dy in dys])
            if ctx.needs_input_grad[1]:
                dweight = dy_rows.t() @ _rows([o.flatten(0, 1).flatten(1) for o in outs])
            if ctx.has_bias and ctx.needs_input_grad[2]:
                dbias = dy_rows.sum(0)
        res = backward(ctx.spec, ctx.ranks, saved, [None] * n, [None] * n, ctx.rows, ctx.group, project=(weight, dys),
                       refusal=ctx.refusal, call=ctx.call)
        return (None, dweight, dbias, *(g[i] for i in range(3) for g in res))


def projected_with_grad(p: Problem, qs, ks, vs, weight, bias, group, rank: Optional[int]) -> list:
    """The op's call(s) on these local ranks' inputs (rank None: the P emulated ranks) followed by the
    output projection, differentiable (_ProjectedFunction) -> one [B, rows, C_out] per local rank."""
    return list(_ProjectedFunction.apply(_Projected(p, group, rank), weight, bias, *qs, *ks, *vs))


# ---- autograd under torch.compile: functional custom ops ---------------------------------------------
def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _call_words(impl: str, causal: bool, softmax_scale, seq_len, shard_rows, pace: str) -> str:
    """The traced call's arguments (as the op was given them) in one string: part of _traced_paths' key."""
    return repr((impl, causal, softmax_scale, seq_len, None if shard_rows is None else list(shard_rows), pace))


def _traced_key(group_name: str, words: str, q_shape, num_kv_heads: int, joint_len: int, dtype, device) -> tuple:
    return (group_name, words, tuple(q_shape), num_kv_heads, joint_len, dtype, device)


# whether the backward of a traced call is fused, by its signature (_traced_key): set by the forward op
# when it runs (impl "auto" is decided there, once per signature and alike on every rank), read by the
# backward op, whose arguments are fixed when the graph is traced
_traced_paths: dict = {}


def _apart(saved: Saved) -> list:
    """The saved tensors as a custom op may return them, none on another's storage: the kernel paths save
    q, k, v as views of one copy (_GradAttend), so k, v get copies of their own here (on this traced path
    only). Storages compared, not _base: below autograd, where a custom op runs, a view has no _base."""
    seen, apart = set(), []
    for t in saved:
        if t is not None and t.numel():
            at = t.untyped_storage().data_ptr()
            t = t.clone() if at in seen else t
            seen.add(at)
        apart.append(t)
    return apart


# The traced ops' names carry their schema's version: torch's compiled-graph caches on disk (inductor's FX graph
# cache) know an op by its name, so a graph cached against an older schema of the same name runs against the new
# one (seen 2026-12-06 when the call's number joined the forward op's outputs: "Expected a value of type 'Tensor'
# for argument 'call'"). Bump it with every change of either op's arguments or outputs.
_TRACED_OPS_VERSION = 2
_GRAD_OP = f"fa_a2a::ulysses_attention_grad_v{_TRACED_OPS_VERSION}"
_GRAD_BACKWARD_OP = f"fa_a2a::ulysses_attention_grad_backward_v{_TRACED_OPS_VERSION}"


@torch.library.custom_op(_GRAD_OP, mutates_args=())
def _grad_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint_q: Optional[torch.Tensor],
    joint_k: Optional[torch.Tensor], joint_v: Optional[torch.Tensor], group_name: str, impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int], shard_rows: Optional[list[int]], pace: str,
) -> list[torch.Tensor]:
    """-> [out, joint out ([B, 0, H, D] without joint), then Saved's q, k, v, o, lse (empty where None), the call's
    number (forward_call) as an int64 [1] CPU tensor]."""
    from .pacing import decode_pace
    from .problem import resolve

    key_name = group_name  # the backward op's key names the group as the call did
    group, group_name, P, rank = group_by_name(group_name)
    joint = (joint_q, joint_k, joint_v) if joint_q is not None else None
    problem, joint = resolve(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size=P,
                             rank=rank, group=group, group_name=group_name, pace=decode_pace(pace), grad=True)
    out, jout, saved, spec, number = forward_saving(problem, q, k, v, joint, group, rank)
    words = _call_words(impl, causal, softmax_scale, seq_len, shard_rows, pace)
    key = _traced_key(key_name, words, q.shape, k.shape[2], problem.layout.joint_len, q.dtype, q.device)
    _traced_paths[key] = (spec.fused, spec.dkv_store)
    if jout is None:
        jout = out.new_empty(out.shape[0], 0, out.shape[2], out.shape[3])
    return [out, jout, *(_empty(q) if t is None else t for t in _apart(saved)), torch.tensor([number])]


@_grad_op.register_fake
def _(q, k, v, joint_q, joint_k, joint_v, group_name, impl, causal, softmax_scale, seq_len, shard_rows, pace):
    from .problem import check_call

    _, _, P, rank = group_by_name(group_name)
    joint = (joint_q, joint_k, joint_v) if joint_q is not None else None
    problem, _ = check_call(q, k, v, joint, impl, causal, softmax_scale, seq_len, P, shard_rows, rank)
    lay, (B, _, H, D) = problem.layout, q.shape
    N, J = lay.num_rows, lay.joint_len
    heads = [q.new_empty(B, N, h, D) for h in (lay.heads_loc, lay.kv_heads_loc, lay.kv_heads_loc)]
    if spec_of(problem).fa4:
        rest = [q.new_empty(B, N, lay.heads_loc, D), q.new_empty(B, lay.heads_loc, N, dtype=torch.float32)]
    else:
        rest = [_empty(q), _empty(q)]
    return [torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, J, H, D), *heads, *rest,
            torch.empty(1, dtype=torch.int64)]


def _layout_of(group_name: str, rows: int, H: int, H_kv: int, J: int, seq_len, shard_rows):
    """The call's layout again, as check_call built it (rows: this rank's q rows)."""
    _, _, P, rank = group_by_name(group_name)
    if shard_rows is not None:
        return UlyssesLayout.from_shard_rows(shard_rows, H, H_kv, P, joint_len=J), P, rank
    return UlyssesLayout.from_shard(rows, H, H_kv, P, seq_len=seq_len, joint_len=J), P, rank


@torch.library.custom_op(_GRAD_BACKWARD_OP, mutates_args=())
def _grad_backward_op(
    dout: torch.Tensor, djout: torch.Tensor, q_heads: torch.Tensor, k_heads: torch.Tensor, v_heads: torch.Tensor,
    o_heads: torch.Tensor, lse: torch.Tensor, call: torch.Tensor, group_name: str, causal: bool, softmax_scale: float,
    fa4: bool, num_kv_heads: int, seq_len: Optional[int], shard_rows: Optional[list[int]], words: str,
) -> list[torch.Tensor]:
    """-> [dq, dk, dv, djq, djk, djv] (joint grads [B, 0, ., D] without joint rows). call: the forward op's
    number of the call (forward_call). words: the call's _call_words (its backward is fused where the forward
    op's run said so)."""
    B, rows, H, D = dout.shape
    lay, P, rank = _layout_of(group_name, rows, H, num_kv_heads, djout.shape[1], seq_len, shard_rows)
    group, _, _, _ = group_by_name(group_name)
    key = _traced_key(group_name, words, dout.shape, num_kv_heads, djout.shape[1], dout.dtype, dout.device)
    spec = Spec(lay, causal, softmax_scale, fa4, *_traced_paths.get(key, (False, None)))
    saved = Saved(q_heads, k_heads, v_heads, o_heads if fa4 else None, lse if fa4 else None)
    [grads] = backward(spec, [rank], [saved], [dout], [djout], [rows], group if P > 1 else None,
                       call=int(call.item()))
    if not lay.joint_len:
        grads = grads[:3] + (dout.new_empty(B, 0, H, D), dout.new_empty(B, 0, num_kv_heads, D),
                             dout.new_empty(B, 0, num_kv_heads, D))
    return [g.contiguous() for g in grads]


@_grad_backward_op.register_fake
def _(dout, djout, q_heads, k_heads, v_heads, o_heads, lse, call, group_name, causal, softmax_scale, fa4, num_kv_heads,
      seq_len, shard_rows, words):
    B, rows, H, D = dout.shape
    J = djout.shape[1]
    return [dout.new_empty(B, rows, H, D), dout.new_empty(B, rows, num_kv_heads, D),
            dout.new_empty(B, rows, num_kv_heads, D), dout.new_empty(B, J, H, D),
            dout.new_empty(B, J, num_kv_heads, D), dout.new_empty(B, J, num_kv_heads, D)]


def _setup_grad_op(ctx, inputs, output) -> None:
    q, k, v, jq, jk, jv, group_name, impl, causal, softmax_scale, seq_len, shard_rows, pace = inputs
    ctx.save_for_backward(*output[2:])
    ctx.args = (group_name, causal, softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3]),
                q.is_cuda and impl != "reference", k.shape[2], seq_len, shard_rows,
                _call_words(impl, causal, softmax_scale, seq_len, shard_rows, pace))
    ctx.shapes = (tuple(q.shape), tuple(output[1].shape))
    ctx.has_joint = jq is not None


def _grad_op_backward(ctx, grads):
    dout, djout = grads[0], grads[1]
    shape, jshape = ctx.shapes
    saved = ctx.saved_tensors
    dout = dout if dout is not None else saved[0].new_zeros(shape)
    djout = djout if djout is not None else saved[0].new_zeros(jshape)
    dq, dk, dv, djq, djk, djv = _grad_backward_op(dout, djout, *saved, *ctx.args)
    joint = (djq, djk, djv) if ctx.has_joint else (None, None, None)
    return (dq, dk, dv, *joint) + (None,) * 7


torch.library.register_autograd(_GRAD_OP, _grad_op_backward, setup_context=_setup_grad_op)


def traced_attention_with_grad(q, k, v, joint, group_name: str, impl: str, causal: bool, softmax_scale, seq_len,
                               shard_rows, pace: str) -> tuple:
    """ulysses_attention under torch.compile with grad: the differentiable custom op -> (out, joint out or None)."""
    jq, jk, jv = joint if joint is not None else (None, None, None)
    res = _grad_op(q, k, v, jq, jk, jv, group_name, impl, causal, softmax_scale, seq_len,
                   None if shard_rows is None else list(shard_rows), pace)
    return res[0], (res[1] if joint is not None else None)
