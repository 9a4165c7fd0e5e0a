"""CPU tier of the QKV projection with the pre-A2A in its epilogue (cute_kernels/qkv_a2a_sm90.py):
sm_90a compiles against fake tensors, the quack internals it relies on, the host-side window view,
the weight gathering for head padding and GQA, and input checks."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import qkv_a2a_sm90 as K
from cute_kernels import qkv_a2a_sm90_device as Dv


def _fake_problem(dtype, D, P=4, H_loc=None, H_kv_loc=None, bias=True, norm=True, B=1, S_loc=200, C=256,
                  bias_dtype=None):
    """Fake CUDA tensors (call inside FakeTensorMode): QKVWeights, x, windows (one allocation each).
    Views of fake CUDA tensors are taken with narrow / as_strided, not Python indexing (t[a:b]): on
    torch's CPU build indexing asks for a CUDA device guard ("PyTorch is not linked with support for
    cuda devices"); narrow gives the same view on both builds."""
    H_loc = H_loc or 256 // D
    H_kv_loc = H_kv_loc or H_loc
    n = P * (H_loc + 2 * H_kv_loc) * D
    dev = "cuda"
    proj = K.QKVWeights(
        torch.empty(n, C, dtype=dtype, device=dev),
        torch.empty(n, dtype=bias_dtype or dtype, device=dev) if bias else None,
        torch.empty(P * (H_loc + H_kv_loc) * D, dtype=torch.float32, device=dev) if norm else None,
        P, H_loc, H_kv_loc, D,
    )
    x = torch.empty(B, S_loc, C, dtype=dtype, device=dev)
    N = P * S_loc
    windows = [torch.empty(P, B, N, h, D, dtype=dtype, device=dev) for h in (H_loc, H_kv_loc, H_kv_loc)]
    cs = torch.empty(S_loc, D, dtype=torch.float32, device=dev)
    return proj, x, windows, cs


def _key(dtype, width, D, bias_dtype, norm, rope, one_launch=False, paced=False, weight_major="k"):
    return (dtype, width, D, bias_dtype, norm, rope, K.GemmConfig(tile_n=128), one_launch, paced, weight_major)


@pytest.fixture
def record_compiles(monkeypatch):
    seen = []
    inner = K.compile_projection

    def recording(*args):
        seen.append(args)
        return inner(*args)

    monkeypatch.setattr(K, "compile_projection", recording)
    return seen


# (dtype, D, bias, norm, rope): every q|k epilogue, both head dims and dtypes, plain bias-only
VARIANTS = [
    (torch.bfloat16, 128, True, True, "table"),  # composition: bias + norm + rope
    (torch.float16, 64, False, True, "table"),  # quack's qk_rope_epi
    (torch.bfloat16, 128, True, True, None),  # composition: bias + norm
    (torch.bfloat16, 64, False, True, None),  # quack's qknorm_epi
    (torch.float16, 128, True, False, "table"),  # quack's rope_table_epi
    (torch.bfloat16, 128, False, False, "table"),  # composition: rope only
    (torch.float16, 64, True, False, None),  # default class, bias: one launch for q|k|v
    (torch.bfloat16, 128, False, False, None),  # default class, no bias
    (torch.bfloat16, 128, True, True, "pair"),  # the (cos, sin) pair: bias + norm + rope
    (torch.float16, 64, False, True, "pair"),  # norm + rope
    (torch.bfloat16, 128, True, False, "pair"),  # bias + rope
    (torch.float16, 128, False, False, "pair"),  # rope only
]


@pytest.mark.parametrize("dtype,D,bias,norm,rope", VARIANTS)
def test_variants_compile_for_sm90(dtype, D, bias, norm, rope, record_compiles):
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(dtype, D, bias=bias, norm=norm)
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs={"table": cs, "pair": (cs, cs), None: None}[rope])
    epi = norm or rope
    bdt = dtype if bias else None
    qk = _key(dtype, 256, D, bdt, norm, rope)
    v = _key(dtype, 256, D, bdt, False, None)
    assert record_compiles[0] == qk
    assert record_compiles[-1] == v
    # separate allocations per tensor: q, k launch apart (no common window stride); one kernel
    assert len(set(record_compiles)) == (2 if epi else 1)


