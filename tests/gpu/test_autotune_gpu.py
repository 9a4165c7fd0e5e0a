"""impl="auto" on one GPU (fa_a2a.engine.autotune): every candidate gives the same bits, the decision is one
of the candidates and agreed by every rank, graph capture after a decision replays exactly, a second
process reads the decision from disk; emulated ranks and 2 / 4 processes sharing the GPU.

Outputs are checked against ulysses.reference's A2As around fa4_forward (atol 0) with the windows
poisoned (NaN) before each call, so an unwritten tile shows."""
import pytest
import torch

from cute_kernels.fa4 import tile_m_for
from fa_a2a.engine import autotune
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated

from tests import helpers
from tests.gpu.test_ulysses_attention import DTYPE, check_exact, make_inputs, reference_outputs
from tests.multiproc import run_on_gloo_groups

# (P, B, S, H, H_kv, D, J, causal): S_loc a multiple of the tile's rows (fused:tma is a
# candidate), S_loc 320 (tiles straddle ranks: st only), uneven S with GQA and joint rows, causal D 64
CASES = [(2, 1, 1024, 8, 8, 128, 0, False), (4, 1, 1280, 8, 4, 128, 0, False), (4, 2, 1001, 6, 2, 128, 77, False),
         (2, 1, 512, 4, 2, 64, 0, True)]
LABELS = ("fused:tma", "fused:st", "serial")


@pytest.fixture
def fresh_records():
    """No decision on disk (the compile cache stays: recompiling every kernel would take minutes)."""
    autotune.clear_records()
    yield
    autotune.clear_records()


def _poison_emulated(case):
    from fa_a2a.engine.forward import _plans

    for transport in {id(p.transport): p.transport for p in _plans.values()
                      if p.transport.world_size == case[0]}.values():
        helpers.poison_allocated(transport)  # every out-slot (emulated ranks lend out of slots 1..)


def _emulated(case, impl, joint, shards):
    _poison_emulated(case)
    res = ulysses_attention_emulated(*shards, impl=impl, joint=joint, causal=case[-1], seq_len=case[2])
    return res if joint is not None else (res, [None] * case[0])


@pytest.mark.parametrize("case", CASES)
def test_emulated_auto_and_every_candidate_give_the_same_bits(case, fresh_records):
    full, joint, shards = make_inputs(case, seed=21)
    want_seq, want_joint = reference_outputs(case, joint, shards)
    S_loc = -(-case[2] // case[0])
    tma = S_loc % tile_m_for(case[5], case[-1]) == 0  # the fused kernel's output tile rows divide S_loc
    for impl in ("auto",) + tuple(label for label in LABELS if label != "fused:tma" or tma):
        for _ in range(2):  # the first auto call measures, the second runs the decision
            outs, jouts = _emulated(case, impl, joint, shards)
            for r in range(case[0]):
                check_exact(case, r, outs[r], jouts[r], want_seq, want_joint)
    made = [c for k, c in autotune.decisions().items() if c.source == "measured" and f'"seq_loc": "{S_loc}"' in k]
    assert made and all(c.label in LABELS for c in made)
    assert all(set(c.times) <= set(LABELS) and c.cost_s > 0 for c in made)
    if not tma:
        assert all("fused:tma" not in c.times for c in made)


def test_graph_capture_after_an_auto_decision_replays_exactly(fresh_records):
    case = CASES[2]
    full, joint, shards = make_inputs(case, seed=3)
    static = [[t.clone() for t in s] for s in shards]
    static_joint = tuple(t.clone() for t in joint)
    _emulated(case, "auto", static_joint, static)  # decides, compiles, allocates
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        g_outs, g_jouts = ulysses_attention_emulated(*static, impl="auto", joint=static_joint, seq_len=case[2])
    torch.cuda.current_stream().wait_stream(s)
    for rnd in range(3):
        full, joint, shards = make_inputs(case, seed=100 + rnd)
        for dst, src in zip(static, shards):
            for a, b in zip(dst, src):
                a.copy_(b)
        for a, b in zip(static_joint, joint):
            a.copy_(b)
        _poison_emulated(case)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        want_seq, want_joint = reference_outputs(case, joint, shards)
        for r in range(case[0]):
            check_exact(case, r, g_outs[r], g_jouts[r], want_seq, want_joint)


def test_first_call_under_capture_takes_the_static_rule(fresh_records, caplog):
    import logging

    case = (2, 1, 768, 4, 4, 128, 0, False)  # a signature no other test decides
    full, joint, shards = make_inputs(case, seed=4)
    ulysses_attention_emulated(*shards, impl="fused")  # windows and kernels exist: capture can run
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.INFO, logger="fa_a2a.engine.autotune"):
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            outs = ulysses_attention_emulated(*shards, impl="auto")
    torch.cuda.current_stream().wait_stream(s)
    assert "fused:tma, static" in caplog.text and "CUDA-graph capture" in caplog.text
    graph.replay()
    torch.cuda.synchronize()
    want_seq, _ = reference_outputs(case, None, shards)
    for r in range(case[0]):
        assert torch.equal(outs[r], want_seq[r])


