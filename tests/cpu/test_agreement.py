"""Every call agreed across ranks (issue: ranks that disagree after the first call).

Gloo ranks in spawned processes (2 and 3 ranks), impl "reference" and "nccl" (the permute +
all_to_all pipeline over gloo): every rank first makes the same call(s), so each rank's signature
is cached, then the ranks disagree. Every rank must raise a ValueError naming the argument within
a few seconds - no wrong answer, no hang. Each case runs under a hard deadline: the processes are
killed and the test fails if any rank is still running.
"""

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from fa_a2a import ulysses_attention
from tests.multiproc import spawn_with_deadline

DEADLINE_S = 90
B, S_LOC, H, D = 1, 4, 6, 8
ON_CUDA = False  # set in the rank processes of the GPU tier (fused / serial): bf16 CUDA tensors, D = 64


def run_with_deadline(case, P, impl, env=None, cuda=False):
    """Spawn P gloo ranks running case(rank, P, group, impl) (cuda: every rank on GPU 0); fail if
    any rank fails or outlives the deadline."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(_worker, (case, P, impl, os.path.join(tmp, "init"), env or {}, cuda), P, DEADLINE_S,
                            f"{case.__name__} (P={P}, {impl})")


def _worker(rank, case, P, impl, init_file, env, cuda):
    os.environ.update(env)
    torch.set_num_threads(1)
    if cuda:
        global ON_CUDA, D
        ON_CUDA, D = True, 64
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    try:
        case(rank, P, dist.new_group(list(range(P))), impl)
        dist.barrier()  # no rank tears down its gloo pairs while a peer is still in its last collective
    finally:
        dist.destroy_process_group()


def _qkv(rank, S_loc=S_LOC, heads=H, **kw):
    g = torch.Generator().manual_seed(rank)
    qkv = [torch.randn(B, S_loc, heads, D, generator=g, **kw) for _ in range(3)]
    return [t.to("cuda", torch.bfloat16) for t in qkv] if ON_CUDA else qkv


def _refused(match, call):
    """call() raises ValueError matching `match`, within a few seconds."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        call()
    took = time.monotonic() - t0
    assert took < 10, f"refusal took {took:.1f} s"
    return str(info.value)


def _call(group, impl, qkv, **kw):
    with torch.no_grad():
        return ulysses_attention(*qkv, group=group, impl=impl, **kw)


# ---- cases (module level: spawned) -------------------------------------------------------------------
def _swapped_known_signatures(rank, P, group, impl):
    """Ranks call signatures that every rank has used before, in a different order."""
    qkv = _qkv(rank)
    for kw_a, kw_b, name in (({"causal": False}, {"causal": True}, "causal"),
                             ({"softmax_scale": 0.5}, {"softmax_scale": 0.25}, "softmax_scale"),
                             ({"seq_len": P * S_LOC}, {"seq_len": P * S_LOC - 1}, "seq_len")):
        good_a, good_b = _call(group, impl, qkv, **kw_a), _call(group, impl, qkv, **kw_b)
        msg = _refused(f"^{name}: expected the same value on every rank",
                       lambda: _call(group, impl, qkv, **(kw_a if rank == 0 else kw_b)))
        assert "rank 0" in msg and "rank 1" in msg
        assert torch.equal(_call(group, impl, qkv, **kw_a), good_a)  # the ranks go on after a refusal
        assert torch.equal(_call(group, impl, qkv, **kw_b), good_b)
    # shapes: H and S_loc swapped between known signatures
    small, big = _qkv(rank, heads=H), _qkv(rank, heads=2 * H)
    _call(group, impl, small), _call(group, impl, big)
    _refused(r"^q \(H\): expected the same", lambda: _call(group, impl, small if rank == 0 else big))
    short, long_ = _qkv(rank, S_loc=S_LOC), _qkv(rank, S_loc=2 * S_LOC)
    _call(group, impl, short), _call(group, impl, long_)
    _refused(r"^q \(S_loc\): expected the same", lambda: _call(group, impl, short if rank == 0 else long_))


def _one_rank_changes(rank, P, group, impl):
    """One rank makes a new call (S_loc, causal, dtype) while the others repeat a cached one."""
    qkv = _qkv(rank)
    _call(group, impl, qkv)
    last = rank == P - 1
    _refused(r"^q \(S_loc\)", lambda: _call(group, impl, _qkv(rank, S_loc=S_LOC + 1) if last else qkv))
    _refused(r"^causal", lambda: _call(group, impl, qkv, causal=last))
    other = torch.float16 if ON_CUDA else torch.double
    _refused(r"^q \(dtype\)", lambda: _call(group, impl, [t.to(other) for t in qkv] if last else qkv))
    _call(group, impl, qkv)


