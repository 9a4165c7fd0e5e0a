"""fa_a2a.op / fa_a2a.attention on CPU: validation, padding, dispatch, torch.compile, gloo ranks.

What runs on CPU: the "nccl" impl (permute + all_to_all_single over gloo, fp32 local attention)
and the "reference" impl, on real ranks (one spawn of 4 processes; P = 2 and 4 are subgroups)
and on one rank. Attention is checked against the fp64 oracle on the unsplit sequence (error
<= 2x the fp32 oracle's + 1e-6); "nccl" and "reference" run the same local attention on the
same head-layout data, so they must agree bit for bit (the moved data is exact). Padding rows of
the shards hold large random values, so an unmasked padded key shows; padding rows of the
outputs must be zero.
"""

import pytest
import torch
import torch.distributed as dist

from fa_a2a.attention import UlyssesAttention
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated
from ulysses.layout import UlyssesLayout, split_seq
from ulysses.reference import full_attention

from tests.helpers import Case, check_attention, make_inputs, oracles, pair
from tests.multiproc import run_on_gloo_groups

# uneven S, head padding, GQA replicated (H_kv < P) and split, joint tokens, causal, a rank
# holding padding only.
CASES = [
    Case(1, 2, 7, 3, 1, 16, 0, True),
    Case(1, 1, 9, 4, 2, 8, 3, False),
    Case(2, 2, 9, 5, 5, 16, 0, False),
    Case(2, 1, 12, 6, 3, 8, 4, False),
    Case(2, 2, 11, 4, 1, 8, 0, True),
    Case(4, 2, 10, 8, 2, 16, 3, False),
    Case(4, 1, 9, 12, 6, 8, 0, True),
    Case(4, 2, 13, 7, 7, 8, 2, False),
    Case(4, 1, 5, 6, 6, 8, 0, False),
]


def check_rank(case, rank, res, full, joint):
    """res: this rank's (out, joint_out or None) vs the oracle; padding rows zero."""
    (ref, jref), (base, jbase) = oracles(full, joint, case.causal)
    out, jout = res
    L = UlyssesLayout(case.S, case.H, case.H_kv, case.P)
    n, first = L.valid_rows(rank), rank * L.seq_loc
    assert out.shape == (case.B, L.seq_loc, case.H, case.D)
    if n:
        check_attention(out[:, :n], ref[:, first:first + n], base[:, first:first + n], 1e-6, (case, rank))
    assert (out[:, n:] == 0).all(), "padding rows of the output must be zero"
    if joint is not None:
        check_attention(jout, jref, jbase, 1e-6, (case, rank, "joint"))


# ---- one process (P = 1) -------------------------------------------------------------------------
def _bad_calls():
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    j = (torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16))
    return [
        (dict(q=q, k=k, v=k, impl="flash"), "impl"),
        (dict(q=q[0], k=k, v=k), "q:"),
        (dict(q=q, k="k", v=k), "k:"),
        (dict(q=q, k=k.double(), v=k), "k: expected q.s dtype"),
        (dict(q=q, k=torch.randn(1, 7, 2, 16), v=torch.randn(1, 7, 2, 16)), "k:"),
        (dict(q=q, k=k, v=torch.randn(1, 8, 1, 16)), "v:"),
        (dict(q=q, k=torch.randn(1, 8, 3, 16), v=torch.randn(1, 8, 3, 16)), "k:"),
        (dict(q=q, k=k, v=k, joint=j[:2]), "joint"),
        (dict(q=q, k=k, v=k, joint=(j[0], j[1], torch.randn(1, 3, 4, 16))), "joint[2]"),
        (dict(q=q, k=k, v=k, joint=j, causal=True), "joint"),
        (dict(q=q, k=k, v=k, softmax_scale=-1.0), "softmax_scale"),
        (dict(q=q, k=k, v=k, causal=1), "causal"),
        (dict(q=q, k=k, v=k, seq_len=9), "seq_len"),
        (dict(q=q, k=k, v=k, impl="fused"), "CUDA"),
        (dict(q=q, k=k, v=k, impl="serial"), "CUDA"),
        (dict(q=q, k=k, v=k, group=object()), "group"),
        (dict(q=q, k=k[:, :, :0], v=k[:, :, :0]), "k:"),  # no KV heads
        (dict(q=q[..., :0], k=k[..., :0], v=k[..., :0]), "q:"),  # head dim 0
        (dict(q=q.int(), k=k.int(), v=k.int()), "q: expected float16, bfloat16, float32 or float64"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_calls())
def test_bad_input_names_the_argument(kwargs, match):
    kwargs.setdefault("impl", "reference")
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        ulysses_attention(q, k, v, **kwargs)


def test_bad_module_and_emulated_arguments():
    with pytest.raises(ValueError, match="impl"):
        UlyssesAttention(impl="flash")
    with pytest.raises(ValueError, match="layout"):
        UlyssesAttention(layout="sbhd")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="qs"):
        ulysses_attention_emulated(q, [q], [q])
    with pytest.raises(ValueError, match="ks, vs"):
        ulysses_attention_emulated([q, q], [q], [q, q])
    with pytest.raises(ValueError, match="impl"):
        ulysses_attention_emulated([q, q], [q, q], [q, q], impl="nccl")
    with pytest.raises(ValueError, match=r"qs\[1\]"):
        ulysses_attention_emulated([q, q[:, :3]], [q, q[:, :3]], [q, q[:, :3]], impl="reference")
    q2 = torch.randn(2, 4, 2, 8)  # rank 1 with another batch size
    with pytest.raises(ValueError, match=r"qs\[1\]"):
        ulysses_attention_emulated([q, q2], [q, q2], [q, q2], impl="reference")


