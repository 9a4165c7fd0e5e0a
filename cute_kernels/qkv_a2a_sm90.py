"""QKV projection GEMM with the Ulysses pre-attention All-to-All in its epilogue (SM90, quack).

Rank r of P holds its rows x [B, M, C] (M = S_loc for the sequence part). Ulysses needs, on every
destination rank d, q [B, N, H_loc, D] and k, v [B, N, H_kv_loc, D] holding rank d's heads for
all N rows; source rank r fills rows [row0, row0 + M) (row0 = r * S_loc). This module runs the
projection y = x W^T (+ bias) (+ per-head RMSNorm with weight on q and k) (+ interleaved RoPE on
q and k) as quack's SM90 GEMM whose output tensor D *is* those P destination windows, so the
epilogue's TMA store of each output tile is the pre-A2A (a peer store when window d is remote).

Window layout written (the op layer's in-windows, fa_a2a.engine.forward.WindowPlan): per destination rank
d a window holding q [B, N, H_loc, D], then k [B, N, H_kv_loc, D], then v (same), each
contiguous; the P windows sit at one uniform stride W in this process's address space (VMM peer
mapping, or P local buffers when ranks are emulated). Element (b, m, column n) of the GEMM goes to
window d = p, tensor t, row row0 + m, local head j, lane i, where the GEMM columns are ordered
n = ((t * P + p) * h_t + j) * D + i (h_t = H_loc for q, H_kv_loc for k and v). For Flux-like
models (H % P == 0, H_kv = H) that is exactly the order of [W_q; W_k; W_v]: global head
h = p * H_loc + j. QKVWeights.from_linear gathers the weight rows for any other head map:
- head padding (H % P != 0): query heads h >= H get zero weight and bias rows; the epilogue
  writes exact zeros there (RMSNorm of a zero head is 0 * rsqrt(eps) = 0; RoPE keeps 0);
- GQA (H_kv < H): rank d's KV heads (ulysses.layout.UlyssesLayout.kv_head_index[d]) are gathered,
  so a KV head needed by several ranks is computed once per rank that receives it (the GEMM
  computes the replicated columns instead of storing one column twice).

Joint (text) rows and uneven S (ulysses/layout.py row order): joint rows are replicated, so rank
r projects them with its own heads' weight rows only (QKVWeights.rank_slice) into its own
window (windows[t][r:r+1]): q at row0 = S_pad, k and v at row0 = S (two calls: the q and k/v row
offsets differ once S < S_pad). The rank holding padded sequence rows (s >= S) sends k and v of
those rows to s + J: one more call with x[:, valid:] and row0 = r*S_loc + valid + J for k|v.

The kernel sees D as (l, m, (h_t*D, P, n_t)) with strides (N*h_t*D, h_t*D, (1, W, T)) (T: the
distance from q's to k's window, n_t consecutive tensors of one launch): one TMA descriptor with
5 modes (i, m, p, t, l) addresses every rank. tile_N divides h_t*D, so an output tile lies in one
(rank, tensor) block; rows past M in the last M tile are clipped by the TMA bounds (the M extent
is this call's rows), so they never reach the next rank's rows. A launch covers consecutive
tensors with the same epilogue and head count: q|k (norm/RoPE) and v (bias only) as two launches,
or q|k|v as one when there is no norm and no RoPE or with one_launch; with GQA, q and k|v
launch separately.
Batches (B > 1) launch one GEMM each: a stride-0 batch mode cannot be a TMA dimension, and
materialising B copies of the weight costs more than the launches.

Epilogues (cute_kernels.qkv_a2a_sm90_device) are quack's or compositions of quack's epilogue ops:
bias, per-head RMSNorm (eps 1e-6, quack's HeadRstd) and RoPE from quack's interleaved table or
diffusers' (cos, sin) pair. This module is the host side and imports neither quack nor the CuTe
DSL: the GEMM of a launch group is compiled through the disk cache (compile_projection), and a
launch passes its epilogue and scheduler arguments as plain tuples (launch_form, kept on disk
beside the kernel), so a process whose projection kernels are all on disk launches them without
importing either (quack's import alone took ~9 s on the H200 machine: torch._dynamo/inductor).

Ordering: the stores are TMA bulk stores issued by quack's epilogue exactly as for a plain
output; nothing waits for remote completion. Visibility to the consumer comes from the barrier
kernel launched after this one on the same stream (cute_kernels/signal.py): kernel completion
orders every store of this grid before that barrier's release. With a pacer (qkv_a2a_launcher's
pacer, qkv_a2a_sm90_device.StorePacer) each epilogue subtile's store waits for a slot of the
grid-wide pacer before it issues; the ordering is the same. Where that pays over a slow link:
fa_a2a.engine.pacing.decide_projection.

Measured (H200, 2026-12-03, bf16, C = 3072, N = 9216, H = 24, D = 128, emulated P = 8 windows,
source rank 3; examples/qkv_speed.py: CUDA-graph replays of 20 calls, medians of 11 trials, us).
fused: q|k|v + bias into the windows (one launch); plain: quack's own kernel, same tiles, plain
output; -nr: q|k with bias + RMSNorm + RoPE and v with bias (two launches each):

    S_loc  config        fused  plain  ratio   fused-nr plain-nr ratio   matmul  plain+copy
    576    128x192 c2x1  74.8   74.2   1.008   91.2     91.6     0.995   52.2    93.7
    576    192x128 c1x2  50.1   49.9   1.003   82.3     82.3     1.000
    1024   128x192 c2x1  83.7   83.2   1.006   92.5     91.9     1.006   89.8    117.3
    1024   192x128 c1x2  109.3  109.1  1.002   147.7    147.3    1.003
    4096   128x192 c2x1  347.8  344.8  1.009   364.2    364.0    1.001   372.0   489.6
    4096   192x128 c1x2  343.8  344.3  0.998   364.6    364.6    1.000

(-nr rows with 128-row tiles use 128x128 for q|k.) Per-trial spread: about +-1% at 576, +-2-4%
at 1024 and 4096; an earlier run of the same 4096 case gave fused/plain 1.013, 0.994, 1.016.
The fused projection with the better tile (config_for) is 0.96 / 0.93 / 0.93 of torch.matmul
(cuBLAS) at S_loc = 576 / 1024 / 4096. The norm+RoPE variant's two launches (q|k: N = 6144,
v: N = 3072) each end in a partial wave: 82.3 us at 576, against 50.1 for one bias-only launch.
one_launch=True runs q|k|v as one grid (qkv_bias_norm_rope_epi); bit-exact on the H200
(test_one_launch_bit_exact). Its time (H200, 2026-12-03, same shapes, 10 calls, 7 trials, us):
with the default tiles (examples/qkv_speed.py --configs) fused-nr1 88.7 / 99.6 / 355.5 against
fused-nr 89.4 / 94.3 / 358.2 at S_loc = 576 / 1024 / 4096 (fused-nr1 / plain-nr1 = 0.999 / 1.007
/ 1.023); with config_for's tile (python -m fa_a2a.bench_block: proj-fused1 against the two
default launches proj-fused) 61.9 vs 95.4 at 576 (192x128: one wave and a half instead of two
partial waves), 89.6 vs 84.0 at 1024 and 324.3 vs 323.3 at 4096 (128x128 over all 9216
columns; the two launches give v 128x192 tiles). So one_launch with config_for pays at 576 only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from cute_kernels.compile_cache import disk_value, load_or_compile
from cute_kernels.limits import ALIGN_BYTES, DTYPES, HEAD_DIMS, aligned16, tma_table
from cute_kernels.limits import address as _address, is_fake as _is_fake


def rope_kind(rope_cs) -> Optional[str]:
    """None, "table" (quack's interleaved table) or "pair" (diffusers' (cos, sin))."""
    if rope_cs is None:
        return None
    return "pair" if isinstance(rope_cs, (tuple, list)) else "table"


# ---- configuration and compile -------------------------------------------------------------------
class GemmConfig(NamedTuple):
    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True


def default_config(width: int, head_dim: int, epilogue: bool) -> GemmConfig:
    """quack's SM90 default shape (128-row tiles, cluster 2x1, pingpong) with tile_N dividing
    the per-rank width h_t*D (and a multiple of D when the epilogue normalizes whole heads).
    The configuration the GPU tests check bit for bit; config_for picks by rows."""
    order = (128, 192, 64) if epilogue else (192, 128, 64)
    for tile_n in order:
        if width % tile_n == 0 and (not epilogue or tile_n % head_dim == 0):
            return GemmConfig(tile_n=tile_n)
    raise ValueError(f"width: no tile_N in {order} divides h_t*D = {width}")


def config_for(rows: int, width: int, head_dim: int, epilogue: bool) -> GemmConfig:
    """Tile rows 192 (tile 192x128, cluster 1x2, pingpong) where that pads fewer rows than
    128-row tiles, else default_config. Measured on the H200 (2026-12-03, Flux shapes, module
    docstring): at S_loc = 576 the fused projection took 50.1 us with 192x128 against 74.8 us
    with quack's 128x192 (cuBLAS 52.2); at 1024 128-row tiles were faster (83.7 vs 109.3 us);
    at 4096 all within 1%. Its bit-exact GPU test is tests/gpu/test_qkv_a2a.py::test_192_row_tiles."""
    base = default_config(width, head_dim, epilogue)
    pad = lambda tile: -(-rows // tile) * tile - rows  # noqa: E731
    if width % 128 == 0 and pad(192) < pad(128):
        return GemmConfig(192, 128, 1, 2, True)
    return base


class _Kernel(NamedTuple):
    compiled: object
    fields: tuple  # launch_form's epilogue fields: None or (operand, unsqueeze), in the kernel's order
    scheduler: tuple  # launch_form's scheduler tuple
    clusters_at: int  # where max_active_clusters goes in it
    cluster_size: int


@functools.lru_cache(maxsize=None)
def compile_projection(dtype: torch.dtype, width: int, head_dim: int,
                       bias_dtype: Optional[torch.dtype], norm: bool, rope: Optional[str],
                       config: GemmConfig, one_launch: bool = False, paced: bool = False,
                       weight_major: str = "k") -> _Kernel:
    """Compile (once per key: every argument) the rank-window GEMM for one launch group
    (rope: None, "table" or "pair", rope_kind; one_launch: q|k|v with qkv_bias_norm_rope_epi, which
    needs bias, norm and rope; paced: its stores paced, qkv_a2a_launcher's pacer; weight_major: the
    weight's layout, weight_major()), or load it and its launch form from the disk cache.

    width = h_t * D (static: a dynamic nested N mode fails TMA-atom construction); the number of
    ranks P, of tensors n_t, the rows and all strides are dynamic. Works without a GPU
    (CUTE_DSL_ARCH=sm_90a): everything is built from fake tensors.
    """
    key = (dtype, width, head_dim, bias_dtype, norm, rope, config, one_launch, paced, weight_major)
    fields, scheduler, clusters_at = launch_form(dtype, width, head_dim, bias_dtype, norm, rope, one_launch, paced)

    def compile():
        from cute_kernels.qkv_a2a_sm90_device import compile_kernel

        return compile_kernel(*key)

    compiled, _ = load_or_compile("compile_projection", key, compile)
    return _Kernel(compiled, fields, scheduler, clusters_at, config.cluster_m * config.cluster_n)


@disk_value
def launch_form(dtype, width: int, head_dim: int, bias_dtype, norm: bool, rope: Optional[str], one_launch: bool,
                paced: bool = False):
    """qkv_a2a_sm90_device.launch_form, kept on disk beside the kernels (a warm process does not
    import quack for it)."""
    from cute_kernels.qkv_a2a_sm90_device import launch_form as form

    return form(dtype, width, head_dim, bias_dtype, norm, rope, one_launch, paced)


@disk_value
def _max_active_clusters(cluster_size: int, device_name: str, sm_count: int, capability: tuple,
                         mps_share: Optional[str]) -> int:
    """The occupancy query the persistent scheduler takes (the DSL's), per kind of GPU (the current
    device is of that kind) and MPS share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), kept on disk. It sizes
    the persistent grid only: a stale value costs speed, never correctness."""
    from cute_kernels.qkv_a2a_sm90_device import max_active_clusters

    return max_active_clusters(cluster_size)


@functools.lru_cache(maxsize=None)
def _scheduler_args(kern: _Kernel, device_index: int) -> tuple:
    """The kernel's scheduler tuple with max_active_clusters of device `device_index`."""
    props = torch.cuda.get_device_properties(device_index)
    with torch.cuda.device(device_index):
        clusters = _max_active_clusters(kern.cluster_size, props.name, props.multi_processor_count,
                                        (props.major, props.minor),
                                        os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
    sched = list(kern.scheduler)
    sched[kern.clusters_at] = clusters
    return tuple(sched)


# ---- weights in destination order ----------------------------------------------------------------
@dataclass(frozen=True)
class QKVWeights:
    """Projection weights with rows in destination order (see the module docstring).

    weight [P*(H_loc + 2*H_kv_loc)*D, C], its rows contiguous (as from_linear builds it) or its
    columns (the transpose view of a contiguous [C, n]: weight_major); bias of the same length (or
    None); norm_weight fp32 [P*(H_loc + H_kv_loc)*D]: the q|k columns' RMSNorm weight (each head's
    weight repeated), or None for no norm. head_map: (H, H_kv, q_head_index, kv_head_index) as from_linear gathered
    them (fa_a2a.block checks it against its layout), None when built directly. Build with
    from_linear, once per layer.
    """

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    norm_weight: Optional[torch.Tensor]
    world_size: int
    heads_loc: int
    kv_heads_loc: int
    head_dim: int
    head_map: Optional[tuple] = None

    @property
    def widths(self) -> tuple:
        """h_t * D for t = q, k, v."""
        D = self.head_dim
        return (self.heads_loc * D, self.kv_heads_loc * D, self.kv_heads_loc * D)

    def column_range(self, t: int) -> tuple:
        """GEMM columns [lo, hi) of tensor t (0 = q, 1 = k, 2 = v)."""
        lo = sum(self.world_size * w for w in self.widths[:t])
        return lo, lo + self.world_size * self.widths[t]

    def versions(self) -> tuple:
        """The version counters of weight, bias and norm_weight (None where absent): an in-place change
        of their data (an optimizer step, copy_) changes them, so a copy made from them is current
        while they are equal (a `.data` write is not versioned)."""
        return tuple(None if t is None else t._version for t in (self.weight, self.bias, self.norm_weight))

    @property
    def one_launch_vectors(self) -> tuple:
        """fp32 row vectors (w, rot, sel) over all columns for qkv_bias_norm_rope_epi: the norm
        weight (0 on v), 1 on q|k (0 on v), 1 on v (0 on q|k). Built on first use, again after the
        norm weight changed in place."""
        if self.norm_weight is None:
            raise ValueError("proj: norm weights expected for the one-launch epilogue")
        version = self.norm_weight._version
        kept = self.__dict__.get("_one_launch_vectors")
        if kept is not None and kept[0] == version:
            return kept[1]
        n_qk, n = self.column_range(1)[1], self.weight.shape[0]
        w = torch.zeros(n, dtype=torch.float32, device=self.weight.device)
        w[:n_qk] = self.norm_weight
        rot = torch.zeros_like(w)
        rot[:n_qk] = 1.0
        vectors = (w, rot, 1.0 - rot)
        self.__dict__["_one_launch_vectors"] = (version, vectors)  # (frozen dataclass: its __dict__ holds it)
        return vectors

    def rank_slice(self, rank: int) -> "QKVWeights":
        """The weights of destination `rank`'s heads alone (world_size 1): joint rows, which every
        rank holds, go only into the rank's own window."""
        rank = _check_int(rank, "rank", 0)
        if rank >= self.world_size:
            raise ValueError(f"rank: an int in [0, {self.world_size}) expected, got {rank}")
        cols = []
        for t, w in enumerate(self.widths):
            lo = self.column_range(t)[0] + rank * w
            cols.append(slice(lo, lo + w))
        weight = torch.cat([self.weight[c] for c in cols])
        bias = torch.cat([self.bias[c] for c in cols]) if self.bias is not None else None
        norm_weight = None
        if self.norm_weight is not None:
            norm_weight = torch.cat([self.norm_weight[c] for c in cols[:2]])
        return QKVWeights(weight, bias, norm_weight, 1, self.heads_loc, self.kv_heads_loc, self.head_dim)

    @classmethod
    def from_linear(cls, wq, wk, wv, *, head_dim: int, world_size: int, bq=None, bk=None, bv=None,
                    q_norm_weight=None, k_norm_weight=None,
                    q_head_index: Optional[Sequence[Sequence[int]]] = None,
                    kv_head_index: Optional[Sequence[Sequence[int]]] = None) -> "QKVWeights":
        """Gather nn.Linear weights (wq [H*D, C], wk/wv [H_kv*D, C], biases [H*D] / [H_kv*D]) into
        destination order. q_head_index[d] lists the global query heads rank d receives (entries
        >= H: zero padding heads), kv_head_index[d] its KV heads (repeats allowed: GQA
        replication); both default to the plain split h -> h // (H / P), which needs H % P == 0
        and H_kv == H. ulysses.layout.UlyssesLayout.q_head_index / kv_head_index give the maps
        for head padding and GQA. q_norm_weight / k_norm_weight: [D] per-head RMSNorm weights
        (both or neither)."""
        D = _check_int(head_dim, "head_dim", 1)
        P = _check_int(world_size, "world_size", 1)
        if D not in HEAD_DIMS:
            raise ValueError(f"head_dim: one of {HEAD_DIMS} expected, got {D}")
        for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] % D:
                raise ValueError(f"{name}: a [heads*{D}, C] tensor expected, got "
                                 f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
            if w.dtype not in DTYPES or w.dtype != wq.dtype or w.device != wq.device:
                raise ValueError(f"{name}: bfloat16/float16 like wq ({wq.dtype} on {wq.device}) "
                                 f"expected, got {w.dtype} on {w.device}")
            if w.shape[1] != wq.shape[1] or w.shape[1] % 8:
                raise ValueError(f"{name}: C = {wq.shape[1]} columns, a multiple of 8, expected, "
                                 f"got {w.shape[1]}")
        if wk.shape != wv.shape:
            raise ValueError(f"wv: shape {tuple(wk.shape)} (wk's) expected, got {tuple(wv.shape)}")
        H, H_kv = wq.shape[0] // D, wk.shape[0] // D
        if q_head_index is None or kv_head_index is None:
            if q_head_index is not None or kv_head_index is not None:
                raise ValueError("q_head_index, kv_head_index: both or neither expected")
            if H % P or H_kv != H:
                raise ValueError(f"q_head_index: needed for H = {H}, H_kv = {H_kv} on P = {P} ranks "
                                 "(plain split needs H % P == 0 and H_kv == H)")
            q_head_index = kv_head_index = [range(d * (H // P), (d + 1) * (H // P)) for d in range(P)]
        q_idx = _head_rows(q_head_index, P, "q_head_index")
        kv_idx = _head_rows(kv_head_index, P, "kv_head_index")
        if any(h < 0 for h in q_idx) or any(not 0 <= h < H_kv for h in kv_idx):
            raise ValueError(f"kv_head_index: heads in [0, {H_kv}) expected (q: >= 0), "
                             f"got {sorted(set(kv_idx))[:8]}")
        biases = (bq, bk, bv)
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise ValueError("bq, bk, bv: all or none expected")
        for name, b, w in (("bq", bq, wq), ("bk", bk, wk), ("bv", bv, wv)):
            if b is not None and (b.shape != (w.shape[0],) or b.device != wq.device
                                  or b.dtype not in DTYPES + (torch.float32,)):
                raise ValueError(f"{name}: [{w.shape[0]}] bf16/fp16/fp32 on {wq.device} expected, "
                                 f"got {tuple(b.shape)} {b.dtype} on {b.device}")
        if (q_norm_weight is None) != (k_norm_weight is None):
            raise ValueError("q_norm_weight, k_norm_weight: both or neither expected")
        for name, nw in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if nw is not None and (nw.shape != (D,) or nw.device != wq.device):
                raise ValueError(f"{name}: [{D}] on {wq.device} expected, got {tuple(nw.shape)} "
                                 f"on {nw.device}")

        def gather(w, index, valid):
            heads = w.unflatten(0, (-1, D))
            out = heads.new_zeros((len(index), D) + tuple(heads.shape[2:]))
            keep = [i for i, h in enumerate(index) if h < valid]
            out[keep] = heads[[index[i] for i in keep]]
            return out.flatten(0, 1)

        weight = torch.cat([gather(wq, q_idx, H), gather(wk, kv_idx, H_kv), gather(wv, kv_idx, H_kv)])
        bias = None
        if bq is not None:
            bdt = torch.promote_types(torch.promote_types(bq.dtype, bk.dtype), bv.dtype)
            bias = torch.cat([gather(bq.to(bdt), q_idx, H), gather(bk.to(bdt), kv_idx, H_kv),
                              gather(bv.to(bdt), kv_idx, H_kv)]).contiguous()
        norm_weight = None
        if q_norm_weight is not None:
            norm_weight = torch.cat([q_norm_weight.float().repeat(len(q_idx)),
                                     k_norm_weight.float().repeat(len(kv_idx))]).contiguous()
        head_map = (H, H_kv, tuple(tuple(int(h) for h in r) for r in q_head_index),
                    tuple(tuple(int(h) for h in r) for r in kv_head_index))
        return cls(weight.contiguous(), bias, norm_weight, P, len(q_idx) // P, len(kv_idx) // P, D, head_map)


def weight_major(w: torch.Tensor) -> Optional[str]:
    """The GEMM's B operand layout of a weight [n, C]: "k" for contiguous rows, "n" for contiguous
    columns (w = W.t() of a contiguous W [C, n], e.g. nn.Linear's weight read in place as the B of
    an input-gradient GEMM dX = dY @ W), each with a 16-byte aligned base and strides; None otherwise.
    The SM90 GEMM reads either (WGMMA takes 16-bit B K- or N-major; the accumulation order is the same)."""
    if w.stride(1) == 1 and aligned16(w, _address(w)):
        return "k"
    if w.stride(0) == 1 and aligned16(w.t(), _address(w)):
        return "n"
    return None


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: an int >= {minimum} expected, got {value!r}")
    return value


def _head_rows(index, P: int, name: str) -> list:
    rows = [list(r) for r in index]
    if len(rows) != P or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError(f"{name}: {P} equally long non-empty head lists expected, "
                         f"got lengths {[len(r) for r in rows]}")
    return [int(h) for r in rows for h in r]


# ---- launch --------------------------------------------------------------------------------------
def _groups(proj: QKVWeights, present: Sequence[bool], epilogue: bool, one_launch: bool) -> list:
    """Launch groups: runs of consecutive present tensors with one epilogue and one width.
    Epilogue per tensor: None (bias only), "qk" (_QK_EPILOGUES) or "qkv" (one launch)."""
    groups = []
    for t in range(3):
        if not present[t]:
            continue
        epi_t = ("qkv" if one_launch else ("qk" if t < 2 else None)) if epilogue else None
        g = groups[-1] if groups else None
        if g and g["ts"][-1] == t - 1 and g["epi"] == epi_t and proj.widths[t] == g["width"]:
            g["ts"].append(t)
        else:
            groups.append({"ts": [t], "epi": epi_t, "width": proj.widths[t]})
    return groups


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if _is_fake(a) or _is_fake(b):
        return True  # compile-only: the launch split does not change the compiled kernel
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_inputs(x, proj, rope_cs, config, one_launch):
    if not isinstance(proj, QKVWeights):
        raise ValueError(f"proj: a QKVWeights expected, got {type(proj).__name__}")
    if one_launch and (proj.bias is None or proj.norm_weight is None or rope_cs is None):
        raise ValueError("one_launch: bias, norm weights and rope_cs expected (the one-launch "
                         "epilogue is bias + RMSNorm + RoPE)")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x: a [B, M, C] tensor expected, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type != "cuda":
        raise ValueError(f"x: a CUDA tensor (SM90) expected, got device {x.device}")
    if x.dtype != proj.weight.dtype or x.device != proj.weight.device:
        raise ValueError(f"x: {proj.weight.dtype} on {proj.weight.device} (the weight's) expected, "
                         f"got {x.dtype} on {x.device}")
    if proj.weight.dim() != 2 or weight_major(proj.weight) is None:
        raise ValueError(f"proj: a weight [n, C] with contiguous rows or columns, a 16-byte aligned base and "
                         f"strides expected, got shape {tuple(proj.weight.shape)} strides {proj.weight.stride()}")
    C = proj.weight.shape[1]
    if x.shape[2] != C or not _tma_rows(x, C, _address(x)):
        raise ValueError(f"x: contiguous rows of C = {C}, 16-byte aligned base and batch stride "
                         f"expected, got shape {tuple(x.shape)} strides {x.stride()}")
    if rope_cs is not None:
        _check_rope(rope_cs, x.shape[1], proj.head_dim, x.device)
    if config is not None and not isinstance(config, GemmConfig):
        raise ValueError(f"config: a GemmConfig expected, got {type(config).__name__}")


def _check_rope(rope_cs, M: int, D: int, device) -> None:
    pair = rope_kind(rope_cs) == "pair"
    if pair and (len(rope_cs) != 2 or not all(isinstance(t, torch.Tensor) for t in rope_cs)):
        raise ValueError("rope_cs: a float32 table or a (cos, sin) pair of tensors expected")
    for name, t in zip(("rope_cs[0] (cos)", "rope_cs[1] (sin)") if pair else ("rope_cs",),
                       rope_cs if pair else (rope_cs,)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (M, D) or t.device != device:
            raise ValueError(f"{name}: float32 [{M}, {D}] on {device} expected, got "
                             f"{f'{t.dtype} {tuple(t.shape)} on {t.device}' if isinstance(t, torch.Tensor) else t}")
        if not tma_table(t, _address(t)):
            raise ValueError(f"{name}: contiguous rows, a 16-byte aligned base and row stride expected (the "
                             f"epilogue's TMA loads), got strides {t.stride()}")


def _group_config(config, g, proj):
    cfg = config if config is not None else default_config(g["width"], proj.head_dim, bool(g["epi"]))
    if g["width"] % cfg.tile_n or (g["epi"] and cfg.tile_n % proj.head_dim):
        raise ValueError(f"config: tile_n must divide h_t*D = {g['width']}"
                         f"{' and be a multiple of D' if g['epi'] else ''}, got {cfg.tile_n}")
    return cfg


def _group_values(proj, g, rope_cs):
    """Columns [lo, hi) of the group and its epilogue values (sliced row vectors)."""
    lo = proj.column_range(g["ts"][0])[0]
    hi = proj.column_range(g["ts"][-1])[1]
    values = dict(bias=proj.bias[lo:hi] if proj.bias is not None else None, norm_weight=None,
                  rope_cs=rope_cs if g["epi"] else None, rot=None, sel=None)
    if g["epi"] == "qkv":
        values["norm_weight"], values["rot"], values["sel"] = (
            v[lo:hi] for v in proj.one_launch_vectors)
    elif g["epi"] and proj.norm_weight is not None:
        values["norm_weight"] = proj.norm_weight[lo:hi]
    return lo, hi, values


def qkv_a2a_projection(x: torch.Tensor, proj: QKVWeights, windows: Sequence[Optional[torch.Tensor]],
                       row0: int, *, rope_cs: Optional[torch.Tensor] = None,
                       config: Optional[GemmConfig] = None, one_launch: bool = False, pacer=None) -> None:
    """y = x W^T (+ bias) (q, k: + per-head RMSNorm with weight, + interleaved RoPE), stored as the
    Ulysses pre-A2A: rows [row0, row0 + M) of every destination window.

    x [B, M, C] with contiguous rows (a row slice of a larger x is fine). windows = (dq, dk, dv): [P, B, N, H_loc, D] / [P, B, N, H_kv_loc, D]
    (window d = destination rank d, each window contiguous, a uniform dim-0 stride W that is a
    multiple of 16 bytes); an entry None skips that tensor (e.g. joint rows, whose q and k/v rows
    differ: launch q and k|v separately with their row0). rope_cs: these rows' RoPE, None for none:
    the fp32 [M, D] table of interleaved (cos_j, sin_j) (interleaved_cos_sin), or diffusers' pair
    (cos, sin) of fp32 [M, D] (each frequency repeated for the adjacent pair; c is read from cos's
    even columns, s from sin's odd ones), each with contiguous rows, 16-byte aligned base and row
    stride (tma_table).
    The norm applies when proj has norm weights. one_launch: q, k and v in one launch of
    qkv_bias_norm_rope_epi (bias + norm + RoPE on q and k, v passed through exactly) instead of
    q|k and v apart: one grid instead of two partial waves. pacer: every epilogue subtile's store
    takes a slot worth its bytes from this grid-wide pacer state first (cute_kernels.pacer.make_pacer
    with tile_bytes = cute_kernels.pacer.UNIT_BYTES; shared by every launch that gets it; None:
    unpaced; qkv_a2a_sm90_device.StorePacer). Graph-capturable; no host sync. On
    fake tensors (FakeTensorMode) it compiles and checks without launching. Calls that repeat
    with the same shapes and windows: qkv_a2a_launcher (checked and bound once).
    """
    qkv_a2a_launcher(x, proj, windows, row0, rope_cs=rope_cs, config=config, one_launch=one_launch,
                     pacer=pacer)(x, proj, rope_cs)


def qkv_a2a_launcher(x: torch.Tensor, proj: QKVWeights, windows: Sequence[Optional[torch.Tensor]],
                     row0: int, *, rope_cs: Optional[torch.Tensor] = None,
                     config: Optional[GemmConfig] = None, one_launch: bool = False, pacer=None):
    """qkv_a2a_projection's checks, launch groups, compiles and window views, done once for these
    arguments -> launch(x, proj, rope_cs=None) on the current stream.

    A launch takes an x of this x's shape, dtype and device, a proj of this proj's kind (shapes,
    weight_major, bias and norm present, world size, heads: e.g. another layer's weights) and rope_cs exactly when
    one is given here, of the same kind (a table or a pair) and checked as here (tma_table); the
    caller keeps to that (fa_a2a.block: its call signature). The pacer is bound here. Per
    launch: proj's weight rows and epilogue vectors of each group, sliced at proj's first launch
    and kept on proj; the epilogue arguments with this call's rope_cs; x itself, or a contiguous
    copy (fresh storage) where its rows are not 16-byte aligned (the TMA's requirement; the checks
    here hold for this x only). The windows and row0 are bound here. Host time of one bound launch (one H200's
    host, 2026-12-04, behind a sleep kernel): 18.2 us, against 14.4 us for the op's pre-A2A launch;
    through the block, which called qkv_a2a_projection before, the host time per call fell from 238
    to 196 us (P 1, S 128) and from 470 to 223 us (two ranks, S_loc 1152; examples/eager_host_cost.py)."""
    _check_inputs(x, proj, rope_cs, config, one_launch)
    if pacer is not None:
        from cute_kernels.pacer import check_pacer

        check_pacer(pacer, x.device)
    if not isinstance(windows, (tuple, list)) or len(windows) != 3 or all(w is None for w in windows):
        raise ValueError("windows: a tuple (dq, dk, dv) with at least one tensor expected")
    B, M, C = x.shape
    P, D = proj.world_size, proj.head_dim
    first = next(w for w in windows if w is not None)
    N = first.shape[2] if first.dim() == 5 else -1
    for t, w in enumerate(windows):
        if w is None:
            continue
        name = f"windows[{t}]"
        heads = proj.widths[t] // D
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (P, B, N, heads, D):
            raise ValueError(f"{name}: [{P}, {B}, N, {heads}, {D}] (N as windows[0]) expected, got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name}: {x.dtype} on {x.device} expected, got {w.dtype} on {w.device}")
        if w.stride()[1:] != (N * heads * D, heads * D, D, 1):
            raise ValueError(f"{name}: each window [B, N, h, D] must be contiguous, got strides {w.stride()}")
        if not aligned16(w, _address(w), dims=(0,) if P > 1 else ()):
            raise ValueError(f"{name}: 16-byte aligned base and window stride expected")
    row0 = _check_int(row0, "row0", 0)
    if row0 + M > N:
        raise ValueError(f"row0: rows [row0, row0 + {M}) must lie in the windows' {N} rows, got {row0}")
    if M == 0:
        return _no_launch  # e.g. a rank without padded rows
    epilogue = proj.norm_weight is not None or rope_cs is not None
    es = x.element_size()
    runs = []
    for g in _groups(proj, [w is not None for w in windows], epilogue, one_launch):
        # split a group where the windows of its tensors are not one uniform-stride block
        split = [[g["ts"][0]]]
        for t in g["ts"][1:]:
            a, b = windows[split[-1][-1]], windows[t]
            T = b.storage_offset() - a.storage_offset()
            same = (_same_storage(a, b) and a.stride() == b.stride() and T > 0
                    and (T * es) % ALIGN_BYTES == 0)
            if same and len(split[-1]) > 1:
                same = T == a.storage_offset() - windows[split[-1][-2]].storage_offset()
            if same:
                split[-1].append(t)
            else:
                split.append([t])
        for ts in split:
            run = dict(g, ts=ts)
            cfg = _group_config(config, run, proj)
            runs.append((run, compile_projection(
                x.dtype, run["width"], D, proj.bias.dtype if proj.bias is not None else None,
                run["epi"] is not None and proj.norm_weight is not None,
                rope_kind(rope_cs) if run["epi"] is not None else None, cfg, run["epi"] == "qkv",
                pacer is not None, weight_major(proj.weight))))
    if _is_fake(x):  # (views of fake CUDA tensors need a CUDA build of torch)
        return _no_launch
    device_index = x.device.index or 0
    bound = tuple((kern, run, tuple(rank_window_view([windows[t] for t in run["ts"]], row0, b, M) for b in range(B)),
                   _scheduler_args(kern, device_index)) for run, kern in runs)

    def launch(x, proj, rope_cs=None) -> None:
        if not _tma_rows(x, C, x.data_ptr()):
            x = x.clone(memory_format=torch.contiguous_format)  # fresh storage: an aligned base too
        for kern, run, views, sched in bound:
            weight, epi, per_call = _launch_args(proj, run, kern)
            if per_call:  # the epilogue's arguments with this call's RoPE table(s) and the pacer
                rope = rope_cs if isinstance(rope_cs, (tuple, list)) else (rope_cs,)
                epi = list(epi)
                for at, which in per_call:
                    epi[at] = pacer if which == "pacer" else rope[which]
                epi = tuple(epi)
            if B == 1:
                kern.compiled(x, weight, views[0], None, epi, sched, None, None, None)
            else:
                for b in range(B):
                    kern.compiled(x[b:b + 1], weight, views[b], None, epi, sched, None, None, None)

    return launch


def _tma_rows(x: torch.Tensor, C: int, address: int) -> bool:
    """Whether x [B, M, C] at `address` is what the GEMM's TMA loads: contiguous rows of C, a
    16-byte aligned base and batch stride."""
    return (x.stride(1) == C or x.shape[1] <= 1) and aligned16(x, address, dims=(0,))


def _no_launch(x, proj, rope_cs=None) -> None:
    return None


def _launch_args(proj: QKVWeights, run: dict, kern: _Kernel) -> tuple:
    """(weight rows [1, n, C], the epilogue tuple (launch_form's fields), ((position, which), ...)
    of the fields the call fills: which 0 / 1 for its RoPE table or (cos, sin) pair, "pacer" for its
    pacer) of launch group `run` for proj. Sliced at proj's first launch with `kern` and kept on
    proj (views: no copy)."""
    cache = proj.__dict__.setdefault("_launch_args", {})
    key = (run["ts"][0], run["ts"][-1], run["epi"], kern.fields)
    args = cache.get(key)
    if args is None:
        lo, hi, values = _group_values(proj, run, None)
        operands = {"b": values["bias"], "bias": values["bias"], "w": values["norm_weight"], "rot": values["rot"],
                    "sel": values["sel"]}
        epi, per_call = [], []
        for at, field in enumerate(kern.fields):
            if field is None:
                epi.append(None)
            elif field[0] in _CALL_FIELDS:  # the call's, put in at launch
                per_call.append((at, _CALL_FIELDS[field[0]]))
                epi.append(None)
            else:
                name, as_row = field
                epi.append(operands[name].unsqueeze(0) if as_row else operands[name])
        # (narrow: also on fake tensors of torch's CPU build, where indexing a CUDA tensor fails)
        args = cache[key] = (proj.weight.narrow(0, lo, hi - lo).unsqueeze(0), tuple(epi), tuple(per_call))
    return args


_CALL_FIELDS = {"cs": 0, "cos": 0, "sin": 1, "pacer": "pacer"}  # which tensor of the call's (table,) or (cos, sin)


def rank_window_view(tensors: Sequence[torch.Tensor], row0: int, batch: int, rows: int) -> torch.Tensor:
    """The kernel's D: a (1, rows, n_t, P, h*D) view of consecutive window tensors (each
    [P, B, N, h, D], one storage, a uniform distance T between them) at rows [row0, row0 + rows)
    of batch `batch`: element (0, m, t, p, i) is tensors[t][p, batch, row0 + m, i // D, i % D]."""
    base = tensors[0]
    P, B, N, h, D = base.shape
    width = h * D
    block = B * N * width  # one tensor's window: a valid stride for modes of extent 1
    W = base.stride(0) if P > 1 else block
    T = tensors[1].storage_offset() - base.storage_offset() if len(tensors) > 1 else block
    return base.as_strided((1, rows, len(tensors), P, width), (N * width, width, T, W, 1),
                           base.storage_offset() + (batch * N + row0) * width)


def qkv_projection_plain(x: torch.Tensor, proj: QKVWeights, out: torch.Tensor, *,
                         rope_cs: Optional[torch.Tensor] = None,
                         config: Optional[GemmConfig] = None, one_launch: bool = False) -> None:
    """The same projection through quack's own kernels (same launch groups, tile configuration
    and epilogues) writing a plain out [B, M, N_total] (columns in proj.weight's order): the
    baseline the fused kernel is compared with, bit for bit and in time. Needs a GPU."""
    _check_inputs(x, proj, rope_cs, config, one_launch)
    B, M, _ = x.shape
    n_total = proj.weight.shape[0]
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, M, n_total)
            or out.dtype != x.dtype or out.stride(-1) != 1 or out.device != x.device):
        raise ValueError(f"out: [{B}, {M}, {n_total}] {x.dtype} on {x.device} with contiguous rows "
                         "expected")
    if M == 0:
        return
    import quack.gemm as quack_gemm

    from cute_kernels.qkv_a2a_sm90_device import _epilogue_mod, _epilogue_values

    epilogue = proj.norm_weight is not None or rope_cs is not None
    for g in _groups(proj, [True, True, True], epilogue, one_launch):
        cfg = _group_config(config, g, proj)
        lo, hi, gv = _group_values(proj, g, rope_cs)
        bias = gv["bias"]
        for b in range(B):
            A, Bw, Dv = x[b:b + 1], proj.weight[lo:hi].unsqueeze(0), out[b:b + 1, :, lo:hi]
            if g["epi"]:
                mod = _epilogue_mod(bias is not None, gv["norm_weight"] is not None, rope_kind(gv["rope_cs"]),
                                    g["epi"] == "qkv")
                values = _epilogue_values(mod, head_dim=proj.head_dim, **gv)
                mod.gemm(A, Bw, Dv, epi_args=values, tile_M=cfg.tile_m, tile_N=cfg.tile_n,
                         cluster_M=cfg.cluster_m, cluster_N=cfg.cluster_n, pingpong=cfg.pingpong)
            else:
                quack_gemm.gemm(A, Bw, Dv, None, None, cfg.tile_m, cfg.tile_n, cfg.cluster_m,
                                cfg.cluster_n, pingpong=cfg.pingpong, persistent=True,
                                rowvec_bias=bias.unsqueeze(0) if bias is not None else None)


def interleaved_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """quack's RoPE table from diffusers-style cos/sin [S, D] (each frequency repeated for the
    adjacent pair): fp32 [S, D] with (cos_j, sin_j) at columns (2j, 2j+1)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] % 2:
        raise ValueError(f"cos, sin: two [S, D] tensors (D even) expected, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    return torch.stack([cos[:, 0::2], sin[:, 0::2]], dim=-1).flatten(1).float().contiguous()
