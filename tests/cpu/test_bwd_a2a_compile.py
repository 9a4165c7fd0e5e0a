"""CPU tier: the fused SM90 backward (cute_kernels.fa4_bwd_a2a: FA4's backward with the post-A2A of dq,
dk, dv in its kernels) compiles for sm_90a with fake tensors, its PTX holds the routed stores, and bad
arguments are refused by name."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4_bwd_a2a as bwd

BF16 = torch.bfloat16


@pytest.fixture
def compiled(monkeypatch):
    """The keys the launcher compiles (main kernel, postprocess), in call order."""
    keys = {"main": [], "post": []}
    main, post = bwd.compile_bwd_a2a_main, bwd.compile_bwd_a2a_post

    def spy_main(*key, **kw):
        keys["main"].append(key)
        return main(*key, **kw)

    def spy_post(*key, **kw):
        keys["post"].append(key)
        return post(*key, **kw)

    monkeypatch.setattr(bwd, "compile_bwd_a2a_main", spy_main)
    monkeypatch.setattr(bwd, "compile_bwd_a2a_post", spy_post)
    return keys


def _inputs(P=2, B=1, S_loc=256, H_loc=2, H_kv=None, D=128, dtype=BF16, seqused=None, J=0):
    """Fake q, k, v, out, dout, lse of one rank and its windows (call under FakeTensorMode); J joint rows."""
    H_kv = H_kv or H_loc
    N = P * S_loc + J
    q = torch.empty(B, N, H_loc, D, dtype=dtype, device="cuda")
    k = torch.empty(B, N, H_kv, D, dtype=dtype, device="cuda")
    lse = torch.empty(B, H_loc, N, dtype=torch.float32, device="cuda")
    dqw = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
    dkw = torch.empty(P, B, S_loc, P * H_kv, D, dtype=dtype, device="cuda")
    sk = None if seqused is None else torch.full((B,), seqused, dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=torch.empty_like(k), out=torch.empty_like(q), dout=torch.empty_like(q), lse=lse,
                dq_windows=dqw, dk_windows=dkw, dv_windows=torch.empty_like(dkw)), sk


CASES = [
    # D, P, S_loc, H_loc, H_kv, causal, seqused, deterministic -> the dK/dV path the launcher picks
    (128, 2, 256, 2, 2, False, None, False, "tma"),  # S_loc a multiple of tile_n (128)
    (128, 8, 100, 1, 1, True, None, False, "st"),  # S_loc < tile: a block spans several ranks
    (64, 2, 320, 2, 2, True, None, True, "st"),  # straddling blocks, FA4's deterministic mode
    (64, 8, 256, 3, 3, False, None, False, "tma"),
    (128, 4, 384, 2, 2, False, 1400, False, "st"),  # padded keys (seqused_k): per-thread stores
    (128, 4, 384, 4, 1, False, 1400, False, "accum"),  # GQA: FA4's fp32 dK/dV, routed by the postprocess
    (64, 8, 200, 4, 2, False, None, True, "accum"),  # GQA, straddling, deterministic
]


@pytest.mark.parametrize("D,P,S_loc,H_loc,H_kv,causal,seqused,det,store", CASES)
def test_compiles_without_gpu(D, P, S_loc, H_loc, H_kv, causal, seqused, det, store, compiled):
    with FakeTensorMode():
        args, sk = _inputs(P=P, S_loc=S_loc, H_loc=H_loc, H_kv=H_kv, D=D, seqused=seqused)
        bwd.fa4_bwd_a2a(**args, rank=P - 1, causal=causal, seqused_k=sk, deterministic=det)
    cfg = bwd.fa4_sm90_bwd_config(D, causal)
    N = P * S_loc
    assert compiled["main"] == [(store, BF16, D, H_loc // H_kv, causal, seqused is not None, det,
                                 N <= cfg.m_block_size, N <= cfg.n_block_size)]
    dq_threads = 128 if cfg.dQ_single_wg else 128 * cfg.num_wg
    posts = [(BF16, D, cfg.m_block_size, dq_threads, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, False)]
    if store == "accum":
        posts.append((BF16, D, cfg.n_block_size, 128 * cfg.num_wg, cfg.AtomLayoutNdKV, cfg.dKV_swapAB,
                      seqused is not None))
    assert compiled["post"] == posts


def test_st_forced_on_aligned_windows_and_fp16(compiled):
    with FakeTensorMode():
        args, _ = _inputs(P=4, S_loc=256, D=128, dtype=torch.float16)
        bwd.fa4_bwd_a2a(**args, rank=0, dkv_store="st")
    assert compiled["main"][0][:2] == ("st", torch.float16)


def test_tiles_are_fa4s():
    assert bwd.bwd_tiles(128) == (80, 128) and bwd.bwd_tiles(128, True) == (64, 128)
    assert bwd.bwd_tiles(64) == (128, 128)


def _ptx(fn, *key, tmp_path):
    return fn(*key, extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__


TMA_STORE = "cp.async.bulk.tensor.5d.global.shared::cta"  # a TMA store through the 5-mode window view


def test_ptx_shows_the_stores(tmp_path):
    st = _ptx(bwd.compile_bwd_a2a_main, "st", BF16, 128, 1, False, False, False, False, False, tmp_path=tmp_path)
    assert "st.global.v4.b32" in st and TMA_STORE not in st  # per-thread 16-byte stores of dK, dV
    tma = _ptx(bwd.compile_bwd_a2a_main, "tma", BF16, 128, 1, False, False, False, False, False, tmp_path=tmp_path)
    assert TMA_STORE in tma and "st.global" not in tma
    # GQA: FA4's own kernel, dK/dV as fp32 bulk reduce-adds into the accumulators beside dQ's
    gqa = _ptx(bwd.compile_bwd_a2a_main, "accum", BF16, 128, 2, False, False, False, False, False, tmp_path=tmp_path)
    add = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
    assert gqa.count(add) > st.count(add) == tma.count(add) > 0 and TMA_STORE not in gqa
    cfg = bwd.fa4_sm90_bwd_config(128, False)
    post = _ptx(bwd.compile_bwd_a2a_post, BF16, 128, cfg.m_block_size, 256, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, False,
                tmp_path=tmp_path)
    assert "st.global.v4.b32" in post


def test_refusals():
    from cute_kernels.fa4_bwd_a2a_sm90 import FlashAttentionA2ABackwardSm90

    with FakeTensorMode():
        args, sk = _inputs(P=2, S_loc=200)

        def refused(match, rank=0, **over):
            with pytest.raises(ValueError, match=match):
                bwd.fa4_bwd_a2a_launcher(**{**args, **over}, rank=rank)

        q, k = args["q"], args["k"]
        refused("q: dtype", q=q.float())
        refused("q: head dim", q=torch.empty(1, 400, 2, 96, dtype=BF16, device="cuda"))
        refused("k: expected", k=k.narrow(1, 0, 300))  # (narrow: torch's CPU build cannot index fake CUDA tensors)
        refused("k: 3 KV heads do not divide", k=torch.empty(1, 400, 3, 128, dtype=BF16, device="cuda"),
                v=torch.empty(1, 400, 3, 128, dtype=BF16, device="cuda"))
        refused("v: expected", v=torch.empty(1, 400, 1, 128, dtype=BF16, device="cuda"))
        refused("out: expected", out=torch.empty(1, 400, 3, 128, dtype=BF16, device="cuda"))
        refused("dout: must be contiguous", dout=torch.empty(1, 400, 128, 2, dtype=BF16, device="cuda").transpose(2, 3))
        refused("lse: expected", lse=args["lse"].transpose(1, 2))
        refused("lse: expected", lse=args["lse"].half())
        refused("rank", rank=2)
        refused("rank", rank=1.0)
        refused("dq_windows: expected", dq_windows=args["dq_windows"].narrow(3, 0, 3))
        refused("dk_windows: expected", dk_windows=args["dk_windows"].narrow(0, 0, 1))
        refused("dv_windows: must be", dv_windows=args["dv_windows"].half())
        win = args["dq_windows"]
        flat = torch.empty(win.numel() + 8, dtype=BF16, device="cuda")
        refused("dq_windows: the base address", dq_windows=flat.narrow(0, 1, win.numel()).view(win.shape))
        odd = flat.as_strided(win.shape, (win.stride(0) + 1,) + win.stride()[1:])
        refused("dq_windows: the window stride", dq_windows=odd)
        heads_inner = flat.as_strided(win.shape, win.stride()[:3] + (1, win.shape[3]))
        refused("dq_windows: each window", dq_windows=heads_inner)
        refused("seqused_k: expected", seqused_k=torch.full((1,), 300, dtype=torch.int64, device="cuda"))
        refused("deterministic: expected a bool", deterministic=1)
        refused("dkv_store", dkv_store="tma")  # S_loc 200 is not a multiple of tile_n
        refused("dkv_store", dkv_store="x")
        args, sk = _inputs(P=2, S_loc=256, seqused=400)
        refused("dkv_store", dkv_store="tma", seqused_k=sk)  # padded keys: TMA would write past them
    with pytest.raises(ValueError, match="dkv_store: 'accum' exactly when"):
        bwd.compile_bwd_a2a_main("st", BF16, 128, 2, False, False, False, False, False)
    with pytest.raises(ValueError, match="qhead_per_kvhead"):
        bwd._main_kernel("tma", BF16, 128, 2, False, False)
    with pytest.raises(ValueError, match="dkv_store: one of"):
        FlashAttentionA2ABackwardSm90(bwd._cute_dtype(BF16), 128, dkv_store="x")


def _joint(B, J, H_loc, H_kv, D=128, dtype=BF16):
    return tuple(torch.empty(B, J, h, D, dtype=dtype, device="cuda") for h in (H_loc, H_kv, H_kv))


@pytest.mark.parametrize("H_loc,H_kv,seqused", [(2, 2, None), (2, 2, 2 * 300 - 40 + 33), (4, 1, 2 * 300 - 40 + 33)])
def test_joint_rows_compile_and_take_the_routed_joint_kernels(monkeypatch, H_loc, H_kv, seqused):
    """Joint rows (N = P * S_loc + J): the routed main kernel (no GQA, per-thread dK/dV stores) and the
    postprocesses are compiled with their joint tensors; GQA keeps FA4's own main kernel."""
    seen = []
    main, post = bwd.compile_bwd_a2a_main, bwd.compile_bwd_a2a_post
    monkeypatch.setattr(bwd, "compile_bwd_a2a_main", lambda *k, **kw: seen.append(("main", k[0], kw)) or main(*k, **kw))
    monkeypatch.setattr(bwd, "compile_bwd_a2a_post", lambda *k, **kw: seen.append(("post", k[2], kw)) or post(*k, **kw))
    with FakeTensorMode():
        args, sk = _inputs(P=2, S_loc=300, H_loc=H_loc, H_kv=H_kv, seqused=seqused, J=33)
        bwd.fa4_bwd_a2a(**args, rank=1, seqused_k=sk, joint=_joint(1, 33, H_loc, H_kv))
    cfg = bwd.fa4_sm90_bwd_config(128, False)
    gqa = H_loc > H_kv
    want = [("main", "accum" if gqa else "st", {} if gqa else {"joint": True}),
            ("post", cfg.m_block_size, {"joint": True})]
    if gqa:
        want.append(("post", cfg.n_block_size, {"joint": True}))
    assert seen == want