def test_the_block_auto_equals_fused_and_serial(fresh_records):
    from fa_a2a import block

    P, B, S_loc, H, D = 2, 1, 320, 4, 128
    C = H * D
    g = torch.Generator(device="cuda").manual_seed(5)
    chain = block.TorchQKV((torch.randn(3 * C, C, device="cuda", generator=g) / C ** 0.5).to(DTYPE),
                           (0.1 * torch.randn(3 * C, device="cuda", generator=g)).to(DTYPE), None, None, H, H, D)
    proj = block.block_weights(chain, P)
    xs = [torch.randn(B, S_loc, C, device="cuda", generator=g).to(DTYPE) for _ in range(P)]
    outs = {impl: [o.clone() for o in block.ulysses_qkv_attention_emulated(xs, proj, impl=impl)]
            for impl in ("auto", "fused", "serial", "fused:st")}
    for impl in ("fused", "serial", "fused:st"):
        for a, b in zip(outs["auto"], outs[impl]):
            assert torch.equal(a, b), impl
    made = [c for k, c in autotune.decisions().items() if '"entry": "ulysses_qkv_attention"' in k]
    assert made and made[-1].label in ("fused:st", "serial") and "fused:tma" not in (made[-1].times or {})


# ---- real ranks: processes sharing the GPU (under MPS where it starts) -------------------------------
def _real_ranks(P, group, rank, expect_source):
    import torch.distributed as dist

    for case in ((P, 1, P * 512, 8, 8, 128, 0, False), (P, 1, P * 320 - 7, 8, 4, 128, 33, False)):
        full, joint, shards = make_inputs(case, seed=77 + P)
        want_seq, want_joint = reference_outputs(case, joint, shards)
        mine = [s[rank] for s in shards]
        for impl in ("auto", "auto", "fused", "fused:st", "serial"):
            res = ulysses_attention(*mine, group=group, impl=impl, joint=joint, seq_len=case[2])
            out, jout = helpers.pair(res, joint)
            check_exact(case, rank, out, jout, want_seq, want_joint)
            del res, out, jout
        S_loc = -(-case[2] // P)
        made = [c for k, c in autotune.decisions().items() if f'"seq_loc": "{S_loc}"' in k and
                f'"world_size": "{P}"' in k and '"entry": "ulysses_attention"' in k]  # (processes serve P 2, 4)
        assert len(made) == 1 and made[0].source == expect_source, made
        labels = [None] * P
        dist.all_gather_object(labels, made[0].label, group=group)
        assert len(set(labels)) == 1, labels  # every rank runs the same path
        assert made[0].label in LABELS and (S_loc % tile_m_for(case[5]) == 0 or made[0].label != "fused:tma")
    from ulysses.transport import get_transport

    get_transport(group).check()


def _measured(P, group, rank):
    _real_ranks(P, group, rank, "measured")


def _from_disk(P, group, rank):
    _real_ranks(P, group, rank, "disk")


def test_real_ranks_decide_agree_and_a_second_process_reads_the_record(fresh_records):
    from ulysses.transport import close_transports

    run_on_gloo_groups(_measured, (2, 4), cuda=True, timeout_s=300, teardown=close_transports)
    assert len(list(autotune.records_dir().glob("*.json"))) == 4  # two signatures at P = 2 and at P = 4
    run_on_gloo_groups(_from_disk, (2, 4), cuda=True, timeout_s=300, teardown=close_transports)
