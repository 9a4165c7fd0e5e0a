"""The peer destination of the X-Stage calibration on one GPU: its VMM path with owner == issuer
(ulysses.transport.PeerMemory, calibrate.VmmPeerBuffer) and `--dest peer`'s refusal.

tests/multigpu/test_calibrate_peer_multigpu.py runs the same checks with the owner on another GPU.
"""
import pytest
import torch

from cute_kernels.remote_store import expected_words, run_bursts

POISON = -1  # the burst pattern's words are positive for these seeds


def _n_sm(dev: int = 0) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def check_peer_buffer(issuer: int, owners: list[int]) -> None:
    """A burst from `issuer` into the VMM mapping of `owners`' memory reaches every owner (each
    reads back the pages it backs, from its own HBM); a wrong expectation fails; the timestamps
    and SM ids stay on the issuer."""
    from fa_a2a.tools.calibrate import VmmPeerBuffer

    torch.cuda.set_device(issuer)
    k = _n_sm(issuer)
    with VmmPeerBuffer(64 << 20 >> 2, issuer, owners) as peer:
        assert peer.tensor.device == torch.device("cuda", issuer)
        b = max(32768, -(-peer.span_bytes // (16 * k)) * 16)
        seed = 0x2468
        want = expected_words("vector", k, b, seed)
        peer.tensor.fill_(POISON)
        times, smid = run_bursts(peer.tensor, num_ctas=k, bytes_per_cta=b, n_bursts=1, seed=seed)
        assert times.device == smid.device == torch.device("cuda", issuer)
        assert peer.check(want)
        assert set(peer.checked_bytes) == set(owners) and sum(peer.checked_bytes.values()) == 4 * want.numel()
        assert not peer.check(expected_words("vector", k, b, seed + 1))  # the check can fail
        # an owner sees what the issuer wrote at an offset inside its page, not just slot 0
        start = want.numel() + 1000
        peer.tensor[start:start + 4096].copy_(torch.arange(4096, dtype=torch.int32, device=peer.tensor.device))
        assert peer.check(torch.arange(4096, dtype=torch.int32), start)


def test_peer_memory_maps_chunks_at_one_range_on_the_same_gpu():
    from ulysses.vmm import PeerMemory, _vmm_allocation_prop

    gran = _vmm_allocation_prop(0, posix_fd=False)[1]
    src = torch.randint(0, 256, (3 * gran,), dtype=torch.uint8, device="cuda")
    with PeerMemory([0], [0], 2 * gran + 1, chunk_bytes=gran) as mem:
        assert (mem.n_chunks, mem.nbytes, mem.address % gran) == (3, 3 * gran, 0)
        t = mem.tensor(0)
        assert t.data_ptr() == mem.address and t.numel() == 3 * gran
        t.copy_(src)  # across the chunk boundaries
        assert torch.equal(t, src)
        del t
        torch.cuda.synchronize()
        free_mapped = torch.cuda.mem_get_info(0)[0]
    assert mem.address is None
    mem.close()  # closing twice is a no-op
    assert torch.cuda.mem_get_info(0)[0] - free_mapped >= 3 * gran  # the chunks were released


def test_peer_memory_refuses_bad_arguments():
    from ulysses.vmm import PeerMemory, _vmm_allocation_prop

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=r"^owners: expected a non-empty list of GPU indices"):
        PeerMemory([n], [0], 1 << 20)
    with pytest.raises(ValueError, match=r"^access: expected"):
        PeerMemory([0], [], 1 << 20)
    with pytest.raises(ValueError, match=r"^nbytes: expected a positive int"):
        PeerMemory([0], [0], 0)
    gran = _vmm_allocation_prop(0, posix_fd=False)[1]
    with pytest.raises(ValueError, match=r"^chunk_bytes: expected a positive multiple of the allocation granularity"):
        PeerMemory([0], [0], 1 << 20, chunk_bytes=gran // 2)


def test_peer_memory_refuses_a_gpu_without_peer_access(monkeypatch):
    import ulysses.vmm as tr

    monkeypatch.setattr(tr, "_can_access_peer", lambda a, b: False)
    with pytest.raises(ValueError, match=r"^access: GPU 0 cannot access the memory of GPU 0 \(cuDeviceCanAccessPeer\)"):
        tr.PeerMemory([0], [0], 1 << 20)


def test_vmm_peer_buffer_on_the_same_gpu_reaches_its_owner():
    check_peer_buffer(0, [0])


def test_vmm_peer_buffer_pages_round_robin_on_the_same_gpu():
    check_peer_buffer(0, [0, 0, 0])  # three owners (all GPU 0): the --spread page layout


def test_calibrate_dest_peer_refuses_one_gpu(capsys):
    if torch.cuda.device_count() > 1:
        pytest.skip("more than one GPU: tests/multigpu/test_calibrate_peer_multigpu.py runs --dest peer")
    from fa_a2a.tools import calibrate

    with pytest.raises(SystemExit) as e:
        calibrate.main(["--dest", "peer", "--quick", "--no-fa"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dest peer: needs >= 2 GPUs with peer access, found 1 (one GPU)" in err
