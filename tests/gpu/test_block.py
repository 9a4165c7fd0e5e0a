"""GPU: the Ulysses attention block from hidden states (fa_a2a.block), emulated ranks on one GPU.

Bit-exact: the block's outputs equal the same projection kernels writing plain outputs
(qkv_projection_plain, the same tile configuration and epilogue) whose q/k/v go through the op
(ulysses_attention_emulated, impl "fused": reference pre-A2A kernel, the same FA4 with the fused
post-A2A): the arithmetic is identical, so atol = 0. The block's in- and out-windows are
NaN-poisoned before every call; padding rows of x hold NaN (the block must zero them).
Numerics: within FA4's rule of the fp64 oracle on the unsplit sequence fed by the fp32 torch chain
(Linear -> per-head RMSNorm -> RoPE), against the bf16 chain + attention in bf16 as the baseline.
"""

import pytest
import torch

from cute_kernels import qkv_a2a_sm90 as K
from fa_a2a import block
from fa_a2a.engine import problem
from fa_a2a.op import ulysses_attention_emulated
from ulysses.layout import UlyssesLayout
from ulysses.reference import full_attention

from tests import helpers

DEV, DTYPE = "cuda", torch.bfloat16


def make_chain(H, H_kv, D, C, seed, *, norm=True, bias=True, across_heads=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    n = (H + 2 * H_kv) * D
    weight = (r(n, C) / C ** 0.5).to(DTYPE)
    b = (0.1 * r(n)).to(DTYPE) if bias else None
    nd = (H * D, H_kv * D) if across_heads else (D, D)
    qn, kn = (r(m) * 0.2 + 1.0 for m in nd) if norm else (None, None)
    return block.TorchQKV(weight, b, qn, kn, H, H_kv, D, across_heads)


def rope_tab(rows, D, offset):
    pos = torch.arange(offset, offset + rows, device=DEV, dtype=torch.float32)
    inv = 10000.0 ** (-torch.arange(D // 2, device=DEV, dtype=torch.float32) / (D // 2))
    ang = pos[:, None] * inv[None]
    return ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)


def to_heads(y, proj, t, heads):
    """Plain projection output y [B, M, N_total] (destination order) -> tensor t's [B, M, heads, D]
    in global head order (padding heads dropped; a replicated KV head taken from any rank)."""
    P, D = proj.world_size, proj.head_dim
    lo, hi = proj.column_range(t)
    h = proj.widths[t] // D
    cols = y[..., lo:hi].unflatten(-1, (P, h, D))
    index = proj.head_map[2] if t == 0 else proj.head_map[3]
    out = y.new_full((*y.shape[:2], heads, D), float("nan"))
    for p in range(P):
        for j in range(h):
            if index[p][j] < heads:
                out[:, :, index[p][j]] = cols[:, :, p, j]
    return out


def plain_qkv(x, proj, rope_cs, **kw):
    y = torch.full((*x.shape[:2], proj.weight.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    K.qkv_projection_plain(x, proj, y, rope_cs=rope_cs, **kw)
    H, H_kv = proj.head_map[:2]
    return to_heads(y, proj, 0, H), to_heads(y, proj, 1, H_kv), to_heads(y, proj, 2, H_kv)


def poison(plan):
    helpers.poison_allocated(plan.transport)  # the plan's windows, every out-slot's too


def assert_same(got, ref, what):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    mism = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
    assert mism == 0, f"{what}: {mism} elements differ from the plain projection + the op"


# (P, S_loc, H, config/one_launch, pace): Flux's 24 heads at P = 8, the 192-row tile and one launch
# there; a rate by hand paces the projection's and the attention's stores (values unchanged)
CASES = [(1, 256, 4, False, None), (2, 200, 4, False, None), (4, 128, 8, False, None), (8, 576, 24, True, None),
         (2, 256, 4, False, 40.0)]


@pytest.mark.parametrize("P,S_loc,H,tuned,pace", CASES)
def test_block_bit_exact_and_close(P, S_loc, H, tuned, pace):
    D, C, B = 128, 256, 1
    chain = make_chain(H, H, D, C, seed=P)
    proj = block.block_weights(chain, P)
    kw = dict(config=K.config_for(S_loc, (H // P) * D, D, True), one_launch=True) if tuned else {}
    g = torch.Generator(device=DEV).manual_seed(10 + P)
    xs = [torch.randn(B, S_loc, C, generator=g, device=DEV).to(DTYPE) for _ in range(P)]
    rot = [rope_tab(S_loc, D, r * S_loc) for r in range(P)]
    plan = block.emulated_plan(P, UlyssesLayout.from_shard(S_loc, H, H, P), B, D, DTYPE, DEV)
    poison(plan)
    got = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot, pace=pace, **kw)
    if pace is not None:  # the P ranks' prepared calls of this signature pace their projections at the rate
        entries = [entry for key, entry in problem._resolved.items() if key[0] == "ulysses_qkv_attention_emulated"]
        blocks = [rb for p, prepared in entries if p.pace == pace for rbs in prepared.values() for rb in rbs]
        assert len(blocks) == P and all(rb.pacing.rate_gbps == pace for rb in blocks)
    tabs = [K.interleaved_cos_sin(*c) for c in rot]
    qkv = [plain_qkv(x, proj, t, **kw) for x, t in zip(xs, tabs)]
    ref = ulysses_attention_emulated(*([t[i] for t in qkv] for i in range(3)), impl="fused")
    for r in range(P):
        assert_same(got[r], ref[r], f"rank {r}")
    # numerics: the fp32 chain + fp64 attention on the unsplit sequence
    x = torch.cat(xs, 1)
    cs = torch.cat(tabs, 0)
    oracle = full_attention(*chain(x, cs, torch.float32))
    base = full_attention(*chain(x, cs), dtype=DTYPE)
    helpers.check_attention(torch.cat(got, 1), oracle, base, 1e-3, "block vs fp64 oracle")


def test_uneven_gqa_head_padding_joint_own_weights():
    """Flux's double-stream shape of the problem: text rows with their own weights; plus an uneven S
    (NaN in x's padding rows), head padding (H = 6 on P = 4) and GQA (H_kv = 2)."""
    P, S_loc, H, H_kv, D, C, Cj, J, B = 4, 100, 6, 2, 128, 256, 128, 40, 2
    S = P * S_loc - 3  # the last rank holds 97 rows and 3 padding rows
    lay = UlyssesLayout.from_shard(S_loc, H, H_kv, P, seq_len=S, joint_len=J)
    chain, jchain = make_chain(H, H_kv, D, C, seed=1), make_chain(H, H_kv, D, Cj, seed=2)
    proj, jproj = block.block_weights(chain, P), block.block_weights(jchain, P)
    g = torch.Generator(device=DEV).manual_seed(3)
    xs = [torch.randn(B, S_loc, C, generator=g, device=DEV).to(DTYPE) for _ in range(P)]
    xs[-1][:, lay.valid_rows(P - 1):] = float("nan")
    jx = torch.randn(B, J, Cj, generator=g, device=DEV).to(DTYPE)
    rot = [K.interleaved_cos_sin(*rope_tab(S_loc, D, J + r * S_loc)) for r in range(P)]
    jrot = K.interleaved_cos_sin(*rope_tab(J, D, 0))
    plan = block.emulated_plan(P, lay, B, D, DTYPE, DEV)
    for rep in range(2):  # a second call over the first call's windows, poisoned again
        poison(plan)
        got, jgot = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot, joint=jx, joint_proj=jproj,
                                                         joint_rotary=jrot, seq_len=S)
    xz = [lay.zero_padding(x, r) for r, x in enumerate(xs)]
    qkv = [plain_qkv(x, proj, t) for x, t in zip(xz, rot)]
    # joint rows: each rank's heads from its own slice of the joint weights (the block's launches)
    jq = torch.full((B, J, H, D), float("nan"), dtype=DTYPE, device=DEV)
    jk = torch.full((B, J, H_kv, D), float("nan"), dtype=DTYPE, device=DEV)
    jv = jk.clone()
    for r in range(P):
        own = jproj.rank_slice(r)
        y = torch.empty(B, J, own.weight.shape[0], dtype=DTYPE, device=DEV)
        K.qkv_projection_plain(jx, own, y, rope_cs=jrot)
        parts = y.split([w for w in own.widths], dim=-1)
        for t, (dst, index) in enumerate(((jq, lay.q_head_index[r]), (jk, lay.kv_head_index[r]),
                                          (jv, lay.kv_head_index[r]))):
            for j, h in enumerate(index):
                if h < dst.shape[2]:
                    dst[:, :, h] = parts[t].unflatten(-1, (-1, D))[:, :, j]
    ref, jref = ulysses_attention_emulated(*([t[i] for t in qkv] for i in range(3)), impl="fused",
                                           joint=(jq, jk, jv), seq_len=S)
    for r in range(P):
        assert_same(got[r], ref[r], f"rank {r}")
        assert_same(jgot[r], jref[r], f"joint, rank {r}")
    assert torch.all(got[-1][:, lay.valid_rows(P - 1):] == 0), "padding rows must come back as zeros"
    assert all(torch.equal(jgot[0], j) for j in jgot), "every rank gets the same joint output"


@pytest.mark.parametrize("P", [2, 3])
def test_segments_text_and_image_rows_uneven_shards(P):
    """Flux under diffusers' context parallelism: every rank holds [text shard; image shard], the
    two with their own weights (text C = 128, image C = 256) and rotary rows, shards as diffusers'
    ulysses_anything splits them (tensor_split of 7 text and 63 image rows: uneven). Bit-exact
    against the plain projections of each segment, concatenated, through the op; within FA4's rule
    of the fp64 oracle on the whole sequence (the ranks' [text; image] rows in rank order)."""
    H, D, C, Cj, B = 4, 128, 256, 128, 2
    t_rows = [len(c) for c in torch.arange(7).tensor_split(P)]
    i_rows = [len(c) for c in torch.arange(63).tensor_split(P)]
    rows = [a + b for a, b in zip(t_rows, i_rows)]
    tchain, ichain = make_chain(H, H, D, Cj, seed=20 + P), make_chain(H, H, D, C, seed=30 + P)
    tproj, iproj = block.block_weights(tchain, P), block.block_weights(ichain, P)
    g = torch.Generator(device=DEV).manual_seed(40 + P)
    tx = [torch.randn(B, n, Cj, generator=g, device=DEV).to(DTYPE) for n in t_rows]
    ix = [torch.randn(B, n, C, generator=g, device=DEV).to(DTYPE) for n in i_rows]
    trot = [rope_tab(n, D, 100 * r) for r, n in enumerate(t_rows)]
    irot = [rope_tab(n, D, 100 * r + 50) for r, n in enumerate(i_rows)]
    xs = [[block.Segment(tx[r], tproj, trot[r]), block.Segment(ix[r], iproj, irot[r])] for r in range(P)]
    plan = block.emulated_plan(P, UlyssesLayout.from_shard_rows(rows, H, H, P), B, D, DTYPE, DEV)
    for _ in range(2):  # a second call over the first call's windows, poisoned again
        poison(plan)
        got = block.ulysses_qkv_attention_emulated(xs, shard_rows=rows, config=None)
    ttab = [K.interleaved_cos_sin(*c) for c in trot]
    itab = [K.interleaved_cos_sin(*c) for c in irot]
    qkv = [[torch.cat(pair, 1) for pair in zip(plain_qkv(tx[r], tproj, ttab[r]), plain_qkv(ix[r], iproj, itab[r]))]
           for r in range(P)]
    ref = ulysses_attention_emulated(*([t[i] for t in qkv] for i in range(3)), impl="fused", shard_rows=rows)
    for r in range(P):
        assert got[r].shape == (B, rows[r], H, D)
        assert_same(got[r], ref[r], f"rank {r}")
    full32 = [[torch.cat(p, 1) for p in zip(tchain(tx[r], ttab[r], torch.float32),
                                            ichain(ix[r], itab[r], torch.float32))] for r in range(P)]
    full = [[torch.cat(p, 1) for p in zip(tchain(tx[r], ttab[r]), ichain(ix[r], itab[r]))] for r in range(P)]
    oracle = full_attention(*(torch.cat([f[i] for f in full32], 1) for i in range(3)))
    base = full_attention(*(torch.cat([f[i] for f in full], 1) for i in range(3)), dtype=DTYPE)
    helpers.check_attention(torch.cat(got, 1), oracle, base, 1e-3, "segments vs fp64 oracle")


def test_module_fused_and_across_heads_fallback():
    """UlyssesQKVAttention.from_linear (diffusers-style layers): per-head norms -> the fused block,
    bit-equal to the function; Wan-style norms across heads -> torch chain + the fused op, within
    FA4's rule of the oracle."""
    P, S_loc, H, D, C = 2, 128, 4, 64, 256
    torch.manual_seed(0)
    lin = [torch.nn.Linear(C, H * D, device=DEV, dtype=DTYPE) for _ in range(3)]
    nq, nk = (torch.nn.RMSNorm(D, eps=1e-6, device=DEV) for _ in range(2))
    xs = [torch.randn(1, S_loc, C, device=DEV).to(DTYPE) for _ in range(P)]
    rot = [rope_tab(S_loc, D, r * S_loc) for r in range(P)]
    with torch.no_grad():
        for n in (nq, nk):
            n.weight.normal_(1.0, 0.2)
        mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=nq, norm_k=nk, world_size=P)
        assert mod.fused
        got = mod.forward_emulated(xs, rotary=rot)
        ref = block.ulysses_qkv_attention_emulated(xs, mod.proj, rotary=rot)
        for r in range(P):
            assert_same(got[r], ref[r], f"module rank {r}")
        wq, wk = (torch.nn.RMSNorm(H * D, eps=1e-6, device=DEV) for _ in range(2))
        for n in (wq, wk):
            n.weight.normal_(1.0, 0.2)
        wan = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=wq, norm_k=wk, across_heads=True,
                                                    world_size=P)
        assert not wan.fused
        out = wan.forward_emulated(xs, rotary=rot)
        x = torch.cat(xs, 1)
        cs = torch.cat([K.interleaved_cos_sin(*c) for c in rot])
        chain = block.TorchQKV(torch.cat([m.weight for m in lin]), torch.cat([m.bias for m in lin]), wq.weight,
                               wk.weight, H, H, D, across_heads=True, eps=1e-6)  # the layers' chain, built here
        oracle = full_attention(*chain(x, cs, torch.float32))
        base = full_attention(*chain(x, cs), dtype=DTYPE)
        helpers.check_attention(torch.cat(out, 1), oracle, base, 1e-3, "across-heads fallback")
        single = block.UlyssesQKVAttention.from_linear(*lin, head_dim=D, norm_q=nq, norm_k=nk)  # P = 1
        one = single(x, rotary=(torch.cat([c[0] for c in rot]), torch.cat([c[1] for c in rot])))
        assert_same(one, block.ulysses_qkv_attention_emulated([x], single.proj, rotary=[cs])[0], "P = 1")


def test_graph_replay_matches_eager():
    P, S_loc, H, D, C = 4, 128, 8, 128, 256
    chain = make_chain(H, H, D, C, seed=5)
    proj = block.block_weights(chain, P)
    xs = [torch.randn(1, S_loc, C, device=DEV).to(DTYPE) for _ in range(P)]
    rot = [K.interleaved_cos_sin(*rope_tab(S_loc, D, r * S_loc)) for r in range(P)]
    eager = [o.clone() for o in block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = block.ulysses_qkv_attention_emulated(xs, proj, rotary=rot)
    plan = block.emulated_plan(P, UlyssesLayout.from_shard(S_loc, H, H, P), 1, D, DTYPE, DEV)
    poison(plan)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for r in range(P):
        assert_same(outs[r], eager[r], f"replay rank {r}")


@pytest.mark.parametrize("impl", ["fused", "serial"])
def test_one_rank_runs_without_a_transport(impl):
    """P = 1 (no group): the projection into local buffers, then FA4 as the op's P = 1 path, with
    joint rows, GQA, a batch of 2 and diffusers' (cos, sin) pairs: bit for bit what the one-rank
    emulated block (its transport, barriers and windows) returns, call after call."""
    S, H, H_kv, D, C, Cj, J, B = 300, 4, 2, 128, 256, 128, 40, 2
    chain, jchain = make_chain(H, H_kv, D, C, seed=7), make_chain(H, H_kv, D, Cj, seed=8)
    proj, jproj = block.block_weights(chain, 1), block.block_weights(jchain, 1)
    g = torch.Generator(device=DEV).manual_seed(9)
    rot, jrot = rope_tab(S, D, J), rope_tab(J, D, 0)
    for _ in range(2):
        x = torch.randn(B, S, C, generator=g, device=DEV).to(DTYPE)
        jx = torch.randn(B, J, Cj, generator=g, device=DEV).to(DTYPE)
        got, jgot = block.ulysses_qkv_attention(x, proj, rotary=rot, joint=jx, joint_proj=jproj, joint_rotary=jrot,
                                                impl=impl)
        ref, jref = block.ulysses_qkv_attention_emulated([x], proj, rotary=[rot], joint=jx, joint_proj=jproj,
                                                         joint_rotary=jrot, impl=impl)
        assert_same(got, ref[0], "sequence rows")
        assert_same(jgot, jref[0], "joint rows")
