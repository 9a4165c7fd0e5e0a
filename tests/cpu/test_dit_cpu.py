"""diffusers' own context parallelism with the fa-a2a backend, on CPU (gloo, 2 and 3 processes).

Tiny random fp32 Flux, Wan and QwenImage transformers. Every rank runs the single-device model
(SDPA), then the same model under `enable_parallelism(ContextParallelConfig(ulysses_degree=P))`
with diffusers' native backend and with fa-a2a's (impl "reference" and "nccl"): all four outputs
must agree to atol 1e-5, on even lengths and with ulysses_anything=True on uneven ones (63 image +
7 text tokens). The backend counts its calls per route and the Ulysses op is wrapped to record
the rows each call saw, so a run that silently did not shard (or took the wrong route) fails.
The same through cache-dit's context parallelism (`cache_dit.enable_cache(model,
parallelism_config=ParallelismConfig(ulysses_size=P, attention_backend=name))`) when cache-dit is
installed; also ring degree P (diffusers' templated ring over the backend's local op) and
enable_ulysses applied twice (refused).

The spawned ranks call fa_a2a.models.diffusers_backend.cpu_testbed(), which lets diffusers' CP run on a
machine without a GPU, with either build of torch (CPU or CUDA), over gloo (it changes no
arithmetic); the single-process tests answer torch.accelerator.device_count() with 1 the same way.
Also: registration refused without a GPU, for a name another library registers, and for another
impl under a registered name; ranks that disagree (another attention backend, or ulysses_anything on
one rank only) end within a bound with a named error on every rank.
"""

import contextlib
import copy
import importlib.util
import os

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a.models import diffusers_backend as backend  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

ATOL = 1e-5
HEADS, HEAD_DIM, TXT_DIM = 6, 16, 24  # 6 heads: P = 2 and 3 divide them (diffusers' native Ulysses needs it)
LAYERS = 2
# (image tokens as (frames, rows, cols), text tokens): even splits over 2 and 3 ranks, and uneven ones.
EVEN = ((1, 6, 6), 6)
UNEVEN = ((1, 7, 9), 7)


# ---- tiny models and their inputs -------------------------------------------------------------------
def _flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TXT_DIM,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))


def _flux_inputs(shape, J, g):
    _, h, w = shape
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(2, h * w, 8, generator=g),
                encoder_hidden_states=torch.randn(2, J, TXT_DIM, generator=g),
                pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.rand(2, generator=g),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.randn(J, 3, generator=g), return_dict=False)


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 1, 1), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                                 in_channels=4, out_channels=4, text_dim=TXT_DIM, freq_dim=32, ffn_dim=64,
                                 num_layers=LAYERS, rope_max_seq_len=64)


def _wan_inputs(shape, J, g):
    f, h, w = shape
    return dict(hidden_states=torch.randn(2, 4, f, h, w, generator=g), timestep=torch.rand(2, generator=g) * 1000,
                encoder_hidden_states=torch.randn(2, J, TXT_DIM, generator=g), return_dict=False)


def _qwen():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=1, in_channels=8, out_channels=8, num_layers=LAYERS,
                                       attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                       joint_attention_dim=TXT_DIM, axes_dims_rope=(4, 6, 6))


def _qwen_inputs(shape, J, g, mask=False):
    f, h, w = shape
    x = dict(hidden_states=torch.randn(2, f * h * w, 8, generator=g),
             encoder_hidden_states=torch.randn(2, J, TXT_DIM, generator=g),
             timestep=torch.rand(2, generator=g), img_shapes=[[(f, h, w)]] * 2, return_dict=False)
    if mask:  # sample 1 has two padded text tokens
        m = torch.ones(2, J, dtype=torch.bool)
        m[1, -2:] = False
        x["encoder_hidden_states_mask"] = m
    return x


