"""CPU tier: the fused SM100 backward (cute_kernels.fa4_bwd_a2a_sm100 through cute_kernels.fa4_bwd_a2a)
compiles for sm_100a with fake tensors, its PTX holds the routed per-thread stores (no TMA store of dK,
dV), the launcher picks FA4's SM100 configuration (2-CTA MMA for D 128 unless FA_DISABLE_2CTA) and
refuses the SM90-only TMA path by name. It has not run on a Blackwell GPU (tests/gpu/test_bwd_a2a.py does
there)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4_bwd_a2a as bwd
from tests.cpu.test_bwd_a2a_compile import ARITY_CASES, _inputs, launched_arities
from tests.cpu.test_fused_compile_sm100 import TMA_STORE, fa4_knobs, sm100  # noqa: F401

BF16 = torch.bfloat16


@pytest.fixture
def compiled(monkeypatch):
    """The SM100 keys the launcher compiles (main kernel, postprocesses), in call order."""
    keys = {"main": [], "post": []}
    main, post = bwd.compile_bwd_a2a_main_sm100, bwd.compile_bwd_a2a_post_sm100
    monkeypatch.setattr(bwd, "compile_bwd_a2a_main_sm100", lambda *k, **kw: keys["main"].append(k) or main(*k, **kw))
    monkeypatch.setattr(bwd, "compile_bwd_a2a_post_sm100", lambda *k, **kw: keys["post"].append(k) or post(*k, **kw))
    return keys


CASES = [
    # D, P, S_loc, H_loc, H_kv, causal, seqused, deterministic, disable_2cta -> the main kernel's dK/dV path
    (128, 2, 256, 2, 2, False, None, False, False, "st"),  # 2-CTA MMA
    (128, 8, 100, 1, 1, True, 700, True, False, "st"),  # a KV block spans ranks, padded keys, deterministic
    (128, 4, 384, 2, 2, False, None, False, True, "st"),  # FA_DISABLE_2CTA: 1-CTA
    (64, 8, 200, 4, 2, False, 1500, True, False, "accum"),  # GQA: FA4's fp32 dK/dV, routed by the postprocess
]


@pytest.mark.parametrize("D,P,S_loc,H_loc,H_kv,causal,seqused,det,no2cta,store", CASES)
def test_compiles_for_sm100_without_gpu(sm100, fa4_knobs, compiled, D, P, S_loc, H_loc, H_kv, causal, seqused,
                                        det, no2cta, store):
    fa4_knobs(disable_2cta=no2cta)
    two_cta = D >= 128 and not no2cta
    with FakeTensorMode():
        args, sk = _inputs(P=P, S_loc=S_loc, H_loc=H_loc, H_kv=H_kv, D=D, seqused=seqused)
        bwd.fa4_bwd_a2a(**args, rank=P - 1, causal=causal, seqused_k=sk, deterministic=det)
    has_sk = seqused is not None
    assert compiled["main"] == [(store, BF16, D, H_loc // H_kv, causal, has_sk, det, two_cta)]
    posts = [(BF16, D, True, two_cta, False)] + ([(BF16, D, False, two_cta, has_sk)] if store == "accum" else [])
    assert compiled["post"] == posts


def test_ptx_shows_the_routed_stores(sm100, fa4_knobs, tmp_path):
    """dK, dV: per-thread 16-byte stores and no TMA store (FA4's default SM100 epilogue stores them by
    TMA: the routed class holds use_tma_store False); dQ's postprocess (2-CTA fragment order and 1-CTA
    tile order) stores 16-byte rows; no local memory."""
    opts = f"--keep-ptx --dump-dir={tmp_path}"
    ours = bwd.compile_bwd_a2a_main_sm100("st", BF16, 128, 1, False, False, False, True, extra_options=opts).__ptx__
    assert ".target sm_100a" in ours and "cta_group::2" in ours
    assert "st.global.v4" in ours and TMA_STORE.format(4) not in ours and TMA_STORE.format(5) not in ours
    assert ".local" not in ours
    for two_cta in (True, False):
        post = bwd.compile_bwd_a2a_post_sm100(BF16, 128, True, two_cta, False, extra_options=opts).__ptx__
        assert "st.global.v4" in post and ".local" not in post


def test_sm100_refusals(sm100):
    from cute_kernels.fa4_bwd_a2a_sm100 import FlashAttentionA2ABackwardSm100

    with FakeTensorMode():
        args, _ = _inputs(P=2, S_loc=256, D=128)
        with pytest.raises(ValueError, match="dkv_store: 'tma' is not 'st', or 'tma' on SM90"):
            bwd.fa4_bwd_a2a_launcher(**args, rank=0, dkv_store="tma")  # SM90's path; SM100 stores per thread
    with pytest.raises(ValueError, match="dkv_store: 'st', or 'accum' exactly when"):
        bwd.compile_bwd_a2a_main_sm100("st", BF16, 128, 2, False, False, False, True)
    with pytest.raises(ValueError, match="qhead_per_kvhead"):
        FlashAttentionA2ABackwardSm100(128, qhead_per_kvhead=2)
    with pytest.raises(ValueError, match="head_dim"):
        FlashAttentionA2ABackwardSm100(80)  # padded to 96: FA4 predicates the columns, the routed store does not


@pytest.mark.parametrize("H_loc,H_kv,seqused", [(2, 2, None), (2, 2, 2 * 300 - 40 + 33), (4, 1, 2 * 300 - 40 + 33)])
def test_joint_rows_compile_and_take_the_routed_joint_kernels(sm100, fa4_knobs, H_loc, H_kv, seqused):
    """Joint rows (N = P * S_loc + J), as on SM90: the routed main kernel (no GQA) and the postprocesses are
    compiled with their joint tensors; GQA keeps FA4's own main kernel and routes them in the postprocesses."""
    from tests.cpu.test_bwd_a2a_compile import _joint

    seen = []

    def spy(name, compile_fn, at):  # records (kernel, its key's argument `at`, the keywords)
        return lambda *key, **kw: seen.append((name, key[at], kw)) or compile_fn(*key, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bwd, "compile_bwd_a2a_main_sm100", spy("main", bwd.compile_bwd_a2a_main_sm100, 0))
        mp.setattr(bwd, "compile_bwd_a2a_post_sm100", spy("post", bwd.compile_bwd_a2a_post_sm100, 2))
        with FakeTensorMode():
            args, sk = _inputs(P=2, S_loc=300, H_loc=H_loc, H_kv=H_kv, seqused=seqused, J=33)
            bwd.fa4_bwd_a2a(**args, rank=1, seqused_k=sk, joint=_joint(1, 33, H_loc, H_kv))
    gqa = H_loc > H_kv
    want = [("main", "accum" if gqa else "st", {} if gqa else {"joint": True}), ("post", True, {"joint": True})]
    if gqa:
        want.append(("post", False, {"joint": True}))
    assert seen == want


