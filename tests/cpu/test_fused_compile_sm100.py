"""CPU tier: FA4's SM100 forward and the rank-window subclass compile for sm_100a with fake tensors.

The CuTe DSL reads CUTE_DSL_ARCH into its environment object once, but reads that object's `arch`
on every kernel construction and compile, so the `sm100` fixture retargets it (and restores
sm_90a after). FA4's persistent schedulers ask the driver for the SM count while tracing; the
fixture answers for a B200 (148 SMs). The PTX is read back for what the design relies on.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels import fa4 as fused

B200_SMS = 148


class _B200Info:
    """cutlass.utils.HardwareInfo without a driver: the SM count of a B200."""

    def __init__(self, *args, **kwargs):
        pass

    def get_device_multiprocessor_count(self):
        return B200_SMS

    def get_max_active_clusters(self, cluster_size):
        return B200_SMS // cluster_size


@pytest.fixture
def sm100():
    import cutlass.utils
    import flash_attn.cute.tile_scheduler as tile_scheduler
    from cutlass.cutlass_dsl import BaseDSL

    env = BaseDSL._get_dsl().envar
    saved = env.arch, cutlass.utils.HardwareInfo, tile_scheduler.HardwareInfo
    env.arch = "sm_100a"
    cutlass.utils.HardwareInfo = tile_scheduler.HardwareInfo = _B200Info
    try:
        yield
    finally:
        env.arch, cutlass.utils.HardwareInfo, tile_scheduler.HardwareInfo = saved


@pytest.fixture
def fa4_knobs(monkeypatch):
    """Set FA4's forward knobs (FA_DISABLE_2CTA, FA_CLC) as its environment variables would."""
    from flash_attn.cute import utils

    def set_knobs(disable_2cta=False, clc=False):
        monkeypatch.setattr(utils, "_fa_disable_2cta_enabled", disable_2cta)
        monkeypatch.setattr(utils, "_fa_disable_2cta_cuda12", False)
        monkeypatch.setattr(utils, "_fa_clc_enabled", clc)

    set_knobs()
    return set_knobs


def _fake(P, B, S_loc, H_loc, D, dtype=torch.bfloat16, kv_heads=None):
    q = torch.empty(B, P * S_loc, H_loc, D, dtype=dtype, device="cuda")
    kv = torch.empty(B, P * S_loc, kv_heads or H_loc, D, dtype=dtype, device="cuda")
    windows = torch.empty(P, B, S_loc, P * H_loc, D, dtype=dtype, device="cuda")
    return q, kv, windows


