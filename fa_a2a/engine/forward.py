"""The forwards behind fa_a2a.op: one rank's call (or P emulated ranks) for a resolved Problem.

impl (one rank r of P; rows and heads as in ulysses/layout.py):
  "fused"      pre-A2A kernel (q, k, v in one launch, 16-byte peer stores) -> barrier ->
               cute_kernels.fa4.fa4_a2a_forward (FA4 whose epilogue stores O tiles into the peers'
               output windows; paced where the call's pace decides so, fa_a2a.engine.pacing) -> barrier
               -> the output: this rank's window itself, or a copy of it (delivery, below).
  "serial"     pre-A2A -> barrier -> fa4_forward -> post-A2A kernel -> barrier -> delivery.
  "nccl"       permute + torch.distributed.all_to_all_single around the local attention: the
               baseline users run today (yunchang, xDiT, DeepSpeed-Ulysses).
  "reference"  the same pipeline with the fp32 reference attention (any device).
  "auto"       one of fused (TMA or st O-stores), serial or nccl, timed on this machine at the
               first call of the signature (fa_a2a.engine.autotune; `_auto_problem`).
One rank (P = 1) needs no communication: every impl runs the local attention on the whole input.
The local attention is chosen in one place (`local_attention`): FA4 on CUDA tensors, the fp32
reference (ulysses.reference) on CPU tensors and for impl "reference".
Joint (text) tokens: the joint query rows go through fa4_forward (they are not sent: every rank
holds all of them) and their outputs are all-gathered over heads by the PostA2A kernel in
broadcast mode, inside the same barrier.
Output rows >= seq_len (padding of an uneven S) are zero in every impl.

Delivery: the call's output stays in the out-window its O tiles were stored into, with
no copy, when every rank has a free one. Besides the staging window each (layout's) out shape has
up to ulysses.env.OUT_SLOTS more (FA_A2A_OUT_SLOTS, 0-16), each allocated when first chosen (by an eager call: a
capture uses only allocated slots). Slot j is free on a rank when no output lent out of it
(Transport.lend: a tensor of its own storage) is alive there and no other CUDA graph owns it (a
graph owns every slot its capture chose: its replays store into it).
Every call the ranks exchange one word each, the mask of their free slots, through the group's host
channel (ulysses.channel; this runs on every rank whatever its own rows or `out=`, so the ranks
always meet), and all take the lowest slot free on every rank: there the output is returned as it
is (when it is contiguous: no padding heads); with none, the staging window is copied out. The next
call's peers store into a window once this rank has passed that call's first barrier, ordered after
the work queued on this stream; a call on another stream than the window's last delivery first
waits for that stream (as with a caching-allocator block, an output used on a third stream needs
that stream's work ordered before its last reference goes). Emulated ranks lend alike: the P ranks'
windows are in this process, so a slot is free when no output lent out of any of them is alive
(no exchange). The same rules, one class (Slots), deliver the fused backward's dq, dk, dv
(fa_a2a.engine.backward).
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import torch

from cute_kernels.limits import aligned16
from ulysses.reference import local_attention as reference_attention

from .problem import Problem

__all__ = ["local_attention", "forward", "forward_emulated", "head_maps", "contiguous16", "WindowPlan", "window_plan",
           "common_slot", "Slots", "slot_setting"]


def common_slot(masks) -> int:
    """The out-window every rank can use: the lowest bit set in every rank's mask (bit j: slot j
    free on that rank; bit 0 is never set), or 0 (the staging window, copied out)."""
    both = functools.reduce(operator.and_, masks)
    return (both & -both).bit_length() - 1 if both > 0 else 0


class Slots:
    """Sets of windows that results stay in, lent out instead of copied (the module docstring's Delivery):
    set 0 is the staging one (its results are copied out), sets 1..count are allocated when first chosen
    (collective: every rank chooses the same set at the same call).
    names_shapes: ((name, shape), ...) of one set's windows (set j > 0 names them f"{name}.{j}.{key}", key:
    every shape of the set, so that two Slots' sets j are the same windows or none of them);
    channel: the group's host channel (ulysses.channel) of real ranks, None for emulated ranks (one process
    holds every rank's windows: its own mask is every rank's). A set is free when none of its windows of
    this process's ranks (transport.local_ranks: the real rank's one, or all P emulated) has a lent tensor
    alive (Transport.lend) and no other CUDA graph owns it (its first window's address names it)."""

    def __init__(self, transport, names_shapes, dtype, count: int, channel):
        self.transport, self.dtype, self.count, self.channel = transport, dtype, count, channel
        key = "-".join("x".join(map(str, shape)) for _, shape in names_shapes)
        # set j's (name, shape) per window, named once (free() looks the unallocated ones up every call)
        self._named = {j: [(f"{name}.{j}.{key}" if j else name, shape) for name, shape in names_shapes]
                       for j in range(count + 1)}
        self._sets: dict = {}  # j -> set j's windows ([P, *shape] each)
        self._address: dict = {}  # j -> the local ranks' address of each of set j's windows
        self._keep(0, [transport.windows(name, shape, dtype) for name, shape in self._named[0]])

    def _keep(self, j: int, windows) -> tuple:
        self._sets[j] = tuple(windows)  # (a window stays where it is)
        self._address[j] = tuple(w[r].data_ptr() for w in windows for r in self.transport.local_ranks)
        return self._sets[j]

    def windows(self, j: int) -> tuple:
        """Set j's windows, allocated here the first time."""
        ws = self._sets.get(j)
        if ws is None:
            ws = self._keep(j, [self.transport.windows(name, shape, self.dtype) for name, shape in self._named[j]])
        return ws

    def free(self, capture: Optional[int], lowest: bool = False) -> int:
        """This process's mask of free sets (bit j: set j). capture: the id of the CUDA-graph capture this
        call is part of (None: eager), which may use only allocated sets. lowest: only the lowest free set's
        bit (what one process choosing alone takes)."""
        t, mask = self.transport, 0
        for j in range(1, self.count + 1):
            if j not in self._address:
                ws = [t.allocated(name, shape, self.dtype) for name, shape in self._named[j]]
                if ws[0] is None:  # (a set is allocated whole, by windows())
                    mask |= (capture is None) << j  # allocated when chosen, never during a capture
                    if mask and lowest:
                        return mask
                    continue
                self._keep(j, ws)
            first = self._address[j][0]
            if t.captured.get(first, capture) == capture and not any(t.lent(a) for a in self._address[j]):
                mask |= 1 << j
                if lowest:
                    return mask
        return mask

    def choose(self) -> int:
        """This call's set, agreed with every rank (common_slot of the ranks' masks; emulated ranks: of this
        process's one mask, which covers them all); 0 where the transport lends nothing. Real ranks
        exchange their masks every call, also with no sets (the exchange counts the group's calls:
        backward.forward_call)."""
        if self.channel is None and not self.count:
            return 0
        t = self.transport
        capture = _capture_id() if t.device.type == "cuda" else None
        if self.channel is None:
            j = common_slot([self.free(capture, lowest=True)])
        else:
            j = common_slot(self.channel.exchange(self.free(capture)))
        if capture is not None:
            if j:  # that graph's replays store into the set: it owns it
                t.captured[self._address[j][0]] = capture
        elif t.device.type == "cuda" and j in self._address:  # delivered on another stream last: the peers'
            # stores wait for it
            used_on, stream = t.used_on.get(self._address[j][0]), torch.cuda.current_stream(t.device)
            if used_on is not None and used_on != stream:
                stream.wait_stream(used_on)
        return j

    def delivered(self, j: int, device) -> None:
        """Set j's results were delivered on the current stream: a later call into it on another stream
        waits for this one."""
        if (self.count or self.channel is not None) and device.type == "cuda":
            self.transport.used_on[self._address[j][0]] = torch.cuda.current_stream(device)

    def lend_or_copy(self, j: int, view: torch.Tensor) -> torch.Tensor:
        """A result view into set j: lent as it is where j is not the staging set and it is contiguous,
        else copied out (the staging set is reused by the next call)."""
        if j and view.is_contiguous():
            return self.transport.lend(view)
        return view.clone(memory_format=torch.contiguous_format)


def slot_setting(transport) -> tuple:
    """(count, channel) of a transport's Slots: up to ulysses.env.OUT_SLOTS sets where the transport lends;
    real ranks exchange their free sets every call through the group's host channel, emulated ranks (no
    group: one process holds every rank's windows) need no exchange."""
    from ulysses.env import out_slots

    count = out_slots() if transport.lends_outputs else 0
    group = getattr(transport, "group", None)
    if group is None:
        return count, None
    from ulysses.channel import get_channel

    return count, get_channel(group)


def _capture_id() -> Optional[int]:
    """The id of the CUDA-graph capture running on the current stream, or None when not capturing."""
    if not torch.cuda.is_current_stream_capturing():
        return None
    from cuda.bindings import driver

    res = driver.cuStreamGetCaptureInfo(driver.CUstream(torch.cuda.current_stream().cuda_stream))
    if res[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamGetCaptureInfo: {res[0]}")
    return int(res[2])


def contiguous16(t: torch.Tensor) -> torch.Tensor:
    """t itself when the A2A kernels can read it (cute_kernels.limits.aligned16), else a copy."""
    if aligned16(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned base


def head_maps(layout, device):
    """int32 head maps of the pre-A2A kernel: global q head per (rank, local head) (-1 = padding), same for KV."""
    q_map = [h if h < layout.num_heads else -1 for row in layout.q_head_index for h in row]
    kv_map = [h for row in layout.kv_head_index for h in row]
    return (torch.tensor(q_map, dtype=torch.int32, device=device),
            torch.tensor(kv_map, dtype=torch.int32, device=device))


def seqused_tensor(n: Optional[int], B: int, device) -> Optional[torch.Tensor]:
    """FA4's seqused_k for a key count n (None: every key): int32 [B], n in every batch row."""
    return None if n is None else torch.full((B,), n, dtype=torch.int32, device=device)


def local_attention(q, k, v, *, causal: bool, softmax_scale: float, seqused_k: Optional[int],
                    reference: bool = False):
    """The one local-attention chooser: FA4 on CUDA tensors unless `reference`; the fp32 reference
    (returned in q's dtype) on CPU tensors or with `reference`. Its callers' arguments passed
    problem.check_call (the op's checks, once per call signature): FA4 launches without checking them again,
    on contiguous q, k, v at 16-byte aligned bases (contiguous16: a copy of one whose base is off; FA4's
    TMA loads need it)."""
    if q.is_cuda and not reference:
        from cute_kernels.fa4 import fa4_forward_unchecked

        return fa4_forward_unchecked(contiguous16(q.contiguous()), contiguous16(k.contiguous()),
                                     contiguous16(v.contiguous()), causal=causal, softmax_scale=softmax_scale,
                                     seqused_k=seqused_tensor(seqused_k, q.shape[0], q.device))
    o = reference_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k)
    return o if o.dtype == q.dtype else o.to(q.dtype)


def _deliver(layout, rank: int, res, rows: int, out=None, joint_out=None):
    """A rank's result (o [B, >= rows, H, D], jo or None) as its outputs: o's first `rows` rows (q's
    rows: S_loc, or shard_rows[rank]) with the padding rows zeroed, and jo. Copied into `out` /
    `joint_out` when given (the custom op's preallocated outputs); otherwise `o` must be fresh
    (not a window) and is returned without a copy where its layout allows."""
    o, jo = res
    if o.shape[1] != rows:
        o = o[:, :rows]
    if out is None:
        out, joint_out = o.contiguous(), (None if jo is None else jo.contiguous())
    else:
        out.copy_(o)
        if joint_out is not None:
            joint_out.copy_(jo)
    valid = layout.shard_rows[rank]  # layout.valid_rows(rank) without its range check
    if valid < rows:
        out[:, valid:].zero_()
    return out, joint_out


# ---- rank windows: plan of one problem on one transport ------------------------------------------
def in_windows(allocate, layout, B: int, D: int) -> tuple:
    """(dq, dk, dv) [P, B, N, h, D] (N = S_pad + J) over allocate(n) -> [P, n]: each rank's q | k | v
    in one allocation, the layout the pre-A2A kernel and the QKV projection write."""
    N, h, hk = layout.num_rows, layout.heads_loc, layout.kv_heads_loc
    nq, nk = B * N * h * D, B * N * hk * D
    flat = allocate(nq + 2 * nk)  # narrow, not indexing: also on fake tensors of torch's CPU build
    return (flat.narrow(1, 0, nq).unflatten(1, (B, N, h, D)), flat.narrow(1, nq, nk).unflatten(1, (B, N, hk, D)),
            flat.narrow(1, nq + nk, nk).unflatten(1, (B, N, hk, D)))


class WindowPlan:
    """Windows, head maps and scratch of one (layout, B, D, dtype) on one transport, built once.

    in-windows (one allocation per rank): q [B, N, H_loc, D] | k [B, N, H_kv_loc, D] | v (same),
    N = S_pad + J; out-windows [B, S_loc, H_pad, D]; joint out-windows [B, J, H_pad, D].
    """

    def __init__(self, transport, layout, B: int, D: int, dtype: torch.dtype):
        self.transport, self.layout, self.B, self.D, self.dtype = transport, layout, B, D, dtype
        self.dq, self.dk, self.dv = in_windows(lambda n: transport.windows("ulysses.in", (n,), dtype), layout, B, D)
        self.out_shape = (B, layout.seq_loc, layout.heads_pad, D)
        self._slots: dict = {}
        self.out = self.slots((("ulysses.out", self.out_shape),))
        self.out_w = self.out.windows(0)[0]
        self.jout_w = (transport.windows("ulysses.joint_out", (B, layout.joint_len, layout.heads_pad, D), dtype)
                       if layout.joint_len else None)
        self.q_map, self.kv_map = head_maps(layout, transport.device)
        self.key_rows = [(layout.valid_rows(r), *layout.key_rows(r)) for r in range(layout.world_size)]
        self.seqused = seqused_tensor(layout.seqused_k(False), B, transport.device)
        self._scratch: dict = {}
        self._launches: dict = {}
        self._results: dict = {}
        self.pacing = None  # the last fused launch's fa_a2a.engine.pacing.Pacing decision (None: pace off)
        self._warm()

    def _warm(self) -> None:
        """Compile the A2A kernels and the barrier this plan launches, then line the ranks up on the
        host: no rank's first in-stream barrier waits out another rank's JIT compiles (~2 s each).
        The attention kernels compile in attend_launch, which lines the ranks up again."""
        from cute_kernels.a2a import compile_post_a2a, compile_pre_a2a
        from cute_kernels.signal import compile_barrier

        lay = self.layout
        compile_pre_a2a(self.dtype, self.D, lay.world_size, lay.joint_len > 0)
        for broadcast in (False, True) if lay.joint_len else (False,):
            compile_post_a2a(self.dtype, self.D, lay.world_size, broadcast)
        compile_barrier(lay.world_size, len(self.transport.local_ranks))
        self.transport.host_barrier()

    def slots(self, names_shapes: tuple) -> Slots:
        """The Slots of these windows ((name, shape), ...) on this plan's transport, built once: one for all
        the ranks this process drives (the output's; the fused backward's gradient sets)."""
        if names_shapes not in self._slots:
            self._slots[names_shapes] = Slots(self.transport, names_shapes, self.dtype, *slot_setting(self.transport))
        return self._slots[names_shapes]

    def scratch(self, kind: str, rank: int, rows: int) -> torch.Tensor:
        key = (kind, rank)
        if key not in self._scratch:
            if self.transport.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("scratch buffers are allocated during CUDA-graph capture: "
                                   "run the call once eagerly before capturing")
            self._scratch[key] = torch.empty(self.B, rows, self.layout.heads_loc, self.D,
                                             dtype=self.dtype, device=self.transport.device)
        return self._scratch[key]

    # one rank's two steps, each checked, compiled and bound once (the eager call's host cost,
    # issue 18); barriers between them are the caller's
    def pre_launch(self, rank: int):
        """-> pre(q, k, v, joint): launches rank's pre-A2A from these sources into the in-windows."""
        if ("pre", rank) not in self._launches:
            self._launches["pre", rank] = self._pre_launch(rank)
        return self._launches["pre", rank]

    def attend_launch(self, rank: int, impl: str, causal: bool, scale: float, pace=None, o_store=None):
        """-> attend(): launches rank's attention and post-A2A ("fused" or "serial") from the
        in-windows. The attention kernels compile at the first request: a rank that asks before its
        first barrier keeps its JIT compiles out of the other ranks' barrier waits.
        pace: the fused kernel's store pacing, as fa_a2a.engine.pacing.check_pace returns it; o_store: its
        O-store path, "tma" | "st" | None (TMA where S_loc is a multiple of the tile's rows)."""
        fused = impl == "fused"
        key = ("attend", rank, impl, causal, scale, pace if fused else None, o_store if fused else None)
        if key not in self._launches:
            self._launches[key] = self._attend_launch(rank, impl, causal, scale, key[-2], key[-1])
            self.transport.host_barrier()  # every rank asks for the same key at the same call
        return self._launches[key]

    def pacer(self, rank: int, causal: bool, pace):
        """The store pacer of rank's fused launch (fa_a2a.engine.pacing.fused_pacer), or None for an
        unpaced one: fa_a2a.engine.pacing decides (pace "auto": collective the first time)."""
        if pace is None:
            return None
        from fa_a2a.engine.pacing import fused_pacer, link_gbps

        lay, t = self.layout, self.transport
        self.pacing, pacer = fused_pacer(pace, lambda: link_gbps(t), self.dq, lay.seq_loc, lay.seq_pad, lay.heads_loc,
                                         self.B, causal, ranks_per_gpu=t.ranks_per_gpu)
        return pacer

    def _pre_launch(self, rank: int):
        from cute_kernels.a2a import pre_a2a_launcher

        launch = pre_a2a_launcher(self.dq, self.dk, self.dv, self.q_map, self.kv_map, rank, self.layout.seq_len,
                                  self.key_rows[rank], self.layout.joint_len > 0)

        def pre(q, k, v, joint) -> None:
            joint = tuple(contiguous16(t) for t in joint) if joint is not None else None
            launch(contiguous16(q), contiguous16(k), contiguous16(v), joint)

        return pre

    def _attend_launch(self, rank: int, impl: str, causal: bool, scale: float, pace, o_store):
        pacer = self.pacer(rank, causal, pace) if impl == "fused" else None
        per_slot = {0: self._attend_steps(rank, impl, causal, scale, pacer, self.out_w, o_store)}

        def attend(slot: int = 0) -> None:
            """Launch into out-slot `slot` (complete's choice; 0: the staging window)."""
            steps = per_slot.get(slot)
            if steps is None:
                steps = per_slot[slot] = self._attend_steps(rank, impl, causal, scale, pacer, self.slot_window(slot),
                                                            o_store)
            for step in steps:
                step()

        return attend

    def _attend_steps(self, rank: int, impl: str, causal: bool, scale: float, pacer, out_w, o_store=None) -> list:
        from cute_kernels.a2a import post_a2a_launcher
        from cute_kernels.fa4 import fa4_a2a_launcher, fa4_launcher

        lay = self.layout
        q, k, v = self.dq[rank], self.dk[rank], self.dv[rank]
        seqused = None if causal else self.seqused
        steps = []
        if impl == "fused":
            steps.append(fa4_a2a_launcher(q[:, :lay.seq_pad], k, v, out_w, rank, causal=causal,
                                          softmax_scale=scale, seqused_k=seqused, pacer=pacer, o_store=o_store))
            if lay.joint_len:
                jo = self.scratch("joint", rank, lay.joint_len)
                steps.append(fa4_launcher(q[:, lay.seq_pad:], k, v, jo, causal=False, softmax_scale=scale,
                                          seqused_k=seqused))
                steps.append(post_a2a_launcher(jo, self.jout_w, rank, broadcast=True))
        else:  # serial
            o = self.scratch("out", rank, lay.num_rows)
            steps.append(fa4_launcher(q, k, v, o, causal=causal, softmax_scale=scale, seqused_k=seqused))
            steps.append(post_a2a_launcher(o[:, :lay.seq_pad], out_w, rank))
            if lay.joint_len:
                steps.append(post_a2a_launcher(o[:, lay.seq_pad:], self.jout_w, rank, broadcast=True))
        return steps

    # ---- delivery: which out-window a call's output stays in (module docstring) ----------------------
    def slot_window(self, slot: int) -> torch.Tensor:
        """The [P, B, S_loc, H_pad, D] out-windows of slot `slot` (0: staging)."""
        return self.out.windows(slot)[0]

    def choose_slot(self) -> int:
        """This call's out-slot, agreed with every rank (Slots.choose)."""
        return self.out.choose()

    def pre(self, rank: int, q, k, v, joint) -> None:
        self.pre_launch(rank)(q, k, v, joint)

    def attend(self, rank: int, impl: str, causal: bool, scale: float, pace=None, o_store=None) -> None:
        self.attend_launch(rank, impl, causal, scale, pace, o_store)()

    def complete(self, rank: int, rows: int, attend, out=None, joint_out=None):
        """The rest of rank's call once its pre-A2A is launched (the op's pre-A2A kernel, the block's
        projection): the out-slot (choose_slot) -> barrier (every rank's q/k/v rows are in the
        in-windows) -> attend -> barrier (every O tile is in its owner's out-window) -> finish."""
        slot = self.choose_slot()
        self.transport.barrier()
        attend(slot)
        self.transport.barrier()
        return self.finish(rank, rows, out, joint_out, slot)

    def finish(self, rank: int, rows: int, out=None, joint_out=None, slot: int = 0):
        """This rank's outputs: lent out of out-slot `slot` as they are where it is not the staging
        window and they are contiguous, else copied out (into out / joint_out when given; the joint
        output is always copied)."""
        key = (rank, rows, slot)
        if key not in self._results:  # views of rank's windows without the padding heads
            H = self.layout.num_heads
            self._results[key] = (self.slot_window(slot)[rank][:, :rows, :H],
                                  self.jout_w[rank][:, :, :H] if self.layout.joint_len else None)
        o, jo = self._results[key]
        self.out.delivered(slot, o.device)
        if out is None:  # (the joint window is reused by the next call: copied out)
            o = self.out.lend_or_copy(slot, o)
            jo = None if jo is None else jo.clone(memory_format=torch.contiguous_format)
        return _deliver(self.layout, rank, (o, jo), rows, out, joint_out)


_plans: dict = {}


def window_plan(transport, layout, B: int, D: int, dtype) -> WindowPlan:
    """The plan of (layout, B, D, dtype) on `transport`, built once (plans of closed transports dropped)."""
    for stale in [k for k, p in _plans.items() if p.transport.closed]:
        del _plans[stale]
    key = (id(transport), layout, B, D, dtype)
    if key not in _plans:
        _plans[key] = WindowPlan(transport, layout, B, D, dtype)
    return _plans[key]


# ---- one rank of a process group -----------------------------------------------------------------
def _single_rank(p: Problem, q, k, v, joint):
    """P = 1: no communication (all heads, no padding rows): the local attention on the whole input."""
    lay = p.layout
    if joint is None:
        return local_attention(q, k, v, causal=p.causal, softmax_scale=p.scale, seqused_k=None,
                               reference=p.impl == "reference"), None
    jq, jk, jv = joint
    o = local_attention(lay.assemble_q(q, jq), lay.assemble_kv(k, jk), lay.assemble_kv(v, jv), causal=p.causal,
                        softmax_scale=p.scale, seqused_k=lay.seqused_k(p.causal), reference=p.impl == "reference")
    return lay.split_out(o)


def _collective_pipeline(p: Problem, q, k, v, joint, group):
    """nccl / reference: permute + all_to_all_single around the local attention (ulysses.reference)."""
    from ulysses.reference import ulysses_reference_attention

    def attention(q, k, v, *, causal, softmax_scale, seqused_k):
        return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k,
                               reference=p.impl == "reference")

    res = ulysses_reference_attention(q, k, v, group=group, joint=joint, causal=p.causal, softmax_scale=p.scale,
                                      seq_len=p.layout.seq_len, shard_rows=p.shard_rows, attention=attention)
    return res if joint is not None else (res, None)


# ---- the prepared call: the one path of the op and the block, real and emulated ranks ------------------
class RankCall:
    """One rank's prepared calls of one signature on one transport, for the op and the block alike:
    the window plan and the bound attention launch (compiled before the first barrier). A call is
    `stage()` (its first step into the in-windows: the op's pre-A2A copy, the block's QKV projection)
    then WindowPlan.complete (out-slot, barrier, attention, barrier, outputs); P emulated ranks run
    their RankCalls in lock step instead (emulated_calls). pre: the op's pre-A2A launch of this rank."""

    def __init__(self, transport, p: Problem, rank: int):
        self.transport, self.rank = transport, rank
        self.plan = window_plan(transport, p.layout, p.batch, p.head_dim, p.dtype)
        self.attend = self.plan.attend_launch(rank, p.impl, p.causal, p.scale, p.pace, p.o_store)
        self._pre = None

    @property
    def closed(self) -> bool:
        return self.transport.closed

    @property
    def pre(self):
        if self._pre is None:
            self._pre = self.plan.pre_launch(self.rank)
        return self._pre

    def __call__(self, stage, rows: int, out=None, joint_out=None):
        stage()
        return self.plan.complete(self.rank, rows, self.attend, out, joint_out)


def prepared_call(cache: dict, key, build):
    """cache[key], built by build() at its first call and again once its transport was closed (the
    entries of closed transports are dropped then): a steady-state call is one dict lookup."""
    call = cache.get(key)
    if call is None or call.closed:
        for stale in [k for k, c in cache.items() if c.closed]:
            del cache[stale]
        call = cache[key] = build()
    return call


def emulated_calls(calls, stages, rows, outs=None, joint_outs=None) -> list:
    """P emulated ranks' calls in one process: every rank's stage, the out-slot (one for all: the P ranks
    share one plan), one barrier (one launch plays the P ranks), every rank's attention, one barrier,
    every rank's outputs (lent or copied out of the slot's windows, as a real rank's)."""
    P = len(calls)
    outs, joint_outs = outs or [None] * P, joint_outs or [None] * P
    for stage in stages:
        stage()
    transport = calls[0].transport
    slot = calls[0].plan.choose_slot()  # (the P ranks share one plan: one choice for all)
    transport.barrier()
    for call in calls:
        call.attend(slot)
    transport.barrier()
    return [c.plan.finish(c.rank, n, o, jo, slot) for c, n, o, jo in zip(calls, rows, outs, joint_outs)]


_rank_calls: dict = {}  # (Problem, group name, rank, device) -> RankCall


def rank_call(p: Problem, group, rank: int) -> RankCall:
    """The op's prepared call of p on this rank (RankCall over the group's transport)."""
    from ulysses.transport import get_transport

    return prepared_call(_rank_calls, (p, group.group_name, rank, torch.cuda.current_device()),
                         lambda: RankCall(get_transport(group), p, rank))


def forward(p: Problem, q, k, v, joint, group, rank: int, out=None, joint_out=None):
    """One rank's call -> (out [B, rows of q, H, D], joint_out [B, J, H, D] or None); written into
    out / joint_out when they are given (the custom op's preallocated outputs)."""
    rows = q.shape[1]
    if p.world_size == 1:
        return _deliver(p.layout, 0, _single_rank(p, q, k, v, joint), rows, out, joint_out)
    if p.impl == "auto":
        p = _auto_problem(p, q, k, v, joint, group, rank)
    if p.impl in ("nccl", "reference"):
        return _deliver(p.layout, rank, _collective_pipeline(p, q, k, v, joint, group), rows, out, joint_out)
    call = rank_call(p, group, rank)
    if p.shard_rows is not None:
        q, k, v = (p.layout.pad_shard(x, rank) for x in (q, k, v))
    return call(lambda: call.pre(q, k, v, joint), rows, out, joint_out)


# ---- impl "auto": the signature's fastest path, decided once (fa_a2a.engine.autotune) ---------------------
# (auto Problem, group name or "emulated", rank, device) -> the decided Problem; looked up first by the
# Problem's identity (_auto_by_id), as the per-signature caches hand out the same Problem every call
# (hashing one costs ~0.7 us of host time)
_auto: dict = {}
_auto_by_id: dict = {}  # id(auto Problem) -> (that Problem, where, the decided Problem)


def _decided(p: Problem, where: tuple) -> Optional[Problem]:
    hit = _auto_by_id.get(id(p))
    if hit is not None and hit[0] is p and hit[1] == where:
        return hit[2]
    decided = _auto.get((p, *where))
    if decided is not None:
        if len(_auto_by_id) > 1024:  # Problems built afresh every call (no signature cache): keep it bounded
            _auto_by_id.clear()
        _auto_by_id[id(p)] = (p, where, decided)
    return decided


def _keep_decision(p: Problem, where: tuple, decided: Problem) -> Problem:
    _auto[(p, *where)] = decided
    _auto_by_id[id(p)] = (p, where, decided)
    return decided


def _nccl_runs(group, transport) -> bool:
    """Whether impl "nccl" runs over group: an NCCL backend and one rank per GPU (NCCL refuses more)."""
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(group)).lower() and transport.ranks_per_gpu == 1


