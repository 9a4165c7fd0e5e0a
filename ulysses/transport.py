"""Peer buffers ("rank windows") and the in-stream barrier, behind one small interface.

A transport gives every rank P windows of one shape at a uniform stride W in its own address
space: `windows(name, shape, dtype)` returns a tensor [P, *shape] whose element [d] is rank d's
buffer (each window contiguous, dim-0 stride W, W a multiple of 16 bytes), plus
`pointer_table()` (int64 [P] window base addresses on the device) for kernels that take peers as
pointers. Kernels store into windows[d] and then call `barrier()`: an in-stream kernel
(cute_kernels/signal.py) with a device-resident epoch, so a captured CUDA graph replays it.
Waits are bounded (`timeout_s`); `check()` turns a timeout into BarrierTimeoutError naming the
rank that never arrived.

Backends:
  EmulatedTransport  one process plays P ranks: windows are one local buffer of P windows and
                     the barrier is one launch of P CTAs (CTA d plays rank d). Tests and
                     single-GPU development.
  VmmTransport       one process per rank, on one GPU (processes sharing it) or on distinct
                     GPUs. Each rank cuMemCreate's its window with a POSIX-fd handle; the fds go
                     to every peer over a Unix socket (SCM_RIGHTS); each rank reserves P*W of
                     address space and cuMemMap's rank d's allocation at base + d*W. This is the
                     uniform-stride mapping the fused kernel's rank-window layout needs (NVSHMEM
                     lays out its symmetric heap the same way). The mapping steps were seen
                     working on an H200 (2026-12-02, cuda-bindings 13.3.1, 2 MiB granularity, two
                     processes, cuMemsetD32 into the peer window); this class: not run on a GPU yet.
                     Bootstrap traffic (socket address, checks) goes over the process group,
                     which may be gloo: NCCL refuses two ranks on one GPU.

  SymmetricMemoryTransport  ranks on distinct GPUs through torch symmetric memory
                     (torch.distributed._symmetric_memory, backend "symm"). Its buffer_ptrs are
                     not promised to sit at one stride, which the rank-window layout needs: the
                     transport checks each allocation and raises ValueError (use "vmm") when the
                     peers' buffers are not at one positive stride. It refuses ranks that share a
                     device (seen on an H200). Not run on a GPU yet (needs >= 2 GPUs).

Collective calls: `windows()` with a new (name, shape, dtype) allocates, and every rank must
make the same calls in the same order (VmmTransport checks name and size against its peers).
Allocation is host-synchronous: do it before CUDA-graph capture (a first, eager call).

Window reuse: each Ulysses call runs pre-A2A -> barrier -> attention -> post-A2A -> barrier ->
copy-out. A rank writes into a peer's windows only after passing a barrier that the peer
reached after it finished reading those windows in the previous call, so two barriers per
call make reuse across calls safe.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from typing import Sequence

import torch

__all__ = [
    "BarrierTimeoutError",
    "Transport",
    "EmulatedTransport",
    "VmmTransport",
    "SymmetricMemoryTransport",
    "uniform_window_stride",
    "get_transport",
    "rank_windows",
    "close_transports",
    "tensor_from_address",
]

DEFAULT_TIMEOUT_S = 30.0


class BarrierTimeoutError(RuntimeError):
    """A barrier wait ran out of time; `missing` lists (waiting rank, missing rank, epoch)."""

    def __init__(self, message: str, missing: list[tuple[int, int, int]]):
        super().__init__(message)
        self.missing = missing


def tensor_from_address(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor [nbytes] over memory this module mapped (the tensor does not own it)."""
    try:
        storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
        t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    except (AttributeError, RuntimeError, TypeError):

        class _Interface:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                        "strides": None, "version": 2}

        t = torch.as_tensor(_Interface(), device=device)
    if t.data_ptr() != address or t.device != device:
        raise RuntimeError(f"could not wrap address {address:#x} as a tensor on {device}")
    return t


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


