"""Compile-only checks (sm_90a, fake tensors, no GPU) of the A2A and barrier kernels.

The PTX is read back to check what the design relies on: 16-byte vector loads and stores in the
A2A copies, and system-scope release/acquire plus the %globaltimer bound in the barrier. The
compile caches are keyed by their arguments (world size included).
"""
import pytest
import torch

from cute_kernels.a2a import compile_post_a2a, compile_pre_a2a
from cute_kernels.a2a_device import PreA2A
from cute_kernels.signal import compile_barrier
from cute_kernels.signal_device import BarrierKernel


def _ptx(compiled) -> str:
    ptx = compiled.__ptx__
    assert ptx and ".target sm_90a" in ptx
    return ptx


@pytest.fixture
def keep_ptx(tmp_path):
    return f"--keep-ptx --dump-dir={tmp_path}"


@pytest.mark.parametrize("world_size,num_local", [(2, 1), (8, 8)])
def test_barrier_uses_system_scope_release_acquire(world_size, num_local, keep_ptx):
    ptx = _ptx(compile_barrier(world_size, num_local, extra_options=keep_ptx))
    # the last one: a timeout written to the host-mapped error mirror, which the host reads unsynced
    for needle in ("fence.acq_rel.sys", "st.release.sys", "ld.acquire.sys", "%globaltimer", "bar.sync",
                   "st.relaxed.sys.global"):
        assert needle in ptx, needle


def test_compile_cache_key_is_the_arguments():
    assert compile_barrier(4, 1) is compile_barrier(4, 1)
    assert compile_barrier(4, 4) is not compile_barrier(4, 1)
    assert compile_post_a2a(torch.bfloat16, 64, 2) is compile_post_a2a(torch.bfloat16, 64, 2)
    assert compile_post_a2a(torch.bfloat16, 64, 4) is not compile_post_a2a(torch.bfloat16, 64, 2)
    assert compile_pre_a2a(torch.float16, 64, 2, False) is compile_pre_a2a(torch.float16, 64, 2, False)
    assert compile_pre_a2a(torch.float16, 64, 2, True) is not compile_pre_a2a(torch.float16, 64, 2, False)


def test_barrier_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        BarrierKernel(33)
    with pytest.raises(ValueError, match="num_local"):
        BarrierKernel(4, 5)


@pytest.mark.parametrize("dtype,head_dim,world_size,broadcast",
                         [(torch.bfloat16, 128, 8, False), (torch.float16, 64, 4, True)])
def test_post_a2a_compiles_to_16_byte_copies(dtype, head_dim, world_size, broadcast, keep_ptx):
    ptx = _ptx(compile_post_a2a(dtype, head_dim, world_size, broadcast, extra_options=keep_ptx))
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.parametrize("dtype,head_dim,world_size,joint",
                         [(torch.bfloat16, 128, 8, False), (torch.float16, 64, 2, True)])
def test_pre_a2a_compiles_to_16_byte_copies(dtype, head_dim, world_size, joint, keep_ptx):
    ptx = _ptx(compile_pre_a2a(dtype, head_dim, world_size, joint, extra_options=keep_ptx))
    # q, k, v (and joint q, k, v): one vector load and store per region
    regions = 6 if joint else 3
    assert ptx.count("st.global.v4") >= regions and ptx.count("ld.global.v4") >= regions


def test_a2a_rejects_head_dim_not_16_bytes():
    import cutlass

    with pytest.raises(ValueError, match="head_dim"):
        PreA2A(cutlass.BFloat16, 60, 2, False)
