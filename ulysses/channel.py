"""One word per rank per call, exchanged among the ranks of a process group on the host.

fa_a2a agrees every call's signature across the ranks through this (fa_a2a.engine.problem.agree_call):
each rank publishes a 47-bit word (a hash of its call's signature, or ERROR_WORD when its own
checks refused the call) and reads every other rank's, before any data moves.

Ranks of one host share a small memory-mapped file (/dev/shm where it exists): int64 slots [2, P].
Call c of rank r stores ((c mod 2^16) << 47 | word) at [c % 2, r] with one aligned 8-byte store
(atomic on x86-64 and AArch64), then reads the row (one 8-byte load per slot) until every
[c % 2, s] carries tag c mod 2^16: one list count when every word is this rank's (the usual case),
a min and a max otherwise, no Python loop over the slots. Rank s cannot overwrite row c % 2 again
(its call c + 2) before every rank has published call c + 1, which a rank does only after it has
read call c: two rows suffice. No collective, no GPU synchronization.
Host time, measured 2026-12-04 with `python examples/agreement_cost.py --ranks P` (gloo rank
processes), "own cost of the rank that arrives last / per call over all ranks, their wait
included", the version before in parentheses (runs alternated with it; both machines' speed varies
by up to 2x between runs):
  this CPU-only dev machine (2 cores, shared with other jobs), P = 2, medians of 10 runs: the
  exchange 0.78 / 0.84 us (0.89 / 0.95); the whole per-call agreement (fa_a2a.engine.problem.agree_call:
  get_channel, the exchange, the verdict) 1.61 / 1.67 us (5.1 / 5.3: an import and the default
  store's lookup on every call). One process, every other word already there (median of 21 runs):
  0.37 us per exchange at P = 2, 0.42 at P = 4 (0.39, 0.46).
  a 16-core GPU host (Xeon), per call over all ranks, two sessions of 3 to 5 runs: the exchange
  1.1-1.3 us at P = 2 (1.4), 1.7-2.2 at P = 4 (1.7-2.2); the agreement 1.9-2.1 us at P = 2
  (4.4-4.8), 2.5-3.1 at P = 4 (5.0-6.0).
A rank that waits past ~20 us yields its core between reads (where ranks outnumber cores the late
rank gets to run: P = 4 on the dev machine, 93 us per call, 2.3 ms before; measured 2026-12-03)
and past 1 ms sleeps between reads.
Ranks on several hosts (or where the file cannot be shared) fall back to an all_gather of one
int64 over the group.

The set-up, and the exchange of full messages when words differ (`gather_messages`), go through
the default group's key-value store, keyed by the group's global ranks: ranks that call with
different process-group objects over the same ranks still meet there and are told so.
Waits end after `timeout_s` with TimeoutError naming the ranks that never arrived (a rank that
stopped calling, or that calls over another group of other ranks).
"""

from __future__ import annotations

import datetime
import mmap
import os
import pickle
import socket
import tempfile
import time
import weakref
from typing import Optional

from ulysses import env

__all__ = ["ERROR_WORD", "WORD_BITS", "Channel", "get_channel", "close_channels"]

