"""Does the fused FA4 + post-A2A kernel keep computing while its stores drain over a slow link?

One-GPU proxy for a slow peer: the P Ulysses output windows sit in pinned host memory (GPU
stores reach them over PCIe, zero-copy), or in HBM for comparison. One source rank's work
(rank 0 of P = 8 emulated ranks, bf16, D = 128, H_loc = 3 by default): FA4 alone, the post-A2A
kernel alone, serial (FA4 then post-A2A), and the fused kernel's variants:

    fused          O staged in sQ, one TMA store per tile (the default path)
    fused-st       per-thread 16-byte stores from sQ (the path of straddling S_loc)
    paced@R        the TMA path with every tile's store paced grid-wide to R GB/s
                   (cute_kernels.fa4_a2a_paced_sm90; --paced-host-gbps, --paced-hbm-gbps)

Every variant is first checked against serial bit for bit into NaN-poisoned windows. Times are
CUDA-graph replay medians (graphs.time_graphs, inputs rotated past L2). Printed per row: time,
ratio to FA4, hiding H = 1 - (T - T_FA)/(T_serial - T_FA), and a bound: FA4's tiles finish in
ceil(tiles / SMs) waves at k*T_FA/waves, each wave's O drains at the A2A-only rate R after the
previous wave's, so T >= max(T_FA, end of the last drain); H_bound is that bound's hiding.

Contention probe (--contention): an attention kernel on half the SMs that stores nothing to
host memory (the fused kernel, one window in HBM, one tile per CTA) runs alone, then beside the
post-A2A kernel writing an 8K O into host (or HBM) windows from the other SMs, started 20 us
later on a second stream of the same CUDA graph: do other SMs' PCIe writes slow its mainloop?

Pacing probe (--pace): the same attention kernel beside a rate-limited writer on the other SMs
(cute_kernels.remote_store: K CTAs, bursts of B bytes separated by an FMA gap), started first so
the attention runs against its steady state, into host memory at fractions of the writer's own
zero-gap rate, with fewer storing CTAs, with bulk (TMA-engine) stores, and into HBM at the host
rate as a control. Printed per writer: its rate while the attention ran (from its %globaltimer
stamps) and the attention's per-tile mainloop: does a store rate below the link rate (a small
write backlog) restore the load speed, or does the slowdown follow the bytes written?
Measured (H200, 2026-12-03, `--seqlens --pace`): 88.5 us alone; 4 KiB bursts per CTA (270 KB a
round) paced to 3-44 GB/s: 90.5-90.7 us; 32 KiB bursts per CTA at 17-35 GB/s: 122-184 us;
unpaced writers at the link's 52 GB/s: 237-1042 us (but 88.3 us with 8 storing CTAs); 1-2
storing CTAs (16-33 GB/s): 88.7 us. The backlog stalls the loads, not the bytes: hence the paced
variants (cute_kernels.fa4_a2a_paced_sm90).

With --stamp-seqlens, one launch of each variant's debug build per destination records per-tile
%globaltimer stamps (CTA start, epilogue entry, sO free, store issued, epilogue end); the summary
says what a CTA waits for. Everything also goes to the JSON file named on the command line.

    python examples/host_window_hiding.py OUT.json [--seqlens 8192 16384 32768] [--stamp-seqlens 8192]
    python examples/host_window_hiding.py OUT.json --seqlens --contention --pace   # probes only
"""

import argparse
import json
import math
import statistics

from fa_a2a.tools.cli import (KERNEL_HEAD_DIMS, MAX_HEADS, MAX_REPEATS, MAX_WORLD_SIZE, SEQLEN, check_seqlens, float_in,
                        int_in, no_gpu)

