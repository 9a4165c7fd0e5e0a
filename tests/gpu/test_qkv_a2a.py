"""GPU: the QKV projection with the pre-A2A in its epilogue (cute_kernels/qkv_a2a_sm90.py).

Bit-exact: the windows the fused kernel writes equal quack's own kernels (same tile
configuration and epilogue) writing a plain output, moved by a reference scatter; the windows
are NaN-poisoned, with NaN pads between q, k, v and between windows that must stay untouched, and
source ranks run in reverse order so a row overflow into the next rank's rows would show.
Numerics: within bf16 tolerance of the torch chain Linear -> per-head RMSNorm -> RoPE in fp32
(error <= 2x that of the same chain in bf16 + 1e-3).
"""

import pytest
import torch

from cute_kernels import qkv_a2a_sm90 as K
from cute_kernels.limits import EPS
from ulysses.layout import UlyssesLayout

DEV = "cuda"
PAD = 64  # elements between tensors of a window and after each window (128 bytes in 16-bit)


class Windows:
    """P in-windows in one allocation at a uniform stride, q | k | v in each (the op's layout,
    plus NaN pads): windows[t] is [P, B, N, h_t, D]."""

    def __init__(self, P, B, N, heads, D, dtype, host=False):
        sizes = [B * N * h * D for h in heads]
        self.offsets = [sum(sizes[:t]) + t * PAD for t in range(3)]
        width = self.offsets[2] + sizes[2] + PAD
        if host:  # pinned host memory the GPU stores into over PCIe (the one-GPU slow link)
            from ulysses.transport import pinned_on_device

            mem, self.host = pinned_on_device(P * width, dtype, torch.device(DEV, torch.cuda.current_device()))
            self.mem = mem.view(P, width).fill_(float("nan"))
        else:
            self.mem = torch.full((P, width), float("nan"), dtype=dtype, device=DEV)
        self.data = torch.zeros_like(self.mem, dtype=torch.bool)
        self.tensors = []
        for t, (h, n) in enumerate(zip(heads, sizes)):
            o = self.offsets[t]
            self.tensors.append(self.mem[:, o:o + n].unflatten(1, (B, N, h, D)))
            self.data[:, o:o + n] = True


def scatter(y, windows, proj, row0):
    """Reference pre-A2A of a plain projection output y [B, M, N_total] (columns in proj order)."""
    M, P, D = y.shape[1], proj.world_size, proj.head_dim
    for t, w in enumerate(windows):
        if w is None:
            continue
        h = proj.widths[t] // D
        lo, hi = proj.column_range(t)
        w[:, :, row0:row0 + M] = y[:, :, lo:hi].unflatten(2, (P, h, D)).permute(2, 0, 1, 3, 4)


def torch_chain(x, proj, rope_cs, dtype):
    """Linear -> per-head RMSNorm (q, k) -> interleaved RoPE (q, k), computed in `dtype`
    (float32: the reference; x's dtype: the same-precision baseline, rounded after each step)."""
    y = torch.nn.functional.linear(x.to(dtype), proj.weight.to(dtype),
                                   proj.bias.to(dtype) if proj.bias is not None else None)
    n_qk = proj.column_range(1)[1]
    qk = y[..., :n_qk].unflatten(-1, (-1, proj.head_dim))
    if proj.norm_weight is not None:
        w = proj.norm_weight.view(-1, proj.head_dim)
        qk32 = qk.float()
        qk = (qk32 * torch.rsqrt(qk32.pow(2).mean(-1, keepdim=True) + EPS) * w).to(dtype)
    if rope_cs is not None:
        c, s = rope_cs[:, None, 0::2], rope_cs[:, None, 1::2]
        x1, x2 = qk.float()[..., 0::2], qk.float()[..., 1::2]
        qk = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(dtype)
    return torch.cat([qk.flatten(-2), y[..., n_qk:]], dim=-1)