@pytest.mark.parametrize("case", [c for c in CASES if c.P == 1])
@pytest.mark.parametrize("impl", ["nccl", "reference"])
def test_single_rank_matches_oracle(case, impl):
    full, joint, (qs, ks, vs) = make_inputs(case, seed=7)
    res = pair(ulysses_attention(qs[0], ks[0], vs[0], impl=impl, joint=joint, causal=case.causal), joint)
    check_rank(case, 0, res, full, joint)


def test_module_bhsd_layout_and_scale():
    case = Case(1, 2, 9, 4, 2, 8, 3, False)
    full, joint, (qs, ks, vs) = make_inputs(case, seed=8)
    scale = 0.3
    mod = UlyssesAttention(impl="reference", softmax_scale=scale, layout="bhsd")
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    out, jout = mod(t(qs[0]), t(ks[0]), t(vs[0]), joint=tuple(t(x) for x in joint))
    ref, jref = full_attention(*full, joint=joint, softmax_scale=scale)
    base, jbase = full_attention(*full, joint=joint, softmax_scale=scale, dtype=torch.float32)
    check_attention(out.transpose(1, 2), ref, base, 1e-6)
    check_attention(jout.transpose(1, 2), jref, jbase, 1e-6)


def test_torch_compile_fullgraph_matches_eager():
    case = Case(1, 1, 9, 4, 2, 8, 3, False)
    _, joint, (qs, ks, vs) = make_inputs(case, seed=9)

    def f(q, k, v, jq, jk, jv):
        out, jout = ulysses_attention(q, k, v, impl="reference", joint=(jq, jk, jv))
        return out * 2, jout + 1

    eager = f(qs[0], ks[0], vs[0], *joint)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(qs[0], ks[0], vs[0], *joint)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_refusals_read_as_the_value_error():
    """Under torch.compile(fullgraph=True) a bad argument raises the op's own ValueError (not
    dynamo's "Observed exception"), with inputs that require grad too."""
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    bad_scale = torch.compile(lambda q, k, v: ulysses_attention(q, k, v, impl="reference", softmax_scale=-1.0),
                              backend="aot_eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(ValueError, match="^softmax_scale: expected a positive float up to"):
        bad_scale(q, k, v)
    plain = torch.compile(lambda q, k, v: ulysses_attention(q, k, v, impl="reference"), backend="aot_eager",
                          fullgraph=True)
    with pytest.raises(ValueError, match="^softmax_scale: expected a positive float up to"):
        bad_scale(q.clone().requires_grad_(), k, v)
    with torch.no_grad():
        assert torch.equal(plain(q, k, v), ulysses_attention(q, k, v, impl="reference"))


def test_emulated_reference_matches_oracle():
    case = Case(4, 2, 10, 8, 2, 16, 3, False)
    full, joint, (qs, ks, vs) = make_inputs(case, seed=10)
    outs, jouts = ulysses_attention_emulated(qs, ks, vs, impl="reference", joint=joint, seq_len=case.S)
    for r in range(4):
        check_rank(case, r, (outs[r], jouts[r]), full, joint)


# ---- real ranks over gloo ------------------------------------------------------------------------
def _check_group(P, group, rank):
    for i, case in enumerate(c for c in CASES if c.P == P):
        causal, S = case.causal, case.S
        for dtype in (torch.float32, torch.bfloat16):
            full, joint, (qs, ks, vs) = make_inputs(case, seed=100 + i, dtype=dtype)
            results = {}
            for impl in ("nccl", "reference"):
                res = ulysses_attention(qs[rank], ks[rank], vs[rank], group=group, impl=impl, joint=joint,
                                        causal=causal, seq_len=S)
                results[impl] = pair(res, joint)
            for a, b in zip(results["nccl"], results["reference"]):
                assert (a is None and b is None) or torch.equal(a, b), (P, rank, case, dtype)
            if dtype == torch.float32:
                check_rank(case, rank, results["nccl"], full, joint)
            else:  # bf16 output: within one bf16 rounding of the fp32 path
                f32 = make_inputs(case, seed=100 + i)
                ref = ulysses_attention(f32[2][0][rank].to(dtype).float(), f32[2][1][rank].to(dtype).float(),
                                        f32[2][2][rank].to(dtype).float(), group=group, impl="nccl",
                                        joint=None if joint is None else tuple(x.float() for x in joint),
                                        causal=causal, seq_len=S)
                ref = pair(ref, joint)[0]
                assert torch.allclose(results["nccl"][0].float(), ref, rtol=1e-2, atol=1e-2)
    # the module, SDPA layout, on this group
    case = next(c for c in CASES if c.P == P)
    full, joint, (qs, ks, vs) = make_inputs(case, seed=5)
    mod = UlyssesAttention(group, impl="nccl", causal=case.causal, layout="bhsd")
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out = mod(t(qs[rank]), t(ks[rank]), t(vs[rank]), joint=None if joint is None else tuple(map(t, joint)),
              seq_len=case.S)
    res = (t(out[0]), t(out[1])) if joint is not None else (t(out), None)
    check_rank(case, rank, res, full, joint)


# Uneven shards (diffusers' ulysses_anything): rank r holds the next shard_rows[r] rows.
UNEVEN = {2: [((5, 3), 4, 2, 0), ((6, 6), 4, 4, 3)], 4: [((2, 5, 0, 4), 8, 2, 2)]}


def _check_uneven(P, group, rank):
    for rows, H, Hkv, J in UNEVEN.get(P, []):
        g = torch.Generator().manual_seed(sum(rows))
        full = [torch.randn(1, sum(rows), h, 8, generator=g) for h in (H, Hkv, Hkv)]
        joint = tuple(torch.randn(1, J, h, 8, generator=g) for h in (H, Hkv, Hkv)) if J else None
        mine = [x.split(rows, dim=1)[rank] for x in full]
        results = [pair(ulysses_attention(*mine, group=group, impl=impl, joint=joint, shard_rows=list(rows)), joint)
                   for impl in ("nccl", "reference")]
        assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(*results))
        (ref, jref), (base, jbase) = oracles(full, joint, False)
        out, jout = results[0]
        first, n = sum(rows[:rank]), rows[rank]
        assert out.shape == (1, n, H, 8)
        if n:
            check_attention(out, ref[:, first:first + n], base[:, first:first + n], 1e-6, (rows, rank))
        if joint is not None:
            check_attention(jout, jref, jbase, 1e-6, (rows, rank))
    if P == 2:  # the ranks must agree on shard_rows, and each rank's q must have its count
        x = torch.randn(1, 4, 2, 8)
        with pytest.raises(ValueError, match="^shard_rows: expected the same value on every rank"):
            ulysses_attention(x, x, x, group=group, impl="reference", shard_rows=[4, 3 + rank])
        with pytest.raises(ValueError, match="q: expected shard_rows"):
            ulysses_attention(x, x, x, group=group, impl="reference", shard_rows=[4, 5])


