"""Torch entry points of the attention kernels: plain FA4 and FA4 with the fused post-A2A.

Both compile FA4's forward class for the device's architecture (or its rank-window subclass)
with FA4's own tile configuration, once per compile key (compile_fa4: its arguments are the key;
SM100 keys carry FA4's SM100 configuration, so the two never share a kernel), and launch on the
current stream through TVM-FFI (torch tensors are passed as they are; shapes and strides are
dynamic). No host sync: both are CUDA-graph capturable. Architectures: SM90 (compute capability
9.0) and SM100 / SM103 (10.x), picked from q's device (for fake tensors: the CuTe DSL's target,
CUTE_DSL_ARCH). fa4_launcher / fa4_a2a_launcher check and compile once and return the launch
itself, for callers that rerun the same buffers (the op's window plan).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, NamedTuple, Optional

import torch

from cute_kernels.compile_cache import disk_cache, disk_value
from cute_kernels.limits import DTYPES, HEAD_DIMS, aligned16, check_softmax_scale
from cute_kernels.limits import address as _address, is_fake as _is_fake
from ulysses.layout import check_rank


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected [B, S, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype must be bfloat16 or float16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"k, v: dtype must match q ({q.dtype}), got {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v: must be on one device")
    if q.device.type != "cuda":
        raise ValueError(f"q: must be a CUDA tensor (SM90 or SM100), got device {q.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q: head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in B or D")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"k: {k.shape[2]} KV heads do not divide {q.shape[2]} query heads")


def _check_scalars(causal, softmax_scale, rotate=False) -> None:
    """causal / rotate bools (a truthy string would turn the mask on), softmax_scale as the op takes it."""
    if type(causal) is not bool or type(rotate) is not bool:  # (bool has no subclasses)
        name, flag = ("causal", causal) if type(causal) is not bool else ("rotate", rotate)
        raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if softmax_scale is not None:
        check_softmax_scale(softmax_scale)


def _check_seqused_k(seqused_k: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if seqused_k is None:
        return
    if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 or seqused_k.shape != (q.shape[0],):
        raise ValueError(f"seqused_k: expected int32 of shape ({q.shape[0]},)")
    if seqused_k.device != q.device:
        raise ValueError("seqused_k: must be on q's device")


class Sm90Config(NamedTuple):
    tile_m: int
    tile_n: int
    intra_wg_overlap: bool
    mma_pv_is_rs: bool


@disk_value
def fa4_sm90_config(head_dim: int, causal: bool) -> Sm90Config:
    """FA4's SM90 forward configuration for this head dim (head_dim_v = head_dim, no local window):
    flash_attn.cute.interface._tile_size_fwd_sm90, the one table FA4 itself uses, read once per
    machine (kept with the compile cache: a warm process does not import FA4's package for it).
    The fused kernels and the tile geometry (fa_a2a.engine.tiles.fa4_tile_shape) take their tiles from here.
    For d = 128: 128 x 128 tiles."""
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    cfg = _tile_size_fwd_sm90(head_dim, head_dim, causal, False)
    return Sm90Config(int(cfg.m_block_size), int(cfg.n_block_size), bool(cfg.intra_wg_overlap),
                      bool(cfg.mma_pv_is_rs))


def _make_kernel(kernel_cls, dtype, head_dim, qhead_per_kvhead, causal, **extra):
    import cutlass

    cfg = fa4_sm90_config(head_dim, causal)
    cute_dtype = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    return kernel_cls(
        cute_dtype,
        head_dim,
        head_dim,
        qhead_per_kvhead,
        is_causal=causal,
        is_local=False,
        pack_gqa=False,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        num_stages=2,
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs,
        **extra,
    )


def tile_m_for(head_dim: int, causal: bool = False, arch: int = 90) -> int:
    """Rows per output tile (one TMA store) that FA4 and the fused kernel use on `arch`
    (90 or 100): SM90's tile_m for the head dim; on SM100 each Q stage, 128 rows."""
    if arch == 100:
        return SM100_TILE_M
    return fa4_sm90_config(head_dim, causal).tile_m


def device_arch(q: torch.Tensor) -> int:
    """90 for SM90, 100 for SM100 / SM103: from q's device, or the CuTe DSL target for fake tensors."""
    if _is_fake(q):
        from cutlass.cutlass_dsl import BaseDSL

        target = BaseDSL._get_dsl().get_arch_enum()
        major, minor = target.major, target.minor
    else:
        major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) == (9, 0):
        return 90
    if major == 10:
        return 100
    raise ValueError(f"q: device of compute capability 9.0 (SM90) or 10.x (SM100/SM103) expected, "
                     f"got {major}.{minor}")


