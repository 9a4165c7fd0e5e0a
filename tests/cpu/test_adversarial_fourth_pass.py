"""A fourth hostile pass (2026-12-05): arguments and state that gave a silent wrong answer or an unclear
error, each now a right answer or a ValueError naming the argument. Numeric checks are against a plain
fp64 torch oracle of the unsplit sequence (CPU, impl "reference"; gloo ranks where ranks matter)."""
import warnings

import pytest
import torch

import fa_a2a
from tests.helpers import fp64_attention


def _qkv(seed, B=1, S=6, H=2, D=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g) for _ in range(3)]


def test_a_joint_iterator_is_refused_by_name_also_after_a_cached_call():
    """The signature key spent a generator given as joint; after one valid call of the same shapes the
    cache hit and the call failed with 'not enough values to unpack', which names nothing."""
    q, k, v = _qkv(0)
    j = _qkv(1, S=2)
    fa_a2a.ulysses_attention(q, k, v, impl="reference", joint=tuple(j))
    with pytest.raises(ValueError, match="^joint: expected a tuple"):
        fa_a2a.ulysses_attention(q, k, v, impl="reference", joint=(t for t in j))


@pytest.mark.parametrize("kind", ["nested", "sparse"])
def test_a_nested_or_sparse_q_is_refused_by_name(kind):
    """A nested q failed inside the signature key (RuntimeError: NestedTensorImpl doesn't support sizes); a
    sparse one was refused as 'elements share memory ... strides (0, 0, 0, 0)'."""
    q, k, v = _qkv(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensor prototype's warning
        bad = torch.nested.nested_tensor([q[0]]) if kind == "nested" else q.to_sparse()
    got = "nested" if kind == "nested" else "torch.sparse_coo"
    with pytest.raises(ValueError, match=f"^q: expected a dense \\(strided\\) tensor, got a {got}"):
        fa_a2a.ulysses_attention(bad, k, v, impl="reference")


def test_float8_is_refused_by_name():
    """float8 passed every check and then failed in gloo's all_to_all ('Invalid scalar type') on real
    ranks, while one rank and emulated ranks ran it: refused alike everywhere now."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(3))
    with pytest.raises(ValueError, match="^q: expected float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"):
        fa_a2a.ulysses_attention(q, k, v, impl="reference")
    with pytest.raises(ValueError, match="^q: expected float16"):
        fa_a2a.ulysses_attention_emulated([q, q], [k, k], [v, v], impl="reference")


@pytest.mark.parametrize("bad", [None, [1, 2], "qs[1]"])
def test_out_proj_emulated_refuses_bad_shard_lists_by_name(bad):
    """With grad on, requires_grad was read over qs, ks, vs before they were checked: TypeError or
    AttributeError ('int' object has no attribute 'requires_grad')."""
    qs, ks, vs = ([t.requires_grad_() for t in _qkv(4 + r, S=3)] for r in range(3))
    qs, ks, vs = [qs[0], ks[0]], [qs[1], ks[1]], [qs[2], ks[2]]
    w = torch.randn(5, 16)
    if bad == "qs[1]":
        qs, want = [qs[0], 7], "^qs\\[1\\]"
    else:
        ks, want = bad, "^ks"
    with pytest.raises(ValueError, match=want):
        fa_a2a.ulysses_attention_out_proj_emulated(qs, ks, vs, w)


def test_module_takes_shard_rows_and_checks_its_layout_when_set():
    """UlyssesAttention.forward had no shard_rows (uneven shards could not pass through the module); a
    layout set after construction was not checked ('bhsd ' ran as bshd: wrong where S_loc == H)."""
    m = fa_a2a.UlyssesAttention(impl="reference", layout="bhsd")
    with pytest.raises(ValueError, match="^layout: expected one of"):
        m.layout = "bhsd "
    assert m.layout == "bhsd"
    q, k, v = (t.transpose(1, 2) for t in _qkv(5, S=4, H=4))  # bhsd, S_loc == H
    out = m(q, k, v, shard_rows=[4])
    want = fp64_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    assert (out.double() - want).abs().max().item() < 1e-5


# ---- timeouts ---------------------------------------------------------------------------------------------
def _late_rank_after_a_peer_timed_out(rank, P):
    import os
    import time

    os.environ["FA_A2A_TIMEOUT_S"] = {0: "5", 1: "1"}[rank]
    q = torch.randn(1, 4, 2, 8)
    with torch.no_grad():
        fa_a2a.ulysses_attention(q, q, q, impl="reference")  # the channel built, the ranks in step
        if rank == 0:
            time.sleep(2)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="fa_a2a"):
            fa_a2a.ulysses_attention(q, q, q, impl="reference")
        waited = time.monotonic() - t0
        assert waited < 8, f"rank {rank}: the call ended after {waited:.1f} s, past its FA_A2A_TIMEOUT_S"
        if rank == 1:
            time.sleep(8)  # goes on with other work, not calling the op


def test_a_rank_late_for_a_peer_that_timed_out_times_out_too():
    """A rank that timed out left its word published: a rank arriving later found the call agreed and
    waited in the call's exchange (gloo's process-group timeout, 30 s here, 30 min by default)."""
    from tests.multiproc import run_gloo_case

    run_gloo_case(_late_rank_after_a_peer_timed_out, 2, deadline_s=60)


def test_a_timeout_under_a_millisecond_is_refused():
    """FA_A2A_TIMEOUT_S=0.0001 became a 0 ms store wait, which a FileStore takes as no timeout: a hang."""
    from ulysses import env

    with pytest.raises(ValueError, match=r"^FA_A2A_TIMEOUT_S: expected a number of seconds in \[0.001, 1e\+06\]"):
        env.timeout_s({"FA_A2A_TIMEOUT_S": "0.0001"})
    assert env.timeout_s({"FA_A2A_TIMEOUT_S": "0.001"}) == 0.001


# ---- impl "auto"'s records on disk ------------------------------------------------------------------------
def test_damaged_auto_records_are_ignored_and_a_record_folder_is_left_clean(tmp_path, monkeypatch):
    """A time written as a 400-digit int (OverflowError), JSON nested deep (RecursionError) or a FIFO (the
    read blocked) at a record's path escaped read_record or hung it; a negative time was accepted; a failed
    write left its temporary file; clear_records raised on a folder named like a record."""
    import json
    import os

    from fa_a2a.engine import autotune
    from tests.cpu.test_autotune import FakeTransport, _problem

    monkeypatch.setenv("FA_A2A_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA_A2A_CACHE", raising=False)
    labels = ("fused:tma", "fused:st", "serial")
    key = autotune.record_key(_problem(), FakeTransport({}))
    path = autotune._record_file(key)
    path.parent.mkdir(parents=True)
    good = dict(key=key, label="serial", times={"serial": 1.0})
    path.write_text(json.dumps(good))
    assert autotune.read_record(key, labels).label == "serial"  # the records are read here
    for text in ['{"key": %s, "label": "serial", "times": {"serial": 1%s}}' % (json.dumps(key), "0" * 400),
                 "[" * 5000 + "]" * 5000, json.dumps(dict(good, times={"serial": -1.0}))]:
        path.write_text(text)
        assert autotune.read_record(key, labels) is None, text[:60]
    path.unlink()
    os.mkfifo(path)
    assert autotune.read_record(key, labels) is None
    path.unlink()
    path.mkdir()  # the record's path is a folder: the write warns, leaves nothing behind
    autotune.write_record(key, autotune.Choice("serial", "measured", {"serial": 1.0}))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert autotune.clear_records() == 0 and path.is_dir()


# ---- settings that differ between ranks -------------------------------------------------------------------
def _check_joint_on_one_rank(rank, P):
    import os

    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    if rank == 0:
        os.environ["FA_A2A_CHECK_JOINT"] = "1"
    q = torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(rank))
    joint = [torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(7)) for _ in range(3)]  # the same
    with torch.no_grad(), pytest.raises(ValueError) as info:
        fa_a2a.ulysses_attention(q, q, q, joint=joint, impl="reference")
    assert str(info.value).startswith("FA_A2A_CHECK_JOINT (whether this rank checks joint's data): expected the "
                                      "same value on every rank, got rank 0: True, rank 1: None"), str(info.value)


def test_check_joint_set_on_one_rank_is_named_as_the_setting():
    """FA_A2A_CHECK_JOINT on rank 0 alone, the same joint data: the refusal read as if the data differed
    ('joint (data checksum ...)', rank 1: None)."""
    from tests.multiproc import run_gloo_case

    run_gloo_case(_check_joint_on_one_rank, 2, deadline_s=60)


def test_fa_a2a_impl_that_cannot_run_on_cpu_tensors_is_said(monkeypatch):
    """FA_A2A_IMPL=serial with CPU tensors ran reference and said only 'CPU tensors: reference is the one
    candidate': the decision now says the setting does not apply."""
    from fa_a2a.engine import autotune

    monkeypatch.setenv("FA_A2A_IMPL", "serial")
    qs, ks, vs = ([t] for t in _qkv(8, S=5))
    fa_a2a.ulysses_attention_emulated(qs + qs, ks + ks, vs + vs, impl="auto")
    reasons = [c.reason for c in autotune.decisions().values() if "CPU tensors" in c.reason]
    assert any("FA_A2A_IMPL='serial' does not apply" in r for r in reasons), reasons