def test_gloo_ranks_uneven_shards():
    run_on_gloo_groups(_check_uneven, (2, 4))


def test_uneven_shards_emulated_and_bad_rows():
    rows = (3, 5, 1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 9, 6, 16, generator=g) for _ in range(3)]
    shards = [list(x.split(rows, dim=1)) for x in full]
    outs = ulysses_attention_emulated(*shards, impl="reference", shard_rows=rows)
    ref, base = full_attention(*full), full_attention(*full, dtype=torch.float32)
    check_attention(torch.cat(outs, dim=1), ref, base, 1e-6)
    q = shards[0][0]
    for bad, match in (([3, 5], "shard_rows"), ([3, -1, 1], "shard_rows"), ("35", "shard_rows"),
                       ([4, 5, 1], "q: expected shard_rows"), ([3, 5, True], "shard_rows")):
        with pytest.raises(ValueError, match=match):
            ulysses_attention_emulated(*shards, impl="reference", shard_rows=bad)
    with pytest.raises(ValueError, match="seq_len"):
        ulysses_attention_emulated(*shards, impl="reference", shard_rows=rows, seq_len=8)
    with pytest.raises(ValueError, match="causal"):
        ulysses_attention_emulated(*shards, impl="reference", shard_rows=rows, causal=True)
    with pytest.raises(ValueError, match="shard_rows"):
        ulysses_attention(q, q, q, impl="reference", shard_rows=[2])