# diffusers' CP hooks take the model's output as a tuple: return_dict=False, as pipelines call it.
# name -> (builder, inputs, (Ulysses calls, local calls) per forward)
MODELS = {
    "flux": (_flux, _flux_inputs, (2, 0)),
    "wan": (_wan, _wan_inputs, (LAYERS, LAYERS)),  # cross-attention: parallel_config=None, local
    "qwenimage": (_qwen, _qwen_inputs, (LAYERS, 0)),
}


class _RecordRows:
    """Wraps the backend's call of the Ulysses op and records the q rows of each call."""

    def __init__(self):
        self.fn, self.rows = backend._call_ulysses, []
        backend._call_ulysses = self

    def __call__(self, q, *args, **kwargs):
        self.rows.append(q.shape[1])
        return self.fn(q, *args, **kwargs)


def _cp_model(name, P, anything):
    from diffusers import ContextParallelConfig

    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    single = copy.deepcopy(model)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P, ulysses_anything=anything))
    return single, model


def _expect_rows(shape, J, P, rank):
    """Rows of this rank's shard: diffusers tensor_splits image and text tokens separately."""
    f, h, w = shape
    return len(torch.arange(f * h * w).tensor_split(P)[rank]) + len(torch.arange(J).tensor_split(P)[rank])


def _check_models(P, group, rank):
    backend.cpu_testbed()
    record = _RecordRows()
    names = {impl: backend.register_diffusers_backend(f"fa_a2a_{impl}", impl) for impl in ("reference", "nccl")}
    torch.set_grad_enabled(False)
    for model_name, (_, make_inputs, (n_cp, n_local)) in MODELS.items():
        for anything, (shape, J) in ((False, EVEN), (True, UNEVEN)):
            what = f"rank {rank} P={P} {model_name} ulysses_anything={anything}"
            single, model = _cp_model(model_name, P, anything)
            x = make_inputs(shape, J, torch.Generator().manual_seed(1))
            ref = single(**x)[0]
            model.set_attention_backend("native")
            native = model(**x)[0]
            assert native.shape == ref.shape, what
            err = (native - ref).abs().max().item()
            assert err <= ATOL, f"{what}: diffusers' native Ulysses differs from one device by {err:.3g}"
            every = [_expect_rows(shape, J if model_name != "wan" else 0, P, r) for r in range(P)]
            rows = every[rank]
            for impl, name in names.items():
                model.set_attention_backend(name)
                backend.route_counts(name, reset=True)
                record.rows.clear()
                out = model(**x)[0]
                err = (out - ref).abs().max().item()
                assert out.shape == ref.shape and err <= ATOL, f"{what} impl={impl}: max error {err:.3g}"
                counts = backend.route_counts(name)
                expect = {"ulysses": n_cp, "local": n_local}  # uneven shards too, as shard_rows
                assert counts == {k: n for k, n in expect.items() if n}, f"{what} impl={impl}: routes {counts}"
                assert record.rows == [rows] * n_cp, f"{what}: op saw q rows {record.rows}"
            if model_name == "qwenimage" and not anything:  # a text mask: handed to the templated path
                xm = _qwen_inputs(shape, J, torch.Generator().manual_seed(2), mask=True)
                ref = single(**xm)[0]
                model.set_attention_backend(names["reference"])
                backend.route_counts(names["reference"], reset=True)
                err = (model(**xm)[0] - ref).abs().max().item()
                assert err <= ATOL, f"{what} with a text mask: max error {err:.3g}"
                assert backend.route_counts(names["reference"]) == {"templated": n_cp}
    _check_ring(P, rank)
    _check_applied_twice()


def _check_ring(P, rank):
    """Ring attention (diffusers' templated ring over the backend's local op, which returns the lse)."""
    from diffusers import ContextParallelConfig

    torch.manual_seed(0)
    model = _flux().eval()
    x = _flux_inputs(*EVEN, torch.Generator().manual_seed(1))
    ref = model(**x)[0]
    name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
    model.set_attention_backend(name)
    model.enable_parallelism(config=ContextParallelConfig(ring_degree=P))
    backend.route_counts(name, reset=True)
    err = (model(**x)[0] - ref).abs().max().item()
    assert err <= ATOL, f"rank {rank} P={P} ring: max error {err:.3g}"
    assert backend.route_counts(name) == {"templated": 2}