def test_fa_a2a_transport_is_agreed_for_the_calls_that_use_it(monkeypatch):
    """FA_A2A_TRANSPORT was in no call's signature: ranks with vmm and host (or symm) windows ran different
    collective set-ups (an unclear TransportSetupError, or a wait until the process group's timeout). It
    is agreed now wherever the windows are used (CUDA tensors, impl auto / fused / serial); a GPU shows the
    set-up itself, this checks the agreement's fields and message."""
    import dataclasses

    from fa_a2a.engine import problem as pb

    q, k, v = _qkv(9)
    base, _ = pb.check_call(q, k, v, None, "reference", False, None, None, 2, None, 0, None)
    cuda = dataclasses.replace(base, device_type="cuda", impl="fused")
    fields = {}
    for rank, value in enumerate(("vmm", "host")):
        monkeypatch.setenv("FA_A2A_TRANSPORT", value)
        fields[rank] = pb.signature_fields(cuda, "ulysses_attention", "0", None)
    assert pb.signature_word(fields[0]) != pb.signature_word(fields[1])
    err = pb._disagreement([("ok", fields[0]), ("ok", fields[1])], None)
    assert str(err) == ("FA_A2A_TRANSPORT (the windows' transport): expected the same value on every rank, got "
                        "rank 0: 'vmm', rank 1: 'host'")
    monkeypatch.setenv("FA_A2A_TRANSPORT", "ipc")  # another name of vmm
    assert pb.signature_fields(cuda, "ulysses_attention", "0", None) == fields[0]
    for other in (base, dataclasses.replace(cuda, impl="nccl")):  # no windows: not agreed
        assert "transport" not in pb.signature_fields(other, "ulysses_attention", "0", None)