def test_ptx_of_the_joint_routing(sm100, fa4_knobs, tmp_path):
    """The joint build's dK/dV epilogue and postprocess store rows to the joint tensors too: more 16-byte
    stores than the build without, still no TMA store and no local memory."""
    opts = f"--keep-ptx --dump-dir={tmp_path}"
    for two_cta in (True, False):
        key = ("st", BF16, 128, 1, False, True, False, two_cta)
        plain = bwd.compile_bwd_a2a_main_sm100(*key, extra_options=opts).__ptx__
        joint = bwd.compile_bwd_a2a_main_sm100(*key, joint=True, extra_options=opts).__ptx__
        assert joint.count("st.global.v4") > plain.count("st.global.v4") > 0, two_cta
        assert TMA_STORE.format(4) not in joint and TMA_STORE.format(5) not in joint and ".local" not in joint
        post = bwd.compile_bwd_a2a_post_sm100(BF16, 128, True, two_cta, False, extra_options=opts).__ptx__
        post_joint = bwd.compile_bwd_a2a_post_sm100(BF16, 128, True, two_cta, False, joint=True,
                                                    extra_options=opts).__ptx__
        assert post_joint.count("st.global.v4") > post.count("st.global.v4") > 0, two_cta


def test_scratch_rounds_as_fa4_does_for_2cta():
    """2-CTA MMA: the KV rows rounded to an even number of 128-row blocks, the dQ semaphores per CTA."""
    with FakeTensorMode():
        s = bwd._scratch(1, 384, 4, 2, 128, 128, 128, True, True, "cuda", cluster=2)
    assert s.dq_accum.shape == (1, 4, 384 * 128) and s.dq_sem.shape == (1, 4, 3, 2)
    assert s.dk_accum.shape == (1, 2, 512 * 128) and s.dk_sem.shape == (1, 2, 4, 2)


@pytest.mark.parametrize("inputs", ARITY_CASES, ids=str)
def test_every_sm100_kernel_is_launched_with_all_its_parameters(sm100, fa4_knobs, monkeypatch, inputs):
    """As on SM90 (tests.cpu.test_bwd_a2a_compile): a kernel loaded from the disk cache takes every parameter."""
    from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100

    from cute_kernels.fa4_bwd_a2a_sm100 import (FlashAttentionA2ABackwardPostprocessSm100,
                                                FlashAttentionA2ABackwardSm100)

    calls = launched_arities(monkeypatch, (FlashAttentionA2ABackwardSm100, FlashAttentionBackwardSm100),
                             FlashAttentionA2ABackwardPostprocessSm100,
                             ("compile_bwd_a2a_main_sm100", "compile_bwd_a2a_post_sm100"), {}, inputs)
    assert len(calls) == (4 if inputs.get("H_kv") else 2)
    assert all(passed == want for _, passed, want in calls), calls
