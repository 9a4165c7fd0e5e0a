"""The FA_A2A_* environment variables: one parser each, and check_all() of every one.

Each variable is read where it is used, through its parser here (a value set after import counts),
and a bad value raises ValueError naming the variable: "FA_A2A_TIMEOUT_S: expected ..., got 'abc'".
fa_a2a.engine.problem.check_call reads every one (check_settings) with every new call signature, inside the
call's local checks, so a bad value on one rank reaches every rank as the same ValueError before anything
waits on it (ulysses.channel builds its channel with the default timeout then, to carry it; a channel
reads FA_A2A_TIMEOUT_S again whenever a wait begins, and the per-call agreement FA_A2A_CHECK_JOINT every
call with joint rows).

  FA_A2A_TIMEOUT_S         seconds a rank waits for its peers (the per-call agreement, barriers): default 30
  FA_A2A_SETUP_TIMEOUT_S   seconds a transport's collective set-up waits: default 300
  FA_A2A_TRANSPORT         the transport's backend: vmm (default), ipc (= vmm), host, symm
  FA_A2A_OUT_SLOTS         out-windows an output may stay in besides the staging window: an int in [0, 16],
                           default 8 (fa_a2a.engine.forward's delivery)
  FA_A2A_CHECK_JOINT       1: the per-call agreement also checksums the joint rows' data (default 0)
  FA_A2A_CACHE             0: compiles are not cached on disk (default 1; cute_kernels.compile_cache.enabled)
  FA_A2A_CACHE_DIR         the compile cache's folder (any path; one that cannot be used is warned about)
  FA_A2A_IMPL              the path impl="auto" takes, instead of timing its candidates (parsed by
                           fa_a2a.engine.problem.forced_label, which knows the candidates, with these)
Imports nothing heavy (ulysses.channel reads its timeout here).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_SETUP_TIMEOUT_S", "MAX_SECONDS", "TRANSPORTS", "OUT_SLOTS", "MAX_OUT_SLOTS",
           "seconds", "timeout_s", "setup_timeout_s", "transport", "check_joint", "out_slots", "check_all"]

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_SETUP_TIMEOUT_S = 300.0
MIN_SECONDS = 1e-3  # the stores' waits count whole milliseconds, and 0 ms is no timeout at all (FileStore)
MAX_SECONDS = 1e6  # ~11.6 days: a wait past any real one, inside datetime.timedelta and int64 nanoseconds
TRANSPORTS = ("vmm", "ipc", "host", "symm")
OUT_SLOTS = 8  # out-windows an output may stay in, besides the staging window (FA_A2A_OUT_SLOTS overrides)
MAX_OUT_SLOTS = 16


def seconds(value, name: str) -> float:
    """value (a number, or its text) as a timeout in [MIN_SECONDS, MAX_SECONDS]; ValueError naming `name`."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        v = float("nan")
    if not MIN_SECONDS <= v <= MAX_SECONDS:  # NaN fails too
        raise ValueError(f"{name}: expected a number of seconds in [{MIN_SECONDS:g}, {MAX_SECONDS:g}], got {value!r}")
    return v


def _get(name: str, env: Optional[dict]) -> Optional[str]:
    return (os.environ if env is None else env).get(name)


def timeout_s(env: Optional[dict] = None) -> float:
    text = _get("FA_A2A_TIMEOUT_S", env)
    return DEFAULT_TIMEOUT_S if text is None else seconds(text, "FA_A2A_TIMEOUT_S")


def setup_timeout_s(env: Optional[dict] = None) -> float:
    text = _get("FA_A2A_SETUP_TIMEOUT_S", env)
    return DEFAULT_SETUP_TIMEOUT_S if text is None else seconds(text, "FA_A2A_SETUP_TIMEOUT_S")


def transport(env: Optional[dict] = None) -> str:
    text = _get("FA_A2A_TRANSPORT", env)
    if text is None:
        return "vmm"
    if text not in TRANSPORTS:
        raise ValueError(f"FA_A2A_TRANSPORT: expected one of {TRANSPORTS}, got {text!r}")
    return text


def check_joint(env: Optional[dict] = None) -> bool:
    text = _get("FA_A2A_CHECK_JOINT", env)
    if text not in (None, "", "0", "1"):
        raise ValueError(f"FA_A2A_CHECK_JOINT: expected 0 (off) or 1 (checksum the joint rows' data), got {text!r}")
    return text == "1"


def out_slots(env: Optional[dict] = None) -> int:
    """FA_A2A_OUT_SLOTS as an int in [0, MAX_OUT_SLOTS] (default OUT_SLOTS; 0: always copy out)."""
    text = _get("FA_A2A_OUT_SLOTS", env)
    if text is None:
        return OUT_SLOTS
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_OUT_SLOTS:
        raise ValueError(f"FA_A2A_OUT_SLOTS: expected an int in [0, {MAX_OUT_SLOTS}], got {text!r}")
    return n


def check_all() -> None:
    """Read every FA_A2A_* variable parsed here (ValueError naming a bad one); FA_A2A_IMPL is
    fa_a2a's (fa_a2a.engine.problem.check_settings reads it with these)."""
    from cute_kernels.compile_cache import enabled

    timeout_s(), setup_timeout_s(), transport(), check_joint(), out_slots(), enabled()
