"""`python -m fa_a2a.bench --backward`: forward + backward of the Ulysses op against FA4's alone (issue 39).

The op's forward with grad keeps what the backward reads (fa_a2a.engine.backward._GradAttend: the pre-A2A
kernel, then for impl "serial" FA4 with its LSE and the post-A2A kernel, for "fused" on SM90 the fused
kernel that also keeps O and the LSE, and a copy of the rank's q, k, v); its backward
(fa_a2a.engine.backward) is, for impl "serial", FA4's backward
(flash_attn.cute.interface._flash_attn_bwd) between two exchanges (all_to_all_single on real ranks),
and for impl "fused" dO's pre-A2A kernel, then FA4's backward storing dq, dk, dv straight into their
owners' windows (cute_kernels.fa4_bwd_a2a), no collective. Per sequence length M (the full sequence; --seqlens / --quick / --world-size / --heads /
--head-dim / --batch / --dtype / --causal / --trials / --warmup / --calls / --target-ms as
`python -m fa_a2a.bench` reads them), side by side in one run:

  fa4_fwd          FA4's forward with its LSE (cute_kernels.fa4.fa4_launcher, what the op's forward runs)
                   on one rank's problem [B, N = M, H_loc = H/P, D]: the rank's share, no exchange
  fa4_fwdbwd       the same forward, then FA4's backward (_flash_attn_bwd with the forward's O and LSE
                   and a fixed random dO, deterministic as torch.are_deterministic_algorithms_enabled(),
                   as the op calls it): the paired baseline
  op_fwd:<impl>    the op's forward on inputs that require grad (what a training step's forward runs:
                   it keeps q, k, v, O and the LSE for the backward), its outputs then dropped
  op_fwdbwd:<impl> the same forward, then torch.autograd.backward of its outputs with fixed random dO
                   (the inputs' .grad reset to None before every call: no accumulation kernel)
  bwd              (not timed itself) fwd+bwd - fwd, for FA4 and for the op

--out-proj C_OUT: the attention block's output projection (H*D -> C_OUT, weight and bias trained) in
both: the FA4 baseline adds torch's linear forward and backward on one rank's S_loc rows, the op is
fa_a2a.ulysses_attention_out_proj (its fused backward takes dO from the projection's GEMM, stored
straight to its owners, instead of the pre-A2A kernel); dO is then dY [B, S_loc, C_OUT].
--joint J: J joint (text) rows replicated on every rank (Flux's prompt: 512): FA4 runs one rank's heads over
M + J rows, the op takes joint=(q, k, v) [B, J, H, D] (their grads computed, each rank's joint output
given its own dO); the fused backward keeps the joint rows' grads on the rank (SM90).

impl: "serial" and "fused" always; "nccl" (all_to_all_single around FA4) on real ranks with one GPU each (it
needs NCCL: skipped, with the reason, when ranks share a GPU); "reference" (the fp32 reference
attention) is not timed. Emulated ranks have no NCCL path.

Emulated ranks (one process, the default): the op is fa_a2a.ulysses_attention_emulated on P shards
[B, M/P, H, D], which runs all P ranks' work (their attentions in turn, on one GPU). Its times are
reported as measured, NOT divided by P, and the ratios compare them with P x FA4's:
    ratio fwd+bwd = op fwd+bwd / (P x fa4 fwd+bwd),   op bwd / fa4 bwd = op bwd / (P x fa4 bwd)
(the ratio is the op's cost over the attention work it contains; dividing the op's time by P would
print a per-rank time that no rank ever takes). Timing: each method is n_calls back-to-back calls
captured in a CUDA graph and replayed (graphs.timing.time_graphs: warm-up replays, method order
rotated every trial, per-call us = replay time / n_calls, median over trials); the autograd
backward is captured with the forward (torch's whole-network capture). Where any method cannot be
captured, every method is timed eagerly instead (below) and the JSON says why ("timing_mode",
"capture_error"). Beside the graph times, the same calls eagerly (EAGER_TRIALS trials): "eager_us"
in the JSON, the host cost of the Python backward shows as eager > graph.

Real ranks (torchrun --nproc-per-node=P, one GPU per process, or P processes on one GPU under
`python -m fa_a2a.mps`): every rank times fa_a2a.ulysses_attention(impl) on its shard [B, M/P, H, D]
and FA4 on its own problem, both on all ranks at once; ratios over 1 x FA4. Timing is eager, never
a graph: every call and every backward of the op agrees its signature across the ranks on the host
(fa_a2a.engine.problem.agree_call), which a replay would skip. A batch is n_calls back-to-back calls
(graphs.eager_batch) between two CUDA events after torch.cuda.synchronize + dist.barrier + one
in-stream barrier of the transport (the ranks' start events fire together); timed by
graphs.time_batches, as the whole-call benchmark times its batches: per trial the max over ranks,
method order rotated every trial, medians over trials. The ranks are set up as the whole-call
benchmark sets them up (fa_a2a.tools.bench_call.setup_ranks). Eager means the host's launch path is in the time where
it is longer than the GPU's work (small M).

Both: the fixed inputs and dO come from --seed; the FA4 baseline rotates over enough input sets
that a call does not find the previous call's data in L2 (graphs.timing.input_sets_needed; the op's
sets are P times larger and rarely need it). Ratios are given from the medians and paired (the
median over trials of the same trial's ratio; every method ran back to back in that trial). After
the timing each method runs once more and its outputs and grads must be finite (else its time is
not reported). Table: one row per (M, impl); rank 0 writes bench_backward.json into --out (no
plots). No numbers are quoted here: none had been measured when this was written.

--breakdown: after each M's timing, every method's call (its first input set) runs BREAKDOWN_CALLS more times
under torch.profiler (CUDA activity) and its kernel time per call is summed by kind (kernel_kind: the
attention's forward and backward kernels, FA4's backward pre/postprocess, GEMMs - the projection's with the
pre-A2A epilogue among them -, the A2A kernels, barriers, copies and gathers, fills and elementwise, other):
where a ratio's difference goes. Kernel times only (no gaps); emulated ranks: all P ranks' kernels, real
ranks: rank 0's own. A table under the main one, "breakdown_us" in the JSON.

Without a GPU nothing is measured: one line says so and the exit status is 0, as for
`python -m fa_a2a.bench`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from fa_a2a.tools.bench_config import DTYPES, EAGER_TRIALS, BenchConfig, torch_dtype
from fa_a2a.tools.bench_report import _finite, _first_line, _git_commit, _Log, _versions, write_result
from fa_a2a.tools.cli import rank_from_env

RESULT_NAME = "bench_backward.json"
NO_GPU_LINE = ("No CUDA GPU: nothing was measured (the forward + backward benchmark needs an SM90 GPU for FA4's "
               "backward; run it there, or under torchrun --nproc-per-node=N for N ranks); nothing written.")
FA4_KEYS = ("fa4_fwd", "fa4_fwdbwd")
IMPLS = ("serial", "fused", "nccl")  # the op's impls timed, where they apply
NCCL_SHARED = "skipped (ranks share a GPU: NCCL refuses two ranks on one device, 'Duplicate GPU detected')"
NCCL_EMULATED = "n/a (emulated ranks: the NCCL path needs real ranks, one GPU each)"
BREAKDOWN_CALLS = 5  # profiled calls per method (--breakdown)
# (kind, substrings of a CUDA kernel's name, any of which puts it there): the first kind that matches
KERNEL_KINDS = (
    ("bwd pre/postprocess", ("Preprocess", "Postprocess")),
    ("attention backward", ("Backward", "flash_bwd")),
    ("attention forward", ("Forward", "flash_fwd")),
    ("GEMM", ("Gemm", "gemm", "GEMM", "nvjet", "xmma")),
    ("A2A kernels", ("PreA2A", "PostA2A")),
    ("barriers", ("Barrier",)),
    ("copies, gathers", ("Memcpy", "copy", "Copy", "index", "Index", "gather", "Gather")),
    ("fills, elementwise, reductions", ("Memset", "Fill", "fill", "elementwise", "reduce", "Reduce")),
)
OTHER_KIND = "other"
# bench's flags that select what the per-kernel benchmark times: refused with --backward (a usage error)
REFUSED = (("methods", "--methods"), ("dest", "--dest"), ("per_kernel", "--per-kernel"), ("platform", "--platform"))


# ------------------------------------------------------------------------------ pure parts
def check_args(ns) -> None:
    """ValueError naming the first flag --backward does not take (bench's other flags keep their meaning;
    --num-sms, --fa-tflops and --no-plots have no effect here: no model, no plots)."""
    for attr, flag in REFUSED:
        value = getattr(ns, attr, None)
        if value not in (None, False):
            raise ValueError(f"{flag}: not with --backward (the forward + backward benchmark times FA4 and the "
                             f"op's serial / fused / NCCL calls, windows in HBM, no model), got {value!r}")


def op_keys(impl: str) -> tuple:
    return f"op_fwd:{impl}", f"op_fwdbwd:{impl}"


def select_impls(real_ranks: bool, shared_gpu: bool = False) -> tuple:
    """(impls to time, {method key: why it is not timed})."""
    why = NCCL_EMULATED if not real_ranks else (NCCL_SHARED if shared_gpu else None)
    impls = tuple(i for i in IMPLS if i != "nccl" or why is None)
    return impls, ({k: why for k in op_keys("nccl")} if why else {})


def method_keys(impls: Sequence[str]) -> tuple:
    return FA4_KEYS + tuple(k for impl in impls for k in op_keys(impl))


def _quot(num, den) -> Optional[float]:
    if num is None or den is None or not den > 0:
        return None
    return num / den


def _split(t: dict, impl: str) -> dict:
    """fwd, fwd+bwd and bwd = fwd+bwd - fwd of FA4 and of the op's impl from one set of times ({key: us})."""
    fwd_k, fb_k = op_keys(impl)
    out = {"fa4_fwd": t.get("fa4_fwd"), "fa4_fwdbwd": t.get("fa4_fwdbwd"), "op_fwd": t.get(fwd_k),
           "op_fwdbwd": t.get(fb_k)}
    for who in ("fa4", "op"):
        f, fb = out[f"{who}_fwd"], out[f"{who}_fwdbwd"]
        out[f"{who}_bwd"] = None if f is None or fb is None else fb - f
    return out


