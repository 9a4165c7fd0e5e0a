"""The README's "Use it in your DiT" snippet as written: its python block, run by 2 rank processes
sharing one GPU with `model` a tiny Flux (tests/gpu/test_dit.py's); under it the model's output is
the single-device output within FA4's bf16 rule and every self-attention took the fa-a2a backend's
Ulysses route. (Shims as test_dit.py's: the output gather through host memory, warning_once.)"""
import logging
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.test_dit import _errors, _flux, _flux_inputs, _on  # noqa: E402
from tests.multiproc import run_on_gloo_groups  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_dit_snippet() -> str:
    section = README.read_text().split("## Use it in your DiT", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_snippet(P, group, rank):
    import copy

    from fa_a2a.models import diffusers_backend as backend
    from ulysses.transport import close_transports

    backend.gather_cuda_over_gloo()
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = logging.Logger.warning
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = _flux().eval().to("cuda", torch.bfloat16)
    x = _flux_inputs(torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).float()(**_on(x, torch.float32), return_dict=False)[0]
    base = model(**_on(x, torch.bfloat16), return_dict=False)[0]
    exec(readme_dit_snippet(), {"model": model})  # noqa: S102 - the README's own lines
    backend.route_counts("fa_a2a", reset=True)
    out = model(**_on(x, torch.bfloat16), return_dict=False)[0]
    counts = backend.route_counts("fa_a2a")
    assert counts == {"ulysses": 4}, counts  # Flux: 2 double- + 2 single-stream blocks
    e = _errors(out, base, ref)
    assert torch.isfinite(out).all() and e["max_err"] <= 2 * e["base_max_err"] + e["atol"], e
    torch.cuda.synchronize()
    close_transports()


def test_readme_snippet_runs_flux_on_the_fused_backend(monkeypatch):
    monkeypatch.setenv("FA_A2A_TIMEOUT_S", "300")
    run_on_gloo_groups(_run_snippet, (2,), cuda=True, timeout_s=300)
