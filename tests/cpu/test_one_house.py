"""The one home of logic that was written more than once (issue 43), on CPU: the 16-byte rule
(cute_kernels.limits.aligned16), the fused launch's pacing (fa_a2a.engine.pacing.fused_pacer, the
op's path, which the benchmark's fused_auto takes), the one timing loop (graphs.time_batches with
eager_batch, which the whole-call benchmark times through) and the examples' rank set-up
(examples/_ranks.py)."""
import importlib.util
import itertools
import os
import types

import pytest
import torch

from cute_kernels.limits import ALIGN_BYTES, aligned16, tma_table
from fa_a2a.engine import pacing
from graphs import eager_batch, time_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the 16-byte rule ----------------------------------------------------------------------------
def _spelled_out(t, address=None, dims=None):
    """The rule as the sites wrote it before: every stride of `dims` times the element size, and the base."""
    es, dims = t.element_size(), range(t.dim() - 1) if dims is None else dims
    base = t.data_ptr() if address is None else address
    return t.stride(-1) == 1 and base % 16 == 0 and all(t.stride(d) * es % 16 == 0 for d in dims)


def test_aligned16_is_the_rule_the_sites_spelled_out():
    flat = torch.zeros(4096, dtype=torch.bfloat16)
    shapes = ((2, 3, 8), (3, 1, 16), (5, 4))
    for shape, offset, k in itertools.product(shapes, (0, 1, 8), (0, 1, 2, 3, 8)):
        st = tuple(k * s for s in (12, 4)[-(len(shape) - 1):]) + (1,)  # outer strides of k * 24 and k * 8 bytes
        for t in (flat.as_strided(shape, st, offset), flat.as_strided(shape, st[:-1] + (2,), offset)):
            assert aligned16(t) == _spelled_out(t), (shape, offset, t.stride())
            assert aligned16(t, dims=(0,)) == _spelled_out(t, dims=(0,))
            assert aligned16(t, 0, ()) == (t.stride(-1) == 1)  # address 0, no dims: the last dim alone
    x = torch.randn(2, 8, 4, 16)
    assert aligned16(x) and aligned16(x.transpose(1, 2))
    assert not aligned16(x[..., 1:9]) and not aligned16(x[..., ::2]) and not aligned16(torch.randn(2, 8, 4, 3))
    assert aligned16(x[..., 1:9], x.data_ptr())  # the base as given (a fake tensor's storage offset)
    assert aligned16(torch.zeros(3)) and ALIGN_BYTES == 16  # 1-D: no strides but the last
    table, rows_of_28_bytes = torch.zeros(6, 8), torch.zeros(6, 7)
    assert tma_table(table, table.data_ptr()) and not tma_table(rows_of_28_bytes, rows_of_28_bytes.data_ptr())


# ---- the fused launch's pacing ---------------------------------------------------------------------
@pytest.fixture
def sm90(monkeypatch):
    import cute_kernels.fa4 as fa4

    monkeypatch.setattr(pacing, "sm_count", lambda device: 132)
    monkeypatch.setattr(fa4, "device_arch", lambda q: 90)
    return fa4


def test_fused_pacer_is_pace_path_plan_and_pacer(sm90, monkeypatch):
    q = torch.empty(1, 4096, 3, 128, dtype=torch.bfloat16)  # rank 0 of P 8 at S 32K: H_loc 3, D 128
    decision, pacer = pacing.fused_pacer("auto", lambda: 52.0, q, 4096, 32768, 3, 1, False)
    tile_m, path = pacing.pace_path(q, 4096, 128, False)
    assert path is None
    assert decision == pacing.plan_pacing("auto", lambda: 52.0, q.device, 32768, 3, 1, 128, torch.bfloat16, False,
                                          tile_m, None)
    assert decision.rate_gbps == pytest.approx(pacing.PACE_FRACTION * 52.0)
    assert pacer.tolist() == pacing.launch_pacer(decision, q.device, tile_m, 128, torch.bfloat16).tolist()
    assert pacing.fused_pacer(None, lambda: 52.0, q, 4096, 32768, 3, 1, False) == (pacing.Pacing(None, "pace off"),
                                                                                  None)
    monkeypatch.setattr(sm90, "device_arch", lambda q: 100)
    decision, pacer = pacing.fused_pacer("auto", lambda: 52.0, q, 4096, 32768, 3, 1, False)
    assert pacer is None and decision.reason == "unpaced: the paced kernel is SM90's (this GPU is SM100)"