def test_gloo_ranks_nccl_and_reference_impls():
    run_on_gloo_groups(_check_group, (2, 4))


# ---- transport: window views (emulated, CPU memory) ------------------------------------------------
def test_emulated_windows_layout_and_cache():
    from ulysses.transport import EmulatedTransport

    t = EmulatedTransport(4, device="cpu")
    w = t.windows("x", (2, 3, 5, 8), torch.bfloat16)
    assert w.shape == (4, 2, 3, 5, 8) and w.stride()[1:] == (120, 40, 8, 1)
    assert (w.stride(0) * 2) % 16 == 0 and w.stride(0) >= 240
    assert (w == 0).all()
    assert t.windows("x", (2, 3, 5, 8), torch.bfloat16) is w
    other = t.windows("y", (2, 3, 5, 8), torch.bfloat16)
    other.fill_(1)
    assert (w == 0).all(), "distinct names must not share memory"
    for d in range(4):  # windows do not overlap
        w[d].fill_(d + 1)
    assert [int(w[d].float().mean()) for d in range(4)] == [1, 2, 3, 4]
    ptrs = t.pointer_table(w)
    assert ptrs.dtype == torch.int64 and ptrs.tolist() == [w[d].data_ptr() for d in range(4)]
    assert t.signal.shape == (4, 4) and t.signal.dtype == torch.int32
    assert t.epoch.tolist() == [0] * 4 and t.error.shape == (4, 4)
    t.check()  # no error recorded
    with pytest.raises(ValueError, match="name"):
        t.windows("", (1,), torch.float32)
    with pytest.raises(ValueError, match="shape"):
        t.windows("z", (-1,), torch.float32)
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.windows("x", (2, 3, 5, 8), torch.bfloat16)


def test_transport_bad_arguments():
    from ulysses.transport import EmulatedTransport, VmmTransport, get_transport

    with pytest.raises(ValueError, match="world_size"):
        EmulatedTransport(33, device="cpu")
    with pytest.raises(ValueError, match="timeout_s"):
        EmulatedTransport(2, device="cpu", timeout_s=0)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="group"):
            VmmTransport()
    with pytest.raises(ValueError, match="backend"):
        get_transport(backend="nvshmem")


def test_uniform_window_stride():
    from ulysses.transport import uniform_window_stride

    assert uniform_window_stride([4096], 1000) == 1024
    assert uniform_window_stride([1 << 20, 3 << 20, 5 << 20], 1 << 20) == 2 << 20
    with pytest.raises(ValueError, match="buffer_ptrs"):
        uniform_window_stride([0, 4096, 9000], 1024)  # not one stride
    with pytest.raises(ValueError, match="buffer_ptrs"):
        uniform_window_stride([8192, 0], 1024)  # negative stride
    with pytest.raises(ValueError, match="buffer_ptrs"):
        uniform_window_stride([0, 512], 1024)  # windows would overlap


