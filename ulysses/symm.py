"""SymmetricMemoryTransport: rank windows in torch symmetric memory. See ulysses.transport."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from cute_kernels.limits import ALIGN_BYTES
from ulysses.transport_base import (DEFAULT_SETUP_TIMEOUT_S, DEFAULT_TIMEOUT_S, Transport, _round_up,
                               tensor_from_address)

__all__ = ["SymmetricMemoryTransport", "uniform_window_stride", "symmetric_window_bases"]


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
    if not uniform or stride < nbytes or stride % ALIGN_BYTES:
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
        self._keep_if_lent(list(self._buffers))
        super().close()
        self._buffers.clear()
