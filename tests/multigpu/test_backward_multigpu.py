"""The backward on real ranks, one GPU each (torchrun, NCCL, VMM windows): impl "fused" (dO's pre-A2A
kernel, FA4's backward kernels storing dq, dk, dv into the owners' windows over NVLink), "serial" and
"nccl" (FA4's backward between all_to_all_single exchanges) give the same gradients bit for bit under
torch.use_deterministic_algorithms(True), every rank; the fused backward runs (no collective) where it
applies (with joint rows: on SM90; elsewhere they fall back to the exchanges and still agree). With the output
projection (ulysses_attention_out_proj) the fused backward takes dO from the projection's GEMM (no
collective) and its grads agree with serial's within bf16 rounding (the two dO GEMMs round apart),
the weight's and bias's bit for bit.

pytest runs this file under torchrun in a subprocess for P = 2, 4 and 8 as far as the machine has
GPUs. Speed: `torchrun --nproc-per-node=P -m fa_a2a.bench --backward` (the benchmark, not this test).
"""
import os

import pytest
import torch

from tests.multiproc import run_torchrun_on_gpus

# (S, H, H_kv, D, J, causal): S_loc a multiple of the tiles; seq_len padding with GQA; causal D 64;
# joint rows (fused on SM90, the exchange backward elsewhere)
CASES = [(16384, 24, 24, 128, 0, False), (8 * 1000 - 5, 16, 8, 128, 0, False), (8192, 8, 8, 64, 0, True),
         (4096, 24, 24, 128, 77, False)]


@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_backward_on_distinct_gpus(nproc):
    out = run_torchrun_on_gpus(__file__, nproc)
    assert out.count("RANK OK") == nproc, out[-4000:]


def main():
    import torch.distributed as dist

    from fa_a2a.op import ulysses_attention, ulysses_attention_out_proj
    from ulysses.transport import close_transports, get_transport

    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    torch.use_deterministic_algorithms(True, warn_only=True)
    calls, all_to_all = [], dist.all_to_all_single

    def counted(*args, **kwargs):  # the exchange backward's collective; the fused backward has none
        calls.append(1)
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted
    for S, H, H_kv, D, J, causal in CASES:
        S_loc = -(-S // P)
        rows = min(S_loc, S - rank * S_loc)  # this rank's rows (the last rank's shard is short with padding)
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        shapes = ((1, rows, H, D), (1, rows, H_kv, D), (1, rows, H_kv, D))
        ins = [torch.randn(s, device="cuda", generator=gen).to(torch.bfloat16) for s in shapes]
        jgen = torch.Generator(device="cuda").manual_seed(7)  # the joint rows: the same on every rank
        joint = tuple(torch.randn(1, J, h, D, device="cuda", generator=jgen).to(torch.bfloat16)
                      for h in (H, H_kv, H_kv)) if J else None
        dout = torch.randn(1, rows, H, D, device="cuda", generator=gen).to(torch.bfloat16)
        grads, exchanges = {}, {}
        for impl in ("fused", "serial", "nccl"):
            q, k, v = (t.clone().requires_grad_() for t in ins)
            res = ulysses_attention(q, k, v, group=group, impl=impl, joint=joint, causal=causal, seq_len=S)
            out = res[0] if J else res
            calls.clear()
            out.backward(dout)
            exchanges[impl] = len(calls)
            grads[impl] = [t.grad for t in (q, k, v)]
        assert exchanges["fused"] == 0, (rank, S, J, exchanges)  # suffix padding (seq_len): the fused backward
        assert exchanges["serial"] > 0 and exchanges["nccl"] > 0, exchanges
        for impl in ("serial", "nccl"):
            for name, a, b in zip("qkv", grads["fused"], grads[impl]):
                assert torch.equal(a, b), (f"rank {rank}: S {S} H {H}/{H_kv} D {D} J {J} causal {causal}: d{name} "
                                           f"of fused and {impl} differ")
        if rank == 0:
            print(f"P={P} S={S} H={H}/{H_kv} D={D} J={J} causal={causal}: fused == serial == nccl grads", flush=True)
        if J:
            continue
        wgen = torch.Generator(device="cuda").manual_seed(9)  # the output projection: the same on every rank
        w = (torch.randn(3 * 128, H * D, device="cuda", generator=wgen) / (H * D) ** 0.5).to(torch.bfloat16)
        b = torch.randn(3 * 128, device="cuda", generator=wgen).to(torch.bfloat16)
        dy = torch.randn(1, rows, 3 * 128, device="cuda", generator=gen).to(torch.bfloat16)
        for impl in ("fused", "serial"):
            leaves = [t.clone().requires_grad_() for t in (*ins, w, b)]
            y = ulysses_attention_out_proj(*leaves, group=group, impl=impl, causal=causal, seq_len=S)
            calls.clear()
            y.backward(dy)
            exchanges[impl] = len(calls)
            grads[impl] = [t.grad for t in leaves]
        assert exchanges["fused"] == 0 and exchanges["serial"] > 0, exchanges
        for name, a, e in zip(("dq", "dk", "dv"), grads["fused"], grads["serial"]):
            assert (a.float() - e.float()).abs().max() <= 0.02 * e.float().abs().max() + 1e-3, (rank, S, name)
        for name, a, e in zip(("dW", "db"), grads["fused"][3:], grads["serial"][3:]):
            assert torch.equal(a, e), (rank, S, name)
    get_transport(group).check()
    close_transports()
    dist.destroy_process_group()
    print("RANK OK", flush=True)


if __name__ == "__main__":
    main()
