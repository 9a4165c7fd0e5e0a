"""fa-a2a as an attention backend of diffusers' context parallelism (and of cache-dit's).

diffusers (0.42.1) runs Ulysses itself: `model.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=P))` shards the model's inputs by its `_cp_plan` (Flux, Flux2, QwenImage, Wan,
ChronoEdit, Helios, LTXVideo, LTX2Video, MiniMaxH3), gathers its output, and hands every attention
call to the backend chosen by `model.set_attention_backend(name)`: q/k/v [B, S_local, H, D] (fa-a2a's
layout) plus `_parallel_config`. `register_diffusers_backend()` makes fa-a2a such a backend, so a
model with a plan gets the fused kernel without a line of model code:

    register_diffusers_backend("fa_a2a")          # impl "auto": the fastest path, timed once
    model.set_attention_backend("fa_a2a")
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))
    # or, the three steps in one call:  enable_ulysses(model)

Routing of one call (every rank decides alike: the facts below are the same on all ranks):
  no parallel config (e.g. Wan's cross-attention)      -> local attention: FA4 (cute_kernels.fa4.
                                                          fa4_forward) where it applies, else SDPA
  Ulysses only, no mask, K/V as long as Q, no lse,     -> fa_a2a.ulysses_attention on the Ulysses
  tensors the impl takes (uneven ulysses_anything         group (impl "fused" by default)
  shards too: as shard_rows)
  anything else: attention mask, ring degree > 1,      -> diffusers' own templated path
  return_lse, K/V of another length, causal over          (_templated_context_parallel_attention)
  uneven shards, tensors the kernels do not take          with the same local attention as its op;
                                                          correct but not fused, logged once per
                                                          (backend, reason)
Sharded text (Flux, Flux2, QwenImage and LTX shard their text tokens too) needs nothing special:
non-causal unmasked attention does not depend on the order of the keys, and every query row
returns to its rank's slot, so the op over each rank's [text | image] rows is exact.
`route_counts(name)` says how many calls took each route (tests use it to fail a run that
silently did not shard); the fused Flux processor counts its paths there too
(route_counts(fa_a2a.models.flux.ROUTE_NAME)).

cache-dit (1.5.3) keeps its own copy of this machinery, its own model plans and its own closed
backend enum, and refuses under its context parallelism a backend it has not registered. When
cache-dit is installed, registration adds the name there too (its dispatcher passes the config as
`_cp_config`; cache-dit's config answers `.context_parallel_config` with itself), so
`ParallelismConfig(ulysses_size=P, attention_backend="fa_a2a")` works.

Differentiable (training): the Ulysses route through the op's backward (fa_a2a.engine.backward),
the templated route through diffusers' templated autograd functions with _local_backward_op, the
local route through SDPA's autograd (FA4 runs there only without grad). Refused when the inputs
require grad (ValueError naming the setting): return_lse under context parallelism (diffusers drops
the lse's gradient), ulysses_anything calls on the templated route and ring_anything (diffusers has
no backward for either). Every rank must backpropagate through every call, as the op's backward
requires; requires_grad is agreed across the ranks on both routes. Training tested on CPU only
(tests/cpu/test_train_example.py: gloo ranks, fp32 parameter grads equal one process's to 1e-4 on
every route); on one H200 (2026-12-05, bf16, 2 processes under MPS: examples/train.py) impl serial and
fused gave the same 8 losses, within 3.4e-4 of the CPU fp32 run's. Inference tested with diffusers 0.42.1 and cache-dit 1.5.3 on CPU (gloo, 2 and 3 ranks; fp32 Flux, Wan, QwenImage equal the single-device model to 1e-5,
both routes) and on one H200 (2026-12-03, bf16, 2 processes sharing the GPU; tests/gpu/test_dit.py): tiny Flux (4 x 128
heads, 2+2 blocks, 1024 image + 64 text tokens) and Wan (2 blocks, 1024 tokens), impl "fused" ==
"serial" bit for bit; max error against the fp32 single-device model 0.0245 (Flux) and 0.0253
(Wan), the same as the single-device bf16 model's (SDPA).
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import importlib.util
import inspect
import logging
from typing import Optional

import torch

from cute_kernels.limits import DTYPES as KERNEL_DTYPES, HEAD_DIMS as KERNEL_HEAD_DIMS
from fa_a2a.engine.log import log_once
from fa_a2a.engine.problem import split_impl

__all__ = ["register_diffusers_backend", "enable_ulysses", "route_counts", "backend_impl", "backend_pace",
           "rows_per_rank"]

logger = logging.getLogger(__name__)

_registered: dict[str, tuple] = {}  # backend name -> (impl, pace)
_counts: dict[str, collections.Counter] = {}


def backend_impl(name: str):
    """The impl ("fused", "serial", "nccl", "reference") a backend name was registered with, or None."""
    return _registered[name][0] if name in _registered else None


def backend_pace(name: str):
    """The pace a backend name was registered with (fa_a2a.engine.pacing.check_pace's value; "auto" for an
    unregistered name)."""
    return _registered[name][1] if name in _registered else "auto"


# ---- local attention (no communication) --------------------------------------------------------
def _fa4_applies(q, k, v, attn_mask) -> bool:
    return (attn_mask is None and q.is_cuda and q.dtype in KERNEL_DTYPES and q.shape[-1] in KERNEL_HEAD_DIMS
            and k.dtype == v.dtype == q.dtype and k.shape[-1] == q.shape[-1])


def _local_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, return_lse=False, grad=False):
    """Attention of q [B, S_q, H, D] over k/v [B, S_k, H_kv, D] -> out [B, S_q, H, D] (, lse [B, S_q, H]).

    FA4 on CUDA bf16/fp16 tensors without a mask; SDPA otherwise (fp32 math when the lse is wanted).
    grad=True (the call builds a graph): never FA4 (its forward here has no autograd), SDPA or the
    explicit fp32 softmax, both differentiable by autograd.
    """
    if not grad and _fa4_applies(q, k, v, attn_mask):
        from cute_kernels.fa4 import fa4_forward

        B, S, H, _ = q.shape
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else None
        out = fa4_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=is_causal,
                          softmax_scale=scale, lse=lse)
        return (out, lse.transpose(1, 2)) if return_lse else out
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = kt.shape[1] != qt.shape[1]
    if not return_lse:
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, is_causal=is_causal,
                                                               scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    # The lse (ring attention's merge needs it): explicit fp32 softmax.
    if gqa:
        kt, vt = (t.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1) for t in (kt, vt))
    s = _scores(qt, kt, attn_mask, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1) @ _fp32(vt)).to(q.dtype)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _fp32(t):
    """t in fp32 at least (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(qt, kt, attn_mask, is_causal, scale):
    """fp32 scores [B, H, S_q, S_k] of heads-first qt, kt, masked as SDPA masks (causal top-left)."""
    s = (_fp32(qt) @ _fp32(kt).transpose(-1, -2)) * (scale if scale is not None else qt.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return s


def _local_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """The local op of diffusers' templated context-parallel path (its forward_op signature). With
    _save_ctx it keeps what _local_backward_op reads: q, k, v (diffusers' ring backward reads them
    back as ctx.saved_tensors[:3]) and the mask, causal flag and scale."""
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.fa_a2a_attention = (attn_mask, is_causal, scale)
    return _local_attention(query, key, value, attn_mask, is_causal, scale, return_lse)


def _local_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """The backward of _local_forward_op (diffusers' backward_op signature) -> (dq, dk, dv).

    Ulysses (diffusers' TemplatedUlyssesAttention calls it with grad_out alone): the attention of
    the saved q, k, v recomputed by SDPA under autograd, its grads against grad_out. Ring
    (TemplatedRingAttention calls it once per K/V chunk with query, key, value of that chunk and
    the merged out and lse [B, S, H] of all chunks): the chunk's share of the gradient, in fp32,
    P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale,
    dK = dS^T Q * scale (the sum over the chunks is the whole attention's gradient)."""
    attn_mask, is_causal, scale = ctx.fa_a2a_attention
    if query is None:
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors[:3])
        with torch.enable_grad():
            o = _local_attention(q, k, v, attn_mask, is_causal, scale, grad=True)
            return torch.autograd.grad(o, (q, k, v), grad_out)
    if key is None or value is None or out is None or lse is None:
        raise ValueError("_local_backward_op: the ring backward passes query, key, value, out and lse together")
    qt, kt, vt, ot, dot = (_fp32(t.transpose(1, 2)) for t in (query, key, value, out, grad_out))
    group = qt.shape[1] // kt.shape[1]
    if group > 1:
        kt, vt = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
    scale_ = scale if scale is not None else qt.shape[-1] ** -0.5
    p = torch.exp(_scores(qt, kt, attn_mask, is_causal, scale) - _fp32(lse.transpose(1, 2)).unsqueeze(-1))
    ds = p * (dot @ vt.transpose(-1, -2) - (dot * ot).sum(-1, keepdim=True))
    dq = ds @ kt * scale_
    dk = ds.transpose(-1, -2) @ qt * scale_
    dv = p.transpose(-1, -2) @ dot
    if group > 1:
        dk, dv = (t.unflatten(1, (-1, group)).sum(2) for t in (dk, dv))
    return tuple(g.transpose(1, 2).to(t.dtype) for g, t in ((dq, query), (dk, key), (dv, value)))


# ---- routing -------------------------------------------------------------------------------------
def rows_per_rank(q_rows: int, k_rows: int, group, *, ulysses_anything: bool = False) -> list[tuple[int, int]]:
    """(q rows, k rows) of every rank of the group: one word per rank through the group's host
    channel (ulysses.channel, the op's per-call agreement; ~1 us, no collective and no
    device synchronization). Every rank must call it at the same call.

    The word also carries the rank's ulysses_anything flag: ranks whose ContextParallelConfig
    disagree on it raise the same ValueError (naming ulysses_anything and the ranks on each side)
    at the same call, even where their shards happen to be equal. Unchecked, such ranks return
    from attention and then run different collectives in diffusers' output gather (an all_gather
    of the shard sizes against one of the output; see _attention), which gloo ends in SIGABRT.

    The counts must be shards of one input, as diffusers splits it (every rank is fed the same
    tokens): equal without ulysses_anything (EquipartitionSharder), the longer shards first with it
    (tensor_split, for each sharded input: so their sums too). Otherwise (ranks fed different token
    counts) every rank raises the same ValueError: the op would attend over the union of the ranks'
    rows and diffusers' output gather return it. With ulysses_anything, counts that do fall in
    that order (rank 0 fed more tokens than rank 1) pass here: enable_ulysses' check of the model's
    inputs (_agree_model_call) sees them.
    """
    import torch.distributed as dist

    from ulysses.channel import get_channel

    for name, rows in (("query", q_rows), ("key", k_rows)):
        if not 0 <= rows < 1 << 23:
            raise ValueError(f"{name}: expected fewer than 2**23 rows per rank, got {rows}")
    try:
        words = get_channel(group).exchange(bool(ulysses_anything) << 46 | q_rows << 23 | k_rows)
    except TimeoutError as e:
        if not ulysses_anything:
            raise
        raise TimeoutError(f"{e}; this rank runs with ContextParallelConfig(ulysses_anything=True): a rank without it "
                           "raises in diffusers' split of tokens that its ranks do not divide (an AssertionError, "
                           "before any attention call) and never arrives here (enable_ulysses on every rank checks "
                           "ulysses_anything before the split)") from None
    flags = [w >> 46 for w in words]
    if any(f != flags[0] for f in flags):
        raise _anything_mismatch(dist.get_process_group_ranks(group), flags)
    rows = [((w >> 23) & ((1 << 23) - 1), w & ((1 << 23) - 1)) for w in words]
    for i, name in enumerate(("query", "key")):
        counts = [r[i] for r in rows]
        if any(a < b if ulysses_anything else a != b for a, b in zip(counts, counts[1:])):
            split = "the longer shards first (tensor_split)" if ulysses_anything else "equal shards"
            raise ValueError(f"hidden_states: expected every rank to feed the model the same tokens (diffusers' "
                             f"split of one input gives {split}), got {name} shards of {counts} rows on group ranks "
                             f"{dist.get_process_group_ranks(group)}")
    return rows


def _anything_mismatch(ranks: list, flags: list) -> ValueError:
    on = [g for g, f in zip(ranks, flags) if f]
    off = [g for g, f in zip(ranks, flags) if not f]
    return ValueError(f"ulysses_anything: rank(s) {on} of group ranks {ranks} run with ContextParallelConfig("
                      f"ulysses_anything=True), rank(s) {off} without; every rank must enable_parallelism with "
                      "the same config")


def _agree_model_call(model, args, kwargs) -> None:
    """enable_ulysses' forward pre-hook on the model, which runs before diffusers' split of its inputs: the ranks of the
    Ulysses group call the model alike (the same ulysses_anything, the same shape of every tensor input) or every
    rank raises the same ValueError, naming the first difference and every rank's value; an input of the model's own
    that diffusers cannot split over the ranks (not a multiple of them, or with ulysses_anything fewer rows than
    ranks) is named too (_check_split_sizes). Without it, ranks that differ in ulysses_anything part ways in
    diffusers' split (an AssertionError on the ranks without it, the others waiting FA_A2A_TIMEOUT_S) or output
    gather, and ranks fed different token counts can return wrong rows (rows_per_rank sees some). One word per rank
    per model call through the group's host channel; the inputs' data is not compared."""
    import torch.distributed as dist

    from fa_a2a.engine.problem import signature_word
    from ulysses.channel import get_channel

    config = getattr(model, "_parallel_config", None)
    cp = config.context_parallel_config if config is not None else None
    if cp is None or cp.ulysses_degree == 1:
        return
    fields = {"ulysses_anything": bool(cp.ulysses_anything)}
    for name, value in (*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            fields[name] = tuple(value.shape)
    group = cp._ulysses_mesh.get_group()
    channel = get_channel(group)
    if len(set(channel.exchange(signature_word(fields)))) == 1:
        _check_split_sizes(model, args, kwargs, cp.ulysses_degree * cp.ring_degree,  # (shapes agreed: alike
                           cp.ulysses_anything or getattr(cp, "ring_anything", False))  # on every rank)
        return
    everyone = channel.gather_messages(fields)
    ranks = dist.get_process_group_ranks(group)
    names = list(dict.fromkeys(name for f in everyone for name in f))  # ulysses_anything first
    for name in names:
        values = [f.get(name) for f in everyone]
        if any(v != values[0] for v in values[1:]):
            if name == "ulysses_anything":
                raise _anything_mismatch(ranks, values)
            shown = ", ".join(f"rank {g}: {v}" for g, v in zip(ranks, values))
            raise ValueError(f"{name}: expected the same shape on every rank (diffusers' context parallelism splits "
                             f"one input over the ranks), got {shown}")


def _check_split_sizes(model, args, kwargs, ranks: int, anything: bool) -> None:
    """The model's inputs that diffusers splits over the context-parallel ranks (its _cp_plan's entries for
    the model itself) have sizes it can split along the split dim: a multiple of the ranks (evenly), with
    `anything` (ulysses_anything) at least one row per rank. A ValueError naming the input instead of the
    AssertionError of diffusers' split (EquipartitionSharder, PartitionAnythingSharder). Inputs that a
    submodule splits (Wan's tokens after its patch embedding) are diffusers' to check."""
    import inspect

    plan = getattr(model, "_cp_plan", None)
    root = plan.get("") if isinstance(plan, dict) else None
    if not isinstance(root, dict):
        return
    try:
        inputs = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        inputs = kwargs
    for name, spec in root.items():
        t, dim = inputs.get(name), getattr(spec, "split_dim", None)
        if (not isinstance(t, torch.Tensor) or not isinstance(dim, int) or getattr(spec, "split_output", False)
                or getattr(spec, "expected_dims", None) not in (None, t.dim()) or not -t.dim() <= dim < t.dim()):
            continue
        n = t.shape[dim]
        if anything and n < ranks:
            raise ValueError(f"{name}: expected at least one row per context-parallel rank along dim {dim} ({ranks}; "
                             f"diffusers splits it under ulysses_anything too), got {n} (shape {tuple(t.shape)})")
        if not anything and n % ranks:
            raise ValueError(f"{name}: expected a size along dim {dim} that the {ranks} context-parallel ranks divide "
                             f"(diffusers splits it evenly), got {n} (shape {tuple(t.shape)}): pad it, or "
                             "enable_ulysses(..., ulysses_anything=True)")


def _not_fusable(impl, q, k, attn_mask, return_lse, cp) -> Optional[str]:
    """Why a context-parallel call cannot go to ulysses_attention (None: it can).

    Every fact used here is the same on all ranks (shapes other than S, dtypes, flags), so all
    ranks take the same route; per-rank row counts are compared in _shard_kwargs.
    """
    if cp.ring_degree > 1:
        return "ring degree > 1"
    if attn_mask is not None:
        return "attention mask"
    if return_lse:
        return "return_lse"
    kernels = split_impl(impl)[0] in ("fused", "serial") or (impl in ("nccl", "auto") and q.is_cuda)
    if kernels and not q.is_cuda:
        return f"CPU tensors (impl {impl!r} runs CUDA kernels)"
    if kernels and q.dtype not in KERNEL_DTYPES:
        return f"{q.dtype} tensors (the kernels take bfloat16/float16)"
    if kernels and q.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the kernels take {' or '.join(map(str, KERNEL_HEAD_DIMS))})"
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        return f"{k.shape[2]} K/V heads for {q.shape[2]} query heads"
    return None


def _shard_kwargs(rows: list[tuple[int, int]], causal: bool):
    """(extra op arguments, None) for these per-rank (q, k) row counts, or (None, why not).

    diffusers' ulysses_anything splits every input with tensor_split, so the longer shards come
    first and, with several inputs (text and image), every rank may hold a different count (e.g.
    4+32 and 3+31): the op takes them as shard_rows (rank r's rows follow those of ranks < r).
    """
    if any(q != k for q, k in rows):
        return None, "K/V of another length than Q"
    if len({q for q, _ in rows}) > 1:
        if causal:
            return None, "causal attention over uneven shards"
        return {"shard_rows": [q for q, _ in rows]}, None
    return {}, None


def _call_ulysses(q, k, v, **kwargs):
    import fa_a2a

    return fa_a2a.ulysses_attention(q, k, v, **kwargs)


def count_route(name: str, route: str) -> None:
    """One call of `name` (a backend, or the fused Flux processor) took `route` (see route_counts)."""
    _counts.setdefault(name, collections.Counter())[route] += 1


def _log_once(name: str, reason: str) -> None:
    log_once(logger, ("backend fallback", name, reason), logging.WARNING,
             "attention backend %r: %s -> diffusers' templated context-parallel path with FA4/SDPA as its local "
             "attention (correct, not fused); logged once", name, reason)


def _agree_grad(cp, grad: bool) -> None:
    """The templated route's agreement on requires_grad over every rank of the context-parallel mesh
    (one word per rank through the group's host channel): diffusers' templated functions run their
    backward's collectives only where the call built a graph, so ranks that differ would hang there.
    (The Ulysses route's op agrees requires_grad in its own per-call check.) Ranks that differ raise
    the same ValueError, naming requires_grad and the ranks on each side."""
    import torch.distributed as dist

    from ulysses.channel import get_channel

    group = cp._flattened_mesh.get_group()
    words = get_channel(group).exchange(1 + grad)
    if len(set(words)) > 1:
        ranks = dist.get_process_group_ranks(group)
        on = [g for g, w in zip(ranks, words) if w == 2]
        off = [g for g, w in zip(ranks, words) if w != 2]
        raise ValueError(f"requires_grad: rank(s) {on} of group ranks {ranks} call attention with inputs that require "
                         f"grad (grad mode on), rank(s) {off} without; every rank must run the model alike (all in "
                         "training, or all under torch.no_grad())")


def _grad_refusal(name, cp, reason, return_lse) -> Optional[ValueError]:
    """Why a call that requires grad cannot backpropagate on the templated route (None: it can)."""
    why = None
    if return_lse:
        why = ("return_lse", "diffusers' templated context-parallel functions drop the lse's gradient")
    elif cp.ulysses_anything and cp.ring_degree == 1:
        why = ("ulysses_anything", f"the call takes diffusers' templated path ({reason}), whose uneven-shard "
               "Ulysses (TemplatedUlyssesAnythingAttention) has no backward in diffusers")
    elif cp.ring_anything:
        why = ("ring_anything", "diffusers' TemplatedRingAnythingAttention has no backward")
    if why is None:
        return None
    return ValueError(f"{why[0]}: the inputs require grad, but {why[1]}; the {name!r} attention backend cannot "
                      "backpropagate this call (run it under torch.no_grad(), or without that setting)")


def _attention(name, impl, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
               parallel_config):
    if dropout_p:
        raise ValueError(f"dropout_p: the {name!r} attention backend has no attention dropout, expected 0.0, got "
                         f"{dropout_p}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]  # [B, S_k] -> [B, 1, 1, S_k], as diffusers' native backend
    cp = parallel_config.context_parallel_config if parallel_config is not None else None
    if cp is None or cp.ulysses_degree * cp.ring_degree == 1:
        count_route(name, "local")
        return _local_attention(query, key, value, attn_mask, is_causal, scale, return_lse, grad=grad)
    reason, extra = _not_fusable(impl, query, key, attn_mask, return_lse, cp), {}
    if reason is None:
        group = cp._ulysses_mesh.get_group()
        # Every call on every rank, with the flag: ranks that disagree on ulysses_anything raise the
        # same ValueError here (rows_per_rank says what happens otherwise: diffusers' output gather
        # runs different collectives on the ranks; ContextParallelGatherHook.post_forward's size
        # all_gather against EquipartitionSharder.unshard's, which gloo ends in SIGABRT).
        rows = rows_per_rank(query.shape[1], key.shape[1], group, ulysses_anything=cp.ulysses_anything)
        if cp.ulysses_anything or key.shape[1] != query.shape[1] or any(r != rows[0] for r in rows):
            extra, reason = _shard_kwargs(rows, bool(is_causal))
    if reason is None:  # the op is differentiable and agrees requires_grad across the ranks itself
        count_route(name, "ulysses")
        return _call_ulysses(query, key, value, group=group, impl=impl, causal=bool(is_causal), softmax_scale=scale,
                             pace=backend_pace(name), **extra)
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    _agree_grad(cp, grad)
    if grad and (refusal := _grad_refusal(name, cp, reason, return_lse)) is not None:
        raise refusal
    refusal = _templated_refusal(cp, query, key, attn_mask)
    if refusal is not None:
        raise refusal
    if cp.ulysses_anything and attn_mask is not None and attn_mask.shape[-1] == key.shape[1]:
        attn_mask = _gathered_key_mask(attn_mask, cp._ulysses_mesh.get_group())
    _log_once(name, reason)
    count_route(name, "templated")
    return _templated_context_parallel_attention(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, return_lse,
        forward_op=_local_forward_op, backward_op=_local_backward_op, _parallel_config=parallel_config)


def _templated_refusal(cp, query, key, attn_mask) -> Optional[ValueError]:
    """What diffusers' templated route would get wrong or fail on unclearly, as a ValueError naming it
    (the same facts on every rank, so every rank raises it): its ring attention hands the rank's own
    key mask to every rank's K/V chunk (wrong numbers), its Ulysses attention takes no mask of the
    rank's query rows (a RuntimeError from a size mismatch) and reshapes the heads into ulysses_degree
    parts (a RuntimeError from a reshape when they do not divide)."""
    if cp.ring_degree > 1 and attn_mask is not None:
        return ValueError("attn_mask: diffusers' ring attention (ring_degree > 1) applies a rank's key mask to "
                          "every rank's K/V chunk, so a masked call would be wrong; not supported (ring_degree 1 "
                          "takes the mask)")
    if (cp.ulysses_degree > 1 and attn_mask is not None and attn_mask.ndim == 4
            and attn_mask.shape[-2] == query.shape[1] != 1):
        return ValueError(f"attn_mask: expected a key mask ([B, S_k] or [B, 1, 1, S_k]) under Ulysses, got a "
                          f"query-by-key mask {tuple(attn_mask.shape)} whose rows are this rank's queries (after "
                          "the sequence -> heads exchange a rank attends every query row); not supported")
    if not cp.ulysses_anything and cp.ulysses_degree > 1:
        for name, t in (("query", query), ("key", key)):
            if t.shape[2] % cp.ulysses_degree:
                return ValueError(f"{name}: {t.shape[2]} heads do not split over ulysses_degree "
                                  f"{cp.ulysses_degree} on diffusers' templated route (taken for a mask, K/V of "
                                  f"another length or return_lse); pass ulysses_anything=True or drop that")
    return None


def _gathered_key_mask(mask: torch.Tensor, group) -> torch.Tensor:
    """A key mask [..., S_k_loc] of every rank -> the full [..., S_k], each rank's part at its own length.
    diffusers' ulysses_anything route gathers it padded to the longest part and trims only the end,
    which is right only when the short parts are the last ones (2 ranks; not 3 + 2 + 2): given the full
    mask it gathers nothing."""
    import torch.distributed as dist

    n = torch.tensor([mask.shape[-1]], device=mask.device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(x) for x in sizes]
    padded = torch.nn.functional.pad(mask, (0, max(sizes) - mask.shape[-1]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[..., :k] for p, k in zip(parts, sizes)], dim=-1)


def _make_backend(name: str, impl: str):
    def fa_a2a_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False, return_lse=False, _parallel_config=None):
        return _attention(name, impl, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          return_lse, _parallel_config)

    fa_a2a_attention.__qualname__ = fa_a2a_attention.__name__ = f"fa_a2a_attention[{name}, {impl}]"
    return fa_a2a_attention


# ---- registration ----------------------------------------------------------------------------------
def _enum_member(enum_cls, value: str):
    """The member of a closed str Enum with this value, added if absent (diffusers and cache-dit
    list their backends in such enums; cache-dit adds its own members the same way)."""
    try:
        return enum_cls(value)
    except ValueError:
        pass
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = value.upper(), value
    enum_cls._member_map_[member._name_] = member
    enum_cls._member_names_.append(member._name_)
    enum_cls._value2member_map_[value] = member
    return member


def _register_with_cache_dit(name: str, fn) -> None:
    from cache_dit.attention.backends.register import _AttnBackend, _AttnBackendRegistry

    def cache_dit_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False, return_lse=False, _cp_config=None):
        return fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _cp_config)

    # bridge_to_diffusers=False: the diffusers entry is ours (registered above), cache-dit must not replace it.
    _AttnBackendRegistry.register(_enum_member(_AttnBackend, name), supports_context_parallel=True,
                                  bridge_to_diffusers=False)(cache_dit_attention)


