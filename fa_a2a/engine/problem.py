"""The one home of the op's argument checks: a call's signature, validated once and agreed on every call.

`resolve` turns one rank's call of `ulysses_attention` into a `Problem` (the layout plus every
fact the ranks must share). A new signature is checked in full locally and cached, so a
steady-state call pays a dict lookup for its checks. Then, on a group of several ranks, EVERY
call is agreed before any data moves (`agree_call`): each rank publishes one word, a hash of its
signature (cached with it) or ERROR_WORD when its own checks refused the call (a bad argument),
through the group's host channel (ulysses.channel: a shared-memory
slot per rank, ~1 us, no collective). Equal words: the call goes on. Otherwise every
rank sends its signature fields (or its error) to all, and every rank raises the same ValueError
naming the first argument that differs and each rank's value - never a wrong answer, never a
hang. A rank that stops calling makes the others raise TimeoutError after FA_A2A_TIMEOUT_S.
CUDA-graph replays never reach Python: they replay the signature agreed at capture.
Whether a call requires grad (grad mode on and q, k, v or joint requiring grad) is part of its
signature: such a call keeps tensors for a backward that is collective too (fa_a2a.engine.backward).

Joint (text) tokens must hold the same data on every rank (they are replicated, not sent); by
default only their shapes are agreed: FA_A2A_CHECK_JOINT=1 adds a checksum of their data to the
word every call (a debugging aid: host time 7-10 ms per call for Flux's 512 text rows on a 2-core
CPU, and a device synchronization). A default check would pay that on every call of a DiT, whose
joint q/k/v are new tensors every call (keyed by data_ptr and _version, the lookup alone took
0.6-0.9 us, and inference tensors have no _version).
Local checks also read every FA_A2A_* variable (check_settings) and refuse inputs whose elements
share memory (check_no_overlap), both once per signature: the key holds every stride.

Error grammar, here and in the kernels' launch checks: "arg: what was expected, got what came".
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Optional

import torch

from cute_kernels.limits import DTYPES as KERNEL_DTYPES, HEAD_DIMS as KERNEL_HEAD_DIMS, check_softmax_scale
from ulysses import channel as host_channel, env
from ulysses.layout import UlyssesLayout, traced_count

__all__ = ["IMPLS", "EMULATED_IMPLS", "Problem", "resolve", "resolve_emulated", "check_call", "check_tensor",
           "check_joint", "check_no_overlap", "check_settings", "agree_call", "checked_and_agreed", "joint_check",
           "signature_fields", "signature_word", "RECHECK"]

IMPLS = ("auto", "fused", "serial", "nccl", "reference")
EMULATED_IMPLS = ("auto", "fused", "serial", "reference")  # nccl needs one rank per GPU
KERNEL_IMPLS = ("fused", "serial")
BLOCK_IMPLS = ("auto", "fused", "serial")  # the attention block's (its projection is always fused)
# impl values that force the fused kernel's O-store path ("fused" alone: TMA where S_loc is a multiple
# of the tile's rows, else st; fa_a2a.engine.autotune times both)
FUSED_PATHS = ("fused:tma", "fused:st")


AUTO_LABELS = FUSED_PATHS + ("serial", "nccl")  # impl "auto"'s candidates, in its tie order (fa_a2a.engine.autotune)
ENV_IMPL = "FA_A2A_IMPL"


def forced_label(env=None) -> Optional[str]:
    """FA_A2A_IMPL, the path impl "auto" takes instead of timing its candidates: a label of
    AUTO_LABELS, "fused" or "reference" (None when unset or empty); ValueError naming it otherwise."""
    text = (os.environ if env is None else env).get(ENV_IMPL, "")
    if text == "":
        return None
    allowed = AUTO_LABELS + ("fused", "reference")
    if text not in allowed:
        raise ValueError(f"{ENV_IMPL}: expected one of {allowed} (or unset), got {text!r}")
    return text


def split_impl(impl, allowed=IMPLS) -> tuple:
    """impl as a call takes it -> (impl, o_store): o_store "tma" / "st" for FUSED_PATHS, else None."""
    if impl in FUSED_PATHS:
        return "fused", impl.split(":")[1]
    if not isinstance(impl, str) or impl not in allowed:
        raise ValueError(f"impl: expected one of {allowed + FUSED_PATHS}, got {impl!r}")
    return impl, None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call's signature. Every field but `layout` must agree across ranks (_ARGUMENT says which
    argument carries each); `layout` is derived from them. impl "auto" is resolved to a concrete
    impl and o_store per signature by fa_a2a.engine.autotune."""

    impl: str
    batch: int
    seq_loc: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device_type: str
    joint_len: int
    causal: bool
    softmax_scale: Optional[float]
    seq_len: Optional[int]
    shard_rows: Optional[tuple]
    world_size: int
    pace: object  # fa_a2a.engine.pacing.check_pace's value: None (off), "auto" or GB/s; None unless impl "fused"
    layout: UlyssesLayout = dataclasses.field(compare=False, repr=False)
    o_store: Optional[str] = None  # impl "fused": the O-store path, "tma" | "st" (None: TMA where S_loc allows)

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def agreed_fields(self) -> tuple:
        """(name, value) of every field the ranks must share, in the order a disagreement is named:
        the arguments that explain the others first (shard_rows before the row count it sets)."""
        return tuple((name, getattr(self, name)) for name in _ARGUMENT if hasattr(self, name))


