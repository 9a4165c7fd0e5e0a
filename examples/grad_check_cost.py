"""Host cost of the op's one requires_grad check (issue 39), against the check it replaced.

An eager ulysses_attention call without inputs that require grad pays fa_a2a.engine.backward.wants_grad
once (then today's forward); before issue 39 it paid problem.check_no_grad (HEAD 08cc0e5, copied
below). Both timed with timeit on the calling thread, best of 7 x 200k calls, the cost of calling
an empty lambda subtracted. Measured on the 2-core CPU dev machine (2026-12-04), three runs (its
speed varies by ~2x between runs): grad mode on, inputs without grad: before 319 / 470 / 312 ns,
after 349 / 278 / 218 ns; under torch.no_grad(): before 96 / 87 / 67 ns, after 54 / 75 / 113 ns.

    python examples/grad_check_cost.py
"""

import timeit

import torch

from fa_a2a.engine.backward import wants_grad


def check_no_grad(*tensors) -> None:
    """fa_a2a.engine.problem.check_no_grad before issue 39 (its refusal message shortened)."""
    if not torch.is_grad_enabled():
        return
    for name, t in zip(("q", "k", "v", "joint[0] (q)", "joint[1] (k)", "joint[2] (v)"), tensors):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name}: requires grad")


def main(n: int = 200_000, repeat: int = 7) -> None:
    q, k, v = (torch.randn(1, 8, 4, 8) for _ in range(3))
    for label, mode in (("grad mode, inputs without grad", torch.enable_grad), ("no_grad", torch.no_grad)):
        with mode():
            best = {name: min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e9
                    for name, fn in (("before", lambda: check_no_grad(q, k, v)),
                                     ("after", lambda: wants_grad(q, k, v, None)), ("empty", lambda: None))}
        print(f"{label}: before (check_no_grad) {best['before'] - best['empty']:.0f} ns, "
              f"after (wants_grad) {best['after'] - best['empty']:.0f} ns per call")


if __name__ == "__main__":
    main()