PACED = [(True, True, "table", False), (True, False, None, False), (False, False, None, False),
         (True, True, "pair", True), (False, True, None, False)]


@pytest.mark.parametrize("bias,norm,rope,one", PACED)
def test_paced_variants_compile_with_the_pacer_in_their_ptx(bias, norm, rope, one, record_compiles, tmp_path,
                                                            monkeypatch):
    """pacer=: the same launch groups, each compiled paced (the default class and quack's composed
    epilogues alike); the PTX holds the pacer's slot claim (atomic max and add, %globaltimer) and
    the unpaced build does not."""
    from cute_kernels.pacer import UNIT_BYTES, make_pacer

    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128, bias=bias, norm=norm)
        pacer = make_pacer("cuda", 44.0, UNIT_BYTES, 4)
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs={"table": cs, "pair": (cs, cs), None: None}[rope],
                             one_launch=one, pacer=pacer)
    assert record_compiles and all(args[8] is True for args in record_compiles)
    import cutlass.cute as cute

    from cute_kernels.qkv_a2a_sm90_device import compile_kernel

    compile = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *a, options="", **kw: compile(
        *a, options=f"{options} --keep-ptx --dump-dir={tmp_path}", **kw))
    ptx = {paced: compile_kernel(*record_compiles[0][:8], paced=paced).__ptx__ for paced in (True, False)}
    assert "red.relaxed.gpu.global.max.s64" in ptx[True] and "atom.relaxed.gpu.global.add.u64" in ptx[True]
    assert "%globaltimer" in ptx[True] and "%globaltimer" not in ptx[False]
    assert "cp.async.bulk.tensor" in ptx[True]  # the TMA stores it paces


def test_paced_launcher_refuses_a_bad_pacer():
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128)
        for bad in (torch.zeros(3, dtype=torch.int64, device="cuda"), torch.empty(3, dtype=torch.int32, device="cuda"),
                    "fast"):
            with pytest.raises(ValueError, match="pacer: expected"):
                K.qkv_a2a_launcher(x, proj, windows, 200, rope_cs=cs, pacer=bad)


def test_gqa_and_fp32_bias_compile(record_compiles):
    """GQA: q (2 heads a rank) and k|v (1 head a rank) have different widths: separate kernels."""
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128, H_loc=2, H_kv_loc=1,
                                             bias_dtype=torch.float32)
        K.qkv_a2a_projection(x, proj, windows, 600, rope_cs=cs)
    widths = [args[1] for args in record_compiles]
    assert widths == [256, 128, 128]
    assert [args[4] for args in record_compiles] == [True, True, False]
    assert all(args[3] == torch.float32 for args in record_compiles)


def test_a_weight_read_in_place_compiles_its_gemm_n_major(record_compiles):
    """The fused backward's dO GEMM (dO = dY @ W_o, fa_a2a.engine.backward._FusedRank.project_dout) reads
    nn.Linear's weight W_o [C_out, H * D] in place: QKVWeights' weight is W_o.t(), contiguous columns, so
    the GEMM compiles with an N-major B; its launch operand is a view of W_o (no copy)."""
    P, H_loc, D, C = 2, 2, 128, 384
    with FakeTensorMode():
        w_o = torch.empty(C, P * H_loc * D, dtype=torch.bfloat16, device="cuda")
        proj = K.QKVWeights(w_o.t(), None, None, P, H_loc, 0, D)
        assert K.weight_major(proj.weight) == "n" and K.weight_major(w_o) == "k"
        x = torch.empty(1, 200, C, dtype=torch.bfloat16, device="cuda")
        dq = torch.empty(P, 1, 400, H_loc, D, dtype=torch.bfloat16, device="cuda")
        K.qkv_a2a_projection(x, proj, (dq, None, None), 200)
        [key] = record_compiles
        assert key == _key(torch.bfloat16, H_loc * D, D, None, False, None, weight_major="n")
        weight, _, _ = K._launch_args(proj, K._groups(proj, [True, False, False], False, False)[0],
                                      K.compile_projection(*key))
        assert weight.shape == (1, P * H_loc * D, C) and weight.stride()[1:] == (1, P * H_loc * D)


