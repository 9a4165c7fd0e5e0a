"""CPU tier of the attention block from hidden states (fa_a2a.block; its projection stage and prepared
call: fa_a2a.engine.projection): the launches the projection makes for each rank (row offsets of q
and k/v, padding rows, joint rows into the rank's own window), the sm_90a compile of those launches
against fake tensors, the torch chain's RoPE against diffusers', and the argument checks ("arg:
expected, got")."""

import dataclasses
import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import qkv_a2a_sm90 as K
from fa_a2a import block
from fa_a2a.engine import forward, problem as engine_problem, projection
from ulysses.layout import UlyssesLayout


def _windows(P, B, N, h, hk, D, device="cpu", dtype=torch.bfloat16):
    return tuple(torch.empty(P, B, N, n, D, dtype=dtype, device=device) for n in (h, hk, hk))


@pytest.fixture
def launches(monkeypatch):
    seen = []

    def record(x, proj, windows, row0, *, rope_cs=None, config=None, one_launch=False):
        seen.append(dict(rows=x.shape[1], proj=proj, which=tuple(w is not None for w in windows),
                         P=next(w for w in windows if w is not None).shape[0], row0=row0,
                         rope_rows=None if rope_cs is None else rope_cs.shape[0]))

    monkeypatch.setattr(K, "qkv_a2a_launcher", _bind_recorder(record))
    return seen


def _bind_recorder(record):
    """A stand-in for K.qkv_a2a_launcher: each launch calls record(x, proj, windows, row0, rope_cs=,
    config=, one_launch=) with the launch's x, proj and rope_cs and the windows, row0 and tiles bound
    (and record.pacers the pacer bound, when record has that list)."""
    def bind(x, proj, windows, row0, *, rope_cs=None, config=None, one_launch=False, pacer=None):
        getattr(record, "pacers", []).append(pacer)
        return lambda x, proj, rope_cs=None: record(x, proj, windows, row0, rope_cs=rope_cs, config=config,
                                                    one_launch=one_launch)
    return bind


def test_project_even_rows_one_launch(launches):
    lay = UlyssesLayout.from_shard(64, 8, 8, 4)
    wins = _windows(4, 1, lay.num_rows, 2, 2, 64)
    x, cs = torch.zeros(1, 64, 32), torch.zeros(64, 64)
    for r in range(4):
        projection.project(wins, lay, r, x, "proj", cs, config=None)
    assert [(s["which"], s["row0"], s["rows"], s["rope_rows"]) for s in launches] == [
        ((True, True, True), 64 * r, 64, 64) for r in range(4)]


def test_project_uneven_rows_and_joint(launches):
    """Last rank with padding rows: its valid rows where q and k|v rows coincide (one launch), its
    padding rows projected from zeros (never read from x: q at its slot, k|v after the joint rows);
    joint rows with S < S_pad: q at S_pad, k|v at S, own window only."""
    P, S_loc, J = 4, 50, 7
    lay = UlyssesLayout.from_shard(S_loc, 8, 8, P, seq_len=P * S_loc - 3, joint_len=J)
    wins = _windows(P, 1, lay.num_rows, 2, 2, 64)
    x, cs, jx, jcs = torch.zeros(1, S_loc, 32), torch.zeros(S_loc, 64), torch.zeros(1, J, 16), torch.zeros(J, 64)
    projection.project(wins, lay, P - 1, x, "proj", cs, jx, "own", jcs, config=None)
    valid = S_loc - 3
    S = lay.seq_len
    got = [(s["proj"], s["which"], s["P"], s["row0"], s["rows"], s["rope_rows"]) for s in launches]
    assert got == [
        ("proj", (True, True, True), P, (P - 1) * S_loc, valid, valid),
        ("proj", (True, False, False), P, (P - 1) * S_loc + valid, 3, 3),
        ("proj", (False, True, True), P, S + J, 3, 3),
        ("own", (True, False, False), 1, lay.seq_pad, J, J),
        ("own", (False, True, True), 1, S, J, J),
    ]
    assert lay.key_rows(P - 1) == ((P - 1) * S_loc, S + J)


def _segment_layouts():
    """(layout, every rank's segment row counts): even shards, a suffix-padded S with joint rows,
    and diffusers' uneven shards (text and image rows tensor_split apart) with segments that reach
    past a rank's valid rows."""
    yield UlyssesLayout.from_shard(12, 4, 4, 2), [[5, 7], [12]]
    lay = UlyssesLayout.from_shard(10, 4, 2, 4, seq_len=37, joint_len=5)  # rank 3: 7 rows + 3 padding
    yield lay, [[4, 6], [1, 9], [10, 0], [2, 1, 7]]
    text, image = 7, 63
    for P in (2, 3, 4):
        t = [len(c) for c in torch.arange(text).tensor_split(P)]
        i = [len(c) for c in torch.arange(image).tensor_split(P)]
        lay = UlyssesLayout.from_shard_rows([a + b for a, b in zip(t, i)], 6, 6, P)
        yield lay, [[a, b] for a, b in zip(t, i)]