SM100_TILE_M = 128


class Sm100Config(NamedTuple):
    q_stage: int
    use_2cta_instrs: bool
    is_static_persistent: bool
    use_clc_scheduler: bool
    use_s_ping_pong: bool


def _config_sm100(head_dim: int, causal: bool, seqlen_q: int, qhead_per_kvhead: int,
                  varlen_k: bool) -> Sm100Config:
    """FA4's SM100 forward choices (flash_attn.cute.interface, 4.0.0b36) for dense q without
    pack_gqa, split-KV, windows or score/mask mods: 128x128 tiles, two Q stages when S > 128,
    2-CTA MMA for D=128 non-causal beyond one work tile, the static persistent scheduler when
    non-causal (or one work tile), CLC and S ping-pong as FA4 decides them; FA4's environment
    knobs (FA_CLC, FA_DISABLE_2CTA, FA_DISABLE_S_PING_PONG) are read through FA4's own helpers."""
    from flash_attn.cute import utils

    q_stage = 2 if seqlen_q > SM100_TILE_M else 1
    one_block = seqlen_q <= q_stage * SM100_TILE_M
    use_2cta = (not utils._get_disable_2cta_default(is_fwd=True) and not one_block
                and not causal and head_dim == 128)
    use_clc = (utils._get_use_clc_scheduler_default() and not (varlen_k and qhead_per_kvhead == 1)
               and not (not varlen_k and not causal))
    use_s_ping_pong = not utils._get_disable_s_ping_pong_default() and q_stage == 1
    return Sm100Config(q_stage, use_2cta, not causal or one_block, use_clc, use_s_ping_pong)


def _make_kernel_sm100(kernel_cls, head_dim, qhead_per_kvhead, causal, cfg: Sm100Config, **extra):
    return kernel_cls(
        head_dim,
        head_dim,
        qhead_per_kvhead=qhead_per_kvhead,
        is_causal=causal,
        is_local=False,
        pack_gqa=False,
        m_block_size=SM100_TILE_M,
        n_block_size=128,
        q_stage=cfg.q_stage,
        is_static_persistent=cfg.is_static_persistent,
        use_2cta_instrs=cfg.use_2cta_instrs,
        use_clc_scheduler=cfg.use_clc_scheduler,
        use_s_ping_pong=cfg.use_s_ping_pong,
        **extra,
    )


def _no_aux(compiling: bool):
    """FA4's empty AuxData: the class itself to compile (FA4's __call__ reads its fields); to
    launch, the plain tuple TVM-FFI turns it into anyway (so a launch of a loaded kernel does not
    import FA4's package)."""
    if not compiling:
        return (None, None)
    from flash_attn.cute.utils import AuxData

    return AuxData(None, None)


def _fa4_sm100_middle(seqused_k, compiling: bool = False):
    """FA4 SM100 __call__'s arguments between softmax_scale and stream (only seqused_k set)."""
    return (None, None, None, seqused_k, None, None, None, None, None, None, _no_aux(compiling),
            None, None, None, None, None, None, None, None)


def _fa4_sm90_middle(seqused_k, compiling: bool = False):
    """FA4 SM90 __call__'s arguments between softmax_scale and stream (only seqused_k set):
    (cu_q, cu_k, seqused_q, seqused_k, page_table, window_l, window_r, sink, blocksparse, aux,
    cu_total_m, cu_total_splits)."""
    return (None, None, None, seqused_k, None, None, None, None, None, _no_aux(compiling), None, None)


