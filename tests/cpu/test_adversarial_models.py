"""Adversarial pass over the diffusers side (fa_a2a.models: the attention backend, the fused processors):
inputs for which the fa-a2a backend or a fused processor gave a silent wrong answer or an unclear error
(2026-12-05), each now a right answer or a ValueError naming the setting on every rank. Numeric checks are against a plain fp64 torch oracle on the unsplit sequence, or
against the single-process model (SDPA). CPU: gloo ranks, the backend's impl "reference", tiny random
fp32 diffusers models."""

import datetime
import os
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a.models import diffusers_backend as backend  # noqa: E402
from tests.helpers import fp64_attention  # noqa: E402
from tests.multiproc import spawn_with_deadline  # noqa: E402

ATOL = 1e-5


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=0,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8,
                                  pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))


def _parallel_config(**cp):
    """A diffusers ParallelConfig set up on the current group (through a tiny model's enable_parallelism)."""
    from diffusers import ContextParallelConfig

    model = _tiny_flux()
    model.enable_parallelism(config=ContextParallelConfig(**cp))
    return model._parallel_config


def _spawn(worker, nprocs, what, deadline_s=180):
    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_deadline(worker, (nprocs, os.path.join(tmp, "init")), nprocs, deadline_s, what)


def _leave():
    """Every rank's collectives done before the group goes (a rank that leaves while a peer's gloo pair still
    sends makes that peer abort, SIGABRT, seen in CI on the 3-rank QwenImage case)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _ranks(rank, world, init_file):
    """Join the gloo group, set up the CPU testbed, register the reference backend -> its name."""
    import torch.distributed as dist

    os.environ["FA_A2A_TIMEOUT_S"] = "20"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    backend.cpu_testbed()
    return backend.register_diffusers_backend("fa_a2a_reference", "reference")


def _masked_call(rank, world, cfg, S, split):
    """One dispatch of q/k/v [2, S, 6, 8] with a bool key mask [B, S] through the fa-a2a backend, each
    rank holding its rows (split(t, dim) -> the rank's shard) -> (out, the oracle's rows of this rank)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, S, 6, 8, generator=g) for _ in range(3))
    keep = torch.rand(2, S, generator=g) > 0.3
    keep[:, 0] = True
    want = split(fp64_attention(q, k, v, mask=keep[:, None, None, :]), 1)
    out = dispatch_attention_fn(split(q, 1), split(k, 1), split(v, 1), attn_mask=split(keep, 1),
                                backend="fa_a2a_reference", parallel_config=cfg)
    return out, want


# ---- ring degree > 1 with an attention mask -------------------------------------------------------------
def _ring_mask_worker(rank, world, init_file):

    try:
        _ranks(rank, world, init_file)
        cfg = _parallel_config(ring_degree=world)
        try:
            out, want = _masked_call(rank, world, cfg, 8, lambda t, d: t.chunk(world, d)[rank])
        except ValueError as e:  # refused by name: fine
            assert "attn_mask" in str(e) or "mask" in str(e), e
            return
        err = (out.double() - want).abs().max().item()
        assert err <= ATOL, f"rank {rank}: ring attention with a key mask, max error {err:.3g} against the oracle"
    finally:
        _leave()


def test_ring_attention_with_key_mask_is_right_or_refused():
    """Ring degree 2 + a key mask: diffusers' ring applies the local mask to every rank's K/V chunk."""
    _spawn(_ring_mask_worker, 2, "ring + mask")


def _qwen_ring_mask_worker(rank, world, init_file):
    from diffusers import ContextParallelConfig

    from tests.cpu.test_dit_cpu import EVEN, _qwen, _qwen_inputs

    try:
        name = _ranks(rank, world, init_file)
        torch.set_grad_enabled(False)
        torch.manual_seed(0)
        model = _qwen().eval()
        x = _qwen_inputs(*EVEN, torch.Generator().manual_seed(2), mask=True)  # two padded text tokens
        ref = model(**x)[0]
        model.set_attention_backend(name)
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
        try:
            out = model(**x)[0]
        except ValueError as e:
            assert "mask" in str(e), e
            return
        err = (out - ref).abs().max().item()
        assert err <= ATOL, f"rank {rank}: QwenImage text mask under ring degree 2, max error {err:.3g}"
    finally:
        _leave()


def test_qwenimage_text_mask_under_ring_is_right_or_refused():
    """QwenImage with encoder_hidden_states_mask, ring degree 2, fa-a2a backend: equals one process."""
    _spawn(_qwen_ring_mask_worker, 2, "QwenImage ring + text mask")