def _ptx(tmp_path, kind, q, kv, windows, causal, rank=1, lse=None, seqused_k=None):
    H_loc = q.shape[2]
    cfg = fused._config_sm100(q.shape[-1], causal, q.shape[1], H_loc // kv.shape[2], seqused_k is not None)
    compiled = fused.compile_fa4(kind, q.dtype, q.shape[-1], H_loc // kv.shape[2], causal, seqused_k is not None,
                                 lse is not None, sm100=cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = compiled.__ptx__
    assert ptx and ".target sm_100a" in ptx
    return ptx


TMA_STORE = "cp.async.bulk.tensor.{}d.global.shared::cta"


@pytest.mark.parametrize("D,causal,disable_2cta,two_cta", [
    (128, False, False, True),  # 2-CTA MMA, static persistent scheduler
    (128, False, True, False),  # the same with FA4's 2-CTA off (1-CTA)
    (64, True, False, False),  # causal: LPT scheduler, not persistent
])
def test_tma_path_stores_o_through_one_5d_descriptor(sm100, fa4_knobs, tmp_path, D, causal, disable_2cta,
                                                      two_cta):
    fa4_knobs(disable_2cta=disable_2cta)
    with FakeTensorMode():
        q, kv, windows = _fake(4, 1, 384, 3, D)
        cfg = fused._config_sm100(D, causal, q.shape[1], 1, False)
        assert cfg.use_2cta_instrs == two_cta and cfg.q_stage == 2
        ours = _ptx(tmp_path, "a2a-tma", q, kv, windows, causal)
        fa4 = _ptx(tmp_path, "fa4", q, kv, windows, causal)
    # FA4 stores O (s, d, h, b) with a 4-D TMA; the rank window adds the rank mode: 5-D, one
    # bulk group per Q stage, waited for with .read only (never for the remote writes)
    assert ours.count(TMA_STORE.format(5)) == fa4.count(TMA_STORE.format(4)) > 0
    assert TMA_STORE.format(4) not in ours
    assert ours.count("cp.async.bulk.commit_group") == fa4.count("cp.async.bulk.commit_group") == 2
    assert "cp.async.bulk.wait_group.read" in ours and "cp.async.bulk.wait_group " not in ours
    assert "st.global.v4" not in ours
    assert ("cta_group::2" in ours) == two_cta
    assert ".local" not in ours


@pytest.mark.parametrize("D,causal,S_loc", [(128, False, 320), (64, True, 200), (128, False, 32)])
def test_st_path_streams_16_byte_stores(sm100, fa4_knobs, tmp_path, D, causal, S_loc):
    # S_loc % 128 != 0: stages straddle rank boundaries (S_loc = 32: a stage spans 4 ranks, and
    # S = 128 gives FA4's one-stage S ping-pong configuration)
    with FakeTensorMode():
        q, kv, windows = _fake(4, 1, S_loc, 2, D)
        ptx = _ptx(tmp_path, "a2a-st", q, kv, windows, causal)
    assert "st.global.v4" in ptx and "ld.shared.v4" in ptx
    assert TMA_STORE.format(5) not in ptx and TMA_STORE.format(4) not in ptx
    # one chunk in registers at a time: no local memory (the whole-stage copy would spill)
    assert ".local" not in ptx


def test_public_entry_points_compile_for_sm100(sm100, fa4_knobs, monkeypatch):
    cfgs, compile_fa4 = {}, fused.compile_fa4

    def spy(*key, sm100=None, **kw):
        cfgs[key] = sm100
        return compile_fa4(*key, sm100=sm100, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    fa4_knobs(clc=True)  # FA4 uses CLC for causal when FA_CLC=1
    with FakeTensorMode():
        # LSE and seqused_k (2-CTA), GQA with CLC (causal), straddling fp16, plain FA4
        q, kv, windows = _fake(4, 2, 256, 2, 128)
        lse_windows = torch.empty(4, 2, 8, 256, dtype=torch.float32, device="cuda")
        seqused = torch.empty(2, dtype=torch.int32, device="cuda")
        fused.fa4_a2a_forward(q, kv, kv, windows, 3, lse_windows=lse_windows, seqused_k=seqused)
        q, kv, windows = _fake(2, 1, 512, 4, 128, kv_heads=1)
        fused.fa4_a2a_forward(q, kv, kv, windows, 0, causal=True)
        q, kv, windows = _fake(8, 1, 100, 1, 64, dtype=torch.float16)
        fused.fa4_a2a_forward(q, kv, kv, windows, 7)
        fused.fa4_forward(q, kv, kv)
    lse_key = ("a2a-tma", torch.bfloat16, 128, 1, False, True, True)
    assert cfgs[lse_key].use_2cta_instrs
    gqa_key = ("a2a-tma", torch.bfloat16, 128, 4, True, False, False)
    assert cfgs[gqa_key].use_clc_scheduler and not cfgs[gqa_key].use_2cta_instrs
    assert ("a2a-st", torch.float16, 64, 1, False, False, False) in cfgs
    assert ("fa4", torch.float16, 64, 1, False, False, False) in cfgs


def test_sm100_dispatch_and_refusals(sm100):
    with FakeTensorMode():
        q, kv, windows = _fake(4, 1, 200, 2, 128)
        assert fused.device_arch(q) == 100
        assert fused.tile_m_for(64, arch=100) == 128
        lse_windows = torch.empty(4, 1, 8, 200, dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError, match="lse_windows: on SM100 S_loc must be a multiple of 128, got 200"):
            fused.fa4_a2a_forward(q, kv, kv, windows, 0, lse_windows=lse_windows)
        with pytest.raises(ValueError, match="o_store: 'tma' is not"):
            fused.fa4_a2a_forward(q, kv, kv, windows, 0, o_store="tma")
        ts = torch.empty(1, 2, 7, 7, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match="timestamps: the stamped debug build is SM90 only"):
            fused.fa4_a2a_forward(q, kv, kv, windows, 0, timestamps=ts)


def test_sm90_target_after_sm100():
    with FakeTensorMode():
        q, _, _ = _fake(2, 1, 128, 2, 128)
        assert fused.device_arch(q) == 90



def _lse_tile_offsets(capfd, s_loc, window_stride, P, B, H, b, h):
    """{row: element offset} that FA4's correction warps write through the kernel's LSE row
    tensor: FA4's (b, h, s) -> (s, h, b) transpose, then 128-row tiles (flash_fwd_sm100), with the
    layout algebra (dynamic s_loc and window stride, as in the kernel) run by the CuTe DSL on the host."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_kernels.fa4_a2a_sm100 import lse_rows

    @cute.jit
    def probe(s_loc: Int32, w: Int32):
        ptr = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=4)
        windows = cute.make_tensor(ptr, cute.make_layout((P, B, H, s_loc), stride=(w, H * s_loc, s_loc, 1)))
        m = lse_rows(windows)
        m = cute.make_tensor(m.iterator, cute.select(m.layout, mode=[2, 1, 0]))[None, h, b]
        for t in cutlass.range((s_loc * P + 127) // 128, unroll=1):
            g = cute.local_tile(m, (128,), (t,))
            for i in cutlass.range(128, unroll=1):
                if t * 128 + i < s_loc * P:
                    cute.printf("lse-row %d %d\n", t * 128 + i, (g.iterator + cute.crd2idx((i,), g.layout)).toint() // 4)

    capfd.readouterr()
    probe(s_loc, window_stride)
    out = capfd.readouterr().out
    return {int(r): int(o) for _, r, o in (line.split() for line in out.splitlines() if line.startswith("lse-row "))}


@pytest.mark.parametrize("s_loc,exact", [(256, True), (384, True), (320, False), (200, False)])
def test_lse_row_tiles_are_exact_only_for_whole_stages(capfd, s_loc, exact):
    # why fa4_a2a_forward refuses lse_windows on SM100 unless 128 divides S_loc
    P, B, H, b, h, W = 4, 2, 3, 1, 2, 1 << 20
    got = _lse_tile_offsets(capfd, s_loc, W, P, B, H, b, h)
    assert sorted(got) == list(range(P * s_loc))
    expected = {s: (s // s_loc) * W + b * H * s_loc + h * s_loc + s % s_loc for s in got}
    assert (got == expected) == exact


def _kernel_params(ptx: str) -> int:
    return ptx.count(".param .")


@pytest.mark.parametrize("S_loc,disable_2cta,persistent,o_store,lse,compare", [
    (384, False, True, "tma", True, True),  # 2-CTA static persistent (512-row work tiles straddle), LSE
    (384, True, True, "tma", False, False),  # 1-CTA
    (320, False, True, "st", False, False),  # stages straddle ranks
    (32, False, True, "st", False, False),  # S = 128: one Q stage, S ping-pong
    (384, False, False, "tma", False, True),  # FA4's single-tile scheduler over 2-CTA clusters
])
def test_rotated_builds_compile(sm100, fa4_knobs, tmp_path, S_loc, disable_2cta, persistent, o_store, lse, compare):
    fa4_knobs(disable_2cta=disable_2cta)
    cfg = fused._config_sm100(128, False, 4 * S_loc, 1, False)._replace(is_static_persistent=persistent)
    key = (f"a2a-{o_store}", torch.bfloat16, 128, 1, False, False, lse)
    opts = f"--keep-ptx --dump-dir={tmp_path}"
    on = fused.compile_fa4(*key, rotate=True, sm100=cfg, extra_options=opts).__ptx__
    assert ".target sm_100a" in on and ".local" not in on
    if compare:
        # the rotated kernel takes its scheduler's block shift (and, persistent, the cluster count)
        off = fused.compile_fa4(*key, sm100=cfg, extra_options=opts).__ptx__
        assert _kernel_params(on) == _kernel_params(off) + (2 if persistent else 1)


def test_rotation_on_sm100_public_path_and_refusals(sm100, fa4_knobs, monkeypatch):
    rotates, compile_fa4 = [], fused.compile_fa4

    def spy(*key, rotate=False, **kw):
        rotates.append((key, rotate))
        return compile_fa4(*key, rotate=rotate, **kw)

    monkeypatch.setattr(fused, "compile_fa4", spy)
    with FakeTensorMode():
        q, kv, windows = _fake(8, 1, 256, 3, 128)
        fused.fa4_a2a_forward(q, kv, kv, windows, 5, rotate=True)
        assert rotates == [(("a2a-tma", torch.bfloat16, 128, 1, False, False, False), True)]
        with pytest.raises(ValueError, match="rotate: the rank-rotated tile order is for non-causal"):
            fused.fa4_a2a_forward(q, kv, kv, windows, 5, causal=True, rotate=True)
        # FA_CLC with GQA and seqused_k: FA4 takes its CLC (LPT) scheduler even when non-causal
        fa4_knobs(clc=True)
        q, kv, windows = _fake(2, 1, 512, 4, 128, kv_heads=1)
        seqused = torch.empty(1, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="rotate: needs FA4's SingleTileScheduler or StaticPersistent"):
            fused.fa4_a2a_forward(q, kv, kv, windows, 0, seqused_k=seqused, rotate=True)
    from cute_kernels.fa4_a2a_sm100 import FlashAttentionA2AForwardSm100

    cfg = fused._config_sm100(128, True, 1024, 1, False)
    with pytest.raises(ValueError, match="rotate: the rank-rotated order is for non-causal"):
        fused._make_kernel_sm100(FlashAttentionA2AForwardSm100, 128, 1, True, cfg, rotate=True)
