"""`python -m fa_a2a.calibrate`: measure the X-Stage platform model M_X = (T_iss0, R, Q) on this GPU.

Sweeps (cute_kernels/remote_store.py, K producer CTAs, one per SM, 16-byte vector stores by
default), as in the paper's Section 3:

1. zero-gap periodic bursts over (K, B)     -> R, least squares of T_period = V/R over V >= 4 MiB
2. periodic large-gap bursts over (K, B)    -> the table T_iss0(K, V)
3. gap sweep at the FA4 design point (K = all SMs, B = 32 KiB = one 128x128 bf16 output tile)
                                            -> T_iss0 from its plateau (G >= V/R); then
                                               T_iss(G), T_period(G) predicted with no refit and
                                               compared with the measurement (error reported)
4. isolated bursts over B (grid barrier before each burst, recovery gap 2·V/R + 20 us)
                                            -> knee and Q (issue floor fitted as a + b·V below the
                                               knee; the HBM control gets its own knee fit)
5. the design test for FA4 tiles (b_m = 128, d = 128, bf16, K = SM count): G*, capacity bound,
   M_ub* = b_n·G*/sigma, with sigma from --sigma-us or measured with FA4 (slope of per-wave
   time against KV tiles between two sequence lengths; cute_kernels.fa4.fa4_forward timed with
   graphs.time_graphs, the project's one timing loop). FA4's tile shape: xstage.fa4_tile_shape.

Destinations (--dest):
- hbm:      a buffer this process allocated on the GPU (plain HBM).
- cuda-ipc: a buffer allocated by a child process on the same GPU and mapped here with legacy
            CUDA IPC (torch.multiprocessing: cudaIpcGetMemHandle / cudaIpcOpenMemHandle; not the
            VMM transport of ulysses.transport). The stores go through that mapping but land in
            this same GPU's HBM: no NVLink or peer-GPU traffic. The owner re-reads its buffer to
            confirm the bytes arrived.
- host:     pinned host memory (torch pin_memory, wrapped as a CUDA tensor by
            ulysses.transport.tensor_from_address) that the GPU's stores reach over PCIe under UVA:
            a one-GPU proxy for a slow peer (bursts, finite capacity, backpressure), NOT NVLink.
            The host re-reads the buffer to confirm the bytes arrived.
- peer:     the HBM of another GPU of this host, mapped into the issuing GPU's address space with
            CUDA VMM in this one process (ulysses.transport.PeerMemory: the VMM steps of the
            transport's VmmTransport, cuMemCreate on the owner GPU, one reserved range, cuMemMap,
            cuMemSetAccess for the issuer and the owner; no handle exchange, as one process drives
            both GPUs). The stores cross the link that joins the two GPUs (NVLink on an HGX H200
            board). `--peer N` names the owner (default: the next GPU after the issuing one, the
            current device). `--spread` maps the buffer's allocation-granularity pages (2 MiB on
            an H200) round-robin over every GPU, the issuer's own included, so the producers of
            one burst write into several GPUs at once, as the fused epilogue stores each wave's
            tiles into every rank's window, 1/P of them local. The interleave is coarser than the
            epilogue's: with B = 32 KiB per CTA, 64 consecutive producers share a page (one GPU),
            where the epilogue's runs are S_loc/tile_m consecutive tiles.
            Refused, before anything is allocated, unless the issuing GPU has peer access
            (torch.cuda.can_device_access_peer) to the owner (every GPU with --spread): on one GPU
            or none it exits with "--dest peer: needs >= 2 GPUs with peer access, found 1".
            Only the destination is remote: the timestamps, SM ids and the grid-barrier counter
            stay in the issuing GPU's memory (Bench allocates them there), so the issue/period
            measurements and the isolated mode's barrier carry no peer traffic.
            Not run on distinct GPUs yet; its VMM path with owner == issuer (PeerMemory's chunks,
            the owner read-back, the page round-robin with one GPU as every owner) ran on one
            H200 (2026-12-03, tests/gpu/test_calibrate_peer.py); tests/multigpu runs the rest.
With cuda-ipc, host and peer an HBM control (same K, store width, addresses and loop, local
buffer) runs alongside.

Verification: before the sweeps one burst with its own seed goes to a region poisoned (-1)
beforehand, and the destination's owner reads it back (cuda-ipc: the owner process; host: the
CPU; peer: each owner GPU copies the pages it backs to the host, from its own HBM). The burst is
large enough to touch every owner's pages with --spread; dest_data_check in the JSON records the
outcome, and a mismatch prints a warning under the table.

Outputs in --out: platform_model.json (PlatformModel.from_json loads it; raw sweeps included),
fig3a_issue_vs_gap.png, fig3b_period_vs_gap.png, fig3c_isolated_knee.png,
fig3d_zero_gap_period.png; a markdown table is printed last.

Measured (NVIDIA H200, 2026-12-02, vector stores, 256 threads per CTA):
- hbm (full sweep): R 4245 GB/s, T_iss0 0.490 us (K = 132, 32 KiB per CTA), Q 2.19 MiB (knee at
  V = 3.70 MiB); G sweep predicted with no refit: T_iss mean error 2.7%, T_period 2.1%; FA4 sigma
  1.43 us per KV tile (4096 -> 8192), G* 0.53 us, M_ub* 47 tokens.
- cuda-ipc (--quick): R 4406 GB/s, T_iss0 0.490 us, Q 2.03 MiB: the same HBM write path.
- hbm --mode bulk (--quick): R 4337 GB/s, T_iss0 0.613 us, Q 0.35 MiB.
- host (--quick --no-fa, 2026-12-03, two runs): R 64.8 / 66.4 GB/s, T_iss0 0.535 us, Q 3.11 / 3.01
  MiB (knee at V = 3.14 MiB); G sweep with no refit: T_iss mean error 15.1% (max 93.5%), T_period
  4.3% (max 14.7%); FA4's aligned 4.125 MiB wave burst fails the capacity bound (4.09 > 3.11 MiB).
  The HBM control in the same run: R 4415 GB/s, Q 2.07 MiB.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from fa_a2a.tools.cli import MAX_WORLD_SIZE, check_out_dir, float_in, int_in, no_gpu
from fa_a2a.tools.xstage import (
    GB,
    KiB,
    MiB,
    US,
    PlatformModel,
    fa4_tile_shape,
    fa_burst_volume,
    fa_tile_burst_bytes,
    fit_capacity,
    fit_drain_rate,
    fit_issue_floor,
    qloop_gap_lower_bound,
)

FA_HEAD_DIM = 128  # the design point: FA4 SM90 forward, d = 128, bf16 output
FA_OUT_BYTES = 2
DESTS = ("hbm", "cuda-ipc", "host", "peer")
EXERCISED = {
    "hbm": "stores into this process's own GPU buffer (HBM)",
    "cuda-ipc": "stores through a legacy CUDA-IPC mapping of a buffer another process allocated on the same "
                "GPU (bytes land in this GPU's HBM; no NVLink/peer traffic)",
    "host": "stores into pinned host memory over PCIe (UVA): a one-GPU proxy for a slow peer, not NVLink",
    "peer": "stores into another GPU's HBM through a CUDA VMM peer mapping (the link between the GPUs: NVLink "
            "on an HGX board)",
}


def fa_tile() -> tuple[int, int]:
    """(tile_m, tile_n) of FA4 at the design point (d = 128): (128, 128)."""
    return fa4_tile_shape(FA_HEAD_DIM)


# --------------------------------------------------------------------------------------------
# destinations other than this process's HBM
# --------------------------------------------------------------------------------------------
def _cuda_ipc_child(conn, nwords: int, device_index: int) -> None:
    import torch

    torch.cuda.set_device(device_index)
    buf = torch.empty(nwords, dtype=torch.int32, device=f"cuda:{device_index}")
    conn.send(buf)
    while True:
        msg = conn.recv()
        if msg[0] == "check":
            _, expected, start = msg
            torch.cuda.synchronize()
            got = buf[start:start + expected.numel()].cpu()
            conn.send(bool(torch.equal(got, expected)))
        else:
            break
    conn.close()


class CudaIpcPeerBuffer:
    """An int32 buffer owned by a child process on the same GPU, mapped here via legacy CUDA IPC.

    with CudaIpcPeerBuffer(nwords) as peer: peer.tensor is this process's view (IPC mapping);
    peer.check(expected, start) asks the owner whether its own view holds `expected`.
    """

    def __init__(self, nwords: int, device_index: Optional[int] = None, timeout_s: float = 180.0):
        import torch

        if nwords <= 0:
            raise ValueError(f"nwords: must be positive, got {nwords}")
        self.nwords = nwords
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        self.timeout_s = timeout_s
        self.tensor = None
        self._proc = None
        self._conn = None

    def __enter__(self) -> "CudaIpcPeerBuffer":
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_cuda_ipc_child, args=(child_conn, self.nwords, self.device_index),
                                 daemon=True)
        self._proc.start()
        if not self._conn.poll(self.timeout_s):
            self._proc.kill()
            raise RuntimeError("CUDA-IPC buffer owner process did not answer")
        self.tensor = self._conn.recv()
        return self

    def check(self, expected, start: int = 0) -> bool:
        self._conn.send(("check", expected, start))
        if not self._conn.poll(self.timeout_s):
            raise RuntimeError("CUDA-IPC buffer owner process did not answer the check")
        return self._conn.recv()

    def __exit__(self, *exc) -> None:
        import torch

        self.tensor = None
        torch.cuda.synchronize()
        try:
            self._conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


class HostBuffer:
    """An int32 buffer in pinned host memory, seen by the GPU as a CUDA tensor (UVA): the GPU's
    stores to peer.tensor cross PCIe. peer.check(expected, start) reads it back on the host."""

    def __init__(self, nwords: int, device_index: Optional[int] = None):
        import torch
        from ulysses.transport import pinned_on_device

        if nwords <= 0:
            raise ValueError(f"nwords: must be positive, got {nwords}")
        dev = torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)
        self.tensor, self.host = pinned_on_device(nwords, torch.int32, dev)

    def check(self, expected, start: int = 0) -> bool:
        import torch

        torch.cuda.synchronize()
        return bool(torch.equal(self.host[start:start + expected.numel()], expected))

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.synchronize()
        self.tensor = None


def peer_owners(issuer: int, n_devices: int, can_access, peer: Optional[int] = None,
                spread: bool = False) -> list[int]:
    """The GPUs whose memory `--dest peer` maps for a burst issued on GPU `issuer`: [peer] (default
    the first GPU after the issuer that it can access), or every GPU in order with `spread`.
    can_access(a, b): torch.cuda.can_device_access_peer. Raises ValueError naming the argument."""
    others = [(issuer + i) % n_devices for i in range(1, n_devices)] if n_devices else []
    reachable = [d for d in others if can_access(issuer, d)]
    if not reachable:
        found = min(n_devices, 1)
        why = ("no CUDA GPU" if not n_devices else "one GPU" if n_devices == 1 else
               f"GPU {issuer} cannot access the memory of GPUs {sorted(others)} (torch.cuda.can_device_access_peer)")
        raise ValueError(f"--dest peer: needs >= 2 GPUs with peer access, found {found} ({why})")
    if spread:
        refused = sorted(set(others) - set(reachable))
        if refused:
            raise ValueError(f"--spread: GPU {issuer} cannot access the memory of GPUs {refused} "
                             "(torch.cuda.can_device_access_peer); drop --spread or hide them (CUDA_VISIBLE_DEVICES)")
        return list(range(n_devices))
    if peer is None:
        return [reachable[0]]
    if peer not in others:
        raise ValueError(f"--peer: expected a GPU index in [0, {n_devices}) other than the issuing GPU {issuer}, "
                         f"got {peer}")
    if peer not in reachable:
        raise ValueError(f"--peer: GPU {issuer} cannot access the memory of GPU {peer} "
                         f"(torch.cuda.can_device_access_peer); GPUs it can access: {reachable}")
    return [peer]


class VmmPeerBuffer:
    """An int32 buffer in the HBM of `owners`, mapped for GPU `issuer` with CUDA VMM in this
    process (ulysses.transport.PeerMemory). One owner: one allocation. Several owners (--spread):
    the allocation-granularity pages round-robin over them. peer.tensor is the issuer's view;
    peer.check(expected, start) has every owner read back, from its own HBM, the words of
    [start, start + len) that its pages hold (True when all match); checked_bytes[owner] counts
    what each owner read (none for an owner whose pages lie outside the range).
    Owners may include the issuer (the same VMM path on one GPU)."""

    def __init__(self, nwords: int, issuer: int, owners: list[int]):
        if nwords <= 0:
            raise ValueError(f"nwords: must be positive, got {nwords}")
        if not owners:
            raise ValueError("owners: expected at least one GPU index, got []")
        self.nwords, self.issuer, self.owners = nwords, issuer, list(owners)
        self.tensor = None
        self.mem = None
        self._owner_views: dict = {}
        self.checked_bytes: dict[int, int] = {}

    def __enter__(self) -> "VmmPeerBuffer":
        import torch
        from ulysses.vmm import PeerMemory, _vmm_allocation_prop

        chunk = None
        if len(self.owners) > 1:
            chunk = max(_vmm_allocation_prop(o, posix_fd=False)[1] for o in self.owners)
        self.mem = PeerMemory(self.owners, [self.issuer], self.nwords * 4, chunk_bytes=chunk)
        self.tensor = self.mem.tensor(self.issuer).view(torch.int32)[: self.nwords]
        self._owner_views = {o: self.mem.tensor(o).view(torch.int32) for o in dict.fromkeys(self.owners)}
        return self

    @property
    def span_bytes(self) -> int:
        """Bytes from the start that reach every owner's pages (0 with one owner: any byte does)."""
        return len(self.owners) * self.mem.chunk_bytes if len(self.owners) > 1 else 0

    def check(self, expected, start: int = 0) -> bool:
        import torch

        torch.cuda.synchronize(self.issuer)
        end, cw = start + expected.numel(), self.mem.chunk_bytes // 4
        ok = True
        self.checked_bytes = {}
        for i in range(start // cw, -(-end // cw)):
            o, a, b = self.mem.owner_of(i), max(start, i * cw), min(end, (i + 1) * cw)
            with torch.cuda.device(o):
                got = self._owner_views[o][a:b].cpu()
            ok &= bool(torch.equal(got, expected[a - start:b - start]))
            self.checked_bytes[o] = self.checked_bytes.get(o, 0) + 4 * (b - a)
        return ok

    def __exit__(self, *exc) -> None:
        self.tensor = None
        self._owner_views = {}
        if self.mem is not None:
            self.mem.close()
            self.mem = None


# --------------------------------------------------------------------------------------------
# one measurement
# --------------------------------------------------------------------------------------------
@dataclass
class RunStats:
    num_ctas: int
    bytes_per_cta: int
    volume: int            # K·B bytes
    gap_iters: int
    align: bool
    issue_s: float         # median issue time (per CTA, then over CTAs/bursts)
    issue_max_s: float     # median over bursts of the slowest CTA's issue time
    period_s: float        # median start-to-start period (nan for one burst)
    gap_s: float           # median measured gap (start[b+1] - end[b])
    ghz: float             # SM clock used to convert clock64


class Bench:
    """Runs remote_store bursts and reduces the timestamps (clock64, converted with the SM clock
    measured over the run when it lasts >= 100 us, else with a reference measured at start)."""

    def __init__(self, mode: str, num_threads: int, device):
        import torch

        self.mode = mode
        self.num_threads = num_threads
        self.device = device
        self.n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.sync = torch.zeros(1, dtype=torch.int32, device=device)
        self.ref_ghz = float("nan")
        self.ns_per_iter = float("nan")
        self.smid_ok = True

    def run(self, dst, K: int, B: int, *, n_bursts: int, gap_iters: int = 0, align: bool = False,
            warmup: int = 2, seed: int = 0x1234) -> RunStats:
        import torch
        from cute_kernels.remote_store import burst_times_ns, clock_rate_ghz, run_bursts

        # timestamps, SM ids and the grid-barrier counter in the issuing GPU's memory, whatever dst is
        times, smid = run_bursts(dst, num_ctas=K, bytes_per_cta=B, n_bursts=n_bursts, gap_iters=gap_iters,
                                 align=align, seed=seed, mode=self.mode, num_threads=self.num_threads,
                                 times=torch.empty(K, n_bursts, 4, dtype=torch.int64, device=self.device),
                                 smid=torch.empty(K, dtype=torch.int32, device=self.device), sync=self.sync)
        torch.cuda.synchronize()
        t, s = times.cpu(), smid.cpu()
        if s.unique().numel() != K or bool((s < 0).any()):
            self.smid_ok = False
        dur_ns = float((t[:, -1, 1] - t[:, 0, 0]).double().median())
        ghz = clock_rate_ghz(t) if dur_ns >= 100e3 or math.isnan(self.ref_ghz) else self.ref_ghz
        issue, period, gap = burst_times_ns(t, ghz)
        w = min(warmup, n_bursts - 1)
        iss = issue[:, w:]
        per = period[:, w:] if period.shape[1] > w else period
        gp = gap[:, w:] if gap.shape[1] > w else gap
        med = lambda x: float(x.median()) * 1e-9 if x.numel() else float("nan")  # noqa: E731
        return RunStats(
            num_ctas=K, bytes_per_cta=B, volume=K * B, gap_iters=gap_iters, align=align,
            issue_s=float(iss.median(dim=0).values.median()) * 1e-9,
            issue_max_s=float(iss.max(dim=0).values.median()) * 1e-9,
            period_s=med(per), gap_s=med(gp), ghz=ghz,
        )

    def calibrate_clock_and_gap(self, dst) -> None:
        """Reference SM clock and ns per gap-loop iteration from a store-free run (B = 0)."""
        iters = 20000
        st = self.run(dst, self.n_sm, 0, n_bursts=4, gap_iters=iters, warmup=1)
        self.ref_ghz = st.ghz
        self.ns_per_iter = st.gap_s * 1e9 / iters

    def iters_for(self, gap_s: float) -> int:
        return max(0, int(round(gap_s * 1e9 / self.ns_per_iter)))


# --------------------------------------------------------------------------------------------
# FA4 sigma
# --------------------------------------------------------------------------------------------
def measure_fa4_sigma(seqlens: tuple[int, int], n_sm: int, device, reps: int = 10) -> dict:
    """sigma = time per KV tile of FA4's Q-loop: slope of per-wave forward time against KV tiles.

    B = 1, d = 128, bf16, non-causal; heads chosen so the output tiles fill whole waves
    (SingleTileScheduler: one tile per CTA); T_FA = median of 3 CUDA-graph replays of `reps`
    back-to-back cute_kernels.fa4.fa4_forward calls (graphs.time_graphs). Per-wave time
    t(M) = T_FA(M) / waves; sigma = (t(M2) - t(M1)) / (M2 - M1)·b_n; the intercept is the fixed
    per-tile part the bound drops.
    """
    import torch

    from cute_kernels.fa4 import fa4_forward
    from graphs import median, time_graphs

    tile_m, tile_n = fa_tile()
    out = {"method": "measured: FA4 forward (cute_kernels.fa4.fa4_forward, CUDA-graph replays), slope of "
                     "per-wave time vs KV tiles", "points": []}
    for m in seqlens:
        if m % tile_m:
            raise ValueError(f"seqlens: {m} is not a multiple of {tile_m}")
        tiles_per_head = m // tile_m
        heads = n_sm // math.gcd(n_sm, tiles_per_head)
        while heads * tiles_per_head < 4 * n_sm:
            heads *= 2
        waves = heads * tiles_per_head // n_sm
        q, k, v = (torch.randn(1, m, heads, FA_HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in range(3))
        o = torch.empty_like(q)
        ts = time_graphs({"fa": lambda: fa4_forward(q, k, v, out=o)}, n_calls=reps, trials=3, warmup=1)["fa"]
        t = median(ts) * US
        out["points"].append({"seqlen": m, "heads": heads, "waves": waves, "kv_tiles": m // tile_n,
                              "t_fa_s": t, "t_per_wave_s": t / waves})
    p1, p2 = out["points"]
    sigma = (p2["t_per_wave_s"] - p1["t_per_wave_s"]) / (p2["kv_tiles"] - p1["kv_tiles"])
    out["sigma_s"] = sigma
    out["fixed_per_tile_s"] = p1["t_per_wave_s"] - sigma * p1["kv_tiles"]
    # the plain ratio T_FA / (waves · KV tiles) at the longer length, fixed part included
    out["sigma_ratio_s"] = p2["t_per_wave_s"] / p2["kv_tiles"]
    return out


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------
def _finish(fig, ax, out_dir: str, filename: str, xlabel: str, ylabel: str, title: str) -> str:
    """Label, save as PNG and close one figure; returns its path."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _plots(out_dir: str, model: PlatformModel, res: dict, dest: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    us = 1e6
    gs = res["gap_sweep"]
    v0 = gs["volume"]
    g_dst = np.array([r["gap_s"] for r in gs["dest"]])
    g_grid = np.linspace(0, max(g_dst.max(), 1e-9) * 1.05, 200)
    have_ctrl = gs["control"] is not None

    # (a) issue time vs gap
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(g_dst * us, [r["issue_s"] * us for r in gs["dest"]], "o", label=f"measured ({dest})")
    if have_ctrl:
        ax.plot([r["gap_s"] * us for r in gs["control"]], [r["issue_s"] * us for r in gs["control"]], "s",
                mfc="none", label="HBM control")
    ax.plot(g_grid * us, model.issue_time(v0, g_grid) * us, "-", label=r"model max($T^0_{iss}$, V/R − G)")
    ax.axvline(model.recovery_gap(v0) * us, ls=":", c="gray", label="G*")
    paths.append(_finish(
        fig, ax, out_dir, "fig3a_issue_vs_gap.png",
        "producer-side gap G (µs)", r"issue time $T_{iss}$ (µs)",
        f"(a) issue time vs gap, K={gs['num_ctas']}, B={gs['bytes_per_cta'] // KiB} KiB",
    ))

    # (b) period vs gap
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(g_dst * us, [r["period_s"] * us for r in gs["dest"]], "o", label=f"measured ({dest})")
    ax.plot(g_grid * us, model.period(v0, g_grid) * us, "-", label=r"max($T^0_{iss}$ + G, V/R)")
    ax.plot(g_grid * us, model.completion_coupled_period(v0, g_grid) * us, "--", label="completion-coupled G + V/R")
    paths.append(_finish(
        fig, ax, out_dir, "fig3b_period_vs_gap.png",
        "producer-side gap G (µs)", r"period $T_{period}$ (µs)",
        "(b) burst period vs gap",
    ))

    # (c) isolated knee
    iso = res["isolated"]
    v_iso = np.array([r["volume"] for r in iso["dest"]], dtype=float)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(v_iso / MiB, [r["issue_s"] * us for r in iso["dest"]], "o", label=f"measured ({dest})")
    if iso["control"] is not None:
        ax.plot([r["volume"] / MiB for r in iso["control"]], [r["issue_s"] * us for r in iso["control"]], "s",
                mfc="none", label="HBM control")
    cf = iso["fit"]
    vg = np.geomspace(v_iso.min() * 0.9, v_iso.max() * 1.1, 300)
    floor = cf["floor_intercept"] + cf["floor_slope"] * vg
    ax.plot(vg / MiB, np.maximum(floor, (vg - cf["capacity"]) / model.drain_rate) * us, "-",
            label="max(floor, (V − Q)/R)")
    if cf["knee_found"] and math.isfinite(cf["knee_volume"]):
        ax.axvline(cf["knee_volume"] / MiB, ls=":", c="gray", label="knee")
    ax.set_xscale("log")
    ax.set_yscale("log")
    paths.append(_finish(
        fig, ax, out_dir, "fig3c_isolated_knee.png",
        "aggregate burst volume V (MiB)", r"isolated issue time $T^{iso}_{iss}$ (µs)",
        f"(c) isolated-burst knee, K={iso['num_ctas']}",
    ))

    # (d) zero-gap period vs V across K
    zg = res["zero_gap"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for k in sorted({r["num_ctas"] for r in zg["points"]}):
        pts = [r for r in zg["points"] if r["num_ctas"] == k]
        ax.plot([r["volume"] / MiB for r in pts], [r["period_s"] * us for r in pts], "o-", ms=4, lw=0.6,
                label=f"K={k}")
    vmax = max(r["volume"] for r in zg["points"])
    vg = np.linspace(0, vmax, 50)
    ax.plot(vg / MiB, vg / model.drain_rate * us, "k--", label=f"V/R, R={model.drain_rate / GB:.0f} GB/s")
    paths.append(_finish(
        fig, ax, out_dir, "fig3d_zero_gap_period.png",
        "aggregate burst volume V (MiB)", r"zero-gap period $T^{ss}_{period}$ (µs)",
        "(d) drain rate across producer counts",
    ))
    return paths


# --------------------------------------------------------------------------------------------
# the sweeps (device-agnostic: `bench` is a Bench or anything with the same methods)
# --------------------------------------------------------------------------------------------
@dataclass
class SweepPlan:
    ks: list
    bs_zero: list
    bs_iso: list
    bs_floor: list
    n_gaps: int
    n_periodic: int
    n_isolated: int
    min_fit_volume: float

    @classmethod
    def make(cls, n_sm: int, quick: bool, min_fit_volume_mib: float = 4.0) -> "SweepPlan":
        if min_fit_volume_mib < 0:
            raise ValueError(f"min_fit_volume_mib: must be >= 0, got {min_fit_volume_mib}")
        bs_iso_kib = np.geomspace(2, 512 if quick else 1024, 10 if quick else 16)
        return cls(
            ks=sorted({max(1, n_sm // 4), max(1, n_sm // 2), n_sm}),
            bs_zero=[8 * KiB, 32 * KiB, 128 * KiB] if quick else
                    [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB],
            bs_iso=sorted({int(round(b * KiB / 16)) * 16 for b in bs_iso_kib}),
            bs_floor=[8 * KiB, 32 * KiB, 128 * KiB],
            n_gaps=10 if quick else 16,
            n_periodic=16 if quick else 24,
            n_isolated=4 if quick else 6,
            min_fit_volume=min_fit_volume_mib * MiB,
        )

    def max_bytes_per_cta(self) -> int:
        return max(max(self.bs_zero), max(self.bs_iso), max(self.bs_floor))


def run_sweeps(bench, dests: list, plan: SweepPlan, log=print) -> tuple[PlatformModel, dict]:
    """Sweeps 1-4 of the module docstring. dests: [("dest", buf)] or [("dest", buf), ("control", local)].
    Returns the fitted model (no meta) and the raw results."""
    if not dests or dests[0][0] != "dest" or any(n not in ("dest", "control") for n, _ in dests):
        raise ValueError("dests: expected [('dest', buf)] optionally followed by ('control', buf)")
    n_sm = bench.n_sm
    dst = dests[0][1]

    # 1. zero-gap periodic sweep -> R (of the control too: its knee is fitted with its own R)
    zeros = {name: [asdict(bench.run(buf, k, b, n_bursts=plan.n_periodic, warmup=4))
                    for k in plan.ks for b in plan.bs_zero] for name, buf in dests}
    zero = zeros["dest"]
    vz = np.array([x["volume"] for x in zero], float)
    tz = np.array([x["period_s"] for x in zero])
    min_v = plan.min_fit_volume
    if (vz >= min_v).sum() < 3:
        min_v = float(np.sort(vz)[-3])
    r = fit_drain_rate(vz, tz, min_volume=min_v)
    r_ctrl = (fit_drain_rate(vz, np.array([x["period_s"] for x in zeros["control"]]), min_volume=min_v)
              if "control" in zeros else None)
    fit_pts = vz >= min_v
    zero_rms = float(np.sqrt(np.mean(np.square((vz[fit_pts] / r - tz[fit_pts]) / tz[fit_pts]))))
    log(f"zero-gap sweep: {len(zero)} points, R = {r / GB:.1f} GB/s (fit on V >= {min_v / MiB:.2f} MiB, "
        f"rms rel. error {zero_rms:.1%})")

    # 2. T_iss0(K, V) table from large gaps
    floor_tab = []
    for k in plan.ks:
        for b in plan.bs_floor:
            g = 2 * k * b / r + 5 * US
            st = bench.run(dst, k, b, n_bursts=10, gap_iters=bench.iters_for(g), warmup=2)
            floor_tab.append({"num_ctas": k, "bytes_per_cta": b, "volume": k * b, "t_iss0_s": st.issue_s,
                              "gap_s": st.gap_s})

    # 3. gap sweep at the FA4 design point -> T_iss0 from the plateau, prediction with no refit
    b0 = fa_tile_burst_bytes(fa_tile()[0], FA_HEAD_DIM, FA_OUT_BYTES)
    v0 = n_sm * b0
    gaps = np.linspace(0, 3 * v0 / r, plan.n_gaps)
    sweep = {name: [asdict(bench.run(buf, n_sm, b0, n_bursts=plan.n_periodic, gap_iters=bench.iters_for(g),
                                     warmup=4)) for g in gaps]
             for name, buf in dests}
    g_meas = np.array([x["gap_s"] for x in sweep["dest"]])
    t_iss = np.array([x["issue_s"] for x in sweep["dest"]])
    t_per = np.array([x["period_s"] for x in sweep["dest"]])
    t0 = fit_issue_floor(g_meas, t_iss, v0, r)
    pm = PlatformModel(t_iss0=t0, drain_rate=r)
    err_iss = (pm.issue_time(v0, g_meas) - t_iss) / t_iss
    err_per = (pm.period(v0, g_meas) - t_per) / t_per
    err_cc = (pm.completion_coupled_period(v0, g_meas) - t_per) / t_per
    log(f"gap sweep at K={n_sm}, B={b0 // KiB} KiB: T_iss0 = {t0 / US:.3f} us; prediction error (no refit) "
        f"T_iss mean {np.mean(np.abs(err_iss)):.1%} max {np.max(np.abs(err_iss)):.1%}, "
        f"T_period mean {np.mean(np.abs(err_per)):.1%} max {np.max(np.abs(err_per)):.1%}")

    # 4. isolated bursts -> knee, Q
    iso = {}
    for name, buf in dests:
        iso[name] = [asdict(bench.run(buf, n_sm, b, n_bursts=plan.n_isolated,
                                      gap_iters=bench.iters_for(2 * n_sm * b / r + 20 * US),
                                      align=True, warmup=1)) for b in plan.bs_iso]
    vi = np.array([x["volume"] for x in iso["dest"]], float)
    ti = np.array([x["issue_s"] for x in iso["dest"]])
    # The floor is fitted (affine in V below the knee) rather than taken from the HBM control:
    # with a destination on the same GPU the control has the same knee and would hide it.
    cf = fit_capacity(vi, ti, r)
    cf_ctrl = None
    if "control" in iso:
        cf_ctrl = fit_capacity(vi, np.array([x["issue_s"] for x in iso["control"]]), r_ctrl)
    log(f"isolated sweep: Q {'=' if cf.knee_found else '>='} {cf.capacity / MiB:.2f} MiB"
        + (f", knee at V = {cf.knee_volume / MiB:.2f} MiB" if cf.knee_found else " (no knee in range: lower bound)"))

    model = PlatformModel(t_iss0=t0, drain_rate=r, capacity=cf.capacity, capacity_is_lower_bound=not cf.knee_found)
    res = {
        "zero_gap": {"points": zero, "fit_min_volume_B": min_v, "fit_rms_rel_error": zero_rms,
                     "control_points": zeros.get("control"), "control_drain_rate_Bps": r_ctrl},
        "t_iss0_table": floor_tab,
        "gap_sweep": {"num_ctas": n_sm, "bytes_per_cta": b0, "volume": v0, "dest": sweep["dest"],
                      "control": sweep.get("control"), "error_issue_rel": err_iss.tolist(),
                      "error_period_rel": err_per.tolist(), "error_completion_coupled_rel": err_cc.tolist()},
        "isolated": {"num_ctas": n_sm, "dest": iso["dest"], "control": iso.get("control"), "fit": cf.as_dict(),
                     "control_fit": cf_ctrl.as_dict() if cf_ctrl is not None else None},
    }
    return model, res


def fa4_design(model: PlatformModel, n_sm: int, sigma_info: dict) -> dict:
    """Design test for FA4 output tiles (d = 128, bf16, FA4's tile shape) with K = n_sm aligned
    producers. capacity_ok: True / False, or None when Q is a lower bound the peak exceeds."""
    tile_m, tile_n = fa_tile()
    b0 = fa_tile_burst_bytes(tile_m, FA_HEAD_DIM, FA_OUT_BYTES)
    v = fa_burst_volume(n_sm, tile_m, FA_HEAD_DIM, FA_OUT_BYTES)
    dt = model.design_test(v, 0.0)
    fa = {
        "tile_m": tile_m, "tile_n": tile_n, "head_dim": FA_HEAD_DIM, "out_bytes": FA_OUT_BYTES,
        "num_producers": n_sm, "burst_per_cta_B": b0, "volume_B": v,
        "recovery_gap_s": model.recovery_gap(v), "peak_outstanding_B": model.peak_outstanding(v),
        "capacity_B": None if math.isinf(model.capacity) else model.capacity,
        "capacity_is_lower_bound": model.capacity_is_lower_bound,
        "capacity_ok": None if dt.undecided else dt.capacity_ok, "sigma": sigma_info,
    }
    sigma = sigma_info.get("sigma_s")
    if sigma is not None and sigma > 0:
        fa["m_ub_tokens"] = model.fa_min_seqlen(v, sigma, tile_n)
        g8k = qloop_gap_lower_bound(8192, sigma, tile_n)
        t8k = model.design_test(v, g8k)
        fa["design_test_M8192"] = {"gap_lower_bound_s": g8k, "failing": list(t8k.failing),
                                   "undecided": list(t8k.undecided)}
    return fa


def markdown_table(model: PlatformModel, res: dict, fa: dict, header: str) -> str:
    zg, gs, iso = res["zero_gap"], res["gap_sweep"], res["isolated"]
    cf = iso["fit"]
    ks = sorted({x["num_ctas"] for x in zg["points"]})
    e_iss, e_per, e_cc = (np.abs(np.array(gs[k])) for k in
                          ("error_issue_rel", "error_period_rel", "error_completion_coupled_rel"))
    sigma = fa["sigma"].get("sigma_s")
    b0 = gs["bytes_per_cta"]
    rows = [
        ("R (drain rate)", f"{model.drain_rate / GB:.1f} GB/s",
         f"zero-gap periods, {len(zg['points'])} points over K = {ks}, fit on V >= "
         f"{zg['fit_min_volume_B'] / MiB:.2f} MiB (rms {zg['fit_rms_rel_error']:.1%})"),
        (f"T_iss0 (K={gs['num_ctas']}, B={b0 // KiB} KiB)", f"{model.t_iss0 / US:.3f} us",
         "gap-sweep plateau, G >= V/R"),
        ("Q (capacity)", f"{'' if cf['knee_found'] else '>= '}{model.capacity / MiB:.2f} MiB",
         (f"isolated-burst knee at V = {cf['knee_volume'] / MiB:.2f} MiB" if cf["knee_found"]
          else "no knee in the swept range: a lower bound") + f", K = {iso['num_ctas']} "
         f"(fit rms {cf['rms_rel_error']:.1%})"),
        *([("Q of the HBM control", f"{'' if iso['control_fit']['knee_found'] else '>= '}"
            f"{iso['control_fit']['capacity'] / MiB:.2f} MiB",
            f"same sweeps on this process's HBM buffer, its own R = {zg['control_drain_rate_Bps'] / GB:.0f} GB/s")]
          if iso.get("control_fit") else []),
        ("gap-sweep error, T_iss", f"mean {e_iss.mean():.1%}, max {e_iss.max():.1%}",
         f"prediction with no refit, {len(e_iss)} gaps"),
        ("gap-sweep error, T_period", f"mean {e_per.mean():.1%}, max {e_per.max():.1%}",
         f"completion-coupled G + V/R instead: mean {e_cc.mean():.1%}"),
        ("FA4 tile burst Bt, V = K·Bt", f"{fa['burst_per_cta_B'] // KiB} KiB, {fa['volume_B'] / MiB:.3f} MiB",
         f"b_m = {fa['tile_m']}, d = {fa['head_dim']}, bf16, K = {fa['num_producers']}"),
        ("FA4 G* = [V/R − T_iss0]+", f"{fa['recovery_gap_s'] / US:.3f} us", "model"),
        ("FA4 capacity bound [V − R·T_iss0]+ <= Q",
         f"{fa['peak_outstanding_B'] / MiB:.3f} <= {model.capacity / MiB:.2f} MiB: "
         f"{'holds' if fa['capacity_ok'] else 'unknown (Q is a lower bound)' if fa['capacity_ok'] is None else 'FAILS'}",
         "model"),
        ("sigma (FA4 time per KV tile)", f"{sigma / US:.3f} us" if sigma else "n/a", fa["sigma"].get("method", "")),
        ("M_ub* = b_n·G*/sigma", f"{fa['m_ub_tokens']:.0f} tokens" if "m_ub_tokens" in fa else "n/a",
         f"b_n = {fa['tile_n']}"),
    ]
    lines = ["", header, "", "| quantity | value | from |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def write_outputs(out_dir: str, model: PlatformModel, res: dict, fa: dict, extra: dict, dest: str):
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "platform_model.json")
    model.to_json(json_path, extra={"sweeps": res, "fa4_design_test": fa, **extra})
    PlatformModel.from_json(json_path)  # the file must load
    return json_path, _plots(out_dir, model, res, dest)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fa_a2a.calibrate",
                                description="Measure the X-Stage platform model (T_iss0, R, Q) on this GPU.")
    p.add_argument("--dest", choices=DESTS, default="hbm",
                   help="hbm: this process's GPU buffer (default); cuda-ipc: a child process's buffer on the "
                        "same GPU mapped via legacy CUDA IPC (same HBM, no NVLink traffic); host: pinned host "
                        "memory over PCIe, a one-GPU proxy for a slow peer, NOT NVLink; peer: another GPU's HBM "
                        "mapped with CUDA VMM (NVLink between GPUs of an HGX board; needs >= 2 GPUs with peer "
                        "access)")
    p.add_argument("--peer", type=int_in(0, MAX_WORLD_SIZE - 1), default=None,
                   help="with --dest peer: the GPU whose memory is written (default: the next GPU after the "
                        "current one)")
    p.add_argument("--spread", action="store_true",
                   help="with --dest peer: the destination's pages round-robin over every GPU (this one "
                        "included), as the fused epilogue spreads a wave's tiles over all ranks")
    p.add_argument("--out", default="results/xstage", help="output directory (default: results/xstage)")
    p.add_argument("--quick", action="store_true", help="smaller sweeps (under a minute on an H200)")
    p.add_argument("--mode", choices=("vector", "bulk"), default="vector",
                   help="store instruction: 16-byte st.global.v4 (default) or cp.async.bulk from smem")
    p.add_argument("--threads", type=int_in(32, 1024), default=256,
                   help="threads per producer CTA, a multiple of 32 in [32, 1024] (default 256)")
    p.add_argument("--sigma-us", type=float_in(0, 1e6), default=None,
                   help="FA4 Q-loop time per KV tile in us, at most 1e6; measured with FA4 when omitted")
    p.add_argument("--no-fa", action="store_true", help="skip the FA4 sigma measurement")
    p.add_argument("--min-fit-volume-mib", type=float_in(0, 1 << 20, lo_inclusive=True), default=4.0,
                   help="zero-gap points with V below this are left out of the R fit (default 4, at most 2^20)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the first bad argument (before anything looks for a GPU)."""
    if args.dest != "peer" and (args.peer is not None or args.spread):
        flag = "--peer" if args.peer is not None else "--spread"
        raise ValueError(f"{flag}: only with --dest peer, got --dest {args.dest}")
    if args.peer is not None and args.spread:
        raise ValueError(f"--peer: not with --spread (which writes into every GPU), got --peer {args.peer}")
    if args.threads % 32:
        raise ValueError(f"--threads: expected a multiple of 32 in [32, 1024], got {args.threads}")
    check_out_dir(args.out)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    import torch

    owners = None
    if args.dest == "peer":  # refused before anything is allocated: one GPU (or none) cannot do it
        n_dev = torch.cuda.device_count() if torch.cuda.is_available() else 0
        issuer = torch.cuda.current_device() if n_dev else 0
        try:
            owners = peer_owners(issuer, n_dev, torch.cuda.can_device_access_peer, args.peer, args.spread)
        except ValueError as e:
            parser.error(str(e))
    if not torch.cuda.is_available():
        return no_gpu("python -m fa_a2a.calibrate", f"the X-Stage microbenchmarks (--dest {args.dest})")
    t_start = time.time()
    log = lambda msg: print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    n_sm = props.multi_processor_count
    bench = Bench(args.mode, args.threads, device)
    plan = SweepPlan.make(n_sm, args.quick, args.min_fit_volume_mib)
    dst_words = max(256 * MiB, 3 * n_sm * plan.max_bytes_per_cta()) // 4
    exercised = EXERCISED[args.dest]
    if owners is not None:
        exercised += (f": GPU {device.index} -> GPU {owners[0]}" if not args.spread else
                      f": GPU {device.index} -> pages round-robin over GPUs {owners} (its own included)")

    data_check = None
    with ExitStack() as stack:
        hbm = torch.empty(dst_words, dtype=torch.int32, device=device)
        peer = None
        if args.dest == "cuda-ipc":
            log("starting the CUDA-IPC buffer owner process")
            peer = stack.enter_context(CudaIpcPeerBuffer(dst_words, device.index))
        elif args.dest == "host":
            log(f"pinning {dst_words * 4 / MiB:.0f} MiB of host memory")
            peer = stack.enter_context(HostBuffer(dst_words, device.index))
        elif args.dest == "peer":
            log(f"mapping {dst_words * 4 / MiB:.0f} MiB of GPU {owners if args.spread else owners[0]} for GPU "
                f"{device.index} (CUDA VMM)")
            peer = stack.enter_context(VmmPeerBuffer(dst_words, device.index, owners))
        dst = peer.tensor if peer is not None else hbm
        dests = [("dest", dst)] + ([("control", hbm)] if peer is not None else [])

        log(f"compiling remote_store ({args.mode}); measuring the SM clock and the gap loop")
        bench.run(dst, n_sm, 16 * KiB, n_bursts=2)  # compile + first touch
        bench.run(hbm, n_sm, 16 * KiB, n_bursts=2)
        bench.calibrate_clock_and_gap(hbm)
        log(f"SM clock {bench.ref_ghz:.3f} GHz, gap loop {bench.ns_per_iter:.3f} ns/iteration")
        if peer is not None:
            from cute_kernels.remote_store import expected_words

            # one slot, poisoned first (the pattern words are positive), large enough to reach every
            # owner's pages with --spread
            b_check = max(32 * KiB, -(-getattr(peer, "span_bytes", 0) // (16 * n_sm)) * 16)
            expected = expected_words(args.mode, n_sm, b_check, 0x0C0FFEE)
            dst[: expected.numel()].fill_(-1)
            bench.run(dst, n_sm, b_check, n_bursts=1, seed=0x0C0FFEE)
            data_check = peer.check(expected)
            by_owner = getattr(peer, "checked_bytes", None)
            if by_owner is not None and set(by_owner) != set(peer.owners):
                data_check = False  # the slot missed some owner's pages: that owner was not checked
            log(f"{args.dest} destination check (its owner re-reads one slot"
                + (f"; bytes read back by GPU: {by_owner}" if by_owner else "")
                + f"): {'ok' if data_check else 'MISMATCH'}")
        model, res = run_sweeps(bench, dests, plan, log)
        del dst, dests, hbm  # drop the mappings before their owner goes

    if args.sigma_us is not None:
        sigma_info = {"sigma_s": args.sigma_us * US, "method": "given on the command line (--sigma-us)"}
    elif args.no_fa:
        sigma_info = {"sigma_s": None, "method": "not measured (--no-fa)"}
    else:
        log("measuring FA4 sigma")
        try:
            # (2048, 4096) gave a slope 3x too small (fixed costs dominate at 2K, H200 2026-12-02)
            sigma_info = measure_fa4_sigma((4096, 8192), n_sm, device)
        except Exception as exc:  # a missing or failing FA4 must not lose the calibration
            sigma_info = {"sigma_s": None, "method": f"not measured: {type(exc).__name__}: {exc}"}
    gs = res["gap_sweep"]
    model = replace(model, meta={
        "device": props.name, "num_sms": n_sm, "dest": args.dest, "what_is_exercised": exercised,
        "store": args.mode, "threads_per_cta": args.threads,
        "t_iss0_at": {"num_ctas": gs["num_ctas"], "bytes_per_cta": gs["bytes_per_cta"], "volume": gs["volume"]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "quick": args.quick,
        **({"issuer_gpu": device.index, "owner_gpus": owners, "spread": args.spread,
            "gpus": [torch.cuda.get_device_name(o) for o in owners]} if owners is not None else {}),
    })
    fa = fa4_design(model, n_sm, sigma_info)
    json_path, pngs = write_outputs(args.out, model, res, fa, {
        "clock": {"ref_sm_ghz": bench.ref_ghz, "gap_loop_ns_per_iter": bench.ns_per_iter},
        "one_cta_per_sm": bench.smid_ok, "dest_data_check": data_check}, args.dest)
    header = (f"X-Stage platform model: {props.name}, {n_sm} SMs, dest={args.dest}: {exercised}; "
              f"store={args.mode}, {args.threads} threads/CTA, {time.time() - t_start:.0f} s. "
              f"Files: {json_path}, " + ", ".join(os.path.basename(p) for p in pngs))
    if not bench.smid_ok:
        header += "\nWARNING: some run did not place its producers one per distinct SM."
    if data_check is False:
        header += f"\nWARNING: the {args.dest} destination's owner did not see the stored bytes."
    print(markdown_table(model, res, fa, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