WORD_BITS = 47
ERROR_WORD = 0  # signature words are never 0 (see fa_a2a.engine.problem)
_WORDS = 1 << WORD_BITS
_TAG = 0xFFFF  # tag << WORD_BITS | word < 2^63: a slot is a non-negative int64
_SPINS = 64  # reads of the row (~20 us) before a waiting rank yields its core between reads


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class Channel:
    """The word exchange of one group's ranks (collective construction: every rank of the group at once)."""

    def __init__(self, group, timeout_s: float):
        import torch.distributed as dist

        # the all_gather fallback's group (several hosts), held weakly: a process group kept alive past
        # destroy_process_group is destroyed at interpreter exit instead, where gloo's aborts the process
        self._group = weakref.ref(group)
        self.world_size, self.rank = group.size(), group.rank()
        self.timeout_s = env.seconds(timeout_s, "timeout_s")
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self.store = dist.distributed_c10d._get_default_store()
        base = f"fa_a2a/channel/{','.join(map(str, self.global_ranks))}"
        # A generation per construction over these ranks: a store can outlive its process groups
        # (torchrun's agent store), and a channel built after destroy_process_group and a new init must
        # not read the keys of the one before (every rank adds 1 once per construction, together)
        generation = (self.store.add(f"{base}/generation", 1) - 1) // self.world_size
        self.prefix = f"{base}/{generation}"
        self.calls = 1  # tags start at 1: the file's initial zeros match no call
        self._rows = self._map_shared()  # the two rows of P slots (memoryviews), or None: all_gather
        self.kind = "shared memory" if self._rows is not None else "all_gather"

    # ---- set-up (through the store) ------------------------------------------------------------------
    def _timeout(self) -> float:
        """FA_A2A_TIMEOUT_S as it is when a wait begins (a value set after the channel was built counts),
        else the channel's own: unset, or a bad value (the checks of a call's first signature refuse it by
        name; a value set bad after that is not read here, and a wait must still end)."""
        if os.environ.get("FA_A2A_TIMEOUT_S") is None:
            return self.timeout_s
        try:
            return env.timeout_s()
        except ValueError:
            return self.timeout_s

    def _wait(self, keys: list) -> None:
        timeout_s = self._timeout()
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # the store's own timeout error type differs between torch versions
            missing = [k for k in keys if not self.store.check([k])]
            absent = [f"rank {g}" for s, g in enumerate(self.global_ranks)
                      if not self.store.check([f"{self.prefix}/host/{s}"])]  # every rank's first key
            who = f"{', '.join(absent)} never reached it" if absent else f"waiting for {missing[:4]}"
            raise TimeoutError(f"fa_a2a: the ranks of group ranks {list(self.global_ranks)} did not meet at fa-a2a's "
                               f"per-call agreement within {timeout_s:g} s: {who} (a rank that stopped "
                               f"calling, raised before its call, or runs another attention backend): {e}") from None

    def _map_shared(self) -> Optional[tuple]:
        P, r, pre = self.world_size, self.rank, self.prefix
        self.store.set(f"{pre}/host/{r}", _host_id())
        path = ""
        try:
            if r == 0:
                self._wait([f"{pre}/host/{s}" for s in range(P)])
                hosts = {self.store.get(f"{pre}/host/{s}") for s in range(P)}
                if len(hosts) == 1:
                    fd, path = tempfile.mkstemp(prefix="fa_a2a_channel_", dir=_shm_dir())
                    os.ftruncate(fd, 2 * P * 8)
                    os.close(fd)
                self.store.set(f"{pre}/path", path)
            else:
                self._wait([f"{pre}/path"])
                path = self.store.get(f"{pre}/path").decode()
            mm = None
            if path:
                try:
                    with open(path, "r+b") as f:
                        mm = mmap.mmap(f.fileno(), 2 * P * 8)
                except OSError:
                    mm = None
            self.store.set(f"{pre}/opened/{r}", b"1" if mm is not None else b"0")
            self._wait([f"{pre}/opened/{s}" for s in range(P)])
        finally:
            # every rank has mapped the file (or given up, or this wait ended): its mappings stay
            # valid, and nothing is left behind in the file system, whichever way this ends
            if r == 0 and path:
                os.unlink(path)
        everyone = all(self.store.get(f"{pre}/opened/{s}") == b"1" for s in range(P))
        if not everyone:
            return None
        slots = memoryview(mm).cast("q")  # int64, native order; the views keep the mapping alive
        return slots[:P], slots[P:]

    # ---- per call ----------------------------------------------------------------------------------------
    def exchange(self, word: int) -> list:
        """Publish this rank's word of the next call and return every rank's (rank order)."""
        if not 0 <= word < _WORDS:
            raise ValueError(f"word: expected an int in [0, 2**{WORD_BITS}), got {word!r}")
        c = self.calls
        self.calls = c + 1
        if self._rows is None:
            return self._all_gather(word)
        row, P = self._rows[c & 1], self.world_size
        lo = (c & _TAG) << WORD_BITS  # this call's tag, above the word
        mine = lo | word
        row[self.rank] = mine  # one aligned 8-byte store
        spins, start = 0, None
        while True:
            vals = row.tolist()  # one 8-byte load per slot: each slot's tag and word together
            if vals.count(mine) == P:  # everyone is at call c, with this rank's word (the usual case)
                return [word] * P
            if lo <= min(vals) and max(vals) < lo + _WORDS:  # everyone is at call c; words differ
                return [v - lo for v in vals]
            spins += 1
            if spins < _SPINS:
                continue
            # waiting past ~20 us: between reads, yield the core to whoever waits for it (the
            # late rank, where ranks outnumber cores), and past 1 ms sleep; give up after timeout_s
            now = time.monotonic()
            if start is None:
                start, timeout_s = now, self._timeout()
            if now - start > timeout_s:
                late = [s for s, v in enumerate(vals) if not lo <= v < lo + _WORDS]
                # withdraw this rank's word: a rank arriving later must not find the call agreed and
                # wait in the call's collectives past its own timeout, but fail at the messages' wait
                row[self.rank] = lo | ERROR_WORD
                raise TimeoutError(
                    f"fa_a2a: rank(s) {late} of {P} did not reach call {c} over group ranks "
                    f"{list(self.global_ranks)} within {timeout_s:g} s (they stopped calling, or call "
                    "with another process group); set FA_A2A_TIMEOUT_S to wait longer")
            if now - start < 1e-3:
                os.sched_yield()
            else:
                time.sleep(1e-5)

    def _all_gather(self, word: int) -> list:
        import torch
        import torch.distributed as dist

        group = self._group()
        if group is None:
            raise RuntimeError(f"fa_a2a: the process group of ranks {list(self.global_ranks)} was destroyed")
        backend = str(dist.get_backend(group))
        device = "cpu" if ("gloo" in backend or "cpu" in backend) else torch.device("cuda", torch.cuda.current_device())
        out = torch.empty(self.world_size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(out, torch.tensor([word], dtype=torch.int64, device=device), group=group)
        return out.tolist()

    def gather_messages(self, message) -> list:
        """Every rank's (picklable) message, through the store: after an exchange whose words
        differ, which every rank sees, so every rank calls this at the same call."""
        key = f"{self.prefix}/msg/{self.calls}"
        self.store.set(f"{key}/{self.rank}", pickle.dumps(message))
        self._wait([f"{key}/{s}" for s in range(self.world_size)])
        return [pickle.loads(self.store.get(f"{key}/{s}")) for s in range(self.world_size)]


_channels: dict = {}  # (group name, default group's id) and (global ranks, default group's id) -> channel
# id of a group object -> its channel: the per-call lookup. No group is held here (a process group kept
# alive past destroy_process_group is destroyed at interpreter exit, where gloo's aborts the process:
# SIGABRT); an entry goes when its group is freed, before its id can be reused
_group_channels: dict = {}


def get_channel(group, timeout_s: Optional[float] = None) -> Channel:
    """The channel of the group's ranks, built at the first call over them (collective over those
    ranks). Every group over the same global ranks shares it: ranks that call over different
    group objects still meet, and the signature (which names the group) tells them apart.
    After the first call over a group object, one dict lookup (a new default store, after
    destroy_process_group and a new init, comes with new group objects)."""
    ch = _group_channels.get(id(group))
    if ch is not None:
        return ch
    import torch.distributed as dist

    # the default group object names this init (its store's Python wrapper is made anew at every lookup:
    # its id is reused, and a new init's group could meet the old init's channel); its channels are
    # dropped when it is freed, before its id can be reused
    default = dist.distributed_c10d._get_default_group()
    key = (group.group_name, id(default))
    ch = _channels.get(key)
    if ch is None:
        ranks_key = (tuple(dist.get_process_group_ranks(group)), key[1])
        ch = _channels.get(ranks_key)
        if ch is None:
            if timeout_s is None:
                try:
                    timeout_s = env.timeout_s()
                except ValueError:  # the call's own checks refuse it by name (fa_a2a.engine.problem), over this channel
                    timeout_s = env.DEFAULT_TIMEOUT_S
            ch = _channels[ranks_key] = Channel(group, timeout_s)
            weakref.finalize(default, _channels.pop, ranks_key, None)
        _channels[key] = ch
        weakref.finalize(default, _channels.pop, key, None)
    if ch._group() is None:  # the group it was built over is gone: the all_gather fallback takes this one
        ch._group = weakref.ref(group)
    _group_channels[id(group)] = ch
    weakref.finalize(group, _group_channels.pop, id(group), None)
    return ch


def close_channels() -> None:
    """Forget every channel (after destroy_process_group; the next call builds a new one)."""
    _channels.clear()
    _group_channels.clear()