def _auto_decided(p: Problem, where: tuple, q, cpu_label: str, measure) -> Problem:
    """p (impl "auto") with its decided path: kept from an earlier call of the signature; else, on CUDA
    tensors, measure() (fa_a2a.engine.autotune.decide_path: collective, every candidate timed on this
    call's inputs); CPU tensors have one candidate, cpu_label."""
    hit = _decided(p, where)
    if hit is None:
        from fa_a2a.engine import autotune

        if q.is_cuda:
            choice = measure()
        else:  # (FA_A2A_IMPL forcing another path is said, not refused: this rank alone reads it here)
            try:
                forced = autotune.forced_label()
            except ValueError:  # (checked with the call; set since)
                forced = None
            ignored = f"; {autotune.ENV_IMPL}={forced!r} does not apply" if forced not in (None, cpu_label) else ""
            choice = autotune.static_choice(cpu_label, f"CPU tensors: {cpu_label} is the one candidate without CUDA "
                                                       f"kernels{ignored}")
        hit = _keep_decision(p, where, autotune.concrete(p, choice.label))
    return hit


def _auto_problem(p: Problem, q, k, v, joint, group, rank: int) -> Problem:
    """One rank's call of p (impl "auto") with this machine's fastest path in its place (candidates:
    fused TMA / st, serial, nccl where it runs; CPU tensors: nccl)."""
    def measure():
        from fa_a2a.engine import autotune
        from ulysses.transport import get_transport

        transport = get_transport(group)
        return autotune.decide_path(p, transport,
                                    lambda label: forward(autotune.concrete(p, label), q, k, v, joint, group, rank),
                                    q, nccl=_nccl_runs(group, transport))

    return _auto_decided(p, (group.group_name, rank, q.device), q, "nccl", measure)