def _example_tensors(kind: str, dtype, head_dim: int, qhead_per_kvhead: int, has_seqused_k: bool,
                     has_lse: bool, timestamps: bool, keep_o: bool = False):
    """Fake tensors of one compile key's shape class (shapes and strides are dynamic in the kernel):
    q, k, v, the output (O, or the source rank's slice of the rank windows), lse, seqused_k, times,
    the kept local O (keep_o: a slice of a longer [B, N, H_loc, D], as the op's joint rows leave it)."""
    P, B, S_loc, H_kv, D = 2, 1, 256, 1, head_dim
    H_loc = H_kv * qhead_per_kvhead
    dev = "cuda"
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device=dev)
    k = torch.empty(B, P * S_loc, H_kv, D, dtype=dtype, device=dev)
    seqused = torch.empty(B, dtype=torch.int32, device=dev) if has_seqused_k else None
    if kind == "fa4":
        out = torch.empty_like(q)
        lse = torch.empty(B, H_loc, P * S_loc, dtype=torch.float32, device=dev) if has_lse else None
    else:
        out = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device=dev).narrow(3, 0, H_loc)
        lse = (torch.empty(P, B, P * H_loc, S_loc, dtype=torch.float32, device=dev).narrow(2, 0, H_loc)
               if has_lse else None)
    times = torch.empty(B, H_loc, 4, 7, dtype=torch.int64, device=dev) if timestamps else None
    o_local = (torch.empty(B, P * S_loc + 8, H_loc, D, dtype=dtype, device=dev).narrow(1, 0, P * S_loc)
               if keep_o else None)
    return q, k, torch.empty_like(k), out, lse, seqused, times, o_local


