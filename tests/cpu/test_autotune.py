"""impl="auto" (fa_a2a.engine.autotune): the decision from injected timings, its agreement across ranks,
its record on disk, forcing it, and the op's default on CPU gloo ranks (the one candidate there)."""

import dataclasses
import json
import logging

import pytest
import torch

from fa_a2a.engine import autotune
from fa_a2a.engine.problem import check_call, split_impl


class FakeTransport:
    """host_allgather returns the given per-rank values for each step (this rank's value at `rank`)."""

    def __init__(self, others: dict, rank: int = 0, world_size: int = 2):
        self.others, self.rank, self.world_size = others, rank, world_size
        self.device, self.ranks_per_gpu = torch.device("cpu"), 1
        self.steps = []

    def host_allgather(self, step, value):
        self.steps.append(step)
        values = list(self.others.get(step, [value] * self.world_size))
        values[self.rank] = value
        return values


def _problem(S_loc=256, world_size=2, impl="auto", D=128):
    """The Problem of a bf16 CUDA call (fake tensors: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, S_loc, 4, D, dtype=torch.bfloat16, device="cuda")
        problem, _ = check_call(q, q, q, None, impl, False, None, None, world_size, pace="auto")
    return problem


def test_choose_takes_the_fastest_by_its_slowest_rank():
    label, worst = autotune.choose([{"fused:tma": 1.0, "fused:st": 0.9, "serial": 1.5},
                                    {"fused:tma": 1.4, "fused:st": 0.95, "serial": 1.2}])
    assert label == "fused:st"
    assert worst == {"fused:tma": 1.4, "fused:st": 0.95, "serial": 1.5}
    assert autotune.choose([{"serial": 1.0, "nccl": 0.5}])[0] == "nccl"


def test_ties_go_to_fused():
    # serial 0.5% faster than fused:tma: a tie, fused wins; st 2% faster: st wins
    assert autotune.choose([{"fused:tma": 1.0, "serial": 0.995}])[0] == "fused:tma"
    assert autotune.choose([{"fused:tma": 1.0, "fused:st": 0.98, "serial": 0.995}])[0] == "fused:st"
    assert autotune.choose([{"fused:tma": 1.0, "fused:st": 1.0}])[0] == "fused:tma"


def test_ranks_with_different_local_timings_agree():
    ranks = [{"fused:tma": 1.0 + 0.1 * r, "fused:st": 1.2 - 0.05 * r, "serial": 1.3} for r in range(4)]
    picks = set()
    for r in range(4):  # every rank gets every rank's times (host_allgather): the same choice
        everyone = [ranks[(r + i) % 4] for i in range(4)]  # any order of the ranks
        picks.add(autotune.choose(everyone)[0])
    assert picks == {"fused:st"}  # tma's slowest rank 1.3 against st's 1.2


def test_candidates_and_static_rule():
    assert autotune.candidates(256, 128, False) == ("fused:tma", "fused:st", "serial")
    assert autotune.candidates(320, 128, True) == ("fused:st", "serial", "nccl")
    assert autotune.static_label(256, 128) == "fused:tma"
    assert autotune.static_label(320, 128) == "fused:st"


def test_impl_values():
    assert split_impl("auto") == ("auto", None)
    assert split_impl("fused:st") == ("fused", "st")
    for bad in ("fused:x", "magic", None, 3):
        with pytest.raises(ValueError, match="impl: expected one of"):
            split_impl(bad)
    p = _problem(impl="fused:tma")
    assert (p.impl, p.o_store) == ("fused", "tma")
    with pytest.raises(ValueError, match="impl: 'fused:tma' needs S_loc a multiple of the tile's 128 rows"):
        _problem(S_loc=320, impl="fused:tma")
    assert _problem(S_loc=320, impl="fused:st").o_store == "st"
    auto = _problem()
    assert autotune.concrete(auto, "serial").pace is None and autotune.concrete(auto, "fused:st").pace == "auto"
    assert autotune.concrete(auto, "fused:st").o_store == "st"


def test_forced_label_is_validated_by_name():
    assert autotune.forced_label({}) is None
    assert autotune.forced_label({"FA_A2A_IMPL": ""}) is None
    assert autotune.forced_label({"FA_A2A_IMPL": "fused:st"}) == "fused:st"
    for bad in ("auto", "fast", "fused:"):
        with pytest.raises(ValueError, match="FA_A2A_IMPL: expected one of"):
            autotune.forced_label({"FA_A2A_IMPL": bad})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_A2A_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA_A2A_IMPL", raising=False)
    return tmp_path


def _decide(problem, transport, times, calls, labels=("fused:tma", "fused:st", "serial")):
    """autotune.decide with injected local timings (time_candidates replaced): calls records the runs."""
    def fake_time(labels_, run, device, trials=autotune.TRIALS):
        calls.append(tuple(labels_))
        return dict(times)

    orig = autotune.time_candidates
    autotune.time_candidates = fake_time
    try:
        return autotune.decide(problem, transport, lambda label: None, labels, "fused:tma")
    finally:
        autotune.time_candidates = orig


def test_measured_then_read_back_from_disk(cache, caplog):
    p, calls = _problem(), []
    t = FakeTransport({"fa_a2a impl auto times": [None, {"fused:tma": 2.0, "fused:st": 1.1, "serial": 1.5}]})
    with caplog.at_level(logging.INFO, logger="fa_a2a.engine.autotune"):
        choice = _decide(p, t, {"fused:tma": 1.0, "fused:st": 1.0, "serial": 1.4}, calls)
    assert (choice.label, choice.source) == ("fused:st", "measured")  # tma's slow rank 1 decides
    assert choice.times == {"fused:tma": 2.0, "fused:st": 1.1, "serial": 1.5}
    assert "fused:st, measured" in caplog.text
    files = list((cache / "impl").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["label"] == "fused:st"
    # a second process: the record is read, nothing measured
    calls.clear()
    again = _decide(p, FakeTransport({}), {"fused:tma": 0.1}, calls)
    assert (again.label, again.source) == ("fused:st", "disk") and calls == []


def test_a_rank_without_the_record_makes_every_rank_measure(cache):
    p, calls = _problem(), []
    _decide(p, FakeTransport({}), {"fused:tma": 1.0, "fused:st": 2.0, "serial": 3.0}, calls)
    calls.clear()
    t = FakeTransport({"fa_a2a impl auto": [None, (None, None)]})  # rank 1 has no record
    choice = _decide(p, t, {"fused:tma": 3.0, "fused:st": 2.0, "serial": 1.0}, calls)
    assert choice.source == "measured" and choice.label == "serial" and len(calls) == 1


def test_a_record_of_another_machine_or_driver_is_ignored(cache, monkeypatch):
    p, calls = _problem(), []
    _decide(p, FakeTransport({}), {"fused:tma": 1.0, "fused:st": 2.0, "serial": 3.0}, calls)
    key = autotune.record_key(p, FakeTransport({}))
    assert autotune.read_record(key, autotune.LABELS).label == "fused:tma"
    for field, value in (("gpu", "another GPU"), ("driver", "12080"), ("world_size", "4")):
        assert autotune.read_record(dict(key, **{field: value}), autotune.LABELS) is None
    # a record file copied under this key from elsewhere (its own key inside differs): ignored
    path = autotune._record_file(key)
    data = json.loads(path.read_text())
    data["key"]["gpu"] = "another GPU"
    path.write_text(json.dumps(data))
    assert autotune.read_record(key, autotune.LABELS) is None
    # the label no longer applies (e.g. S_loc's tile rule): ignored
    autotune.write_record(key, autotune.Choice("nccl", "measured", {"nccl": 1.0}))
    assert autotune.read_record(key, ("fused:st", "serial")) is None
    monkeypatch.setenv("FA_A2A_CACHE", "0")
    assert autotune.read_record(key, autotune.LABELS) is None
    assert autotune.clear_records() == 1


def test_forced_impl_wins_and_must_agree(cache, monkeypatch):
    p, calls = _problem(), []
    monkeypatch.setenv("FA_A2A_IMPL", "serial")
    choice = _decide(p, FakeTransport({}), {"fused:tma": 1.0}, calls)
    assert (choice.label, choice.source, calls) == ("serial", "forced", [])
    monkeypatch.setenv("FA_A2A_IMPL", "fused")
    assert _decide(p, FakeTransport({}), {}, calls).label == "fused:tma"  # fused: the static rule
    monkeypatch.setenv("FA_A2A_IMPL", "nccl")
    with pytest.raises(ValueError, match="FA_A2A_IMPL: 'nccl' does not run this call"):
        _decide(p, FakeTransport({}), {}, calls)
    monkeypatch.setenv("FA_A2A_IMPL", "serial")
    t = FakeTransport({"fa_a2a impl auto": [None, (None, None)]})
    with pytest.raises(ValueError, match="FA_A2A_IMPL: expected the same value on every rank, got rank 0: "
                                         "'serial', rank 1: None"):
        _decide(p, t, {}, calls)


def test_one_candidate_is_not_timed(cache):
    calls = []
    choice = _decide(_problem(), FakeTransport({}), {}, calls, labels=("fused:st",))
    assert (choice.label, choice.source, calls) == ("fused:st", "only", [])


def test_record_key_holds_the_signature_not_the_impl():
    t = FakeTransport({})
    a = autotune.record_key(_problem(), t)
    assert a == autotune.record_key(dataclasses.replace(_problem(), impl="fused"), t)
    assert a != autotune.record_key(_problem(S_loc=512), t)
    assert a["world_size"] == "2" and a["transport"] == "FakeTransport" and a["gpu"] == "cpu"


# ---- the default impl on CPU: real gloo ranks (nccl) and emulated ranks (reference) ----------------
def _check_default_impl(P, group, rank):
    from fa_a2a import ulysses_attention

    g = torch.Generator().manual_seed(7)
    qkv = [torch.randn(1, 4 * P, 4, 8, generator=g) for _ in range(3)]
    mine = [x.chunk(P, dim=1)[rank] for x in qkv]
    out = ulysses_attention(*mine, group=group)  # impl "auto": nccl, the one candidate on CPU tensors
    assert torch.equal(out, ulysses_attention(*mine, group=group, impl="nccl"))
    assert any(c.label == "nccl" and c.source == "static" for c in autotune.decisions().values())


def test_default_impl_on_cpu_ranks():
    from tests.multiproc import run_on_gloo_groups

    run_on_gloo_groups(_check_default_impl, (2,))


def test_default_impl_on_emulated_cpu_ranks():
    from fa_a2a import ulysses_attention_emulated

    g = torch.Generator().manual_seed(3)
    shards = [[torch.randn(1, 4, 4, 8, generator=g) for _ in range(2)] for _ in range(3)]
    outs = ulysses_attention_emulated(*shards)
    for a, b in zip(outs, ulysses_attention_emulated(*shards, impl="reference")):
        assert torch.equal(a, b)


# ---- the decision over real gloo ranks: every rank's times gathered, one choice, one refusal ----------
class GlooTransport(FakeTransport):
    """host_allgather through the process group (as SymmetricMemoryTransport's)."""

    def __init__(self, group):
        super().__init__({}, world_size=group.size())
        self.group = group

    def host_allgather(self, step, value):
        import torch.distributed as dist

        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values


def _check_gloo_decision(P, group, rank):
    import os

    t, calls = GlooTransport(group), []
    local = {"fused:tma": 1.0 + rank, "fused:st": 1.5, "serial": 2.0 - 0.1 * rank}  # rank 1's tma is slow
    choice = _decide(_problem(), t, local, calls)
    assert choice.label == "fused:st" and choice.times == {"fused:tma": 1.0 + P - 1, "fused:st": 1.5,
                                                           "serial": 2.0}
    os.environ["FA_A2A_IMPL"] = "serial" if rank == 0 else "fused:st"
    try:
        with pytest.raises(ValueError, match="^FA_A2A_IMPL: expected the same value on every rank, got rank 0: "
                                             "'serial', rank 1: 'fused:st'"):
            _decide(_problem(), t, local, calls)
    finally:
        del os.environ["FA_A2A_IMPL"]


def test_gloo_ranks_agree_on_one_decision(cache):
    from tests.multiproc import run_on_gloo_groups

    run_on_gloo_groups(_check_gloo_decision, (2,))