def _ratios_of(t: dict, impl: str, factor: int) -> dict:
    s = _split(t, impl)
    return {name: _quot(s[f"op_{name}"], None if s[f"fa4_{name}"] is None else factor * s[f"fa4_{name}"])
            for name in ("fwd", "fwdbwd", "bwd")}


def ratios(med: dict, raw: Optional[dict], impl: str, factor: int) -> dict:
    """The op's impl over factor x FA4 (factor: P for emulated ranks, whose times hold all P ranks' work;
    1 for real ranks): "fwd", "fwdbwd" and "bwd" (bwd = fwd+bwd - fwd of each) from the medians, and
    "<name>_paired": the median over trials of the same trial's ratio (raw: {key: [us per trial]});
    None where a time is missing or a denominator is not positive."""
    if not (isinstance(factor, int) and factor >= 1):
        raise ValueError(f"factor: expected an int >= 1, got {factor!r}")
    out = _ratios_of(med, impl, factor)
    keys = FA4_KEYS + op_keys(impl)
    n = len(raw[keys[0]]) if raw and all(raw.get(k) for k in keys) else 0
    if n and any(len(raw[k]) != n for k in keys):
        raise ValueError(f"raw: expected the same number of trials for {keys}, got {[len(raw[k]) for k in keys]}")
    per_trial = [_ratios_of({k: raw[k][t] for k in keys}, impl, factor) for t in range(n)]
    for name in ("fwd", "fwdbwd", "bwd"):
        values = [r[name] for r in per_trial]
        out[name + "_paired"] = statistics.median(values) if values and None not in values else None
    return out


