"""Cross-rank barrier over per-rank flag windows (system-scope release/acquire), graph-capturable.

Flags: an int32 tensor mSignal [P, P] whose row d is rank d's signal pad (one row per rank
window, dim-0 stride = the window stride) and mSignal[d, s] is written only by rank s.
Epochs: mEpoch[j] (device memory) counts the barriers CTA j's rank has passed; the kernel reads
it, uses e = epoch + 1 and stores e back at the end, so no host argument changes between calls
and a captured CUDA graph replays correctly any number of times. Flags are monotonic (never
reset): a wait is satisfied by flag - e >= 0 (wrap-safe int32), so a fast rank that already
signalled epoch e + 1 satisfies a slow rank's wait for e.

Ordering (one CTA per local rank, thread t < P handles peer t):
  1. fence.acq_rel.sys, then st.release.sys of e into mSignal[t, rank] (peer t's pad): the
     stores this rank issued before the barrier (earlier kernels on the stream, e.g. the A2A
     copies into peer windows) are ordered before the flag at system scope;
  2. ld.acquire.sys spin on mSignal[rank, t] until it reaches e, bounded by `timeout_ns` of
     %globaltimer; on timeout the epoch e is written to mError[j, t] ("rank rank_base + j gave
     up on rank t at epoch e") and the wait ends: the kernel never hangs;
  3. bar.sync + fence.acq_rel.sys, then thread 0 stores the new epoch.
A timeout is also written to a host-mapped mirror of mError (pinned host memory, `error_host_addr`,
0 = none), which the host reads without synchronizing: ulysses.transport refuses every later call
on the transport once it sees an entry there, naming the missing rank. A CTA whose mError row
already holds an error still signals but skips the waits, so the barriers already queued (or a
replayed CUDA graph) end at once instead of each waiting out the timeout; their results are
void, and the host's refusal / `check()` says so.

One launch can play several ranks (num_local CTAs, CTA j = rank rank_base + j): with
num_local = P one process emulates all P ranks; all P CTAs are co-resident, so the spins make
progress. P <= 32 (one warp per CTA).

Cost: not measured in isolation; on the lent H200 (2026-12-02) the Ulysses layer's two barriers
per call sit inside the emulated sweep of notes/measurements.md, where Fused - FA4 stayed within
±0.3% from M = 8192 up.
"""

import functools

from cute_kernels.compile_cache import disk_cache
from cute_kernels.limits import MAX_WORLD_SIZE

__all__ = ["MAX_WORLD_SIZE"]  # and the barrier's compile and launch functions below


@disk_cache
def compile_barrier(world_size: int, num_local: int = 1, extra_options: str = ""):
    """The compiled BarrierKernel for (world_size, num_local); fake tensors, so no GPU is needed.

    The arguments are the cache key; extra_options (e.g. "--keep-ptx --dump-dir=DIR") are passed
    to the compiler."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    from quack.compile_utils import make_fake_tensor

    from cute_kernels.signal_device import BarrierKernel

    kernel = BarrierKernel(world_size, num_local)  # argument checks
    mSignal = cute.runtime.make_fake_tensor(
        Int32, (world_size, world_size), stride=(cute.sym_int64(), 1), assumed_align=4
    )
    mEpoch = make_fake_tensor(Int32, (num_local,), divisibility=1)
    mError = make_fake_tensor(Int32, (num_local, world_size), divisibility=1)
    return cute.compile(
        kernel, mSignal, mEpoch, mError, Int64(0), Int32(0), Int64(0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi {extra_options}".strip(),
    )


def barrier_launcher(signal, epoch, error, rank_base: int, timeout_ns: int, error_host=None):
    """The barrier on these buffers, checked and compiled once -> launch() on the current stream.

    signal: int32 [P, P] (row d in rank d's window); epoch: int32 [num_local] and error: int32
    [num_local, P], both on the launching device, zero-initialised once and then only touched
    by this kernel (and by the host's error check). error_host: optional int32 [num_local, P]
    contiguous pinned CPU tensor, the host-visible mirror of `error` (written on timeouts only).
    """
    import torch

    if signal.dtype != torch.int32 or signal.dim() != 2 or signal.shape[0] != signal.shape[1]:
        raise ValueError(f"signal: expected int32 [P, P], got {signal.dtype} {tuple(signal.shape)}")
    if signal.stride(1) != 1:
        raise ValueError("signal: each rank's row must be contiguous")
    P = signal.shape[0]
    if epoch.dtype != torch.int32 or epoch.dim() != 1:
        raise ValueError(f"epoch: expected int32 [num_local], got {epoch.dtype} {tuple(epoch.shape)}")
    num_local = epoch.shape[0]
    if error.dtype != torch.int32 or tuple(error.shape) != (num_local, P):
        raise ValueError(f"error: expected int32 [{num_local}, {P}], got {error.dtype} {tuple(error.shape)}")
    if not 0 <= rank_base <= P - num_local:
        raise ValueError(f"rank_base: {rank_base} not in [0, {P - num_local}]")
    if timeout_ns <= 0:
        raise ValueError(f"timeout_ns: must be > 0, got {timeout_ns}")
    host_addr = 0
    if error_host is not None:
        if (error_host.dtype != torch.int32 or tuple(error_host.shape) != (num_local, P)
                or not error_host.is_contiguous() or not error_host.is_pinned()):
            raise ValueError(f"error_host: expected a contiguous pinned int32 [{num_local}, {P}] CPU tensor, "
                             f"got {error_host.dtype} {tuple(error_host.shape)} "
                             f"(pinned: {error_host.is_pinned()})")
        host_addr = _device_address(error_host.data_ptr())
    return functools.partial(compile_barrier(P, num_local), signal, epoch, error, host_addr, rank_base, timeout_ns)


def barrier(signal, epoch, error, rank_base: int, timeout_ns: int, error_host=None) -> None:
    """Launch the barrier on the current stream; see the module docstring and barrier_launcher."""
    barrier_launcher(signal, epoch, error, rank_base, timeout_ns, error_host)()


@functools.cache
def _device_address(host_ptr: int) -> int:
    """The device address of mapped pinned host memory (equal to host_ptr under UVA)."""
    from cuda.bindings import runtime

    err, dev_ptr = runtime.cudaHostGetDevicePointer(host_ptr, 0)
    return int(dev_ptr) if err == runtime.cudaError_t.cudaSuccess else host_ptr