def test_nan_in_padding_rows_does_not_leak():
    # S = 7 over P = 2: rank 1's shard has one padding row; the caller may leave NaN there
    torch.manual_seed(5)
    full = [torch.randn(1, 7, 2, 8) for _ in range(3)]
    shards = [split_seq(x, 2) for x in full]
    poisoned = [[t.clone() for t in s] for s in shards]
    for s in poisoned:
        s[1][:, 3:] = float("nan")
    clean = ulysses_attention_emulated(*shards, impl="reference", seq_len=7)
    dirty = ulysses_attention_emulated(*poisoned, impl="reference", seq_len=7)
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_window_plan_compiles_its_kernels_before_the_first_barrier():
    """A plan compiles (sm_90a, fake tensors) every A2A kernel and the barrier it will launch when
    it is built, so ranks do not meet their first in-stream barrier seconds apart."""
    from cute_kernels.a2a import compile_post_a2a, compile_pre_a2a
    from cute_kernels.signal import compile_barrier
    from fa_a2a.engine.forward import WindowPlan
    from ulysses.transport import EmulatedTransport

    transport = EmulatedTransport(2, device="cpu")
    layout = UlyssesLayout(10, 4, 2, 2, joint_len=3)
    plan = WindowPlan(transport, layout, 1, 64, torch.bfloat16)
    assert plan.key_rows == [(5, 0, 13), (5, 5, 13)]
    for compile_fn, args in ((compile_pre_a2a, (torch.bfloat16, 64, 2, True)),
                             (compile_post_a2a, (torch.bfloat16, 64, 2, False)),
                             (compile_post_a2a, (torch.bfloat16, 64, 2, True)), (compile_barrier, (2, 2))):
        misses = compile_fn.cache_info().misses
        compile_fn(*args)
        assert compile_fn.cache_info().misses == misses, f"{compile_fn.__name__}{args} was not compiled by the plan"
    transport.close()


def test_attention_launches_compile_before_the_first_barrier_and_line_ranks_up(monkeypatch):
    """A rank's attention step is checked and compiled when first asked for (forward asks before its
    first barrier), then the ranks meet on the host once; later calls reuse the bound launches."""
    import cute_kernels.a2a as a2a
    import cute_kernels.fa4 as fused
    from fa_a2a.engine.forward import WindowPlan
    from ulysses.transport import EmulatedTransport

    events = []

    def recorder(name):
        return lambda *a, **kw: events.append(f"prepare {name}") or (lambda: events.append(f"launch {name}"))

    monkeypatch.setattr(fused, "fa4_a2a_launcher", recorder("fused"))
    monkeypatch.setattr(fused, "fa4_launcher", recorder("fa4"))
    monkeypatch.setattr(a2a, "post_a2a_launcher", recorder("post"))
    transport = EmulatedTransport(2, device="cpu")
    plan = WindowPlan(transport, UlyssesLayout(10, 4, 2, 2, joint_len=3), 1, 64, torch.bfloat16)
    monkeypatch.setattr(transport, "host_barrier", lambda *a, **kw: events.append("host barrier"))
    attend = plan.attend_launch(1, "fused", False, 0.125)
    assert events == ["prepare fused", "prepare fa4", "prepare post", "host barrier"]
    assert plan.attend_launch(1, "fused", False, 0.125) is attend and len(events) == 4
    attend()
    assert events[4:] == ["launch fused", "launch fa4", "launch post"]
    plan.attend_launch(1, "serial", False, 0.125)
    assert events[7:] == ["prepare fa4", "prepare post", "prepare post", "host barrier"]
    transport.close()


def _check_subgroup_rank(P, group, rank):
    """The op's group resolution reads size and rank off the ProcessGroup: for ranks 1 and 2 of three
    they are the group's (2; 0 and 1), as dist.get_world_size / get_rank(group) say."""
    from fa_a2a.engine.problem import group_facts as _group

    sub = dist.new_group([1, 2])  # every rank takes part in creating it
    if rank in (1, 2):
        got = _group(sub)
        assert got[1:] == (sub.group_name, 2, rank - 1) == (sub.group_name, dist.get_world_size(sub),
                                                             dist.get_rank(sub))
    assert _group(None)[2:] == (3, rank)  # the default group


def test_group_size_and_rank_of_a_subgroup():
    run_on_gloo_groups(_check_subgroup_rank, (3,))


def test_contiguous16_keeps_what_the_kernels_can_read():
    from fa_a2a.engine.forward import contiguous16

    x = torch.randn(2, 8, 4, 16)
    assert contiguous16(x) is x  # contiguous, 16-byte base and rows
    v = x.transpose(1, 2)  # strided, every stride a multiple of 16 bytes
    assert contiguous16(v) is v
    for copied in (x[..., 1:9],  # base 4 bytes past an aligned one
                   x[..., ::2],  # last dim not unit-stride
                   torch.randn(2, 8, 4, 3)):  # 12-byte rows
        c = contiguous16(copied)
        assert c is not copied and torch.equal(c, copied) and c.is_contiguous() and c.data_ptr() % 16 == 0