def _auto_problem_emulated(p: Problem, qs, ks, vs, joint) -> Problem:
    """_auto_problem for P emulated ranks (candidates: fused TMA / st, serial; CPU tensors: reference)."""
    def measure():
        from fa_a2a.engine import autotune

        return autotune.decide_path(p, emulated_transport(p.world_size, qs[0].device),
                                    lambda label: forward_emulated(autotune.concrete(p, label), qs, ks, vs, joint),
                                    qs[0])

    return _auto_decided(p, ("emulated", 0, qs[0].device), qs[0], "reference", measure)


# ---- P emulated ranks in one process --------------------------------------------------------------
_emulated: dict = {}
_emulated_calls: dict = {}  # (Problem, device) -> the emulated op's RankCalls (_EmulatedRanks)


class _EmulatedRanks(list):
    """The P emulated ranks' RankCalls of one signature: one cache entry, one lookup per call."""

    @property
    def closed(self) -> bool:
        return self[0].closed


def emulated_transport(world_size: int, device):
    """The process's EmulatedTransport of P = world_size ranks on `device`, built once (the emulated
    op and the emulated attention block share it, and so their window plans)."""
    from ulysses.transport import EmulatedTransport

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (world_size, device)
    if key not in _emulated or _emulated[key].closed:
        _emulated[key] = EmulatedTransport(world_size, device)
    return _emulated[key]