def test_a_weight_with_neither_rows_nor_columns_contiguous_is_refused():
    with FakeTensorMode():
        proj, x, windows, _ = _fake_problem(torch.bfloat16, 128, bias=False, norm=False)
        n, C = proj.weight.shape
        wide = torch.empty(n, 2 * C, dtype=torch.bfloat16, device="cuda")
        for bad in (wide.as_strided((n, C), (2 * C, 2)),  # strided rows (as_strided: torch's CPU build too)
                    torch.empty(n + 1, C, dtype=torch.bfloat16, device="cuda").as_strided((n, C), (C, 1), 1)):
            with pytest.raises(ValueError, match=r"proj: a weight \[n, C\] with contiguous rows or columns"):
                K.qkv_a2a_launcher(x, K.QKVWeights(bad, None, None, proj.world_size, proj.heads_loc,
                                                   proj.kv_heads_loc, proj.head_dim), windows, 200)


def test_compile_is_cached():
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128)
        K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=cs)
        before = K.compile_projection.cache_info()
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=cs)
        after = K.compile_projection.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def test_one_launch_compiles(record_compiles):
    """q|k|v in one launch of qkv_bias_norm_rope_epi (separate allocations: three launches of
    one kernel); GQA widths split the launch but keep the epilogue."""
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128)
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=cs, one_launch=True)
        assert set(record_compiles) == {_key(torch.bfloat16, 256, 128, torch.bfloat16, True, "table", True)}
        record_compiles.clear()
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=(cs, cs), one_launch=True)
        assert set(record_compiles) == {_key(torch.bfloat16, 256, 128, torch.bfloat16, True, "pair", True)}
        record_compiles.clear()
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128, H_loc=2, H_kv_loc=1)
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=cs, one_launch=True)
        assert [(a[1], a[7]) for a in record_compiles] == [(256, True), (128, True), (128, True)]
        with pytest.raises(ValueError, match="one_launch: bias, norm weights and rope_cs"):
            K.qkv_a2a_projection(x, proj, windows, 200, one_launch=True)


@pytest.mark.parametrize("bias,norm,rope_on,one", [(True, True, "table", False), (True, False, None, False),
                                                    (True, True, "table", True), (False, True, None, False),
                                                    (True, True, "pair", False), (True, True, "pair", True),
                                                    (True, False, "table", False), (False, False, None, False)])