@disk_cache
def compile_fa4(kind: str, dtype: torch.dtype, head_dim: int, qhead_per_kvhead: int, causal: bool,
                has_seqused_k: bool, has_lse: bool, timestamps: bool = False, rotate: bool = False,
                sm100: Optional[Sm100Config] = None, extra_options: str = "", keep_o: bool = False):
    """The compiled attention kernel of one key (the arguments are the key): kind "fa4" (FA4's own
    forward), "a2a-tma" / "a2a-st" (the rank-window subclass and its O path) or "a2a-paced" /
    "a2a-paced-st" (its TMA / st path with the store pacer, SM90: cute_kernels.fa4_a2a_paced_sm90); for SM90, or for
    SM100 when `sm100` (FA4's SM100 configuration of the call) is given. timestamps: SM90's stamped
    debug build. rotate: the fused kernels' rank-rotated tile order (launched with the rank after
    the optional tensors). keep_o: the SM90 fused kernel that also stores O into the rank's own O
    (launched with it last). Compiled as FA4 compiles ahead of time, from fake tensors of the key's
    shape class (shapes and strides dynamic, 16-byte aligned), so no GPU is needed; the result
    launches on the current stream through TVM-FFI. extra_options (e.g. "--keep-ptx --dump-dir=DIR") go to the
    compiler."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.testing import active_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    paced = kind.startswith("a2a-paced")
    with contextlib.nullcontext() if active_fake_mode() else FakeTensorMode():
        example = _example_tensors(kind, dtype, head_dim, qhead_per_kvhead, has_seqused_k, has_lse, timestamps,
                                   keep_o)
        tq, tk, tv, to = [to_cute_tensor(t) for t in example[:4]]
        tlse = to_cute_tensor(example[4], assumed_align=4)
        tsk = to_cute_tensor(example[5], assumed_align=4, leading_dim=0)
        ttimes = to_cute_tensor(example[6], assumed_align=8)
        to_local = to_cute_tensor(example[7])
        tpace = to_cute_tensor(torch.empty(3, dtype=torch.int64, device="cuda"), assumed_align=8) if paced else None
    if rotate and kind == "fa4":
        raise ValueError("rotate: only the fused kernels (kind 'a2a-*') have the rank-rotated order")
    if paced and (rotate or sm100 is not None):
        raise ValueError("kind: the paced kernel is SM90 only, without the rank-rotated order")
    if keep_o and (paced or sm100 is not None or not kind.startswith("a2a-")):
        raise ValueError("keep_o: the SM90 fused kernels' (kind 'a2a-tma' / 'a2a-st') local O store")
    rank = cutlass.Int32(0) if rotate else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi {extra_options}".strip()
    if sm100 is not None:
        from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

        from cute_kernels.fa4_a2a_sm100 import FlashAttentionA2AForwardSm100

        if kind == "fa4":
            fa = _make_kernel_sm100(FlashAttentionForwardSm100, head_dim, qhead_per_kvhead, causal, sm100)
            # FA4 SM100 __call__: (q, k, v, o, lse, scale, <_fa4_sm100_middle>, stream)
            return cute.compile(fa, tq, tk, tv, to, tlse, 1.0, *_fa4_sm100_middle(tsk, True), stream=stream,
                                options=options)
        fa = _make_kernel_sm100(FlashAttentionA2AForwardSm100, head_dim, qhead_per_kvhead, causal, sm100,
                                o_store=kind.removeprefix("a2a-"), rotate=rotate)
        return cute.compile(fa, tq, tk, tv, to, tlse, 1.0, tsk, rank, stream=stream, options=options)
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from cute_kernels.fa4_a2a_sm90 import FlashAttentionA2AForwardSm90

    if kind == "fa4":
        fa = _make_kernel(FlashAttentionForwardSm90, dtype, head_dim, qhead_per_kvhead, causal)
        # FA4 SM90 __call__: (q, k, v, o, lse, scale, <_fa4_sm90_middle>, stream)
        return cute.compile(fa, tq, tk, tv, to, tlse, 1.0, *_fa4_sm90_middle(tsk, True), stream, options=options)
    if paced:
        from cute_kernels.fa4_a2a_paced_sm90 import FlashAttentionA2APacedForwardSm90 as kernel_cls
    else:
        kernel_cls = FlashAttentionA2AForwardSm90
    fa = _make_kernel(kernel_cls, dtype, head_dim, qhead_per_kvhead, causal,
                      o_store=PACED_O_STORE[kind] if paced else kind.removeprefix("a2a-"), timestamps=timestamps,
                      rotate=rotate, keep_o=keep_o)
    return cute.compile(fa, tq, tk, tv, to, tlse, 1.0, tsk, ttimes, rank, tpace, to_local, stream=stream,
                        options=options)


PACED_O_STORE = {"a2a-paced": "tma", "a2a-paced-st": "st"}  # the paced kernel's compile kinds -> O path


def _scale(softmax_scale: Optional[float], head_dim: int) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def _check_lse(lse, q: torch.Tensor, name: str) -> None:
    """An LSE output of q [B, S, H, D]'s rows: float32 [B, H, S] on q's device, last dim contiguous."""
    B, S, H, _ = q.shape
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != (B, H, S)
            or lse.stride(-1) != 1 or lse.device != q.device):
        raise ValueError(f"{name}: expected float32 [{B}, {H}, {S}] on {q.device} with contiguous last dim, "
                         f"got {getattr(lse, 'dtype', type(lse).__name__)} {tuple(getattr(lse, 'shape', ()))}")


def _fa4_bound(q, k, v, out, causal, softmax_scale, seqused_k, lse) -> tuple:
    """fa4_launcher's checks and compile -> (compiled, its arguments; out at ARG_OUT, lse at ARG_LSE)."""
    _check_qkv(q, k, v)
    _check_scalars(causal, softmax_scale)
    _check_seqused_k(seqused_k, q)
    if lse is not None:
        _check_lse(lse, q, "lse")
    if (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
            or out.stride(-1) != 1 or out.device != q.device):
        raise ValueError(f"out: expected {tuple(q.shape)} {q.dtype} on {q.device} with contiguous last dim")
    return _fa4_compiled(q, k, v, out, causal, softmax_scale, seqused_k, lse)


