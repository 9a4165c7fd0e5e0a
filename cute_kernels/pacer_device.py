"""The grid-wide store pacer's device side (CuTe DSL): one thread claims the next slot and waits for
it. The state is cute_kernels.pacer's (make_pacer): int64 [3] = (TAT, dt, tau), in ns."""

import cutlass
import cutlass.cute as cute
from cutlass import Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def _red_max_s64(addr: Int64, val: Int64, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int64(val).ir_value(loc=loc, ip=ip)],
        "red.relaxed.gpu.global.max.s64 [$0], $1;", "l,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _atom_add_s64(addr: Int64, val: Int64, *, loc=None, ip=None) -> Int64:
    """atom.global.add (relaxed, gpu scope) on a 64-bit word: its old value."""
    return Int64(llvm.inline_asm(
        T.i64(), [Int64(addr).ir_value(loc=loc, ip=ip), Int64(val).ir_value(loc=loc, ip=ip)],
        "atom.relaxed.gpu.global.add.u64 $0, [$1], $2;", "=l,l,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def pace_wait(mPace: cute.Tensor, share_num: cutlass.Constexpr[int] = 1, share_den: cutlass.Constexpr[int] = 1):
    """Claim the next slot of the grid-wide pacer and wait for it (one thread): TAT is lifted to
    at least now - tau (credit for idle time is capped at the burst tolerance), then the slot is
    TAT's old value as dt is added. Two atomics, no retry loop (the same thread's accesses to one
    word stay in program order). A store of share_num / share_den of the pacer's tile bytes takes
    that share of dt (static; 1 / 1: one tile)."""
    addr = mPace.iterator.toint()
    dt = mPace[1]
    if cutlass.const_expr(share_num != share_den):
        dt = dt * share_num // share_den
    tau = mPace[2]
    now = cute.arch.globaltimer()
    _red_max_s64(addr, now - tau)
    slot = _atom_add_s64(addr, dt)
    while now < slot:
        now = cute.arch.globaltimer()