def test_launch_args_are_quacks_arguments_as_tuples_of_views_kept_per_weights(bias, norm, rope_on, one):
    """qkv_a2a_launcher's per-launch arguments of a weights object (_launch_args, from launch_form):
    with this call's RoPE tables put in, the epilogue tuple is field for field what quack's own
    EpilogueArguments holds for these values (TVM-FFI takes a NamedTuple as the tuple of its
    fields), the scheduler tuple is quack's TileSchedulerOptions; the weight rows and epilogue
    vectors are views of the weights (no copy), built once per weights object and kept on it;
    another layer's weights get their own."""
    from quack.epilogue.ops import EpiOp
    from quack.gemm_default_epi import GemmDefaultEpiMixin
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    P, H_loc, D, C, M = 2, 2, 64, 32, 8
    n = P * 3 * H_loc * D
    g = torch.Generator().manual_seed(0)

    def weights():
        return K.QKVWeights(torch.randn(n, C, generator=g).bfloat16(),
                            torch.randn(n, generator=g).bfloat16() if bias else None,
                            torch.randn(P * 2 * H_loc * D, generator=g) if norm else None, P, H_loc, H_loc, D)

    proj, other = weights(), weights()
    table = torch.randn(M, D, generator=g)
    rope_cs = {"table": table, "pair": (table, table.clone()), None: None}[rope_on]
    epilogue = norm or rope_on is not None
    for group in K._groups(proj, [True, True, True], epilogue, one):
        rope = rope_on if group["epi"] is not None else None
        key = (torch.bfloat16, group["width"], D, torch.bfloat16 if bias else None,
               group["epi"] is not None and norm, rope, K._group_config(None, group, proj), group["epi"] == "qkv")
        kern = K.compile_projection(*key)
        weight, epi, tables = K._launch_args(proj, group, kern)
        lo, hi = proj.column_range(group["ts"][0])[0], proj.column_range(group["ts"][-1])[1]
        assert weight.shape == (1, hi - lo, C) and weight.data_ptr() == proj.weight[lo].data_ptr()
        assert len(tables) == {"table": 1, "pair": 2, None: 0}[rope]
        epi = list(epi)
        for at, which in tables:
            epi[at] = (rope_cs if rope == "pair" else (rope_cs,))[which]
        # quack's own arguments for the same values
        _, _, gv = K._group_values(proj, group, rope_cs)
        if group["epi"] is None:
            theirs = GemmDefaultEpiMixin.EpilogueArguments(
                alpha=None, beta=None, mRowVecBroadcast=gv["bias"].unsqueeze(0) if bias else None,
                mColVecBroadcast=None, add_to_output=None, rounding_mode=None, sr_seed=None)
        else:
            mod = Dv._epilogue_mod(bias, gv["norm_weight"] is not None, rope, group["epi"] == "qkv")
            values = Dv._epilogue_values(mod, head_dim=D, **gv)
            cls = Dv._mint(mod, values)
            fields = dict.fromkeys(cls.EpilogueArguments._fields)
            for op in cls._epi_ops:
                op_key = op.host_arg_key(values.get(op.name))
                if op_key is not None:
                    v = values[op.name]
                    fields[op.name] = v if type(op).host_call_arg is EpiOp.host_call_arg else op.host_call_arg(v, op_key)
            theirs = cls.EpilogueArguments(**fields)
        assert len(epi) == len(theirs)
        for ours, quacks in zip(epi, theirs):
            assert (ours is None) == (quacks is None)
            if ours is not None:
                assert ours.shape == quacks.shape and ours.data_ptr() == quacks.data_ptr()
                sources = [proj.bias, proj.norm_weight, *(proj.one_launch_vectors if group["epi"] == "qkv" else ()),
                           *{"table": (rope_cs,), "pair": rope_cs, None: ()}[rope]]
                assert ours.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in sources
                                                              if t is not None}
        assert kern.scheduler[:kern.clusters_at] + (7,) + kern.scheduler[kern.clusters_at + 1:] == tuple(
            int(v) if hasattr(v, "value") else v for v in make_scheduler_args(7, 8, None))
        assert K._launch_args(proj, group, kern) is K._launch_args(proj, group, kern)
        assert K._launch_args(other, group, kern)[0].data_ptr() == other.weight[lo].data_ptr()


_ALL_EPILOGUES = {**{key: mod for key, mod in Dv._QK_EPILOGUES.items()},
                  **{(True, True, rope, "one launch"): mod for rope, mod in Dv._ONE_LAUNCH.items()}}