# Argument that carries each agreed field, for the cross-rank error message (and the order of the check).
_ARGUMENT = dict(entry="entry point", group="group (process group)", world_size="world size", impl="impl",
                 o_store="impl (O-store path)",
                 device_type="q (device type)", dtype="q (dtype)", shard_rows="shard_rows", seq_len="seq_len",
                 batch="q (B)", seq_loc="q (S_loc)", num_heads="q (H)", num_kv_heads="k (H_kv)", head_dim="q (D)",
                 joint_len="joint (J rows; 0 = no joint)", causal="causal", softmax_scale="softmax_scale", pace="pace",
                 requires_grad="requires_grad (grad mode on and q, k, v or joint requiring grad)",
                 transport="FA_A2A_TRANSPORT (the windows' transport)",
                 check_joint="FA_A2A_CHECK_JOINT (whether this rank checks joint's data)",
                 joint_data="joint (data checksum, FA_A2A_CHECK_JOINT=1)",
                 deterministic="torch.use_deterministic_algorithms (FA4's deterministic backward)",
                 forward_call="the backward's call (its forward's number over the group: every rank must run the "
                              "backwards of its calls in the same order)")


# ---- the process group -----------------------------------------------------------------------------
def group_facts(group):
    """(group, group name, world size, rank); group=None is the default group, or P = 1 without one."""
    import torch.distributed as dist

    # isinstance, not hasattr: dynamo (torch 2.11) cannot trace hasattr on a ProcessGroup
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, "", 1, 0
        group = dist.group.WORLD
    # the group's own size and rank (= dist.get_world_size / get_rank(group), without their lookups)
    return group, group.group_name, group.size(), group.rank()


def group_by_name(group_name: str):
    """group_facts of the process group a custom op names by its group name ("" : no group, P = 1)."""
    import torch.distributed as dist

    return group_facts(dist.distributed_c10d._resolve_process_group(group_name) if group_name else None)