# ---- ulysses_anything with an attention mask over 3 ranks ----------------------------------------------
def _anything_mask_worker(rank, world, init_file):

    try:
        _ranks(rank, world, init_file)
        cfg = _parallel_config(ulysses_degree=world, ulysses_anything=True)
        # 7 keys over 3 ranks: shards of 3, 2, 2 rows (a short shard before the last one)
        out, want = _masked_call(rank, world, cfg, 7, lambda t, d: t.tensor_split(world, d)[rank])
        err = (out.double() - want).abs().max().item()
        assert err <= ATOL, f"rank {rank}: ulysses_anything with a key mask, max error {err:.3g} against the oracle"
    finally:
        _leave()


def test_ulysses_anything_key_mask_over_three_ranks():
    """Uneven shards 3+2+2 with a key mask: diffusers' mask gather pads and trims in the wrong place."""
    _spawn(_anything_mask_worker, 3, "ulysses_anything + mask, 3 ranks")


def _qwen_anything_mask_worker(rank, world, init_file):
    from diffusers import ContextParallelConfig

    from tests.cpu.test_dit_cpu import UNEVEN, _qwen, _qwen_inputs

    try:
        name = _ranks(rank, world, init_file)
        torch.set_grad_enabled(False)
        torch.manual_seed(0)
        model = _qwen().eval()
        x = _qwen_inputs(*UNEVEN, torch.Generator().manual_seed(2), mask=True)  # 7 text + 63 image tokens
        ref = model(**x)[0]
        model.set_attention_backend(name)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, ulysses_anything=True))
        out = model(**x)[0]
        err = (out - ref).abs().max().item()
        assert err <= ATOL, f"rank {rank}: QwenImage text mask, ulysses_anything on 3 ranks, max error {err:.3g}"
    finally:
        _leave()


def test_qwenimage_text_mask_ulysses_anything_three_ranks():
    """QwenImage + encoder_hidden_states_mask, 3 ranks, ulysses_anything (24+23+23 rows): equals one process."""
    _spawn(_qwen_anything_mask_worker, 3, "QwenImage ulysses_anything + text mask, 3 ranks", deadline_s=240)


# ---- heads that the ranks do not divide, on the templated route ------------------------------------------
def _odd_heads_worker(rank, world, init_file):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    try:
        _ranks(rank, world, init_file)
        cfg = _parallel_config(ulysses_degree=world)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, 3, 8, generator=g) for _ in range(3))  # 3 heads on 2 ranks
        keep = torch.ones(1, 8, dtype=torch.bool)
        keep[:, -1] = False
        shard = lambda t: t.chunk(world, 1)[rank]  # noqa: E731
        try:
            out = dispatch_attention_fn(shard(q), shard(k), shard(v), attn_mask=shard(keep),
                                        backend="fa_a2a_reference", parallel_config=cfg)
        except ValueError as e:  # refused by name: fine
            assert "head" in str(e), e
            return
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"rank {rank}: 3 heads on 2 ranks with a mask raised {type(e).__name__}: {e} "
                        "(expected a right answer or a ValueError naming the heads)")
        err = (out.double() - shard(fp64_attention(q, k, v, mask=keep[:, None, None, :]))).abs().max().item()
        assert err <= ATOL, f"rank {rank}: max error {err:.3g}"
    finally:
        _leave()


def test_heads_not_divisible_on_templated_route_named_error():
    """3 heads on 2 ranks: the Ulysses route pads heads, the mask's templated route dies in a reshape."""
    _spawn(_odd_heads_worker, 2, "3 heads, 2 ranks, mask")


# ---- a query-by-key mask of the rank's rows, on the templated route ------------------------------------------
def _query_mask_worker(rank, world, init_file):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    try:
        _ranks(rank, world, init_file)
        for anything in (False, True):
            cfg = _parallel_config(ulysses_degree=world, ulysses_anything=anything)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(2, 12, 6, 8, generator=g) for _ in range(3))
            keep = torch.rand(2, 1, 12, 12, generator=g) > 0.3
            keep[..., 0] = True
            shard = lambda t, d=1: t.chunk(world, d)[rank]  # noqa: E731
            with pytest.raises(ValueError, match=r"^attn_mask: expected a key mask .* got a query-by-key mask "
                                                 r"\(2, 1, 6, 12\) whose rows are this rank's queries"):
                dispatch_attention_fn(shard(q), shard(k), shard(v), attn_mask=shard(keep, 2),
                                      backend="fa_a2a_reference", parallel_config=cfg)
    finally:
        _leave()


def test_a_query_by_key_mask_of_the_ranks_rows_is_refused_by_name():
    """A mask [B, 1, S_q_loc, S_k] (this rank's query rows, every key) ended in a RuntimeError from a size
    mismatch inside diffusers' templated Ulysses attention."""
    _spawn(_query_mask_worker, 2, "query-by-key mask")