def new_point(M: int, cfg: BenchConfig, impls: Sequence[str], status: dict) -> dict:
    """One M's record (JSON) before anything is timed."""
    return {"M": M, "S_loc": M // cfg.world_size, "H_loc": cfg.heads_local,
            "factor": 1 if cfg.real_ranks else cfg.world_size, "impls": list(impls), "n_calls": None,
            "input_sets": None, "timing_mode": None, "capture_error": None, "status": dict(status), "raw_us": {},
            "median_us": {}, "eager_raw_us": {}, "eager_us": {}, "finite": {}, "ratios": {}, "breakdown_us": {}}


def fill_point(point: dict, raw: dict, eager_raw: Optional[dict] = None) -> dict:
    """point's medians and ratios from the per-trial times ({key: [us]}, max over ranks): a method whose
    output or grads were not finite (point["finite"]) gets that status and no time."""
    bad = [k for k, ok in point["finite"].items() if not ok]
    for k in bad:
        point["status"][k] = "non-finite output or grads"
    point["raw_us"], point["eager_raw_us"] = raw, eager_raw or {}
    point["median_us"] = {k: statistics.median(v) for k, v in raw.items() if v and k not in bad}
    point["eager_us"] = {k: statistics.median(v) for k, v in (eager_raw or {}).items() if v and k not in bad}
    good = {k: raw[k] for k in point["median_us"]}
    point["ratios"] = {impl: ratios(point["median_us"], good, impl, point["factor"]) for impl in point["impls"]}
    return point


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS row of a CUDA kernel (or memcpy / memset) named `name`, else OTHER_KIND."""
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return OTHER_KIND


def breakdown(kernels, calls: int) -> dict:
    """{kind: us per call} of (name, us) kernel records gathered over `calls` calls, plus "total"."""
    if not (isinstance(calls, int) and calls >= 1):
        raise ValueError(f"calls: expected an int >= 1, got {calls!r}")
    out: dict = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        out[kind] = out.get(kind, 0.0) + us / calls
    out["total"] = sum(out.values())
    return out


def format_breakdown(points: Sequence[dict]) -> str:
    """Markdown table, one row per (M, method) with a breakdown (us of kernel time per call by kind)."""
    kinds = [k for k, _ in KERNEL_KINDS] + [OTHER_KIND, "total"]
    lines = ["| M | method | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 2)]
    for p in points:
        for key, b in p.get("breakdown_us", {}).items():
            lines.append(f"| {p['M']} | {key} | " + " | ".join(_cell(b.get(k)) for k in kinds) + " |")
    return "\n".join(lines)


def _cell(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


TABLE_HEAD = ("M", "impl", "fa4 fwd (us)", "fa4 fwd+bwd (us)", "op fwd (us)", "op fwd+bwd (us)",
              "op bwd / fa4 bwd", "ratio fwd+bwd", "ratio fwd+bwd paired")


def format_table(points: Sequence[dict]) -> str:
    """Markdown table, one row per (M, impl): the medians (us per call; the op's as measured) and the ratios
    over factor x FA4 (from the medians; the last column paired); under it the methods not timed, why."""
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for p in points:
        for impl in p["impls"]:
            s, r = _split(p["median_us"], impl), p["ratios"].get(impl, {})
            lines.append("| " + " | ".join([
                str(p["M"]), impl, _cell(s["fa4_fwd"]), _cell(s["fa4_fwdbwd"]), _cell(s["op_fwd"]),
                _cell(s["op_fwdbwd"]), _cell(r.get("bwd"), "{:.3f}"), _cell(r.get("fwdbwd"), "{:.3f}"),
                _cell(r.get("fwdbwd_paired"), "{:.3f}")]) + " |")
    from fa_a2a.tools.bench_call import not_run_lines

    return "\n".join(lines + not_run_lines(points, "Not timed"))


def table_title(points: Sequence[dict], card: str, cfg: BenchConfig) -> str:
    modes = "/".join(sorted({str(p["timing_mode"]) for p in points})) or "nothing timed"
    if cfg.real_ranks:
        who = f"P={cfg.world_size} real ranks, per trial the max over ranks; ratios over 1 x FA4"
    else:
        who = (f"P={cfg.world_size} emulated ranks in one process: the op's times are all {cfg.world_size} ranks' "
               f"work, ratios over {cfg.world_size} x FA4")
    proj = (f"; with the output projection H*D -> {cfg.out_proj} (FA4 + torch's linear vs "
            f"ulysses_attention_out_proj)" if cfg.out_proj else "")
    if cfg.joint:
        proj += f"; {cfg.joint} joint rows (FA4 over M + {cfg.joint} rows)"
    return (f"{card}, {cfg.dtype}, B={cfg.batch}, H={cfg.heads}, H_loc={cfg.heads_local}, D={cfg.head_dim}"
            f"{', causal' if cfg.causal else ''}{proj}; {who}; us per call, median over {cfg.trials} trials ({modes}); "
            f"bwd = fwd+bwd - fwd")


# ------------------------------------------------------------------------------ GPU
def _setup(cfg: BenchConfig) -> dict:
    """Real ranks: the whole-call benchmark's rank set-up (bench_call.setup_ranks); emulated ranks: GPU 0,
    no process group."""
    import torch

    if cfg.real_ranks:
        from fa_a2a.tools.bench_call import setup_ranks

        return setup_ranks(cfg)
    torch.cuda.set_device(0)
    return {"rank": 0, "group": None, "device": torch.device("cuda", 0), "shared_gpu": False,
            "local_world_size": 1, "gpus": torch.cuda.device_count(), "backend": None}


def _build(cfg: BenchConfig, M: int, ctx: dict, impls: Sequence[str]) -> tuple:
    """({key: [zero-argument calls, one per input set]}, {key: input sets}); every call returns the
    tensors whose finiteness is checked (outputs, and grads where it runs the backward)."""
    import torch

    from cute_kernels.fa4 import fa4_launcher
    from fa_a2a.op import (ulysses_attention, ulysses_attention_emulated, ulysses_attention_out_proj,
                           ulysses_attention_out_proj_emulated)
    from flash_attn.cute.interface import _flash_attn_bwd
    from graphs import input_sets_needed

    P, B, H, D, H_loc = cfg.world_size, cfg.batch, cfg.heads, cfg.head_dim, cfg.heads_local
    S_loc, dtype, causal, dev = M // P, torch_dtype(cfg.dtype), cfg.causal, ctx["device"]
    J = cfg.joint  # joint rows: FA4 runs one rank's heads over M + J rows, the op takes them as joint=
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1_000_003 + M * 64 + ctx["rank"])

    def randn(*shape, grad=False):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen).requires_grad_(grad)

    x_bytes = B * M * H_loc * D * DTYPES[cfg.dtype]  # one [B, M, H_loc, D] tensor = one rank's shard
    l2 = ctx["l2_bytes"]
    # one FA4 fwd+bwd reads / writes q, k, v, O, dO, dq, dk, dv (+ LSE, FA4's fp32 dq accumulator)
    n_fa4 = input_sets_needed(10 * x_bytes, l2)
    ranks_here = 1 if cfg.real_ranks else P
    n_op = input_sets_needed(10 * x_bytes * ranks_here, l2)

    C_out = cfg.out_proj
    if C_out:  # the output projection's weights, trained (their grads computed) in both
        weight, bias = randn(C_out, H * D, grad=True), randn(C_out, grad=True)
        with torch.no_grad():
            weight /= math.sqrt(H * D)

    def linear_set():
        """One rank's output projection on its S_loc rows, forward and backward (torch's linear): what the
        FA4 baseline adds with --out-proj."""
        x, dy = randn(B, S_loc, H * D, grad=True), randn(B, S_loc, C_out)

        def fwd():
            with torch.enable_grad():
                return torch.nn.functional.linear(x, weight, bias)

        def fwd_bwd():
            for t in (x, weight, bias):
                t.grad = None
            y = fwd()
            torch.autograd.backward(y, dy)
            return [y.detach(), x.grad, weight.grad, bias.grad]

        return fwd, fwd_bwd

    def fa4_set():
        q, k, v, do = (randn(B, M + J, H_loc, D) for _ in range(4))
        o = torch.empty_like(q)
        lse = torch.empty(B, H_loc, M + J, dtype=torch.float32, device=dev)
        fwd = fa4_launcher(q, k, v, o, causal=causal, softmax_scale=scale, lse=lse)
        lin = linear_set() if C_out else None

        def fwd_only():
            fwd()
            return (o, lse) + ((lin[0]().detach(),) if lin else ())

        def fwd_bwd():
            fwd()
            grads = _flash_attn_bwd(q, k, v, o, do, lse, scale, causal,
                                    deterministic=torch.are_deterministic_algorithms_enabled())
            return (o,) + tuple(grads[:3]) + (tuple(lin[1]()) if lin else ())

        return fwd_only, fwd_bwd

    fa4 = [fa4_set() for _ in range(n_fa4)]
    calls = {"fa4_fwd": [f for f, _ in fa4], "fa4_fwdbwd": [fb for _, fb in fa4]}

    def op_set(impl):
        n = 1 if cfg.real_ranks else P
        qs, ks, vs = ([randn(B, S_loc, H, D, grad=True) for _ in range(n)] for _ in range(3))
        dos = [randn(B, S_loc, C_out) if C_out else randn(B, S_loc, H, D) for _ in range(n)]
        joint = tuple(randn(B, J, H, D, grad=True) for _ in range(3)) if J else None  # replicated: one tuple
        djouts = [randn(B, J, H, D) for _ in range(n)] if J else []  # each rank's joint output's grad
        leaves = qs + ks + vs + ([weight, bias] if C_out else []) + list(joint or ())
        if cfg.real_ranks and C_out:
            def forward():
                return [ulysses_attention_out_proj(qs[0], ks[0], vs[0], weight, bias, group=ctx["group"], impl=impl,
                                                   causal=causal)]
        elif cfg.real_ranks:
            def forward():
                res = ulysses_attention(qs[0], ks[0], vs[0], group=ctx["group"], impl=impl, causal=causal, joint=joint)
                return list(res) if J else [res]
        elif C_out:
            def forward():
                return ulysses_attention_out_proj_emulated(qs, ks, vs, weight, bias, impl=impl, causal=causal)
        else:
            def forward():
                res = ulysses_attention_emulated(qs, ks, vs, impl=impl, causal=causal, joint=joint)
                return [*res[0], *res[1]] if J else list(res)

        def fwd_only():
            with torch.enable_grad():
                outs = forward()
            return [o.detach() for o in outs]

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            with torch.enable_grad():
                outs = forward()
            torch.autograd.backward(outs, dos + djouts)
            return [o.detach() for o in outs] + [t.grad for t in leaves]

        return fwd_only, fwd_bwd

    for impl in impls:
        sets = [op_set(impl) for _ in range(n_op)]
        fwd_k, fb_k = op_keys(impl)
        calls[fwd_k], calls[fb_k] = [f for f, _ in sets], [fb for _, fb in sets]
    return calls, {"fa4": n_fa4, "op": n_op}


def _aligner(ctx: dict):
    """Before a timed batch: this GPU idle; with real ranks also the hosts met and one in-stream barrier
    of the transport (bench_call.rank_aligner), so that every rank's start event fires together."""
    import torch

    if ctx["group"] is None:
        return torch.cuda.synchronize
    from fa_a2a.tools.bench_call import rank_aligner

    return rank_aligner(ctx["group"])