def forward_emulated(p: Problem, qs, ks, vs, joint, outs=None, joint_outs=None):
    """All P ranks' calls in one process (the real kernels and barriers over one local buffer) ->
    (list of P outputs, list of P joint outputs or None); into outs / joint_outs when given."""
    if p.impl == "auto":
        p = _auto_problem_emulated(p, qs, ks, vs, joint)
    P = p.world_size
    rows = [q.shape[1] for q in qs]
    outs = outs or [None] * P
    joint_outs = joint_outs or [None] * P
    if p.impl == "reference":
        from ulysses.reference import emulated_ulysses_attention

        res = emulated_ulysses_attention(list(qs), list(ks), list(vs), joint=joint, causal=p.causal,
                                         softmax_scale=p.scale, seq_len=p.layout.seq_len, shard_rows=p.shard_rows)
        o, jo = res if joint is not None else (res, None)
        done = [_deliver(p.layout, r, (o[r], None if jo is None else jo.clone()), rows[r], outs[r], joint_outs[r])
                for r in range(P)]
    else:
        device = qs[0].device
        calls = prepared_call(_emulated_calls, (p, device), lambda: _EmulatedRanks(
            RankCall(emulated_transport(P, device), p, r) for r in range(P)))
        if p.shard_rows is not None:
            qs, ks, vs = ([p.layout.pad_shard(x, r) for r, x in enumerate(xs)] for xs in (qs, ks, vs))
        stages = [lambda c=c, r=r: c.pre(qs[r], ks[r], vs[r], joint) for r, c in enumerate(calls)]
        done = emulated_calls(calls, stages, rows, outs, joint_outs)
    return [o for o, _ in done], (None if joint is None else [j for _, j in done])