@pytest.mark.parametrize("key", sorted(_ALL_EPILOGUES, key=str))
def test_mint_matches_quack(key, monkeypatch):
    """The class this module compiles is the one quack's own EpiMod.gemm mints for the same call
    (dense, batched, SM90, no C): pins the private quack contract the module relies on."""
    import quack.epilogue.frontend as frontend

    mod = _ALL_EPILOGUES[key]
    captured = {}

    class Stop(Exception):
        pass

    def build(GemmCls, *args, **kwargs):
        captured["cls"] = GemmCls
        raise Stop

    monkeypatch.setattr(frontend, "build_gemm_epi_plan", build)
    monkeypatch.setattr(frontend, "get_device_capacity", lambda *_: (9, 0))
    D, M, n, C = 128, 200, 512, 256
    with FakeTensorMode():
        dev = "cuda"
        bias = None
        if key[0]:  # quack infers an unpinned bias (rope_table_epi) from an (l, n) tensor
            pinned = "b" in mod.ops
            bias = torch.empty((n,) if pinned else (1, n), dtype=torch.bfloat16, device=dev)
        vec = lambda: torch.empty(n, dtype=torch.float32, device=dev)  # noqa: E731
        table = lambda: torch.empty(M, D, dtype=torch.float32, device=dev)  # noqa: E731
        values = Dv._epilogue_values(
            mod, bias=bias, norm_weight=vec(), head_dim=D,
            rope_cs=(table(), table()) if key[2] == "pair" else table(), rot=vec(), sel=vec())
        A = torch.empty(1, M, C, dtype=torch.bfloat16, device=dev)
        Bw = torch.empty(1, n, C, dtype=torch.bfloat16, device=dev)
        Dt = torch.empty(1, M, n, dtype=torch.bfloat16, device=dev)
        with pytest.raises(Stop):
            mod.gemm(A, Bw, Dt, epi_args=values, tile_M=128, tile_N=128, cluster_M=2, cluster_N=1,
                     pingpong=True)
        assert Dv._mint(mod, values) is captured["cls"]


def _reference_scatter(y, windows, proj, row0):
    """Index by index: GEMM column n = ((t*P + p)*h_t + j)*D + i -> windows[t][p, b, row0 + m, j, i]."""
    B, M, _ = y.shape
    P, D = proj.world_size, proj.head_dim
    for t, w in enumerate(windows):
        h = proj.widths[t] // D
        lo = proj.column_range(t)[0]
        for p in range(P):
            for j in range(h):
                col = lo + (p * h + j) * D
                w[p, :, row0:row0 + M, j, :] = y[:, :, col:col + D]


@pytest.mark.parametrize("P,B,S_loc,merged", [(1, 1, 5, True), (3, 2, 7, True), (4, 1, 3, False)])
def test_window_view_is_the_ulysses_layout(P, B, S_loc, merged):
    """rank_window_view (the kernel's D) puts every GEMM column where the pre-A2A puts it; pads
    between tensors and windows are never written."""
    D, H_loc, C = 8, 2, 16
    n = 3 * P * H_loc * D
    proj = K.QKVWeights(torch.zeros(n, C), None, None, P, H_loc, H_loc, D)
    N, pad = P * S_loc + 2, 24  # two rows more than the sequence part (say joint rows)
    per = B * N * H_loc * D
    W = 3 * (per + pad) + 40
    got = torch.full((P, W), float("nan"))
    ref = got.clone()

    def split(flat):
        return [flat[:, k * (per + pad):k * (per + pad) + per].unflatten(1, (B, N, H_loc, D))
                for k in range(3)]

    wg, wr = split(got), split(ref)
    if not merged:  # one tensor per launch
        groups = [[0], [1], [2]]
    else:
        groups = [[0, 1, 2]]
    for r in reversed(range(P)):
        y = torch.randn(B, S_loc, n)
        row0 = r * S_loc
        for ts in groups:
            lo, hi = proj.column_range(ts[0])[0], proj.column_range(ts[-1])[1]
            for b in range(B):
                view = K.rank_window_view([wg[t] for t in ts], row0, b, S_loc)
                view.copy_(y[b:b + 1, :, lo:hi].reshape(1, S_loc, len(ts), P, H_loc * D))
        _reference_scatter(y, wr, proj, row0)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(got, 7.0), torch.nan_to_num(ref, 7.0))
    assert got.isnan().sum() == P * (3 * pad + 40 + 3 * B * 2 * H_loc * D)  # pads + the 2 extra rows