def run_point(cfg: BenchConfig, M: int, ctx: dict, log: _Log) -> dict:
    import torch

    from fa_a2a.tools.bench_call import calls_per_batch, first_calls
    from graphs import GpuClockMonitor, capture, eager_batch, rank_max, time_batches, time_graphs

    group = ctx["group"]
    impls, status = select_impls(cfg.real_ranks, ctx["shared_gpu"])
    point = new_point(M, cfg, impls, status)
    calls, sets = _build(cfg, M, ctx, impls)
    point["input_sets"] = sets
    keys = list(calls)

    def first(key):  # every input set's first call (compiles, window allocations), its outputs dropped
        for f in calls[key]:
            f()

    # First calls (collective: the same order on every rank), then one timed call each; a method that
    # fails is dropped on every rank (bench_call.first_calls, as the whole-call benchmark does it)
    est = first_calls(keys, first, lambda key: calls[key][0](), point["status"], group)
    names = list(est)
    for key in keys:
        if key not in est:
            log(f"  M={M} {key}: {point['status'][key]}")
    if not names:
        return fill_point(point, {})
    n_calls = calls_per_batch(cfg, est.values(), group, multiple=sets["fa4"])
    point["n_calls"] = n_calls

    error = None
    if cfg.real_ranks:
        error = "real ranks: every call and backward agrees its signature across the ranks on the host"
    else:  # a trial capture of each method: all or none in graphs, so that the ratios compare like with like
        for key in names:
            try:
                capture(calls[key], len(calls[key]), eager_warmup=0)  # the graph is dropped at once
            except Exception as e:
                error = f"{key}: {_first_line(e)}"
                break
        torch.cuda.synchronize()
    point["capture_error"] = error
    point["timing_mode"] = "eager" if error else "cuda-graph"
    log(f"M={M}: {n_calls} calls per batch, input sets FA4 {sets['fa4']} / op {sets['op']}, {point['timing_mode']}"
        + (f" (no graph: {error})" if error and not cfg.real_ranks else ""))
    align = _aligner(ctx)
    eager = {k: eager_batch(calls[k], n_calls) for k in names}  # timed after align(), between CUDA events
    if error is None:
        monitor = GpuClockMonitor(ctx["device"])
        raw = time_graphs({k: calls[k] for k in names}, n_calls, cfg.trials, cfg.warmup, monitor=monitor)
        point["clock_warnings"] = list(monitor.warnings)
        eager_raw = time_batches(eager, n_calls, EAGER_TRIALS, before=align, group=group)
    else:
        raw = eager_raw = time_batches(eager, n_calls, cfg.trials, cfg.warmup, before=align, group=group)
    torch.cuda.synchronize()
    ok = torch.tensor([0.0 if _finite(calls[k][0]()) else 1.0 for k in names])  # fresh outputs and grads
    torch.cuda.synchronize()
    bad = rank_max(ok, group)
    point["finite"] = {k: bool(bad[j] == 0) for j, k in enumerate(names)}
    for k, good in point["finite"].items():
        if not good:
            log(f"  M={M} {k}: NaN/Inf in its outputs or grads (on some rank); its time is not reported")
    if cfg.breakdown:
        point["breakdown_us"] = {k: _profiled(calls[k][0], align) for k in names}
    return fill_point(point, raw, eager_raw)


