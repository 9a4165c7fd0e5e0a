"""CPU tier: the X-Stage microbenchmark kernel compiles for sm_90a with fake tensors, emits the
store instructions it claims to, and its pattern/reduction helpers are right."""
import pytest
import torch

from cute_kernels.remote_store import (
    PATTERN_CTA_SHIFT,
    RemoteStoreBurst,
    burst_times_ns,
    clock_rate_ghz,
    compile_remote_store,
    expected_words,
)

# instructions each mode must contain (and, for the other mode's store, must not)
COMMON = ["%globaltimer", "%clock64", "%smid", "fma.rn.f32", "red.release.gpu.global.add.s32",
          "ld.global.acquire.gpu.b32", "bar.sync"]
ONLY = {"vector": ["st.global.v4.b32"],
        "bulk": ["cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.commit_group",
                 "cp.async.bulk.wait_group.read"]}


@pytest.mark.parametrize("mode", ["vector", "bulk"])
def test_compiles_and_emits_stores(mode, tmp_path):
    fn = compile_remote_store(mode, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = fn.__ptx__
    assert ".target sm_90a" in ptx
    for ins in COMMON + ONLY[mode]:
        assert ins in ptx, f"{mode}: {ins} missing from the PTX"
    other = "bulk" if mode == "vector" else "vector"
    for ins in ONLY[other]:
        assert ins not in ptx, f"{mode}: unexpected {ins}"


def test_compile_cache_key_is_the_arguments():
    assert compile_remote_store("vector") is compile_remote_store("vector")
    assert compile_remote_store("vector", num_threads=128) is not compile_remote_store("vector")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(mode="tma"), "mode"),
        (dict(num_threads=100), "num_threads"),
        (dict(stage_bytes=1000), "stage_bytes"),
        (dict(bulk_chunk_bytes=3000), "bulk_chunk_bytes"),
        (dict(stage_bytes=16384, bulk_chunk_bytes=16), None),
        (dict(smem_bytes=1024), "smem_bytes"),
    ],
)
def test_config_validation(kwargs, name):
    if name is None:
        RemoteStoreBurst(**kwargs)
        return
    with pytest.raises(ValueError, match=name):
        RemoteStoreBurst(**kwargs)


def test_expected_words():
    seed, k, b = 0x7FFFFFF0, 3, 64  # the seed makes the int32 pattern wrap
    w = expected_words("vector", k, b, seed)
    assert w.dtype == torch.int32 and w.numel() == k * b // 4
    ref = [((seed + (c << PATTERN_CTA_SHIFT) + j + 2**31) % 2**32) - 2**31 for c in range(k) for j in range(b // 4)]
    assert w.tolist() == ref
    wb = expected_words("bulk", 2, 64, 5, stage_bytes=32)  # staging buffer repeats every 8 words
    assert wb.view(2, 16)[:, :8].tolist() == wb.view(2, 16)[:, 8:].tolist()
    assert wb.view(2, 16)[1, 0] - wb.view(2, 16)[0, 0] == 1 << PATTERN_CTA_SHIFT


def test_timestamp_reduction():
    # two CTAs, three bursts; clocks at 2 GHz; issue 100 ns, gap 400 ns, period 500 ns
    k, n = 2, 3
    t = torch.zeros(k, n, 4, dtype=torch.int64)
    for c in range(k):
        for b in range(n):
            start_ns = 1000 + c * 10 + b * 500
            t[c, b] = torch.tensor([start_ns, start_ns + 100, 2 * start_ns + 7, 2 * (start_ns + 100) + 7])
    assert clock_rate_ghz(t) == pytest.approx(2.0)
    issue, period, gap = burst_times_ns(t)
    assert torch.allclose(issue, torch.full((k, n), 100.0, dtype=torch.float64))
    assert torch.allclose(period, torch.full((k, n - 1), 500.0, dtype=torch.float64))
    assert torch.allclose(gap, torch.full((k, n - 1), 400.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="times"):
        clock_rate_ghz(torch.zeros(1, 1, 4, dtype=torch.int64))


def test_calibrate_without_gpu_exits_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from fa_a2a.tools import calibrate

    assert calibrate.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
