"""What a hostile caller found after the cross-rank agreement (issue 42): each item ends in a
ValueError naming the argument (the same on every rank where ranks are involved), or runs correctly;
no hang, no file left in /dev/shm. One test per item; multi-rank cases run gloo ranks under a hard
deadline (tests.multiproc.spawn_with_deadline)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fa_a2a import block
from fa_a2a.op import ulysses_attention, ulysses_attention_emulated
from tests.multiproc import run_gloo_case

BF16 = torch.bfloat16


def _linears(c_in=64, c_out=256, n=3):
    return [nn.Linear(c_in, c_out, dtype=BF16) for _ in range(n)]


# ---- from_linear with q/k norms the epilogue cannot compute -------------------------------------------------
def test_norms_other_than_rmsnorm_are_refused_by_from_linear_and_routed_by_the_processors():
    pytest.importorskip("diffusers")
    from fa_a2a.models.base import _norm_ok

    q, k, v = _linears()
    for name, norms in (("norm_q", (nn.LayerNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-6))),
                        ("norm_k", (nn.RMSNorm(64, eps=1e-6), nn.LayerNorm(64, eps=1e-6))),
                        ("norm_q", (nn.GroupNorm(1, 64, eps=1e-6), nn.RMSNorm(64, eps=1e-6)))):
        with pytest.raises(ValueError, match=f"^{name}: expected an RMSNorm .* got (LayerNorm|GroupNorm)"):
            block.UlyssesQKVAttention.from_linear(q, k, v, head_dim=64, world_size=2, norm_q=norms[0], norm_k=norms[1])
    with pytest.raises(ValueError, match="^norm_q: expected an RMSNorm .* got LayerNorm"):  # the torch chain too
        block.UlyssesQKVAttention.from_linear(q, k, v, head_dim=64, world_size=2, across_heads=True,
                                              norm_q=nn.LayerNorm(256, eps=1e-6), norm_k=nn.RMSNorm(256, eps=1e-6))
    from diffusers.models.normalization import RMSNorm
    with pytest.raises(ValueError, match="^norm_added_k: expected an RMSNorm"):  # diffusers' RMSNorm with a bias
        block.UlyssesQKVAttention.from_linear(q, k, v, head_dim=64, world_size=2, add_q=q, add_k=k, add_v=v,
                                              norm_added_q=RMSNorm(64, eps=1e-6), norm_added_k=RMSNorm(64, eps=1e-6,
                                                                                                    bias=True))
    ok = block.UlyssesQKVAttention.from_linear(q, k, v, head_dim=64, world_size=2, norm_q=RMSNorm(64, eps=1e-6),
                                               norm_k=nn.RMSNorm(64, eps=1e-6))
    assert ok.proj.norm_weight is not None
    # the processors run a model with LayerNorm q/k norms through diffusers' own processor instead
    assert not _norm_ok(nn.LayerNorm(64, eps=1e-6), 64) and _norm_ok(RMSNorm(64, eps=1e-6), 64)


# ---- inputs whose elements share memory -------------------------------------------------------------------
def test_inputs_whose_memory_overlaps_are_refused_by_name():
    from fa_a2a.engine.problem import overlaps

    base = torch.randn(4096)
    dense = torch.randn(1, 8, 4, 8)
    assert not any(overlaps(t) for t in (dense, dense.transpose(1, 2), dense[:, ::2], dense.permute(3, 1, 0, 2)))
    q = base.as_strided((1, 8, 4, 8), (0, 8, 8, 1))  # rows and heads overlap (torch: "too hard" to tell)
    assert overlaps(q) and overlaps(dense[:, :1].expand(1, 8, 4, 8))
    k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8)
    with torch.no_grad():
        ulysses_attention(base[:256].view(1, 8, 4, 8), k, v, impl="reference")  # the signature cached, dense
        with pytest.raises(ValueError, match=r"^q: expected a tensor whose elements do not share memory, got shape "
                                             r"\(1, 8, 4, 8\) with strides \(0, 8, 8, 1\)"):
            ulysses_attention(q, k, v, impl="reference")  # same shape and stride(-1): a new signature
        with pytest.raises(ValueError, match="^v: expected a tensor whose elements do not share memory"):
            ulysses_attention(k, k, k[:, :1].expand(1, 8, 4, 8), impl="reference")
        with pytest.raises(ValueError, match=r"^joint\[1\] \(k\): expected a tensor whose elements do not share"):
            j = torch.randn(1, 3, 4, 8)
            ulysses_attention(k, k, v, impl="reference", joint=(j, j[:, :1].expand(1, 3, 4, 8), j))
        with pytest.raises(ValueError, match="^q: expected a tensor whose elements do not share memory"):
            ulysses_attention_emulated([q[:, :4], q[:, 4:]], [k[:, :4], k[:, 4:]], [v[:, :4], v[:, 4:]],
                                       impl="reference")
    # the block: its hidden states, segments and joint rows (checked every call: strides are not in its key)
    mod = block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=1)
    x = torch.randn(1, 8, 64, dtype=BF16)
    bad_x = x.as_strided((1, 8, 64), (0, 32, 1))
    with pytest.raises(ValueError, match="^x: expected a tensor whose elements do not share memory"):
        block.ulysses_qkv_attention(bad_x, mod.proj)
    with pytest.raises(ValueError, match=r"^x\[1\]\.x: expected a tensor whose elements do not share memory"):
        block.ulysses_qkv_attention([block.Segment(x, mod.proj), block.Segment(bad_x, mod.proj)])
    with pytest.raises(ValueError, match="^joint: expected a tensor whose elements do not share memory"):
        block.ulysses_qkv_attention(x, mod.proj, joint=bad_x)
    with pytest.raises(ValueError, match=r"^xs\[1\]: expected a tensor whose elements do not share memory"):
        block.ulysses_qkv_attention_emulated([x, bad_x], mod.proj)
    with pytest.raises(ValueError, match="^x: expected a CUDA tensor"):  # a dense x goes on to the next check
        block.ulysses_qkv_attention(x, mod.proj)


def _block_joint_data(rank, P):
    """FA_A2A_CHECK_JOINT=1 checks the block's joint rows too. The block takes CUDA tensors only; its
    checks and agreement run here on CPU ones with x's device check let through (nothing past the
    agreement runs: the refusal comes first)."""
    block._check_x = lambda x, name, proj: None
    os.environ["FA_A2A_CHECK_JOINT"] = "1"
    mod = block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=P, group=dist.group.WORLD)
    x = torch.randn(1, 4, 64, dtype=BF16)
    joint = torch.randn(1, 3, 64, dtype=BF16, generator=torch.Generator().manual_seed(0)) + rank
    with torch.no_grad(), pytest.raises(ValueError) as info:
        block.ulysses_qkv_attention(x, mod.proj, joint=joint, group=dist.group.WORLD)
    assert str(info.value).startswith("joint (data checksum, FA_A2A_CHECK_JOINT=1): expected the same value on every "
                                      "rank, got rank 0: "), f"rank {rank}: {info.value!r}"


def test_block_joint_rows_are_checked_with_check_joint():
    run_gloo_case(_block_joint_data, 2, deadline_s=60)


# ---- different token counts fed to a diffusers model -------------------------------------------------------
def _token_counts(rank, P):
    from fa_a2a.models import diffusers_backend as backend
    from tests.cpu.test_dit_cpu import _cp_model, _flux, _flux_inputs

    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    backend.cpu_testbed()
    name = backend.register_diffusers_backend("fa_a2a_reference", "reference")
    torch.set_grad_enabled(False)
    image = {0: (1, 4, 4), 1: (1, 4, 5)}[rank]  # 16 vs 20 image tokens (8 vs 10 rows each), 6 text (3 each)
    for anything in (False, True):  # the backend's row exchange (plain enable_parallelism)
        _, model = _cp_model("flux", P, anything)
        model.set_attention_backend(name)
        split = "the longer shards first (tensor_split)" if anything else "equal shards"
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            model(**_flux_inputs(image, 6, torch.Generator().manual_seed(1)))
        assert str(info.value) == ("hidden_states: expected every rank to feed the model the same tokens (diffusers' "
                                   f"split of one input gives {split}), got query shards of [11, 13] rows on group "
                                   "ranks [0, 1]"), f"rank {rank}: {info.value!r}"
        assert time.monotonic() - t0 < 10
        dist.barrier()
    # 20 vs 16 with ulysses_anything: shards in tensor_split's order ([13, 11]), so only the model's
    # inputs tell; enable_ulysses compares them before diffusers' split
    torch.manual_seed(0)
    model = _flux().eval()
    backend.enable_ulysses(model, impl="reference", ulysses_anything=True)
    image = {0: (1, 4, 5), 1: (1, 4, 4)}[rank]
    with pytest.raises(ValueError) as info:
        model(**_flux_inputs(image, 6, torch.Generator().manual_seed(1)))
    assert str(info.value) == ("hidden_states: expected the same shape on every rank (diffusers' context parallelism "
                               "splits one input over the ranks), got rank 0: (2, 20, 8), rank 1: (2, 16, 8)"), \
        f"rank {rank}: {info.value!r}"
    dist.barrier()


def test_ranks_fed_different_token_counts_are_refused_on_every_rank():
    pytest.importorskip("diffusers")
    run_gloo_case(_token_counts)


def _anything_on_one_rank(rank, P):
    from fa_a2a.models import diffusers_backend as backend
    from tests.cpu.test_dit_cpu import UNEVEN, _cp_model, _flux, _flux_inputs

    os.environ["FA_A2A_TIMEOUT_S"] = "3"
    backend.cpu_testbed()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = _flux().eval()
    backend.enable_ulysses(model, impl="reference", ulysses_anything=rank == 0)
    dist.barrier()
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        model(**_flux_inputs(*UNEVEN, torch.Generator().manual_seed(1)))
    assert str(info.value).startswith("ulysses_anything: rank(s) [0] of group ranks [0, 1] run with "
                                      "ContextParallelConfig(ulysses_anything=True), rank(s) [1] without"), \
        f"rank {rank}: {info.value!r}"
    assert time.monotonic() - t0 < 3, f"rank {rank}: took {time.monotonic() - t0:.1f} s"
    dist.barrier()
    # without enable_ulysses nothing of fa-a2a runs before diffusers' split: the rank without the flag
    # raises diffusers' AssertionError there; the rank with it names ulysses_anything after FA_A2A_TIMEOUT_S
    _, model = _cp_model("flux", P, rank == 0)
    model.set_attention_backend(backend.register_diffusers_backend("fa_a2a_reference", "reference"))
    dist.barrier()
    with pytest.raises(AssertionError if rank else TimeoutError) as info:
        model(**_flux_inputs(*UNEVEN, torch.Generator().manual_seed(1)))
    assert rank or "this rank runs with ContextParallelConfig(ulysses_anything=True)" in str(info.value)


def test_ulysses_anything_on_one_rank_is_named_on_both_ranks():
    pytest.importorskip("diffusers")
    run_gloo_case(_anything_on_one_rank)


def _uneven_tokens(rank, P):
    from fa_a2a.models import diffusers_backend as backend
    from tests.cpu.test_dit_cpu import EVEN, UNEVEN, _flux, _flux_inputs

    backend.cpu_testbed()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = _flux().eval()
    backend.enable_ulysses(model, impl="reference")
    with pytest.raises(ValueError) as info:  # 63 image tokens, 7 text tokens over 2 ranks
        model(**_flux_inputs(*UNEVEN, torch.Generator().manual_seed(1)))
    assert str(info.value) == ("hidden_states: expected a size along dim 1 that the 2 context-parallel ranks divide "
                               "(diffusers splits it evenly), got 63 (shape (2, 63, 8)): pad it, or "
                               "enable_ulysses(..., ulysses_anything=True)"), f"rank {rank}: {info.value!r}"
    image, text = EVEN
    with pytest.raises(ValueError, match="^encoder_hidden_states: expected a size along dim 1 that the 2 "):
        model(**_flux_inputs(image, text + 1, torch.Generator().manual_seed(1)))  # the text rows split too
    assert model(**_flux_inputs(*EVEN, torch.Generator().manual_seed(1)))[0].isfinite().all()  # even: runs
    dist.barrier()
    anything = _flux().eval()  # with ulysses_anything: any count, but at least one row per rank
    backend.enable_ulysses(anything, impl="reference", ulysses_anything=True)
    with pytest.raises(ValueError) as info:
        anything(**_flux_inputs(image, 1, torch.Generator().manual_seed(1)))
    assert str(info.value) == ("encoder_hidden_states: expected at least one row per context-parallel rank along "
                               "dim 1 (2; diffusers splits it under ulysses_anything too), got 1 (shape (2, 1, 24))"), \
        f"rank {rank}: {info.value!r}"
    assert anything(**_flux_inputs(*UNEVEN, torch.Generator().manual_seed(1)))[0].isfinite().all()
    dist.barrier()


def test_tokens_the_ranks_do_not_divide_are_named_before_diffusers_split():
    """enable_ulysses without ulysses_anything: an input the ranks do not divide gets a ValueError naming it on
    every rank (diffusers' split raised an AssertionError "not divisible by mesh size"); with it, an input of
    fewer rows than ranks ("Cannot shard tensor of size ...")."""
    pytest.importorskip("diffusers")
    run_gloo_case(_uneven_tokens)


# ---- FA_A2A_* variables ---------------------------------------------------------------------------------------
BAD_SETTINGS = [("FA_A2A_TIMEOUT_S", v) for v in ("0", "-1", "abc", "nan", "inf", "1e400", "")] + [
    ("FA_A2A_SETUP_TIMEOUT_S", "0"), ("FA_A2A_SETUP_TIMEOUT_S", "-5"), ("FA_A2A_TRANSPORT", "nvlink"),
    ("FA_A2A_OUT_SLOTS", "abc"), ("FA_A2A_OUT_SLOTS", "17"), ("FA_A2A_CHECK_JOINT", "yes"),
    ("FA_A2A_CHECK_JOINT", "2"), ("FA_A2A_CACHE", "on")]


@pytest.mark.parametrize("var, value", BAD_SETTINGS)
def test_every_setting_is_checked_by_name_at_the_call(monkeypatch, var, value):
    from fa_a2a.engine import problem

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(problem, "_resolved", {})  # a new signature (settings are read with each one),
    S = 5 + BAD_SETTINGS.index((var, value))  # whatever earlier tests of this process called
    q = torch.randn(1, S, 2, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{var}: expected"):
        ulysses_attention(q, q, q, impl="reference")


def _one_rank_bad_timeout(rank, P, value):
    import ulysses.channel as channel_mod

    if rank == 1:
        os.environ["FA_A2A_TIMEOUT_S"] = value
    q = torch.randn(1, 4, 2, 8)
    t0 = time.monotonic()
    with torch.no_grad(), pytest.raises(ValueError) as info:
        ulysses_attention(q, q, q, impl="reference")
    want = f"FA_A2A_TIMEOUT_S: expected a number of seconds in [0.001, 1e+06], got {value!r}"
    assert str(info.value) == (want if rank == 1 else f"rank 1 of {P}: {want}"), f"rank {rank}: {info.value!r}"
    assert time.monotonic() - t0 < 10
    ch = channel_mod.get_channel(dist.group.WORLD)
    path = ch.store.get(f"{ch.prefix}/path").decode()
    assert path and not os.path.exists(path), f"rank {rank}: {path} left behind"
    dist.barrier()


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_a_bad_timeout_on_one_rank_reaches_every_rank(value):
    run_gloo_case(_one_rank_bad_timeout, 2, value, deadline_s=60)


def _channel_left_midway(rank, P):
    """Rank 1 announces its host, then never opens the shared file: rank 0's set-up times out, and
    the file it created is gone."""
    from ulysses.channel import Channel, _host_id

    group = dist.group.WORLD
    prefix = f"fa_a2a/channel/{','.join(map(str, range(P)))}/0"  # (the ranks' first channel: generation 0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        with pytest.raises(TimeoutError, match="did not meet"):
            Channel(group, timeout_s=2)
        path = store.get(f"{prefix}/path").decode()
        assert path and not os.path.exists(path), f"{path} left behind"
    else:
        store.set(f"{prefix}/host/1", _host_id())
    dist.barrier()


def test_channel_files_are_removed_when_set_up_fails():
    run_gloo_case(_channel_left_midway, 2, deadline_s=60)


# ---- from_linear arguments: world_size, out_features ----------------------------------------------------------
def test_from_linear_world_size_is_bounded():
    from cute_kernels.signal import MAX_WORLD_SIZE

    t0 = time.monotonic()
    for P in (MAX_WORLD_SIZE + 1, 2**40):
        with pytest.raises(ValueError, match=f"^world_size: expected at most {MAX_WORLD_SIZE} ranks"):
            block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=P)
        with pytest.raises(ValueError, match=f"^world_size: expected at most {MAX_WORLD_SIZE} ranks"):
            block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=P, across_heads=True)
    assert time.monotonic() - t0 < 5
    assert block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=MAX_WORLD_SIZE).world_size == 32


def test_from_linear_with_an_empty_linear_names_it():
    q, k, v = _linears()
    for layers, name in (((q, nn.Linear(64, 0, dtype=BF16), v), "to_k"), ((nn.Linear(64, 0, dtype=BF16), k, v), "to_q"),
                         (_linears(c_in=0), "to_q")):
        with pytest.raises(ValueError, match=f"^{name}: expected in_features >= 1 and out_features >= head_dim = 64"):
            block.UlyssesQKVAttention.from_linear(*layers, head_dim=64, world_size=2)
    with pytest.raises(ValueError, match="^add_v: expected in_features >= 1"):
        block.UlyssesQKVAttention.from_linear(q, k, v, head_dim=64, world_size=2, add_q=q, add_k=k,
                                              add_v=nn.Linear(64, 0, dtype=BF16))


# ---- numbers beyond float range, rates below any link ---------------------------------------------------------
def test_numbers_out_of_float_range_are_refused_by_name():
    from cute_kernels.pacer import make_pacer
    from fa_a2a.engine import pacing
    from ulysses.transport import EmulatedTransport

    huge = 10**400
    for pace in (huge, -huge, 1e-300, 0.0009):
        with pytest.raises(ValueError, match=r"^pace: expected 'auto', None/'off' or a rate in \[0.001, 1e\+06\]"):
            pacing.check_pace(pace)
    assert pacing.check_pace(0.001) == 0.001
    q = torch.randn(1, 4, 2, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="^softmax_scale: expected a positive float up to"):
        ulysses_attention(q, q, q, impl="reference", softmax_scale=huge)
    with torch.no_grad(), pytest.raises(ValueError, match="^pace: expected 'auto'"):
        ulysses_attention(q, q, q, impl="reference", pace=huge)
    with pytest.raises(ValueError, match="^rate_gbps: expected a number in"):
        make_pacer("cpu", huge, 4096)
    with pytest.raises(ValueError, match="^link: expected a positive rate"):
        pacing.decide(huge, None)
    with pytest.raises(ValueError, match="^timeout_s: expected a number of seconds"):
        EmulatedTransport(2, device="cpu", timeout_s=huge)


# ---- torch.compile(fullgraph=True): the plain ValueError ---------------------------------------------------------
def test_refusals_under_torch_compile_are_the_plain_value_error():
    q = [torch.randn(1, 4, 2, 8) for _ in range(2)]

    def emulated(qs):
        outs = ulysses_attention_emulated(qs, qs, qs, impl="reference", softmax_scale=-1.0)
        return torch.cat(outs, 1) * 2

    mod = block.UlyssesQKVAttention.from_linear(*_linears(), head_dim=64, world_size=1)
    x = torch.randn(1, 8, 64, dtype=BF16)
    cases = [(emulated, (q,), "^softmax_scale: expected a positive float up to"),
             (lambda x: block.ulysses_qkv_attention(x, mod.proj).flatten(2, 3), (x,), "^x: expected a CUDA tensor"),
             (lambda x: torch.cat(mod.forward_emulated([x], seq_len=7), 1), (x,), r"^seq_len \(7\) does not fit")]
    for fn, args, match in cases:
        with torch.no_grad(), pytest.raises(ValueError, match=match) as info:
            torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
        assert type(info.value) is ValueError and info.value.__cause__ is None
    # a compiled from_linear module runs its layers' chain, then the op (its fused copies could go stale
    # unseen inside the graph): on CPU that is the reference, the eager chain's values
    with torch.no_grad():
        got = torch.compile(lambda x: mod(x), backend="aot_eager", fullgraph=True)(x)
        assert torch.equal(got, ulysses_attention(*block._chain_qkv(x, None, mod._layers[0].chain())))
    with torch.no_grad():  # a valid call still compiles into one graph
        ok = torch.compile(lambda qs: ulysses_attention_emulated(qs, qs, qs, impl="reference"), backend="aot_eager",
                           fullgraph=True)(q)
        assert all(torch.equal(a, b) for a, b in zip(ok, ulysses_attention_emulated(q, q, q, impl="reference")))