def test_ptx_of_the_joint_routing(tmp_path):
    """The joint build's dK/dV epilogue and postprocess store rows to the joint tensors too: more 16-byte
    stores than the build without."""
    st = _ptx(bwd.compile_bwd_a2a_main, "st", BF16, 128, 1, False, True, False, False, False, tmp_path=tmp_path)
    joint = bwd.compile_bwd_a2a_main("st", BF16, 128, 1, False, True, False, False, False, joint=True,
                                     extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert joint.count("st.global.v4.b32") > st.count("st.global.v4.b32") > 0
    cfg = bwd.fa4_sm90_bwd_config(128, False)
    key = (BF16, 128, cfg.m_block_size, 256, cfg.AtomLayoutMdQ, cfg.dQ_swapAB, False)
    post = _ptx(bwd.compile_bwd_a2a_post, *key, tmp_path=tmp_path)
    post_joint = bwd.compile_bwd_a2a_post(*key, joint=True, extra_options=f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert post_joint.count("st.global.v4.b32") > post.count("st.global.v4.b32") > 0


def test_joint_refusals():
    with FakeTensorMode():
        args, _ = _inputs(P=2, S_loc=256, J=20)

        def refused(match, **over):
            with pytest.raises(ValueError, match=match):
                bwd.fa4_bwd_a2a_launcher(**{**args, **over}, rank=0)

        good = _joint(1, 20, 2, 2)
        refused("dq_windows: expected")  # 20 joint rows without their tensors
        refused("joint: expected", joint=good[:2])
        refused("joint: djq must be", joint=(good[0].narrow(1, 0, 0),) + good[1:])
        refused("joint djk: expected", joint=(good[0].narrow(1, 0, 10),) + good[1:])  # J read from djq: 10
        refused("joint djq: expected", joint=(torch.empty(1, 20, 3, 128, dtype=BF16, device="cuda"),) + good[1:])
        refused("joint djk: expected", joint=(good[0], torch.empty(1, 20, 1, 128, dtype=BF16, device="cuda"), good[2]))
        refused("joint djv: dtype", joint=good[:2] + (good[2].half(),))
        refused("joint djq: must be contiguous",
                joint=(torch.empty(1, 2, 20, 128, dtype=BF16, device="cuda").transpose(1, 2),) + good[1:])
        refused("dkv_store", joint=good, dkv_store="tma")  # S_loc 256 a multiple of tile_n, but joint rows
        refused("joint: causal masking", joint=good, causal=True)
        refused("joint djk: overlaps djv", joint=(good[0], good[1], good[1]))
        refused("joint djq: overlaps dout", joint=(args["dout"].narrow(1, 512, 20),) + good[1:])
        refused("joint djv: overlaps k", joint=good[:2] + (args["k"].narrow(1, 512, 20),))
    with pytest.raises(ValueError, match="joint"):
        bwd.compile_bwd_a2a_main("tma", BF16, 128, 1, False, False, False, False, False, joint=True)


def _arity(cls) -> int:
    """The parameters of a kernel class's __call__ but self and stream: what its compiled function loaded from
    the disk cache takes, every one positionally (cute_kernels.compile_cache)."""
    import inspect

    return len([p for p in inspect.signature(cls.__call__).parameters if p not in ("self", "stream")])


def launched_arities(monkeypatch, main_classes, post_class, compile_names, launcher_kwargs, inputs):
    """Run the launcher's launch with strict stand-ins of its compiled kernels (FakeTensorMode, nothing runs on a
    device): -> [(kernel, arguments passed, parameters of the kernel's __call__)] per kernel call."""
    import flash_attn.cute.interface as fa4_interface

    calls = []

    def strict(cls):
        want = _arity(cls)
        return lambda *args, **kw: calls.append((cls.__name__, len(args) + len(kw), want))

    main_name, post_name = compile_names
    monkeypatch.setattr(bwd, main_name, lambda dkv_store, dtype, D, qpk, *a, **kw: strict(main_classes[qpk > 1]))
    monkeypatch.setattr(bwd, post_name, lambda *a, **kw: strict(post_class))
    monkeypatch.setattr(fa4_interface, "_bwd_preprocess", lambda *a, **kw: None)
    monkeypatch.setattr(bwd, "_is_fake", lambda t: False)
    with FakeTensorMode():
        args, sk = _inputs(**inputs)
        J, H_loc = inputs.get("J"), inputs["H_loc"]
        joint = _joint(1, J, H_loc, inputs.get("H_kv") or H_loc) if J else None
        bwd.fa4_bwd_a2a(**args, rank=0, seqused_k=sk, joint=joint, **launcher_kwargs)
    return calls


ARITY_CASES = [  # the kernel set each launch takes: tma / st / GQA, seqused, deterministic, joint rows
    dict(P=2, S_loc=256, H_loc=2),
    dict(P=4, S_loc=100, H_loc=2, seqused=300),
    dict(P=2, S_loc=256, H_loc=4, H_kv=1, seqused=400),
    dict(P=2, S_loc=300, H_loc=2, J=33),
    dict(P=2, S_loc=300, H_loc=4, H_kv=2, J=33),
]


@pytest.mark.parametrize("inputs", ARITY_CASES, ids=str)
@pytest.mark.parametrize("det", [False, True])
def test_every_kernel_is_launched_with_all_its_parameters(monkeypatch, inputs, det):
    """A compiled function loaded from the disk cache takes all its parameters positionally, absent ones as None
    (one passed fewer fails there with "Expects N parameters", never in the process that compiled it)."""
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    from cute_kernels.fa4_bwd_a2a_sm90 import FlashAttentionA2ABackwardPostprocessSm90, FlashAttentionA2ABackwardSm90

    calls = launched_arities(monkeypatch, (FlashAttentionA2ABackwardSm90, FlashAttentionBackwardSm90),
                             FlashAttentionA2ABackwardPostprocessSm90,
                             ("compile_bwd_a2a_main", "compile_bwd_a2a_post"), dict(deterministic=det), inputs)
    assert len(calls) == (4 if inputs.get("H_kv") else 2)
    assert all(passed == want for _, passed, want in calls), calls