# ---- double backward --------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["autograd.grad", "hessian", "emulated", "out_proj"])
def test_double_backward_is_refused_however_it_is_asked_for(how):
    """create_graph=True: the gradients came out detached behind a DelayedError that only a .backward()
    over every node met; autograd.grad(penalty, w) and autograd.functional.hessian skipped it and silently
    lost the attention's second-order term (a wrong weight gradient, an all-zero Hessian)."""
    S, H, D, C = 4, 2, 4, 6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, S, C, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(H * D, C, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, S, H, D, dtype=torch.float64, generator=g) for _ in range(2))
    with pytest.raises(ValueError, match="^create_graph: fa_a2a's attention has no double backward"):
        if how == "hessian":
            torch.autograd.functional.hessian(lambda q: fa_a2a.ulysses_attention(q, k, v).pow(2).sum(), k.clone())
        else:
            q = torch.nn.functional.linear(x, w).unflatten(-1, (H, D))
            if how == "emulated":
                out = torch.cat(fa_a2a.ulysses_attention_emulated(list(q.chunk(2, 1)), list(k.chunk(2, 1)),
                                                                 list(v.chunk(2, 1)), impl="reference"), 1)
            elif how == "out_proj":
                out = fa_a2a.ulysses_attention_out_proj(q, k, v, torch.randn(3, H * D, dtype=torch.float64))
            else:
                out = fa_a2a.ulysses_attention(q, k, v)
            gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
            torch.autograd.grad((gx ** 2).sum(), w)


