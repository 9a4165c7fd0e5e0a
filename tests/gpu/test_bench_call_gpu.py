"""The whole-call benchmark (fa_a2a.tools.bench_call) on two processes sharing GPU 0 over a gloo group: a
small point runs every method but NCCL (skipped with its reason), times them, and breaks the fused
call down on both ranks. Under an MPS daemon (python -m fa_a2a.mps -- python -m pytest ...) the
ranks' kernels overlap; without one they time-slice the GPU: slower, the same checks."""
import torch

from tests.multiproc import run_on_gloo_groups

M = 1024


def _point(P, group, rank):
    from fa_a2a.tools import bench, bench_call as bc

    cfg = bench.parse_args(["-M", str(M), "--heads", "8", "--trials", "2", "--warmup", "0", "--calls", "3"],
                           env={"WORLD_SIZE": str(P)})
    ctx = {"rank": rank, "group": group, "device": torch.device("cuda", 0), "shared_gpu": True}
    p = bc.run_call_point(cfg, M, ctx, bench._Log(rank))
    assert p["status"] == {"nccl": bc.NCCL_SHARED}, p["status"]
    ran = {"fa4_local", "fa4_aligned", "pre_a2a", "serial", "fused", "fused_unpaced", "fused_st", "auto", "qkv_gemm",
           "block"}
    assert set(p["median_us"]) == ran and all(t > 0 for t in p["median_us"].values()), p["median_us"]
    assert set(p["eager_us"]) == ran and p["n_calls"] == 3
    assert p["finite"] == {k: True for k in ("serial", "fused", "fused_unpaced", "fused_st", "auto", "block")}
    assert p["auto"], "impl 'auto' decided at its first call and said how"
    assert p["timing_mode"] in ("cuda-graph", "eager") and (p["timing_mode"] == "eager") == bool(p["capture_error"])
    assert p["ratios"]["call_over_local"] > 0 and p["ratios"]["block_over_local_paired"] > 0
    assert p["ratios"]["call_over_aligned_paired"] > 0 and p["ratios"]["block_over_aligned_paired"] > 0
    b = p["breakdown"]
    assert [r["rank"] for r in b["ranks"]] == [0, 1]
    for row in b["ranks"]:
        assert all(row[ph] >= 0 for ph in bc.PHASES) and row["attend"] > 0 and row["launch"] > 0
        assert row["coverage"] == row["sum"] / b["call_eager_us"] > 0
    if rank == 0:
        print(bc.format_call_table([p]), bc.format_breakdown([p]), sep="\n")


def test_whole_call_point_on_two_processes_sharing_the_gpu():
    from ulysses.transport import close_transports

    run_on_gloo_groups(_point, (2,), cuda=True, timeout_s=600, teardown=close_transports)
