"""Argument edges of UlyssesQKVAttention.from_linear / its constructor and of the paced kernel's
make_pacer / check_pacer: each bad argument is a ValueError naming the caller's argument (CPU
tensors: the checks and the weight gathering need no GPU)."""

import pytest
import torch
from torch import nn

from cute_kernels import pacer as paced
from fa_a2a import block

BF16 = torch.bfloat16


def _lin(c_in=64, c_out=256, dtype=BF16, bias=True):
    return nn.Linear(c_in, c_out, bias=bias, dtype=dtype)


def _qkv(**kw):
    return [_lin(**kw) for _ in range(3)]


def _norms(n=64, eps=1e-6):
    return dict(norm_q=nn.RMSNorm(n, eps=eps), norm_k=nn.RMSNorm(n, eps=eps))


def _from(layers, **kw):
    kw.setdefault("head_dim", 64)
    kw.setdefault("world_size", 2)
    return block.UlyssesQKVAttention.from_linear(*layers, **kw)


def _nobias():
    return _lin(bias=False)


FROM_LINEAR_BAD = [
    ("head_dim 0", lambda: (_qkv(), dict(head_dim=0)), "head_dim: expected a positive int, got 0"),
    ("head_dim -64", lambda: (_qkv(), dict(head_dim=-64)), "head_dim: expected a positive int, got -64"),
    ("head_dim bool", lambda: (_qkv(), dict(head_dim=True)), "head_dim: expected a positive int, got True"),
    ("head_dim float", lambda: (_qkv(), dict(head_dim=64.0)), "head_dim: expected a positive int"),
    ("q out_features", lambda: ([_lin(c_out=200), _lin(), _lin()], {}),
     "to_q: expected out_features a multiple of head_dim = 64, got 200"),
    ("q out_features across heads", lambda: ([_lin(c_out=200), _lin(), _lin()], dict(across_heads=True)),
     "to_q: expected out_features a multiple of head_dim = 64, got 200"),
    ("v out_features", lambda: ([_lin(), _lin(c_out=128), _lin(c_out=192)], {}),
     r"to_v: expected out_features = 128 \(to_k's\), got 192"),
    ("kv heads not dividing", lambda: ([_lin(), _lin(c_out=192), _lin(c_out=192)], {}),
     "to_k: expected a head count .* dividing to_q's 4, got 3"),
    ("bias on to_q only", lambda: ([_lin(), _nobias(), _nobias()], {}),
     "to_q, to_k, to_v: expected a bias on all three or on none, got one on to_q only"),
    ("no bias on to_k", lambda: ([_lin(), _nobias(), _lin()], {}),
     "to_q, to_k, to_v: expected a bias on all three or on none, got one on to_q, to_v only"),
    ("to_k in_features", lambda: ([_lin(), _lin(c_in=32), _lin()], {}),
     r"to_k: expected in_features = 64 \(to_q's\), got 32"),
    ("fp32", lambda: (_qkv(dtype=torch.float32), {}), "to_q: expected bfloat16/float16 weights .* got torch.float32"),
    ("mixed bf16/fp16", lambda: ([_lin(), _lin(dtype=torch.float16), _lin()], {}),
     "to_k: expected to_q's torch.bfloat16 on cpu, got torch.float16 on cpu"),
    ("not a Linear", lambda: ([_lin(), nn.Conv1d(64, 256, 1), _lin()], {}), "to_k: expected an nn.Linear, got Conv1d"),
    ("norm_q only", lambda: (_qkv(), dict(norm_q=nn.RMSNorm(64, eps=1e-6))), "norm_q, norm_k: both or neither"),
    ("norm eps", lambda: (_qkv(), _norms(eps=1e-5)), "norm_q: expected eps 1e-06"),
    ("norm_k eps", lambda: (_qkv(), dict(norm_q=nn.RMSNorm(64, eps=1e-6), norm_k=nn.RMSNorm(64, eps=None))),
     "norm_k: expected eps 1e-06 .* got None"),
    ("norm size", lambda: (_qkv(), _norms(32)), r"norm_q: expected an RMSNorm or a weight tensor, \[64\]"),
    ("norm without weight", lambda: (_qkv(), dict(norm_q=nn.RMSNorm(64, eps=1e-6, elementwise_affine=False),
                                                  norm_k=nn.RMSNorm(64, eps=1e-6))),
     r"norm_q: expected an RMSNorm with a weight, got one without \(elementwise_affine=False\)"),
    ("across-heads norm size", lambda: (_qkv(), dict(_norms(64, 1e-5), across_heads=True)),
     r"norm_q: expected an RMSNorm or a weight tensor, \[256\] on cpu \(across heads\)"),
    ("across-heads eps differ", lambda: (_qkv(), dict(norm_q=nn.RMSNorm(256, eps=1e-5),
                                                      norm_k=nn.RMSNorm(256, eps=1e-6), across_heads=True)),
     "norm_k: expected norm_q's eps 1e-05, got 1e-06"),
    ("add_q alone", lambda: (_qkv(), dict(add_q=_lin())), "add_q, add_k, add_v: expected all three or none"),
    ("add_k alone", lambda: (_qkv(), dict(add_k=_lin())), "add_q, add_k, add_v: expected all three or none"),
    ("norm_added without add", lambda: (_qkv(), dict(norm_added_q=nn.RMSNorm(64))),
     "norm_added_q, norm_added_k: expected None without add_q"),
    ("add heads", lambda: (_qkv(), dict(zip(("add_q", "add_k", "add_v"), _qkv(c_out=128)))),
     r"add_q, add_k: expected to_q's and to_k's heads \(4, 4\), got \(2, 2\)"),
    ("add dtype", lambda: (_qkv(), dict(zip(("add_q", "add_k", "add_v"), _qkv(dtype=torch.float16)))),
     "add_q: expected to_q's torch.bfloat16 on cpu, got torch.float16"),
    ("add bias", lambda: (_qkv(), dict(add_q=_lin(), add_k=_nobias(), add_v=_lin())),
     "add_q, add_k, add_v: expected a bias on all three or on none, got one on add_q, add_v only"),
    ("add norms", lambda: (_qkv(), dict(zip(("add_q", "add_k", "add_v"), _qkv()), norm_added_k=nn.RMSNorm(64))),
     "norm_added_q, norm_added_k: both or neither"),
    ("share with across heads", lambda: (_qkv(), dict(share_weights=True, across_heads=True)),
     "share_weights: expected False with across_heads=True"),
    ("share not bool", lambda: (_qkv(), dict(share_weights=1)), "share_weights: expected a bool, got 1"),
    ("across not bool", lambda: (_qkv(), dict(across_heads="no")), "across_heads: expected a bool"),
    ("world_size 0", lambda: (_qkv(), dict(world_size=0)), "world_size: expected a positive int or None, got 0"),
    ("head_dim 32", lambda: (_qkv(), dict(head_dim=32)), r"head_dim: one of \(64, 128\) expected, got 32"),
]