def _require_accelerator(caller: str) -> None:
    """diffusers' enable_parallelism computes `rank % torch.accelerator.device_count()`: without a GPU
    it dies in a ZeroDivisionError. Refuse before that, saying what is needed."""
    if torch.accelerator.device_count() == 0:
        raise RuntimeError(f"{caller}: diffusers' context parallelism needs a GPU (torch.accelerator.device_count() "
                           "is 0 here); on CPU use fa_a2a.ulysses_attention(impl='reference' or 'nccl') on a gloo "
                           "group (fa_a2a.models.diffusers_backend.cpu_testbed() lets diffusers' CP run there for tests)")


def _foreign_backend(name: str) -> Optional[str]:
    """The library that already registers an attention backend `name` (diffusers, cache-dit), or None."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    if name in AttentionBackendName._value2member_map_:
        return "diffusers"
    if importlib.util.find_spec("cache_dit") is not None:
        from cache_dit.attention.backends.register import _AttnBackend

        if name in _AttnBackend._value2member_map_:
            return "cache-dit"
    return None


def register_diffusers_backend(name: str = "fa_a2a", impl: str = "auto", pace="auto") -> str:
    """Register the fa-a2a attention backend with diffusers (and cache-dit, if installed); returns name.

    name: the backend name for `model.set_attention_backend(name)` (lower case; not a backend that
    diffusers or cache-dit already has, such as "native", "sage3", "ffpa"). impl: the Ulysses op's
    impl, "auto" (default) | "fused" | "fused:tma" | "fused:st" | "serial" | "nccl" | "reference"
    (fa_a2a.ulysses_attention). pace: the fused kernel's store pacing, "auto",
    None or GB/s (fa_a2a.engine.pacing). Idempotent: registering a name again with the same impl and pace
    does nothing more; another impl or pace under a registered name is refused (register a second
    name instead). Refused (RuntimeError) without a GPU: diffusers' enable_parallelism needs one.
    """
    from fa_a2a.engine.pacing import check_pace

    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if not isinstance(name, str) or not name or name != name.lower() or not name.replace("_", "").isalnum():
        raise ValueError(f"name: expected a lower-case identifier such as 'fa_a2a', got {name!r}")
    split_impl(impl)
    pace = check_pace(pace)
    if name in _registered:
        if _registered[name][0] != impl:
            raise ValueError(f"impl: backend {name!r} is registered with impl {_registered[name][0]!r}, got "
                             f"{impl!r} (register another name for another impl)")
        if _registered[name][1] != pace:
            raise ValueError(f"pace: backend {name!r} is registered with pace {_registered[name][1]!r}, got "
                             f"{pace!r} (register another name for another pace)")
        return name
    owner = _foreign_backend(name)
    if owner is not None:
        raise ValueError(f"name: {name!r} is already a {owner} attention backend; choose another name")
    _require_accelerator("register_diffusers_backend")
    fn = _make_backend(name, impl)
    member = _enum_member(AttentionBackendName, name)
    _AttentionBackendRegistry._backends[member] = fn
    _AttentionBackendRegistry._constraints[member] = []
    _AttentionBackendRegistry._supported_arg_names[member] = set(inspect.signature(fn).parameters)
    _AttentionBackendRegistry._supports_context_parallel.add(member.value)
    if importlib.util.find_spec("cache_dit") is not None:
        _register_with_cache_dit(name, fn)
    _registered[name] = (impl, pace)
    _collect_meshes_at_exit()
    return name


@functools.cache
def _collect_meshes_at_exit() -> None:
    """diffusers' enable_parallelism builds DeviceMeshes that reference each other and hold their process
    groups (DeviceMesh._pg_registry): a reference cycle, which outlives `del model` and destroy_process_group
    until the garbage collector runs. Left to the interpreter's finalization, a gloo group is destroyed
    there and aborts its rank now and then (SIGABRT "terminate called without an active exception", CI
    2026-12-05). One collection at exit, while the interpreter is whole, frees them first."""
    atexit.register(gc.collect)


def enable_ulysses(model, ulysses_degree: Optional[int] = None, *, impl: str = "auto", name: Optional[str] = None,
                   ulysses_anything: bool = False, mesh=None, pace="auto"):
    """Run a diffusers model under Ulysses with the fa-a2a backend: register, set, enable.

    ulysses_degree: P (default: the world size). ulysses_anything=True: any sequence length (uneven
    shards, passed to the op as shard_rows). mesh: a
    diffusers-style ("ring", "ulysses") DeviceMesh when the model's ranks are not the whole world.
    name: backend name (default "fa_a2a" for impl "auto", else "fa_a2a_<impl>", ":" as "_"). pace: as
    register_diffusers_backend's. Returns the model.
    Refused (ValueError) when the model already runs under context parallelism. Every model call
    then first checks that the ranks agree on ulysses_anything and on every tensor input's shape, and
    that diffusers can split the token counts it splits over the ranks
    (_agree_model_call: the same ValueError on every rank otherwise, before diffusers' split).
    """
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"model: {type(model).__name__} already runs under context parallelism "
                         "(enable_ulysses / enable_parallelism was applied); it cannot be applied twice")
    if getattr(model, "_cp_plan", None) is None:
        raise ValueError(f"model: {type(model).__name__} has no _cp_plan (diffusers' context-parallel plan)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("model: torch.distributed must be initialized before enable_ulysses")
    _require_accelerator("enable_ulysses")
    split_impl(impl)  # (before the default name is made from it)
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh) or "ulysses" not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"mesh: expected a DeviceMesh with a 'ulysses' dim (diffusers' ('ring', 'ulysses')), "
                             f"got {mesh!r}")
    if ulysses_degree is None:
        ulysses_degree = mesh["ulysses"].size() if mesh is not None else dist.get_world_size()
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1:
        raise ValueError(f"ulysses_degree: expected an int >= 1, got {ulysses_degree!r}")
    if mesh is None and ulysses_degree != dist.get_world_size():
        raise ValueError(f"ulysses_degree: expected the world size {dist.get_world_size()} without a mesh (pass "
                         f"mesh= for Ulysses over part of the ranks), got {ulysses_degree}")
    if name is None:
        name = "fa_a2a" if impl == "auto" else f"fa_a2a_{impl}".replace(":", "_")
    register_diffusers_backend(name, impl, pace)
    model.set_attention_backend(name)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses_degree,
                                                          ulysses_anything=ulysses_anything, mesh=mesh))
    model.register_forward_pre_hook(_agree_model_call, with_kwargs=True)
    return model


def route_counts(name: str = "fa_a2a", reset: bool = False) -> dict:
    """Calls of backend `name` per route since the last reset: {"ulysses", "templated", "local": n};
    of the fused Flux processor (name fa_a2a.models.flux.ROUTE_NAME): {"fused", "fallback": n}."""
    counts = dict(_counts.get(name, {}))
    if reset:
        _counts.pop(name, None)
    return counts


class _GatherThroughHost(torch.autograd.Function):
    """diffusers' AllGatherFunction through host memory: the backward takes the rank's own chunk of
    the output's gradient, as diffusers' does (every rank computes the same loss from the gathered
    output)."""

    @staticmethod
    def forward(ctx, tensor, dim, group):
        import torch.distributed as dist

        ctx.dim, ctx.rank, ctx.world = dim, dist.get_rank(group), dist.get_world_size(group)
        host = tensor.contiguous().cpu()
        parts = [torch.empty_like(host) for _ in range(ctx.world)]
        dist.all_gather(parts, host, group=group)
        return torch.cat(parts, dim=dim).to(tensor.device)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world, dim=ctx.dim)[ctx.rank], None, None


def _gather_through_host(cls, tensor, dim, mesh):
    return _GatherThroughHost.apply(tensor, dim, mesh.get_group())


def gather_cuda_over_gloo() -> None:
    """Let diffusers' output gather (EquipartitionSharder.unshard) run on a gloo group with CUDA
    tensors, through host memory: for ranks that share one GPU, where NCCL refuses to run. A testbed
    switch (tests, examples/dit_inference.py), not for production runs."""
    import diffusers.hooks.context_parallel as cp_hooks

    cp_hooks.EquipartitionSharder.unshard = classmethod(_gather_through_host)


def _all_gather_anything_padded(tensor, dim, group):
    """diffusers' _all_gather_anything (uneven shards along dim) through equal-size buffers: gloo's
    all_gather takes equal sizes only. Pads every shard to the longest, gathers, trims."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, torch.tensor([tensor.shape[dim]]), group=group)
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, int(sizes.max()) - tensor.shape[dim]]
    padded = torch.nn.functional.pad(tensor, pad)
    parts = [torch.empty_like(padded) for _ in range(len(sizes))]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, int(n)) for p, n in zip(parts, sizes)], dim=dim)


def cpu_testbed() -> None:
    """Let diffusers' context parallelism run in CPU processes over gloo: a testbed switch (the CPU
    tests, examples/dit_inference.py --device cpu), not for production runs; it changes no
    arithmetic. diffusers 0.42.1 assumes a GPU in four places, answered here as a CPU run needs:
    enable_parallelism divides by torch.accelerator.device_count() (0 without a GPU: answered 1,
    which also lets register_diffusers_backend / enable_ulysses through); ulysses_anything's size
    gather places its tensors on torch.accelerator.current_accelerator() (cuda on a CUDA build of
    torch even without a GPU: answered None, as a CPU build of torch does); its output gather of
    uneven shards is an all_gather of unequal tensors, which gloo refuses (padded, gathered,
    trimmed); its hooks call logger.warning_once (added when transformers is imported). Process-wide
    and not undone; on a machine with a GPU only the last two apply."""
    import diffusers.hooks.context_parallel as cp_hooks

    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
        torch.accelerator.current_accelerator = lambda check_available=False: None
    cp_hooks._all_gather_anything = _all_gather_anything_padded
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = logging.Logger.warning
