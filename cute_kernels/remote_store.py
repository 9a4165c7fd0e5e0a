"""X-Stage microbenchmark kernel: K producer CTAs issue store bursts separated by a compute gap.

Each of K CTAs (one per SM, forced by its shared-memory request) repeats, n_bursts times:

    [grid barrier, optional] -> t_start -> store B bytes to its slice of the destination
    -> CTA barrier (all threads' stores issued) -> t_end -> gap: `gap_iters` FMA iterations, no stores

so the periodic mode (no barrier, gap small) and the isolated mode (grid barrier before every
burst, gap long enough to recover) share one loop, as the paper's local-memory control shares the
producer count, store width, address generation and loop structure with the remote runs. The
destination is a plain tensor argument: local HBM, a CUDA-IPC mapping or a peer GPU's buffer.

Store modes (compile-time):
- "vector": every thread issues 16-byte `st.global.v4.b32`, threads strided over the burst.
- "bulk":   threads issue `cp.async.bulk.global.shared::cta` copies of `bulk_chunk_bytes` from a
            staging buffer in shared memory, then `cp.async.bulk.wait_group.read 0` (source read,
            i.e. the data has left the SM) before the CTA barrier. Sender-visible issue time here
            therefore includes the bulk engine's read of shared memory, as a TMA-store epilogue that
            reuses its staging buffer would wait for it.

Burst b of CTA c writes slot s = b mod n_slots (n_slots = dst words // (K·B/4)) at word offset
(s·K + c)·B/4. Word j of a CTA's burst holds seed + (c << 22) + j ("vector") or
seed + (c << 22) + (j mod stage_words) ("bulk"): see `expected_words`.

Timestamps, written by thread 0 of each CTA: times[c, b] = (globaltimer at start, at end,
clock64 at start, at end). Issue time is end - start; the start-to-start period is
start[b+1] - start[b]; the gap actually run is start[b+1] - end[b]. clock64 has cycle resolution
but is per SM; convert with cycles/ns measured over the whole run from the globaltimer pair
(`clock_rate_ghz`). Thread 0 writes its 32 bytes of timestamps to global memory after each burst
(small against B >= 1 KiB per burst, and the same in the local control).

The grid barrier needs all K CTAs co-resident: K must not exceed the SM count (checked by the
launcher) and the CTA asks for more than half an SM's shared memory, so one CTA runs per SM.

Measured with this kernel (H200, 2026-12-02, `python -m fa_a2a.calibrate`, notes/measurements.md),
all on one GPU, so the destination is this GPU's HBM, not a peer link:
  local HBM (then `--dest local`, now `hbm`), vector stores: R 4245 GB/s, T_iss0 0.490 µs
  (K = 132, 32 KiB per CTA), Q 2.19 MiB;
  the same, bulk stores (--quick): R 4337 GB/s, T_iss0 0.613 µs, Q 0.35 MiB (a burst's issue ends
  only after the bulk engine read smem, so far less is accepted-but-not-drained);
  a buffer of another process on the same GPU (then `--dest ipc`, now `cuda-ipc`, --quick):
  R 4406 GB/s, T_iss0 0.49 µs, Q 2.03 MiB.
"""

import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_kernels.limits import aligned16

MODES = ("vector", "bulk")
PATTERN_CTA_SHIFT = 22          # word j < 2**22: at most 16 MiB per CTA per burst
MAX_BYTES_PER_CTA = 4 << PATTERN_CTA_SHIFT


