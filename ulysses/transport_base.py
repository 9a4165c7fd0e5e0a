"""The transport's base: the Transport interface (windows, barrier, lending), its errors, the
emulated transport, and helpers the backends share. ulysses.transport describes it all and builds
a group's transport (get_transport); the backends (ulysses.vmm, ulysses.symm) subclass Transport
from here, so no module imports the one that imports it.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # imported by `import torch` already

from ulysses.env import DEFAULT_SETUP_TIMEOUT_S, DEFAULT_TIMEOUT_S, seconds as _positive_seconds  # noqa: F401 (vmm's)

__all__ = ["BarrierTimeoutError", "TransportSetupError", "Transport", "EmulatedTransport", "tensor_from_address",
           "pinned_on_device"]

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


def _sizes(shape) -> tuple:
    """A window shape as ints (2.7 is no size: int() would take 2; a bool is no size either)."""
    import operator

    try:
        if any(isinstance(n, bool) for n in shape):
            raise TypeError
        return tuple(operator.index(n) for n in shape)
    except TypeError:
        raise ValueError(f"shape: expected a sequence of ints, got {shape!r}") from None


def _windows_view(flat: torch.Tensor, world_size: int, window_bytes: int, shape, dtype) -> torch.Tensor:
    """[P, *shape] dtype view of a byte range holding P windows at stride window_bytes."""
    es = torch.empty(0, dtype=dtype).element_size()
    shape = _sizes(shape)
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
        shape = _sizes(shape)
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
