"""Shared test set-up.

Without a GPU, kernels are compiled for sm_90a against fake tensors (the CPU tier that CI runs):
the CuTe DSL and FlashAttention-4 read these variables at import time, so they are set here,
before any test module imports them.
The compile cache on disk (cute_kernels.compile_cache) goes to a folder of this test session
(shared with the rank processes the tests spawn), not to the user's cache, unless
FA_A2A_CACHE_DIR is set.
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if "FA_A2A_CACHE_DIR" not in os.environ:
    os.environ["FA_A2A_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa_a2a_test_cache_")
    atexit.register(shutil.rmtree, os.environ["FA_A2A_CACHE_DIR"], ignore_errors=True)
if not HAS_CUDA:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "90")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 GPUs, found {n_gpus}")
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}gpu{os.sep}" in path and n_gpus < 1:
            item.add_marker(skip_gpu)
        if f"{os.sep}multigpu{os.sep}" in path and n_gpus < 2:
            item.add_marker(skip_multi)
