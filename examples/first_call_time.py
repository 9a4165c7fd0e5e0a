"""Time to first output of a fresh process, with the compile cache cold and warm.

For each case (the attention op fa_a2a.ulysses_attention, impl "fused", and the attention block
fa_a2a.ulysses_qkv_attention, each at P = 1 and at P = 2 rank processes on GPU 0; bf16, B = 1,
S = 1024, H = 8, D = 128, C = 512), fresh processes run the case twice: first on an empty cache
folder (cold: every kernel compiles and is exported), then on the same folder (warm: every kernel
loads). Each process reports the seconds from its start to the end of its imports and to the
first output (synchronized), the first call alone (from its start to its synchronized output),
the second call's milliseconds, and whether the CuTe DSL got imported (a warm process whose
kernels all load as shared libraries never imports it); P = 2 shows the slower rank.
The warm output must equal the cold one bit for bit (a loaded kernel computes what the compiled
one did), and the warm run must add no entry to the folder.

    python examples/first_call_time.py            # one SM90 GPU; prints the table
    python examples/first_call_time.py --profile  # also where a warm P = 1 first call spends its time

Columns: import s, first output s (from process start), first call s, second call ms, CuTe DSL
imported, cache entries after the run, whether the warm output equals the cold one, the warm
first output over the cold one, and the same after each rank's imports (first output minus
imports: what the compile cache acts on; Python and torch's import is the floor of a warm start).
With --profile the profiles follow the table.
"""

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

B, S, H, D, C = 1, 1024, 8, 128, 512
CASES = (("attention", 1), ("attention", 2), ("block", 1), ("block", 2))
ROOT = Path(__file__).resolve().parents[1]


def _inputs(what: str, P: int, rank: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1234)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    rows = slice(rank * S // P, (rank + 1) * S // P)
    if what == "attention":
        return [r(B, S, H, D)[:, rows].to(torch.bfloat16).contiguous() for _ in range(3)]
    from fa_a2a import block

    n = 3 * H * D
    chain = block.TorchQKV((r(n, C) / C ** 0.5).to(torch.bfloat16), (0.1 * r(n)).to(torch.bfloat16),
                           r(D) * 0.2 + 1.0, r(D) * 0.2 + 1.0, H, H, D)
    x = r(B, S, C)[:, rows].to(torch.bfloat16).contiguous()
    rotary = block.rotary_pair(torch.arange(S, device="cuda")[rows], D)
    return x, block.block_weights(chain, P), rotary


def child(what: str, P: int, rank: int, init_file: str, out_file: str) -> None:
    """One rank process: time its imports, its first output and a second call; save the output."""
    import torch
    import torch.distributed as dist

    import fa_a2a

    imported = time.perf_counter() - _START
    torch.cuda.set_device(0)
    group = None
    if P > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P)
        group = dist.group.WORLD
    args = _inputs(what, P, rank)

    def call():
        with torch.no_grad():
            if what == "attention":
                return fa_a2a.ulysses_attention(*args, group=group, impl="fused")
            x, proj, rotary = args
            return fa_a2a.ulysses_qkv_attention(x, proj, group=group, rotary=rotary, impl="fused")

    profile = None
    if os.environ.get("FIRST_CALL_PROFILE") == "1" and rank == 0:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - _START
    first_call = time.perf_counter() - t
    dsl = int("cutlass" in sys.modules)
    if profile is not None:
        import io
        import pstats

        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        print("\n".join("PROFILE " + ln for ln in text.getvalue().splitlines() if ln.strip()), flush=True)
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    second_ms = (time.perf_counter() - t) * 1e3
    torch.save(out.cpu(), out_file)
    print(f"RESULT {imported:.2f} {first:.2f} {second_ms:.2f} {first_call:.2f} {dsl}", flush=True)
    if P > 1:
        from ulysses.transport import close_transports

        dist.barrier()
        close_transports()
        dist.destroy_process_group()