def _fa4_compiled(q, k, v, out, causal, softmax_scale, seqused_k, lse) -> tuple:
    """_fa4_bound without its checks."""
    B, S, H, D = q.shape
    scale = _scale(softmax_scale, D)
    key = ("fa4", q.dtype, D, H // k.shape[2], causal, seqused_k is not None, lse is not None)
    if device_arch(q) == 100:
        cfg = _config_sm100(D, causal, S, H // k.shape[2], seqused_k is not None)
        compiled = compile_fa4(*key, sm100=cfg)
        return compiled, (q, k, v, out, lse, scale, *_fa4_sm100_middle(seqused_k))
    return compile_fa4(*key), (q, k, v, out, lse, scale, *_fa4_sm90_middle(seqused_k))


ARG_OUT, ARG_LSE = 3, 4  # where the compiled forward takes out and lse


def fa4_launcher(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Callable[[], None]:
    """Plain FA4 forward (SM90 or SM100) on these tensors, checked and compiled once: the returned
    function launches it on the current stream (for a caller that reruns the same buffers, e.g.
    the op's window plan: no per-call checks). q [B, S_q, H, D], k/v [B, S_k, H_kv, D], out like q;
    lse: optional fp32 [B, H, S_q] output of the rows' log-sum-exp (natural log)."""
    compiled, args = _fa4_bound(q, k, v, out, causal, softmax_scale, seqused_k, lse)
    return (lambda: None) if _is_fake(q) else functools.partial(compiled, *args)


def fa4_into_launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_like: torch.Tensor, *,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      seqused_k: Optional[torch.Tensor] = None,
                      lse_like: Optional[torch.Tensor] = None) -> Callable[..., None]:
    """fa4_forward on these fixed q, k, v (e.g. a window plan's), checked and compiled once against
    out_like (and lse_like): each launch(out) (launch(out, lse) with lse_like) writes FA4's output into
    the out (and lse) it is given, tensors of out_like's (lse_like's) shape, dtype and strides: e.g.
    fresh ones of each call that a backward keeps (no per-call checks or binding)."""
    compiled, args = _fa4_bound(q, k, v, out_like, causal, softmax_scale, seqused_k, lse_like)
    if _is_fake(q):
        return lambda out, lse=None: None
    head, tail = args[:ARG_OUT], args[ARG_LSE + 1:]

    def launch(out: torch.Tensor, lse: Optional[torch.Tensor] = None) -> None:
        compiled(*head, out, lse, *tail)

    return launch


def fa4_fresh_launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       softmax_scale: Optional[float] = None, seqused_k: Optional[torch.Tensor] = None,
                       lse: bool = False) -> Callable[[], object]:
    """fa4_forward on these fixed q, k, v (e.g. a window plan's), checked and compiled once: each call of
    the returned function launches FA4 into a fresh output (torch.empty_like(q)) and returns it (the
    P = 1 block's attention: no per-call checks or binding); lse=True: a fresh fp32 [B, H, S_q] LSE too,
    the call returns (out, lse) (the forward that keeps them for its backward: no copies)."""
    fresh_lse = None
    if isinstance(q, torch.Tensor):  # (a non-tensor q: _fa4_bound names it)
        out = torch.empty_like(q)
        if lse:
            fresh_lse = q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    else:
        out = None
    into = fa4_into_launcher(q, k, v, out, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k,
                             lse_like=fresh_lse)

    def launch() -> torch.Tensor:
        out = torch.empty_like(q)
        into(out)
        return out

    def launch_with_lse() -> tuple:
        out, lse_out = torch.empty_like(q), torch.empty_like(fresh_lse)
        into(out, lse_out)
        return out, lse_out

    return launch_with_lse if lse else launch


def fa4_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain FA4 forward (SM90 or SM100): q [B, S_q, H, D], k/v [B, S_k, H_kv, D] -> out [B, S_q, H, D].

    lse: optional fp32 [B, H, S_q] output of the rows' log-sum-exp (natural log)."""
    if out is None and isinstance(q, torch.Tensor):
        out = torch.empty_like(q)
    fa4_launcher(q, k, v, out, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k, lse=lse)()
    return out


def fa4_forward_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                          softmax_scale: Optional[float], seqused_k: Optional[torch.Tensor]) -> torch.Tensor:
    """fa4_forward without its per-call checks, for a caller whose arguments passed them already: the op's
    local attention (fa_a2a.engine.forward.local_attention: every argument checked once per call signature
    by fa_a2a.engine.problem.check_call, contiguous q, k, v, seqused_k built there). Saves the checks'
    host time on every eager call."""
    out = torch.empty_like(q)
    if not _is_fake(q):
        compiled, args = _fa4_compiled(q, k, v, out, causal, softmax_scale, seqused_k, None)
        compiled(*args)
    return out