def test_from_linear_gathers_heads_for_padding_and_gqa():
    """H = 6 query heads over P = 4 ranks (H_loc = 2, heads 6, 7 padding), H_kv = 2 (GQA)."""
    D, C, P = 64, 8, 4
    wq, wk, wv = (torch.randn(h * D, C, dtype=torch.bfloat16) for h in (6, 2, 2))
    bq, bk, bv = (torch.randn(h * D) for h in (6, 2, 2))
    q_index = [(0, 1), (2, 3), (4, 5), (6, 7)]
    kv_index = [(0,), (0,), (1,), (1,)]  # query heads 0..2 read KV head 0, 3..5 KV head 1
    nq, nk = torch.randn(D), torch.randn(D)
    proj = K.QKVWeights.from_linear(wq, wk, wv, head_dim=D, world_size=P, bq=bq, bk=bk, bv=bv,
                                    q_norm_weight=nq, k_norm_weight=nk, q_head_index=q_index,
                                    kv_head_index=kv_index)
    assert (proj.heads_loc, proj.kv_heads_loc, proj.widths) == (2, 1, (128, 64, 64))
    heads = proj.weight.unflatten(0, (-1, D))
    for slot, h in enumerate([h for r in q_index for h in r]):
        expect = wq[h * D:(h + 1) * D] if h < 6 else torch.zeros(D, C, dtype=wq.dtype)
        assert torch.equal(heads[slot], expect)
        assert torch.equal(proj.bias[slot * D:(slot + 1) * D], bq[h * D:(h + 1) * D] if h < 6 else torch.zeros(D))
    for slot, h in enumerate([h for r in kv_index for h in r]):
        assert torch.equal(heads[8 + slot], wk[h * D:(h + 1) * D])
        assert torch.equal(heads[12 + slot], wv[h * D:(h + 1) * D])
    assert torch.equal(proj.norm_weight, torch.cat([nq.repeat(8), nk.repeat(4)]))
    plain = K.QKVWeights.from_linear(wq[:4 * D], wq[:4 * D], wq[:4 * D], head_dim=D, world_size=P)
    assert torch.equal(plain.weight, torch.cat([wq[:4 * D]] * 3))


def test_bad_inputs_name_the_argument():
    D = 64
    w = torch.randn(4 * D, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim: one of"):
        K.QKVWeights.from_linear(w, w, w, head_dim=96, world_size=2)
    with pytest.raises(ValueError, match="q_head_index: needed"):
        K.QKVWeights.from_linear(w, w[:2 * D], w[:2 * D], head_dim=D, world_size=2)
    with pytest.raises(ValueError, match="q_head_index: needed"):
        K.QKVWeights.from_linear(w, w, w, head_dim=D, world_size=3)
    with pytest.raises(ValueError, match="wk: bfloat16/float16"):
        K.QKVWeights.from_linear(w, w.float(), w, head_dim=D, world_size=2)
    with pytest.raises(ValueError, match="bq, bk, bv: all or none"):
        K.QKVWeights.from_linear(w, w, w, head_dim=D, world_size=2, bq=torch.zeros(4 * D))
    with pytest.raises(ValueError, match="q_norm_weight, k_norm_weight"):
        K.QKVWeights.from_linear(w, w, w, head_dim=D, world_size=2, q_norm_weight=torch.ones(D))
    with pytest.raises(ValueError, match="kv_head_index: heads in"):
        K.QKVWeights.from_linear(w, w, w, head_dim=D, world_size=2, q_head_index=[(0, 1), (2, 3)],
                                 kv_head_index=[(0, 1), (2, 9)])
    with pytest.raises(ValueError, match="width: no tile_N"):
        K.default_config(96, 32, False)
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128)
        with pytest.raises(ValueError, match="x: torch.bfloat16"):
            K.qkv_a2a_projection(x.half(), proj, windows, 0)
        with pytest.raises(ValueError, match=r"rope_cs: float32 \[200, 128\]"):
            K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=cs.half())
        with pytest.raises(ValueError, match=r"rope_cs\[1\] \(sin\): float32"):
            K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=(cs, cs.narrow(0, 0, 100)))
        with pytest.raises(ValueError, match=r"rope_cs\[0\] \(cos\): contiguous rows, a 16-byte aligned base"):
            K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=(torch.empty(200 * 128 + 1, device="cuda").narrow(0, 1, 200 * 128).view(200, 128), cs))
        with pytest.raises(ValueError, match="rope_cs: a float32 table or a"):
            K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=(cs,))
        with pytest.raises(ValueError, match="row0: rows"):
            K.qkv_a2a_projection(x, proj, windows, 700)
        with pytest.raises(ValueError, match="row0: an int"):
            K.qkv_a2a_projection(x, proj, windows, 1.0)
        with pytest.raises(ValueError, match=r"windows\[1\]: \[4, 1, N, 2, 128\]"):
            k1 = torch.empty(4, 1, 800, 1, 128, dtype=torch.bfloat16, device="cuda")
            K.qkv_a2a_projection(x, proj, [windows[0], k1, windows[2]], 0)
        with pytest.raises(ValueError, match="windows: a tuple"):
            K.qkv_a2a_projection(x, proj, [None, None, None], 0)
        with pytest.raises(ValueError, match="config: tile_n must divide"):
            K.qkv_a2a_projection(x, proj, windows, 0, config=K.GemmConfig(tile_n=192))
    with pytest.raises(ValueError, match="x: a CUDA tensor"):
        K.qkv_a2a_projection(torch.zeros(1, 4, 16, dtype=torch.bfloat16), proj, windows, 0)