@pytest.mark.parametrize("what,make,match", FROM_LINEAR_BAD, ids=[c[0] for c in FROM_LINEAR_BAD])
def test_from_linear_refuses(what, make, match):
    layers, kw = make()
    with pytest.raises(ValueError, match=match):
        _from(layers, **kw)


def test_from_linear_builds_both_paths():
    """The good cases beside the refusals: fused (bf16, per-head norms, text layers) and the torch chain
    (fp32 accepted there, norms across heads)."""
    add = dict(zip(("add_q", "add_k", "add_v"), _qkv(c_in=32)), norm_added_q=nn.RMSNorm(64, eps=1e-6),
               norm_added_k=nn.RMSNorm(64, eps=1e-6))
    mod = _from(_qkv(), **_norms(), **add)
    assert mod.fused and mod.proj.world_size == 2 and mod.joint_proj.weight.shape == (3 * 256, 32)
    wan = _from(_qkv(dtype=torch.float32), norm_q=nn.RMSNorm(256, eps=1e-5), norm_k=nn.RMSNorm(256, eps=1e-5),
                across_heads=True)
    assert not wan.fused and wan.chain is None and wan._chains()[0].eps == 1e-5 and wan._chains()[0].num_heads == 4


def test_share_weights_refuses_gqa_replication_and_changes_nothing():
    """8 query heads, 2 KV heads on 8 ranks: every rank holds a replica of its KV head, so W_k is not a
    block of the gathered weights; the refusal leaves every layer as it was."""
    layers = [_lin(c_out=512), _lin(c_out=128), _lin(c_out=128)]
    before = [m.weight for m in layers]
    ptrs = [m.weight.data_ptr() for m in layers]
    with pytest.raises(ValueError, match="share_weights: expected to_k's heads in order"):
        _from(layers, world_size=8, share_weights=True)
    assert [m.weight for m in layers] == before and [m.weight.data_ptr() for m in layers] == ptrs
    assert _from(layers, world_size=8).proj.kv_heads_loc == 1  # the copy is fine


