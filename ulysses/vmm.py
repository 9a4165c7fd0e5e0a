"""CUDA VMM rank windows: the driver helpers, PeerMemory, VmmTransport, and HostTransport with
its windows in pinned host memory shared by the rank processes. See ulysses.transport."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Optional, Sequence

import torch

from ulysses.bootstrap import _Bootstrap
from ulysses.transport_base import (DEFAULT_SETUP_TIMEOUT_S, DEFAULT_TIMEOUT_S, Transport, TransportSetupError,
                               _positive_seconds, _reason, _round_up, tensor_from_address)

__all__ = ["PeerMemory", "VmmTransport", "HostTransport", "map_host_windows", "unmap_host_windows"]


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


def _pci_bus_id(ordinal: int) -> str:
    cu = _cu()
    dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    return _check(cu.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId").split(b"\0")[0].decode()


def _can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    """Whether `ordinal` can map memory that lives on `peer_ordinal` (same device: yes)."""
    if ordinal == peer_ordinal:
        return True
    cu = _cu()
    dev, peer = (_check(cu.cuDeviceGet(o), "cuDeviceGet") for o in (ordinal, peer_ordinal))
    return bool(_check(cu.cuDeviceCanAccessPeer(dev, peer), "cuDeviceCanAccessPeer"))


def _vmm_allocation_prop(ordinal: int, posix_fd: bool):
    """(CUmemAllocationProp, granularity in bytes) of PINNED memory on GPU `ordinal`, exportable as
    a POSIX fd when `posix_fd`; RuntimeError when the GPU lacks VMM (or that handle type)."""
    cu = _cu()
    cu_dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = cu.CUdevice_attribute
    if not _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_dev),
                  "cuDeviceGetAttribute"):
        raise RuntimeError(f"GPU {ordinal} does not support CUDA virtual memory management")
    if posix_fd and not _check(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu_dev), "cuDeviceGetAttribute"):
        raise RuntimeError(f"GPU {ordinal} cannot export POSIX file-descriptor memory handles")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = (cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix_fd
                                 else cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)
    granularity = int(_check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"))
    return prop, granularity


def _vmm_map(handles: Sequence, chunk: int, alignment: int, access: Sequence[Sequence[int]],
             names: Optional[Sequence[str]] = None) -> int:
    """Reserve len(handles)·chunk bytes of address space, map handles[i] (chunk bytes each) at
    base + i·chunk and give the GPUs access[i] read/write access to it; returns base. All or
    nothing: on an error what was mapped is unmapped and the range freed before it raises."""
    cu = _cu()
    n = len(handles)
    names = names or [f"chunk {i}" for i in range(n)]
    base = int(_check(cu.cuMemAddressReserve(n * chunk, alignment, 0, 0), "cuMemAddressReserve"))
    mapped = []
    try:
        for i, h in enumerate(handles):
            _check(cu.cuMemMap(base + i * chunk, chunk, 0, h, 0), f"cuMemMap({names[i]})")
            mapped.append(i)
        for i in range(n):
            descs = []
            for ordinal in access[i]:
                desc = cu.CUmemAccessDesc()
                desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = int(ordinal)
                desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                descs.append(desc)
            _check(cu.cuMemSetAccess(base + i * chunk, chunk, descs, len(descs)), f"cuMemSetAccess({names[i]})")
    except BaseException:
        for i in mapped:
            cu.cuMemUnmap(base + i * chunk, chunk)
        cu.cuMemAddressFree(base, n * chunk)
        raise
    return base


class PeerMemory:
    """GPU memory mapped into this process at one virtual range with VmmTransport's VMM steps
    (_vmm_allocation_prop, cuMemCreate on the owner, _vmm_map), without a handle exchange: one
    process drives every GPU involved (the X-Stage calibration's peer destination).

    Chunk i (`chunk_bytes`, a multiple of the allocation granularity; default the whole size) is
    created on owners[i % len(owners)] and mapped at address + i·chunk_bytes, readable and writable
    from every GPU in `access` and from its owner. owners == access == [d] maps a GPU's own memory
    (the same path on one GPU). Every GPU in `access` must be able to access every owner
    (cuDeviceCanAccessPeer): ValueError before anything is created otherwise. A failed set-up
    frees what it made; close() (or leaving the `with`) synchronizes the GPUs and frees the rest.
    """

    def __init__(self, owners: Sequence[int], access: Sequence[int], nbytes: int,
                 chunk_bytes: Optional[int] = None):
        torch.cuda.init()
        cu = _cu()
        count = int(_check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        for arg, devs in (("owners", owners), ("access", access)):
            if not devs or any(not isinstance(d, int) or not 0 <= d < count for d in devs):
                raise ValueError(f"{arg}: expected a non-empty list of GPU indices in [0, {count}), got {list(devs)}")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
        refused = [f"GPU {a} cannot access the memory of GPU {o}"
                   for a in dict.fromkeys(access) for o in dict.fromkeys(owners) if not _can_access_peer(a, o)]
        if refused:
            raise ValueError(f"access: {'; '.join(refused)} (cuDeviceCanAccessPeer)")
        props = {o: _vmm_allocation_prop(o, posix_fd=False) for o in dict.fromkeys(owners)}
        granularity = max(g for _, g in props.values())
        if chunk_bytes is None:
            chunk_bytes = _round_up(nbytes, granularity)
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % granularity:
            raise ValueError(f"chunk_bytes: expected a positive multiple of the allocation granularity "
                             f"({granularity} bytes), got {chunk_bytes!r}")
        self.owners, self.access = list(owners), list(dict.fromkeys(access))
        self.chunk_bytes = chunk_bytes
        self.n_chunks = -(-nbytes // chunk_bytes)
        self.nbytes = self.n_chunks * chunk_bytes
        self.address = None
        self._handles: list = []
        try:
            for i in range(self.n_chunks):
                o = self.owner_of(i)
                self._handles.append(_check(cu.cuMemCreate(chunk_bytes, props[o][0], 0),
                                            f"cuMemCreate({chunk_bytes} bytes on GPU {o})"))
            self.address = _vmm_map(self._handles, chunk_bytes, granularity,
                                    [tuple(dict.fromkeys([*self.access, self.owner_of(i)])) for i in range(self.n_chunks)],
                                    names=[f"chunk {i} of GPU {self.owner_of(i)}" for i in range(self.n_chunks)])
        except BaseException:
            for h in self._handles:
                cu.cuMemRelease(h)
            self._handles.clear()
            raise

    def owner_of(self, chunk: int) -> int:
        """The GPU whose memory backs chunk `chunk`."""
        return self.owners[chunk % len(self.owners)]

    def tensor(self, device) -> torch.Tensor:
        """uint8 [nbytes] over the whole range, labelled with `device` (one of `access`, or an owner
        reading only its own chunks); kernels on that GPU store through it."""
        if self.address is None:
            raise RuntimeError("tensor: this PeerMemory is closed")
        return tensor_from_address(self.address, self.nbytes, torch.device(device))

    def close(self) -> None:
        if self.address is None:
            return
        cu = _cu()
        for d in dict.fromkeys([*self.access, *self.owners]):
            torch.cuda.synchronize(d)
        first = None
        calls = [(cu.cuMemUnmap, (self.address + i * self.chunk_bytes, self.chunk_bytes)) for i in range(self.n_chunks)]
        calls += [(cu.cuMemAddressFree, (self.address, self.nbytes))] + [(cu.cuMemRelease, (h,)) for h in self._handles]
        for fn, args in calls:
            try:
                _check(fn(*args), fn.__name__)
            except RuntimeError as exc:
                first = first or exc
        self.address = None
        self._handles.clear()
        if first is not None:
            raise first

    def __enter__(self) -> "PeerMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

class VmmTransport(Transport):
    """One process per rank; peers' windows mapped at a uniform stride with CUDA VMM."""

    def __init__(self, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized")
        setup_timeout_s = _positive_seconds(setup_timeout_s, "setup_timeout_s")
        self.group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(self.group)
        world_size = dist.get_world_size(self.group)
        self._rank = rank
        self._mappings: list[tuple[int, int, list]] = []  # (base, P*W, handles)
        self._bootstrap: Optional[_Bootstrap] = None
        # Step 1, local: device, VMM and POSIX-fd support, the root's socket (listening before the
        # exchange, so a refused connection later means the root is gone). Outcomes go to every
        # rank in the one process-group exchange: all ranks raise together or go on together.
        token = uuid.uuid4().hex[:16]
        problem, bus_id = None, None
        try:
            device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"device: VmmTransport needs a CUDA device, got {device}")
            bus_id = self._probe(device)
            if rank == 0:
                self._bootstrap = _Bootstrap(0, world_size, f"\0fa_a2a.{token}", setup_timeout_s)
        except Exception as exc:  # reported to every rank below
            problem = _reason(exc)
        info = {"token": token, "host": socket.gethostname(), "bus_id": bus_id, "problem": problem}
        infos = [None] * world_size
        try:
            dist.all_gather_object(infos, info, group=self.group)
            failures = {r: x["problem"] for r, x in enumerate(infos) if x["problem"]}
            if failures:
                raise TransportSetupError("VmmTransport set-up", failures)
            hosts = sorted({x["host"] for x in infos})
            if len(hosts) > 1:
                raise ValueError(f"group: the VMM transport needs every rank on one host (its handles travel "
                                 f"over a Unix socket); the ranks are on {hosts}")
            if rank != 0:
                self._bootstrap = _Bootstrap(rank, world_size, f"\0fa_a2a.{infos[0]['token']}", setup_timeout_s)
            #: ranks of the group that run on this rank's GPU (concurrently under MPS), this one included
            self.ranks_per_gpu = sum(x["bus_id"] == bus_id for x in infos)
            # Step 2: every rank can map every peer's GPU.
            try:
                problem = self._peer_problem([x["bus_id"] for x in infos])
            except Exception as exc:
                problem = _reason(exc)
            self._agree("VmmTransport peer access", problem)
            super().__init__(world_size, device, (rank,), timeout_s, setup_timeout_s)
        except BaseException:
            self._release_all()
            raise

    def _probe(self, device: torch.device) -> str:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # create and bind the primary context
        self._dev = device.index
        self._prop, self._granularity = _vmm_allocation_prop(self._dev, posix_fd=True)
        return _pci_bus_id(self._dev)

    def _peer_problem(self, bus_ids: list[str]) -> Optional[str]:
        """Why this rank cannot map some peer's memory (None: it can). A peer GPU that this
        process does not see (CUDA_VISIBLE_DEVICES) is left to the mapping step's own errors."""
        n = _check(_cu().cuDeviceGetCount(), "cuDeviceGetCount")
        local = {_pci_bus_id(o): o for o in range(n)}
        refused = [f"rank {q} (GPU {bus_ids[q]})" for q in range(len(bus_ids))
                   if q != self._rank and bus_ids[q] in local and not _can_access_peer(self._dev, local[bus_ids[q]])]
        if refused:
            return (f"GPU {self._dev} ({bus_ids[self._rank]}) cannot access the memory of "
                    f"{', '.join(refused)} (cuDeviceCanAccessPeer)")
        return None

    def _agree(self, step: str, problem: Optional[str], value=None, fd: int = -1, label: Optional[str] = None):
        """One bootstrap step: every rank's outcome (and value, fd) to every rank; all raise
        TransportSetupError (about `label`, default the step) together if any rank reports a
        problem. Returns (values, fds)."""
        label = label or step
        try:
            values, fds = self._bootstrap.allgather(step, {"problem": problem, "value": value}, fd)
        except TransportSetupError as exc:
            raise TransportSetupError(label, exc.failures) from None
        failures = {r: v["problem"] for r, v in enumerate(values) if v["problem"]}
        if failures:
            for f in fds:
                if f >= 0:
                    os.close(f)
            self._bootstrap.broken = label
            raise TransportSetupError(label, failures)
        return [v["value"] for v in values], fds

    @property
    def rank(self) -> int:
        return self._rank

    def host_barrier(self, timeout_s: Optional[float] = None) -> None:
        """Every rank arrives, or every rank raises TransportSetupError naming those that did
        not within `timeout_s` (default: setup_timeout_s)."""
        self._usable("host_barrier")
        try:
            self._bootstrap.allgather("host barrier", None, timeout_s=timeout_s)
        except TransportSetupError as exc:
            raise self._fail(exc)

    def host_allgather(self, step: str, value) -> list:
        self._usable(step)
        return self._agree(step, None, value)[0]

    def _exchange_fds(self, problem: Optional[str], name: str, W: int, fd: int, label: str) -> list:
        """A new window's first setup step: this rank's outcome and fd to every rank -> every rank's
        fd (dup'ed into this process). All raise TransportSetupError if a rank failed or the ranks'
        windows() calls differ (the step name is the same for every allocation: calls are told
        apart by their name and size)."""
        tags, fds = self._agree("windows", problem, [name, W], fd, label=label)
        if any(t != tags[0] for t in tags):
            for f in fds:
                if f >= 0:
                    os.close(f)
            raise TransportSetupError("windows(): the ranks' calls differ, they must match",
                                      {q: f"called windows {t[0]} ({t[1]} bytes)" for q, t in enumerate(tags)})
        return fds

    def _allocate(self, name: str, nbytes: int):
        cu = _cu()
        P, me = self.world_size, self._rank
        W = _round_up(nbytes, self._granularity)
        label = f"windows {name}"
        handle, fd, problem = None, -1, None
        imported: list = []
        base, mapped = None, []
        fds: list[int] = []

        def release():
            for off in mapped:
                cu.cuMemUnmap(base + off, W)
            if base is not None:
                cu.cuMemAddressFree(base, P * W)
            for h in imported + ([handle] if handle is not None else []):
                cu.cuMemRelease(h)
            for f in fds + ([fd] if fd >= 0 else []):
                os.close(f)
            mapped.clear()
            imported.clear()
            fds.clear()

        try:
            # Step 1: this rank's allocation and its handle; the handles travel with the outcome.
            try:
                handle = _check(cu.cuMemCreate(W, self._prop, 0), f"cuMemCreate({W} bytes)")
                fd = int(_check(cu.cuMemExportToShareableHandle(
                    handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    "cuMemExportToShareableHandle"))
            except Exception as exc:
                problem = _reason(exc)
            fds = self._exchange_fds(problem, name, W, fd, label)
            os.close(fd)
            fd = -1
            # Step 2: import the peers' handles, map all P at base + d*W, zero this rank's window.
            problem = None
            try:
                by_rank = [None] * P
                by_rank[me] = handle
                for q in range(P):
                    if q == me:
                        continue
                    h = _check(cu.cuMemImportFromShareableHandle(
                        fds[q], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                        f"cuMemImportFromShareableHandle(rank {q})")
                    imported.append(h)
                    by_rank[q] = h
                base = _vmm_map(by_rank, W, self._granularity, [(self._dev,)] * P, names=[f"rank {q}" for q in range(P)])
                mapped.extend(q * W for q in range(P))
                flat = tensor_from_address(base, P * W, self.device)
                flat[me * W:(me + 1) * W].zero_()
                torch.cuda.synchronize(self.device)
            except Exception as exc:
                problem = _reason(exc)
            for f in fds:
                if f >= 0:
                    os.close(f)
            fds = []
            # every rank mapped and zeroed its window before anyone stores into a peer's
            self._agree("windows mapping", problem, label=f"{label} mapping")
        except BaseException as exc:
            release()
            if isinstance(exc, TransportSetupError):
                self._fail(exc)
            raise
        self._mappings.append((base, P * W, [handle] + imported))
        return flat, W

    def _release_all(self) -> None:
        """Unmap and release every allocation and close the socket; best effort, first error raised."""
        cu = _cu() if self._mappings else None
        first = None
        for base, size, handles in self._mappings:
            calls = [(cu.cuMemUnmap, (base, size)), (cu.cuMemAddressFree, (base, size))]
            calls += [(cu.cuMemRelease, (h,)) for h in handles]
            for fn, args in calls:
                try:
                    _check(fn(*args), fn.__name__)
                except RuntimeError as exc:
                    first = first or exc
        self._mappings.clear()
        if self._bootstrap is not None:
            self._bootstrap.close()
        if first is not None:
            raise first

    def close(self) -> None:
        """Unmap and release everything. Collective when healthy: a host barrier first, so peers
        have finished storing into this rank's windows. A transport that failed skips it, and a
        barrier that fails (a peer failed or is gone) is not raised: this rank's unmapping is
        safe either way (a peer's mapping keeps the memory alive until the peer unmaps it)."""
        if self.closed:
            return
        if self._mappings:
            try:
                self._usable("close")
                torch.cuda.synchronize(self.device)
                self.host_barrier()
            except Exception:
                pass
        if self._keep_if_lent(self._memory()):
            self._detach_memory()  # stays mapped (Transport.lend); the bootstrap still closes
        super().close()
        self._release_all()

    def _memory(self) -> list:
        """What _release_all releases of the windows' memory."""
        return list(self._mappings)

    def _detach_memory(self) -> None:
        self._mappings.clear()

# ---- pinned host memory shared by the rank processes ------------------------------------------------
_PROT_NONE, _PROT_RW = 0, 0x1 | 0x2  # Linux mmap constants (x86-64 and AArch64)
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_HOST_REGISTER_FLAGS = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP (cuda.h)


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def map_host_windows(fds: Sequence[int], window_bytes: int) -> int:
    """Map P shared-memory files (fds[d]: rank d's window, window_bytes long) at one reserved range,
    rank d's at base + d * window_bytes, read-write and shared -> base. Undo with unmap_host_windows."""
    import ctypes

    libc, P = _libc(), len(fds)
    base = libc.mmap(None, P * window_bytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap: reserving {P * window_bytes} bytes failed")
    for d, fd in enumerate(fds):
        at = base + d * window_bytes
        got = libc.mmap(at, window_bytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != at:
            err = ctypes.get_errno()
            libc.munmap(base, P * window_bytes)
            raise OSError(err, f"mmap: mapping rank {d}'s window at {at:#x} failed")
    return base


def unmap_host_windows(base: int, nbytes: int) -> None:
    import ctypes

    if _libc().munmap(base, nbytes) != 0:
        raise OSError(ctypes.get_errno(), f"munmap({base:#x}, {nbytes}) failed")


class HostTransport(VmmTransport):
    """One process per rank with the post-A2A's windows (the attention's output windows, and the
    pacing link probe's) in pinned host memory shared by the ranks: every store of the fused
    epilogue or the post-A2A kernel crosses PCIe. On one GPU it is the slow link for real ranks
    (P processes under MPS). The other windows (the pre-A2A's: the attention's q/k/v inputs) stay
    in GPU memory: a rank reads its own input window in every Q tile, which on a real slow link is
    its own HBM, and one GPU cannot put a window behind PCIe for the writers only (measured on an
    H200, 2026-12-03: with the input windows in host memory too the attention ran 70-120x slower).
    The owner's delivery copy out of its output window then reads over PCIe as well (a proxy cost:
    on a real slow link that read is local).

    Each rank creates its host window as a memfd (POSIX shared memory), the fds travel like
    VmmTransport's handles, and every rank maps the P files at one reserved range (rank d at
    base + d*W), registers the range with cuMemHostRegister (portable, device-mapped) and uses its
    device address (the uniform-stride layout of the other transports). The barrier's signal words
    stay in GPU memory too (a few bytes per call that would otherwise poll across PCIe). Linux
    only (memfd, mmap at a fixed address); backend "host" of get_transport.
    Measured (one H200 under MPS, 2026-12-03): see fa_a2a.engine.pacing and notes/measurements.md."""

    HOST_WINDOWS = ("ulysses.out:", "ulysses.joint_out:", "fa_a2a.engine.pacing.link:")  # name prefixes
    lends_outputs = False  # an output left in host memory would be read over PCIe by every consumer
    split_links = True  # the input windows are GPU memory

    def __init__(self, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S):
        self._host_mappings: list[tuple[int, int, int]] = []  # (base, P*W, device address)
        super().__init__(group, device, timeout_s, setup_timeout_s)

    def _probe(self, device: torch.device) -> str:
        if not hasattr(os, "memfd_create"):
            raise ValueError("HostTransport needs Linux (os.memfd_create)")
        return super()._probe(device)

    def _allocate(self, name: str, nbytes: int):
        if not name.startswith(self.HOST_WINDOWS):
            return super()._allocate(name, nbytes)
        cu = _cu()
        P, me = self.world_size, self._rank
        W = _round_up(nbytes, 1 << 16)
        label = f"host windows {name}"
        fd, problem, base, dptr, registered = -1, None, None, None, False
        fds: list[int] = []
        try:
            try:  # step 1: this rank's window as a shared-memory file; the fds travel with the outcome
                fd = os.memfd_create(f"fa_a2a.{me}.{name}"[:200], 0)
                os.ftruncate(fd, W)
            except Exception as exc:
                problem = _reason(exc)
            fds = self._exchange_fds(problem, name, W, fd, label)
            problem = None
            try:  # step 2: map all P files at base + d*W, register the range, zero this rank's window
                base = map_host_windows(fds, W)
                _check(cu.cuMemHostRegister(base, P * W, _HOST_REGISTER_FLAGS), f"cuMemHostRegister({P * W} bytes)")
                registered = True
                dptr = int(_check(cu.cuMemHostGetDevicePointer(base, 0), "cuMemHostGetDevicePointer"))
                flat = tensor_from_address(dptr, P * W, self.device)
                flat[me * W:(me + 1) * W].zero_()
                torch.cuda.synchronize(self.device)
            except Exception as exc:
                problem = _reason(exc)
            self._agree("windows mapping", problem, label=f"{label} mapping")
        except BaseException as exc:
            if registered:
                cu.cuMemHostUnregister(base)
            if base is not None:
                unmap_host_windows(base, P * W)
            if isinstance(exc, TransportSetupError):
                self._fail(exc)
            raise
        finally:
            for f in fds + ([fd] if fd >= 0 else []):
                if f >= 0:
                    os.close(f)  # the mappings keep the files alive
        self._host_mappings.append((base, P * W, dptr))
        return flat, W

    def _memory(self) -> list:
        return super()._memory() + list(self._host_mappings)

    def _detach_memory(self) -> None:
        super()._detach_memory()
        self._host_mappings.clear()

    def _release_all(self) -> None:
        first = None
        for base, size, _ in self._host_mappings:
            try:
                _check(_cu().cuMemHostUnregister(base), "cuMemHostUnregister")
                unmap_host_windows(base, size)
            except (RuntimeError, OSError) as exc:
                first = first or exc
        self._host_mappings.clear()
        try:
            super()._release_all()
        finally:
            if first is not None:
                raise first