def _profiled(call, align) -> dict:
    """breakdown() of BREAKDOWN_CALLS calls of `call` under torch.profiler (this process's kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    align()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(BREAKDOWN_CALLS):
            call()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return breakdown([(e.name, e.device_time_total) for e in prof.events() if e.device_type == cuda],
                     BREAKDOWN_CALLS)


def run_gpu(cfg: BenchConfig) -> int:
    import torch

    from graphs import l2_cache_bytes

    ctx = _setup(cfg)
    log = _Log(ctx["rank"])
    props = torch.cuda.get_device_properties(ctx["device"])
    ctx["l2_bytes"] = l2_cache_bytes(ctx["device"])
    mps = {"thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "mps_share": cfg.mps_share}
    if cfg.real_ranks:
        where = (f"{ctx['local_world_size']} processes sharing {ctx['gpus']} GPU(s)" if ctx["shared_gpu"]
                 else "one GPU per process")
        ranks_text = f"P={cfg.world_size} real ranks, {where}, process group {ctx['backend']}"
    else:
        ranks_text = f"P={cfg.world_size} emulated ranks in one process"
    log(f"fa_a2a.tools.bench --backward on {props.name}: {ranks_text}; B={cfg.batch}, H={cfg.heads}, "
        f"D={cfg.head_dim}, {cfg.dtype}{', causal' if cfg.causal else ''}; M={list(cfg.seqlens)}; "
        f"{cfg.trials} trials, {cfg.warmup} warm-up")
    timing = ("real ranks: eager batches of n_calls calls between CUDA events after synchronize + dist.barrier + "
              "one in-stream barrier; per trial the max over ranks" if cfg.real_ranks else
              "emulated ranks: CUDA-graph replays of n_calls calls (graphs.timing.time_graphs), or eager batches "
              "between CUDA events where a method could not be captured (timing_mode)")
    result = {"config": {**dataclasses.asdict(cfg), "seqlens": list(cfg.seqlens), "backward": True},
              "env": {"card": props.name, "sm_count": props.multi_processor_count,
                      "capability": f"{props.major}.{props.minor}", "l2_bytes": ctx["l2_bytes"],
                      "versions": _versions(), "git_commit": _git_commit(), "argv": sys.argv,
                      "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
              "ranks": {"world_size": cfg.world_size, "real": cfg.real_ranks, "shared_gpu": ctx["shared_gpu"],
                        "process_group": ctx["backend"], "mps": mps},
              "factor": "op times over factor x FA4: factor = P for emulated ranks (the op's times hold all P "
                        "ranks' work), 1 for real ranks",
              "timing": timing + f"; per-call us, method order rotated per trial, medians over trials; eager_us: "
                                 f"eager batches, {EAGER_TRIALS} trials",
              "points": []}
    for M in cfg.seqlens:
        result["points"].append(run_point(cfg, M, ctx, log))
        torch.cuda.empty_cache()
        if cfg.real_ranks:  # a barrier that timed out makes this M's numbers wrong
            from ulysses.transport import get_transport

            get_transport(ctx["group"]).check()
    if ctx["rank"] == 0:
        files = write_result(cfg, RESULT_NAME, result, lambda out: [], log)
        for w in [w for p in result["points"] for w in p.get("clock_warnings", [])]:
            log(f"warning: {w}")
        log("Wrote " + ", ".join(files))
        log("")
        log(table_title(result["points"], props.name, cfg))
        log(format_table(result["points"]))
        if cfg.breakdown:
            log("")
            log("Kernel time per call by kind (us; torch.profiler, " + ("rank 0's kernels" if cfg.real_ranks else
                f"all {cfg.world_size} emulated ranks' kernels") + f", {BREAKDOWN_CALLS} calls):")
            log(format_breakdown(result["points"]))
    if cfg.real_ranks:
        import torch.distributed as dist

        from ulysses.transport import close_transports

        close_transports()
        dist.destroy_process_group()
    return 0


def run(cfg: BenchConfig, gpu: bool) -> int:
    """`python -m fa_a2a.bench --backward` after its arguments (fa_a2a.tools.bench.main): without a GPU
    rank 0 prints NO_GPU_LINE (the other ranks nothing) and nothing is written; exit status 0."""
    if not gpu:
        if rank_from_env() == 0:
            print(NO_GPU_LINE)
        return 0
    return run_gpu(cfg)