def _check_applied_twice():
    torch.manual_seed(0)
    model = _flux().eval()
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 0  # no GPU: refused before diffusers divides by it
    try:
        with pytest.raises(RuntimeError, match=r"^enable_ulysses: .*needs a GPU"):
            backend.enable_ulysses(model, impl="reference")
    finally:
        torch.accelerator.device_count = count
    backend.enable_ulysses(model, impl="reference")
    for again in (lambda: backend.enable_ulysses(model, impl="reference"),
                  lambda: backend.enable_ulysses(model, impl="nccl")):
        with pytest.raises(ValueError, match="twice"):
            again()
    with pytest.raises(ValueError, match="_cp_plan"):
        backend.enable_ulysses(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("P", [2, 3])
def test_models_match_single_device_under_diffusers_cp(P):
    """Also: ring degree P through the templated path, and enable_ulysses applied twice refused."""
    run_on_gloo_groups(_check_models, (P,), timeout_s=240)


def _check_cache_dit(P, group, rank):
    import cache_dit
    from cache_dit import ParallelismConfig

    backend.cpu_testbed()
    record = _RecordRows()
    name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
    torch.set_grad_enabled(False)
    for model_name in ("flux", "wan", "qwenimage"):
        torch.manual_seed(0)
        model = MODELS[model_name][0]().eval()
        x = MODELS[model_name][1](*EVEN, torch.Generator().manual_seed(1))
        ref = model(**x)[0]
        cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size=P, attention_backend=name))
        backend.route_counts(name, reset=True)
        record.rows.clear()
        out = model(**x)[0]
        err = (out - ref).abs().max().item()
        assert out.shape == ref.shape and err <= ATOL, f"rank {rank} cache-dit {model_name}: max error {err:.3g}"
        counts = backend.route_counts(name)
        assert counts.get("ulysses", 0) == MODELS[model_name][2][0] and record.rows, \
            f"rank {rank} cache-dit {model_name}: routes {counts}, op rows {record.rows}"


def test_models_match_single_device_under_cache_dit_cp():
    pytest.importorskip("cache_dit")
    run_on_gloo_groups(_check_cache_dit, (2,), timeout_s=240)


# ---- single process ------------------------------------------------------------------------------------------
@pytest.fixture
def one_accelerator(monkeypatch):
    """What cpu_testbed answers diffusers in the spawned ranks, undone after the test."""
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)


def test_registration_refused_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match=r"^register_diffusers_backend: diffusers' context parallelism needs a GPU"):
        backend.register_diffusers_backend("fa_a2a_no_gpu", "reference")
    assert backend.backend_impl("fa_a2a_no_gpu") is None


