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
                              its LSE -> copies of what the backward needs -> post-A2A kernel ->
                              barrier (the serial forward: "fused" runs it too when grad is
                              required, so both give the same gradients bit for bit; the fused
                              kernel does not leave O in the heads layout, which FA4's backward
                              reads). The backward: FA4's backward between two all_to_all_single
                              exchanges over the group. Faster, not done: dO through the pre-A2A
                              kernel into the in-windows and dq/dk/dv through the post-A2A kernel
                              (or FA4's dQ postprocess and dK/dV epilogues storing to the peers).
  impl "auto" decides as the forward does (fa_a2a.engine.forward); its choices all run FA4 on CUDA.
Every rank must run the backward of every call that required grad, in the same order (it is
collective, as the forward is): a rank whose loss does not reach an output still backpropagates
through it (e.g. loss + 0 * out.sum()). Each backward is agreed across ranks like a forward
(fa_a2a.engine.problem.agree_call): ranks whose backwards differ raise the same ValueError, a rank that
never comes makes the others raise TimeoutError (FA_A2A_TIMEOUT_S), never a hang.
FA4's backward accumulates dQ with atomics: its bits vary from run to run unless
torch.use_deterministic_algorithms(True) (then FA4's deterministic mode).

Autograd: eagerly a torch.autograd.Function calls the Python paths below directly (the op's eager
host cost, fa_a2a.op); under torch.compile the public function calls the functional custom op
`fa_a2a::ulysses_attention_grad`, whose backward (torch.library.register_autograd) is the custom
op `fa_a2a::ulysses_attention_grad_backward`. Inputs that do not require grad (or no_grad /
inference_mode) never come here. Double backward is not supported.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ulysses.layout import UlyssesLayout, take_heads
from ulysses.reference import local_attention as reference_attention
from ulysses.reference import local_attention_backward as reference_attention_backward

from .problem import KERNEL_IMPLS, Problem, group_by_name

__all__ = ["Saved", "Spec", "wants_grad", "forward_saving", "forward_emulated_saving", "backward",
           "attention_with_grad", "attention_emulated_with_grad", "traced_attention_with_grad", "saved_bytes"]


class Saved(NamedTuple):
    """One rank's heads-layout tensors the backward reads: q [B, N, H_loc, D], k, v [B, N, H_kv_loc, D]
    (key-row order), and where FA4 ran, o like q and lse [B, H_loc, N] fp32 (None otherwise)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]


class Spec(NamedTuple):
    """What the backward of one call needs besides tensors: fa4 = FA4's backward (else the reference's)."""

    layout: UlyssesLayout
    causal: bool
    scale: float
    fa4: bool


def spec_of(p: Problem) -> Spec:
    return Spec(p.layout, p.causal, p.scale, p.device_type == "cuda" and p.impl != "reference")


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
    out = torch.cat([x[0] for x in recv], dim=2)[:, :, :H]
    return out, (torch.cat([x[1] for x in recv], dim=2)[:, :, :H] if lay.joint_len else None)


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


def _sum_heads(parts, rows, num_heads: int) -> torch.Tensor:
    """Head-sum: parts[i] [B, n, h, D] holds global heads rows[i] -> [B, n, num_heads, D] (sums in fp32)."""
    flat = [h for row in rows for h in row]
    if flat == list(range(num_heads)):  # each head once, in order: a plain split
        return torch.cat(parts, dim=2)
    B, n, _, D = parts[0].shape
    acc = parts[0].new_zeros(B, n, num_heads, D, dtype=torch.promote_types(parts[0].dtype, torch.float32))
    acc.index_add_(2, torch.tensor(flat, device=acc.device), torch.cat(parts, dim=2).to(acc.dtype))
    return acc.to(parts[0].dtype)


def _sum_ranks(parts) -> torch.Tensor:
    """The ranks' joint grads summed (in fp32 at least), in their dtype."""
    return torch.stack(parts).sum(0, dtype=torch.promote_types(parts[0].dtype, torch.float32)).to(parts[0].dtype)


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

        B, N, H, _ = q.shape
        lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        seqused = None if used is None else torch.full((B,), used, dtype=torch.int32, device=q.device)
        q, k, v = (t.contiguous() for t in (q, k, v))
        o = fa4_forward(q, k, v, causal=spec.causal, softmax_scale=spec.scale, seqused_k=seqused, lse=lse)
        return o, Saved(q, k, v, o, lse)
    o = reference_attention(q, k, v, causal=spec.causal, softmax_scale=spec.scale, seqused_k=used).to(q.dtype)
    return o, Saved(q, k, v, None, None)


def _attention_backward(spec: Spec, s: Saved, do) -> tuple:
    """(dq, dk, dv) heads layout; keys beyond seqused_k get zeros."""
    used = spec.layout.seqused_k(spec.causal)
    if spec.fa4:
        from flash_attn.cute.interface import _flash_attn_bwd

        B = s.q.shape[0]
        seqused = None if used is None else torch.full((B,), used, dtype=torch.int32, device=s.q.device)
        dq, dk, dv = _flash_attn_bwd(s.q, s.k, s.v, s.o, do.contiguous(), s.lse, spec.scale, spec.causal,
                                     seqused_k=seqused, deterministic=torch.are_deterministic_algorithms_enabled())
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
    """A rank's serial attention from its in-window for the backward: FA4 with its LSE into scratch,
    copies of q, k, v (the in-window), O and the LSE, then the post-A2A kernel(s) - launched by
    WindowPlan.complete between its two barriers. The copies of the in-window are queued before
    the second barrier: peers' next pre-A2A stores into it once they have passed that barrier."""

    def __init__(self, plan, rank: int, causal: bool, scale: float):
        from cute_kernels.fa4 import fa4_launcher

        lay = plan.layout
        self.plan, self.rank = plan, rank
        self.q, self.k, self.v = plan.dq[rank], plan.dk[rank], plan.dv[rank]
        self.o = plan.scratch("out", rank, lay.num_rows)
        self.lse = torch.empty(plan.B, lay.heads_loc, lay.num_rows, dtype=torch.float32, device=self.o.device)
        self.fa4 = fa4_launcher(self.q, self.k, self.v, self.o, causal=causal, softmax_scale=scale,
                                seqused_k=None if causal else plan.seqused, lse=self.lse)
        self.per_slot: dict = {}
        self.saved: Optional[Saved] = None

    def _post(self, slot: int) -> list:
        from cute_kernels.a2a import post_a2a_launcher

        if slot not in self.per_slot:
            lay, plan = self.plan.layout, self.plan
            steps = [post_a2a_launcher(self.o[:, :lay.seq_pad], plan.slot_window(slot), self.rank)]
            if lay.joint_len:
                steps.append(post_a2a_launcher(self.o[:, lay.seq_pad:], plan.jout_w, self.rank, broadcast=True))
            self.per_slot[slot] = steps
        return self.per_slot[slot]

    def __call__(self, slot: int = 0) -> None:
        self.fa4()
        self.saved = Saved(*(t.clone() for t in (self.q, self.k, self.v, self.o, self.lse)))
        for step in self._post(slot):
            step()

    def take(self) -> Saved:
        saved, self.saved = self.saved, None
        return saved


_grad_attends: dict = {}


def _grad_attend(plan, rank: int, causal: bool, scale: float) -> _GradAttend:
    """Built once per (plan, rank, causal, scale); the ranks line up after the first build (its
    compiles), as WindowPlan.attend_launch does."""
    for stale in [key for key, a in _grad_attends.items() if a.plan.transport.closed]:
        del _grad_attends[stale]
    key = (id(plan), rank, causal, scale)
    attend = _grad_attends.get(key)
    if attend is None or attend.plan is not plan:
        attend = _grad_attends[key] = _GradAttend(plan, rank, causal, scale)
        plan.transport.host_barrier()
    return attend


def _kernel_forward(p: Problem, q, k, v, joint, group, rank: int) -> tuple:
    """serial / fused on real ranks: -> (out, joint out or None, Saved)."""
    from ulysses.transport import get_transport

    from .forward import window_plan

    plan = window_plan(get_transport(group), p.layout, p.batch, p.head_dim, p.dtype)
    attend = _grad_attend(plan, rank, p.causal, p.scale)
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
    """One rank's forward that keeps what its backward reads -> (out, joint out or None, Saved)."""
    from .forward import _deliver

    p = _decided(p, q, k, v, joint, group, rank)
    if p.world_size > 1 and p.impl in KERNEL_IMPLS:
        return _kernel_forward(p, q, k, v, joint, group, rank)
    lay, rows = p.layout, q.shape[1]
    padded = [_padded(lay, rank, x) for x in (q, k, v)]
    [(res, saved)] = _collective_forward(spec_of(p), [rank], *([x] for x in padded), joint,
                                         _exchanger(group if p.world_size > 1 else None))
    out, jout = _deliver(lay, rank, res, rows)
    return out, jout, saved


def forward_emulated_saving(p: Problem, qs, ks, vs, joint) -> tuple:
    """All P emulated ranks -> (outs, joint outs or None, [Saved] per rank)."""
    from .forward import _auto_problem_emulated, _deliver, emulated_transport, window_plan

    if p.impl == "auto":
        p = _auto_problem_emulated(p, qs, ks, vs, joint)
    lay, P = p.layout, p.world_size
    rows = [q.shape[1] for q in qs]
    qs, ks, vs = ([_padded(lay, r, x) for r, x in enumerate(xs)] for xs in (qs, ks, vs))
    if p.impl in KERNEL_IMPLS:
        transport = emulated_transport(P, qs[0].device)
        plan = window_plan(transport, lay, p.batch, p.head_dim, p.dtype)
        attends = [_grad_attend(plan, r, p.causal, p.scale) for r in range(P)]
        for r in range(P):
            plan.pre(r, qs[r], ks[r], vs[r], joint)
        transport.barrier()
        for attend in attends:
            attend()
        transport.barrier()
        done = [plan.finish(r, rows[r]) for r in range(P)]
        saved = [a.take() for a in attends]
    else:
        results = _collective_forward(spec_of(p), range(P), qs, ks, vs, joint, _transpose)
        done = [_deliver(lay, r, res, rows[r]) for r, (res, _) in enumerate(results)]
        saved = [s for _, s in results]
    return [o for o, _ in done], (None if joint is None else [j for _, j in done]), saved


# ---- the backward -------------------------------------------------------------------------------------
def _agree_backward(spec: Spec, group) -> None:
    """Every real rank's backward of a call agrees like a forward (problem.agree_call)."""
    from .problem import agree_call, signature_word

    key = (spec, group.group_name)
    entry = _backward_words.get(key)
    if entry is None:
        lay = spec.layout
        fields = dict(entry="ulysses_attention (backward)", group=group.group_name, world_size=lay.world_size,
                      seq_len=lay.seq_len, shard_rows=lay.shard_rows, num_heads=lay.num_heads,
                      num_kv_heads=lay.num_kv_heads, joint_len=lay.joint_len, causal=spec.causal,
                      softmax_scale=spec.scale)
        entry = _backward_words[key] = (fields, signature_word(fields))
    agree_call(*entry, None, group)


_backward_words: dict = {}


def backward(spec: Spec, ranks, saved, douts, djouts, rows, group=None) -> list:
    """The backward of these local ranks' calls (group: the real ranks' group, None for P = 1 or
    emulated ranks) -> per rank (dq, dk, dv, djq, djk, djv), joint grads None without joint rows."""
    lay = spec.layout
    if group is not None:
        _agree_backward(spec, group)
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


class _UlyssesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, jq, jk, jv):
        joint = None if jq is None else (jq, jk, jv)
        out, jout, saved = forward_saving(call.problem, q, k, v, joint, call.group, call.rank)
        ctx.spec, ctx.group, ctx.rank, ctx.rows = spec_of(call.problem), call.group, call.rank, q.shape[1]
        ctx.has_joint = joint is not None
        ctx.save_for_backward(*saved)
        return out, jout

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, djout):
        group = ctx.group if ctx.spec.layout.world_size > 1 else None
        [grads] = backward(ctx.spec, [ctx.rank], [Saved(*ctx.saved_tensors)], [dout], [djout], [ctx.rows], group)
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
        outs, jouts, saved = forward_emulated_saving(p, qs, ks, vs, joint)
        ctx.spec, ctx.rows, ctx.n_saved = spec_of(p), [q.shape[1] for q in qs], len(saved[0])
        ctx.save_for_backward(*(t for s in saved for t in s))
        return (*outs, *(jouts or ()))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        spec, P = ctx.spec, ctx.spec.layout.world_size
        flat, n = ctx.saved_tensors, ctx.n_saved
        saved = [Saved(*flat[r * n:(r + 1) * n]) for r in range(P)]
        djouts = grads[P:] if spec.layout.joint_len else [None] * P
        res = backward(spec, range(P), saved, grads[:P], djouts, ctx.rows)
        per_input = [[g[i] for g in res] for i in range(3)]
        joint = [_sum_ranks([g[i] for g in res]) for i in range(3, 6)] if spec.layout.joint_len else []
        return (None, *per_input[0], *per_input[1], *per_input[2], *joint)