class Transport:
    """Common part: window cache, signal pad, epoch/error tensors, barrier and its check."""

    world_size: int
    device: torch.device
    #: ranks this process drives: range(P) when emulated, (rank,) otherwise.
    local_ranks: Sequence[int]

    def __init__(self, world_size: int, device: torch.device, local_ranks: Sequence[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        from cute_kernels.signal import MAX_WORLD_SIZE

        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size: must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.world_size = world_size
        self.device = device
        self.local_ranks = tuple(local_ranks)
        self.timeout_s = float(timeout_s)
        self._windows: dict = {}
        self._ptr_tables: dict = {}
        self.closed = False
        n = len(self.local_ranks)
        self.epoch = torch.zeros(n, dtype=torch.int32, device=device)
        self.error = torch.zeros(n, world_size, dtype=torch.int32, device=device)
        self.signal = self.windows("__signal__", (world_size,), torch.int32)

    # ---- backend hooks ---------------------------------------------------------------------
    def _allocate(self, name: str, nbytes: int) -> tuple[torch.Tensor, int]:
        """Collective: a uint8 tensor over P windows and the window stride in bytes."""
        raise NotImplementedError

    def host_barrier(self) -> None:
        """Host-side barrier of all ranks (bootstrap and teardown only)."""

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
        if self.closed:
            raise RuntimeError("windows: this transport is closed")
        if key not in self._windows:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"windows {name!r} {shape} {dtype} are allocated during CUDA-graph capture: "
                    "run the call once eagerly before capturing")
            nbytes = max(math.prod(shape) * torch.empty(0, dtype=dtype).element_size(), 16)
            flat, window_bytes = self._allocate(f"{name}:{shape}:{dtype}", nbytes)
            self._windows[key] = _windows_view(flat, self.world_size, window_bytes, shape, dtype)
        return self._windows[key]

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
        """In-stream barrier of all ranks on the current stream (graph-capturable)."""
        from cute_kernels.signal import barrier

        barrier(self.signal[:, : self.world_size], self.epoch, self.error,
                self.local_ranks[0], int(self.timeout_s * 1e9))

    def check(self) -> None:
        """Raise BarrierTimeoutError if any barrier of this process timed out (synchronizes)."""
        error = self.error.cpu()
        missing = [(self.local_ranks[j], int(q), int(error[j, q]))
                   for j, q in zip(*torch.nonzero(error, as_tuple=True))]
        if missing:
            parts = [f"rank {r} waited {self.timeout_s:g} s at barrier epoch {e} for rank {q}, "
                     "which never arrived" for r, q, e in missing]
            raise BarrierTimeoutError("; ".join(parts), missing)

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


def uniform_window_stride(buffer_ptrs: Sequence[int], nbytes: int) -> int:
    """The stride W (bytes) at which peers' buffers of `nbytes` sit: buffer_ptrs[d] = ptrs[0] + d*W.

    Raises ValueError when they do not sit at one positive stride, a multiple of 16 bytes, with
    room for nbytes in each window (the rank-window layout then cannot address them)."""
    ptrs = [int(p) for p in buffer_ptrs]
    if not ptrs:
        raise ValueError("buffer_ptrs: empty")
    if len(ptrs) == 1:
        return _round_up(nbytes, 128)
    stride = ptrs[1] - ptrs[0]
    uniform = all(p == ptrs[0] + d * stride for d, p in enumerate(ptrs))
    if not uniform or stride < nbytes or stride % 16:
        raise ValueError(
            f"buffer_ptrs: peers' buffers are not at one positive stride >= {nbytes} bytes "
            f"(offsets from rank 0: {[p - ptrs[0] for p in ptrs]}); use the 'vmm' transport")
    return stride


class SymmetricMemoryTransport(Transport):
    """One process per GPU; windows are torch symmetric-memory buffers that sit at one stride."""

    def __init__(self, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized")
        self.group = group if group is not None else dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: SymmetricMemoryTransport needs a CUDA device, got {device}")
        self._buffers: list[torch.Tensor] = []
        super().__init__(dist.get_world_size(self.group), device, (dist.get_rank(self.group),), timeout_s)

    def host_barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _allocate(self, name: str, nbytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        import torch.distributed as dist

        handle = symm_mem.rendezvous(buf, self.group.group_name)
        # each rank sees its own addresses: agree before raising, or the ranks that passed would
        # wait for the others in the host barrier below
        refusal = None
        try:
            window_bytes = uniform_window_stride(handle.buffer_ptrs, nbytes)
        except ValueError as exc:
            refusal = exc
        ok = torch.tensor([refusal is None], dtype=torch.int32, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not ok.item():
            del handle, buf
            raise refusal or ValueError(
                "buffer_ptrs: a peer's buffers are not at one positive stride; use the 'vmm' transport")
        buf.zero_()
        torch.cuda.synchronize(self.device)
        self.host_barrier()  # every window zeroed before any peer stores into it
        self._buffers.append(buf)
        span = (self.world_size - 1) * window_bytes + nbytes
        return tensor_from_address(int(handle.buffer_ptrs[0]), span, self.device), window_bytes

    def close(self) -> None:
        super().close()
        self._buffers.clear()


# ---- CUDA VMM ----------------------------------------------------------------------------------
def _cu():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    """Unpack a cuda.bindings result tuple, raising on an error code."""
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name} ({msg.decode() if msg else ''})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class VmmTransport(Transport):
    """One process per rank; peers' windows mapped at a uniform stride with CUDA VMM."""

    def __init__(self, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist
        from multiprocessing.connection import Listener

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized")
        self.group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(self.group)
        world_size = dist.get_world_size(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: VmmTransport needs a CUDA device, got {device}")
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # create and bind the primary context
        cu = _cu()
        self._dev = device.index
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._dev
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = prop
        self._granularity = int(_check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self._mappings: list[tuple[int, int, list]] = []  # (base, P*W, handles)
        self._rank = rank
        # Unix-socket listener for fd passing; its address is shared over the group.
        token = uuid.uuid4().hex[:12]
        tokens = [None] * world_size
        dist.all_gather_object(tokens, (token, os.getpid()), group=self.group)
        self._addresses = [f"\0fa_a2a.{tokens[0][0]}.{r}" for r in range(world_size)]
        self._listener = Listener(self._addresses[rank], family="AF_UNIX")
        self._alloc_count = 0
        dist.barrier(group=self.group)
        super().__init__(world_size, device, (rank,), timeout_s)

    @property
    def rank(self) -> int:
        return self._rank

    def host_barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _exchange_fds(self, fd: int, tag: tuple) -> list[int]:
        """Send this rank's fd to every peer and receive theirs (SCM_RIGHTS over Unix sockets).

        Each peer connects exactly once per allocation, and _allocate ends with a host barrier,
        so a connection accepted here always belongs to this allocation (the tag checks it).
        """
        from multiprocessing.connection import Client
        from multiprocessing.reduction import recv_handle, send_handle

        P, me = self.world_size, self._rank
        failure: list[BaseException] = []

        def serve():
            try:
                for _ in range(P - 1):
                    with self._listener.accept() as conn:
                        peer = conn.recv()
                        conn.send(tag)
                        send_handle(conn, fd, peer)
            except BaseException as exc:  # surfaced below
                failure.append(exc)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        fds = [-1] * P
        fds[me] = fd
        for q in range(P):
            if q == me:
                continue
            with Client(self._addresses[q], family="AF_UNIX") as conn:
                conn.send(os.getpid())
                peer_tag = conn.recv()
                if peer_tag != tag:
                    raise RuntimeError(f"rank {q} allocated {peer_tag} while rank {me} allocated {tag}: "
                                       "windows() calls must match on all ranks")
                fds[q] = recv_handle(conn)
        server.join()
        if failure:
            raise RuntimeError(f"rank {me}: sending its window handle failed") from failure[0]
        return fds

    def _allocate(self, name: str, nbytes: int):
        cu = _cu()
        P = self.world_size
        W = _round_up(nbytes, self._granularity)
        self._alloc_count += 1
        handle = _check(cu.cuMemCreate(W, self._prop, 0), "cuMemCreate")
        fd = int(_check(cu.cuMemExportToShareableHandle(
            handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle"))
        try:
            fds = self._exchange_fds(fd, (self._alloc_count, name, W))
        finally:
            os.close(fd)
        handles = [handle]
        by_rank = [None] * P
        by_rank[self._rank] = handle
        for q in range(P):
            if q == self._rank:
                continue
            try:
                h = _check(cu.cuMemImportFromShareableHandle(
                    fds[q], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    f"cuMemImportFromShareableHandle(rank {q})")
            finally:
                os.close(fds[q])
            handles.append(h)
            by_rank[q] = h
        base = int(_check(cu.cuMemAddressReserve(P * W, self._granularity, 0, 0), "cuMemAddressReserve"))
        for q in range(P):
            _check(cu.cuMemMap(base + q * W, W, 0, by_rank[q], 0), f"cuMemMap(rank {q})")
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self._dev
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(base, P * W, [desc], 1), "cuMemSetAccess")
        self._mappings.append((base, P * W, handles))
        flat = tensor_from_address(base, P * W, self.device)
        # Zero this rank's own window, then make sure every rank did before anyone signals.
        flat[self._rank * W:(self._rank + 1) * W].zero_()
        torch.cuda.synchronize(self.device)
        self.host_barrier()
        return flat, W

    def close(self) -> None:
        """Unmap everything (collective: peers may still be writing until the host barrier)."""
        if not self._mappings:
            return
        cu = _cu()
        torch.cuda.synchronize(self.device)
        self.host_barrier()
        super().close()
        for base, size, handles in self._mappings:
            _check(cu.cuMemUnmap(base, size), "cuMemUnmap")
            _check(cu.cuMemAddressFree(base, size), "cuMemAddressFree")
            for h in handles:
                _check(cu.cuMemRelease(h), "cuMemRelease")
        self._mappings.clear()
        self._listener.close()


_transports: dict = {}


def get_transport(group=None, *, backend: str | None = None, timeout_s: float | None = None) -> Transport:
    """The process's transport for `group` (created on first use; collective then).

    backend: "vmm" (default; ranks sharing a GPU or on distinct GPUs) or "symm" (torch symmetric
    memory, distinct GPUs only). `FA_A2A_TRANSPORT` overrides the default. `FA_A2A_TIMEOUT_S` sets
    the barrier timeout (default 30 s).
    """
    import torch.distributed as dist

    backend = backend or os.environ.get("FA_A2A_TRANSPORT", "vmm")
    if backend not in ("vmm", "ipc", "symm"):
        raise ValueError(f"backend: expected 'vmm' (or its alias 'ipc') or 'symm', got {backend!r}")
    backend = "vmm" if backend == "ipc" else backend
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized")
    if group is None:
        group = dist.group.WORLD
    explicit_timeout = timeout_s is not None
    if timeout_s is None:
        timeout_s = float(os.environ.get("FA_A2A_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    key = (group.group_name, torch.cuda.current_device(), backend)
    cached = _transports.get(key)
    if cached is not None and not cached.closed and explicit_timeout and cached.timeout_s != timeout_s:
        raise ValueError(f"timeout_s: the transport of this group exists with timeout {cached.timeout_s:g} s; "
                         "close_transports() first to change it")
    if key not in _transports or _transports[key].closed:
        cls = SymmetricMemoryTransport if backend == "symm" else VmmTransport
        _transports[key] = cls(group, timeout_s=timeout_s)
    return _transports[key]


def rank_windows(shape, *, dtype: torch.dtype, device=None, group=None, name: str = "rank_windows") -> torch.Tensor:
    """Windows [P, *shape[1:]] of the group's transport (collective on first use per shape).

    shape[0] must be the group size P. `device` must be the current CUDA device (or None).
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape: expected (P, ...)")
    if device is not None and torch.device(device) != torch.device("cuda", torch.cuda.current_device()):
        raise ValueError(f"device: {device} is not the current CUDA device")
    transport = get_transport(group)
    if shape[0] != transport.world_size:
        raise ValueError(f"shape: dim 0 ({shape[0]}) must be the group size {transport.world_size}")
    return transport.windows(name, shape[1:], dtype)


def close_transports() -> None:
    """Close every cached transport (collective)."""
    for t in _transports.values():
        t.close()
    _transports.clear()
