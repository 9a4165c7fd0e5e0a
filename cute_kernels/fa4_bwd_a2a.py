"""Torch entry point of the fused backward (cute_kernels.fa4_bwd_a2a_sm90 on SM90,
cute_kernels.fa4_bwd_a2a_sm100 on SM100): FA4's backward of one rank's heads with the post-A2A of dq,
dk, dv in its kernels.

fa4_bwd_a2a_launcher checks and compiles once (cute_kernels.compile_cache: the kernels are keyed by
their configuration, shapes and strides are dynamic) and returns the launch: FA4's preprocess (its own
function and compile cache), the main kernel, the routed postprocesses, on the current stream through
TVM-FFI, no host sync (CUDA-graph capturable). FA4's configuration is its own backward's
(flash_attn.cute.interface._flash_attn_bwd on the device's architecture), so the results are FA4's
bit for bit. The architecture is q's device's, or the CuTe DSL target for fake tensors
(cute_kernels.fa4.device_arch).
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional

import torch

from cute_kernels.compile_cache import disk_cache, disk_value
from cute_kernels.fa4 import device_arch
from cute_kernels.limits import DTYPES, HEAD_DIMS, aligned16
from cute_kernels.limits import address as _address, is_fake as _is_fake
from ulysses.layout import check_rank

DKV_STORES = ("tma", "st")  # the non-GQA dK/dV paths (cute_kernels.fa4_bwd_a2a_sm90)


# ---- FA4's SM90 backward configuration ------------------------------------------------------------
class Sm90BwdConfig(NamedTuple):
    """flash_attn.cute.interface._tile_size_bwd_sm90's BwdConfig, as a plain tuple."""

    m_block_size: int
    n_block_size: int
    num_stages_Q: int
    num_stages_dO: int
    num_stages_PdS: int
    SdP_swapAB: bool
    dKV_swapAB: bool
    dQ_swapAB: bool
    AtomLayoutMSdP: int
    AtomLayoutNdKV: int
    AtomLayoutMdQ: int
    num_wg: int
    dQ_single_wg: bool


@disk_value
def fa4_sm90_bwd_config(head_dim: int, causal: bool) -> Sm90BwdConfig:
    """FA4's SM90 backward configuration for this head dim (head_dim_v = head_dim, no local window,
    no block sparsity): the table FA4's own backward uses. D=128: tile_m 80 (64 causal), tile_n 128."""
    import dataclasses

    from flash_attn.cute.interface import _tile_size_bwd_sm90

    cfg = dataclasses.asdict(_tile_size_bwd_sm90(head_dim, head_dim, causal, False))
    return Sm90BwdConfig(**{f: cfg[f] for f in Sm90BwdConfig._fields})


def bwd_tiles(head_dim: int, causal: bool = False) -> tuple:
    """(tile_m, tile_n) of FA4's SM90 backward: dQ rows per postprocess tile, dK/dV rows per KV block."""
    cfg = fa4_sm90_bwd_config(head_dim, causal)
    return cfg.m_block_size, cfg.n_block_size


# ---- compile (fake tensors of the key's shape class; shapes and strides are dynamic) --------------
def _cute_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def _main_kernel(dkv_store: str, dtype, head_dim: int, qhead_per_kvhead: int, causal: bool, deterministic: bool,
                 joint: bool = False):
    """FA4's SM90 backward object (dkv_store "accum": FA4's own class, GQA) or the routed subclass (joint:
    its dK, dV rows of the joint keys stored into the rank's own tensors), configured as
    flash_attn.cute.interface._flash_attn_bwd configures it."""
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    from cute_kernels.fa4_bwd_a2a_sm90 import FlashAttentionA2ABackwardSm90

    cfg = fa4_sm90_bwd_config(head_dim, causal)
    cls, extra = FlashAttentionBackwardSm90, {}
    if dkv_store != "accum":
        cls, extra = FlashAttentionA2ABackwardSm90, {"dkv_store": dkv_store, "joint": joint}
    return cls(
        _cute_dtype(dtype), head_dim, head_dim, qhead_per_kvhead, causal, is_local=False,
        deterministic=deterministic, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
        Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
        SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
        AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, q_subtile_factor=2,
        dQ_single_wg=cfg.dQ_single_wg, **extra,
    )


