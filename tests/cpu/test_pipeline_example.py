"""examples/pipeline.py end to end on CPU: a tiny FluxPipeline built here from random-weight
components (CLIP and T5 text encoders, tokenizers with a word-level vocabulary, a two-block VAE, a
one-block Flux transformer; nothing downloaded), saved to a folder and loaded by the example through
--model, under `torchrun --nproc-per-node=2` on CPU ranks (gloo, fp32) with impls reference and
native. Each impl's image must equal the single-device pipeline's to one level of 8 bits, and
every attention call must have taken the path the table reports (the backend's Ulysses route,
the fused processor's fallback on CPU tensors).

tiny_flux_pipeline() is also what tests/gpu/test_pipeline_example_gpu.py runs on a GPU.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from tests.helpers import repo_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "a photo of an astronaut riding horse cat dog red blue tiny".split()
# The example's flags of the runs here: 64 x 64 pixels -> 32 x 32 latents -> 16 x 16 = 256 image tokens,
# 32 text tokens.
RUN = ["--prompt", "a photo of an astronaut riding a horse", "--height", "64", "--width", "64",
       "--max-sequence-length", "32", "--seed", "3"]
STEPS = 3


def tiny_flux_pipeline(path, heads=2, head_dim=64, seed=0):
    """A FluxPipeline of random weights saved to `path` (~4 MB); returns it. heads x head_dim: the
    transformer's attention (head dim 64 or 128 for the fused kernels; P must divide heads)."""
    import tempfile

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w") as f:
            json.dump({"<|startoftext|>": 0, "<|endoftext|>": 1, **{w + "</w>": 2 + i for i, w in enumerate(WORDS)}}, f)
        with open(os.path.join(tmp, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
        tokenizer = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), model_max_length=77)
    tokenizer_2 = T5TokenizerFast(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in WORDS],
                                  extra_ids=0, model_max_length=512)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                                                num_hidden_layers=2, projection_dim=32, bos_token_id=0, eos_token_id=1,
                                                pad_token_id=1, max_position_embeddings=77))
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                             decoder_start_token_id=0))
    rope = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)  # Flux's split of the head dim over (t, h, w)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=rope)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        transformer=transformer)
    pipe.save_pretrained(path)
    return pipe


def single_device_image(path) -> np.ndarray:
    """The pipeline loaded from `path` on one CPU process, the example's arguments: uint8 pixels."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=RUN[1], height=64, width=64, max_sequence_length=32, num_inference_steps=STEPS,
                 generator=torch.Generator("cpu").manual_seed(3)).images[0]
    return np.asarray(image)


def test_tiny_pipeline_on_two_cpu_ranks_matches_one_device(tmp_path):
    model = tmp_path / "tiny-flux"
    tiny_flux_pipeline(model)
    expect = single_device_image(str(model))
    env = repo_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "examples", "pipeline.py"), "--model", str(model), "--impl", "reference", "native",
           "--steps", str(STEPS), "--warmup-steps", "1", *RUN, "--out", str(tmp_path / "out" / "img.png"),
           "--json", str(tmp_path / "table.json")]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    table = json.loads((tmp_path / "table.json").read_text())
    assert (table["world_size"], table["group"], table["steps"]) == (2, "gloo", STEPS)
    rows = {r["impl"]: r for r in table["rows"]}
    assert list(rows) == ["reference", "native"]
    calls = 2 * STEPS  # one double- and one single-stream attention per transformer call
    # the fused processor falls back on CPU tensors (diffusers' projection, then the backend), which
    # runs every call as the Ulysses op
    assert rows["reference"]["routes"] == {"fa_a2a_reference": {"ulysses": calls},
                                           "FusedFluxAttnProcessor": {"fallback": calls}}
    assert rows["native"]["routes"] == {"FusedFluxAttnProcessor": {"fallback": calls}}
    for impl, row in rows.items():
        assert row["ms_per_step"] > 0 and row["seconds"] > 0
        assert row["image"] == str(tmp_path / "out" / f"img-{impl}.png")
        from PIL import Image

        got = np.asarray(Image.open(row["image"]))
        assert got.shape == expect.shape == (64, 64, 3)
        diff = np.abs(got.astype(int) - expect.astype(int)).max()
        assert diff <= 1, f"{impl}: the 2-rank image differs from one device's by {diff} levels"
    assert "| reference |" in p.stdout and "| native |" in p.stdout and "ms/step" in p.stdout


def test_pipeline_example_refuses_one_process_and_gpu_impls_on_cpu(tmp_path):
    script = os.path.join(ROOT, "examples", "pipeline.py")
    env = repo_env(CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, script, "--model", "x"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "expected torchrun with P >= 2 ranks" in p.stderr.splitlines()[-1], p.stderr
    env["WORLD_SIZE"] = "2"
    p = subprocess.run([sys.executable, script, "--model", "x", "--device", "cpu", "--impl", "fused"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--impl: on CPU only reference native run" in p.stderr.splitlines()[-1], p.stderr