def test_segment_writes_match_the_layout_row_order():
    """Every slot row of every rank reaches its q row and its key row exactly once, from the right
    segment row (padding rows from the zero rows): checked against the layout's own key order
    (kv_row_source, built from masks, not from key_rows)."""
    for lay, rows in _segment_layouts():
        source = lay.kv_row_source().tolist()
        key_of = {s: k for k, s in enumerate(source) if s < lay.seq_pad}
        for r in range(lay.world_size):
            starts = [sum(rows[r][:i]) for i in range(len(rows[r]) + 1)]
            valid = lay.valid_rows(r)
            q_dst, kv_dst = {}, {}
            for seg, n, which, row in block.segment_writes(lay, r, rows[r]):
                first = starts[seg] if seg < len(rows[r]) else valid
                assert seg == len(rows[r]) or n <= rows[r][seg]
                for j in range(n):
                    slot = first + j
                    for dst in ([q_dst] if which == "q" else [kv_dst] if which == "kv" else [q_dst, kv_dst]):
                        assert slot not in dst, (lay, r, slot, which)
                        dst[slot] = row + j
            assert q_dst == {s: r * lay.seq_loc + s for s in range(lay.seq_loc)}, (lay, r)
            assert kv_dst == {s: key_of[r * lay.seq_loc + s] for s in range(lay.seq_loc)}, (lay, r)
            assert all(starts[seg] + n <= valid for seg, n, _, _ in block.segment_writes(lay, r, rows[r])
                       if seg < len(rows[r])), "rows past the valid ones are never read"
    with pytest.raises(ValueError, match="x: expected rows summing to >= 12"):
        block.segment_writes(UlyssesLayout.from_shard(12, 4, 4, 2), 0, [5, 6])


def test_project_segments(launches):
    """Flux's [text shard; image shard] on rank 1 of uneven shards: each segment with its own
    weights and rotary rows at its offset; the padding row from zeros with the image weights."""
    lay = UlyssesLayout.from_shard_rows([36, 35], 4, 4, 2)  # 4 + 32 and 4 + 31 rows
    wins = _windows(2, 1, lay.num_rows, 2, 2, 64)
    text = (torch.zeros(1, 4, 16), "text", torch.zeros(4, 64))
    image = (torch.zeros(1, 31, 32), "image", torch.zeros(31, 64))
    projection.project(wins, lay, 1, [text, image], config=None)
    got = [(s["proj"], s["which"], s["row0"], s["rows"], s["rope_rows"]) for s in launches]
    assert got == [("text", (True, True, True), 36, 4, 4),  # q row 36 = key row 36 (rank 0 full)
                   ("image", (True, True, True), 40, 31, 31),
                   ("image", (True, True, True), 71, 1, 1)]  # the padding row: q at its slot 71,
    #                                                  k|v after S = 71 (no joint rows): one launch
    launches.clear()
    projection.project(wins, lay, 0, [text, (torch.zeros(1, 32, 32), "image", None)], config=None)
    assert [(s["proj"], s["row0"], s["rows"], s["rope_rows"]) for s in launches] == [
        ("text", 0, 4, 4), ("image", 4, 32, None)]


def _chain(H, H_kv, D, C, device, norm=True, across=False):
    n = (H + 2 * H_kv) * D
    nd = (H * D, H_kv * D) if across else (D, D)
    return block.TorchQKV(torch.randn(n, C, device=device).to(torch.bfloat16),
                          torch.randn(n, device=device).to(torch.bfloat16),
                          *((torch.ones(m, device=device) for m in nd) if norm else (None, None)),
                          H, H_kv, D, across)


def _fake_proj(P, H, H_kv, D, C):
    """QKVWeights of fake CUDA tensors with the layout's head map (call inside FakeTensorMode;
    from_linear's index gathering needs a CUDA build of torch for fake CUDA tensors)."""
    lay = UlyssesLayout.from_shard(1, H, H_kv, P)
    n = P * (lay.heads_loc + 2 * lay.kv_heads_loc) * D
    return K.QKVWeights(torch.empty(n, C, dtype=torch.bfloat16, device="cuda"),
                        torch.empty(n, dtype=torch.bfloat16, device="cuda"),
                        torch.empty(P * (lay.heads_loc + lay.kv_heads_loc) * D, device="cuda"),
                        P, lay.heads_loc, lay.kv_heads_loc, D,
                        (H, H_kv, lay.q_head_index, lay.kv_head_index))


def test_block_weights_head_map():
    """block_weights gathers for the layout's head map (padding heads, GQA) and records it."""
    lay = UlyssesLayout.from_shard(1, 6, 2, 4)
    proj = block.block_weights(_chain(6, 2, 64, 32, "cpu"), 4)
    assert proj.head_map == (6, 2, lay.q_head_index, lay.kv_head_index)
    assert (proj.heads_loc, proj.kv_heads_loc) == (lay.heads_loc, lay.kv_heads_loc)
    assert proj.weight.shape == (4 * (lay.heads_loc + 2 * lay.kv_heads_loc) * 64, 32)


def test_project_compiles_for_sm90(monkeypatch):
    """The block's launches for GQA with head padding (q and k|v of different widths), compiled for
    sm_90a on fake tensors. (Row and window slices of fake CUDA tensors need a CUDA build of torch:
    the uneven and joint launches are checked by the recording tests above and on the GPU.)"""
    P, S_loc, D, C = 4, 64, 128, 256
    seen = []
    inner = K.compile_projection
    monkeypatch.setattr(K, "compile_projection", lambda *a: seen.append(a) or inner(*a))
    with FakeTensorMode():
        lay = UlyssesLayout.from_shard(S_loc, 6, 1, P)  # 2 q heads a rank (heads 6, 7 padding), 1 KV head
        proj = _fake_proj(P, 6, 1, D, C)
        wins = _windows(P, 1, lay.num_rows, lay.heads_loc, lay.kv_heads_loc, D, "cuda")
        x, cs = torch.empty(1, S_loc, C, dtype=torch.bfloat16, device="cuda"), torch.empty(S_loc, D, device="cuda")
        projection.project(wins, lay, 1, x, proj, cs, config=None)
    assert [(a[1], a[4], a[5]) for a in seen] == [(256, True, "table"), (128, True, "table"), (128, False, None)]


