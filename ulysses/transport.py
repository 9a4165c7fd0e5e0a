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
calibration's peer destination, fa_a2a.calibrate --dest peer).

Collective calls: `windows()` with a new (name, shape, dtype) allocates, and every rank must
make the same calls in the same order (checked: name and size). Allocation is host-synchronous:
do it before CUDA-graph capture (a first, eager call).

Window reuse: each Ulysses call runs pre-A2A -> barrier -> attention -> post-A2A -> barrier ->
copy-out. A rank writes into a peer's windows only after passing a barrier that the peer
reached after it finished reading those windows in the previous call, so two barriers per
call make reuse across calls safe.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # imported by `import torch` already

from ulysses import env
from ulysses.env import DEFAULT_SETUP_TIMEOUT_S, DEFAULT_TIMEOUT_S, seconds as _positive_seconds  # noqa: F401 (vmm's)

if TYPE_CHECKING:  # the backends' modules import this one: they load on first use (__getattr__ below)
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
]

# the memory of transports closed while tensors lent out of their windows lived: kept until the process exits
_KEPT: list = []


class BarrierTimeoutError(RuntimeError):
    """A barrier wait ran out of time; `missing` lists (waiting rank, missing rank, epoch)."""

    def __init__(self, message: str, missing: list[tuple[int, int, int]]):
        super().__init__(message)
        self.missing = missing


class TransportSetupError(RuntimeError):
    """A collective setup step failed; every rank raises it. `failures`: {rank: reason}."""

    def __init__(self, step: str, failures: dict[int, str]):
        parts = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        super().__init__(f"{step} failed ({parts})")
        self.step = step
        self.failures = dict(failures)