# ---- local checks ------------------------------------------------------------------------------------
def check_tensor(t, name: str, ndim: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else t.layout
        raise ValueError(f"{name}: expected a dense (strided) tensor, got a {kind} one")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")


def overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of t may share memory, from its shape and strides: sorted by stride, each
    dim of extent > 1 must step past the span of the smaller ones (exact for every dense layout,
    permuted or not, and for views of them; an interleaving that does not overlap but fails this,
    e.g. shape (3, 2) strides (2, 3), counts as overlapping). The smallest stride is picked by plain
    comparisons, not sorted() / min(): dynamo cannot sort the symbolic strides of torch.compile's
    dynamic shapes (a transposed input at a second sequence length)."""
    dims = [(st, n) for st, n in zip(t.stride(), t.shape) if n > 1]
    span = 0
    while dims:
        first = 0
        for i in range(1, len(dims)):
            if dims[i][0] < dims[first][0]:
                first = i
        stride, size = dims.pop(first)
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_no_overlap(named) -> None:
    """Refuse an input whose elements share memory (as_strided with overlapping strides, expand): the
    kernels and transports read each element of their inputs as its own. named: (name, tensor or
    anything else: skipped) pairs; a contiguous tensor costs one is_contiguous call."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and not t.is_contiguous() and overlaps(t):
            raise ValueError(f"{name}: expected a tensor whose elements do not share memory, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()} (pass .contiguous())")


def check_joint(joint) -> Optional[tuple]:
    """joint=None or a 3-sequence of tensors -> a tuple (q, k, v) or None (J = 0 counts as None)."""
    if joint is None:
        return None
    if isinstance(joint, torch.Tensor) or not isinstance(joint, (tuple, list)) or len(joint) != 3:
        raise ValueError(f"joint: expected a tuple (joint_q, joint_k, joint_v), got {type(joint).__name__}")
    for name, t in zip(("joint[0] (q)", "joint[1] (k)", "joint[2] (v)"), joint):
        check_tensor(t, name)
    return tuple(joint)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_scalar_args(causal, softmax_scale, seq_len) -> None:
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    check_softmax_scale(softmax_scale)
    if (seq_len is not None and not traced_count(seq_len, "seq_len")
            and (isinstance(seq_len, bool) or not isinstance(seq_len, int))):
        raise ValueError(f"seq_len: expected an int or None, got {seq_len!r}")


def _check_qkv(q, k, v, empty_shard_ok: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
    B, S_loc, H, D = q.shape
    if min(B, S_loc if not empty_shard_ok else 1, H, D) < 1:
        raise ValueError(f"q: expected every dim of [B, S_loc, H, D] >= 1, got {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:  # float8: no exchange (gloo) or attention here computes in it
        raise ValueError(f"q: expected float16, bfloat16, float32 or float64, got {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, S_loc, D):
        raise ValueError(f"k: expected [{B}, {S_loc}, H_kv, {D}] like q {tuple(q.shape)}, got {tuple(k.shape)}")
    H_kv = k.shape[2]
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"k: expected a KV head count dividing q's {H} heads, got {H_kv}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")


def _check_joint_shapes(joint, q, H_kv, causal) -> int:
    B, _, H, D = q.shape
    for name, t, heads in (("joint[0] (q)", joint[0], H), ("joint[1] (k)", joint[1], H_kv),
                           ("joint[2] (v)", joint[2], H_kv)):
        if (t.shape[0], t.shape[2], t.shape[3]) != (B, heads, D) or t.shape[1] != joint[0].shape[1]:
            raise ValueError(f"{name}: expected [{B}, J, {heads}, {D}], got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    J = joint[0].shape[1]
    if J and causal:
        raise ValueError("joint: expected no joint tokens with causal=True (MMDiT attention is not causal), got "
                         f"{J} rows")
    return J


def _check_kernel_limits(q, k, v, impl) -> None:
    """What the SM90 kernels (and FA4 behind the nccl impl on CUDA) take."""
    if not q.is_cuda:
        raise ValueError(f"q: impl={impl!r} needs CUDA tensors, got device {q.device}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q: expected bfloat16 or float16 for impl={impl!r}, got {q.dtype}")
    if q.shape[3] not in KERNEL_HEAD_DIMS:
        raise ValueError(f"q: expected head dim {' or '.join(map(str, KERNEL_HEAD_DIMS))} for impl={impl!r}, "
                         f"got {q.shape[3]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous head dim (stride 1), got stride {t.stride(-1)}")


def check_settings() -> None:
    """Every FA_A2A_* variable (ulysses.env's and FA_A2A_IMPL), read with each new signature: a bad
    value is the call's ValueError, naming the variable, on every rank."""
    env.check_all()
    forced_label()


def _check_shard_rows(shard_rows, world_size: int, seq_len, rows_here: int, rank: int) -> tuple:
    from ulysses.layout import check_shard_rows

    shard_rows = check_shard_rows(shard_rows, world_size)
    if seq_len is not None and seq_len != sum(shard_rows):
        raise ValueError(f"seq_len: expected None or sum(shard_rows) = {sum(shard_rows)}, got {seq_len}")
    if rows_here != shard_rows[rank]:
        raise ValueError(f"q: expected shard_rows[{rank}] = {shard_rows[rank]} rows on rank {rank}, got {rows_here}")
    return shard_rows


def check_call(q, k, v, joint, impl, causal, softmax_scale, seq_len, world_size: int, shard_rows=None,
               rank: int = 0, pace=None, stand_ins: bool = False):
    """Every local check of one rank's call -> (Problem, joint tuple or None). Raises ValueError.
    stand_ins: q, k, v and joint stand for the shapes of a call (the block's, expanded from one row:
    their memory is not checked)."""
    from fa_a2a.engine.pacing import check_pace

    check_settings()
    impl, o_store = split_impl(impl)
    _check_scalar_args(causal, softmax_scale, seq_len)
    pace = check_pace(pace)
    if isinstance(pace, float) and impl not in ("fused", "auto"):
        raise ValueError(f"pace: a rate paces the fused kernel's stores, got {pace:g} GB/s with impl={impl!r}")
    pace = pace if impl in ("fused", "auto") else None
    _check_qkv(q, k, v, empty_shard_ok=shard_rows is not None)
    if not stand_ins:
        check_no_overlap((("q", q), ("k", k), ("v", v)))
    if shard_rows is not None:
        shard_rows = _check_shard_rows(shard_rows, world_size, seq_len, q.shape[1], rank)
    joint = check_joint(joint)
    J = _check_joint_shapes(joint, q, k.shape[2], causal) if joint is not None else 0
    if joint is not None and not stand_ins:
        check_no_overlap(zip(("joint[0] (q)", "joint[1] (k)", "joint[2] (v)"), joint))
    if J == 0:
        joint = None
    if impl in KERNEL_IMPLS or (impl in ("nccl", "auto") and q.is_cuda):
        _check_kernel_limits(q, k, v, impl)
    B, S_loc, H, D = q.shape
    if shard_rows is None:
        layout = UlyssesLayout.from_shard(S_loc, H, k.shape[2], world_size, seq_len=seq_len, joint_len=J)
    else:
        layout = UlyssesLayout.from_shard_rows(shard_rows, H, k.shape[2], world_size, joint_len=J)
        if causal and not layout.is_suffix_padded:
            raise ValueError(f"causal: expected False with uneven shard_rows (keys are compacted), got True "
                             f"with shard_rows={list(shard_rows)}")
    if o_store == "tma" and world_size > 1:
        from cute_kernels.fa4 import tile_m_for

        tile_m = tile_m_for(D, causal)
        if layout.seq_loc % tile_m:
            raise ValueError(f"impl: 'fused:tma' needs S_loc a multiple of the tile's {tile_m} rows (TMA stores a "
                             f"tile into one rank), got S_loc {layout.seq_loc}; use 'fused:st' or 'fused'")
    scale = None if softmax_scale is None else float(softmax_scale)
    problem = Problem(impl, B, layout.seq_loc, H, k.shape[2], D, q.dtype, q.device.type, J, causal, scale, seq_len,
                      shard_rows, world_size, pace, layout, o_store)
    return problem, joint


# ---- cross-rank agreement, every call ----------------------------------------------------------------
def signature_fields(problem: Problem, entry: str, group_name: str, joint, requires_grad: bool = False) -> dict:
    fields = dict(problem.agreed_fields(), entry=entry, group=group_name, requires_grad=requires_grad)
    if problem.device_type == "cuda" and problem.impl not in ("nccl", "reference"):
        # the transport the windows come from: its set-up is collective, and each kind's is its own
        fields["transport"] = "vmm" if env.transport() == "ipc" else env.transport()
    if joint is not None and env.check_joint():
        digest = hashlib.blake2b(digest_size=8)
        for t in joint:
            digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        fields["joint_data"] = digest.hexdigest()
        fields["check_joint"] = True  # (a rank without it sends neither: the message names the setting)
    return fields


def joint_check(has_joint: bool, fields: dict) -> bool:
    """Whether a call's cached signature fields must be built again for its joint data: when
    FA_A2A_CHECK_JOINT is on now (read every call: a value set after a signature's first call counts)
    or was on when they were built."""
    return has_joint and (env.check_joint() or "joint_data" in fields)


def signature_word(fields: dict) -> int:
    """A deterministic non-zero 47-bit hash of the fields (Python's hash() differs between processes)."""
    from ulysses.channel import WORD_BITS

    h = int.from_bytes(hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=8).digest(), "little")
    return (h & ((1 << WORD_BITS) - 1)) or 1


def _disagreement(everyone: list, error: Optional[str]) -> ValueError:
    """The ValueError a rank raises from every rank's ("error", message) / ("ok", fields): its own
    error if it has one, else the first failed rank's (prefixed with that rank), else the first
    differing argument with every rank's value (the same text on every rank)."""
    P = len(everyone)
    failed = [(r, msg) for r, (kind, msg) in enumerate(everyone) if kind == "error"]
    if failed:
        r, msg = failed[0]
        return ValueError(error if error is not None else f"rank {r} of {P}: {msg}")
    fields = [msg for _, msg in everyone]
    for name in _ARGUMENT:
        values = [f.get(name) for f in fields]
        if any(x != values[0] for x in values[1:]):
            shown = ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(values))
            return ValueError(f"{_ARGUMENT[name]}: expected the same value on every rank, got {shown}")
    return ValueError(f"the ranks' calls differ in a field that is not named (signature words differ): {fields}")


def agree_call(fields: Optional[dict], word: int, error: Optional[str], group) -> None:
    """Every call on a group of several ranks, before any data moves: every rank raises the same
    ValueError if any rank's call was invalid (its own message) or the ranks' signatures differ
    (the first differing argument, all values). fields / word: this rank's signature
    (signature_fields, signature_word), ignored when `error` is given."""
    channel = host_channel.get_channel(group)
    words = channel.exchange(host_channel.ERROR_WORD if error is not None else word)
    if words[0] != host_channel.ERROR_WORD and words.count(words[0]) == len(words):
        return
    message = ("error", error) if error is not None else ("ok", fields)
    raise _disagreement(channel.gather_messages(message), error)


# ---- per-signature cache --------------------------------------------------------------------------
_resolved: dict = {}  # the one per-signature cache: the op's keys here, the block's (fa_a2a.block) named by its entry


def _signature(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size, rank, group_name,
               pace=None):
    """A hashable key of everything check_call looks at, or None when it cannot be built cheaply."""
    try:
        # every stride: check_call's memory checks read them (stride() costs no more than stride(-1))
        facts = (q.shape, q.dtype, q.device, q.stride(), k.shape, k.dtype, k.device, k.stride(),
                 v.shape, v.dtype, v.device, v.stride())
        if joint is not None:
            if not isinstance(joint, (tuple, list)):  # an iterator would be spent here: check_joint names it
                return None
            facts += tuple((t.shape, t.dtype, t.device, t.stride()) for t in joint)
        rows = tuple((type(n), n) for n in shard_rows) if isinstance(shard_rows, (list, tuple)) else shard_rows
        # typed: 1 == True == 1.0 in a dict key, but check_call refuses some of them
        scalars = (type(impl), impl, type(causal), causal, type(softmax_scale), softmax_scale, type(seq_len), seq_len,
                   type(pace), pace)
        return (facts, joint is None, scalars, rows, world_size, rank, group_name)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # RuntimeError: a nested or sparse tensor
        return None


def lookup(key):
    """(key, cached entry) of the per-signature cache (the op's keys and the block's, fa_a2a.block):
    (key, None) for a new signature, (None, None) for a key None or one that cannot be hashed (an
    unhashable argument, e.g. a list as seq_len, which check_call names): checked every time. Not
    while torch.compile traces: a key of sizes it traces as symbolic would fix them (hashing them
    guards each on its value), and a traced call is checked once per graph anyway."""
    if key is None or torch.compiler.is_compiling():
        return None, None
    try:
        hit = _resolved.get(key)
    except TypeError:
        return None, None
    return key, hit


def remember(key, entry):
    """Keep entry for key (a key from lookup; None: nothing kept). Returns entry."""
    if key is not None:
        _resolved[key] = entry
    return entry


# The refusal of a call that torch.compile traced: its body checks the call again and raises the message it
# finds (a message naming sizes traced as dynamic, symbolic, is no constant the graph could carry)
RECHECK = "fa_a2a: refused while traced; checked again when run"


def resolve(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows=None, *, world_size: int, rank: int = 0,
            group=None, group_name: str = "", refusal: Optional[str] = None, pace=None, grad: bool = False):
    """Validate (once per signature), then, on a group of several ranks, agree this call with every
    rank (every call; see the module docstring). refusal: a ValueError message the caller already
    found (raised like this rank's own). grad: whether the call requires grad (agreed with the rest).

    Returns (Problem, joint tuple or None)."""
    sig = _signature(q, k, v, joint, impl, causal, softmax_scale, seq_len, shard_rows, world_size, rank, group_name,
                     pace)
    if grad and sig is not None:
        sig = ("grad", sig)
    key, hit = lookup(sig)
    collective = world_size > 1 and group is not None

    def checks():
        if refusal is not None and refusal != RECHECK:
            raise ValueError(refusal)
        entry = hit if refusal is None else None
        if entry is None:
            problem, joint_out = check_call(q, k, v, joint, impl, causal, softmax_scale, seq_len, world_size,
                                            shard_rows, rank, pace)
            if refusal is not None:  # (the checks that refused it while traced passed on the real tensors)
                raise ValueError("ulysses_attention: refused while torch.compile traced it (dynamic shapes), "
                                 "accepted when run: call it eagerly to see the refusal")
            fields = signature_fields(problem, "ulysses_attention", group_name, joint_out, grad) if collective else None
            entry = remember(key, (problem, joint_out is not None, fields, fields and signature_word(fields)))
        problem, has_joint, fields, word = entry
        joint_out = tuple(joint) if has_joint else None
        if collective and joint_check(has_joint, fields):  # debugging aid: this call's joint data
            fields = signature_fields(problem, "ulysses_attention", group_name, joint_out, grad)
            word = signature_word(fields)
        return (problem, joint_out), fields, word

    return checked_and_agreed(checks, group if collective else None)


def checked_and_agreed(checks, group):
    """checks() -> (result, signature fields, signature word): this rank's local checks. With a
    group (several ranks) the call is then agreed with every rank (agree_call): a ValueError of
    checks() reaches every rank instead of leaving them waiting. Returns result."""
    if group is None:
        return checks()[0]
    result = fields = word = error = None
    try:
        result, fields, word = checks()
    except ValueError as e:
        error = str(e)
    agree_call(fields, word, error, group)
    return result


def refuse_on_every_rank(error: ValueError, group) -> None:
    """Raise `error` on this rank and, through the per-call agreement (agree_call), the same ValueError on
    every rank of `group` (as group_facts takes it): for a check that runs before a call's own agreement
    (the block's torch chain, the output projection's weight), which would otherwise raise on its rank
    alone and leave the others waiting for it. While torch.compile traces: `error` here alone (the
    traced call's own checks agree at run time)."""
    if torch.compiler.is_compiling():
        raise error
    group, _, P, _ = group_facts(group)

    def checks():
        raise error

    checked_and_agreed(checks, group if P > 1 and group is not None else None)


def resolve_emulated(qs, ks, vs, joint, impl, causal, softmax_scale, seq_len, shard_rows=None, pace=None):
    """resolve for P emulated ranks in one process: lists of per-rank shards that must all match rank 0's."""
    for name, xs in (("qs", qs), ("ks", ks), ("vs", vs)):
        if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or not xs:
            raise ValueError(f"{name}: expected a non-empty list of per-rank tensors, got {type(xs).__name__}")
    P = len(qs)
    if not len(ks) == len(vs) == P:
        raise ValueError(f"ks, vs: expected {P} tensors like qs, got {len(ks)} and {len(vs)}")
    split_impl(impl, EMULATED_IMPLS)
    keys = [_signature(qs[r], ks[r], vs[r], joint, impl, causal, softmax_scale, seq_len, shard_rows, P, r,
                       "emulated", pace) for r in range(P)]
    key, hit = lookup(None if None in keys else tuple(keys))
    if hit is not None:
        return hit[0], (tuple(joint) if hit[1] else None)
    checked = []
    for r in range(P):
        for name, xs in (("qs", qs), ("ks", ks), ("vs", vs)):
            check_tensor(xs[r], f"{name}[{r}]")
        checked.append(check_call(qs[r], ks[r], vs[r], joint, impl, causal, softmax_scale, seq_len, P, shard_rows, r,
                                  pace))
    problem, joint_out = checked[0]
    for r in range(1, P):  # (each rank's own checks passed: rank 0's B, H, H_kv, D, dtype and device, and rows
        # without shard_rows, make the same Problem; compared size by size, as torch.compile can trace them)
        a, b = qs[r], qs[0]
        if (a.dtype != b.dtype or a.device != b.device or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]
                or a.shape[3] != b.shape[3] or ks[r].shape[2] != ks[0].shape[2]
                or (shard_rows is None and a.shape[1] != b.shape[1])):
            raise ValueError(f"qs[{r}]: expected rank 0's shapes, dtype and device "
                             f"({tuple(qs[0].shape)} {qs[0].dtype} on {qs[0].device}), got "
                             f"{tuple(qs[r].shape)} {qs[r].dtype} on {qs[r].device}")
    remember(key, (problem, joint_out is not None, None, None))
    return problem, joint_out