def rope_table(rows, D, offset=0):
    pos = torch.arange(offset, offset + rows, device=DEV, dtype=torch.float32)
    inv = 10000.0 ** (-torch.arange(D // 2, device=DEV, dtype=torch.float32) / (D // 2))
    ang = pos[:, None] * inv[None]
    return K.interleaved_cos_sin(ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1))


def make_proj(H, H_kv, D, C, P, dtype, *, bias=True, norm=True, layout=None, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    wq, wk, wv = ((r(h * D, C) / C ** 0.5).to(dtype) for h in (H, H_kv, H_kv))
    b = [(0.1 * r(h * D)).to(dtype) for h in (H, H_kv, H_kv)] if bias else [None] * 3
    nw = [r(D) * 0.2 + 1.0 for _ in range(2)] if norm else [None] * 2
    heads = {}
    if layout is not None:
        heads = dict(q_head_index=layout.q_head_index, kv_head_index=layout.kv_head_index)
    return K.QKVWeights.from_linear(wq, wk, wv, head_dim=D, world_size=P, bq=b[0], bk=b[1], bv=b[2],
                                    q_norm_weight=nw[0], k_norm_weight=nw[1], **heads)


def run_case(proj, B, S_loc, C, dtype, rope, *, extra_rows=0, seed=1, config=None, one_launch=False, pacer=None,
             host=False):
    """All P source ranks (reverse order) into fresh NaN windows (host: the fused kernel's in pinned
    host memory), fused (paced by `pacer` when given) and reference; returns the reference outputs
    per rank for the numerics check."""
    P, D = proj.world_size, proj.head_dim
    N = P * S_loc + extra_rows
    heads = [w // D for w in proj.widths]
    got, ref = Windows(P, B, N, heads, D, dtype, host=host), Windows(P, B, N, heads, D, dtype)
    g = torch.Generator(device=DEV).manual_seed(seed)
    y = torch.empty(B, S_loc, proj.weight.shape[0], dtype=dtype, device=DEV)
    outs = []
    for r in reversed(range(P)):
        x = torch.randn(B, S_loc, C, generator=g, device=DEV).to(dtype)
        cs = rope_table(S_loc, D, r * S_loc) if rope else None
        K.qkv_a2a_projection(x, proj, got.tensors, r * S_loc, rope_cs=cs, config=config,
                             one_launch=one_launch, pacer=pacer)
        y.fill_(float("nan"))
        K.qkv_projection_plain(x, proj, y, rope_cs=cs, config=config, one_launch=one_launch)
        scatter(y, ref.tensors, proj, r * S_loc)
        outs.append((x, cs, y.clone()))
    torch.cuda.synchronize()
    return got, ref, outs


def assert_bit_exact(got, ref, written_rows_all=True):
    mism = int((got.mem.view(torch.int16) != ref.mem.view(torch.int16)).sum())
    assert mism == 0, f"{mism} elements differ from quack's plain output moved by the reference scatter"
    assert not got.mem[~got.data].isnan().logical_not().any(), "a pad was written"
    if written_rows_all:
        assert not got.mem[got.data].isnan().any(), "rows left unwritten"


def assert_close_to_torch(proj, outs, rope, dtype):
    for x, cs, y in outs:
        ref = torch_chain(x, proj, cs if rope else None, torch.float32)
        base = torch_chain(x, proj, cs if rope else None, dtype)
        err = (y.float() - ref).abs().max().item()
        err_base = (base.float() - ref).abs().max().item()
        assert err <= 2 * err_base + 1e-3, (err, err_base)


@pytest.mark.parametrize("P,S_loc", [(1, 200), (2, 130), (3, 77), (4, 256), (8, 100)])
def test_bias_norm_rope_bit_exact(P, S_loc):
    """Flux's q/k path (bias, per-head RMSNorm with weight, RoPE), v bias only; D = 128."""
    dtype, D, C = torch.bfloat16, 128, 512
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype)
    got, ref, outs = run_case(proj, 1, S_loc, C, dtype, rope=True)
    assert_bit_exact(got, ref)
    assert_close_to_torch(proj, outs[:2], True, dtype)


@pytest.mark.parametrize("P,S_loc", [(8, 576), (2, 130)])
def test_192_row_tiles(P, S_loc):
    """config_for's 192x128 tiles (cluster 1x2): the last M tile is partial at S_loc = 130."""
    dtype, D, C = torch.bfloat16, 128, 512
    config = K.config_for(S_loc, 2 * D, D, True)
    assert (config.tile_m, config.tile_n) == (192, 128)
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype)
    for rope, nproj in ((True, proj), (False, K.QKVWeights(proj.weight, proj.bias, None, P, 2, 2, D))):
        got, ref, outs = run_case(nproj, 1, S_loc, C, dtype, rope=rope, config=config)
        assert_bit_exact(got, ref)
        assert_close_to_torch(nproj, outs[:1], rope, dtype)


@pytest.mark.parametrize("P,S_loc,rows_config", [(8, 576, True), (3, 77, False)])
def test_one_launch_bit_exact(P, S_loc, rows_config):
    """q|k|v in one launch (qkv_bias_norm_rope_epi): bit-exact against quack's plain output of
    the same epilogue, and v equal to the two-launch kernels' v (same tiles): passed through."""
    dtype, D, C = torch.bfloat16, 128, 512
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype)
    config = K.config_for(S_loc, 2 * D, D, True) if rows_config else K.GemmConfig(tile_n=128)
    got, ref, outs = run_case(proj, 1, S_loc, C, dtype, rope=True, config=config, one_launch=True)
    assert_bit_exact(got, ref)
    assert_close_to_torch(proj, outs[:2], True, dtype)
    two, _, _ = run_case(proj, 1, S_loc, C, dtype, rope=True, config=config)
    assert torch.equal(got.tensors[2], two.tensors[2])


