"""The QKV projection's device side (SM90, quack): the rank-window GEMM class, its epilogues, and
how a launch passes its arguments. Imported only to compile (cute_kernels.qkv_a2a_sm90, the host
side, compiles through the disk cache): a process whose projection kernels are all on disk launches
them without quack or the CuTe DSL.

Epilogues are quack's (quack.epilogue.library.qk_rope_epi, qknorm_epi;
quack.epilogue.rotary.rope_table_epi) or compositions of quack's epilogue ops (HeadRstd,
RowVecLoad, rotary_cos_sin_load) where quack has no ready one (bias before the norm, RoPE
without bias, and every RoPE epilogue again for diffusers' (cos, sin) pair read as it is: two
table loads instead of quack's one interleaved table). RMSNorm eps is 1e-6 (quack's HeadRstd in
its library epilogues).

Host requirement seen on the H200 machine: quack fingerprints epilogue functions by walking their
globals and treats functions as library code (keyed by name) only when their file lies under a
"site-packages" / "dist-packages" directory (quack/gemm_runtime/identity.py,
_is_extern_function). CuTe DSL installed elsewhere makes `import quack.epilogue.library` raise
TypeError (it reaches a ContextVar of the DSL); install it as a normal package.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import get_max_active_clusters, mlir_namedtuple, torch2cute_dtype_map
try:
    from quack.epilogue.frontend import EpiMod, gemm_epilogue, pack, unpack
    from quack.epilogue.head_rmsnorm import HeadRstd
    from quack.epilogue.library import qk_rope_epi, qknorm_epi
    from quack.epilogue.ops import EpiOp, RowVecLoad
    from quack.epilogue.rotary import rope_table_epi, rotary_cos_sin_load
except TypeError as e:  # quack's fingerprint of its epilogues (see the module docstring)
    raise ImportError("quack's GEMM epilogues did not import, so the QKV projection kernel cannot compile: install "
                      "nvidia-cutlass-dsl and quack-kernels as packages (pip into a venv, conda or the system's "
                      "site-packages), not from a PYTHONPATH entry or a `pip install --target` folder, which quack "
                      f"does not take as installed code ({type(e).__name__}: {e})") from e
from quack.gemm_default_epi import GemmDefaultSm90
from quack.gemm_runtime.host import FakeArgCtx
from quack.gemm_tvm_ffi_utils import (
    compile_gemm_kernel,
    make_fake_gemm_tensors,
    make_fake_scheduler_args,
    make_scheduler_args,
)
from quack.rounding import RoundingMode

from cute_kernels.limits import EPS
from cute_kernels.pacer import UNIT_BYTES
from cute_kernels.pacer_device import pace_wait

# ---- kernel classes ------------------------------------------------------------------------------
class _RankWindowD:
    """Mixin for a quack SM90 GEMM class: D arrives as (l, m, t, p, i) (t: q/k/v tensor of the
    launch, p: destination rank, i < h_t*D static) and is regrouped into quack's batch-first
    (l, m, n) with a nested n = (i, p, t); everything after that is quack's own __call__."""

    @cute.jit
    def __call__(self, mA, mB, mD, mC, epilogue_args, scheduler_args, varlen_args, stream,
                 mSFA=None, mSFB=None):
        s, d = mD.layout.shape, mD.layout.stride
        mD = cute.make_tensor(
            mD.iterator,
            cute.make_layout((s[0], s[1], (s[4], s[3], s[2])),
                             stride=(d[0], d[1], (d[4], d[3], d[2]))),
        )
        # explicit class: the epilogue classes below are made by type(), where a bare super()
        # inside a traced method recursed into this method (CuTe DSL 4.8.1)
        super(_RankWindowD, self).__call__(mA, mB, mD, mC, epilogue_args, scheduler_args,
                                           varlen_args, stream, mSFA, mSFB)