VARIANTS = {  # the unpaced O-store paths
    "fused": dict(o_store="tma"),
    "fused-st": dict(o_store="st"),
}
MAX_GBPS = 1e4  # store rates, GB/s
MAX_CTAS = 1024  # storing CTAs (more than any GPU's SMs)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    seqlen = SEQLEN
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--seqlens", type=seqlen, nargs="*", default=[8192, 16384, 32768],
                    help="sequence lengths of the timing table (none: probes only)")
    ap.add_argument("--dests", nargs="+", default=["hbm", "host"], choices=["hbm", "host"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--stamp-seqlens", type=seqlen, nargs="*", default=[8192])
    ap.add_argument("--hbm-only-seqlens", type=seqlen, nargs="*", default=[],
                    help="extra sequence lengths timed with windows in HBM only (the <= 1.01 check)")
    ap.add_argument("--paced-host-gbps", type=float_in(0, MAX_GBPS), nargs="*", default=[],
                    help="paced variants with host windows: grid-wide O store rates, GB/s")
    ap.add_argument("--paced-hbm-gbps", type=float_in(0, MAX_GBPS), nargs="*", default=[],
                    help="paced variants with HBM windows: grid-wide O store rates, GB/s")
    ap.add_argument("--paced-burst-tiles", type=int_in(1, 1 << 16), default=8,
                    help="the pacer's burst tolerance, in tiles")
    ap.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE), default=8)
    ap.add_argument("--heads-per-rank", type=int_in(1, MAX_HEADS), default=3)
    ap.add_argument("--head-dim", type=int, choices=KERNEL_HEAD_DIMS, default=128)
    ap.add_argument("--trials", type=int_in(1, MAX_REPEATS), default=7)
    ap.add_argument("--platform", help="a calibrated platform model (python -m fa_a2a.calibrate --dest host): "
                    "print the Burst-Gap model's T_fused (T_FA4 + E_res) beside the host rows")
    ap.add_argument("--contention", action="store_true", help="run the contention probe too")
    ap.add_argument("--pace", action="store_true", help="run the pacing probe too (paced writers, see above)")
    ap.add_argument("--pace-fractions", type=float_in(0, 1), nargs="+", default=[0.1, 0.25, 0.5, 0.75, 0.9],
                    help="writer rates of the pacing probe, as fractions of its zero-gap rate into host memory")
    ap.add_argument("--pace-ctas", type=int_in(1, MAX_CTAS), nargs="+", default=[1, 2, 4, 8, 16, 33],
                    help="storing-CTA counts of the pacing probe's zero-gap writers")
    return ap, ap.parse_args(argv)


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # a bad flag is refused before torch and the kernels load

import torch  # noqa: E402

from cute_kernels.pacer import make_pacer  # noqa: E402
from cute_kernels.fa4_a2a_sm90 import TIMESTAMP_FIELDS  # noqa: E402
from cute_kernels.fa4 import fa4_a2a_forward, fa4_forward, tile_m_for  # noqa: E402
from fa_a2a.op import post_a2a  # noqa: E402
from fa_a2a.tools.xstage import US, FaTiles, PlatformModel, fused_residual  # noqa: E402
from graphs import capture, input_sets_needed, median, round_up, time_graphs  # noqa: E402
from ulysses.transport import pinned_on_device  # noqa: E402

def make_windows(dest, P, S_loc, H, D, dtype, keep):
    """[P, 1, S_loc, H, D] windows in HBM or in pinned host memory (wrapped as a CUDA tensor)."""
    nbytes = P * S_loc * H * D * torch.empty(0, dtype=dtype).element_size()
    if dest == "host":
        flat, host = pinned_on_device(nbytes, torch.uint8, torch.device("cuda", torch.cuda.current_device()))
        keep.append(host)
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return flat.view(dtype).view(P, 1, S_loc, H, D)


def hiding(t, t_fa, t_ser):
    return 1.0 - (t - t_fa) / (t_ser - t_fa) if t_ser - t_fa > 1.0 else float("nan")


def stamp_summary(st, t_kernel_us):
    """What a CTA waits for, from one launch's per-tile stamps [tiles, 7] (ns)."""
    f = {name: st[:, i] for i, name in enumerate(TIMESTAMP_FIELDS)}
    t0 = int(f["cta_start"].min())
    us = lambda x: float(x) / 1e3
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    # tiles of one CTA in order; a tile starts at its CTA's start or at its predecessor's end
    by_cta = {}
    for i in sorted(range(st.shape[0]), key=lambda i: int(f["epilogue"][i])):
        by_cta.setdefault(int(f["cta"][i]), []).append(i)
    first_main, later_main = [], []
    for tiles in by_cta.values():
        prev_end = None
        for i in tiles:
            start = int(f["cta_start"][i]) if prev_end is None else prev_end
            (first_main if prev_end is None else later_main).append(us(int(f["epilogue"][i]) - start))
            prev_end = int(f["end"][i])
    # non-persistent: on each SM, a later CTA's start after the earlier CTA's end
    by_sm = {}
    for c, tiles in by_cta.items():
        i = tiles[0]
        by_sm.setdefault(int(f["smid"][i]), []).append((int(f["cta_start"][i]), int(f["end"][tiles[-1]])))
    sm_gaps = []
    for ctas in by_sm.values():
        ctas.sort()
        sm_gaps += [us(b[0] - a[1]) for a, b in zip(ctas, ctas[1:])]
    span = us(int(f["end"].max()) - t0)
    return dict(
        ctas=len(by_cta), tiles=int(st.shape[0]),
        mainloop_first_us=med(first_main), mainloop_later_us=med(later_main),
        wait_sO_free_us=med([us(x) for x in (f["sO_free"] - f["epilogue"]).tolist()]),
        wait_sO_free_max_us=max(us(x) for x in (f["sO_free"] - f["epilogue"]).tolist()),
        issue_us=med([us(x) for x in (f["store_issued"] - f["sO_free"]).tolist()]),
        wait_after_issue_us=med([us(x) for x in (f["end"] - f["store_issued"]).tolist()]),
        wait_after_issue_max_us=max(us(x) for x in (f["end"] - f["store_issued"]).tolist()),
        next_cta_start_after_prev_end_us=med(sm_gaps),
        last_epilogue_end_us=span, kernel_event_us=t_kernel_us, kernel_end_after_last_tile_us=t_kernel_us - span,
        last_first_wave_end_us=us(sorted(int(f["end"][t[0]]) for t in by_cta.values())[-1] - t0),
    )


