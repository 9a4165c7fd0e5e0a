"""CPU tier: FA4's SM90 forward and the rank-window subclass compile for sm_90a with fake tensors."""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4 as fused


@pytest.fixture
def compile_keys(monkeypatch):
    """The keys fused.compile_fa4 is asked for (positional key + timestamps), in call order."""
    keys, compile_fa4 = [], fused.compile_fa4

    def spy(*key, timestamps=False, **kw):
        keys.append((*key, timestamps))
        return compile_fa4(*key, timestamps=timestamps, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    return keys


@pytest.mark.parametrize("D,causal,dtype", [(128, False, torch.bfloat16), (64, True, torch.float16)])
def test_compiles_without_gpu(D, causal, dtype, compile_keys):
    with FakeTensorMode():
        P, B, S_loc, H_loc = 4, 1, 320, 3
        q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
        k, v = torch.empty_like(q), torch.empty_like(q)
        fused.fa4_forward(q, k, v, causal=causal)
        windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
        fused.fa4_a2a_forward(q, k, v, windows, 1, causal=causal)
        S_loc = 3 * fused.tile_m_for(D, causal)
        q2 = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
        windows2 = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
        fused.fa4_a2a_forward(q2, q2, q2, windows2, 0, causal=causal)
        lse_windows = torch.empty(P, B, P * H_loc, S_loc, dtype=torch.float32, device="cuda")
        fused.fa4_a2a_forward(q2, q2, q2, windows2, 0, causal=causal, lse_windows=lse_windows)
    assert ("a2a-tma", dtype, D, 1, causal, False, False, False) in compile_keys
    assert ("a2a-tma", dtype, D, 1, causal, False, True, False) in compile_keys
    assert ("a2a-st", dtype, D, 1, causal, False, False, False) in compile_keys  # 320 % tile_m != 0


@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_timestamp_variants_compile(D, dtype, compile_keys):
    # the stamped debug builds of both O paths (straddling and aligned S_loc)
    with FakeTensorMode():
        P, B, H_loc = 4, 1, 3
        for S_loc in (320, 3 * fused.tile_m_for(D)):
            q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
            windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
            n_m = -(-P * S_loc // fused.tile_m_for(D))
            ts = torch.empty(B, H_loc, n_m, 7, dtype=torch.int64, device="cuda")
            fused.fa4_a2a_forward(q, q, q, windows, 1, timestamps=ts)
    for kind in ("a2a-st", "a2a-tma"):
        assert (kind, dtype, D, 1, False, False, False, True) in compile_keys


def _fake_inputs(**over):
    shapes = dict(P=2, B=1, S_loc=128, H_loc=2, D=128)
    shapes.update(over)
    P, B, S_loc, H_loc, D = (shapes[k] for k in ("P", "B", "S_loc", "H_loc", "D"))
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=torch.bfloat16, device="cuda")
    w = torch.empty(P, B, S_loc, P * H_loc, D, dtype=torch.bfloat16, device="cuda")
    return q, w


def test_bad_inputs_name_the_argument():
    with FakeTensorMode():
        q, w = _fake_inputs()
        k, v = torch.empty_like(q), torch.empty_like(q)
        with pytest.raises(ValueError, match="q: dtype"):
            fused.fa4_forward(q.float(), k, v)
        with pytest.raises(ValueError, match="head dim"):
            q96 = torch.empty(1, 256, 2, 96, dtype=torch.bfloat16, device="cuda")
            fused.fa4_forward(q96, q96, q96)
        with pytest.raises(ValueError, match="rank"):
            fused.fa4_a2a_forward(q, k, v, w, 2)
        with pytest.raises(ValueError, match="rank"):
            fused.fa4_a2a_forward(q, k, v, w, 1.0)
        with pytest.raises(ValueError, match="base address"):
            flat = torch.empty(w.numel() + 1, dtype=w.dtype, device="cuda")
            fused.fa4_a2a_forward(q, k, v, flat.as_strided(w.shape, w.stride(), 1), 0)
        with pytest.raises(ValueError, match="out:"):
            fused.fa4_forward(q, k, v, out=q.narrow(1, 0, 8))
        with pytest.raises(ValueError, match="out_windows: P \\* S_loc"):
            fused.fa4_a2a_forward(q, k, v, w.narrow(2, 0, 100), 0)
        with pytest.raises(ValueError, match="out_windows: H"):
            fused.fa4_a2a_forward(q, k, v, w.narrow(3, 0, 3), 0)
        with pytest.raises(ValueError, match="k: 3 KV heads"):
            k3 = torch.empty(1, 256, 3, 128, dtype=torch.bfloat16, device="cuda")
            fused.fa4_forward(q, k3, k3)
        with pytest.raises(ValueError, match="lse_windows"):
            fused.fa4_a2a_forward(q, k, v, w, 0, lse_windows=torch.empty(2, 1, 4, 100, device="cuda"))
        with pytest.raises(ValueError, match="o_store: 'bulk' is not"):
            fused.fa4_a2a_forward(q, k, v, w, 0, o_store="bulk")
        with pytest.raises(ValueError, match="timestamps: expected a contiguous int64"):
            fused.fa4_a2a_forward(q, k, v, w, 0, timestamps=torch.empty(1, 2, 3, 7, dtype=torch.int64, device="cuda"))
        with pytest.raises(ValueError, match="seqused_k"):
            fused.fa4_forward(q, k, v, seqused_k=torch.empty(2, dtype=torch.int64, device="cuda"))


def test_cpu_tensors_are_refused():
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fused.fa4_forward(q, q, q)


def _rotated_order(capfd, scheduler, rank, P, s_loc, block_rows, cluster, H, B):
    """{(linear CTA or tile, head, batch): (m_block, head, batch)} of the rank-rotated scheduler,
    its Params built by to_underlying_arguments and the shift by rank_rotation_shift as in the
    kernels' __call__, run by the CuTe DSL on the host (dynamic rank, P, S_loc)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from flash_attn.cute.tile_scheduler import SingleTileScheduler, TileSchedulerArguments

    from cute_kernels.fa4_a2a_sm90 import rank_rotated_scheduler, rank_rotation_shift

    single = scheduler is SingleTileScheduler

    @cute.jit
    def probe(rank: Int32, P: Int32, s_loc: Int32):
        # FA4's num_block (flash_fwd_sm100): per cluster for the single-tile scheduler, per CTA
        # (q_stage * 128 rows) for the persistent one, which divides by the cluster itself
        num_block = cute.ceil_div(P * s_loc, block_rows if single else block_rows // cluster)
        shift = rank_rotation_shift(rank, P, s_loc, block_rows)
        args = TileSchedulerArguments(num_block, H, B, 1, 1, 128, 128, total_q=P * s_loc * B,
                                      tile_shape_mn=(block_rows // cluster, 128), cluster_shape_mn=(cluster, 1),
                                      use_cluster_idx=single and cluster > 1)
        cls = rank_rotated_scheduler(scheduler, shift)
        params = cls.to_underlying_arguments(args)
        if cutlass.const_expr(single):
            for b in cutlass.range(B, unroll=1):
                for h in cutlass.range(H, unroll=1):
                    for i in cutlass.range(params.num_block, unroll=1):
                        w = cls(params, (i, h, b)).get_current_work()
                        cute.printf("tile %d %d %d %d %d %d\n", i, h, b, w.tile_idx[0], w.tile_idx[1], w.tile_idx[2])
        else:
            for t in cutlass.range(params.total_blocks_cluster, unroll=1):
                w = cls(params, t).get_current_work()
                cute.printf("tile %d %d %d %d %d %d\n", t, 0, 0, w.tile_idx[0], w.tile_idx[1], w.tile_idx[2])

    capfd.readouterr()
    probe(rank, P, s_loc)
    out = capfd.readouterr().out
    rows = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("tile ")]
    return {r[:3]: r[3:] for r in rows}


@pytest.mark.parametrize("scheduler,P,s_loc,block_rows,cluster", [
    ("single", 8, 256, 128, 1),  # SM90 D=128: tile_m divides S_loc
    ("single", 4, 320, 128, 1),  # tiles straddle rank boundaries
    ("single", 8, 100, 128, 1),  # S_loc < tile_m: a tile spans several ranks
    ("single", 4, 1024, 512, 2),  # SM100 non-persistent 2-CTA: the cluster is the block
    ("persistent", 4, 1024, 512, 2),  # SM100 static persistent, 2-CTA, q_stage 2
    ("persistent", 4, 320, 256, 1),  # the same with 1-CTA MMA, straddling
    ("persistent", 1, 512, 256, 1),  # one rank: no rotation
])
def test_rank_rotated_order_starts_at_the_next_rank(capfd, scheduler, P, s_loc, block_rows, cluster):
    from flash_attn.cute.tile_scheduler import SingleTileScheduler, StaticPersistentTileScheduler

    cls = SingleTileScheduler if scheduler == "single" else StaticPersistentTileScheduler
    H, B = 2, 2
    num_block = -(-P * s_loc // block_rows)
    for rank in sorted({0, P - 1, P // 2}):
        got = _rotated_order(capfd, cls, rank, P, s_loc, block_rows, cluster, H, B)
        assert len(got) == num_block * H * B
        shift = got[(0, 0, 0)][0]
        # the first block holds rank (rank + 1) % P's first row
        first_row = (rank + 1) % P * s_loc
        assert shift * block_rows <= first_row < (shift + 1) * block_rows
        for (i, h, b), (m, h2, b2) in got.items():
            if scheduler == "persistent":  # linear tile i = (b * H + h) * num_block + m, FA4's order
                (b, h), i = divmod(i // num_block, H), i % num_block
            assert (h2, b2) == (h, b) and m == (i + shift) % num_block
        assert sorted(got.values()) == sorted((m, h, b) for m in range(num_block) for h in range(H) for b in range(B))


def _kernel_params(ptx: str) -> int:
    return ptx.count(".param .")


def test_rotated_builds_compile_and_take_the_shift(compile_keys, monkeypatch, tmp_path):
    rotates = []
    spy = fused.compile_fa4

    def spy_rotate(*key, rotate=False, **kw):
        rotates.append((key[0], rotate))
        return spy(*key, rotate=rotate, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy_rotate)
    with FakeTensorMode():
        P, B, H_loc, D = 4, 1, 4, 128
        for S_loc, o_store, lse, kv_heads in ((256, "tma", True, 1), (320, "st", True, 4), (256, "st", False, 4)):
            q = torch.empty(B, P * S_loc, H_loc, D, dtype=torch.bfloat16, device="cuda")
            kv = torch.empty(B, P * S_loc, kv_heads, D, dtype=torch.bfloat16, device="cuda")
            w = torch.empty(P, B, S_loc, P * H_loc, D, dtype=torch.bfloat16, device="cuda")
            lse_w = torch.empty(P, B, P * H_loc, S_loc, dtype=torch.float32, device="cuda") if lse else None
            fused.fa4_a2a_forward(q, kv, kv, w, 3, lse_windows=lse_w, o_store=o_store, rotate=True)
        n_m = P * 256 // fused.tile_m_for(D)
        ts = torch.empty(B, H_loc, n_m, 7, dtype=torch.int64, device="cuda")
        q = torch.empty(B, P * 256, H_loc, D, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(P, B, 256, P * H_loc, D, dtype=torch.bfloat16, device="cuda")
        fused.fa4_a2a_forward(q, q, q, w, 0, timestamps=ts, rotate=True)
    assert rotates == [("a2a-tma", True), ("a2a-st", True), ("a2a-st", True), ("a2a-tma", True)]
    assert ("a2a-tma", torch.bfloat16, D, 4, False, False, True, False) in compile_keys  # GQA
    assert ("a2a-st", torch.bfloat16, D, 1, False, False, True, False) in compile_keys
    assert ("a2a-tma", torch.bfloat16, D, 1, False, False, False, True) in compile_keys
    # the rotated kernel takes the block shift (one more kernel parameter) and adds it to ctaid.x
    key = ("a2a-tma", torch.bfloat16, D, 1, False, False, False)
    off, on = (spy(*key, rotate=r, extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__ for r in (False, True))
    assert _kernel_params(on) == _kernel_params(off) + 1
    assert "selp" in on and on.count("%ctaid.x") == off.count("%ctaid.x")


def test_rotation_is_refused_for_causal():
    from cute_kernels.fa4_a2a_sm90 import FlashAttentionA2AForwardSm90

    with pytest.raises(ValueError, match="rotate: the rank-rotated order is for non-causal"):
        fused._make_kernel(FlashAttentionA2AForwardSm90, torch.bfloat16, 128, 1, True, rotate=True)
    with FakeTensorMode():
        q, w = _fake_inputs()
        with pytest.raises(ValueError, match="rotate: the rank-rotated tile order is for non-causal"):
            fused.fa4_a2a_forward(q, q, q, w, 0, causal=True, rotate=True)
    with pytest.raises(ValueError, match="rotate: only the fused kernels"):
        fused.compile_fa4("fa4", torch.bfloat16, 128, 1, False, False, False, rotate=True)


def test_fresh_launcher_binds_once_and_launches_into_fresh_outputs(monkeypatch):
    """fa4_fresh_launcher (the P = 1 block's attention): checked and bound once on fixed q, k, v; each call
    launches the compiled forward on them with a new output tensor, which it returns."""
    launches = []
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fused, "compile_fa4", lambda *key, **options: (lambda *args: launches.append(args)))
    monkeypatch.setattr(fused, "_is_fake", lambda t: False)  # the launch path itself, on fake tensors
    monkeypatch.setattr(fused, "device_arch", lambda q: 90)
    with FakeTensorMode():
        q = torch.empty(1, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
        # (no indexing: torch's CPU build refuses views of fake CUDA tensors)
        k, v, k3 = (torch.empty(1, 256, h, 128, dtype=torch.bfloat16, device="cuda") for h in (2, 2, 3))
        launch = fused.fa4_fresh_launcher(q, k, v, softmax_scale=0.5)
        outs = [launch(), launch()]
        with_lse = fused.fa4_fresh_launcher(q, k, v, softmax_scale=0.5, lse=True)
        pairs = [with_lse(), with_lse()]
        with pytest.raises(ValueError, match="^k: 3 KV heads do not divide 4"):
            fused.fa4_fresh_launcher(q, k3, k3)
        for junk in ([q], None, 3):  # named as fa4_forward names it (not torch.empty_like's TypeError)
            with pytest.raises(ValueError, match="^q: expected a torch.Tensor"):
                fused.fa4_fresh_launcher(junk, k, v)
    assert len(launches) == 4 and outs[0] is not outs[1]
    for args, out in zip(launches, outs):
        assert args[:3] == (q, k, v) and args[fused.ARG_OUT] is out and args[fused.ARG_LSE] is None and args[5] == 0.5
        assert out.shape == q.shape and out.dtype == q.dtype
    # lse=True: a fresh fp32 [B, H, S] LSE per call beside the output (the forward that keeps both for its backward)
    assert pairs[0][0] is not pairs[1][0] and pairs[0][1] is not pairs[1][1]
    for args, (out, lse) in zip(launches[2:], pairs):
        assert args[fused.ARG_OUT] is out and args[fused.ARG_LSE] is lse
        assert lse.shape == (1, 4, 256) and lse.dtype == torch.float32


def test_unchecked_forward_launches_what_the_checked_one_does(monkeypatch):
    """fa4_forward_unchecked (the op's local attention, whose arguments the op checked once per signature)
    launches the same compiled forward with the same arguments as fa4_forward, into a fresh output."""
    launches = []
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fused, "compile_fa4", lambda *key, **options: (lambda *args: launches.append((key, args))))
    monkeypatch.setattr(fused, "_is_fake", lambda t: False)
    monkeypatch.setattr(fused, "device_arch", lambda q: 90)
    with FakeTensorMode():
        q = torch.empty(1, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        used = torch.full((1,), 200, dtype=torch.int32, device="cuda")
        for causal, scale, seqused in ((False, None, used), (True, 0.25, None)):
            launches.clear()
            out = fused.fa4_forward_unchecked(q, k, v, causal=causal, softmax_scale=scale, seqused_k=seqused)
            checked = fused.fa4_forward(q, k, v, causal=causal, softmax_scale=scale, seqused_k=seqused)
            (key_u, args_u), (key_c, args_c) = launches
            assert key_u == key_c and args_u[fused.ARG_OUT] is out and args_c[fused.ARG_OUT] is checked
            same = [i for i in range(len(args_c)) if i != fused.ARG_OUT]
            assert all(args_u[i] is args_c[i] or args_u[i] == args_c[i] for i in same)


def _v4_stores(ptx: str) -> int:
    return len(re.findall(r"\bst\.global\.v4\b", ptx))


@pytest.mark.parametrize("kind", ["a2a-tma", "a2a-st"])
def test_keeping_build_also_stores_every_o_tile_locally(kind, tmp_path):
    """keep_o (the forward that keeps O for its backward): the same kernel with the routed O store as it was (TMA or
    per-thread) plus FA4's per-thread O store of the staged tile into the local O: 8 more 16-byte stores per thread
    at D 128 (a 128 x 128 bf16 tile over 256 threads), one more kernel parameter group (the local O)."""
    key = (kind, torch.bfloat16, 128, 1, False, False, True)
    opts = f"--keep-ptx --dump-dir={tmp_path}"
    plain, keep = (fused.compile_fa4(*key, keep_o=k, extra_options=opts).__ptx__ for k in (False, True))
    assert _v4_stores(keep) == _v4_stores(plain) + 8
    assert keep.count(".global.shared::cta") == plain.count(".global.shared::cta")  # the TMA store as it was
    assert _kernel_params(keep) > _kernel_params(plain)
    with pytest.raises(ValueError, match="keep_o"):
        fused.compile_fa4("a2a-paced", *key[1:], keep_o=True)
    with pytest.raises(ValueError, match="keep_o"):
        fused.compile_fa4("fa4", *key[1:], keep_o=True)


def test_keeping_launcher_takes_each_calls_o_and_lse(monkeypatch):
    """fa4_a2a_keeping_launcher: checked and compiled once against o_like / lse_like (slices of the op's
    [B, N, ...] tensors, N = S + joint rows); each launch passes that call's o last and its lse as the P LSE
    windows the kernel's LSE path indexes (window d = rows d * S_loc ..: strides (S_loc, H*N, N, 1))."""
    launches, keys = [], []
    monkeypatch.setattr(fused, "compile_fa4", lambda *key, **kw: keys.append((key, kw)) or (lambda *a: launches.append(a)))
    monkeypatch.setattr(fused, "_is_fake", lambda t: False)
    monkeypatch.setattr(fused, "device_arch", lambda q: 90)
    P, B, S_loc, H, D, J = 4, 2, 256, 3, 128, 40
    N = P * S_loc + J
    with FakeTensorMode():
        def kept():
            o = torch.empty(B, N, H, D, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(B, H, N, dtype=torch.float32, device="cuda")
            return o.narrow(1, 0, P * S_loc), lse.narrow(2, 0, P * S_loc)

        q, _ = kept()
        w = torch.empty(P, B, S_loc, P * H, D, dtype=torch.bfloat16, device="cuda")
        launch = fused.fa4_a2a_keeping_launcher(q, q, q, w, 2, *kept(), o_store="st")
        calls = [kept(), kept()]
        for o, lse in calls:
            launch(o, lse)
        with pytest.raises(ValueError, match="^o_like"):
            fused.fa4_a2a_keeping_launcher(q, q, q, w, 2, w, kept()[1])
        with pytest.raises(ValueError, match="^lse_like"):
            fused.fa4_a2a_keeping_launcher(q, q, q, w, 2, kept()[0], kept()[0])
        monkeypatch.setattr(fused, "device_arch", lambda q: 100)
        with pytest.raises(ValueError, match="^o_like: the fused kernel that keeps O is SM90's"):
            fused.fa4_a2a_keeping_launcher(q, q, q, w, 2, *kept())
    [(key, kw)] = keys
    assert key == ("a2a-st", torch.bfloat16, D, 1, False, False, True) and kw == {"rotate": False, "keep_o": True}
    assert len(launches) == 2
    for args, (o, lse) in zip(launches, calls):
        assert args[-1] is o and args[0] is q
        view = args[fused.ARG_A2A_LSE]
        assert tuple(view.shape) == (P, B, H, S_loc) and view.stride() == (S_loc, H * N, N, 1)
        assert view._base is lse._base and view.storage_offset() == lse.storage_offset()  # that call's lse