def _one_rank_refuses_locally(rank, P, group, impl):
    """A rank's own ValueError reaches every rank; so does a rank whose inputs alone require grad
    (grad mode on: requires_grad is part of the agreed signature, the backward is collective)."""
    qkv = _qkv(rank)
    _call(group, impl, qkv)
    grad = [t.clone().requires_grad_(rank == 1) for t in qkv]
    msg = _refused("requires_grad", lambda: ulysses_attention(*grad, group=group, impl=impl))
    assert msg.startswith("requires_grad (grad mode on and q, k, v or joint requiring grad): expected the same "
                          "value on every rank"), msg
    bad = _qkv(rank, S_loc=S_LOC) if rank else [qkv[0], qkv[1], qkv[2][..., :D // 2]]
    _refused(r"v: expected k's shape", lambda: _call(group, impl, bad))
    _call(group, impl, qkv)


def _different_groups(rank, P, group, impl):
    """Ranks pass different process-group objects over the same ranks."""
    other = dist.new_group(list(range(P)))
    qkv = _qkv(rank)
    _call(group, impl, qkv)
    _call(other, impl, qkv)
    _refused(r"^group \(process group\): expected the same", lambda: _call(group if rank == 0 else other, impl, qkv))


def _devices_and_joint(rank, P, group, impl):
    """Device type (meta vs cpu), joint on/off, shard_rows lists, joint data (FA_A2A_CHECK_JOINT=1)."""
    qkv = _qkv(rank)
    _call(group, impl, qkv)
    meta = [t.to("meta") for t in qkv]
    _refused(r"^q \(device type\)", lambda: _call(group, "reference", meta if rank == 0 else qkv))
    g = torch.Generator().manual_seed(7)  # the same joint tokens on every rank
    joint = [torch.randn(B, 3, H, D, generator=g) for _ in range(3)]
    _call(group, impl, qkv, joint=joint)
    _refused(r"^joint \(J rows", lambda: _call(group, impl, qkv, **({"joint": joint} if rank == 0 else {})))
    rows_a = [S_LOC] * P
    rows_b = [S_LOC + 1] + [S_LOC] * (P - 1)
    mine = _qkv(rank, S_loc=rows_b[rank])
    _refused(r"^shard_rows: expected the same value on every rank",
             lambda: _call(group, impl, mine if rank == 0 else qkv, shard_rows=rows_b if rank == 0 else rows_a))
    if os.environ.get("FA_A2A_CHECK_JOINT") == "1":
        mixed = [t + rank for t in joint]
        _refused(r"^joint \(data checksum", lambda: _call(group, impl, qkv, joint=mixed))
    _call(group, impl, qkv, joint=joint)


def _block_refusal(rank, P, group, impl):
    """The attention block's local refusals go through the same agreement: every rank raises."""
    import cute_kernels.qkv_a2a_sm90  # noqa: F401 - the checks' imports (quack, CuTe DSL: seconds on a
    from fa_a2a.block import ulysses_qkv_attention  # loaded 2-core machine) are not the refusal's time

    x = torch.randn(1, S_LOC, 16)
    _refused("", lambda: ulysses_qkv_attention(x, None if rank == 0 else "weights", group=group, impl=impl))
    _call(group, "reference", _qkv(rank))  # the ranks still meet afterwards


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("impl", ["reference", "nccl"])
def test_swapped_known_signatures_are_refused(P, impl):
    run_with_deadline(_swapped_known_signatures, P, impl)


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("impl", ["reference", "nccl"])
def test_one_rank_with_a_new_signature_is_refused(P, impl):
    run_with_deadline(_one_rank_changes, P, impl)


@pytest.mark.parametrize("P", [2, 3])
def test_a_local_refusal_reaches_every_rank(P):
    run_with_deadline(_one_rank_refuses_locally, P, "nccl")


@pytest.mark.parametrize("P", [2, 3])
def test_different_group_objects_are_refused(P):
    run_with_deadline(_different_groups, P, "reference")


@pytest.mark.parametrize("P", [2, 3])
def test_device_joint_and_shard_rows_disagreements(P):
    run_with_deadline(_devices_and_joint, P, "nccl", env={"FA_A2A_CHECK_JOINT": "1"})


@pytest.mark.parametrize("P", [2, 3])
def test_block_refusals_reach_every_rank(P):
    run_with_deadline(_block_refusal, P, "fused")