def test_config_for_rows():
    """192-row tiles where they pad fewer rows (measured faster at S_loc = 576, slower at 1024)."""
    assert K.config_for(576, 384, 128, True) == K.GemmConfig(192, 128, 1, 2, True)
    assert K.config_for(1024, 384, 128, False) == K.default_config(384, 128, False)
    assert K.config_for(4096, 384, 128, False).tile_m == 128
    assert K.config_for(576, 192, 64, True) == K.default_config(192, 64, True)  # 128 does not divide 192
    assert K.default_config(384, 128, False).tile_n == 192
    assert K.default_config(192, 64, True).tile_n == 192
    assert K.default_config(64, 64, True).tile_n == 64


def test_interleaved_cos_sin():
    ang = torch.rand(5, 4)
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    cs = K.interleaved_cos_sin(cos, sin)
    assert cs.dtype == torch.float32 and cs.shape == (5, 8)
    assert torch.equal(cs[:, 0::2], ang.cos()) and torch.equal(cs[:, 1::2], ang.sin())
    with pytest.raises(ValueError, match="cos, sin"):
        K.interleaved_cos_sin(cos, sin[:, :6])


def test_diffusers_pairs_of_row_views_compile_the_pair_epilogue(record_compiles):
    """rope_cs as diffusers' (cos, sin) pair of row views of larger tensors (a rank's rows of the
    model's rotary): accepted as they are; the q|k launches compile the pair epilogue, v the same
    kernel as with the table."""
    with FakeTensorMode():
        proj, x, windows, cs = _fake_problem(torch.bfloat16, 128)
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=cs)
        table_keys = list(record_compiles)
        cos, sin = (torch.empty(600, 128, device="cuda").narrow(0, 100, 200) for _ in range(2))
        K.qkv_a2a_projection(x, proj, windows, 200, rope_cs=(cos, sin))
        pair_keys = [k[:5] + (("pair",) if k[5] == "table" else k[5:6]) + k[6:] for k in table_keys]
        assert record_compiles[len(table_keys):] == pair_keys and any(k[5] == "pair" for k in pair_keys)


def test_row_slices_of_x_are_accepted():
    """x needs contiguous rows only: a batch stride larger than M*C (a row slice) is fine."""
    with FakeTensorMode():
        proj, _, windows, cs = _fake_problem(torch.bfloat16, 128, B=2)
        x = torch.empty_strided((2, 200, 256), (300 * 256, 256, 1), dtype=torch.bfloat16, device="cuda")
        K.qkv_a2a_projection(x, proj, windows, 0, rope_cs=cs)
        empty = torch.empty(2, 0, 256, dtype=torch.bfloat16, device="cuda")  # a rank without padded rows
        K.qkv_a2a_projection(empty, proj, windows, 800, rope_cs=torch.empty(0, 128, device="cuda"))
        bad = torch.empty_strided((2, 200, 256), (300 * 256, 264, 1), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="x: contiguous rows"):
            K.qkv_a2a_projection(bad, proj, windows, 0, rope_cs=cs)