def attention_emulated_with_grad(p: Problem, qs, ks, vs, joint) -> tuple:
    """ulysses_attention_emulated with grad: (outs, joint outs or None), differentiable."""
    P = p.world_size
    res = _EmulatedFunction.apply(p, *qs, *ks, *vs, *(joint or ()))
    return list(res[:P]), (list(res[P:]) if joint is not None else None)


# ---- autograd under torch.compile: functional custom ops ---------------------------------------------
def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op("fa_a2a::ulysses_attention_grad", mutates_args=())
def _grad_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint_q: Optional[torch.Tensor],
    joint_k: Optional[torch.Tensor], joint_v: Optional[torch.Tensor], group_name: str, impl: str, causal: bool,
    softmax_scale: Optional[float], seq_len: Optional[int], shard_rows: Optional[list[int]], pace: str,
) -> list[torch.Tensor]:
    """-> [out, joint out ([B, 0, H, D] without joint), then Saved's q, k, v, o, lse (empty where None)]."""
    from .pacing import decode_pace
    from .problem import resolve

    group, group_name, P, rank = group_by_name(group_name)
    joint = (joint_q, joint_k, joint_v) if joint_q is not None else None
    problem, joint = resolve(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size=P,
                             rank=rank, group=group, group_name=group_name, pace=decode_pace(pace), grad=True)
    out, jout, saved = forward_saving(problem, q, k, v, joint, group, rank)
    if jout is None:
        jout = out.new_empty(out.shape[0], 0, out.shape[2], out.shape[3])
    return [out, jout, *(t if t is not None else _empty(q) for t in saved)]


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
    return [torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, J, H, D), *heads, *rest]