# --------------------------------------------------------------------------------------------
# PTX helpers
# --------------------------------------------------------------------------------------------
@dsl_user_op
def st_global_v4_b32(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    """One 16-byte vector store `st.global.v4.b32` to a 16-byte aligned global address."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)]
        + [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_store_s2g(gmem_addr: Int64, smem_addr: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    """`cp.async.bulk.global.shared::cta.bulk_group`: copy nbytes (multiple of 16) smem -> gmem."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
         Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def ld_acquire_gpu(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int64(addr).ir_value(loc=loc, ip=ip)],
            "ld.global.acquire.gpu.b32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def red_release_gpu_add(addr: Int64, val: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------
class RemoteStoreBurst:
    """Periodic/isolated store bursts from K producer CTAs with in-kernel timestamps.

    Compile-time: mode ("vector" | "bulk"), num_threads, stage_bytes (bulk staging buffer),
    bulk_chunk_bytes, smem_bytes (>= half an SM's shared memory keeps one CTA per SM).
    Runtime (no recompilation across a sweep): K and n_bursts (from mTimes' shape), bytes per
    CTA, gap iterations, the align flag and the pattern seed.
    """

    def __init__(self, mode: str = "vector", num_threads: int = 256, stage_bytes: int = 16384,
                 bulk_chunk_bytes: int = 4096, smem_bytes: int = 120 * 1024):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if num_threads % 32 != 0 or not 32 <= num_threads <= 1024:
            raise ValueError(f"num_threads: must be a multiple of 32 in [32, 1024], got {num_threads}")
        if stage_bytes % 16 != 0 or stage_bytes <= 0:
            raise ValueError(f"stage_bytes: must be a positive multiple of 16, got {stage_bytes}")
        if bulk_chunk_bytes % 16 != 0 or bulk_chunk_bytes <= 0 or stage_bytes % bulk_chunk_bytes != 0:
            raise ValueError(
                f"bulk_chunk_bytes: must be a positive multiple of 16 dividing stage_bytes={stage_bytes}, "
                f"got {bulk_chunk_bytes}")
        if smem_bytes < stage_bytes:
            raise ValueError(f"smem_bytes: must be >= stage_bytes={stage_bytes}, got {smem_bytes}")
        self.mode = mode
        self.num_threads = num_threads
        self.stage_bytes = stage_bytes
        self.stage_words = stage_bytes // 4
        self.bulk_chunk_bytes = bulk_chunk_bytes
        self.smem_bytes = smem_bytes

    @cute.jit
    def __call__(
        self,
        mDst: cute.Tensor,      # (n_words,) Int32, 16-byte aligned: destination slots
        mTimes: cute.Tensor,    # (K, n_bursts, 4) Int64: glob start/end, clock start/end
        mSmid: cute.Tensor,     # (K,) Int32: SM id of each producer
        mSync: cute.Tensor,     # (1,) Int32, zero at launch: grid-barrier counter
        bytes_per_cta: Int32,   # B, multiple of 16
        gap_iters: Int32,       # FMA iterations of the producer-side gap
        align: Int32,           # != 0: grid barrier before every burst (isolated mode)
        seed: Int32,            # pattern seed
        # Always keep stream as the last parameter (EnvStream: obtained implicitly via TVM FFI).
        stream: cuda.CUstream = None,
    ):
        @cute.struct
        class SharedStorage:
            stage: cute.struct.Align[cute.struct.MemRange[Int32, self.stage_words], 128]

        num_ctas = mTimes.shape[0]
        self.kernel(mDst, mTimes, mSmid, mSync, bytes_per_cta, gap_iters, align, seed,
                    SharedStorage).launch(
            grid=[num_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mDst: cute.Tensor,
        mTimes: cute.Tensor,
        mSmid: cute.Tensor,
        mSync: cute.Tensor,
        bytes_per_cta: Int32,
        gap_iters: Int32,
        align: Int32,
        seed: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx = cute.arch.thread_idx()[0]
        cta = cute.arch.block_idx()[0]
        num_ctas = mTimes.shape[0]
        n_bursts = mTimes.shape[1]
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        words_per_cta = bytes_per_cta // 4
        slot_words = num_ctas * words_per_cta
        n_slots = mDst.shape[0] // cutlass.max(slot_words, 1)
        val_base = seed + (cta << PATTERN_CTA_SHIFT)
        dst_addr = mDst.iterator.toint()
        sync_addr = mSync.iterator.toint()
        if tidx == 0:
            mSmid[cta] = cute.arch.smid()

        if const_expr(self.mode == "bulk"):
            sStage = storage.stage.get_tensor(cute.make_layout(self.stage_words))
            for w in cutlass.range(tidx, self.stage_words, self.num_threads):
                sStage[w] = val_base + w
            # generic-proxy writes of the staging buffer -> visible to the bulk-copy (async) proxy
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        stage_addr = storage.stage.data_ptr().toint()

        # gap state: four independent FMA chains per thread; kept alive by an impossible store
        x0 = Float32(tidx)
        x1 = x0 + Float32(1.0)
        x2 = x0 + Float32(2.0)
        x3 = x0 + Float32(3.0)

        for burst in cutlass.range(n_bursts):
            if align != 0:
                self.grid_barrier(sync_addr, tidx, num_ctas * (burst + 1))
            cute.arch.sync_threads()
            g0 = Int64(0)
            c0 = Int64(0)
            if tidx == 0:
                g0 = cute.arch.globaltimer()
                c0 = cute.arch.clock64()
            base_word = ((burst % cutlass.max(n_slots, 1)) * num_ctas + cta) * words_per_cta
            if const_expr(self.mode == "vector"):
                self.burst_vector(dst_addr, base_word, bytes_per_cta // 16, val_base, tidx)
            else:
                self.burst_bulk(dst_addr, base_word, bytes_per_cta, stage_addr, tidx)
            cute.arch.sync_threads()
            if tidx == 0:
                g1 = cute.arch.globaltimer()
                c1 = cute.arch.clock64()
                mTimes[cta, burst, 0] = g0
                mTimes[cta, burst, 1] = g1
                mTimes[cta, burst, 2] = c0
                mTimes[cta, burst, 3] = c1
            for _ in cutlass.range(gap_iters):
                x0 = x0 * Float32(0.999) + Float32(0.001)
                x1 = x1 * Float32(0.999) + Float32(0.001)
                x2 = x2 * Float32(0.999) + Float32(0.001)
                x3 = x3 * Float32(0.999) + Float32(0.001)

        # the chains start >= 0 and stay >= 0, so this never stores; the compiler cannot prove it
        if x0 + x1 + x2 + x3 < Float32(-1.0):
            mSmid[cta] = Int32(-1)

    @cute.jit
    def grid_barrier(self, sync_addr: Int64, tidx: Int32, target: Int32):
        """All K CTAs arrive (release) and wait (acquire) until the counter reaches target."""
        if tidx == 0:
            red_release_gpu_add(sync_addr, Int32(1))
            seen = ld_acquire_gpu(sync_addr)
            while seen < target:
                seen = ld_acquire_gpu(sync_addr)

    @cute.jit
    def burst_vector(self, dst_addr: Int64, base_word: Int32, n_vecs: Int32, val_base: Int32,
                     tidx: Int32):
        """16-byte stores, thread t writes vectors t, t + num_threads, ... of the burst."""
        for v in cutlass.range(tidx, n_vecs, self.num_threads, unroll=4):
            w = v * 4
            addr = dst_addr + Int64(base_word + w) * 4
            val = val_base + w
            st_global_v4_b32(addr, val, val + 1, val + 2, val + 3)

    @cute.jit
    def burst_bulk(self, dst_addr: Int64, base_word: Int32, nbytes: Int32, stage_addr: Int32,
                   tidx: Int32):
        """Bulk copies of bulk_chunk_bytes (the last one shorter), chunk k from thread k mod
        num_threads, source = staging buffer at (k·chunk) mod stage_bytes."""
        chunk = self.bulk_chunk_bytes
        n_chunks = (nbytes + chunk - 1) // chunk
        for k in cutlass.range(tidx, n_chunks, self.num_threads):
            off = k * chunk
            size = cutlass.min(nbytes - off, chunk)
            bulk_store_s2g(dst_addr + Int64(base_word) * 4 + Int64(off),
                           stage_addr + off % self.stage_bytes, size)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


# --------------------------------------------------------------------------------------------
# compile + launch (torch side)
# --------------------------------------------------------------------------------------------
@functools.cache
def compile_remote_store(mode: str = "vector", num_threads: int = 256, stage_bytes: int = 16384,
                         bulk_chunk_bytes: int = 4096, smem_bytes: int = 120 * 1024, extra_options: str = ""):
    """The compiled RemoteStoreBurst for one compile-time configuration; fake tensors, so no GPU
    is needed. The arguments are the cache key; extra_options (e.g. "--keep-ptx --dump-dir=DIR")
    are passed to the compiler."""
    from quack.compile_utils import make_fake_stream, make_fake_tensor

    kernel = RemoteStoreBurst(mode, num_threads, stage_bytes, bulk_chunk_bytes, smem_bytes)
    sym = cute.sym_int
    m_dst = make_fake_tensor(Int32, (sym(),), divisibility=4)
    m_times = make_fake_tensor(Int64, (sym(), sym(), 4), divisibility=1)
    m_smid = make_fake_tensor(Int32, (sym(),), divisibility=1)
    m_sync = make_fake_tensor(Int32, (1,), divisibility=1)
    return cute.compile(kernel, m_dst, m_times, m_smid, m_sync, Int32(0), Int32(0), Int32(0), Int32(0),
                        make_fake_stream(), options=f"--enable-tvm-ffi {extra_options}".strip())


def expected_words(mode: str, num_ctas: int, bytes_per_cta: int, seed: int, stage_bytes: int = 16384):
    """Pattern one slot holds after a burst, as an int32 torch tensor of num_ctas·B/4 words (CPU)."""
    import torch

    words = bytes_per_cta // 4
    j = torch.arange(words, dtype=torch.int64)
    if mode == "bulk":
        j = j % (stage_bytes // 4)
    c = torch.arange(num_ctas, dtype=torch.int64)[:, None] << PATTERN_CTA_SHIFT
    v = (seed + c + j[None, :]) & 0xFFFFFFFF
    v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(torch.int32).reshape(-1)


def run_bursts(dst, *, num_ctas: int, bytes_per_cta: int, n_bursts: int, gap_iters: int = 0,
               align: bool = False, seed: int = 0x5EED, mode: str = "vector", num_threads: int = 256,
               stage_bytes: int = 16384, bulk_chunk_bytes: int = 4096, times=None, smid=None, sync=None):
    """Launch one run on the current stream; returns (times [K, n_bursts, 4] int64, smid [K] int32),
    both on the GPU (the caller synchronizes). dst: contiguous 1-D int32 CUDA tensor, 16-byte
    aligned, at least one slot of num_ctas·bytes_per_cta bytes. Preallocated times/smid/sync
    (sync is zeroed here) avoid allocations in a timed loop."""
    import torch

    if not isinstance(dst, torch.Tensor) or dst.dtype != torch.int32 or dst.dim() != 1 or not dst.is_cuda:
        raise ValueError("dst: expected a 1-D int32 CUDA tensor")
    if not aligned16(dst):
        raise ValueError("dst: must be contiguous and 16-byte aligned")
    n_sm = torch.cuda.get_device_properties(dst.device).multi_processor_count
    if not 1 <= num_ctas <= n_sm:
        raise ValueError(f"num_ctas: must be in [1, {n_sm}] (one co-resident CTA per SM), got {num_ctas}")
    if bytes_per_cta % 16 != 0 or not 0 <= bytes_per_cta <= MAX_BYTES_PER_CTA:
        raise ValueError(f"bytes_per_cta: must be a multiple of 16 in [0, {MAX_BYTES_PER_CTA}], got {bytes_per_cta}")
    if dst.numel() * 4 < num_ctas * bytes_per_cta:
        raise ValueError(f"dst: {dst.numel() * 4} bytes < one slot of {num_ctas * bytes_per_cta} bytes")
    if dst.numel() >= 2**31:
        raise ValueError("dst: at most 2**31 - 1 int32 words (word offsets are 32-bit)")
    if n_bursts < 1:
        raise ValueError(f"n_bursts: must be >= 1, got {n_bursts}")
    if not 0 <= gap_iters < 2**31:
        raise ValueError(f"gap_iters: must be in [0, 2**31), got {gap_iters}")
    dev = dst.device
    if times is None:
        times = torch.empty(num_ctas, n_bursts, 4, dtype=torch.int64, device=dev)
    if smid is None:
        smid = torch.empty(num_ctas, dtype=torch.int32, device=dev)
    if sync is None:
        sync = torch.zeros(1, dtype=torch.int32, device=dev)
    else:
        sync.zero_()
    if tuple(times.shape) != (num_ctas, n_bursts, 4) or times.dtype != torch.int64:
        raise ValueError(f"times: expected int64 of shape {(num_ctas, n_bursts, 4)}, got {tuple(times.shape)}")
    fn = compile_remote_store(mode, num_threads, stage_bytes, bulk_chunk_bytes)
    seed32 = ((seed + 2**31) % 2**32) - 2**31
    fn(dst, times, smid, sync, bytes_per_cta, gap_iters, int(bool(align)), seed32)
    return times, smid


def clock_rate_ghz(times) -> float:
    """SM cycles per ns over a whole run: median over CTAs of d(clock64)/d(globaltimer) between the
    first burst's start and the last burst's end (use runs of >= ~50 us: globaltimer ticks can be
    coarse)."""
    import torch

    t = times.double()
    dg = t[:, -1, 1] - t[:, 0, 0]
    dc = t[:, -1, 3] - t[:, 0, 2]
    ok = dg > 0
    if not bool(ok.any()):
        raise ValueError("times: the run is too short to measure the SM clock")
    return float(torch.median(dc[ok] / dg[ok]))


def burst_times_ns(times, ghz: Optional[float] = None):
    """Per (CTA, burst) issue time, and per (CTA, burst b >= 1) period and gap, in ns from clock64.
    Returns (issue [K, N], period [K, N-1], gap [K, N-1]) float64 tensors."""
    t = times.double()
    if ghz is None:
        ghz = clock_rate_ghz(times)
    c0, c1 = t[..., 2], t[..., 3]
    issue = (c1 - c0) / ghz
    period = (c0[:, 1:] - c0[:, :-1]) / ghz
    gap = (c0[:, 1:] - c1[:, :-1]) / ghz
    return issue, period, gap
