"""State across calls (a hostile pass, 2026-12-05): caches, plans, groups, autograd and settings that an
earlier call leaves behind must not make a later call silently wrong, hang, or fail with an unclear error
(each test here found one that did). Every numeric check is against a plain fp64 torch oracle of the
unsplit sequence."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from fa_a2a import ulysses_attention
from tests.multiproc import run_gloo_case
from tests.helpers import fp64_attention


def _full(seed, B, S, H, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


# ---- backward order: two calls whose backwards move the same bytes -----------------------------------------
def _oracle_grads(full, S_loc, rank, scale=None):
    """fp64 grads of sum(out * w) on this rank's rows w.r.t. the full inputs' rows of this rank, summed over
    every rank's loss (each rank backpropagates its own rows; the exact gradient of the whole loss)."""
    xs = [t.double().requires_grad_() for t in full]
    o = fp64_attention(*xs, scale=scale)
    (o * _weights(o.shape)).sum().backward()
    return [x.grad[:, rank * S_loc:(rank + 1) * S_loc] for x in xs]


def _weights(shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def _swapped_backward_order(rank, P, impl):
    """Calls A (B=2, D=8) and B (B=1, D=16) move the same bytes; rank 0 runs A's backward first, rank 1 B's."""
    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    S_loc, H = 4, 2
    cases = {"A": (2, 8), "B": (1, 16)}
    fulls, outs, shards = {}, {}, {}
    for name, (B, D) in cases.items():
        fulls[name] = _full(ord(name), B, P * S_loc, H, D)
        shards[name] = [t[:, rank * S_loc:(rank + 1) * S_loc].clone().requires_grad_() for t in fulls[name]]
        outs[name] = ulysses_attention(*shards[name], impl=impl, softmax_scale=0.3)
    order = ("A", "B") if rank == 0 else ("B", "A")
    try:
        for name in order:
            o = outs[name]
            w = _weights((o.shape[0], P * S_loc) + tuple(o.shape[2:]))[:, rank * S_loc:(rank + 1) * S_loc]
            (o * w.to(o.dtype)).sum().backward()
    except (ValueError, TimeoutError, RuntimeError) as e:  # refused: fine, as long as it names the mismatch
        assert isinstance(e, ValueError), f"rank {rank}: an unclear error for backwards in another order: {e!r}"
        return
    _check_grads(fulls, shards, S_loc, rank, 0.3)


def _check_grads(fulls, shards, S_loc, rank, scale=None):
    """Each call's shard gradients against the fp64 oracle's."""
    for name in fulls:
        for x, g in zip(shards[name], _oracle_grads(fulls[name], S_loc, rank, scale)):
            err = (x.grad.double() - g).abs().max().item()
            assert err < 1e-4, f"rank {rank}: call {name}'s gradients are wrong by {err}"


@pytest.mark.parametrize("impl", ["reference", "nccl"])
def test_backwards_run_in_another_order_on_each_rank_are_refused_not_mixed(impl):
    """The backward's agreement omits B, D and dtype: swapped backwards of equal byte counts exchange each other's data."""
    run_gloo_case(_swapped_backward_order, 2, impl, deadline_s=90)


def _swapped_backward_same_signature(rank, P, impl):
    """Calls A and B of one signature (other data); rank 0 runs A's backward first, rank 1 B's: both
    ranks' gradients were wrong by ~1.3 (each rank's exchanges met the other call's)."""
    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    S_loc = 4
    fulls = {name: _full(seed, 1, P * S_loc, 2, 8) for name, seed in (("A", 10), ("B", 20))}
    shards = {name: [t[:, rank * S_loc:(rank + 1) * S_loc].clone().requires_grad_() for t in f]
              for name, f in fulls.items()}
    outs = {name: ulysses_attention(*shards[name], impl=impl) for name in fulls}
    w = _weights((1, P * S_loc, 2, 8))[:, rank * S_loc:(rank + 1) * S_loc].float()
    for name in (("A", "B") if rank == 0 else ("B", "A")):
        with pytest.raises(ValueError, match="the backward's call .* got rank 0: [0-9]+, rank 1: [0-9]+"):
            (outs[name] * w).sum().backward()
    for name in ("A", "B"):  # in the same order on every rank, after the refusal: right
        (outs[name] * w).sum().backward()
    _check_grads(fulls, shards, S_loc, rank)


@pytest.mark.parametrize("impl", ["reference", "nccl"])
def test_backwards_of_one_signature_in_another_order_on_each_rank_are_refused(impl):
    """The backward agrees the forward call it belongs to, not only the signature."""
    run_gloo_case(_swapped_backward_same_signature, 2, impl, deadline_s=90)


def _copying_hooks():
    """Saved-tensor hooks whose unpack hands the backward a copy (activation offloading or compression, as
    torch.autograd.graph.save_on_cpu does on CUDA)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def _same_order_under_copying_hooks(rank, P):
    """Every rank runs the same two calls of one signature and the same backward, 20 times, under copying
    hooks: never refused, and the gradients right. (The backward looked its forward's number up by the saved
    q's address, which the copy does not have: 6-35 of 40 such iterations were refused with "got rank 0: 0,
    rank 1: 47", a miss or a stale entry of an earlier call, differently on each rank.)"""
    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    rows = [7, 2]
    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
    for it in range(20):
        full = _full(it, 1, sum(rows), 2, 8)
        x = [t[:, mine].clone().requires_grad_() for t in full]
        with _copying_hooks():
            o1 = ulysses_attention(*x, impl="reference", shard_rows=rows)
            o2 = ulysses_attention(*x, impl="reference", shard_rows=rows)
        (o1.sum() + 2 * o2.sum()).backward()
    xs = [t.double().requires_grad_() for t in full]
    (3 * fp64_attention(*xs)).sum().backward()
    for a, b in zip(x, xs):
        err = (a.grad.double() - b.grad[:, mine]).abs().max().item()
        assert err < 1e-4, f"rank {rank}: gradients wrong by {err} under copying hooks"


def test_saved_tensor_hooks_that_copy_keep_a_correct_program_agreed():
    run_gloo_case(_same_order_under_copying_hooks, 2, deadline_s=90)


def _misordered_under(rank, P, mode):
    """Calls A and B of one signature, their backwards in another order on each rank (a caller's bug), under
    copying saved-tensor hooks (eager, or the traced custom ops of torch.compile) or non-reentrant activation
    checkpointing: refused as without them (each rank silently got the other call's gradients, wrong by ~1.5)."""
    from torch.utils.checkpoint import checkpoint

    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    S_loc = 4
    fulls = {name: _full(seed, 1, P * S_loc, 2, 8) for name, seed in (("A", 10), ("B", 20))}
    attend = lambda q, k, v: ulysses_attention(q, k, v, impl="reference")  # noqa: E731
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    outs = {}
    for name, f in fulls.items():
        x = [t[:, rank * S_loc:(rank + 1) * S_loc].clone().requires_grad_() for t in f]
        if mode == "checkpoint":
            outs[name] = checkpoint(attend, *x, use_reentrant=False)
        else:
            with _copying_hooks():
                outs[name] = (compiled if mode == "compiled" else attend)(*x)
    with pytest.raises(ValueError, match="the backward's call .* got rank 0: [0-9]+, rank 1: [0-9]+"):
        for name in (("A", "B") if rank == 0 else ("B", "A")):
            outs[name].sum().backward()


@pytest.mark.parametrize("mode", ["hooks", "compiled", "checkpoint"])
def test_misordered_backwards_are_refused_under_copying_hooks_and_checkpointing(mode):
    """(Reentrant checkpointing runs the forward again in the backward's order: a misorder is not seen there,
    as engine.backward.forward_call says.)"""
    run_gloo_case(_misordered_under, 2, mode, deadline_s=90)


# ---- destroy_process_group: fa_a2a keeps no process group alive -------------------------------------------
def _group_freed_after_destroy(rank, P, impl):
    """A call (forward and backward) over the default group, then destroy_process_group: the group object
    is freed. (The channel cache held it: it was destroyed at interpreter exit instead, where gloo's
    aborted the rank process now and then, SIGABRT "terminate called without an active exception".)"""
    import gc
    import weakref

    x = [t[:, rank * 4:(rank + 1) * 4].clone().requires_grad_() for t in _full(3, 1, P * 4, 2, 8)]
    ulysses_attention(*x, impl=impl).sum().backward()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert world() is None, f"rank {rank}: the default process group is still alive after destroy_process_group"


@pytest.mark.parametrize("impl", ["reference", "nccl"])
def test_no_process_group_outlives_destroy_process_group(impl):
    run_gloo_case(_group_freed_after_destroy, 2, impl, deadline_s=60)


# ---- destroy_process_group, then a new group in the same processes (torchrun's agent store persists) ------
def _two_channels_over_one_store(rank, P):
    """Two channels built one after the other over the same ranks and store (as after destroy_process_group
    and a new init on a store that outlives its groups, torchrun's agent store): the second takes the next
    generation of keys, so it reads none of the first one's set-up or message keys."""
    import pickle

    from ulysses.channel import Channel

    first = Channel(dist.group.WORLD, 5)
    assert first.exchange(3) == [3] * P
    second = Channel(dist.group.WORLD, 5)
    assert (first.prefix[-2:], second.prefix[-2:]) == ("/0", "/1"), (first.prefix, second.prefix)
    # a message the first channel left at the key the second will use for its call (same call number)
    first.store.set(f"{first.prefix}/msg/{second.calls}/{1 - rank}", pickle.dumps("stale"))
    dist.barrier()
    assert second.exchange(5 + rank) == [5, 6]
    assert second.gather_messages(("this call", rank)) == [("this call", r) for r in range(P)]


def test_a_channel_built_again_over_the_same_store_reads_only_its_own_keys():
    """(The case: a store that outlives its process groups; a new group built after destroy_process_group
    read the old group's keys: a hang, or the wrong argument named.)"""
    run_gloo_case(_two_channels_over_one_store, 2, deadline_s=60)


# ---- impl="auto" records on disk -------------------------------------------------------------------------------
@pytest.mark.parametrize("times", [{"serial": "fast"}, {"serial": None}, {"serial": [1.0]}])
def test_a_corrupted_auto_record_is_ignored_not_a_type_error(monkeypatch, tmp_path, times):
    """A record on disk whose times are not numbers (hand-edited, another version's) crashes every first call."""
    import json

    from fa_a2a.engine import autotune
    from tests.cpu.test_autotune import FakeTransport, _problem

    monkeypatch.setenv("FA_A2A_CACHE_DIR", str(tmp_path))
    problem, transport = _problem(), FakeTransport({})
    key = autotune.record_key(problem, transport)
    path = autotune._record_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(key=key, label="serial", times=times)))
    monkeypatch.setattr(autotune, "_decisions", {})
    choice = autotune.read_record(key, ("fused:tma", "fused:st", "serial"))
    assert choice is None or isinstance(choice.describe(), str)  # decide() logs choice.describe()