def _layout_of(group_name: str, rows: int, H: int, H_kv: int, J: int, seq_len, shard_rows):
    """The call's layout again, as check_call built it (rows: this rank's q rows)."""
    _, _, P, rank = group_by_name(group_name)
    if shard_rows is not None:
        return UlyssesLayout.from_shard_rows(shard_rows, H, H_kv, P, joint_len=J), P, rank
    return UlyssesLayout.from_shard(rows, H, H_kv, P, seq_len=seq_len, joint_len=J), P, rank


@torch.library.custom_op("fa_a2a::ulysses_attention_grad_backward", mutates_args=())
def _grad_backward_op(
    dout: torch.Tensor, djout: torch.Tensor, q_heads: torch.Tensor, k_heads: torch.Tensor, v_heads: torch.Tensor,
    o_heads: torch.Tensor, lse: torch.Tensor, group_name: str, causal: bool, softmax_scale: float, fa4: bool,
    num_kv_heads: int, seq_len: Optional[int], shard_rows: Optional[list[int]],
) -> list[torch.Tensor]:
    """-> [dq, dk, dv, djq, djk, djv] (joint grads [B, 0, ., D] without joint rows)."""
    B, rows, H, D = dout.shape
    lay, P, rank = _layout_of(group_name, rows, H, num_kv_heads, djout.shape[1], seq_len, shard_rows)
    group, _, _, _ = group_by_name(group_name)
    spec = Spec(lay, causal, softmax_scale, fa4)
    saved = Saved(q_heads, k_heads, v_heads, o_heads if fa4 else None, lse if fa4 else None)
    [grads] = backward(spec, [rank], [saved], [dout], [djout], [rows], group if P > 1 else None)
    if not lay.joint_len:
        grads = grads[:3] + (dout.new_empty(B, 0, H, D), dout.new_empty(B, 0, num_kv_heads, D),
                             dout.new_empty(B, 0, num_kv_heads, D))
    return [g.contiguous() for g in grads]


