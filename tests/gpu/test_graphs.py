"""graphs.timing on a GPU: known-duration workloads time sanely, replays compute what eager calls
compute (each input set, the right number of times), the barrier bounds every replay, and eager
wall time covers the GPU work (and exceeds the graph time when the host path dominates)."""
import pytest
import torch

from graphs import GpuClockMonitor, capture, time_eager, time_graphs


def _sleep_fn(cycles):
    return lambda: torch.cuda._sleep(cycles)


def test_sleep_kernel_times_scale_and_match_the_clock():
    # torch.cuda._sleep spins for a number of SM clock cycles: 1e6 cycles ~ 505 us at 1.98 GHz.
    c = 1_000_000
    mon = GpuClockMonitor()
    t = time_graphs({"one": _sleep_fn(c), "two": _sleep_fn(2 * c)}, n_calls=8, trials=7, warmup=2, monitor=mon)
    assert set(t) == {"one", "two"} and all(len(v) == 7 for v in t.values())
    one, two = sorted(t["one"])[3], sorted(t["two"])[3]
    assert 1.8 < two / one < 2.2, (one, two)
    assert c / 2500 < one < c / 500, one  # any SM clock between 0.5 and 2.5 GHz
    if mon.available:
        clocks = [s[0] for v in mon.samples.values() for s in v]
        assert len(clocks) == 14 and all(300 < x < 3000 for x in clocks)
        expect = c / (sum(clocks) / len(clocks))  # us at the sampled clock
        assert 0.85 * expect < one < 1.15 * expect, (one, expect, clocks)


def test_matmul_chain_throughput_is_sane():
    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    out, tmp = torch.empty_like(a), torch.empty_like(a)

    def chain():  # 4 matmuls of n^3: 2 * 4 * n^3 flops
        torch.matmul(a, b, out=tmp)
        torch.matmul(tmp, b, out=out)
        torch.matmul(out, b, out=tmp)
        torch.matmul(tmp, b, out=out)

    t = time_graphs({"chain": chain}, n_calls=10, trials=5, warmup=2)["chain"]
    us = sorted(t)[2]
    tflops = 8 * n**3 / (us * 1e-6) / 1e12
    # H100/H200 dense bf16 peak ~989 TFLOP/s; anything but a broken timer lands well inside this
    assert 50 < tflops < 1000, (us, tflops)
    assert max(t) / min(t) < 1.5, t
    assert torch.isfinite(out).all()


def test_replay_equals_eager_for_every_input_set():
    # Small integers: every product and sum is exact in fp32, so any matmul algorithm gives the
    # same bits and eager vs. replay must agree exactly.
    k_sets, n_calls = 3, 6  # every set is called twice per replay
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randint(-3, 4, (256, 128), device="cuda", generator=g).float() for _ in range(k_sets)]
    ws = [torch.randint(-3, 4, (128, 64), device="cuda", generator=g).float() for _ in range(k_sets)]
    acc = [torch.full((256, 64), float("nan"), device="cuda") for _ in range(k_sets)]
    fns = [lambda i=i: acc[i].add_(xs[i] @ ws[i]) for i in range(k_sets)]
    ref = [(x.cpu().double() @ w.cpu().double()).float() for x, w in zip(xs, ws)]

    graph = capture(fns, n_calls, eager_warmup=1)
    for a in acc:  # the eager warm-up ran each set once; start from zero
        a.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for i in range(k_sets):  # 2 replays x 2 calls per set
        assert torch.equal(acc[i].cpu(), 4 * ref[i]), i
    eager = [torch.zeros_like(a) for a in acc]
    for _ in range(4):
        for i in range(k_sets):
            eager[i].add_(xs[i] @ ws[i])
    for i in range(k_sets):
        assert torch.equal(acc[i], eager[i]), i


def test_barrier_once_per_replay_before_and_after():
    calls = []
    out = torch.zeros(1, device="cuda")
    t = time_graphs({"a": lambda: out.add_(1), "b": lambda: out.add_(2)}, n_calls=5, trials=4, warmup=3,
                    barrier=lambda: calls.append(1))
    # one untimed barrier before and one timed barrier after each (warm-up or timed) replay
    assert len(calls) == 2 * 2 * (3 + 4)
    assert all(x > 0 for v in t.values() for x in v)
    torch.cuda.synchronize()
    # each replay runs 5 calls; eager warm-up inside capture ran each once
    assert out.item() == (1 + 2) * (1 + 5 * (3 + 4))


def test_after_capture_runs_between_capture_and_replays():
    out = torch.zeros(4, device="cuda")
    seen = []

    def poison():
        seen.append(out.clone())
        out.fill_(float("nan"))

    time_graphs({"w": lambda: out.copy_(torch.arange(4.0, device="cuda"))}, n_calls=2, trials=1, warmup=0,
                after_capture=poison)
    assert len(seen) == 1 and torch.equal(seen[0].cpu(), torch.arange(4.0))  # the eager warm-up's result
    assert torch.equal(out.cpu(), torch.arange(4.0))  # written again by the replays


def test_clock_monitor_reads_the_gpu():
    pytest.importorskip("pynvml")
    mon = GpuClockMonitor()
    assert mon.available, mon.reason
    clock, temp = mon.sample("x")
    assert 100 < clock < 3000 and 0 < temp < 120
    assert mon.device_info().get("max_sm_clock_mhz", 0) >= clock


def test_eager_wall_time_covers_gpu_work_and_shows_host_cost():
    c = 1_000_000  # ~0.5 ms of GPU time per call: GPU-bound, eager ~ graph
    g = sorted(time_graphs({"s": _sleep_fn(c)}, n_calls=4, trials=3, warmup=1)["s"])[1]
    e = sorted(time_eager({"s": _sleep_fn(c)}, n_calls=4, trials=3)["s"])[1]
    assert 0.97 * g < e < 1.5 * g, (g, e)
    x = torch.zeros(1, device="cuda")
    calls = []
    fns = [lambda: (calls.append(1), x.add_(1)), lambda: (calls.append(2), x.add_(2))]
    t = time_eager({"tiny": fns}, n_calls=50, trials=2)
    assert calls == [1, 2] * 50  # 2 trials of 50 calls, call i runs fn[i % k]
    torch.cuda.synchronize()
    assert x.item() == 50 * 1 + 50 * 2
    g = sorted(time_graphs({"tiny": lambda: x.add_(1)}, n_calls=50, trials=3, warmup=1)["tiny"])[1]
    assert min(t["tiny"]) > g  # a ~2 us kernel launched from Python costs more than its replay