class GemmRankWindowSm90(_RankWindowD, GemmDefaultSm90):
    """quack's default SM90 GEMM (optional row-vector bias) storing into rank windows."""


@functools.lru_cache(maxsize=None)
def _rank_window_class(base):
    return type(f"RankWindow_{base.__name__}", (_RankWindowD, base), {"__module__": __name__})


# ---- the store pacer: an epilogue op the epilogue function never sees ---------------------------
PACER = "pacer"  # the EpilogueArguments field of a paced kernel


class StorePacer(EpiOp):
    """The projection's store pacer (cute_kernels.pacer; the state counts in UNIT_BYTES) as a quack
    epilogue op. Per epilogue subtile, thread 0 of the storing threads (tidx 0: lane 0 of the warp
    that issues the TMA store) claims a slot worth the subtile's bytes and waits for it in
    end_loop_stage. quack's driver (0.6.5, gemm_base.epilogue) runs end_loop_stage after the
    epilogue math and before the epilogue barrier that precedes the register-to-smem copy and the
    TMA store, so the other epilogue threads wait at that barrier and the subtile's store issues
    after its slot. In pingpong the other warpgroup's mainloop runs meanwhile. Values are unchanged."""

    def host_arg_key(self, value):
        return None if value is None else ("int64", 3)

    def host_fake_arg(self, key, fctx):
        return make_fake_tensor(cutlass.Int64, (3,), leading_dim=0)

    def param_fields(self):
        return [(self.name, Optional[cute.Tensor], None)]

    def to_params(self, gemm, args):
        return {self.name: getattr(args, self.name)}

    def end_loop_stage(self, gemm, param, state, epi_coord, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tidx):
        tile_m, tile_n = gemm.cta_tile_shape_mnk[:2]
        subtiles = cute.size(cute.zipped_divide(cute.make_layout((tile_m, tile_n)), epi_tile).shape[1])
        _pace_subtile(param, tidx, tile_m * tile_n * gemm.d_dtype.width // 8 // subtiles)
        return None  # nothing staged: the driver's own barrier follows


_STORE_PACER = StorePacer(PACER)


@cute.jit
def _pace_subtile(mPace: cute.Tensor, tidx, subtile_bytes: cutlass.Constexpr[int]):
    if tidx == 0:
        pace_wait(mPace, subtile_bytes, UNIT_BYTES)


@functools.lru_cache(maxsize=None)
def _paced_mod(mod: EpiMod) -> EpiMod:
    """`mod` with the store pacer (its own kernels: another semantic key)."""
    if mod.output_ops or mod.sinks:
        raise NotImplementedError(f"{mod.fn.__name__}: the paced copy keeps no stored outputs or sinks besides D")
    return EpiMod(mod.fn, ops=mod.ops, mode=mod.mode, prepass=mod.prepass, prepass_outs=mod.prepass_outs,
                  extra_ops=mod.extra_ops + (_STORE_PACER,), vectorize=mod.vectorize)


@functools.lru_cache(maxsize=None)
def _paced_default_class():
    """GemmRankWindowSm90 with the store pacer: quack's default epilogue arguments plus PACER."""
    base = GemmDefaultSm90.EpilogueArguments
    Args = NamedTuple("EpilogueArguments", [*base.__annotations__.items(), (PACER, Optional[cute.Tensor])])
    Args.__new__.__defaults__ = tuple(base._field_defaults.get(f) for f in base._fields) + (None,)
    return type("GemmRankWindowPacedSm90", (_RankWindowD, GemmDefaultSm90),
                {"_epi_ops": GemmDefaultSm90._epi_ops + (_STORE_PACER,),
                 "EpilogueArguments": mlir_namedtuple(Args), "__module__": __name__})


# ---- epilogues: quack's where they exist, compositions of quack's ops otherwise ------------------
# RoPE reads quack's interleaved (cos_j, sin_j) table (rope "table": one table load, quack's own
# layout) or diffusers' (cos, sin) pair as it is (rope "pair": two loads, c from cos's even
# columns, s from sin's odd ones; no table built per call). Measured (H200, 2026-12-04, Flux
# shapes, examples/qkv_speed.py fused-nr, the q|k epilogue with both): equal at S_loc 576 (91.9
# vs 92.5 us), the pair 5.7% slower at 4096 (377.4 vs 357.0 us); fa_a2a.block picks by rows.
def _rotate(x1, x2, c, s):
    return pack(x1 * c - x2 * s, x1 * s + x2 * c)


def _pair_cos_sin(cos, sin):
    c, _ = unpack(cos)
    _, s = unpack(sin)
    return c, s


def _sq_prepass(acc):
    return {"qk": acc * acc}


def _sq_bias_prepass(acc, b):
    x = acc + b
    return {"qk": x * x}


def _bias_norm_rope(acc, c, s, qk, w, b):
    x1, x2 = unpack((acc + b) * qk * w)
    return {"D": _rotate(x1, x2, c, s)}


def _qkv_bias_norm_rope(acc, c, s, qk, w, b, rot, sel):
    x = acc + b
    x1, x2 = unpack(x * qk * w + x * sel)
    r1, _ = unpack(rot)
    v1, _ = unpack(sel)
    return {"D": _rotate(x1, x2, c * r1 + v1, s * r1)}


_NORM = dict(qk=HeadRstd("qk", eps=EPS), w=RowVecLoad("w"))
_BIAS_NORM = dict(prepass=_sq_bias_prepass, prepass_outs=("qk",), mode="acc_pair")
_ONE = dict(rot=RowVecLoad("rot"), sel=RowVecLoad("sel"))
_TABLE = dict(cs=rotary_cos_sin_load("cs"))
_PAIR = dict(cos=rotary_cos_sin_load("cos"), sin=rotary_cos_sin_load("sin"))


@gemm_epilogue(ops={**_TABLE, **_NORM, "b": RowVecLoad("b")}, **_BIAS_NORM)
def qk_bias_norm_rope_epi(acc, cs, qk, w, b):
    """quack's qk_rope_epi with the projection bias added before the norm (a DiT's q/k path):
    rmsnorm_head(acc + b) * w, then interleaved RoPE."""
    return _bias_norm_rope(acc, *unpack(cs), qk, w, b)


@gemm_epilogue(ops={**_PAIR, **_NORM, "b": RowVecLoad("b")}, **_BIAS_NORM)
def qk_bias_norm_rope_pair_epi(acc, cos, sin, qk, w, b):
    """qk_bias_norm_rope_epi with the (cos, sin) pair."""
    return _bias_norm_rope(acc, *_pair_cos_sin(cos, sin), qk, w, b)


@gemm_epilogue(
    ops={"qk": HeadRstd("qk", eps=EPS), "w": RowVecLoad("w"), "b": RowVecLoad("b")},
    prepass=_sq_bias_prepass, prepass_outs=("qk",),
)
def qk_bias_norm_epi(acc, qk, w, b):
    """quack's qknorm_epi with the projection bias added before the norm."""
    return {"D": (acc + b) * qk * w}


@gemm_epilogue(ops={**_PAIR, **_NORM}, prepass=_sq_prepass, prepass_outs=("qk",), mode="acc_pair")
def qk_norm_rope_pair_epi(acc, cos, sin, qk, w):
    """quack's qk_rope_epi (per-head RMSNorm with weight, then RoPE) with the (cos, sin) pair."""
    x1, x2 = unpack(acc * qk * w)
    return {"D": _rotate(x1, x2, *_pair_cos_sin(cos, sin))}


@gemm_epilogue(ops={**_PAIR, "b": RowVecLoad("b")}, mode="acc_pair")
def qk_bias_rope_pair_epi(acc, cos, sin, b):
    """quack's rope_table_epi (bias, then RoPE) with the (cos, sin) pair."""
    x1, x2 = unpack(acc + b)
    return {"D": _rotate(x1, x2, *_pair_cos_sin(cos, sin))}


@gemm_epilogue(ops=_TABLE, mode="acc_pair")
def qk_rope_epi_nobias(acc, cs):
    """quack's rope_table_epi without the bias."""
    x1, x2 = unpack(acc)
    return {"D": _rotate(x1, x2, *unpack(cs))}


@gemm_epilogue(ops=_PAIR, mode="acc_pair")
def qk_rope_pair_epi_nobias(acc, cos, sin):
    """qk_rope_epi_nobias with the (cos, sin) pair."""
    x1, x2 = unpack(acc)
    return {"D": _rotate(x1, x2, *_pair_cos_sin(cos, sin))}


@gemm_epilogue(ops={**_TABLE, **_NORM, "b": RowVecLoad("b"), **_ONE}, **_BIAS_NORM)
def qkv_bias_norm_rope_epi(acc, cs, qk, w, b, rot, sel):
    """qk_bias_norm_rope_epi over q|k|v in one launch. Row vectors: on q and k columns w = the
    head's norm weight, rot = 1, sel = 0; on v columns w = 0, rot = 0, sel = 1, where the result
    is acc + b exactly (x * rstd * 0 = +-0, RoPE with cos 1 and sin +-0)."""
    return _qkv_bias_norm_rope(acc, *unpack(cs), qk, w, b, rot, sel)


@gemm_epilogue(ops={**_PAIR, **_NORM, "b": RowVecLoad("b"), **_ONE}, **_BIAS_NORM)
def qkv_bias_norm_rope_pair_epi(acc, cos, sin, qk, w, b, rot, sel):
    """qkv_bias_norm_rope_epi with the (cos, sin) pair."""
    return _qkv_bias_norm_rope(acc, *_pair_cos_sin(cos, sin), qk, w, b, rot, sel)


# (bias, norm, rope: None, "table" or "pair") -> epilogue of the q|k columns; (.., False, None) is
# the default class
_QK_EPILOGUES = {
    (False, True, "table"): qk_rope_epi,
    (True, True, "table"): qk_bias_norm_rope_epi,
    (False, False, "table"): qk_rope_epi_nobias,
    (True, False, "table"): rope_table_epi,
    (False, True, "pair"): qk_norm_rope_pair_epi,
    (True, True, "pair"): qk_bias_norm_rope_pair_epi,
    (False, False, "pair"): qk_rope_pair_epi_nobias,
    (True, False, "pair"): qk_bias_rope_pair_epi,
    (False, True, None): qknorm_epi,
    (True, True, None): qk_bias_norm_epi,
}
_ONE_LAUNCH = {"table": qkv_bias_norm_rope_epi, "pair": qkv_bias_norm_rope_pair_epi}
_UNPINNED_KINDS = {"bias": "row"}


def _epilogue_mod(bias: bool, norm: bool, rope: Optional[str], one_launch: bool):
    if one_launch:
        if not (bias and norm and rope):
            raise ValueError("one_launch: bias, norm weights and rope_cs expected (the one-launch "
                             f"epilogue is bias + RMSNorm + RoPE), got bias={bias}, norm={norm}, "
                             f"rope={rope}")
        return _ONE_LAUNCH[rope]
    return _QK_EPILOGUES[(bias, norm, rope)]  # rope_table_epi's bias operand is inferred by quack as a row vector


def _mint(mod, values):
    """The quack class of `mod` for these epilogue values: the mint key quack's EpiMod.gemm
    derives for a dense, batched, SM90 call without C (pinned by tests/cpu/test_qkv_compile.py)."""
    visit_sig = tuple(
        (name, mod.ops[name].fn_port if name in mod.ops else _UNPINNED_KINDS[name])
        for name in mod.operand_names
    )
    prepass_sig = tuple((n, k) for n, k in visit_sig if n in mod.prepass_operand_names)
    arg_forms = tuple(
        (name, mod.ops[name].host_arg_form(values[name]))
        for name in mod.operand_names
        if name in mod.ops and mod.ops[name].host_arg_form(values[name])
    )
    paired = mod.mode == "acc_pair"
    return mod._mint(visit_sig, 9, paired, False, prepass_sig, RoundingMode.RN, arg_forms, False)


def _epilogue_values(mod, *, bias, norm_weight, head_dim, rope_cs, rot=None, sel=None):
    """epi_args of `mod`; rope_cs: None, the table or the (cos, sin) pair. An inferred (unpinned)
    row vector must be (l, n) for quack."""
    if bias is not None and bias.dim() == 1 and any(n not in mod.ops for n in mod.operand_names):
        bias = bias.unsqueeze(0)
    pair = rope_cs if isinstance(rope_cs, (tuple, list)) else (None, None)
    by_name = {"b": bias, "bias": bias, "w": norm_weight, "qk": head_dim, "cs": rope_cs, "cos": pair[0],
               "sin": pair[1], "rot": rot, "sel": sel}
    return {name: by_name[name] for name in mod.operand_names}


# ---- compile and launch form ---------------------------------------------------------------------
def _kernel_class(dtype, width: int, head_dim: int, bias_dtype, norm: bool, rope: Optional[str], one_launch: bool,
                  paced: bool, l, m, n, k) -> tuple:
    """(GEMM class, its fake EpilogueArguments to compile with, the active epilogue ops as
    ((name, op, key), ...), the CPU stand-in values they were keyed with) of one launch group;
    paced: with the store pacer (StorePacer, the PACER field)."""
    pacer = torch.empty(3, dtype=torch.int64) if paced else None
    if not (norm or rope):
        row = None
        if bias_dtype is not None:
            row = make_fake_tensor(torch2cute_dtype_map[bias_dtype], (l, n), leading_dim=1, divisibility=4)
        cls = _paced_default_class() if paced else GemmRankWindowSm90
        fields = {PACER: _STORE_PACER.host_fake_arg(None, None)} if paced else {}
        epi = cls.EpilogueArguments(
            alpha=None, beta=None, mRowVecBroadcast=row, mColVecBroadcast=None,
            add_to_output=False, rounding_mode=RoundingMode.RN, sr_seed=None, **fields,
        )
        return cls, epi, (), {PACER: pacer}
    mod = _epilogue_mod(bias_dtype is not None, norm, rope, one_launch)
    if paced:
        mod = _paced_mod(mod)
    # CPU stand-ins: host_arg_key reads only dtype, rank and the last extent
    vec = torch.empty(1, dtype=torch.float32)
    table = torch.empty(1, head_dim, dtype=torch.float32)
    dummies = _epilogue_values(
        mod,
        bias=torch.empty(1, dtype=bias_dtype) if bias_dtype is not None else None,
        norm_weight=vec, head_dim=head_dim,
        rope_cs=(table, table) if rope == "pair" else table, rot=vec, sel=vec,
    )
    dummies[PACER] = pacer
    cls = _rank_window_class(_mint(mod, dummies))
    fctx = FakeArgCtx(m, n, k, l, True, False)
    call_ops, fields = [], {}
    for op in cls._epi_ops:
        key = op.host_arg_key(dummies.get(op.name))
        if key is None:
            continue
        fake = op.host_fake_arg(key, fctx)
        if fake is not None:
            fields[op.name] = fake
        call_ops.append((op.name, op, key))
    return cls, cls.EpilogueArguments(**fields), tuple(call_ops), dummies


def compile_kernel(dtype: torch.dtype, width: int, head_dim: int, bias_dtype: Optional[torch.dtype], norm: bool,
                   rope: Optional[str], config, one_launch: bool, paced: bool = False, weight_major: str = "k"):
    """The TVM-FFI compiled rank-window GEMM of one launch group (cute_kernels.qkv_a2a_sm90.
    compile_projection's arguments; weight_major "k" or "n": B's contiguous mode; fake tensors: no GPU
    needed)."""
    cdt = torch2cute_dtype_map[dtype]
    mA, mB, _, _, m, n, k, l = make_fake_gemm_tensors(cdt, cdt, cdt, None, "k", weight_major, "n", None)
    div = 128 // cdt.width
    mD = cute.runtime.make_fake_tensor(
        cdt, (l, m, cute.sym_int(), cute.sym_int(), width),
        stride=tuple(cute.sym_int64(divisibility=div) for _ in range(4)) + (1,),
        assumed_align=16,
    )
    cls, epi, _, _ = _kernel_class(dtype, width, head_dim, bias_dtype, norm, rope, one_launch, paced, l, m, n, k)
    return compile_gemm_kernel(
        cls, cdt, (config.tile_m, config.tile_n), (config.cluster_m, config.cluster_n, 1),
        config.pingpong, True, False, False, (9, 0), mA, mB, mD, None, epi,
        make_fake_scheduler_args(False, False, l), None,
    )


def launch_form(dtype: torch.dtype, width: int, head_dim: int, bias_dtype: Optional[torch.dtype], norm: bool,
                rope: Optional[str], one_launch: bool, paced: bool = False) -> tuple:
    """How a launch of compile_kernel's kernel passes its epilogue and scheduler arguments, in
    plain Python (TVM-FFI takes a NamedTuple argument as the tuple of its fields, so a launch needs
    neither quack's classes nor the DSL's numbers): (epilogue fields, scheduler tuple, index of
    max_active_clusters in it). Each epilogue field, in the kernel's order, is None (passed as None:
    absent, or a compile-time constant such as the head dim of the norm) or (operand, unsqueeze):
    the launch group's operand of that name ("b"/"bias", "w", "rot", "sel", "cs", "cos", "sin", or
    PACER: the launch's pacer state), as a [1, n] row when unsqueeze. Raises where an epilogue op
    passes its value in another form (none of this module's do)."""
    cdt = torch2cute_dtype_map[dtype]
    _, _, _, _, m, n, k, l = make_fake_gemm_tensors(cdt, cdt, cdt, None, "k", "k", "n", None)
    cls, _, call_ops, dummies = _kernel_class(dtype, width, head_dim, bias_dtype, norm, rope, one_launch, paced,
                                              l, m, n, k)
    if not call_ops:
        given = {"mRowVecBroadcast": ("bias", True) if bias_dtype is not None else None,
                 PACER: (PACER, False) if paced else None}
        fields = tuple(given.get(f) for f in cls.EpilogueArguments._fields)
    else:
        by_name = {}
        for name, op, key in call_ops:
            dummy = dummies[name]
            value = dummy if type(op).host_call_arg is EpiOp.host_call_arg else op.host_call_arg(dummy, key)
            if value is None:
                by_name[name] = None
            elif value is dummy and isinstance(dummy, torch.Tensor):
                by_name[name] = (name, name == "bias" and dummy.dim() == 2)  # an unpinned bias: (l, n)
            else:
                raise NotImplementedError(f"epilogue operand {name}: passed as {type(value).__name__}, not as "
                                          "the tensor or None (launch_form knows these two)")
        fields = tuple(by_name.get(f) for f in cls.EpilogueArguments._fields)
    sched = make_scheduler_args(0, 8, None)
    return fields, tuple(_plain(v) for v in sched), type(sched)._fields.index("max_active_clusters")


def _plain(value):
    """A scheduler argument as TVM-FFI takes it: a DSL number as the Python number, a NamedTuple
    as a tuple."""
    if isinstance(value, cutlass.Numeric):
        return value.value
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def max_active_clusters(cluster_size: int) -> int:
    """quack's (the DSL's) occupancy query for the current CUDA device."""
    return get_max_active_clusters(cluster_size, device_id=torch.cuda.current_device())
