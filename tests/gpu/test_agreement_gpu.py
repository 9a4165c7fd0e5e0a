"""Every call agreed across ranks on the kernel impls: fused and serial, 2 and 3 rank processes on
GPU 0 (under CUDA MPS where it can start). The cases of tests/cpu/test_agreement.py: ranks that
swap known signatures, one rank with a new one, a rank's own refusal, different group objects;
each must end in the same named ValueError on every rank within seconds, under a hard deadline."""

import contextlib

import pytest

from fa_a2a.tools.mps import MpsUnavailableError, mps_available, mps_daemon
from tests.cpu import test_agreement as cases


@contextlib.contextmanager
def _maybe_mps():
    with contextlib.ExitStack() as stack:
        if mps_available():
            try:
                stack.enter_context(mps_daemon())
            except MpsUnavailableError:
                pass  # time-sliced ranks: slower, still correct
        yield


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("impl", ["fused", "serial"])
@pytest.mark.parametrize("case", [cases._swapped_known_signatures, cases._one_rank_changes,
                                  cases._one_rank_refuses_locally, cases._different_groups],
                         ids=["swapped", "one_rank_changes", "local_refusal", "different_groups"])
def test_kernel_impls_refuse_disagreeing_ranks(case, impl, P):
    with _maybe_mps():
        cases.run_with_deadline(case, P, impl, cuda=True)
