"""Host-memory destination of the benchmark and the calibration on a GPU: bytes arrive in pinned
host memory, the benchmark's host windows get what HBM windows get, bit for bit."""
import torch

from fa_a2a.tools import bench
from fa_a2a.tools.calibrate import HostBuffer

POISON = float("nan")


def test_host_buffer_receives_remote_store_bursts():
    from cute_kernels.remote_store import expected_words, run_bursts

    k = torch.cuda.get_device_properties(0).multi_processor_count
    b = 32768
    with HostBuffer(k * b // 4) as peer:
        assert peer.tensor.is_cuda and peer.tensor.data_ptr() == peer.host.data_ptr()
        peer.host.fill_(-1)
        run_bursts(peer.tensor, num_ctas=k, bytes_per_cta=b, n_bursts=1, seed=0x0C0FFEE)
        assert peer.check(expected_words("vector", k, b, 0x0C0FFEE))
        assert not peer.check(expected_words("vector", k, b, 0x0C0FFEF))  # the check can fail


def test_bench_host_windows_get_what_hbm_windows_get():
    from cute_kernels.fa4 import fa4_a2a_forward, fa4_forward
    from fa_a2a.op import post_a2a

    cfg = bench.parse_args(["-M", "2048", "--dest", "hbm", "host"], env={})
    ctx = {"device": torch.device("cuda", 0), "group": None, "rank": 0}
    gen = torch.Generator(device="cuda").manual_seed(0)
    got = {}
    for dest in cfg.dests:
        pt = bench._Point(cfg, 2048, dest, ctx, gen)
        w_serial, w_fused = pt.windows("serial.0"), pt.windows("fused.0")
        assert w_fused.shape == (8, 1, 256, 24, 128) and w_fused.is_cuda
        if dest == "host":  # the window memory is the pinned host buffer itself
            assert w_fused.data_ptr() == pt.keep[-1].data_ptr() and pt.keep[-1].is_pinned()
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, 2048, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        for w in (w_serial, w_fused):
            w.fill_(POISON)
        fa4_forward(q, k, v, out=o)
        post_a2a(o, w_serial, 0)
        fa4_a2a_forward(q, k, v, w_fused, 0)
        torch.cuda.synchronize()
        mine = pt.mine(w_fused)
        assert torch.isfinite(mine).all()
        assert torch.equal(mine, pt.mine(w_serial))
        got[dest] = mine.cpu()
    assert torch.equal(got["hbm"], got["host"])