@pytest.mark.parametrize("norm,rope,one_launch,config,host", [
    (True, True, False, None, True),  # two launches (composed q|k epilogue, default-class v), host windows
    (True, True, True, "rows", False),  # one launch, 192-row tiles
    (False, False, False, None, True),  # bias only, the default class
])
def test_paced_bit_exact(norm, rope, one_launch, config, host):
    """pacer=: the windows are the unpaced kernels' bit for bit (pacing only delays stores)."""
    from cute_kernels.pacer import UNIT_BYTES, make_pacer

    dtype, D, C, P, S_loc = torch.bfloat16, 128, 512, 4, 576
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype, norm=norm)
    cfg = K.config_for(S_loc, 2 * D, D, True) if config == "rows" else None
    pacer = make_pacer(torch.device(DEV, torch.cuda.current_device()), 20.0, UNIT_BYTES, 4)
    got, ref, outs = run_case(proj, 1, S_loc, C, dtype, rope=rope, config=cfg, one_launch=one_launch,
                              pacer=pacer, host=host)
    assert_bit_exact(got, ref)
    assert_close_to_torch(proj, outs[:1], rope, dtype)


def test_pacer_spaces_the_projection_stores():
    """At 1 GB/s the projection's stores (S_loc x N x 2 bytes) take at least their bytes / rate less
    the burst tolerance, and not much more."""
    from cute_kernels.pacer import UNIT_BYTES, make_pacer

    dtype, D, C, P, S_loc = torch.bfloat16, 128, 512, 4, 384
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype)
    N = P * S_loc
    win = Windows(P, 1, N, [2, 2, 2], D, dtype)
    x = torch.randn(1, S_loc, C, device=DEV).to(dtype)
    cs = rope_table(S_loc, D)
    pacer = make_pacer(x.device, 1.0, UNIT_BYTES, burst_tiles=2)
    launch = K.qkv_a2a_launcher(x, proj, win.tensors, 0, rope_cs=cs, pacer=pacer)
    launch(x, proj, cs)  # compiled, and a TAT in the past for the next launch
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    launch(x, proj, cs)
    b.record()
    torch.cuda.synchronize()
    units = S_loc * proj.weight.shape[0] * 2 / UNIT_BYTES
    unit_us = pacer[1].item() / 1e3
    assert a.elapsed_time(b) * 1e3 >= (units - 2 - 1) * unit_us
    assert a.elapsed_time(b) * 1e3 < (units + 20) * unit_us