def check_windows(out_windows: torch.Tensor, q: torch.Tensor, rank: int) -> None:
    """Validate a rank-window output [P, B, S_loc, H, D] against q [B, S, H_loc, D]."""
    if not isinstance(out_windows, torch.Tensor) or out_windows.dim() != 5:
        raise ValueError("out_windows: expected a tensor [P, B, S_loc, H, D]")
    P, B, S_loc, H, D = out_windows.shape
    H_loc = q.shape[2]
    if out_windows.dtype != q.dtype:
        raise ValueError(f"out_windows: dtype {out_windows.dtype} must equal q's {q.dtype}")
    if out_windows.device != q.device:
        raise ValueError("out_windows: must be on q's device")
    if B != q.shape[0] or D != q.shape[3]:
        raise ValueError(f"out_windows: B and D {B, D} must match q's {q.shape[0], q.shape[3]}")
    if P * S_loc != q.shape[1]:
        raise ValueError(f"out_windows: P * S_loc = {P}*{S_loc} must equal q's sequence length {q.shape[1]}")
    if H != P * H_loc:
        raise ValueError(f"out_windows: H = {H} must equal P * H_loc = {P}*{H_loc}")
    check_rank(rank, P)
    if out_windows.stride()[1:] != (S_loc * H * D, H * D, D, 1):
        raise ValueError("out_windows: each window out_windows[d] must be a contiguous [B, S_loc, H, D]")
    if P > 1 and not aligned16(out_windows, 0, dims=(0,)):
        raise ValueError("out_windows: the window stride (dim 0) must be a multiple of 16 bytes")
    if not aligned16(out_windows, _address(out_windows), dims=()):
        raise ValueError("out_windows: the base address must be 16-byte aligned")


