"""ulysses_attention on real ranks, one GPU each (torchrun, NCCL; windows mapped with CUDA VMM).

pytest runs this file under torchrun in a subprocess, for P = 2, 4 and 8 as far as the machine
has GPUs. Every rank builds the same inputs; "fused", "serial" and "nccl" must equal the
reference path (ulysses.reference's A2As around fa4_forward) bit for bit on the valid rows: the
same FA4 runs on the same data. "reference" (fp32 attention) is checked against the fp64 oracle.

Before every impl each rank poisons its own windows (NaN) and the ranks line up on the host, so
an impl that leaves some remote tile unwritten shows NaN instead of the previous impl's values
(the window plan is shared by the impls). After the last case the transport's check() raises if
any barrier timed out. `check_ranks` is also run by tests/gpu/test_transport_ipc.py on processes
sharing one GPU, where it is shown to fail on a fused epilogue that drops its remote tiles.
"""
import os

import pytest
import torch

from tests.helpers import poison_allocated
from tests.multiproc import run_torchrun_on_gpus

IMPLS = ("fused", "serial", "nccl", "reference")
# (B, S, H, H_kv, D, J, causal) as functions of P
CASES = (lambda P: (1, P * 1024, 3 * P, 3 * P, 128, 0, False),
         lambda P: (2, P * 251 - 1, 2 * P - 2, 2, 128, 77, False),  # uneven S, padded heads, GQA, joint
         lambda P: (1, P * 512, 2 * P, P, 64, 0, True))


@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4, 8])
@pytest.mark.parametrize("backend", ["vmm", "symm"])
def test_torchrun_real_ranks(backend, nproc):
    out = run_torchrun_on_gpus(__file__, nproc, dict(FA_A2A_TRANSPORT=backend))
    if backend == "symm" and out.count("RANK SYMM-NONUNIFORM") == nproc:
        pytest.skip("torch symmetric memory placed the peers' buffers at no single stride here")
    assert out.count("RANK OK") == nproc, out[-4000:]


def _poison_own_windows(transport, rank: int) -> None:
    """NaN into this rank's window of every float allocation (but those of outputs lent out and still
    held), then every rank waits for all."""
    poison_allocated(transport, [rank])
    torch.cuda.synchronize()
    transport.host_barrier()


def drop_remote_tiles(fused_launcher):
    """A broken fused epilogue for tests, in place of cute_kernels.fa4.fa4_a2a_launcher: its launches
    leave O tiles in this rank's own window only."""

    def broken(q, k, v, out_windows, rank, **kwargs):
        scratch = torch.empty_like(out_windows, memory_format=torch.contiguous_format)
        launch = fused_launcher(q, k, v, scratch, rank, **kwargs)

        def run():
            launch()
            out_windows[rank].copy_(scratch[rank])

        return run

    return broken


def check_ranks(P, group, rank, *, impls=IMPLS, cases=CASES):
    """Every impl on every case equals the reference pipeline on this rank (see the docstring)."""
    from cute_kernels.fa4 import fa4_forward
    from fa_a2a.op import ulysses_attention
    from ulysses.layout import UlyssesLayout, split_seq
    from ulysses.reference import emulated_post_a2a, emulated_pre_a2a, full_attention
    from ulysses.transport import get_transport

    dtype = torch.bfloat16
    for i, case in enumerate(cases):
        B, S, H, Hkv, D, J, causal = case(P)
        g = torch.Generator(device="cuda").manual_seed(i)
        full = [torch.randn(B, S, h, D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv)]
        joint = tuple(torch.randn(B, J, h, D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv)) if J else None
        shards = [split_seq(x, P) for x in full]
        L = UlyssesLayout(S, H, Hkv, P, joint_len=J)
        used = L.seqused_k(causal)
        used = None if used is None else torch.full((B,), used, dtype=torch.int32, device="cuda")
        heads = emulated_pre_a2a(L, *shards, joint)
        want, want_joint = emulated_post_a2a(L, [fa4_forward(q, k, v, causal=causal, seqused_k=used) for q, k, v in heads])
        n = L.valid_rows(rank)
        for impl in impls:
            try:
                if impl in ("fused", "serial"):
                    _poison_own_windows(get_transport(group), rank)
                res = ulysses_attention(*(s[rank] for s in shards), group=group, impl=impl, joint=joint,
                                        causal=causal, seq_len=S)
            except ValueError as e:  # only the "symm" backend may refuse, and only for this reason
                if os.environ.get("FA_A2A_TRANSPORT") == "symm" and "one positive stride" in str(e):
                    return False
                raise
            out, jout = res if joint is not None else (res, None)
            assert (out[:, n:] == 0).all(), (impl, i)
            if impl == "reference":
                ref = full_attention(*full, joint=joint, causal=causal)
                base = full_attention(*full, joint=joint, causal=causal, dtype=dtype)
                (ref, jref), (base, jbase) = (ref, base) if joint is not None else ((ref, None), (base, None))
                first = rank * L.seq_loc
                err = (out[:, :n].double() - ref[:, first:first + n]).abs().max().item()
                base_err = (base[:, first:first + n].double() - ref[:, first:first + n]).abs().max().item()
                assert err <= 2 * base_err + 1e-3, (impl, i, err, base_err)
                continue
            assert torch.equal(out[:, :n], want[rank][:, :n]), (impl, i, rank)
            if joint is not None:
                assert torch.equal(jout, want_joint), (impl, i, rank)
    torch.cuda.synchronize()
    get_transport(group).check()
    return True


def _main():
    import torch.distributed as dist

    from ulysses.transport import close_transports

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, P = dist.get_rank(), dist.get_world_size()
    if not check_ranks(P, None, rank):
        print(f"RANK SYMM-NONUNIFORM {rank}", flush=True)
        return
    close_transports()
    dist.destroy_process_group()
    print(f"RANK OK {rank}", flush=True)


if __name__ == "__main__":
    _main()