# ---- FA_A2A_* variables changed between calls --------------------------------------------------------------------
def _check_joint_turned_on_later(rank, P):
    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    S_loc, H, D = 4, 2, 8
    q = torch.randn(1, S_loc, H, D, generator=torch.Generator().manual_seed(rank))
    joint = [torch.randn(1, 3, H, D, generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    with torch.no_grad():
        ulysses_attention(q, q, q, joint=joint, impl="reference")  # the signature cached, FA_A2A_CHECK_JOINT off
        os.environ["FA_A2A_CHECK_JOINT"] = "1"  # e.g. set from a debugger or by the training script later on
        mixed = [t + rank for t in joint]
        with pytest.raises(ValueError, match=r"^joint \(data checksum"):
            ulysses_attention(q, q, q, joint=mixed, impl="reference")


def test_check_joint_set_after_the_first_call_checks_the_joint_data():
    """FA_A2A_CHECK_JOINT=1 set after a signature's first call is never read for it: different joint data runs."""
    run_gloo_case(_check_joint_turned_on_later, 2, deadline_s=60)


def _timeout_lowered_later(rank, P):
    q = torch.randn(1, 4, 2, 8)
    with torch.no_grad():
        ulysses_attention(q, q, q, impl="reference")  # the channel built with the default timeout (30 s)
        os.environ["FA_A2A_TIMEOUT_S"] = "2"
        if rank == 1:
            time.sleep(12)  # rank 1 stops calling for a while
            return
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ulysses_attention(q, q, q, impl="reference")
        took = time.monotonic() - t0
        assert took < 8, f"FA_A2A_TIMEOUT_S=2 set after the first call: the wait lasted {took:.1f} s"


def test_timeout_set_after_the_first_call_bounds_the_wait():
    """FA_A2A_TIMEOUT_S is read once, when a group's channel is built: a later value is ignored (waits 30 s)."""
    run_gloo_case(_timeout_lowered_later, 2, deadline_s=80)