def contention_probe(n_sms, P, H_loc, D, dt, tile_m):
    """Per-tile mainloop (us) of a one-wave attention kernel alone and beside host / HBM stores."""
    n_tiles = n_sms // 2
    M1 = n_tiles * tile_m
    q1, k1, v1 = (torch.randn(1, M1, 1, D, device="cuda", dtype=dt) for _ in range(3))
    w1 = torch.empty(1, 1, M1, 1, D, device="cuda", dtype=dt)
    o8 = torch.randn(1, 8192, H_loc, D, device="cuda", dtype=dt)
    keep = []
    wins = {dest: make_windows(dest, P, 8192 // P, P * H_loc, D, dt, keep) for dest in ("hbm", "host")}
    side = torch.cuda.Stream()
    out = {}
    for cond in ("alone", "hbm", "host"):
        ts = torch.zeros(1, 1, n_tiles, len(TIMESTAMP_FIELDS), dtype=torch.int64, device="cuda")

        def body():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                torch.cuda._sleep(40000)  # ~20 us: the attention CTAs are resident first
                if cond != "alone":
                    post_a2a(o8, wins[cond], 0)
            fa4_a2a_forward(q1, k1, v1, w1, 0, o_store="tma", timestamps=ts)
            cur.wait_stream(side)

        graph = capture(body, 1)
        graph.replay()
        torch.cuda.synchronize()
        st = ts.view(-1, len(TIMESTAMP_FIELDS)).cpu()
        f = {name: st[:, i] for i, name in enumerate(TIMESTAMP_FIELDS)}
        main_us = ((f["epilogue"] - f["cta_start"]).double() / 1e3).tolist()
        out[cond] = dict(tiles=n_tiles, mainloop_median_us=statistics.median(main_us),
                         mainloop_max_us=max(main_us), mainloop_min_us=min(main_us))
    return out


PACE_COVER_US = 320.0   # a paced writer runs at least this long: it covers the attention (<= ~200 us) started 10 us later
PACE_BURST = 4096       # bytes per CTA per burst of the rate sweep: one round of 66 CTAs drains in ~5 us at 52 GB/s


def _writer_stats(times, B, window=None):
    """A writer run's stamps [K, n, 4] (globaltimer start/end, clock start/end): bytes per us over
    its whole run, or over the bursts that started inside window = (t0, t1) ns."""
    g0, g1 = times[:, :, 0], times[:, :, 1]
    if window is None:
        span = float(g1[:, -1].max() - g0[:, 0].min())
        return times.shape[0] * times.shape[1] * B / span * 1e3, span / 1e3
    t0, t1 = window
    n = int(((g0 >= t0) & (g0 < t1)).sum())
    return n * B / float(t1 - t0) * 1e3, float(g1[:, -1].max() - t1) / 1e3


def pace_probe(n_sms, D, dt, tile_m, fractions, ctas_list, replays=3):
    """Per-tile mainloop of a one-wave attention kernel on half the SMs beside paced writers on the
    other half (see the module docstring). Returns a list of rows (dicts)."""
    from cute_kernels.remote_store import run_bursts

    dev = torch.device("cuda", torch.cuda.current_device())
    half = n_sms // 2
    M1 = half * tile_m
    q1, k1, v1 = (torch.randn(1, M1, 1, D, device="cuda", dtype=dt) for _ in range(3))
    w1 = torch.empty(1, 1, M1, 1, D, device="cuda", dtype=dt)
    nwords = (32 << 20) // 4
    host_dst, host = pinned_on_device(nwords, torch.int32, dev)  # `host` owns the memory: kept alive here
    dsts = dict(host=host_dst, hbm=torch.empty(nwords, dtype=torch.int32, device="cuda"))
    side = torch.cuda.Stream()

    def solo(dest, K, B, gap, n, mode):
        times = torch.empty(K, n, 4, dtype=torch.int64, device="cuda")
        run_bursts(dsts[dest], num_ctas=K, bytes_per_cta=B, n_bursts=n, gap_iters=gap, mode=mode, times=times)
        torch.cuda.synchronize()
        return times.cpu()

    # the gap loop's speed: tiny bursts, a long gap
    t = solo("hbm", half, 16, 20000, 5, "vector")
    per = (t[:, 1:, 0] - t[:, :-1, 0]).double().median().item()
    ns_per_iter = (per - (t[:, :, 1] - t[:, :, 0]).double().median().item()) / 20000
    # the writer's zero-gap rate into host memory (the link rate R0 of this writer)
    r0, _ = _writer_stats(solo("host", half, PACE_BURST, 0, 200, "vector"), PACE_BURST)

    def gap_for(K, B, rate):
        return max(0, round((K * B / rate * 1e3) / ns_per_iter)) if rate else 0

    cfgs = [("alone", "vector", "host", 0, 0, None)]
    cfgs += [(f"host {f:.0%} R0", "vector", "host", half, PACE_BURST, f * r0) for f in fractions]
    cfgs += [("host gap 0", "vector", "host", half, PACE_BURST, None)]
    cfgs += [(f"host gap 0, K={K}", "vector", "host", K, PACE_BURST, None) for K in ctas_list if K < half]
    cfgs += [("host 50% R0, 32K bursts", "vector", "host", half, 32768, 0.5 * r0),
             ("host gap 0, 32K bursts", "vector", "host", half, 32768, None)]
    cfgs += [(f"host bulk {f:.0%} R0, 32K", "bulk", "host", half, 32768, f * r0) for f in (0.25, 0.5, 0.75)]
    cfgs += [("host bulk gap 0, 32K", "bulk", "host", half, 32768, None),
             ("hbm at 100% R0 (control)", "vector", "hbm", half, PACE_BURST, r0)]
    rows = []
    for name, mode, dest, K, B, rate in cfgs:
        ts = torch.zeros(1, 1, half, len(TIMESTAMP_FIELDS), dtype=torch.int64, device="cuda")
        row = dict(writer=name, mode=mode, dest=dest, K=K, B=B, target_GBps=rate / 1e3 if rate else None)
        times = None
        if K:
            gap = gap_for(K, B, rate)
            # the solo run sets the burst count that covers PACE_COVER_US (the rate does not need the attention)
            solo_rate, span = _writer_stats(solo(dest, K, B, gap, 20, mode), B)
            n = max(20, math.ceil(20 * PACE_COVER_US / span))
            times = torch.zeros(K, n, 4, dtype=torch.int64, device="cuda")
            smid = torch.empty(K, dtype=torch.int32, device="cuda")
            sync = torch.zeros(1, dtype=torch.int32, device="cuda")
            row.update(gap_iters=gap, n_bursts=n, solo_GBps=solo_rate / 1e3)

        def body():
            cur = torch.cuda.current_stream()
            if K:
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    run_bursts(dsts[dest], num_ctas=K, bytes_per_cta=B, n_bursts=n, gap_iters=gap, mode=mode,
                               times=times, smid=smid, sync=sync)
            torch.cuda._sleep(20000)  # ~10 us: the writer's CTAs are resident and in steady state first
            fa4_a2a_forward(q1, k1, v1, w1, 0, o_store="tma", timestamps=ts)
            if K:
                cur.wait_stream(side)

        graph = capture(body, 1)
        mains, rates, run_rates, tails, overlap = [], [], [], [], 0
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
            st = ts.view(-1, len(TIMESTAMP_FIELDS)).cpu()
            f = {nm: st[:, i] for i, nm in enumerate(TIMESTAMP_FIELDS)}
            mains.append(statistics.median(((f["epilogue"] - f["cta_start"]).double() / 1e3).tolist()))
            if K:
                w = times.cpu()
                r, tail = _writer_stats(w, B, (int(f["cta_start"].min()), int(f["epilogue"].max())))
                rates.append(r / 1e3)
                tails.append(tail)
                run_rates.append(_writer_stats(w, B)[0] / 1e3)
                overlap = max(overlap, len(set(smid.cpu().tolist()) & set(f["smid"].tolist())))
        row.update(mainloop_us=statistics.median(mains), mainloop_replays_us=mains)
        if K:
            # covered: the writer's last burst ended after the attention's last mainloop (tail > 0)
            row.update(rate_GBps=statistics.median(rates), run_GBps=statistics.median(run_rates),
                       writer_after_attention_us=min(tails),
                       shared_sms=overlap)
        rows.append(row)
    base = rows[0]["mainloop_us"]
    for row in rows:
        row["slowdown"] = row["mainloop_us"] / base
    return dict(r0_GBps=r0 / 1e3, ns_per_gap_iter=ns_per_iter, rows=rows)


def main(parser, args):
    if not torch.cuda.is_available():
        raise SystemExit(no_gpu("examples/host_window_hiding.py", "the hiding probe"))
    P, H_loc, D, dt = args.world_size, args.heads_per_rank, args.head_dim, torch.bfloat16
    H = P * H_loc
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile_m = tile_m_for(D)
    for flag, values in (("--seqlens", args.seqlens), ("--hbm-only-seqlens", args.hbm_only_seqlens)):
        try:
            check_seqlens(values, P * tile_m, f"P * tile_m = {P} * {tile_m}", flag=flag)
        except ValueError as e:
            parser.error(str(e))
    platform = PlatformModel.from_json(args.platform) if args.platform else None
    rows, stamps, raw = [], [], {}
    print("| M | dest | variant | us | / FA4 | hiding H | bound us | H_bound | model us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for M in args.seqlens + args.hbm_only_seqlens:
        S_loc = M // P
        set_bytes = 4 * M * H_loc * D * 2
        sets = [[torch.randn(1, M, H_loc, D, device="cuda", dtype=dt) for _ in range(4)]
                for _ in range(input_sets_needed(set_bytes))]
        keep = []
        for dest in (args.dests if M in args.seqlens else ["hbm"]):
            win = make_windows(dest, P, S_loc, H, D, dt, keep)
            mine = win[:, :, :, :H_loc]
            q, k, v, o = sets[0]
            win.fill_(float("nan"))
            fa4_forward(q, k, v, o)
            post_a2a(o, win, 0)
            torch.cuda.synchronize()
            ref = mine.clone()
            exact = {}
            rates = args.paced_host_gbps if dest == "host" else args.paced_hbm_gbps
            pacers = {f"paced@{r:g}": make_pacer(q.device, r, tile_m * D * 2, args.paced_burst_tiles) for r in rates}
            runs = {name: (lambda q, k, v, w, kw=VARIANTS[name]: fa4_a2a_forward(q, k, v, w, 0, **kw))
                    for name in args.variants}
            runs.update({name: (lambda q, k, v, w, p=p: fa4_a2a_forward(q, k, v, w, 0, pacer=p))
                         for name, p in pacers.items()})
            for name, run in runs.items():
                win.fill_(float("nan"))
                run(q, k, v, win)
                torch.cuda.synchronize()
                exact[name] = bool(torch.equal(mine, ref))
            methods = {
                "fa4": [lambda s=s: fa4_forward(s[0], s[1], s[2], s[3]) for s in sets],
                "a2a": [lambda s=s, w=win: post_a2a(s[3], w, 0) for s in sets],
                "serial": [lambda s=s, w=win: (fa4_forward(s[0], s[1], s[2], s[3]), post_a2a(s[3], w, 0))
                           for s in sets],
            }
            for name, run in runs.items():
                methods[name] = [lambda s=s, run=run, w=win: run(s[0], s[1], s[2], w) for s in sets]
            est_us = 184.0 * (M / 8192) ** 2 * H_loc / 3  # FA4 on an H200, for ~2 ms per replay
            n_calls = round_up(max(2, round(2000 / est_us)), len(sets))
            times = time_graphs(methods, n_calls=n_calls, trials=args.trials, warmup=2)
            t = {name: median(v) for name, v in times.items()}
            tiles = FaTiles.fa4(M, H_loc, D, num_sms=n_sms)
            bound = tiles.wave_drain_bound(t["fa4"] * US, M * H_loc * D * 2 / (t["a2a"] * US)) / US
            model_us = (t["fa4"] + fused_residual(platform, tiles, t["fa4"] * US)["e_res"] / US
                        if platform is not None and dest == "host" else None)
            for name in methods:
                h = hiding(t[name], t["fa4"], t["serial"]) if name not in ("fa4", "a2a") else float("nan")
                row = dict(M=M, dest=dest, variant=name, us=t[name], trials_us=times[name],
                           ratio_fa4=t[name] / t["fa4"], hiding=h, bound_us=bound,
                           hiding_bound=hiding(bound, t["fa4"], t["serial"]), model_us=model_us,
                           exact=exact.get(name))
                rows.append(row)
                flag = "" if exact.get(name, True) else " NOT EXACT"
                print(f"| {M} | {dest} | {name}{flag} | {t[name]:.1f} | {row['ratio_fa4']:.3f} | "
                      f"{h:.0%} | {bound:.1f} | {row['hiding_bound']:.0%} | "
                      f"{'-' if model_us is None else f'{model_us:.1f}'} |", flush=True)
            if M in args.stamp_seqlens:
                q, k, v, _ = sets[0]
                for name in args.variants:
                    ts = torch.zeros(1, H_loc, M // tile_m, len(TIMESTAMP_FIELDS), dtype=torch.int64, device="cuda")
                    run = lambda w=win, ts=ts, kw=VARIANTS[name]: fa4_a2a_forward(q, k, v, w, 0, timestamps=ts, **kw)
                    graph = capture(run, 1)  # a replay starts the kernel within a few us of its event
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    torch.cuda.synchronize()
                    st = ts.view(-1, len(TIMESTAMP_FIELDS)).cpu()
                    summ = dict(M=M, dest=dest, variant=name, **stamp_summary(st, a.elapsed_time(b) * 1e3))
                    stamps.append(summ)
                    raw[f"{M}/{dest}/{name}"] = st.tolist()
            del win, mine, ref
        del sets, keep
        torch.cuda.empty_cache()
    if stamps:
        keys = [k for k in stamps[0] if k not in ("M", "dest", "variant")]
        print("\nper-tile stamps, one launch (medians over tiles, us):")
        for s in stamps:
            print(f"{s['M']} {s['dest']} {s['variant']}: " + ", ".join(
                f"{k}={s[k]:.1f}" if isinstance(s[k], float) else f"{k}={s[k]}" for k in keys))
    contention = None
    if args.contention:
        contention = contention_probe(n_sms, P, H_loc, D, dt, tile_m)
        print("\ncontention probe: per-tile mainloop of a one-wave attention kernel (us, median / min / max):")
        for cond, c in contention.items():
            print(f"{cond}: {c['mainloop_median_us']:.1f} / {c['mainloop_min_us']:.1f} / {c['mainloop_max_us']:.1f}"
                  f" ({c['tiles']} tiles)")
    pacing = None
    if args.pace:
        pacing = pace_probe(n_sms, D, dt, tile_m, args.pace_fractions, args.pace_ctas)
        print(f"\npacing probe: writer zero-gap rate into host memory R0 = {pacing['r0_GBps']:.1f} GB/s; "
              f"attention per-tile mainloop beside it (median of replays):")
        print("| writer | K | B | GB/s while attention ran | GB/s whole run | GB/s writer alone | mainloop us | slowdown |")
        print("|---|---|---|---|---|---|---|---|")
        for r in pacing["rows"]:
            rate = f"{r['rate_GBps']:.1f}" if "rate_GBps" in r else "-"
            solo_r = f"{r['solo_GBps']:.1f}" if "solo_GBps" in r else "-"
            run_r = f"{r['run_GBps']:.1f}" if "run_GBps" in r else "-"
            warn = ""
            if r.get("writer_after_attention_us", 1.0) <= 0:
                warn += " (writer ended early)"
            if r.get("shared_sms"):
                warn += f" ({r['shared_sms']} shared SMs)"
            print(f"| {r['writer']}{warn} | {r['K']} | {r['B']} | {rate} | {run_r} | {solo_r} | "
                  f"{r['mainloop_us']:.1f} | {r['slowdown']:.2f} |", flush=True)
    card = torch.cuda.get_device_name()
    with open(args.out, "w") as fh:
        json.dump(dict(card=card, P=P, H_loc=H_loc, D=D, dtype="bf16", sms=n_sms, rows=rows,
                       stamp_fields=TIMESTAMP_FIELDS, stamps=stamps, raw_stamps=raw,
                       contention=contention, pacing=pacing), fh)


if __name__ == "__main__":
    main(PARSER, ARGS)