class _Scratch(NamedTuple):
    """FA4's backward buffers of one call: dPsum, the LSE in base 2, dq_accum, GQA's dk/dv_accum and
    the deterministic mode's semaphores (None where unused)."""

    dpsum: torch.Tensor
    lse_log2: torch.Tensor
    dq_accum: torch.Tensor
    dk_accum: Optional[torch.Tensor]
    dv_accum: Optional[torch.Tensor]
    dq_sem: Optional[torch.Tensor]
    dk_sem: Optional[torch.Tensor]
    dv_sem: Optional[torch.Tensor]


def _scratch(B: int, N: int, H: int, H_kv: int, D: int, tm: int, tn: int, gqa: bool, deterministic: bool,
             device, cluster: int = 1) -> _Scratch:
    """As flash_attn.cute.interface._flash_attn_bwd allocates them (D a multiple of 32): rows rounded
    up to tile_m (tile_n), with 2-CTA MMA (cluster 2) to an even number of KV blocks."""
    n_m, n_n = -(-N // tm) * tm, -(-N // tn) * tn
    if cluster == 2 and (n_n // tn) % 2:
        n_n += tn
    f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
    dpsum, lse_log2 = torch.empty(B, H, n_m, **f32), torch.empty(B, H, n_m, **f32)
    dq_accum = torch.empty(B, H, n_m * D, **f32)
    dk_accum = dv_accum = dq_sem = dk_sem = dv_sem = None
    if gqa:
        dk_accum, dv_accum = torch.zeros(B, H_kv, n_n * D, **f32), torch.zeros(B, H_kv, n_n * D, **f32)
    if deterministic:
        dq_sem = torch.zeros(B, H, n_m // tm, cluster, **i32)
        if gqa:
            dk_sem, dv_sem = torch.zeros(B, H_kv, n_n // tn, 2, **i32), torch.zeros(B, H_kv, n_n // tn, 2, **i32)
    return _Scratch(dpsum, lse_log2, dq_accum, dk_accum, dv_accum, dq_sem, dk_sem, dv_sem)


def _semaphore_tensor(t):
    """A deterministic-mode semaphore (b, h, blocks, k) int32, its last mode contiguous."""
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    return None if t is None else to_cute_tensor(t, assumed_align=4, leading_dim=3)


@disk_cache
def compile_bwd_a2a_main(dkv_store: str, dtype: torch.dtype, head_dim: int, qhead_per_kvhead: int, causal: bool,
                         has_seqused_k: bool, deterministic: bool, single_q_block: bool, single_k_block: bool,
                         joint: bool = False, extra_options: str = ""):
    """The main backward kernel of one key: dkv_store "tma" / "st" (FlashAttentionA2ABackwardSm90, dK, dV
    into the windows; qhead_per_kvhead == 1) or "accum" (FA4's FlashAttentionBackwardSm90 with fp32 dK,
    dV accumulators, GQA). single_q_block / single_k_block: one m / n block (FA4 compiles those apart).
    joint ("st" only): the J joint key rows' dK, dV go into the rank's own [B, J, h, D] tensors.
    extra_options (e.g. "--keep-ptx --dump-dir=DIR") go to the compiler."""
    gqa = dkv_store == "accum"
    if gqa != (qhead_per_kvhead > 1):
        raise ValueError(f"dkv_store: 'accum' exactly when qhead_per_kvhead > 1, got {dkv_store!r} "
                         f"with qhead_per_kvhead={qhead_per_kvhead}")
    if joint and dkv_store != "st":
        raise ValueError(f"joint: the joint key rows' dK, dV are routed by the 'st' epilogue, got {dkv_store!r}")
    fa = _main_kernel(dkv_store, dtype, head_dim, qhead_per_kvhead, causal, deterministic, joint)
    cfg = fa4_sm90_bwd_config(head_dim, causal)
    N = cfg.m_block_size if single_q_block else 640 * 2
    if single_k_block:
        N = min(N, cfg.n_block_size)
    if single_q_block != (N <= cfg.m_block_size) or single_k_block != (N <= cfg.n_block_size):
        raise ValueError("single_q_block, single_k_block: no sequence length has this pair of block counts")
    return _compile_main(fa, gqa, dtype, head_dim, qhead_per_kvhead, has_seqused_k, deterministic, N,
                         cfg.m_block_size, cfg.n_block_size, 1, extra_options, joint)


JOINT_ROWS_EXAMPLE = 77  # the fake tensors' joint rows (shapes are dynamic)


def _compile_main(fa, gqa: bool, dtype, head_dim: int, qhead_per_kvhead: int, has_seqused_k: bool,
                  deterministic: bool, N: int, tm: int, tn: int, cluster: int, extra_options: str,
                  joint: bool = False):
    """cute.compile of a main backward kernel object (FA4's or the routed one, SM90 or SM100: the same
    __call__ arguments) on fake tensors of one rank of P = 2 with N rows."""
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.testing import active_fake_mode
    from flash_attn.cute.utils import AuxData
    from torch._subclasses.fake_tensor import FakeTensorMode

    P, B, H_kv, D = 2, 1, 1, head_dim
    H = H_kv * qhead_per_kvhead
    with contextlib.nullcontext() if active_fake_mode() else FakeTensorMode():
        q = torch.empty(B, N, H, D, dtype=dtype, device="cuda")
        k = torch.empty(B, N, H_kv, D, dtype=dtype, device="cuda")
        s = _scratch(B, N, H, H_kv, D, tm, tn, gqa, deterministic, "cuda", cluster)
        seqused = torch.empty(B, dtype=torch.int32, device="cuda") if has_seqused_k else None
        if gqa:
            dk, dv = s.dk_accum, s.dv_accum
        else:
            dk = torch.empty(P, B, N // P, P * H_kv, D, dtype=dtype, device="cuda").narrow(3, 0, H_kv)
            dv = dk
        tq, tk, tdk, tdv = (to_cute_tensor(t) for t in (q, k, dk, dv))
        tdpsum, tlse, tacc = (to_cute_tensor(t) for t in (s.dpsum, s.lse_log2, s.dq_accum))
        tsk = to_cute_tensor(seqused, assumed_align=4, leading_dim=0)
        tsems = [_semaphore_tensor(t) for t in (s.dq_sem, s.dk_sem, s.dv_sem)]
        tjoint = [to_cute_tensor(torch.empty(B, JOINT_ROWS_EXAMPLE, H_kv, D, dtype=dtype, device="cuda"))
                  for _ in range(2)] if joint else []
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi {extra_options}".strip()
    if gqa:
        # FA4's backward __call__ (SM90, SM100): (..., dk, dv, scale, cu_q, cu_k, seqused_q, seqused_k,
        # window_l, window_r, dQ_sem, dK_sem, dV_sem, aux, blocksparse, cu_total_m_blocks_k, stream)
        return cute.compile(fa, tq, tk, tk, tq, tlse, tdpsum, tacc, tdk, tdv, 1.0, None, None, None, tsk, None,
                            None, *tsems, AuxData(None, None), None, None, stream, options=options)
    return cute.compile(fa, tq, tk, tk, tq, tlse, tdpsum, tacc, tdk, tdv, 1.0, tsk, tsems[0], *tjoint,
                        stream=stream, options=options)


@disk_cache
def compile_bwd_a2a_post(dtype: torch.dtype, head_dim: int, tile_m: int, num_threads: int, atom_layout: int,
                         swap_ab: bool, has_seqused: bool, joint: bool = False, extra_options: str = ""):
    """The routed postprocess of one key (FlashAttentionA2ABackwardPostprocessSm90): FA4's postprocess
    configuration of dQ (tile_m = the backward's m block, AtomLayoutMdQ, dQ_swapAB) or of GQA's dK, dV
    (n block, AtomLayoutNdKV, dKV_swapAB). joint: the J last rows (before seqused) go into the rank's own
    [B, J, h, D] tensor."""
    from cute_kernels.fa4_bwd_a2a_sm90 import FlashAttentionA2ABackwardPostprocessSm90

    fa = FlashAttentionA2ABackwardPostprocessSm90(_cute_dtype(dtype), head_dim, tile_m, num_threads, atom_layout,
                                                  swap_ab)
    return _compile_post(fa, dtype, head_dim, has_seqused, extra_options, joint)


def _compile_post(fa, dtype, head_dim: int, has_seqused: bool, extra_options: str, joint: bool = False):
    """cute.compile of a routed postprocess object (RoutedPostprocess, SM90 or SM100) on fake tensors."""
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.testing import active_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    P, B, S_loc, H_loc = 2, 1, 640, 1
    with contextlib.nullcontext() if active_fake_mode() else FakeTensorMode():
        accum = torch.empty(B, H_loc, P * S_loc * head_dim, dtype=torch.float32, device="cuda")
        windows = torch.empty(P, B, S_loc, P * H_loc, head_dim, dtype=dtype, device="cuda").narrow(3, 0, H_loc)
        seqused = torch.empty(B, dtype=torch.int32, device="cuda") if has_seqused else None
        tacc, twin = to_cute_tensor(accum), to_cute_tensor(windows)
        tsu = to_cute_tensor(seqused, assumed_align=4, leading_dim=0)
        tjoint = [to_cute_tensor(torch.empty(B, JOINT_ROWS_EXAMPLE, H_loc, head_dim, dtype=dtype, device="cuda"))
                  ] if joint else []
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(fa, tacc, twin, 1.0, tsu, *tjoint, stream=stream,
                        options=f"--enable-tvm-ffi {extra_options}".strip())


# ---- SM100 (cute_kernels.fa4_bwd_a2a_sm100) ---------------------------------------------------------
SM100_BWD_TILES = (128, 128)  # FA4's SM100 backward: tile_m, tile_n (per CTA)


def fa4_sm100_bwd_2cta(head_dim: int) -> bool:
    """Whether FA4's SM100 backward runs 2-CTA MMA (cluster of 2) for this head dim: D >= 128 unless
    FA_DISABLE_2CTA (flash_attn.cute.interface._flash_attn_bwd)."""
    from flash_attn.cute import utils

    return head_dim >= 128 and not utils._get_disable_2cta_default()


@disk_cache
def compile_bwd_a2a_main_sm100(dkv_store: str, dtype: torch.dtype, head_dim: int, qhead_per_kvhead: int,
                               causal: bool, has_seqused_k: bool, deterministic: bool, use_2cta: bool,
                               joint: bool = False, extra_options: str = ""):
    """The SM100 main backward kernel of one key: dkv_store "st" (FlashAttentionA2ABackwardSm100, dK, dV
    into the windows; qhead_per_kvhead == 1) or "accum" (FA4's FlashAttentionBackwardSm100 with fp32 dK,
    dV accumulators, GQA), configured as flash_attn.cute.interface._flash_attn_bwd configures it.
    joint ("st" only): the J joint key rows' dK, dV go into the rank's own [B, J, h, D] tensors."""
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    from cute_kernels.fa4_bwd_a2a_sm100 import FlashAttentionA2ABackwardSm100

    gqa = dkv_store == "accum"
    if dkv_store not in ("st", "accum") or gqa != (qhead_per_kvhead > 1):
        raise ValueError(f"dkv_store: 'st', or 'accum' exactly when qhead_per_kvhead > 1, got {dkv_store!r} "
                         f"with qhead_per_kvhead={qhead_per_kvhead}")
    if joint and gqa:
        raise ValueError("joint: the joint key rows' dK, dV are routed by the 'st' epilogue (GQA: the postprocess)")
    tm, tn = SM100_BWD_TILES
    cluster = 2 if use_2cta else 1
    fa = (FlashAttentionBackwardSm100 if gqa else FlashAttentionA2ABackwardSm100)(
        head_dim, head_dim, is_causal=causal, is_local=False, qhead_per_kvhead=qhead_per_kvhead, tile_m=tm,
        tile_n=tn, cluster_size=cluster, use_2cta_instrs=use_2cta, deterministic=deterministic,
        spt=causal and deterministic, q_subtile_factor=2, kv_subtile_factor=1, **({"joint": True} if joint else {}),
    )
    return _compile_main(fa, gqa, dtype, head_dim, qhead_per_kvhead, has_seqused_k, deterministic, 4 * tn, tm, tn,
                         cluster, extra_options, joint)


@disk_cache
def compile_bwd_a2a_post_sm100(dtype: torch.dtype, head_dim: int, of_dq: bool, use_2cta: bool, has_seqused: bool,
                               joint: bool = False, extra_options: str = ""):
    """The routed SM100 postprocess of one key (FlashAttentionA2ABackwardPostprocessSm100) with FA4's
    postprocess configuration: dQ (of_dq: tile_m, 2-CTA as the main kernel, its dQ tile order) or GQA's
    dK, dV (tile_n, its dK/dV tile order). joint: the J last rows (before seqused) go into the rank's own
    [B, J, h, D] tensor."""
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    from cute_kernels.fa4_bwd_a2a_sm100 import FlashAttentionA2ABackwardPostprocessSm100

    tm, tn = SM100_BWD_TILES
    dq_order, dkv_order = FlashAttentionBackwardSm100.accum_tile_orders(use_2cta, tn)
    fa = FlashAttentionA2ABackwardPostprocessSm100(_cute_dtype(dtype), head_dim, tm if of_dq else tn,
                                                   use_2cta and of_dq, dq_order if of_dq else dkv_order)
    return _compile_post(fa, dtype, head_dim, has_seqused, extra_options, joint)


# ---- the launcher -----------------------------------------------------------------------------------
def _check_heads(name: str, t, B: int, N: int, D: int, dtype, device, heads: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"{name}: expected a tensor [B, N, H, D]")
    if t.dtype not in DTYPES or t.dtype != dtype:
        raise ValueError(f"{name}: dtype must be q's (bfloat16 or float16), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: must be on q's device ({device})")
    if t.shape[0] != B or t.shape[1] != N or t.shape[3] != D or (heads is not None and t.shape[2] != heads):
        want = f"[{B}, {N}, {'H' if heads is None else heads}, {D}]"
        raise ValueError(f"{name}: expected {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _check_windows(name: str, w, x: torch.Tensor, rank: int, joint_len: int = 0) -> None:
    """w [P, B, S_loc, P * h_loc, D] of x [B, P * S_loc + joint_len, h_loc, D]: each window contiguous, the
    window stride a multiple of 16 bytes, a 16-byte aligned base."""
    if not isinstance(w, torch.Tensor) or w.dim() != 5:
        raise ValueError(f"{name}: expected a tensor [P, B, S_loc, P * heads, D]")
    P, B, S_loc, H, D = w.shape
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{name}: must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
    if B != x.shape[0] or D != x.shape[3] or P * S_loc != x.shape[1] - joint_len or H != P * x.shape[2]:
        raise ValueError(f"{name}: expected [P, {x.shape[0]}, S_loc, P * {x.shape[2]}, {x.shape[3]}] with "
                         f"P * S_loc = {x.shape[1] - joint_len}, got {tuple(w.shape)}")
    check_rank(rank, P)
    if w.stride()[1:] != (S_loc * H * D, H * D, D, 1):
        raise ValueError(f"{name}: each window {name}[d] must be a contiguous [B, S_loc, H, D]")
    if P > 1 and not aligned16(w, 0, dims=(0,)):
        raise ValueError(f"{name}: the window stride (dim 0) must be a multiple of 16 bytes")
    if not aligned16(w, _address(w), dims=()):
        raise ValueError(f"{name}: the base address must be 16-byte aligned")


def _overlapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte (same storage, overlapping element ranges)."""
    if a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    lo_a, lo_b = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes


def fa4_bwd_a2a_launcher(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dq_windows: torch.Tensor,
    dk_windows: torch.Tensor,
    dv_windows: torch.Tensor,
    rank: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    dkv_store: Optional[str] = None,
    joint: Optional[tuple] = None,
) -> Callable[[], None]:
    """FA4's backward (SM90 or SM100) of rank `rank` with the post-A2A of dq, dk, dv in its kernels,
    checked and compiled once: the returned function launches it on the current stream (preprocess, main kernel,
    postprocesses; FA4's scratch is allocated here once and reused, so one launch at a time).

    q, out, dout [B, N, H_loc, D]; k, v [B, N, H_kv_loc, D] (rows in slot order, N = P * S_loc, all
    contiguous); lse [B, H_loc, N] fp32, the forward's (natural log). dq_windows [P, B, S_loc, P*H_loc, D],
    dk_windows, dv_windows [P, B, S_loc, P*H_kv_loc, D] (window d is rank d's buffer, any window stride
    that is a multiple of 16 bytes). Writes dq_windows[s // S_loc][b, s % S_loc, rank * H_loc + h] =
    dq[b, s, h], and dk, dv likewise at heads rank * H_kv_loc + h; rows >= seqused_k of dk, dv are not
    written. Stores are left to drain: the consumer needs a barrier after it (module docstring).
    deterministic: FA4's deterministic mode (dQ and GQA's dK, dV summed in a fixed order).
    dkv_store: "tma" | "st" | None (auto: "tma" when S_loc is a multiple of the backward's tile_n and
    there is no seqused_k; SM100 takes "st" only); with GQA dK, dV go through the postprocess and it has
    no effect.
    The rows of k must be in slot order (key row s = sequence row s): ulysses.layout's key order is
    that when the padding is a suffix.
    joint (not causal): (djq [B, J, H_loc, D], djk, djv [B, J, H_kv_loc, D]), the rank's own contiguous
    tensors, apart from each other and from q, k, v, out, dout (seqused_k, a device value, is not read
    here: with joint rows it must be S + J):
    the rows then hold J joint rows too, N = P * S_loc + J (ulysses.layout: query rows [sequence slots,
    joint], key rows [S valid keys, joint, padding keys], S = seqused_k - J or P * S_loc): query rows
    >= P * S_loc go to djq (row P * S_loc + j to djq[:, j]), key rows S .. S + J - 1 to djk, djv, the
    others to the windows as above ("st" dK/dV stores)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a tensor [B, N, H, D]")
    B, N, H_loc, D = q.shape
    if q.dtype not in DTYPES:
        raise ValueError(f"q: dtype must be bfloat16 or float16, got {q.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim must be one of {HEAD_DIMS}, got {D}")
    if q.device.type != "cuda":
        raise ValueError(f"q: must be a CUDA tensor (SM90 or SM100), got device {q.device}")
    _check_heads("q", q, B, N, D, q.dtype, q.device)
    _check_heads("k", k, B, N, D, q.dtype, q.device)
    _check_heads("v", v, B, N, D, q.dtype, q.device, heads=k.shape[2])
    _check_heads("out", out, B, N, D, q.dtype, q.device, heads=H_loc)
    _check_heads("dout", dout, B, N, D, q.dtype, q.device, heads=H_loc)
    if H_loc % k.shape[2]:
        raise ValueError(f"k: {k.shape[2]} KV heads do not divide q's {H_loc} heads")
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != (B, H_loc, N)
            or not lse.is_contiguous() or lse.device != q.device):
        raise ValueError(f"lse: expected a contiguous float32 [{B}, {H_loc}, {N}] on {q.device}")
    arch = device_arch(q)  # 90 or 100 (ValueError naming q otherwise)
    J = 0
    if joint is not None:
        if not isinstance(joint, (tuple, list)) or len(joint) != 3:
            raise ValueError("joint: expected (djq, djk, djv)")
        if causal:
            raise ValueError("joint: causal masking with joint rows is not defined (ulysses.layout)")
        J = joint[0].shape[1] if isinstance(joint[0], torch.Tensor) and joint[0].dim() == 4 else -1
        if not 0 < J < N:
            raise ValueError(f"joint: djq must be [B, J, H_loc, D] with 0 < J < {N}")
        for name, t, heads in zip(("djq", "djk", "djv"), joint, (H_loc, k.shape[2], k.shape[2])):
            _check_heads(f"joint {name}", t, B, J, D, q.dtype, q.device, heads=heads)
            if not aligned16(t, _address(t), dims=()):
                raise ValueError(f"joint {name}: the base address must be 16-byte aligned")
        named = list(zip(("djq", "djk", "djv"), joint)) + [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)]
        for i, (name, t) in enumerate(named[:3]):
            for other, u in named[i + 1:]:
                if _overlapping(t, u):
                    raise ValueError(f"joint {name}: overlaps {other} (the kernels write it while reading the others)")
    _check_windows("dq_windows", dq_windows, q, rank, J)
    _check_windows("dk_windows", dk_windows, k, rank, J)
    _check_windows("dv_windows", dv_windows, v, rank, J)
    if dk_windows.shape[0] != dq_windows.shape[0] or dv_windows.shape[0] != dq_windows.shape[0]:
        raise ValueError("dk_windows, dv_windows: must have dq_windows' P")
    if seqused_k is not None and (not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32
                                  or tuple(seqused_k.shape) != (B,) or seqused_k.device != q.device):
        raise ValueError(f"seqused_k: expected int32 of shape ({B},) on {q.device}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic: expected a bool, got {deterministic!r}")
    H_kv_loc, S_loc = k.shape[2], dq_windows.shape[2]
    qpk = H_loc // H_kv_loc
    if arch == 100:
        (tm, tn), use_2cta = SM100_BWD_TILES, fa4_sm100_bwd_2cta(D)
        cluster = 2 if use_2cta else 1
        tma_ok = False  # the routed SM100 epilogue stores per thread (cute_kernels.fa4_bwd_a2a_sm100)
    else:
        cfg = fa4_sm90_bwd_config(D, causal)
        tm, tn, cluster = cfg.m_block_size, cfg.n_block_size, 1
        tma_ok = S_loc % tn == 0 and seqused_k is None and not J  # (joint rows: per-thread stores)
    if dkv_store is None:
        dkv_store = "tma" if tma_ok else "st"
    elif dkv_store not in DKV_STORES or (dkv_store == "tma" and not tma_ok):
        raise ValueError(f"dkv_store: {dkv_store!r} is not 'st', or 'tma' on SM90 with S_loc a multiple of {tn} "
                         f"(the backward's tile_n), no seqused_k and no joint rows")
    if qpk > 1:
        dkv_store = "accum"
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    has_sk = seqused_k is not None
    post_dkv = None
    with_joint = {"joint": True} if J else {}  # (the keys of calls without joint rows as they were)
    if arch == 100:
        main = compile_bwd_a2a_main_sm100(dkv_store, q.dtype, D, qpk, bool(causal), has_sk, deterministic, use_2cta,
                                          **(with_joint if qpk == 1 else {}))
        post_dq = compile_bwd_a2a_post_sm100(q.dtype, D, True, use_2cta, False, **with_joint)
        if qpk > 1:
            post_dkv = compile_bwd_a2a_post_sm100(q.dtype, D, False, use_2cta, has_sk, **with_joint)
    else:
        main = compile_bwd_a2a_main(dkv_store, q.dtype, D, qpk, bool(causal), has_sk, deterministic, N <= tm, N <= tn,
                                    **(with_joint if qpk == 1 else {}))
        post_dq = compile_bwd_a2a_post(q.dtype, D, tm, 128 if cfg.dQ_single_wg else cfg.num_wg * 128,
                                       cfg.AtomLayoutMdQ, cfg.dQ_swapAB, False, **with_joint)
        if qpk > 1:
            post_dkv = compile_bwd_a2a_post(q.dtype, D, tn, cfg.num_wg * 128, cfg.AtomLayoutNdKV, cfg.dKV_swapAB,
                                            has_sk, **with_joint)
    s = _scratch(B, N, H_loc, H_kv_loc, D, tm, tn, qpk > 1, deterministic, q.device, cluster)
    from flash_attn.cute.cute_dsl_utils import torch2cute_dtype_map
    from flash_attn.cute.interface import _bwd_preprocess

    def preprocess(compile_only: bool = False):
        # FA4's own: dPsum = rowsum(dO * O), the LSE in base 2, dq_accum zeroed (its compile cache;
        # fake_mode: compile, do not launch)
        _bwd_preprocess(out, dout, s.dpsum, lse, s.lse_log2, s.dq_accum, None, None, None,
                        torch2cute_dtype_map[q.dtype], D, D, tm, fake_mode=compile_only, hdim_multiple_of=32)

    preprocess(compile_only=True)
    if _is_fake(q):
        return lambda: None
    dq_dst = dq_windows.narrow(3, rank * H_loc, H_loc)
    dk_dst = dk_windows.narrow(3, rank * H_kv_loc, H_kv_loc)
    dv_dst = dv_windows.narrow(3, rank * H_kv_loc, H_kv_loc)
    # Every parameter passed, the absent ones as None: a function loaded from the disk cache takes all of
    # them positionally (cute_kernels.compile_cache).
    djq, djk, djv = joint if J else (None, None, None)
    if qpk > 1:
        main_args = (q, k, v, dout, s.lse_log2, s.dpsum, s.dq_accum, s.dk_accum, s.dv_accum, scale, None, None,
                     None, seqused_k, None, None, s.dq_sem, s.dk_sem, s.dv_sem, (None, None), None, None)
    else:
        main_args = (q, k, v, dout, s.lse_log2, s.dpsum, s.dq_accum, dk_dst, dv_dst, scale, seqused_k, s.dq_sem,
                     djk, djv)
    zero = [t for t in (s.dk_accum, s.dv_accum, s.dq_sem, s.dk_sem, s.dv_sem) if t is not None]

    def launch() -> None:
        for t in zero:
            t.zero_()
        preprocess()
        main(*main_args)
        post_dq(s.dq_accum, dq_dst, scale, None, djq)
        if post_dkv is not None:
            post_dkv(s.dk_accum, dk_dst, scale, seqused_k, djk)
            post_dkv(s.dv_accum, dv_dst, 1.0, seqused_k, djv)

    return launch


def fa4_bwd_a2a(q, k, v, out, dout, lse, dq_windows, dk_windows, dv_windows, rank: int, **kwargs) -> None:
    """fa4_bwd_a2a_launcher(...)() : one fused backward (see the launcher for the arguments)."""
    fa4_bwd_a2a_launcher(q, k, v, out, dout, lse, dq_windows, dk_windows, dv_windows, rank, **kwargs)()
