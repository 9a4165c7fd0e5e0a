"""Peer buffers ("rank windows") and the in-stream barrier, behind one small interface.

A transport gives every rank P windows of one shape at a uniform stride W in its own address
space: `windows(name, shape, dtype)` returns a tensor [P, *shape] whose element [d] is rank d's
buffer (each window contiguous, dim-0 stride W, W a multiple of 16 bytes), plus
`pointer_table()` (int64 [P] window base addresses on the device) for kernels that take peers as
pointers. Kernels store into windows[d] and then call `barrier()`: an in-stream kernel
(cute_kernels/signal.py) with a device-resident epoch, so a captured CUDA graph replays it.

Failure handling (every wait is bounded; nothing hangs on a rank that failed or went away):
- In-stream barrier waits end after `timeout_s` (default 30 s, `FA_A2A_TIMEOUT_S`). A timeout is
  written to a host-mapped error mirror; from then on `barrier()` and `windows()` on this
  transport raise BarrierTimeoutError naming the rank that never arrived (no synchronization
  needed: the host reads the mirror). Barriers queued before the host saw it, and CUDA-graph
  replays, end at once with void results: call `check()` (synchronizes) after replays. A failed
  transport stays failed: `close_transports()` and build a new one.
- Setup (VmmTransport's creation and every new `windows()` allocation) is collective: after each
  step the ranks exchange their outcome and either all go on or all raise TransportSetupError
  naming the ranks that failed and why (no VMM or POSIX-fd support, a peer GPU this GPU cannot
  access, cuMemCreate out of memory, windows() calls that differ between ranks, a rank that does
  not arrive within `setup_timeout_s`, default 300 s, `FA_A2A_SETUP_TIMEOUT_S`). A rank that
  fails frees what it had created (handles, reservation, mappings). After a setup failure the
  transport refuses further use.

Backends:
  EmulatedTransport  one process plays P ranks: windows are one local buffer of P windows and
                     the barrier is one launch of P CTAs (CTA d plays rank d). Tests and
                     single-GPU development.
  VmmTransport       one process per rank, on one GPU (processes sharing it) or on distinct
                     GPUs of one node. Each rank cuMemCreate's its window with a POSIX-fd handle;
                     the fds go to every peer over a Unix socket (SCM_RIGHTS); each rank reserves
                     P*W of address space and cuMemMap's rank d's allocation at base + d*W. This
                     is the uniform-stride mapping the fused kernel's rank-window layout needs
                     (NVSHMEM lays out its symmetric heap the same way). Run on an H200
                     (2026-12-02) with 2 and 4 processes sharing the GPU (tests/gpu); not run on
                     distinct GPUs yet. The process group carries one exchange at creation (socket
                     address, host names, device checks; it may be gloo: NCCL refuses two ranks
                     on one GPU); every later setup step and `host_barrier()` go over the Unix
                     socket with `setup_timeout_s`. Ranks on several hosts are refused (the
                     abstract Unix socket does not leave the host).

  HostTransport      VmmTransport's processes with the post-A2A's (output) windows in pinned host
                     memory (POSIX shared memory mapped by every rank at one stride, registered
                     with cuMemHostRegister): each store into them crosses PCIe. On one GPU, the
                     slow link for real ranks (the store pacer's case, fa_a2a.engine.pacing). Backend "host".

  SymmetricMemoryTransport  ranks on distinct GPUs through torch symmetric memory
                     (torch.distributed._symmetric_memory, backend "symm", never chosen by
                     default). Window bases are buffer_ptrs[d] + the tensor's offset in its
                     pool segment (the same on every rank; read from this rank's own); the
                     rank-window layout needs them at one stride, which torch does not promise:
                     the transport checks each allocation and raises ValueError (use "vmm") when
                     they are not. It refuses ranks that share a device (seen on an H200). Not run
                     on a GPU yet (needs >= 2 GPUs); its waits are the process group's.

One process, several GPUs: `PeerMemory` maps memory created on other GPUs (or this one) into
this process with the VMM steps VmmTransport uses, without the handle exchange (the X-Stage
calibration's peer destination, fa_a2a.tools.calibrate --dest peer).

Collective calls: `windows()` with a new (name, shape, dtype) allocates, and every rank must
make the same calls in the same order (checked: name and size). Allocation is host-synchronous:
do it before CUDA-graph capture (a first, eager call).

Window reuse: each Ulysses call runs pre-A2A -> barrier -> attention -> post-A2A -> barrier ->
copy-out. A rank writes into a peer's windows only after passing a barrier that the peer
reached after it finished reading those windows in the previous call, so two barriers per
call make reuse across calls safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ulysses import env
from ulysses.transport_base import (BarrierTimeoutError, EmulatedTransport, Transport,  # noqa: F401 (named here)
                                    TransportSetupError, pinned_on_device, tensor_from_address)

if TYPE_CHECKING:  # the backends load on first use (__getattr__ below)
    from ulysses.symm import SymmetricMemoryTransport, uniform_window_stride
    from ulysses.vmm import HostTransport, PeerMemory, VmmTransport

__all__ = [
    "BarrierTimeoutError",
    "TransportSetupError",
    "Transport",
    "EmulatedTransport",
    "VmmTransport",
    "HostTransport",
    "SymmetricMemoryTransport",
    "PeerMemory",
    "uniform_window_stride",
    "get_transport",
    "close_transports",
    "tensor_from_address",
    "pinned_on_device",
]


_transports: dict = {}
BACKENDS = env.TRANSPORTS


def get_transport(group=None, *, backend: str | None = None, timeout_s: float | None = None,
                  setup_timeout_s: float | None = None) -> Transport:
    """The process's transport for `group` (created on first use; collective then).

    backend: "vmm" (default; ranks sharing a GPU or on distinct GPUs of one host), "host" (the data
    windows in pinned host memory shared by the ranks: every store crosses PCIe; HostTransport) or
    "symm" (torch symmetric memory, distinct GPUs only). `FA_A2A_TRANSPORT` overrides the default.
    timeout_s: in-stream barrier timeout (`FA_A2A_TIMEOUT_S`, default 30 s).
    setup_timeout_s: bound of every host-side setup wait (`FA_A2A_SETUP_TIMEOUT_S`, default 300 s).
    """
    import torch.distributed as dist

    from ulysses.symm import SymmetricMemoryTransport
    from ulysses.vmm import HostTransport, VmmTransport

    backend = backend or env.transport()
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} ('ipc' is 'vmm'), got {backend!r}")
    backend = "vmm" if backend == "ipc" else backend
    explicit_timeout = timeout_s is not None
    if timeout_s is None:
        timeout_s = env.timeout_s()
    if setup_timeout_s is None:
        setup_timeout_s = env.setup_timeout_s()
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not torch.cuda.is_available():
        raise ValueError("group: the transports' windows are GPU memory; no CUDA device is available here")
    key = (group.group_name, torch.cuda.current_device(), backend)
    cached = _transports.get(key)
    if cached is not None and not cached.closed and explicit_timeout and cached.timeout_s != timeout_s:
        raise ValueError(f"timeout_s: the transport of this group exists with timeout {cached.timeout_s:g} s; "
                         "close_transports() first to change it")
    if key not in _transports or _transports[key].closed:
        cls = {"symm": SymmetricMemoryTransport, "host": HostTransport}.get(backend, VmmTransport)
        _transports[key] = cls(group, timeout_s=timeout_s, setup_timeout_s=setup_timeout_s)
    return _transports[key]


def close_transports() -> None:
    """Close every cached transport (collective); raises the first close error after closing all."""
    first = None
    for t in _transports.values():
        try:
            t.close()
        except Exception as exc:
            first = first or exc
    _transports.clear()
    if first is not None:
        raise first


# The backends live in their own modules (ulysses.symm, ulysses.vmm), which import this one; they
# stay reachable here (ulysses.transport.VmmTransport, from ulysses.transport import PeerMemory).
_BACKEND_MODULES = {
    "SymmetricMemoryTransport": "ulysses.symm",
    "uniform_window_stride": "ulysses.symm",
    "VmmTransport": "ulysses.vmm",
    "HostTransport": "ulysses.vmm",
    "PeerMemory": "ulysses.vmm",
}


def __getattr__(name: str):
    module = _BACKEND_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