def test_bench_fused_auto_takes_the_ops_path_and_measures_the_link_once(sm90, monkeypatch, capsys):
    from fa_a2a.tools import bench_methods

    probes, calls = [], []
    monkeypatch.setattr(pacing, "measure_store_rate", lambda windows, rank: probes.append(windows.shape) or 52.0)
    one_path = pacing.fused_pacer
    monkeypatch.setattr(pacing, "fused_pacer", lambda *a, **kw: calls.append((a[2:], kw)) or one_path(*a, **kw))
    cfg = types.SimpleNamespace(real_ranks=False, world_size=8, heads_local=3, batch=1, head_dim=128, causal=False)
    pt = types.SimpleNamespace(cfg=cfg, M=32768, S_loc=4096, dest="host", rank=0, mine=lambda w: w,
                               windows=lambda name, shape=None: torch.empty(8, *(shape or (1, 4096, 24, 128)),
                                                                            device="meta"))
    for i in range(2):  # two input sets of one point
        s = {"i": i, **{n: torch.empty(1, 32768, 3, 128, dtype=torch.bfloat16, device="meta") for n in "qkv"}}
        call, out = bench_methods._build_fused_auto(pt, s)
        assert callable(call) and out.shape[0] == 8
    assert probes == [(8, *pacing.probe_shape(8))]  # measured once per point, where its windows are
    assert [kw for _, kw in calls] == [{"ranks_per_gpu": 1}] * 2 and calls[0][0][1:] == (4096, 32768, 3, 1, False)
    assert capsys.readouterr().out.count("[fused_auto M=32768 host] ") == 1  # the decision printed once


# ---- the one timing loop --------------------------------------------------------------------------
def test_eager_batch_runs_n_calls_over_the_input_sets():
    seen = []
    eager_batch([lambda: seen.append(0), lambda: seen.append(1)], 5)()
    assert seen == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="n_calls"):
        eager_batch(lambda: None, 0)
    with pytest.raises(ValueError, match="expected a callable"):
        eager_batch([], 3)


def test_time_batches_times_batch_and_after_not_before(monkeypatch):
    """CUDA events faked by a clock (ms) that each step moves on: before() is outside the timed
    region, after() inside; the order rotates per trial; warm-up runs are not timed."""
    clock, order = [0.0], []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def step(ms, name=None):
        def run():
            clock[0] += ms
            if name:
                order.append(name)
        return run

    got = time_batches({"a": step(4.0, "a"), "b": step(8.0, "b")}, 4, 3, warmup=1, before=step(100.0),
                       after=step(2.0))
    assert got == {"a": [1500.0] * 3, "b": [2500.0] * 3}  # (batch + after) ms * 1e3 / 4 calls
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then trials 0, 1, 2 rotated
    with pytest.raises(ValueError, match="batches: empty"):
        time_batches({}, 4, 3)
    with pytest.raises(ValueError, match="trials"):
        time_batches({"a": step(1.0)}, 4, 0)


# ---- the examples' rank set-up ---------------------------------------------------------------------
def test_examples_rank_setup_picks_cpu_ranks_over_gloo(monkeypatch):
    spec = importlib.util.spec_from_file_location("_ranks", os.path.join(ROOT, "examples", "_ranks.py"))
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def error(message):
        raise SystemExit(message)

    ap, args = types.SimpleNamespace(error=error), types.SimpleNamespace(device=None)
    assert ranks.pick_device(ap, args) == (2, torch.device("cpu"), "gloo") and args.device == "cpu"
    with pytest.raises(SystemExit, match="^--device cuda: no CUDA GPU found"):
        ranks.pick_device(ap, types.SimpleNamespace(device="cuda"))
