"""A real rank's output left in its out-slot (fa_a2a.engine.forward's delivery), 2 processes sharing GPU 0
(under MPS where it starts): outputs held across calls keep their values and their own slots, a
dropped output's slot comes back, more held outputs than slots fall back to a copy, a CUDA graph
owns the slot its capture chose (an eager call between replays does not touch it), uneven shards,
and an output that outlives close_transports(). Every fused output equals the serial call's (its
values cloned away at once) bit for bit."""
import torch

from tests.multiproc import run_on_gloo_groups

S_LOC, H, D = 256, 8, 128


def _same(got, want, what):
    assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), what


def _delivery(P, group, rank):
    from fa_a2a import ulysses_attention
    from ulysses.env import OUT_SLOTS
    from ulysses.transport import close_transports

    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    inputs = [[torch.randn(1, S_LOC, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
              for _ in range(OUT_SLOTS + 2)]
    with torch.no_grad():
        refs = [ulysses_attention(*x, group=group, impl="serial").clone() for x in inputs]
        fused = lambda x: ulysses_attention(*x, group=group, impl="fused")  # noqa: E731

        held = [fused(x) for x in inputs[:3]]
        ptrs = [o.data_ptr() for o in held]
        assert len(set(ptrs)) == 3, f"rank {rank}: held outputs share memory: {ptrs}"
        for i, o in enumerate(held):
            _same(o, refs[i], f"rank {rank}: held output {i} after later calls")
        first = ptrs[0]
        del held, o
        again = fused(inputs[3])
        assert again.data_ptr() == first, f"rank {rank}: a dropped output's slot was not reused"
        _same(again, refs[3], f"rank {rank}: reused slot")
        del again

        held = [fused(x) for x in inputs]  # one more than the slots: the last is copied out
        for i, o in enumerate(held):
            _same(o, refs[i], f"rank {rank}: output {i} of {len(inputs)} held")
        slot_ptrs = {o.data_ptr() for o in held[:OUT_SLOTS]}
        assert len(slot_ptrs) == OUT_SLOTS and held[-1].data_ptr() not in slot_ptrs
        del held, o

        static = [t.clone() for t in inputs[1]]
        fused(static)  # warm up on the capture's inputs
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a = fused(static)
            a_ptr = a.data_ptr()
            del a
            b = fused(static)  # the same capture: the slot its first (dropped) output left
        assert b.data_ptr() == a_ptr, f"rank {rank}: one capture took two slots"
        e = fused(inputs[2])  # eager, after the capture: not the graph's slot
        assert e.data_ptr() != b.data_ptr()
        b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _same(b, refs[1], f"rank {rank}: graph replay")
        _same(e, refs[2], f"rank {rank}: eager output across a replay")
        for t, x in zip(static, inputs[4]):
            t.copy_(x)
        graph.replay()
        _same(b, refs[4], f"rank {rank}: graph replay on new inputs")
        _same(e, refs[2], f"rank {rank}: eager output across a second replay")
        del graph, b, e

        rows = [S_LOC, 200]  # uneven shards: rank 1's output is its first 200 rows
        uneven = [t[:, :rows[rank]].contiguous() for t in inputs[0]]
        ref = ulysses_attention(*uneven, group=group, impl="serial", shard_rows=rows).clone()
        _same(ulysses_attention(*uneven, group=group, impl="fused", shard_rows=rows), ref, f"rank {rank}: uneven")

        last = fused(inputs[0])
        torch.cuda.synchronize()
    close_transports()  # the windows' memory stays while `last` lives (with a warning)
    _same(last, refs[0], f"rank {rank}: output after close_transports()")


def test_outputs_stay_in_their_out_slots_on_two_processes_sharing_the_gpu():
    from ulysses.transport import close_transports

    run_on_gloo_groups(_delivery, (2,), cuda=True, timeout_s=300, teardown=close_transports)