# ---- fused processors: projection layers with forward hooks ------------------------------------------------
def _hooked_reason(monkeypatch, hook):
    """_why_not_qwen on a QwenImage attention (bf16, per-head RMSNorm, no grad, past the device checks as
    tests/cpu/test_dit_blocks_cpu.py's test_fallback_reasons does) whose to_q carries `hook`."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.attention_dispatch import AttentionBackendName

    from fa_a2a.models import dit_blocks

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    fused = AttentionBackendName(backend.register_diffusers_backend("fa_a2a", "fused"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    model = QwenImageTransformer2DModel(patch_size=1, in_channels=8, out_channels=8, num_layers=1,
                                        attention_head_dim=64, num_attention_heads=4, joint_attention_dim=24,
                                        axes_dims_rope=(16, 24, 24)).to(torch.bfloat16).requires_grad_(False)
    attn = model.transformer_blocks[0].attn
    proc = dit_blocks.FusedQwenImageAttnProcessor()
    proc._attention_backend = fused
    proc._parallel_config = type("C", (), {"context_parallel_config": type("CP", (), {"ulysses_degree": 2,
                                                                                      "ring_degree": 1})()})()
    x = torch.randn(1, 8, attn.query_dim, dtype=torch.bfloat16)
    e = torch.randn(1, 3, attn.query_dim, dtype=torch.bfloat16)
    freqs = (torch.ones(8, 32, dtype=torch.complex64), torch.ones(3, 32, dtype=torch.complex64))
    assert dit_blocks._why_not_qwen(proc, attn, x, e, None, None, freqs) is None  # fused without the hook
    hook(attn.to_q)
    return dit_blocks._why_not_qwen(proc, attn, x, e, None, None, freqs)


def test_fused_processor_falls_back_for_linear_with_forward_hook(monkeypatch):
    """A hook-based adapter on to_q (register_forward_hook) changes its output; the fused block reads the weight."""
    why = _hooked_reason(monkeypatch, lambda lin: lin.register_forward_hook(lambda m, i, o: o + 1))
    assert why is not None, "a to_q with a forward hook would run fused: the hook's change is silently dropped"


def test_fused_processor_falls_back_for_linear_with_instance_forward(monkeypatch):
    """An instance-level forward override (diffusers' HookRegistry, accelerate's add_hook_to_module) on to_q."""
    from diffusers.hooks import HookRegistry, ModelHook

    class AddOne(ModelHook):
        def post_forward(self, module, output):
            return output + 1

    why = _hooked_reason(monkeypatch, lambda lin: HookRegistry.check_if_exists_or_initialize(lin).register_hook(
        AddOne(), "add_one"))
    assert why is not None, "a to_q whose forward a diffusers hook wraps would run fused: the hook is skipped"


# ---- diffusers' meshes hold the process groups in a reference cycle ---------------------------------------
_group_watch = []  # weakrefs whose callbacks record when each group is freed


def _groups_freed_before_exit(rank, P, record):
    """enable_ulysses, then destroy_process_group (by run_gloo_case) and the end of the process: each group
    is freed before the interpreter's finalization (diffusers' DeviceMeshes hold them in a cycle; freed in
    the finalization, a gloo group aborted its rank now and then: SIGABRT in CI on 2026-12-05)."""
    import sys
    import weakref

    from torch.distributed.distributed_c10d import _world

    from fa_a2a.models.diffusers_backend import cpu_testbed, enable_ulysses

    cpu_testbed()
    enable_ulysses(_tiny_flux(), impl="reference")

    def freed(_):
        with open(f"{record}.{rank}", "a") as fh:
            fh.write(f"finalizing={sys.is_finalizing()}\n")

    _group_watch.extend(weakref.ref(g, freed) for g in list(_world.pg_map))
    with open(f"{record}.{rank}.n", "w") as fh:
        fh.write(str(len(_group_watch)))


def test_diffusers_meshes_free_their_groups_before_interpreter_exit(tmp_path):
    from tests.multiproc import run_gloo_case

    run_gloo_case(_groups_freed_before_exit, 2, str(tmp_path / "freed"), deadline_s=90)
    for rank in range(2):
        n = int((tmp_path / f"freed.{rank}.n").read_text())
        path = tmp_path / f"freed.{rank}"
        lines = path.read_text().split() if path.exists() else []
        assert n >= 2 and lines == ["finalizing=False"] * n, (
            f"rank {rank}: of {n} process groups, freed before finalization: {lines.count('finalizing=False')}, "
            f"in it: {lines.count('finalizing=True')} (a gloo group destroyed there can abort the rank)")