def test_auto_tiles():
    """192-row tiles (and one launch with bias + norm + RoPE) where they pad fewer rows: Flux's
    S_loc = 576 on 8 ranks; quack's defaults at 1024 and 4096 and for 64-wide ranks, in one launch
    with bias + norm + RoPE up to ONE_LAUNCH_ROWS rows."""
    lay = UlyssesLayout.from_shard(1, 24, 24, 8)
    h = lay.heads_loc
    full = K.QKVWeights(torch.empty(1), torch.empty(1), torch.empty(1), 8, h, h, 128, None)
    cs = torch.empty(1)
    assert projection.auto_tiles(576, full, cs) == (K.GemmConfig(192, 128, 1, 2, True), True)
    assert projection.auto_tiles(576, full, None) == (K.GemmConfig(192, 128, 1, 2, True), False)
    assert projection.auto_tiles(1024, full, cs) == (None, False)
    assert projection.auto_tiles(4096, full, cs) == (None, False)
    assert projection.auto_tiles(128, full, cs) == (None, True)
    assert projection.auto_tiles(128, full, None) == (None, False)
    assert projection.auto_tiles(projection.ONE_LAUNCH_ROWS + 128, full, cs) == (None, False)
    narrow = K.QKVWeights(torch.empty(1), None, None, 8, 1, 1, 64, None)
    assert projection.auto_tiles(576, narrow, None) == (None, False)