def test_registration_refuses_other_libraries_backends(one_accelerator):
    """A name diffusers or cache-dit already registers would silently replace that backend."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = dict(_AttentionBackendRegistry._backends)
    for name in ("native", "flash", "_native_cudnn"):
        with pytest.raises(ValueError, match=f"name: '{name}' is already a diffusers attention backend"):
            backend.register_diffusers_backend(name, "reference")
    if importlib.util.find_spec("cache_dit") is not None:
        from cache_dit.attention.backends.register import _AttnBackendRegistry

        cache_before = dict(_AttnBackendRegistry._backends)
        for name in ("sage3", "ffpa", "ffpa_fp8", "_sdpa_cudnn"):
            with pytest.raises(ValueError, match=f"name: '{name}' is already a (cache-dit|diffusers) attention"):
                backend.register_diffusers_backend(name, "reference")
        assert _AttnBackendRegistry._backends == cache_before
    assert _AttentionBackendRegistry._backends == before
    assert backend.register_diffusers_backend("fa_a2a", "fused") == "fa_a2a"  # fa-a2a's own: idempotent
    assert backend.register_diffusers_backend("fa_a2a", "fused") == "fa_a2a"


def test_registration_is_idempotent_and_refuses_conflicts(one_accelerator):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    assert backend.register_diffusers_backend("fa_a2a_reference", "reference") == "fa_a2a_reference"
    assert backend.register_diffusers_backend("fa_a2a_reference", "reference") == "fa_a2a_reference"
    member = AttentionBackendName("fa_a2a_reference")
    assert member in _AttentionBackendRegistry._backends
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    with pytest.raises(ValueError, match="impl"):
        backend.register_diffusers_backend("fa_a2a_reference", "nccl")
    with pytest.raises(ValueError, match="impl"):
        backend.register_diffusers_backend("fa_a2a_x", "magic")
    with pytest.raises(ValueError, match="name"):
        backend.register_diffusers_backend("native", "reference")
    with pytest.raises(ValueError, match="name"):
        backend.register_diffusers_backend("FA_A2A", "reference")


def test_without_parallel_config_the_backend_is_local_attention(one_accelerator):
    torch.manual_seed(0)
    model = _flux().eval()
    x = _flux_inputs(*EVEN, torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(**x)[0]
        name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
        model.set_attention_backend(name)
        backend.route_counts(name, reset=True)
        out = model(**x)[0]
        model.reset_attention_backend()
    assert (out - ref).abs().max().item() <= ATOL
    assert backend.route_counts(name) == {"local": 2}
    q, k, v = torch.randn(3, 1, 5, 2, 8).unbind(0)
    out, lse = backend._local_attention(q, k, v, return_lse=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5
    assert torch.allclose(lse, torch.logsumexp(s, -1).transpose(1, 2), atol=1e-6)
    assert torch.allclose(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), atol=1e-6)
    with pytest.raises(ValueError, match="dropout_p"):
        backend._attention(name, "reference", q, k, v, None, 0.1, False, None, False, False, None)


@contextlib.contextmanager
def _two_gloo_ranks_on_reference(rank: int, init_file: str, *, wait_s: int, group_timeout_s: int):
    """A spawned test rank's 2-rank gloo group (its timeout group_timeout_s; FA_A2A_TIMEOUT_S = wait_s)
    with fa-a2a's reference backend registered on the CPU testbed -> the backend's name; the group
    destroyed at exit."""
    import datetime

    import torch.distributed as dist

    os.environ["FA_A2A_TIMEOUT_S"] = str(wait_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        backend.cpu_testbed()
        yield backend.register_diffusers_backend("fa_a2a_reference", "reference")
    finally:
        dist.destroy_process_group()


def _mixed_backends(rank, init_file):
    """Rank 0 runs diffusers' native backend, rank 1 fa-a2a's, on the same CP model (issue 27's
    model-level row): rank 0 never runs fa-a2a code, so it cannot be told; rank 1 waits for its word
    at most FA_A2A_TIMEOUT_S and raises TimeoutError naming rank 0, and rank 0's collective then
    fails as rank 1 leaves the group: a RuntimeError, or (seen once in CI, 2 cores, torch 2.14.1)
    gloo's std::terminate on its own thread, SIGABRT ("terminate called without an active
    exception"). Bounded on both ranks, no silent output. (The row's twin,
    ulysses_anything on one rank only: _anything_on_one_rank below.)"""
    import time

    with _two_gloo_ranks_on_reference(rank, init_file, wait_s=5, group_timeout_s=30) as name:
        _, model = _cp_model("flux", 2, False)
        model.set_attention_backend("native" if rank == 0 else name)
        x = _flux_inputs(*EVEN, torch.Generator().manual_seed(1))
        t0 = time.monotonic()
        with torch.no_grad(), pytest.raises(Exception) as info:
            model(**x)
        if rank == 1:
            assert isinstance(info.value, TimeoutError) and "rank 0" in str(info.value), repr(info.value)
            assert time.monotonic() - t0 < 20


def test_ranks_on_different_backends_end_bounded():
    import tempfile

    from tests.multiproc import spawn_with_deadline

    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(_mixed_backends, (os.path.join(tmp, "init"),), 2, 90, "native on rank 0, fa_a2a on rank 1",
                            may_abort=(0,))


def _anything_on_one_rank(rank, init_file):
    """ulysses_anything on rank 0 only, both ranks on fa-a2a's backend (issue 27's twin of the row
    above): an even-token call, then an uneven one.

    Before the fix the even call ended with rank 0 killed by SIGABRT: both ranks saw equal shards,
    so fa-a2a's row exchange and the op's agreement passed and attention ran; then diffusers'
    output gather (diffusers/hooks/context_parallel.py, ContextParallelGatherHook.post_forward)
    ran different collectives on the two ranks: rank 0 PartitionAnythingSharder.unshard_anything
    -> _all_gather_anything, whose first collective is an all_gather of one int64 (the shard sizes:
    diffusers/models/_modeling_parallel.py gather_size_by_comm, or cpu_testbed's padded gather's
    all_gather_into_tensor), rank 1 EquipartitionSharder.unshard -> funcol.all_gather_tensor of its
    output shard. gloo's tcp transport, reading the larger message for rank 0's size buffer, failed
    GLOO_ENFORCE "op.preamble.length <= op.nbytes. 576 vs 4. Received data size doesn't match
    expected size" (torch's third_party/gloo/gloo/transport/tcp/pair.cc:456); the gloo::EnforceNotMet
    escaped on gloo's own thread, not into Python (faulthandler showed rank 0's Python thread still
    inside the all_gather): std::terminate -> SIGABRT. Rank 1, depending on timing, returned an
    output whose rank-0 half never arrived (max error 1.56 against the single-device model), then
    failed the uneven call's split, or raised gloo's RuntimeError as rank 0's socket closed.
    Now the backend's row exchange carries the flag: both ranks raise the same ValueError naming
    ulysses_anything at the first attention call, before any collective. The uneven call then
    fails on rank 1 in diffusers' own EquipartitionSharder.shard (an assert: not divisible) before
    any attention, and rank 0 waits for it at most FA_A2A_TIMEOUT_S: TimeoutError naming rank 1."""
    import time

    import torch.distributed as dist

    with _two_gloo_ranks_on_reference(rank, init_file, wait_s=10, group_timeout_s=60) as name:
        _, model = _cp_model("flux", 2, rank == 0)
        model.set_attention_backend(name)
        torch.set_grad_enabled(False)
        dist.barrier()  # the ranks start the even call together (the channel's wait is 10 s)
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            model(**_flux_inputs(*EVEN, torch.Generator().manual_seed(1)))
        assert str(info.value).startswith("ulysses_anything: rank(s) [0] of group ranks [0, 1] run with "
                                          "ContextParallelConfig(ulysses_anything=True), rank(s) [1] without"), \
            f"rank {rank}: {info.value!r}"
        assert time.monotonic() - t0 < 30, f"rank {rank}: the even call took {time.monotonic() - t0:.1f} s"
        dist.barrier()
        t0 = time.monotonic()
        uneven = _flux_inputs(*UNEVEN, torch.Generator().manual_seed(1))
        if rank == 1:
            with pytest.raises(AssertionError, match="divisible by mesh size"):
                model(**uneven)
        else:
            with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not reach call \d+"):
                model(**uneven)
        assert time.monotonic() - t0 < 40, f"rank {rank}: the uneven call took {time.monotonic() - t0:.1f} s"


def test_ulysses_anything_on_one_rank_ends_with_a_named_error():
    """Both ranks end cleanly (no SIGABRT, no output): spawn fails the test on a rank killed by a
    signal or raising, and spawn_with_deadline on one still running after 90 s."""
    import tempfile

    from tests.multiproc import spawn_with_deadline

    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(_anything_on_one_rank, (os.path.join(tmp, "init"),), 2, 90,
                            "ulysses_anything on rank 0 only")