def test_head_dim_64_and_batch():
    dtype, D, C, P = torch.bfloat16, 64, 256, 4
    proj = make_proj(4 * P, 4 * P, D, C, P, dtype)
    got, ref, outs = run_case(proj, 2, 50, C, dtype, rope=True)
    assert_bit_exact(got, ref)
    assert_close_to_torch(proj, outs[:1], True, dtype)


@pytest.mark.parametrize("P", [2, 3])
def test_bias_only_fp16_one_launch(P):
    """No norm, no RoPE: q | k | v in one launch (one window stride, one tensor distance)."""
    dtype, D, C = torch.float16, 64, 256
    proj = make_proj(4 * P, 4 * P, D, C, P, dtype, norm=False)
    got, ref, outs = run_case(proj, 2, 96, C, dtype, rope=False)
    assert_bit_exact(got, ref)
    assert_close_to_torch(proj, outs[:1], False, dtype)


@pytest.mark.parametrize("P,S_loc,epilogue", [(2, 130, False), (8, 100, True)])
def test_a_weight_read_n_major_equals_its_rows_bit_for_bit(P, S_loc, epilogue):
    """The fused backward's dO GEMM reads nn.Linear's weight in place (QKVWeights' weight = W.t(),
    contiguous columns: an N-major B, K.weight_major): its windows equal those of the same weight
    stored in contiguous rows, bit for bit (the same MMA and order over K), every row written."""
    import dataclasses

    dtype, D, C = torch.bfloat16, 128, 384
    proj = make_proj(3 * P, 3 * P, D, C, P, dtype, bias=epilogue, norm=epilogue)
    cols = dataclasses.replace(proj, weight=proj.weight.t().contiguous().t())
    assert K.weight_major(proj.weight) == "k" and K.weight_major(cols.weight) == "n"
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(1, S_loc, C, generator=g, device=DEV).to(dtype)
    cs = rope_table(S_loc, D, S_loc) if epilogue else None
    heads = [w // D for w in proj.widths]
    got = []
    for p in (proj, cols):
        w = Windows(P, 1, P * S_loc, heads, D, dtype)
        K.qkv_a2a_projection(x, p, w.tensors, S_loc, rope_cs=cs)
        got.append(w)
    torch.cuda.synchronize()
    assert torch.equal(got[0].mem.view(torch.int16), got[1].mem.view(torch.int16))
    for t in got[1].tensors:
        assert not t[:, :, S_loc:2 * S_loc].isnan().any(), "rows left unwritten"


def test_gqa_and_head_padding():
    """H = 6 query heads over P = 4 (2 a rank, heads 6 and 7 zero padding), H_kv = 1 (the KV
    head replicated on every rank), uneven S_loc: q and k|v launch apart (widths 256, 128)."""
    dtype, D, C, P, S_loc = torch.bfloat16, 128, 256, 4, 70
    layout = UlyssesLayout.from_shard(S_loc, 6, 1, P)
    assert (layout.heads_loc, layout.kv_heads_loc) == (2, 1)
    proj = make_proj(6, 1, D, C, P, dtype, layout=layout)
    got, ref, outs = run_case(proj, 1, S_loc, C, dtype, rope=True)
    assert_bit_exact(got, ref)
    assert torch.all(got.tensors[0][3] == 0), "padding heads must be exact zeros"
    assert_close_to_torch(proj, outs[:1], True, dtype)


def test_joint_rows_into_own_window():
    """Joint (text) rows: rank r's heads only, into its own window, q at S_pad + t and k, v at
    S + t (one rank window, row0 per launch); the sequence rows stay NaN."""
    dtype, D, C, P, S_loc, J, rank = torch.bfloat16, 128, 256, 4, 64, 40, 2
    full = make_proj(2 * P, 2 * P, D, C, P, dtype)
    n = 2 * D  # this rank's columns of q, k and v
    rows = torch.cat([full.weight[t * P * n + rank * n:t * P * n + (rank + 1) * n] for t in range(3)])
    bias = torch.cat([full.bias[t * P * n + rank * n:t * P * n + (rank + 1) * n] for t in range(3)])
    q_cols = P * n  # q part of the norm weight (the q head weight repeated), then k's
    norm = torch.cat([full.norm_weight[:n], full.norm_weight[q_cols:q_cols + n]])
    own = K.QKVWeights(rows, bias, norm, 1, 2, 2, D)
    N = P * S_loc + J
    got, ref = Windows(P, 1, N, [2, 2, 2], D, dtype), Windows(P, 1, N, [2, 2, 2], D, dtype)
    x = torch.randn(1, J, C, device=DEV).to(dtype)
    cs = rope_table(J, D, 10_000)
    for w, row0, sel in ((got, P * S_loc, (0,)), (got, P * S_loc - 8, (1, 2))):  # S = S_pad - 8
        wins = [w.tensors[t][rank:rank + 1] if t in sel else None for t in range(3)]
        K.qkv_a2a_projection(x, own, wins, row0, rope_cs=cs)
    y = torch.empty(1, J, own.weight.shape[0], dtype=dtype, device=DEV)
    K.qkv_projection_plain(x, own, y, rope_cs=cs)
    scatter(y, [ref.tensors[0][rank:rank + 1], None, None], own, P * S_loc)
    scatter(y, [None, ref.tensors[1][rank:rank + 1], ref.tensors[2][rank:rank + 1]], own, P * S_loc - 8)
    torch.cuda.synchronize()
    assert_bit_exact(got, ref, written_rows_all=False)
    assert got.mem[got.data].isnan().sum() == got.data.sum() - 3 * J * n


def test_graph_capture_replays_the_same_windows():
    dtype, D, C, P, S_loc = torch.bfloat16, 128, 256, 2, 128
    proj = make_proj(2 * P, 2 * P, D, C, P, dtype)
    x = torch.randn(1, S_loc, C, device=DEV).to(dtype)
    cs = rope_table(S_loc, D)
    w = Windows(P, 1, P * S_loc, [2, 2, 2], D, dtype)
    K.qkv_a2a_projection(x, proj, w.tensors, S_loc, rope_cs=cs)
    torch.cuda.synchronize()
    expect = w.mem.clone()
    w.mem.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.qkv_a2a_projection(x, proj, w.tensors, S_loc, rope_cs=cs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w.mem.view(torch.int16), expect.view(torch.int16))


@pytest.mark.parametrize("one_launch", [False, True])
def test_diffusers_pair_equals_the_table(one_launch):
    """rope_cs as diffusers' (cos, sin) pair (row views of larger tensors, as a rank's rows of the
    model's rotary are) gives bit for bit what its interleaved table gives, fused and plain: the
    epilogue reads c from cos's even columns and s from sin's odd ones."""
    P, S_loc, C, D, dtype = 4, 200, 512, 128, torch.bfloat16
    proj = make_proj(4 * P, 4 * P, D, C, P, dtype)
    pos = torch.arange(3 * S_loc, device=DEV, dtype=torch.float32)
    ang = pos[:, None] * 10000.0 ** (-torch.arange(D // 2, device=DEV, dtype=torch.float32) / (D // 2))
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    rows = slice(S_loc, 2 * S_loc)
    pair, table = (cos[rows], sin[rows]), K.interleaved_cos_sin(cos[rows], sin[rows])
    x = torch.randn(1, S_loc, C, device=DEV).to(dtype)
    heads = [w // D for w in proj.widths]
    outs = []
    for rope in (pair, table):
        w = Windows(P, 1, P * S_loc, heads, D, dtype)
        K.qkv_a2a_projection(x, proj, w.tensors, S_loc, rope_cs=rope, one_launch=one_launch)
        y = torch.full((1, S_loc, proj.weight.shape[0]), float("nan"), dtype=dtype, device=DEV)
        K.qkv_projection_plain(x, proj, y, rope_cs=rope, one_launch=one_launch)
        outs.append((w, y))
    torch.cuda.synchronize()
    (wp, yp), (wt, yt) = outs
    assert torch.equal(wp.mem.view(torch.int16), wt.mem.view(torch.int16))
    assert torch.equal(yp.view(torch.int16), yt.view(torch.int16)) and not yt.isnan().any()
