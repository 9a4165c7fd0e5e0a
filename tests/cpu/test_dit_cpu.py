"""Flux under Ulysses on CPU: fa_a2a.dit's processor and hooks with the "reference" impl.

A tiny random FluxTransformer2DModel (fp32) run by P = 2 gloo ranks, and by emulated ranks in one
process, must return the single-device model's output (fp32 attention on both sides: only the
order of floating-point sums differs). The Ulysses op is wrapped to count its calls and check
their shapes, so a model that silently ran unsharded would fail.
"""

import pytest
import torch

pytest.importorskip("diffusers")

from fa_a2a import dit  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

CFG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
           num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
ATOL = 2e-5  # fp32; outputs are O(1)


def _model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(**CFG).eval()


def _inputs(height, width, text_len, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return dict(
        hidden_states=torch.randn(batch, height * width, CFG["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, CFG["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(batch, CFG["pooled_projection_dim"], generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.randn(text_len, 3, generator=g),
    )


class _CountCalls:
    """Wraps a function of fa_a2a.op and records the sequence length of each call's q."""

    def __init__(self, monkeypatch, name):
        import fa_a2a.op as op

        self.fn = getattr(op, name)
        self.rows = []
        monkeypatch.setattr(op, name, self)

    def __call__(self, q, *args, **kwargs):
        self.rows.append(q[0].shape[1] if isinstance(q, (list, tuple)) else q.shape[1])
        return self.fn(q, *args, **kwargs)


CASES = [(4, 4, 5), (3, 5, 4)]  # (height, width, text tokens): S = 16 (even), S = 15 (uneven over 2)
N_ATTN = CFG["num_layers"] + CFG["num_single_layers"]


def _check_flux(P, group, rank):
    import fa_a2a.op as op

    calls = []
    real = op.ulysses_attention
    op.ulysses_attention = lambda q, *a, **k: (calls.append(q.shape[1]), real(q, *a, **k))[1]
    model = _model()
    torch.set_grad_enabled(False)
    for height, width, J in CASES:
        x = _inputs(height, width, J)
        ref = model(**x).sample
        handle = dit.parallelize_flux(model, group=group, impl="reference")
        calls.clear()
        out = model(**x).sample
        out_tuple = model(**x, return_dict=False)[0]
        S_loc = -(-height * width // P)
        assert calls == [S_loc] * (2 * N_ATTN), \
            f"rank {rank}: Ulysses calls saw q rows {calls}, expected {2 * N_ATTN} x {S_loc}"
        handle.remove()
        again = model(**x).sample
        err = (out - ref).abs().max().item()
        assert out.shape == ref.shape and err <= ATOL and torch.equal(out, out_tuple), \
            f"rank {rank} S={height * width}: shape {tuple(out.shape)} vs {tuple(ref.shape)}, max error {err:.3g} > {ATOL}"
        assert torch.equal(again, ref), f"rank {rank}: remove() did not restore the model"


def test_flux_gloo_two_ranks_matches_single_device():
    run_on_gloo_groups(_check_flux, (2,), timeout_s=120)


@pytest.mark.parametrize("P", [3, 4])
def test_flux_emulated_ranks_matches_single_device(P, monkeypatch):
    # P = 3 does not divide the 4 heads (head padding) nor S = 15 or 16 (sequence padding).
    counter = _CountCalls(monkeypatch, "ulysses_attention_emulated")
    model = _model()
    with torch.no_grad():
        for height, width, J in CASES:
            x = _inputs(height, width, J, batch=3)
            ref = model(**x).sample
            handle = dit.parallelize_flux(model, impl="reference", emulated_ranks=P)
            counter.rows.clear()
            out = model(**x).sample
            handle.remove()
            S_loc = -(-height * width // P)
            assert counter.rows == [S_loc] * N_ATTN
            assert out.shape == ref.shape
            err = (out - ref).abs().max().item()
            assert err <= ATOL, err
            assert torch.equal(model(**x).sample, ref)


def test_shard_and_gather_rows_are_exact():
    x = torch.randn(2, 7, 3)
    shards = [dit.shard_rows(x, 1, r, 3) for r in range(3)]
    assert [s.shape[1] for s in shards] == [3, 3, 3]
    assert torch.equal(torch.cat(shards, 1)[:, :7], x)
    assert torch.equal(shards[2][:, 1:], torch.zeros(2, 2, 3))
    ids = torch.randn(5, 3)
    assert torch.equal(dit.shard_rows(ids, 0, 1, 2), torch.cat([ids[3:], torch.zeros(1, 3)]))
    assert torch.equal(dit.shard_rows(ids, 0, 2, 4)[1], torch.zeros(3))  # rank 2 of 4: rows 4, (5)


def test_bad_input_raises_value_error():
    model = _model()
    with pytest.raises(ValueError, match="impl"):
        dit.parallelize_flux(model, impl="magic", emulated_ranks=2)
    with pytest.raises(ValueError, match="impl"):
        dit.parallelize_flux(model, impl="nccl", emulated_ranks=2)
    with pytest.raises(ValueError, match="emulated_ranks"):
        dit.parallelize_flux(model, impl="reference", emulated_ranks=0)
    with pytest.raises(ValueError, match="model"):
        dit.parallelize_flux(torch.nn.Linear(2, 2), impl="reference", emulated_ranks=2)
    x = _inputs(4, 4, 5)
    handle = dit.parallelize_flux(model, impl="reference", emulated_ranks=2)
    bad = dict(x, img_ids=x["img_ids"][:-1])
    with pytest.raises(ValueError, match="img_ids"), torch.no_grad():
        model(**bad)
    handle.remove()
    # The processor alone, on a shard whose rotary rows do not match its tokens.
    proc = dit.UlyssesFluxAttnProcessor(impl="reference")
    attn = model.transformer_blocks[0].attn
    hs, enc = torch.randn(1, 8, attn.query_dim), torch.randn(1, 3, attn.query_dim)
    rot = model.pos_embed(torch.zeros(16 + 3, 3))
    with pytest.raises(ValueError, match="image_rotary_emb"), torch.no_grad():
        proc(attn, hs, enc, image_rotary_emb=rot)
    with pytest.raises(ValueError, match="attention_mask"), torch.no_grad():
        proc(attn, hs, enc, attention_mask=torch.ones(1, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="text_len"), torch.no_grad():
        proc(model.single_transformer_blocks[0].attn, hs)