def check_timestamps(timestamps: Optional[torch.Tensor], q: torch.Tensor, tile_m: int) -> None:
    """The stamped debug build's buffer: None, or a contiguous int64 [B, H_loc, ceil(S / tile_m), 7]."""
    if timestamps is None:
        return
    shape = (q.shape[0], q.shape[2], -(-q.shape[1] // tile_m), 7)
    if (not isinstance(timestamps, torch.Tensor) or timestamps.dtype != torch.int64
            or tuple(timestamps.shape) != shape or not timestamps.is_contiguous() or timestamps.device != q.device):
        raise ValueError(f"timestamps: expected a contiguous int64 tensor {shape} on {q.device}")


def fa4_a2a_launcher(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_windows: torch.Tensor,
    rank: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    lse_windows: Optional[torch.Tensor] = None,
    o_store: Optional[str] = None,
    timestamps: Optional[torch.Tensor] = None,
    rotate: bool = False,
    pacer: Optional[torch.Tensor] = None,
) -> Callable[[], None]:
    """fa4_a2a_forward on these tensors, checked and compiled once: the returned function launches
    it on the current stream (no per-call checks; the op's window plan keeps one per rank)."""
    compiled, args = _fa4_a2a_bound(q, k, v, out_windows, rank, causal, softmax_scale, seqused_k, lse_windows,
                                    o_store, timestamps, rotate, pacer, None)
    return (lambda: None) if _is_fake(q) else functools.partial(compiled, *args)


def fa4_a2a_keeping_launcher(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_windows: torch.Tensor,
    rank: int,
    o_like: torch.Tensor,
    lse_like: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    o_store: Optional[str] = None,
    rotate: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The fused kernel that also keeps what FA4's backward reads (SM90): launch(o, lse) routes O into
    out_windows as fa4_a2a_forward does and also stores it into o [B, S, H_loc, D] (q's shape, FA4's
    layout) and the rows' log-sum-exp into lse fp32 [B, H_loc, S]: FA4's O and LSE bit for bit
    (cute_kernels.fa4_a2a_sm90, keep_o). Checked and compiled once against o_like and lse_like; each
    launch takes an o and an lse with their shapes, dtypes and strides (e.g. fresh tensors of each call
    that a backward keeps; o's last dim contiguous, its other strides and base address multiples of 16
    bytes; lse's last dim contiguous)."""
    compiled, args = _fa4_a2a_bound(q, k, v, out_windows, rank, causal, softmax_scale, seqused_k, None, o_store,
                                    None, rotate, None, (o_like, lse_like))
    if _is_fake(q):
        return lambda o, lse: None
    P, S_loc = out_windows.shape[0], out_windows.shape[2]
    head, middle = args[:ARG_A2A_LSE], args[ARG_A2A_LSE + 1:-1]

    def launch(o: torch.Tensor, lse: torch.Tensor) -> None:
        compiled(*head, _lse_as_windows(lse, P, S_loc), *middle, o)

    return launch


ARG_A2A_LSE = 4  # where the compiled fused kernel takes its LSE windows (its local O comes last)


def _lse_as_windows(lse: torch.Tensor, P: int, S_loc: int) -> torch.Tensor:
    """A rank's own LSE [B, H_loc, S] (S = P * S_loc, last dim contiguous) as the fused kernel's P LSE
    windows (P, B, H_loc, S_loc): window d holds rows d * S_loc .. of every head."""
    B, H, _ = lse.shape
    st = lse.stride()
    return lse.as_strided((P, B, H, S_loc), (S_loc, st[0], st[1], 1), lse.storage_offset())


def _check_kept(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """fa4_a2a_keeping_launcher's o and lse against q [B, S, H_loc, D]."""
    if (not isinstance(o, torch.Tensor) or o.shape != q.shape or o.dtype != q.dtype or o.device != q.device
            or not aligned16(o, _address(o))):
        raise ValueError(f"o_like: expected {tuple(q.shape)} {q.dtype} on {q.device}, last dim contiguous, other "
                         "strides and base address multiples of 16 bytes")
    _check_lse(lse, q, "lse_like")


def _fa4_a2a_bound(q, k, v, out_windows, rank, causal, softmax_scale, seqused_k, lse_windows, o_store, timestamps,
                   rotate, pacer, kept) -> tuple:
    """fa4_a2a_launcher's (and, kept = (o_like, lse_like), fa4_a2a_keeping_launcher's) checks and compile ->
    (compiled, its arguments; the kept o_like last)."""
    _check_qkv(q, k, v)
    _check_scalars(causal, softmax_scale, rotate)
    _check_seqused_k(seqused_k, q)
    check_windows(out_windows, q, rank)
    H_loc, D = q.shape[2], q.shape[3]
    dst = out_windows.narrow(3, rank * H_loc, H_loc)
    lse_dst = o_local = None
    if lse_windows is not None:
        P, B, S_loc, H, _ = out_windows.shape
        if (not isinstance(lse_windows, torch.Tensor) or lse_windows.dtype != torch.float32
                or tuple(lse_windows.shape) != (P, B, H, S_loc)
                or lse_windows.stride()[1:] != (H * S_loc, S_loc, 1) or lse_windows.device != q.device):
            raise ValueError(f"lse_windows: expected float32 [{P}, {B}, {H}, {S_loc}], each window contiguous")
        lse_dst = lse_windows.narrow(2, rank * H_loc, H_loc)
    if kept is not None:
        o_local, lse_like = kept
        _check_kept(q, o_local, lse_like)
        lse_dst = _lse_as_windows(lse_like, out_windows.shape[0], out_windows.shape[2])
    scale = _scale(softmax_scale, D)
    arch = device_arch(q)
    # TMA needs every tile inside one rank; otherwise per-thread stores (see the kernel's docstring)
    S_loc = out_windows.shape[2]
    aligned = S_loc % tile_m_for(D, causal, arch) == 0
    if o_store is None:
        o_store = "tma" if aligned else "st"
    elif o_store not in ("tma", "st") or (o_store == "tma" and not aligned):
        raise ValueError(f"o_store: {o_store!r} is not 'st', or 'tma' with S_loc a multiple of the tile rows")
    if rotate and causal:
        raise ValueError("rotate: the rank-rotated tile order is for non-causal attention, got causal=True")
    kind = f"a2a-{o_store}"
    if pacer is not None:
        from cute_kernels.pacer import check_pacer

        check_pacer(pacer, q.device)
        if arch != 90 or lse_dst is not None or rotate:
            raise ValueError("pacer: the paced kernel is SM90's, without lse_windows or rotate")
        kind = "a2a-paced" if o_store == "tma" else "a2a-paced-st"
    key = (kind, q.dtype, D, H_loc // k.shape[2], causal, seqused_k is not None, lse_dst is not None)
    if arch == 100:
        if kept is not None:
            raise ValueError("o_like: the fused kernel that keeps O is SM90's (the SM100 op keeps FA4's own)")
        if lse_dst is not None and not aligned:
            # FA4's SM100 LSE rows go out in 128-row tiles from the correction warps (see the kernel)
            raise ValueError(f"lse_windows: on SM100 S_loc must be a multiple of {SM100_TILE_M}, got {S_loc}")
        if timestamps is not None:
            raise ValueError("timestamps: the stamped debug build is SM90 only")
        cfg = _config_sm100(D, causal, q.shape[1], H_loc // k.shape[2], seqused_k is not None)
        compiled = compile_fa4(*key, rotate=rotate, sm100=cfg)
        return compiled, (q, k, v, dst, lse_dst, scale, seqused_k, rank if rotate else None)
    check_timestamps(timestamps, q, tile_m_for(D, causal))
    if kept is None:
        compiled = compile_fa4(*key, timestamps=timestamps is not None, rotate=rotate)
        return compiled, (q, k, v, dst, lse_dst, scale, seqused_k, timestamps, rank if rotate else None, pacer, None)
    compiled = compile_fa4(*key, rotate=rotate, keep_o=True)
    return compiled, (q, k, v, dst, lse_dst, scale, seqused_k, None, rank if rotate else None, None, o_local)


def fa4_a2a_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_windows: torch.Tensor,
    rank: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    lse_windows: Optional[torch.Tensor] = None,
    o_store: Optional[str] = None,
    timestamps: Optional[torch.Tensor] = None,
    rotate: bool = False,
    pacer: Optional[torch.Tensor] = None,
) -> None:
    """FA4 with the post-attention All-to-All fused into the output epilogue.

    q: [B, S, H_loc, D] on source rank `rank`, S = P * S_loc; k, v: [B, S_k, H_kv, D] (fewer
    heads: GQA; more keys than queries: e.g. joint text tokens appended after the sequence).
    out_windows: [P, B, S_loc, H, D], H = P * H_loc, out_windows[d] is rank d's
    output buffer (contiguous; any window stride that is a multiple of 16 bytes). Writes
    out_windows[s // S_loc][b, s % S_loc, rank * H_loc + h] = attention(q, k, v)[b, s, h].
    Stores are issued and left to drain: visibility to other ranks needs a barrier after it.
    lse_windows: optional fp32 [P, B, H, S_loc] (each window contiguous): the rows' log-sum-exp
    routed like O, lse_windows[s // S_loc][b, rank * H_loc + h, s % S_loc].
    o_store: "tma" | "st" | None (auto: "tma" when S_loc is a multiple of the tile's rows,
    tile_m_for(D, causal, arch)).
    timestamps: optional int64 [B, H_loc, ceil(S / tile_m), 7], contiguous: a debug variant that
    stamps every tile with cute_kernels.fa4_a2a_sm90.TIMESTAMP_FIELDS (%globaltimer, ns); SM90 only.
    On SM100 (cute_kernels.fa4_a2a_sm100) lse_windows needs S_loc % 128 == 0.
    rotate: the rank-rotated tile order (rank r starts on rank r+1's rows; same output; non-causal
    only, ValueError otherwise): see cute_kernels.fa4_a2a_sm90.
    pacer: every O tile's store paced grid-wide by this state (cute_kernels.pacer.make_pacer, for the
    O tile's bytes; shared by every launch that gets it; the kernel: cute_kernels.fa4_a2a_paced_sm90):
    SM90, either O path, no LSE, no rotation.
    """
    fa4_a2a_launcher(q, k, v, out_windows, rank, causal=causal, softmax_scale=softmax_scale, seqused_k=seqused_k,
                     lse_windows=lse_windows, o_store=o_store, timestamps=timestamps, rotate=rotate, pacer=pacer)()