def tensor_from_address(address: int, nbytes: int, device: torch.device,
                        like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A uint8 tensor [nbytes] over memory mapped elsewhere (the tensor does not own it; its storage
    is its own), or one with like's dtype, shape and strides (like: a view of the memory at address)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    if like is None:
        t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    else:
        t = torch.empty(0, dtype=like.dtype, device=device).set_(storage, 0, like.shape, like.stride())
    if t.data_ptr() != address or t.device != device:
        raise RuntimeError(f"could not wrap address {address:#x} as a tensor on {device}")
    return t


def pinned_on_device(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 1-D tensor on `device` over new pinned host memory, the host tensor that owns the memory):
    the GPU's loads and stores of the first cross PCIe; keep the second alive while the first is used."""
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    return tensor_from_address(host.data_ptr(), numel * host.element_size(), device).view(dtype), host


def _windows_view(flat: torch.Tensor, world_size: int, window_bytes: int, shape, dtype) -> torch.Tensor:
    """[P, *shape] dtype view of a byte range holding P windows at stride window_bytes."""
    es = torch.empty(0, dtype=dtype).element_size()
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel * es > window_bytes or window_bytes % es:
        raise ValueError(f"shape: {shape} {dtype} does not fit a window of {window_bytes} bytes")
    contiguous = []
    acc = 1
    for s in reversed(shape):
        contiguous.append(acc)
        acc *= s
    stride = (window_bytes // es, *reversed(contiguous))
    return flat.view(dtype).as_strided((world_size, *shape), stride)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class Transport:
    """Common part: window cache, signal pad, epoch/error tensors, barrier and its check."""

    world_size: int
    device: torch.device
    #: ranks this process drives: range(P) when emulated, (rank,) otherwise.
    local_ranks: Sequence[int]
    #: ranks of the group whose kernels run at once on this rank's GPU (1: emulated ranks run in turn)
    ranks_per_gpu: int = 1
    #: whether a call's output may stay in its window (fa_a2a.engine.forward's delivery): not where the
    #: windows are host memory, which every later read would cross PCIe for
    lends_outputs: bool = True
    #: whether the pre-A2A's (input) windows sit behind another link than the post-A2A's (output)
    #: windows (fa_a2a.engine.pacing.link_gbps measures each then)
    split_links: bool = False

    def __init__(self, world_size: int, device: torch.device, local_ranks: Sequence[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S, setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S):
        from cute_kernels.signal import MAX_WORLD_SIZE

        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size: must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
        self.timeout_s = _positive_seconds(timeout_s, "timeout_s")
        self.setup_timeout_s = _positive_seconds(setup_timeout_s, "setup_timeout_s")
        self.world_size = world_size
        self.device = device
        self.local_ranks = tuple(local_ranks)
        self._windows: dict = {}
        self._ptr_tables: dict = {}
        self._lent: dict = {}  # address -> StorageWeakRef of the tensor lent at it (lend)
        self.used_on: dict = {}  # window address -> the CUDA stream its last output was delivered on
        self.captured: dict = {}  # window address -> id of the CUDA-graph capture that owns it
        self.closed = False
        self._failure: Optional[Exception] = None  # set once; every later call raises it
        self._barrier_launch = None  # the barrier kernel's launch, prepared at the first barrier()
        n = len(self.local_ranks)
        self.epoch = torch.zeros(n, dtype=torch.int32, device=device)
        self.error = torch.zeros(n, world_size, dtype=torch.int32, device=device)
        # host-visible mirror of `error` (pinned, mapped): the host sees a timeout without a sync
        self.error_host = (torch.zeros(n, world_size, dtype=torch.int32, pin_memory=True)
                           if device.type == "cuda" else None)
        self._error_host_np = self.error_host.numpy() if self.error_host is not None else None
        self._no_error = bytes(self._error_host_np.nbytes) if self.error_host is not None else b""
        self.signal = self.windows("__signal__", (world_size,), torch.int32)

    # ---- backend hooks ---------------------------------------------------------------------
    def _allocate(self, name: str, nbytes: int) -> tuple[torch.Tensor, int]:
        """Collective: a uint8 tensor over P windows and the window stride in bytes."""
        raise NotImplementedError

    def host_barrier(self, timeout_s: Optional[float] = None) -> None:
        """Host-side barrier of all ranks (plan set-up and teardown). Emulated: nothing to wait for."""

    def host_allgather(self, step: str, value) -> list:
        """Every rank's (picklable) value, by rank, from every rank of this process (collective on
        the host, like host_barrier). Emulated: the one process's value for each local rank."""
        return [value] * self.world_size

    # ---- state -----------------------------------------------------------------------------
    def _usable(self, what: str) -> None:
        """Raise if this transport is closed or has failed (a barrier timeout seen by the host)."""
        if self.closed:
            raise RuntimeError(f"{what}: this transport is closed")
        if self._failure is None and self._error_host_np is not None and self._error_host_np.tobytes() != self._no_error:
            self._failure = self._timeout_error(self.error_host)
        f = self._failure
        if isinstance(f, BarrierTimeoutError):
            raise BarrierTimeoutError(f"{what} refused, this transport failed earlier: {f}", f.missing)
        if isinstance(f, TransportSetupError):
            raise TransportSetupError(f"{what} refused, this transport failed earlier at {f.step}", f.failures)

    def _fail(self, exc: Exception) -> Exception:
        if self._failure is None:
            self._failure = exc
        return exc

    # ---- windows ---------------------------------------------------------------------------
    def windows(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """[P, *shape] windows (zero-filled when first allocated), cached per (name, shape, dtype)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape: sizes must be >= 0, got {shape}")
        key = (name, shape, dtype)
        self._usable("windows")
        if key not in self._windows:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"windows {name!r} {shape} {dtype} are allocated during CUDA-graph capture: "
                    "run the call once eagerly before capturing")
            nbytes = max(math.prod(shape) * torch.empty(0, dtype=dtype).element_size(), 16)
            flat, window_bytes = self._allocate(f"{name}:{shape}:{dtype}", nbytes)
            self._windows[key] = _windows_view(flat, self.world_size, window_bytes, shape, dtype)
        return self._windows[key]

    def allocated(self, name: str, shape: tuple, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The windows() tensor of (name, shape: a tuple of ints, dtype) if it is allocated, else
        None (no collective)."""
        return self._windows.get((name, shape, dtype))

    def allocated_windows(self) -> list[torch.Tensor]:
        """Every windows() tensor allocated so far ([P, *shape] each), the signal pad excluded."""
        return [w for (name, _, _), w in self._windows.items() if name != "__signal__"]

    # ---- tensors lent out of windows (zero-copy delivery, fa_a2a.engine.forward) ------------------------
    def lend(self, view: torch.Tensor) -> torch.Tensor:
        """A contiguous view into one of the windows as a tensor of its own storage, for the caller
        to hand out; lent(view.data_ptr()) then says whether it (or any view of it) is alive. The
        transport keeps its memory past close() while one is (with a warning). ~4 us of host time
        (a 2-core CPU machine)."""
        if not view.is_contiguous():
            raise ValueError(f"view: expected a contiguous view into a window, got strides {view.stride()}")
        t = tensor_from_address(view.data_ptr(), view.numel() * view.element_size(), view.device, like=view)
        self._lent[view.data_ptr()] = StorageWeakRef(t.untyped_storage())  # expired() once no tensor uses it
        return t

    def lent(self, address: int) -> bool:
        """Whether the tensor lent at `address` is alive."""
        ref = self._lent.get(address)
        if ref is None:
            return False
        if ref.expired():
            del self._lent[address]
            return False
        return True

    def _keep_if_lent(self, memory) -> bool:
        """At close: keep `memory` (what backs the windows) until the process exits when a lent
        tensor is alive, and say so. Returns whether it was kept."""
        alive = sum(self.lent(a) for a in list(self._lent))
        if alive:
            _KEPT.append(memory)
            logging.getLogger("fa_a2a").warning(
                "closing a transport while %d output tensor(s) still live in its windows: its window memory "
                "stays allocated until the process exits", alive)
        return bool(alive)

    def pointer_table(self, windows: torch.Tensor) -> torch.Tensor:
        """int64 [P] device tensor of the window base addresses of a windows() tensor."""
        key = (windows.data_ptr(), windows.stride(0))
        if key not in self._ptr_tables:
            es = windows.element_size()
            ptrs = [windows.data_ptr() + d * windows.stride(0) * es for d in range(self.world_size)]
            self._ptr_tables[key] = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        return self._ptr_tables[key]

    # ---- barrier ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """In-stream barrier of all ranks on the current stream (graph-capturable).

        Raises BarrierTimeoutError, without synchronizing, once an earlier barrier of this
        transport is seen to have timed out."""
        self._usable("barrier")
        if self._barrier_launch is None:  # checked and compiled once; the buffers never change
            from cute_kernels.signal import barrier_launcher

            self._barrier_launch = barrier_launcher(self.signal[:, : self.world_size], self.epoch, self.error,
                                                    self.local_ranks[0], int(self.timeout_s * 1e9),
                                                    error_host=self.error_host)
        self._barrier_launch()

    def _timeout_error(self, error: torch.Tensor) -> Optional[BarrierTimeoutError]:
        missing = [(self.local_ranks[j], int(q), int(error[j, q]))
                   for j, q in zip(*torch.nonzero(error, as_tuple=True))]
        if not missing:
            return None
        parts = [f"rank {r} waited {self.timeout_s:g} s at barrier epoch {e} for rank {q}, "
                 "which never arrived" for r, q, e in missing]
        return BarrierTimeoutError("; ".join(parts), missing)

    def check(self) -> None:
        """Raise BarrierTimeoutError if any barrier of this process timed out (synchronizes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        err = self._timeout_error(self.error.cpu())
        if err is not None:
            raise self._fail(err)

    def close(self) -> None:
        """Drop the windows; tensors obtained from windows() must not be used afterwards."""
        self.closed = True
        self._windows.clear()
        self._ptr_tables.clear()


class EmulatedTransport(Transport):
    """P virtual ranks in one process: windows are P slices of one local buffer."""

    def __init__(self, world_size: int, device=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._buffers: list[torch.Tensor] = []
        super().__init__(world_size, device, range(world_size), timeout_s)

    def _allocate(self, name: str, nbytes: int):
        window_bytes = _round_up(nbytes, 128)
        flat = torch.zeros(self.world_size * window_bytes, dtype=torch.uint8, device=self.device)
        self._buffers.append(flat)
        return flat, window_bytes

    def close(self) -> None:
        super().close()
        self._buffers.clear()


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