def test_constructor_refuses():
    chain = block.TorchQKV(torch.zeros(768, 64, dtype=BF16), None, None, None, 4, 4, 64)
    proj = block.block_weights(chain, 2)
    with pytest.raises(ValueError, match="chain, proj: expected exactly one"):
        block.UlyssesQKVAttention(chain, proj=proj, world_size=2)
    with pytest.raises(ValueError, match="chain, proj: expected exactly one"):
        block.UlyssesQKVAttention(world_size=2)
    with pytest.raises(ValueError, match="proj: expected a QKVWeights gathered for world_size = 4"):
        block.UlyssesQKVAttention(proj=proj, world_size=4)
    with pytest.raises(ValueError, match="joint_proj: expected a QKVWeights gathered for world_size = 2"):
        block.UlyssesQKVAttention(proj=proj, joint_proj=chain, world_size=2)
    with pytest.raises(ValueError, match="joint_chain: expected None with proj"):
        block.UlyssesQKVAttention(proj=proj, joint_chain=chain, world_size=2)
    with pytest.raises(ValueError, match="joint_proj: expected None with chain"):
        block.UlyssesQKVAttention(chain, joint_proj=proj, world_size=2)
    with pytest.raises(ValueError, match="world_size: expected a positive int or None, got True"):
        block.UlyssesQKVAttention(chain, world_size=True)
    assert block.UlyssesQKVAttention(proj=proj, world_size=2).proj is proj


# ---- the pacer -----------------------------------------------------------------------------------------
PACER_BAD = [
    ((5e-324, 32768), "rate_gbps: expected at least tile_bytes / 1e9"),
    ((1e-300, 32768), "rate_gbps: expected at least tile_bytes / 1e9"),
    ((1e-6, 32768), "rate_gbps: expected at least tile_bytes / 1e9"),
    ((True, 32768), r"rate_gbps: expected a number in \(0, 1e\+06\] GB/s, got True"),
    ((float("nan"), 32768), "rate_gbps: expected a number"),
    ((1e7, 32768), "rate_gbps: expected a number"),
    ((None, 32768), "rate_gbps: expected a number"),
    ((40.0, 2**80), r"tile_bytes: expected an int in \[1, 2\*\*30\]"),
    ((40.0, True), "tile_bytes: expected an int"),
    ((40.0, 32768.0), "tile_bytes: expected an int"),
    ((40.0, 32768, 2**62), r"burst_tiles: expected an int in \[0, 2\*\*20\]"),
    ((40.0, 32768, False), "burst_tiles: expected an int"),
    ((40.0, 32768, 2.0), "burst_tiles: expected an int"),
]


@pytest.mark.parametrize("args,match", PACER_BAD, ids=[repr(a) for a, _ in PACER_BAD])
def test_make_pacer_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        paced.make_pacer("cpu", *args)


def test_make_pacer_bounds_hold():
    """The extremes accepted stay inside int64 (dt <= 1 s a tile, tau <= 2**20 tiles of it)."""
    slow = paced.make_pacer("cpu", 2**30 / 1e9, 2**30, burst_tiles=2**20)
    assert slow.tolist() == [0, 10**9, 2**20 * 10**9]
    fast = paced.make_pacer("cpu", 1e6, 1)
    assert fast.tolist() == [0, 1, 8]
    with torch.inference_mode():  # made under inference mode: still checkable
        paced.check_pacer(paced.make_pacer("cpu", 40, 32768), torch.device("cpu"))


def test_check_pacer_refuses_states_not_from_make_pacer():
    good = paced.make_pacer("cpu", 40.0, 32768)
    paced.check_pacer(good, torch.device("cpu"))
    for bad in (torch.tensor([0, -5, -40]), torch.tensor([0, 819, 3276]), torch.zeros(3, dtype=torch.int32),
                torch.zeros(4, dtype=torch.int64), [0, 819, 3276]):
        with pytest.raises(ValueError, match="pacer: expected"):
            paced.check_pacer(bad, torch.device("cpu"))
    good[1] = -5  # written after make_pacer: its dt is no longer the checked one
    with pytest.raises(ValueError, match="pacer: expected the state make_pacer returned, unchanged since"):
        paced.check_pacer(good, torch.device("cpu"))
    with pytest.raises(ValueError, match="pacer: expected an int64 tensor"):
        paced.check_pacer(paced.make_pacer("meta", 40.0, 32768), torch.device("cpu"))


def test_layers_made_float32_after_from_linear_are_refused_by_the_same_rule():
    """The fused projection's dtype rule holds when from_linear takes the layers and when they change later
    (layer.float() after the build): one rule (block._check_fused_dtype), one message."""
    layers = _qkv()
    mod = _from(layers, **_norms())
    for m in layers:
        m.float()
    xs = [torch.randn(1, 8, 64, dtype=BF16) for _ in range(2)]
    with torch.no_grad(), pytest.raises(ValueError,
                                        match="to_q: expected bfloat16/float16 weights .* got torch.float32"):
        mod.forward_emulated(xs)