def test_rank_slice_is_one_rank_of_heads():
    D, C, P = 64, 8, 4
    wq, wk, wv = (torch.randn(8 * D, C, dtype=torch.bfloat16) for _ in range(3))
    bq, bk, bv = (torch.randn(8 * D) for _ in range(3))
    nq, nk = torch.randn(D), torch.randn(D)
    proj = K.QKVWeights.from_linear(wq, wk, wv, head_dim=D, world_size=P, bq=bq, bk=bk, bv=bv,
                                    q_norm_weight=nq, k_norm_weight=nk)
    own = proj.rank_slice(2)
    rows = slice(4 * D, 6 * D)  # heads 4, 5
    assert (own.world_size, own.heads_loc, own.kv_heads_loc) == (1, 2, 2)
    assert torch.equal(own.weight, torch.cat([wq[rows], wk[rows], wv[rows]]))
    assert torch.equal(own.bias, torch.cat([bq[rows], bk[rows], bv[rows]]))
    assert torch.equal(own.norm_weight, torch.cat([nq.repeat(2), nk.repeat(2)]))
    with pytest.raises(ValueError, match="rank: an int in"):
        proj.rank_slice(4)


def test_one_launch_vectors():
    D, P = 64, 2
    w = torch.randn(2 * D, 8, dtype=torch.bfloat16)
    nq, nk = torch.randn(D), torch.randn(D)
    proj = K.QKVWeights.from_linear(w, w, w, head_dim=D, world_size=P, q_norm_weight=nq, k_norm_weight=nk)
    wv, rot, sel = proj.one_launch_vectors
    n_qk = 2 * 2 * D
    assert torch.equal(wv[:n_qk], proj.norm_weight) and not wv[n_qk:].any()
    assert torch.equal(rot, (torch.arange(3 * 2 * D) < n_qk).float()) and torch.equal(sel, 1 - rot)
    assert proj.one_launch_vectors[0] is wv  # built once


def test_tma_rows_is_what_the_checks_and_the_bound_launch_require():
    """One predicate for the projection's x (its checks refuse, a bound launch copies where false):
    contiguous rows of C, a 16-byte aligned base and batch stride."""
    C = 64
    x = torch.empty(2, 5, C, dtype=torch.bfloat16)
    assert K._tma_rows(x, C, x.data_ptr())
    assert K._tma_rows(x[:, 1:3], C, x[:, 1:3].data_ptr())  # a row slice: rows stay contiguous
    assert not K._tma_rows(x[:, :, :C - 8], C - 8, x.data_ptr())  # rows of C - 8 inside rows of C
    assert not K._tma_rows(x.transpose(1, 2).contiguous().transpose(1, 2), C, x.data_ptr())
    assert not K._tma_rows(x, C, x.data_ptr() + 2)  # a base off 16 bytes
    odd = torch.empty(2 * (5 * C + 1), dtype=torch.bfloat16).as_strided((2, 5, C), (5 * C + 1, C, 1))
    assert not K._tma_rows(odd, C, 0)  # a batch stride of 5 * C + 1 elements


def test_quack_epilogues_that_fail_their_fingerprint_name_the_install(monkeypatch):
    """Kernel packages imported from a folder that is not site-packages (PYTHONPATH, pip --target): quack's
    epilogue library raises a TypeError about a ContextVar of the DSL while fingerprinting its epilogues (seen on
    an H100, 2026-12-05); the projection's device module says what to do instead."""
    import importlib
    import sys

    class Refuse:  # a finder that fails quack's epilogue library as that install does
        def find_spec(self, name, path=None, target=None):
            if name == "quack.epilogue.library":
                raise TypeError("epilogue fn depends on <ContextVar name='_LOC_TRANSFORMS'>")
            return None

    monkeypatch.setattr(sys, "meta_path", [Refuse()] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "quack.epilogue.library", raising=False)
    monkeypatch.delitem(sys.modules, "cute_kernels.qkv_a2a_sm90_device")
    with pytest.raises(ImportError, match="not from a PYTHONPATH entry .*TypeError: epilogue fn depends on"):
        importlib.import_module("cute_kernels.qkv_a2a_sm90_device")
