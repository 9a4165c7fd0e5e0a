"""The host channel's word exchange (ulysses.channel) among gloo rank processes.

Every rank gets every rank's word in rank order, call after call: equal words and differing ones,
ranks that arrive late (past the spinning, into the sleeps), the tag's wrap past 2^16 calls, the
all_gather fallback of ranks on several hosts; get_channel's lookup per group object (a new
init gets a new channel); and a rank that stops calling is named in the TimeoutError of the
others. Each case runs under a hard deadline (no hang).
"""

import datetime
import os
import tempfile
import time

import pytest
import torch.distributed as dist

import ulysses.channel as channel_mod
from ulysses.channel import WORD_BITS, Channel, get_channel
from tests.multiproc import spawn_with_deadline

DEADLINE_S = 60
CALLS = 3000


def _run(case, P, *args):
    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(_worker, (case, P, os.path.join(tmp, "init"), args), P, DEADLINE_S, f"{case.__name__} (P={P})")


def _worker(rank, case, P, init_file, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=30))
    try:
        case(rank, P, *args)
    finally:
        dist.destroy_process_group()


def _word(call, rank):
    """Equal words on most calls, differing ones on every 7th; the extremes of the range now and then."""
    if call % 7 == 3:
        return (call * 1000003 + rank * 7919) % (1 << WORD_BITS)
    return {0: 0, 1: (1 << WORD_BITS) - 1}.get(call % 11, call * 2654435761 % (1 << WORD_BITS))


def _many_calls(rank, P, several_hosts):
    if several_hosts:
        channel_mod._host_id = lambda: f"host {rank}"
    ch = Channel(dist.group.WORLD, timeout_s=20)
    assert ch.kind == ("all_gather" if several_hosts else "shared memory")
    first = (1 << 16) - CALLS // 2  # the tag wraps to 0 half way
    ch.calls = first
    for call in range(first, first + CALLS):
        if call % 500 == rank:  # a late rank: the others spin, then sleep
            time.sleep(0.003)
        got = ch.exchange(_word(call, rank))
        want = [_word(call, s) for s in range(P)]
        assert got == want, f"rank {rank}, call {call}: got {got}, expected {want}"
        assert all(type(w) is int for w in got)
    with pytest.raises(ValueError, match="word"):
        ch.exchange(1 << WORD_BITS)


def _channel_per_group(rank, P, init_file):
    ch = get_channel(dist.group.WORLD)
    assert get_channel(dist.group.WORLD) is ch  # the per-call lookup
    assert get_channel(dist.new_group(list(range(P)))) is ch  # another group object over the same ranks
    assert ch.exchange(rank + 1) == list(range(1, P + 1))
    dist.destroy_process_group()  # a new init: new store, new group objects, a new channel
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=30))
    fresh = get_channel(dist.group.WORLD)
    assert fresh is not ch and fresh.store is not ch.store
    assert get_channel(dist.group.WORLD) is fresh
    assert fresh.exchange(7) == [7] * P


def _freed_group_then_another(rank, P):
    """A group over every rank is destroyed (the default group stays) and another built over the same ranks:
    the channel they share holds neither, and its all_gather fallback (several hosts) runs over the live one."""
    import gc
    import weakref

    channel_mod._host_id = lambda: f"host {rank}"
    first = dist.new_group(list(range(P)))
    ch = get_channel(first)
    assert ch.exchange(rank) == list(range(P))
    freed = weakref.ref(first)
    dist.destroy_process_group(first)
    del first
    gc.collect()
    assert freed() is None, "the channel cache kept a process group alive"
    second = dist.new_group(list(range(P)))
    assert get_channel(second) is ch
    assert ch.exchange(rank + 5) == [5 + s for s in range(P)]


def _one_rank_stops(rank, P):
    ch = Channel(dist.group.WORLD, timeout_s=1)
    assert ch.exchange(5) == [5] * P
    if rank != P - 1:  # the last rank stops calling
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"rank\(s\) \[{P - 1}\] of {P} did not reach call 2"):
            ch.exchange(6)
        assert time.monotonic() - t0 < 5
    dist.barrier()


@pytest.mark.parametrize("P", [2, 3])
def test_every_rank_gets_every_word_in_rank_order(P):
    _run(_many_calls, P, False)


def test_the_all_gather_fallback_gets_the_same_words():
    _run(_many_calls, 2, True)


def test_each_group_object_finds_its_channel_and_a_new_init_a_new_one():
    with tempfile.TemporaryDirectory() as tmp:
        _run(_channel_per_group, 2, os.path.join(tmp, "init2"))


def test_a_freed_group_is_not_kept_and_its_channel_serves_the_next_group():
    _run(_freed_group_then_another, 2)


def test_a_rank_that_stops_calling_is_named():
    _run(_one_rank_stops, 3)