def test_rope_matches_diffusers():
    """The chain's interleaved RoPE on the kernel's table == diffusers' apply_rotary_emb (Flux's
    use_real_unbind_dim=-1) on its (cos, sin)."""
    emb = pytest.importorskip("diffusers.models.embeddings")
    S, H, D = 9, 2, 8
    pos = torch.arange(S, dtype=torch.float32)
    ang = pos[:, None] * 10000.0 ** (-torch.arange(D // 2) / (D // 2))[None]
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    x = torch.randn(1, S, H, D)
    ours = block.apply_rope(x, K.interleaved_cos_sin(cos, sin))
    theirs = emb.apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1)
    torch.testing.assert_close(ours, theirs)
    # rotary_pair (the benchmarks' and examples' pair) is this pair, and diffusers' own 1-D rotary
    assert all(torch.equal(a, b) for a, b in zip(block.rotary_pair(pos, D), (cos, sin)))
    dcos, dsin = emb.get_1d_rotary_pos_embed(D, pos, theta=10000.0, use_real=True, repeat_interleave_real=True)
    torch.testing.assert_close(block.rotary_pair(pos, D), (dcos.float(), dsin.float()))


def test_chain_per_head_and_across_heads():
    x = torch.randn(2, 5, 16)
    ch = _chain(2, 1, 8, 16, "cpu")
    ch = block.TorchQKV(ch.weight.float(), ch.bias.float(), torch.rand(8) + 0.5, torch.rand(8) + 0.5, 2, 1, 8)
    q, k, v = ch(x)
    y = torch.nn.functional.linear(x, ch.weight, ch.bias)
    q_ref = y[..., :16].unflatten(-1, (2, 8))
    q_ref = q_ref * torch.rsqrt(q_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * ch.q_norm
    torch.testing.assert_close(q, q_ref)
    assert k.shape == v.shape == (2, 5, 1, 8)
    wan = block.TorchQKV(ch.weight, ch.bias, torch.ones(16), torch.ones(8), 2, 1, 8, across_heads=True)
    q, _, _ = wan(x)
    q_ref = y[..., :16] * torch.rsqrt(y[..., :16].pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(q, q_ref.unflatten(-1, (2, 8)))
    with pytest.raises(ValueError, match="chain: per-head q/k norms expected"):
        block.block_weights(wan, 2)


BAD = [
    ("impl", lambda a: dict(impl="nccl"), "impl: expected one of"),
    ("channels", lambda a: dict(xs=[torch.empty(1, 32, 48, dtype=torch.bfloat16, device="cuda")] * 2),
     "xs\\[0\\]: expected C = 64"),
    ("dtype", lambda a: dict(xs=[torch.empty(1, 32, 64, dtype=torch.float16, device="cuda")] * 2),
     "xs\\[0\\]: expected the weights' torch.bfloat16"),
    ("dims", lambda a: dict(xs=[torch.empty(32, 64, dtype=torch.bfloat16, device="cuda")] * 2),
     "xs\\[0\\]: expected a 3-D tensor"),
    ("world", lambda a: dict(xs=[torch.empty(1, 32, 64, dtype=torch.bfloat16, device="cuda")] * 4,
                             rotary=None), "proj: expected weights gathered for P = 4 ranks"),
    ("no head map", lambda a: dict(proj=K.QKVWeights(a["proj"].weight, None, None, 2, 2, 2, 64)),
     "proj: expected weights with a head map"),
    ("rotary rows", lambda a: dict(rotary=[torch.empty(31, 64, device="cuda")] * 2),
     "rotary: expected a contiguous float32 \\[32, 64\\]"),
    ("rotary list", lambda a: dict(rotary=torch.empty(32, 64, device="cuda")), "rotary: expected None or a list"),
    ("rotary pair", lambda a: dict(rotary=[(torch.empty(32, 64, device="cuda"),)] * 2),
     "rotary: expected a \\(cos, sin\\) pair"),
    ("seq_len", lambda a: dict(seq_len=100), "seq_len"),
    ("joint_rotary alone", lambda a: dict(joint_rotary=torch.empty(3, 64, device="cuda")),
     "joint: expected the joint rows"),
    ("joint rope mismatch", lambda a: dict(joint=torch.empty(1, 3, 64, dtype=torch.bfloat16, device="cuda")),
     "joint_rotary: expected a table exactly when rotary is given"),
    ("joint batch", lambda a: dict(joint=torch.empty(2, 3, 64, dtype=torch.bfloat16, device="cuda"),
                                   joint_rotary=torch.empty(3, 64, device="cuda")), "joint: expected \\[1, J, C\\]"),
    ("causal joint", lambda a: dict(joint=torch.empty(1, 3, 64, dtype=torch.bfloat16, device="cuda"),
                                    joint_rotary=torch.empty(3, 64, device="cuda"), causal=True), "joint: expected no"),
    ("xs type", lambda a: dict(xs=torch.empty(2, 1, 32, 64, device="cuda")), "xs: expected a non-empty list"),
    ("cpu x", lambda a: dict(xs=[torch.empty(1, 32, 64, dtype=torch.bfloat16)] * 2), "xs\\[0\\]: expected a CUDA"),
    ("weight grad", lambda a: dict(proj=dataclasses.replace(a["proj"], weight=torch.empty_like(a["proj"].weight,
                                                                                        requires_grad=True))),
     "proj.weight: requires grad"),
    ("joint weight grad", lambda a: dict(joint=torch.empty(1, 3, 64, dtype=torch.bfloat16, device="cuda"),
                                         joint_rotary=torch.empty(3, 64, device="cuda"),
                                         joint_proj=dataclasses.replace(a["proj"], norm_weight=torch.empty_like(
                                             a["proj"].norm_weight, requires_grad=True))),
     "joint_proj.norm_weight: requires grad"),
    ("shard rows", lambda a: dict(shard_rows=[30, 34]), "xs\\[0\\]: expected shard_rows\\[0\\] = 30 rows"),
]


@pytest.mark.parametrize("name,change,match", BAD, ids=[b[0] for b in BAD])
def test_emulated_argument_checks(name, change, match):
    with FakeTensorMode():
        P, S_loc, H, D, C = 2, 32, 4, 64, 64
        proj = _fake_proj(P, H, H, D, C)
        args = dict(xs=[torch.empty(1, S_loc, C, dtype=torch.bfloat16, device="cuda") for _ in range(P)], proj=proj,
                    rotary=[torch.empty(S_loc, D, device="cuda") for _ in range(P)])
        args.update(change(args))
        xs, proj = args.pop("xs"), args.pop("proj")
        with pytest.raises(ValueError, match=match):
            block.ulysses_qkv_attention_emulated(xs, proj, **args)


def test_one_rank_argument_checks_and_module():
    """P = 1 (no process group): the same checks name x; the module refuses what it cannot build."""
    with FakeTensorMode():
        chain = _chain(4, 4, 64, 64, "cuda")
        proj = _fake_proj(1, 4, 4, 64, 64)
        with pytest.raises(ValueError, match="x: expected C = 64"):
            block.ulysses_qkv_attention(torch.empty(1, 8, 32, dtype=torch.bfloat16, device="cuda"), proj)
        with pytest.raises(ValueError, match="proj: expected a QKVWeights"):
            block.ulysses_qkv_attention(torch.empty(1, 8, 64, dtype=torch.bfloat16, device="cuda"), chain)
        with pytest.raises(ValueError, match="joint_proj: expected weights gathered for P = 1"):
            block.ulysses_qkv_attention(torch.empty(1, 8, 64, dtype=torch.bfloat16, device="cuda"), proj,
                                        joint=torch.empty(1, 3, 64, dtype=torch.bfloat16, device="cuda"),
                                        joint_proj=_fake_proj(2, 4, 4, 64, 64))
    lin = [torch.nn.Linear(64, 256, dtype=torch.bfloat16) for _ in range(3)]  # block_weights on CPU tensors
    with pytest.raises(ValueError, match="norm_q: expected eps 1e-06"):
        block.UlyssesQKVAttention.from_linear(*lin, head_dim=64, norm_q=torch.nn.RMSNorm(64, eps=1e-5),
                                              norm_k=torch.nn.RMSNorm(64, eps=1e-5))
    with pytest.raises(ValueError, match="norm_q, norm_k: both or neither"):
        block.UlyssesQKVAttention.from_linear(*lin, head_dim=64, norm_q=torch.nn.RMSNorm(64, eps=1e-6))
    with pytest.raises(ValueError, match="impl: expected one of"):
        block.UlyssesQKVAttention(_chain(4, 4, 64, 64, "cpu"), impl="reference")
    mod = block.UlyssesQKVAttention.from_linear(*lin, head_dim=64, world_size=2)
    assert mod.fused and mod.proj.world_size == 2 and mod.chain is None
    with pytest.raises(ValueError, match="xs: expected 2 per-rank tensors"):
        mod.forward_emulated([torch.empty(1, 8, 64, dtype=torch.bfloat16)])
    wan = block.UlyssesQKVAttention.from_linear(*lin, head_dim=64, norm_q=torch.nn.RMSNorm(256, eps=1e-5),
                                                norm_k=torch.nn.RMSNorm(256, eps=1e-5), across_heads=True)
    # no copy of the layers' weights: their own chain runs at every call
    assert not wan.fused and wan.proj is None and wan.chain is None and wan._chains()[0].eps == 1e-5


SEG_BAD = [
    ("proj too", lambda s, p: dict(proj=p), "proj: expected None with segments"),
    ("rotary too", lambda s, p: dict(rotary=[None, torch.empty(32, 64, device="cuda")]),
     "rotary: expected None with segments"),
    ("rotary on one", lambda s, p: dict(xs=[[s[0], s[1]._replace(rotary=None)]] * 2),
     "xs\\[0\\]\\[0\\].rotary: expected a rotary on every segment or on none"),
    ("batch", lambda s, p: dict(xs=[[s[0], s[1]._replace(x=torch.empty(2, 28, 64, dtype=torch.bfloat16,
                                                                        device="cuda"))]] * 2),
     "xs\\[0\\]\\[1\\].x: expected \\[1, rows, C\\]"),
    ("world", lambda s, p: dict(xs=[[s[0], s[1]._replace(proj=_fake_proj(4, 4, 4, 64, 64))]] * 2),
     "xs\\[0\\]\\[1\\].proj: expected weights gathered for P = 2"),
    ("segment rotary rows",
     lambda s, p: dict(xs=[[s[0], s[1]._replace(rotary=torch.empty(27, 64, device="cuda"))]] * 2),
     "xs\\[0\\]\\[1\\].rotary: expected a contiguous float32 \\[28, 64\\]"),
    ("not segments", lambda s, p: dict(xs=[[(s[0].x, s[0].proj)]] * 2),
     "xs\\[0\\]: expected a \\[B, rows, C\\] tensor or"),
    ("shard rows", lambda s, p: dict(shard_rows=[30, 34]), "xs\\[0\\]: expected shard_rows\\[0\\] = 30 rows"),
]


@pytest.mark.parametrize("name,change,match", SEG_BAD, ids=[b[0] for b in SEG_BAD])
def test_emulated_segment_argument_checks(name, change, match):
    """Segments (Flux's text and image rows, each with its own weights): the checks name the segment."""
    with FakeTensorMode():
        P, D, C = 2, 64, 64
        text, image = _fake_proj(P, 4, 4, D, C), _fake_proj(P, 4, 4, D, C)
        segs = [block.Segment(torch.empty(1, 4, C, dtype=torch.bfloat16, device="cuda"), text,
                              torch.empty(4, D, device="cuda")),
                block.Segment(torch.empty(1, 28, C, dtype=torch.bfloat16, device="cuda"), image,
                              torch.empty(28, D, device="cuda"))]
        args = dict(xs=[segs] * P, proj=None)
        args.update(change(segs, text))
        xs, proj = args.pop("xs"), args.pop("proj")
        with pytest.raises(ValueError, match=match):
            block.ulysses_qkv_attention_emulated(xs, proj, **args)


# ---- the real-rank path's prepared call ------------------------------------------------------------
class _FakeTransport:
    split_links, ranks_per_gpu, world_size, device = False, 1, 2, torch.device("cpu")
    pacing_link_gbps = 1e4  # a fast link, measured already: pace "auto" leaves the projection unpaced

    def __init__(self):
        self.closed, self.barriers = False, 0

    def barrier(self):
        self.barriers += 1


class _FakePlan:
    def __init__(self, transport, lay, B, D, dtype, device):
        self.transport, self.attends, self.joint = transport, 0, lay.joint_len > 0
        self.dq, self.dk, self.dv = _windows(lay.world_size, B, lay.num_rows, lay.heads_loc, lay.kv_heads_loc, D,
                                             device, dtype)

    def attend_launch(self, rank, impl, causal, scale, pace, o_store=None):
        return lambda slot=0: setattr(self, "attends", self.attends + 1)

    def choose_slot(self):
        return 0

    def finish(self, rank, rows, out=None, joint_out=None, slot=0):
        return ("out", rank, rows), ("joint out", rank) if self.joint else None

    complete = forward.WindowPlan.complete


def test_rope_operands_are_the_callers_tensors_where_the_epilogue_reads_them():
    """_rope_operand (the prepared call's rotary, every call): a float32 pair or table with rows the
    TMA loads is passed as it is (the same tensors: nothing converted per call); a bf16 one, or rows
    at a base that is not 16-byte aligned, become a float32 copy of equal values; a pair of more than
    PAIR_ROWS_MAX rows is stacked into its _RopeTable, quack's interleaved table."""
    rows, D = 6, 8
    g = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
    assert projection._rope_operand(None) is None
    got = projection._rope_operand((cos, sin))
    assert got[0] is cos and got[1] is sin
    assert projection._rope_operand(cos) is cos
    wide = torch.randn(rows, 2 * D, generator=g)
    got = projection._rope_operand((wide[:, :D], wide[:, D:]))  # row views of a wider table: loadable
    assert got[0].data_ptr() == wide.data_ptr() and got[1].data_ptr() == wide[:, D:].data_ptr()
    for odd in (cos.bfloat16(), torch.randn(rows * D + 1, generator=g)[1:].view(rows, D)):
        got = projection._rope_operand((odd, sin))
        assert got[0].dtype == torch.float32 and got[0].data_ptr() % 16 == 0 and torch.equal(got[0], odd.float())
        assert got[1] is sin
    long = tuple(torch.randn(projection.PAIR_ROWS_MAX + 1, D, generator=g) for _ in range(2))
    assert projection._rope_table_for((cos, sin), D) is None and projection._rope_table_for(cos, D) is None
    table = projection._rope_table_for(long, D)
    assert torch.equal(projection._rope_operand(long, table), K.interleaved_cos_sin(*long))  # quack's table
    assert projection._rope_operand(long, table) is table.table  # stacked into the kept buffer, call after call


def test_rope_table_follows_every_change_of_its_pair():
    """_RopeTable (the prepared call's (cos, sin) conversion): bit-equal to interleaved_cos_sin call
    after call, also after the pair's values change in place, after a new pair, after `.data` points
    a tensor elsewhere (its kept views are then rebuilt), for bf16 pairs and strided ones."""
    rows, D = 6, 8
    g = torch.Generator().manual_seed(0)
    rt = projection._RopeTable(rows, D, "cpu")
    pair = lambda dtype=torch.float32: (torch.randn(rows, D, generator=g, dtype=dtype),  # noqa: E731
                                        torch.randn(rows, D, generator=g, dtype=dtype))
    cos, sin = pair()
    cases = []
    cases.append((cos, sin))
    cases.append((cos.mul_(3), sin))  # same tensors, new values
    cases.append(pair())
    cases.append(pair(torch.bfloat16))
    wide = torch.randn(rows, 2 * D, generator=g)
    cases.append((wide[:, :D], wide[:, D:]))  # strided rows
    cos, sin = pair()
    rt(cos, sin)
    cos.data = torch.randn(rows, D, generator=g)  # the same object, other memory
    cases.append((cos, sin))
    for c, s_ in cases:
        out = rt(c, s_)
        assert out is rt.table and torch.equal(out, K.interleaved_cos_sin(c, s_))


def test_rank_block_launches_what_project_launches(monkeypatch):
    """The prepared call (uneven rows: padding rows from zeros, joint rows with S < S_pad, Flux's two
    segments, (cos, sin) pairs) launches exactly what project() launches, call after call: the same
    routing, this call's (cos, sin) pairs themselves (their rows), the same zero rows, and the joint
    weights sliced once."""
    import types

    seen = []
    monkeypatch.setattr(K, "qkv_a2a_launcher", _bind_recorder(
        lambda x, proj, windows, row0, *, rope_cs, config, one_launch:
        seen.append((x, proj, tuple(windows), row0, rope_cs, config, one_launch))))
    P, rank, D, J = 2, 1, 64, 5
    lay = UlyssesLayout.from_shard_rows([36, 33], 4, 4, P, joint_len=J)  # rank 1: 33 valid rows + 3 padding
    p = types.SimpleNamespace(layout=lay, batch=1, head_dim=D, dtype=torch.bfloat16, impl="fused", causal=False,
                              scale=0.125, pace=None, o_store=None)
    transport = _FakeTransport()
    monkeypatch.setattr(forward, "window_plan", lambda t, lay, B, D, dtype: _FakePlan(t, lay, B, D, dtype, "cpu"))
    sliced = []

    class JointWeights:  # stands for QKVWeights: its slice for a rank, and its data's versions (unchanged)
        def versions(self):
            return (0, 0, 0)

        def rank_slice(self, r):
            sliced.append(("joint", r))
            return f"joint@{r}"

    joint_weights = JointWeights()

    def call_args(seed):
        g = torch.Generator().manual_seed(seed)
        pair = lambda n: (torch.randn(n, D, generator=g), torch.randn(n, D, generator=g))  # noqa: E731
        segs = ((torch.randn(1, 4, 16, generator=g), "text", pair(4)),
                (torch.randn(1, 32, 32, generator=g), "image", pair(32)))
        return segs, torch.randn(1, J, 16, generator=g), pair(J)

    def same(a, b):  # the same window view
        return a is b if a is None or b is None else (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape,
                                                                                              b.stride())

    segs, jx, jpair = call_args(0)
    rb = projection._RankBlock(transport, p, rank, segs, jx, joint_weights, jpair, None, False)
    windows = (rb.plan.dq, rb.plan.dk, rb.plan.dv)
    prepared = []
    for seed in (1, 2):
        segs, jx, jpair = call_args(seed)
        seen.clear()
        assert rb(segs, jx, jpair, joint_weights) == (("out", rank, 36), ("joint out", rank))
        got = list(seen)
        prepared.append(got)
        seen.clear()
        projection.project(windows, lay, rank, list(segs), joint_x=jx, joint_proj="joint@1", joint_rope=jpair,
                      config=None)
        assert [a[1] for a in got] == ["text", "image", "image", "image", "joint@1", "joint@1"]
        assert len(got) == len(seen)
        for a, b in zip(got, seen):  # the same launch with the same values; x and windows the same tensors
            assert a[1] == b[1] and a[3:4] + a[5:] == b[3:4] + b[5:]
            assert all(same(u, v) for u, v in zip(a[2], b[2]))
            assert torch.equal(a[0], b[0]) and type(a[4]) is type(b[4])
            tables = lambda r: r if isinstance(r, tuple) else (r,)  # noqa: E731
            assert all(torch.equal(u, v) for u, v in zip(tables(a[4]), tables(b[4])))
        assert got[0][0] is segs[0][0] and got[4][0] is got[5][0] is jx
        assert got[1][0].data_ptr() == segs[1][0].data_ptr() and got[1][0].shape[1] == 29  # its valid rows
        pairs = [r for _, _, r in segs] + [jpair]
        for a in got:  # rope: this call's pairs (rows of them), the padding rows' zero table
            assert a[4] is rb.project.zeros[1] or any(a[4][0].data_ptr() == c.data_ptr()
                                                      and a[4][1].data_ptr() == s_.data_ptr() for c, s_ in pairs)
    for a, b in zip(*prepared):  # the zero rows of one call are the next call's
        assert a[2] == b[2] and (a[0] is b[0]) == (a[0] is rb.project.zeros[0])
    assert sliced == [("joint", rank)]
    assert transport.barriers == 4 and rb.plan.attends == 2


@pytest.mark.parametrize("pace,split,in_link,rate", [
    (None, False, None, None),
    (40.0, False, None, 40.0),  # a rate by hand paces the projection's stores at it
    ("auto", False, None, None),  # the fast link the fake transport measured
    (40.0, True, 1e4, None),  # input windows behind their own link: decided as "auto", from that link
    ("auto", True, 200.0, 170.0),  # a slower input link and a GEMM long enough beside it: paced at 85% of it
])
def test_rank_block_paces_its_projection_as_pace_says(monkeypatch, pace, split, in_link, rate):
    """_RankBlock binds one pacer (fa_a2a.engine.pacing.plan_projection_pacing) to every projection launch."""
    import types

    from cute_kernels.pacer import UNIT_BYTES

    pacers = []
    record = lambda *a, **k: None  # noqa: E731
    record.pacers = pacers
    monkeypatch.setattr(K, "qkv_a2a_launcher", _bind_recorder(record))
    monkeypatch.setattr(forward, "window_plan", lambda t, lay, B, D, dtype: _FakePlan(t, lay, B, D, dtype, "cpu"))
    P, D, C, S_loc = 2, 64, 4096, 64
    lay = UlyssesLayout.from_shard(S_loc, 4, 4, P)
    p = types.SimpleNamespace(layout=lay, batch=1, head_dim=D, dtype=torch.bfloat16, impl="fused", causal=False,
                              scale=0.125, pace=pace, o_store=None)
    transport = _FakeTransport()
    transport.split_links = split
    if in_link is not None:
        transport.pacing_in_link_gbps = in_link
    segs = ((torch.randn(1, S_loc, C), _fake_proj_cpu(P, 4, D, C), None),)
    rb = projection._RankBlock(transport, p, 0, segs, None, None, None, None, False)
    assert pacers and all(q is pacers[0] for q in pacers)  # one state for all the rank's launches
    assert (rb.pacing.rate_gbps if rb.pacing is not None else None) == (pytest.approx(rate) if rate else None)
    if rate is None:
        assert pacers[0] is None
    else:
        assert pacers[0][1].item() == round(UNIT_BYTES / rate)


def _fake_proj_cpu(P, H, D, C):
    n = 3 * H * D
    return K.QKVWeights(torch.empty(n, C, dtype=torch.bfloat16), None, None, P, H // P, H // P, D)


def test_rank_block_steady_state_and_refusals(monkeypatch):
    """ulysses_qkv_attention (P = 1, fake CUDA tensors): no transport or window plan (the projection
    writes buffers of the in-windows' layout, FA4 runs on them as the op's P = 1 path); the
    projection's routing is built once per signature (not per call); a bad rotary of the same
    signature is still refused by name. With a group (P = 2), a closed transport's call is rebuilt."""
    import cute_kernels.fa4 as fa4_mod
    import ulysses.transport as transport_mod

    seen, bound, attended, made = [], [], [], []
    monkeypatch.setattr(engine_problem, "_resolved", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(K, "qkv_a2a_launcher", _bind_recorder(
        lambda x, proj, windows, row0, *, rope_cs, config, one_launch:
        seen.append((x, row0, rope_cs, config, one_launch, windows))))
    monkeypatch.setattr(transport_mod, "get_transport", lambda group: made.append(_FakeTransport()) or made[-1])
    monkeypatch.setattr(forward, "window_plan", lambda t, lay, B, D, dtype: made.append("plan") or
                        _FakePlan(t, lay, B, D, dtype, "cuda"))

    def fresh_launcher(q, k, v, **kw):  # FA4 on the windows, bound once per prepared block
        bound.append((q, k, v, kw))
        return lambda: attended.append(q) or torch.empty(q.shape, dtype=q.dtype, device=q.device)

    monkeypatch.setattr(fa4_mod, "fa4_fresh_launcher", fresh_launcher)
    routed = []
    inner = projection.segment_writes
    monkeypatch.setattr(projection, "segment_writes", lambda *a: routed.append(a) or inner(*a))
    with FakeTensorMode():
        S, D, C = 32, 64, 64
        proj = _fake_proj(1, 4, 4, D, C)
        xs = [torch.empty(1, S, C, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
        table = torch.empty(S, D, device="cuda")
        for x in xs:
            out = block.ulysses_qkv_attention(x, proj, rotary=table)
            assert out.shape == (1, S, 4, D)
        assert made == [] and len(routed) == 1 and [s[0] for s in seen] == xs and all(s[2] is table for s in seen)
        windows = seen[0][5]
        assert len(bound) == 1 and bound[0][0].data_ptr() == windows[0].data_ptr() and len(attended) == 3
        assert bound[0][3] == dict(causal=False, softmax_scale=D ** -0.5, seqused_k=None)
        with pytest.raises(ValueError, match="rotary: expected a contiguous float32 \\[32, 64\\] table"):
            # the same signature (strides are not in it): refused by the call's own check
            block.ulysses_qkv_attention(xs[0], proj, rotary=torch.empty_strided((S, D), (1, S), device="cuda"))
        with pytest.raises(ValueError, match="rotary: expected cos, sin of shape \\[32, 64\\]"):
            block.ulysses_qkv_attention(xs[0], proj, rotary=(table, torch.empty(1, D, device="cuda")))

        proj2 = _fake_proj(2, 4, 4, D, C)
        problem = block._check_rank_call(xs[0], proj2, table, None, None, None, "fused", False, None, None, None,
                                         2, 0)
        segs = block._rank_segments(xs[0], proj2, table)
        calls = {}
        first = projection._rank_block(calls, "group", 2, 0, problem, segs, None, None, None, None, False)
        assert projection._rank_block(calls, "group", 2, 0, problem, segs, None, None, None, None, False) is first
        made[0].closed = True
        again = projection._rank_block(calls, "group", 2, 0, problem, segs, None, None, None, None, False)
        assert again is not first and not again.transport.closed and made[1:] == ["plan", again.transport, "plan"]


def test_emulated_block_checks_and_prepares_once_per_signature(monkeypatch):
    """ulysses_qkv_attention_emulated (P = 2, fake CUDA tensors): the P ranks' calls are checked and
    prepared (transport, plans, routed projections) once per signature; every call then launches
    each rank's projection with its own x and pair, one barrier, each rank's attention, one barrier,
    and each rank's delivery. Other rows per rank are a new signature; a bad rotary of a known one
    is still refused by name."""
    seen, made, checked = [], [], []
    emulated = functools.partial(block.ulysses_qkv_attention_emulated, impl="fused")  # the prepared path, not auto
    monkeypatch.setattr(engine_problem, "_resolved", {})
    monkeypatch.setattr(K, "qkv_a2a_launcher", _bind_recorder(
        lambda x, proj, windows, row0, *, rope_cs, config, one_launch: seen.append((x, row0, rope_cs))))
    monkeypatch.setattr(forward, "emulated_transport", lambda P, device: made.append(_FakeTransport()) or made[-1])
    monkeypatch.setattr(forward, "window_plan", lambda t, lay, B, D, dtype: made.append("plan") or
                        _FakePlan(t, lay, B, D, dtype, "cpu"))  # (windows the recorder never reads)
    inner = block._check_rank_call
    monkeypatch.setattr(block, "_check_rank_call", lambda *a, **k: checked.append(a[-2]) or inner(*a, **k))
    with FakeTensorMode():
        P, S, D, C = 2, 32, 64, 64
        proj = _fake_proj(P, 4, 4, D, C)

        def call_args(rows=S):
            xs = [torch.empty(1, rows, C, dtype=torch.bfloat16, device="cuda") for _ in range(P)]
            return xs, [torch.empty(rows, D, device="cuda") for _ in range(P)]  # fp32 tables (a pair's
            # conversion is a stack, which fake CUDA tensors of a CPU build of torch cannot run)

        for _ in range(3):
            xs, rots = call_args()
            seen.clear()
            assert emulated(xs, proj, rotary=rots) == [("out", 0, S), ("out", 1, S)]
            assert [s[0] for s in seen] == xs  # rank 0's projection, then rank 1's, each with its own x
            assert [s[2] for s in seen] == rots
        transport = made[0]
        assert [m if m == "plan" else type(m).__name__ for m in made] == ["_FakeTransport", "plan", "plan"]
        assert checked == ["xs[0]", "xs[1]"] and transport.barriers == 6
        with pytest.raises(ValueError, match=r"rotary: expected a contiguous float32 \[32, 64\] table"):
            xs, rots = call_args()
            strided = torch.empty_strided((S, D), (1, S), device="cuda")  # a known signature, not contiguous
            emulated(xs, proj, rotary=[rots[0], strided])
        xs, rots = call_args(S - 8)  # other rows: checked and prepared again
        assert emulated(xs, proj, rotary=rots) == [("out", 0, S - 8), ("out", 1, S - 8)]
        assert checked == ["xs[0]", "xs[1]"] * 2 and len(made) == 6

        sliced = []  # joint rows: each rank's own slice of the joint weights, sliced once per rank
        monkeypatch.setattr(type(proj), "rank_slice", lambda w, r: sliced.append((w, r)) or w)
        J = 5
        for _ in range(2):
            xs, rots = call_args()
            joint, jrot = torch.empty(1, J, C, dtype=torch.bfloat16, device="cuda"), torch.empty(J, D, device="cuda")
            seen.clear()
            outs = emulated(xs, proj, rotary=rots, joint=joint, joint_rotary=jrot)
            assert outs == ([("out", 0, S), ("out", 1, S)], [("joint out", 0), ("joint out", 1)])
            assert [(s[0] is joint, s[2] is jrot) for s in seen] == [(False, False), (True, True)] * 2
        assert sliced == [(proj, 0), (proj, 1)] and checked == ["xs[0]", "xs[1]"] * 3


def test_rope_source_takes_cuda_without_an_index():
    """A rotary on cuda:0 named by the device "cuda" (as a test or a user writes it) is on that device
    (the GPU run of 2026-12-05 refused it: "expected ... on cuda, got ... on cuda:0"); another device
    type is still refused, naming the argument."""
    rows, D = 4, 8
    with FakeTensorMode():
        cos, sin = torch.empty(rows, D, device="cuda:0"), torch.empty(rows, D, device="cuda:0")
        table = torch.empty(rows, D, device="cuda:0")  # (no indexing of fake CUDA tensors: torch's CPU build)
    for src in ((cos, sin), table):
        got = projection._rope_source(src, rows, D, "cuda", "rotary")
        assert got is src if isinstance(src, torch.Tensor) else (got[0] is cos and got[1] is sin)
    with pytest.raises(ValueError, match="rotary: expected a contiguous float32 .* on cpu"):
        projection._rope_source((cos, sin), rows, D, "cpu", "rotary")