@_grad_backward_op.register_fake
def _(dout, djout, q_heads, k_heads, v_heads, o_heads, lse, group_name, causal, softmax_scale, fa4, num_kv_heads,
      seq_len, shard_rows):
    B, rows, H, D = dout.shape
    J = djout.shape[1]
    return [dout.new_empty(B, rows, H, D), dout.new_empty(B, rows, num_kv_heads, D),
            dout.new_empty(B, rows, num_kv_heads, D), dout.new_empty(B, J, H, D),
            dout.new_empty(B, J, num_kv_heads, D), dout.new_empty(B, J, num_kv_heads, D)]


def _setup_grad_op(ctx, inputs, output) -> None:
    q, k, v, jq, jk, jv, group_name, impl, causal, softmax_scale, seq_len, shard_rows, pace = inputs
    ctx.save_for_backward(*output[2:])
    ctx.args = (group_name, causal, softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3]),
                q.is_cuda and impl != "reference", k.shape[2], seq_len, shard_rows)
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


torch.library.register_autograd("fa_a2a::ulysses_attention_grad", _grad_op_backward, setup_context=_setup_grad_op)


def traced_attention_with_grad(q, k, v, joint, group_name: str, impl: str, causal: bool, softmax_scale, seq_len,
                               shard_rows, pace: str) -> tuple:
    """ulysses_attention under torch.compile with grad: the differentiable custom op -> (out, joint out or None)."""
    jq, jk, jv = joint if joint is not None else (None, None, None)
    res = _grad_op(q, k, v, jq, jk, jv, group_name, impl, causal, softmax_scale, seq_len,
                   None if shard_rows is None else list(shard_rows), pace)
    return res[0], (res[1] if joint is not None else None)