def _double_backward_on_ranks(rank, P):
    import os

    os.environ["FA_A2A_TIMEOUT_S"] = "10"
    q, k, v = (t[:, rank * 3:(rank + 1) * 3].clone().requires_grad_() for t in _qkv(11, S=6))
    out = fa_a2a.ulysses_attention(q, k, v, impl="reference")
    with pytest.raises(ValueError, match="create_graph: fa_a2a's attention has no double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=rank == 0)  # on one rank only: both refuse


def test_double_backward_on_one_rank_is_refused_on_every_rank():
    from tests.multiproc import run_gloo_case

    run_gloo_case(_double_backward_on_ranks, 2, deadline_s=60)


# ---- the attention block's layers (from_linear), on its grad path (CPU) -----------------------------------
def _layers(bias=True, C=16, H=2, D=64):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(C, H * D, bias=bias).to(torch.bfloat16).requires_grad_(False) for _ in range(3)]
    with torch.no_grad():
        for m in layers:
            if bias:
                m.bias.normal_()
    return layers


def _x(C=16, S=6):
    return torch.randn(1, S, C, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()


@pytest.mark.parametrize("which", [0, 1])
def test_a_bias_removed_after_from_linear_is_refused(which):
    """to_q.bias = None after from_linear left out to_k's and to_v's biases too (relative error 0.97, in
    training as well); to_k.bias = None failed in torch.cat (TypeError)."""
    layers = _layers()
    module = fa_a2a.UlyssesQKVAttention.from_linear(*layers, head_dim=64, world_size=1)
    layers[which].bias = None
    with pytest.raises(ValueError, match="^to_q, to_k, to_v: expected a bias on all three or on none"):
        module(_x())


@pytest.mark.parametrize("how", ["subclass", "hook", "instance forward"])
def test_layers_whose_call_is_more_than_their_weights_are_refused(how):
    """A LoRA-style nn.Linear subclass, a forward hook or a forward set on the instance: accepted, and
    what they add was dropped (relative errors 1.03, 0.75, 9.0). Hooks added after from_linear count too."""
    class Adapted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    layers = _layers()
    if how == "subclass":
        adapted = Adapted(16, 128).to(torch.bfloat16).requires_grad_(False)
        adapted.load_state_dict(layers[0].state_dict())
        with pytest.raises(ValueError, match="^to_q: Adapted computes more than its weight"):
            fa_a2a.UlyssesQKVAttention.from_linear(adapted, *layers[1:], head_dim=64, world_size=1)
        return
    module = fa_a2a.UlyssesQKVAttention.from_linear(*layers, head_dim=64, world_size=1)
    if how == "hook":
        layers[1].register_forward_hook(lambda m, args, out: out * 2)
    else:
        layers[1].forward = lambda x: torch.nn.functional.linear(x, layers[1].weight) * 2
    with pytest.raises(ValueError, match="^to_k: has forward hooks"):
        module(_x())


def test_share_weights_refuses_tied_layers():
    """to_q and to_k sharing one Parameter: share_weights pointed it at k's rows only, so a `.data` write
    reached one copy (relative error 1.57 after it)."""
    layers = _layers(bias=False)
    layers[1].weight = layers[0].weight
    with pytest.raises(ValueError, match="^share_weights: expected layers with weights of their own, got to_q and "
                                         "to_k sharing one"):
        fa_a2a.UlyssesQKVAttention.from_linear(*layers, head_dim=64, world_size=1, share_weights=True)


def test_forward_emulated_takes_a_list_of_every_ranks_rotary():
    """rotary of one entry for 2 ranks: zip cut the call to one rank's output; one (cos, sin) pair for P 2
    was taken as two ranks' tables."""
    from fa_a2a import block

    layers = _layers()
    module = fa_a2a.UlyssesQKVAttention.from_linear(*layers, head_dim=64, world_size=2)
    xs = [_x(S=3), _x(S=3)]
    cos, sin = block.rotary_pair(torch.arange(3), 64)
    for rotary, got in (([(cos, sin)], "got 1 entries"), ((cos, sin), "got a tuple of two tensors")):
        with pytest.raises(ValueError, match=f"^rotary: expected None or a list of 2 per-rank rotaries, {got}"):
            module.forward_emulated(xs, rotary=rotary)


@pytest.mark.parametrize("arg", ["joint_rotary", "impl", "config", "one_launch"])
def test_the_grad_path_checks_the_arguments_the_fused_path_checks(arg):
    """Hidden states that require grad: joint_rotary without joint, impl 'nccl', config 'bogus' and
    one_launch 'x' ran (a call accepted in training, refused at inference)."""
    from fa_a2a import block

    proj = block.block_weights(block.TorchQKV(torch.cat([m.weight for m in _layers(bias=False)]), None, None, None,
                                              2, 2, 64), 1)
    kw = {"joint_rotary": dict(joint_rotary=torch.zeros(2, 64)), "impl": dict(impl="nccl"),
          "config": dict(config="bogus"), "one_launch": dict(one_launch="x")}[arg]
    with pytest.raises(ValueError, match=f"^{'joint' if arg == 'joint_rotary' else arg}: "):
        fa_a2a.ulysses_qkv_attention(_x(), proj, **kw)


# ---- torch.compile with dynamic sequence lengths ----------------------------------------------------------
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("entry", ["op", "module", "emulated"])
def test_one_graph_serves_every_sequence_length(entry, grad):
    """The traced checks fixed the sequence length (operator.index in the layout, the signature cache's key):
    a graph per length under dynamic=True, FailOnRecompileLimitHit at the 9th under fullgraph=True, and
    torch._dynamo.mark_dynamic on the rows a ConstraintViolationError."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    if entry == "emulated" and grad:
        pytest.skip("emulated ranks are differentiable eagerly only (refused under torch.compile)")
    torch._dynamo.reset()
    module = fa_a2a.UlyssesAttention(impl="reference", layout="bhsd")
    calls = {
        "op": lambda q, k, v: fa_a2a.ulysses_attention(q, k, v, impl="reference", softmax_scale=0.3),
        "module": lambda q, k, v: module(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2),
        "emulated": lambda q, k, v: torch.cat(fa_a2a.ulysses_attention_emulated(
            list(q.chunk(2, 1)), list(k.chunk(2, 1)), list(v.chunk(2, 1)), impl="reference", softmax_scale=0.3), 1)}
    counter = CompileCounter()
    compiled = torch.compile(calls[entry], backend=counter, fullgraph=True, dynamic=True)
    scale = None if entry == "module" else 0.3
    for S in range(4, 24, 2):  # 10 lengths: past torch's recompile limit of 8
        g = torch.Generator().manual_seed(S)
        q, k, v = (torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(3))
        out = compiled(q, k, v)
        xs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        want = fp64_attention(*xs, scale) if scale else fp64_attention(*xs)
        assert (out.detach() - want.detach()).abs().max().item() < 1e-12, S
        if grad:
            w = torch.randn(out.shape, generator=g, dtype=torch.float64)
            for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), xs)):
                assert (a - b).abs().max().item() < 1e-12, S
    assert counter.frame_count == 1


def test_mark_dynamic_on_the_rows_is_kept():
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa_a2a.ulysses_attention(q, k, v, impl="reference"), backend="eager",
                             fullgraph=True)
    q, k, v = _qkv(12, S=4)
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 1)
    want = fp64_attention(*(t.double() for t in (q, k, v)))
    assert (compiled(q, k, v).double() - want).abs().max().item() < 1e-5


# ---- the kernels' own entry points (fake CUDA tensors, the compile replaced by a stub) --------------------
@pytest.mark.parametrize("kw", [dict(causal="no"), dict(softmax_scale=float("nan")), dict(softmax_scale=-1.0),
                                dict(softmax_scale=0.0), dict(softmax_scale="x"), dict(rotate="no")])
def test_fa4_entry_points_refuse_bad_scalars(kw, monkeypatch):
    """fa4_forward / fa4_a2a_forward took causal='no' (a truthy string: FA4's causal mask on) and NaN, zero or
    negative scales into the kernel's compile key and launch unchecked; the op refuses them by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cute_kernels import fa4

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fa4, "compile_fa4", lambda *key, **options: (lambda *args: None))
    name = next(iter(kw))
    with FakeTensorMode():
        q = torch.empty(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
        windows = torch.empty(2, 1, 128, 4, 128, dtype=torch.bfloat16, device="cuda")
        if name != "rotate":
            with pytest.raises(ValueError, match=f"^{name}: expected"):
                fa4.fa4_forward(q, q, q, **kw)
            with pytest.raises(ValueError, match=f"^{name}: expected"):
                fa4.fa4_fresh_launcher(q, q, q, **kw)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            fa4.fa4_a2a_forward(q, q, q, windows, 0, **kw)


def test_low_level_entry_points_name_bad_arguments():
    """enable_fused_projection(None) (AttributeError), get_transport('abc') (AttributeError), get_transport on
    a machine without CUDA (torch's 'no NVIDIA driver'), post_a2a(broadcast='x') (torch's op schema error)."""
    from ulysses.transport import get_transport

    with pytest.raises(ValueError, match="^model: expected a diffusers model"):
        fa_a2a.enable_fused_projection(None)
    with pytest.raises(ValueError, match="^broadcast: expected a bool"):
        fa_a2a.post_a2a(torch.zeros(1, 2, 1, 8), torch.zeros(2, 1, 1, 2, 8), 0, broadcast="x")
    from tests.multiproc import run_gloo_case

    run_gloo_case(_transport_arguments, 1, deadline_s=60)


def _transport_arguments(rank, P):
    from ulysses.transport import get_transport

    with pytest.raises(ValueError, match="^group: expected a torch.distributed ProcessGroup"):
        get_transport("abc")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^group: the transports' windows are GPU memory"):
            get_transport()


def _enable_ulysses_arguments(rank, P):
    from fa_a2a.models.diffusers_backend import cpu_testbed

    from tests.cpu.test_adversarial_models import _tiny_flux

    cpu_testbed()
    for kw, want in ((dict(ulysses_degree=1), "^ulysses_degree: expected the world size 2 without a mesh"),
                     (dict(ulysses_degree=3), "^ulysses_degree: expected the world size 2 without a mesh"),
                     (dict(impl=None), "^impl: "), (dict(impl="FUSED"), "^impl: "),
                     (dict(mesh="abc"), "^mesh: expected a DeviceMesh")):
        model = _tiny_flux()
        with pytest.raises(ValueError, match=want):
            fa_a2a.enable_ulysses(model, **kw)
        assert getattr(model, "_parallel_config", None) is None, kw  # refused before anything was set


def test_enable_ulysses_refuses_a_degree_other_than_the_world_size_without_a_mesh():
    """ulysses_degree 2 on 3 ranks: ranks 0 and 1 ran a 2-rank model while rank 2 failed in DeviceMesh (the
    ranks parted ways); impl None named the backend name; a mesh of another type failed with TypeError."""
    pytest.importorskip("diffusers")
    from tests.multiproc import run_gloo_case

    run_gloo_case(_enable_ulysses_arguments, 2, deadline_s=120)


# ---- the ulysses package's own functions and the X-Stage fits ---------------------------------------------
def test_reference_attention_checks_its_scale_rows_and_gradient():
    """local_attention took a NaN scale (all-zero output: SDPA's CPU kernel zeroes NaN rows) and
    seqused_k=True as 1; its backward checked nothing (a q of 1 head with k of 2 gave dq of 2 heads; a do
    of another shape was broadcast; seqused_k -2 masked two keys)."""
    from ulysses.reference import local_attention, local_attention_backward

    q, k, v = _qkv(13, H=2)
    for kw, want in ((dict(softmax_scale=float("nan")), "^softmax_scale: "),
                     (dict(softmax_scale=True), "^softmax_scale: "), (dict(seqused_k=True), "^seqused_k "),
                     (dict(seqused_k=-2), "^seqused_k "), (dict(seqused_k=2.5), "^seqused_k ")):
        for fn in (lambda **a: local_attention(q, k, v, **a), lambda **a: local_attention_backward(q, k, v, q, **a)):
            with pytest.raises(ValueError, match=want):
                fn(**kw)
    with pytest.raises(ValueError, match="^k: expected"):
        local_attention_backward(q[:, :, :1], k, v, q[:, :, :1])
    with pytest.raises(ValueError, match="^do: expected q's shape"):
        local_attention_backward(q, k, v, q[:, :, :1])


def test_layout_helpers_refuse_what_int_would_truncate_or_reorder():
    """take_heads(x, [0.9, 1.9]) was take_heads(x, [0, 1]); check_shard_rows({5, 3}, 2) gave (3, 5) (a set
    has no rank order); EmulatedTransport.windows('b', (2.7,), ...) made a [P, 2] window."""
    from ulysses.layout import check_shard_rows, take_heads
    from ulysses.transport import EmulatedTransport

    x = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="^heads: "):
        take_heads(x, [0.9, 1.9])
    with pytest.raises(ValueError, match="^heads: "):
        take_heads(x, [True])
    with pytest.raises(ValueError, match="^shard_rows: "):
        check_shard_rows({5, 3}, 2)
    with pytest.raises(ValueError, match="^world_size: "):
        check_shard_rows([5, 3], True)
    with pytest.raises(ValueError, match="^shard_rows: "):
        fa_a2a.ulysses_attention(*_qkv(14), impl="reference", shard_rows={6})
    t = EmulatedTransport(2, device="cpu")
    for shape in ((2.7,), (True,)):
        with pytest.raises(ValueError, match="^shape: "):
            t.windows("b", shape, torch.float32)
    t.close()


def test_xstage_fits_at_the_ends_of_float():
    """fit_drain_rate of volumes 1e-200 over periods of 1 s returned 0.0 ((x * x) underflowed), 1e200 over
    1e-200 NaN; fit_capacity(n_iter=0) raised UnboundLocalError."""
    from fa_a2a.tools.xstage import fit_capacity, fit_drain_rate

    assert fit_drain_rate([1e-200], [1.0]) == pytest.approx(1e-200)
    assert fit_drain_rate([1e-170, 2e-170], [1.0, 2.0]) == pytest.approx(1e-170)
    with pytest.raises(ValueError, match="^volumes, periods: no finite positive drain rate"):
        fit_drain_rate([1e200], [1e-200])
    with pytest.raises(ValueError, match="^n_iter: "):
        fit_capacity([1e6, 2e6, 4e6], [1e-6, 2e-6, 4e-6], 1e12, n_iter=0)


def test_layout_methods_and_platform_json_name_bad_arguments():
    """AttributeError from split_out([1]), zero_padding([1], 0) and assemble_q(joint=5); RecursionError from
    PlatformModel.from_json of JSON nested deep (its docstring promises a ValueError)."""
    from ulysses.layout import UlyssesLayout

    lay = UlyssesLayout(8, 2, 2, 2, joint_len=1)
    seq = torch.zeros(1, 8, 1, 4)
    for call, want in ((lambda: lay.split_out([1]), "^out must be"), (lambda: lay.zero_padding([1], 0), "^x: "),
                       (lambda: lay.assemble_q(seq, 5), "^joint must be None or")):
        with pytest.raises(ValueError, match=want):
            call()
    with pytest.raises(ValueError, match="^source: not valid JSON"):
        fa_a2a.PlatformModel.from_json("[" * 5000 + "]" * 5000)
