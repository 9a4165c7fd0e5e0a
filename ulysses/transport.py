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
                     slow link for real ranks (the store pacer's case, fa_a2a.pacing). Backend "host".

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

import json
import math
import os
import socket
import struct
import time
import uuid
from typing import Optional, Sequence

import torch

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

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_SETUP_TIMEOUT_S = 300.0


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


def tensor_from_address(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor [nbytes] over memory this module mapped (the tensor does not own it)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
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


def _positive_seconds(value, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}") from None
    if not v > 0 or v == float("inf"):
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return v


class Transport:
    """Common part: window cache, signal pad, epoch/error tensors, barrier and its check."""

    world_size: int
    device: torch.device
    #: ranks this process drives: range(P) when emulated, (rank,) otherwise.
    local_ranks: Sequence[int]
    #: ranks of the group whose kernels run at once on this rank's GPU (1: emulated ranks run in turn)
    ranks_per_gpu: int = 1

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

    def allocated_windows(self) -> list[torch.Tensor]:
        """Every windows() tensor allocated so far ([P, *shape] each), the signal pad excluded."""
        return [w for (name, _, _), w in self._windows.items() if name != "__signal__"]

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


def symmetric_window_bases(handle, local_ptr: int, rank: int) -> list[int]:
    """Each rank's address of the tensor (at local_ptr on `rank`) a symmetric-memory handle was
    made for. torch allocates symm_mem.empty from a pool: buffer_ptrs are the peers' segment bases
    and the tensor sits at the same offset into each segment (pytorch#162193); the offset is read
    from this rank's own addresses."""
    ptrs = [int(p) for p in handle.buffer_ptrs]
    offset = int(local_ptr) - ptrs[rank]
    if not 0 <= offset < int(getattr(handle, "buffer_size", offset + 1)):
        raise ValueError(f"buffer_ptrs: the tensor at {int(local_ptr):#x} is not inside this rank's "
                         f"segment at {ptrs[rank]:#x}")
    return [p + offset for p in ptrs]


class SymmetricMemoryTransport(Transport):
    """One process per GPU; windows are torch symmetric-memory buffers that sit at one stride."""

    def __init__(self, group=None, device=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized")
        self.group = group if group is not None else dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: SymmetricMemoryTransport needs a CUDA device, got {device}")
        self._buffers: list[torch.Tensor] = []
        super().__init__(dist.get_world_size(self.group), device, (dist.get_rank(self.group),), timeout_s,
                         setup_timeout_s)

    def host_barrier(self, timeout_s: Optional[float] = None) -> None:
        """dist.barrier of the group (bounded by the process group's timeout only)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def host_allgather(self, step: str, value) -> list:
        import torch.distributed as dist

        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def _allocate(self, name: str, nbytes: int):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(buf, self.group.group_name)
        # each rank sees its own addresses: agree before raising, or the ranks that passed would
        # wait for the others in the host barrier below
        refusal = None
        try:
            bases = symmetric_window_bases(handle, buf.data_ptr(), self.local_ranks[0])
            window_bytes = uniform_window_stride(bases, nbytes)
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
        return tensor_from_address(bases[0], span, self.device), window_bytes

    def close(self) -> None:
        super().close()
        self._buffers.clear()


# ---- bootstrap over a Unix socket (bounded waits) ----------------------------------------------
_HEADER = struct.Struct("!Q")
_MAX_FDS = 64


def _send_msg(sock: socket.socket, obj, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    data = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_msg(sock: socket.socket):
    """(object, received fds); the fds arrive with the message's first bytes."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
    fds = list(fds)
    try:
        if not data:
            raise ConnectionError("the peer closed the connection")
        while len(data) < _HEADER.size:
            more = sock.recv(1 << 16)
            if not more:
                raise ConnectionError("the peer closed the connection")
            data += more
        (n,) = _HEADER.unpack(data[:_HEADER.size])
        while len(data) < _HEADER.size + n:
            more = sock.recv(1 << 16)
            if not more:
                raise ConnectionError("the peer closed the connection")
            data += more
        return json.loads(data[_HEADER.size:_HEADER.size + n]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class _Bootstrap:
    """Gather-to-root-and-broadcast over an abstract Unix socket, every wait bounded.

    Rank 0 listens; in each step every other rank connects, sends (step, value[, fd]) and waits
    for the root's answer: the list of every rank's value (and the fds passed along), or the
    root's error. Steps carry a sequence number and a name, so ranks that call different steps
    are told so instead of exchanging the wrong data. The root gives up on ranks that have not
    arrived within the timeout and tells the ranks that did; the others wait for the root's answer
    up to twice the timeout (the root may start the step up to one timeout after them) and then
    give up naming rank 0. Any failure leaves the bootstrap broken (later steps raise).
    """

    def __init__(self, rank: int, world_size: int, address: str, timeout_s: float):
        self.rank, self.world_size, self.address, self.timeout_s = rank, world_size, address, timeout_s
        self._seq = 0
        self._listener = None
        self.broken: Optional[str] = None
        if rank == 0 and world_size > 1:
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                lst.bind(address)
                lst.listen(max(world_size, 8))
            except BaseException:
                lst.close()
                raise
            self._listener = lst

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def allgather(self, step: str, value, fd: int = -1, timeout_s: Optional[float] = None):
        """Every rank's value (list by rank) and, for ranks that passed one, their fd (dup'ed
        into this process; list by rank, -1 where none). Raises TransportSetupError."""
        if self.broken is not None:
            raise TransportSetupError(step, {self.rank: f"the bootstrap failed earlier ({self.broken})"})
        self._seq += 1
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + (timeout_s if self.rank == 0 else 2 * timeout_s)
        try:
            if self.world_size == 1:
                return [value], [os.dup(fd) if fd >= 0 else -1]
            if self.rank == 0:
                return self._root(step, value, fd, deadline, timeout_s)
            return self._leaf(step, value, fd, deadline)
        except TransportSetupError as exc:
            self.broken = str(exc)
            raise
        except OSError as exc:  # a peer went away mid-step
            self.broken = _reason(exc)
            raise TransportSetupError(step, {self.rank: f"bootstrap socket error ({_reason(exc)})"}) from exc

    def _root(self, step, value, fd, deadline, timeout_s):
        P = self.world_size
        values, fds, conns = [None] * P, [-1] * P, {}
        values[0] = value
        fds[0] = os.dup(fd) if fd >= 0 else -1
        problems: dict[int, str] = {}
        try:
            while len(conns) < P - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    break
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    msg, got = _recv_msg(conn)
                except (OSError, ValueError) as exc:
                    conn.close()
                    problems[0] = f"could not read a bootstrap message ({_reason(exc)})"
                    continue
                q = msg.get("rank")
                if not isinstance(q, int) or not 0 < q < P or q in conns:
                    for f in got:
                        os.close(f)
                    conn.close()
                    problems[0] = f"received an unexpected bootstrap message {msg!r}"
                    continue
                conns[q] = conn
                if (msg.get("seq"), msg.get("step")) != (self._seq, step):
                    problems[q] = (f"was at setup step {msg.get('seq')} {msg.get('step')!r} while rank 0 was at "
                                   f"step {self._seq} {step!r}: the ranks' windows() calls differ")
                values[q] = msg.get("value")
                if got:
                    fds[q] = got[0]
                    for f in got[1:]:
                        os.close(f)
            for q in range(1, P):
                if q not in conns:
                    problems[q] = f"did not arrive within {timeout_s:g} s"
            if problems:
                err = TransportSetupError(step, problems)
                for conn in conns.values():
                    try:
                        _send_msg(conn, {"error": str(err), "failures": {str(k): v for k, v in problems.items()}})
                    except OSError:
                        pass
                raise err
            reply = {"values": values, "has_fd": [f >= 0 for f in fds]}
            passed = [f for f in fds if f >= 0]
            for q, conn in conns.items():
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                _send_msg(conn, reply, passed)
            return values, fds
        except BaseException:
            for f in fds:
                if f >= 0:
                    os.close(f)
            raise
        finally:
            for conn in conns.values():
                conn.close()

    def _leaf(self, step, value, fd, deadline):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:  # the root listens from before the ranks first met: a refusal means it is gone
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.connect(self.address)
            except (OSError, ValueError) as exc:
                raise TransportSetupError(step, {0: f"did not answer rank {self.rank} "
                                                    f"(connecting: {_reason(exc)})"}) from None
            _send_msg(sock, {"rank": self.rank, "seq": self._seq, "step": step, "value": value},
                      [fd] if fd >= 0 else [])
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                msg, got = _recv_msg(sock)
            except (OSError, ValueError) as exc:
                raise TransportSetupError(step, {0: f"did not answer rank {self.rank} "
                                                    f"({_reason(exc)})"}) from None
            if "error" in msg:
                for f in got:
                    os.close(f)
                raise TransportSetupError(step, {int(k): v for k, v in msg["failures"].items()})
            fds, it = [], iter(got)
            for has in msg["has_fd"]:
                fds.append(next(it) if has else -1)
            return msg["values"], fds
        finally:
            sock.close()


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


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


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
        super().close()
        self._release_all()



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
    Measured (one H200 under MPS, 2026-12-03): see fa_a2a.pacing and notes/measurements.md."""

    HOST_WINDOWS = ("ulysses.out:", "ulysses.joint_out:", "fa_a2a.pacing.link:")  # name prefixes

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


_transports: dict = {}
BACKENDS = ("vmm", "ipc", "host", "symm")


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

    backend = backend or os.environ.get("FA_A2A_TRANSPORT", "vmm")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} ('ipc' is 'vmm'), got {backend!r}")
    backend = "vmm" if backend == "ipc" else backend
    explicit_timeout = timeout_s is not None
    if timeout_s is None:
        timeout_s = _positive_seconds(os.environ.get("FA_A2A_TIMEOUT_S", DEFAULT_TIMEOUT_S), "FA_A2A_TIMEOUT_S")
    if setup_timeout_s is None:
        setup_timeout_s = _positive_seconds(os.environ.get("FA_A2A_SETUP_TIMEOUT_S", DEFAULT_SETUP_TIMEOUT_S),
                                            "FA_A2A_SETUP_TIMEOUT_S")
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