def run_case(what: str, P: int, cache: Path, work: Path, tag: str, profile: bool = False) -> dict:
    """Start P fresh rank processes on `cache`; their slowest times and rank 0's output (and rank
    0's profile of its first call with `profile`)."""
    init_file = work / f"init-{what}-{P}-{tag}"
    env = dict(os.environ, FA_A2A_CACHE_DIR=str(cache), FA_A2A_CACHE="1", FIRST_CALL_PROFILE=str(int(profile)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, __file__, "--child", what, str(P), str(r), str(init_file),
                               str(work / f"out-{what}-{P}-{tag}-{r}.pt")],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(P)]
    results = []
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"{what} P={P} {tag} rank {r} failed (exit {p.returncode}):\n{out[-4000:]}")
        results.append([float(v) for v in lines[-1].split()[1:]])
        if r == 0:
            profile_text = "\n".join(ln[len("PROFILE "):] for ln in out.splitlines() if ln.startswith("PROFILE "))
    imported, first, second, first_call, dsl = (max(col) for col in zip(*results))
    after = max(r[1] - r[0] for r in results)  # first output after the rank's own imports
    return dict(imported=imported, first=first, second=second, first_call=first_call, dsl=bool(dsl), after=after,
                profile=profile_text,
                entries=len(list(cache.rglob("*.o"))), out=work / f"out-{what}-{P}-{tag}-0.pt")


def main(profile: bool) -> None:
    import torch

    from fa_a2a.tools.cli import no_gpu  # here, not at the top: a rank child's import time stays the project's own

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(no_gpu("examples/first_call_time.py", "the first-call timing",
                                "an SM90 GPU (compute capability 9.0)"))
    print(f"{'case':<14}{'cache':<7}{'import s':>9}{'first output s':>16}{'first call s':>14}"
          f"{'second call ms':>16}{'CuTe DSL':>10}{'entries':>9}{'same output':>13}{'warm/cold':>11}"
          f"{'after imports w/c':>19}")
    profiles = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, P in CASES:
            cache, work = Path(tmp) / f"cache-{what}-{P}", Path(tmp)
            cold = run_case(what, P, cache, work, "cold")
            warm = run_case(what, P, cache, work, "warm", profile=profile and P == 1)
            same = torch.equal(torch.load(cold["out"]), torch.load(warm["out"]))
            for tag, res in (("cold", cold), ("warm", warm)):
                flag = "" if tag == "cold" else ("yes" if same else "NO")
                ratio = "" if tag == "cold" else f"{warm['first'] / cold['first']:.2f}"
                after = "" if tag == "cold" else f"{warm['after'] / cold['after']:.3f}"
                print(f"{what + ' P=' + str(P):<14}{tag:<7}{res['imported']:>9.2f}{res['first']:>16.2f}"
                      f"{res['first_call']:>14.2f}{res['second']:>16.2f}{'yes' if res['dsl'] else 'no':>10}"
                      f"{res['entries']:>9}{flag:>13}{ratio:>11}{after:>19}", flush=True)
            if warm["profile"]:
                profiles.append(f"first call of {what} P={P}, warm cache, rank 0 (cProfile, cumulative):\n"
                                f"{warm['profile']}")
            if not same or warm["entries"] != cold["entries"]:
                raise SystemExit(f"{what} P={P}: the warm run " + ("changed the output" if not same else
                                 f"added cache entries ({cold['entries']} -> {warm['entries']})"))
    print("\n".join(profiles))  # after the table: the table's rows stay together


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="print where a warm P = 1 first call spends its time")
    parser.add_argument("--child", nargs=5, metavar=("WHAT", "P", "RANK", "INIT_FILE", "OUT_FILE"),
                        help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        what, P, rank, init_file, out_file = ns.child
        child(what, int(P), int(rank), init_file, out_file)
    else:
        main(ns.profile)
