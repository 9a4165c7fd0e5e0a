"""The delivery of a real rank's output (fa_a2a.engine.forward: out-slots instead of a copy), on CPU: the
slot the ranks agree on, which slots a rank offers (lent outputs alive, CUDA graphs owning slots),
and the transport's lent tensors. The kernels' side (real ranks on a GPU) is tests/gpu/test_delivery_gpu.py."""
import pytest
import torch

from fa_a2a.engine.forward import Slots, common_slot
from ulysses.env import MAX_OUT_SLOTS, OUT_SLOTS, out_slots as out_slots_setting
from ulysses.transport import EmulatedTransport

SHAPE = (1, 4, 2, 8)  # B, S_loc, H_pad, D


def test_the_ranks_take_the_lowest_slot_free_on_every_rank():
    assert common_slot([0b1110, 0b1110]) == 1
    assert common_slot([0b1100, 0b0110, 0b1111_0100]) == 2
    assert common_slot([0b1000, 0b0100]) == 0  # nothing free everywhere: the staging window
    assert common_slot([0, 0b1110]) == 0  # a rank offering nothing (a capture, or slots off)
    assert common_slot([1 << MAX_OUT_SLOTS]) == MAX_OUT_SLOTS


def test_the_slot_count_setting_is_bounded_and_named():
    assert out_slots_setting({}) == OUT_SLOTS and out_slots_setting({"FA_A2A_OUT_SLOTS": "0"}) == 0
    assert out_slots_setting({"FA_A2A_OUT_SLOTS": str(MAX_OUT_SLOTS)}) == MAX_OUT_SLOTS
    for bad in ("-1", str(MAX_OUT_SLOTS + 1), "two", ""):
        with pytest.raises(ValueError, match=r"^FA_A2A_OUT_SLOTS: expected an int in \[0, 16\], got"):
            out_slots_setting({"FA_A2A_OUT_SLOTS": bad})


class _Channel:
    """The other rank's free-slot mask, and what this rank sent."""

    def __init__(self, other: int):
        self.other, self.sent = other, []

    def exchange(self, word: int) -> list:
        self.sent.append(word)
        return [word, self.other]


class _Plan:
    """A WindowPlan's out-slots (Slots) over a CPU transport of 2 ranks (this process is rank 0), as the
    tests below name them."""

    def __init__(self, slots=3, other=0b1110, family=(("ulysses.out", SHAPE),)):
        self.transport = EmulatedTransport(2, "cpu")
        self.transport.local_ranks = (0,)
        self.out = Slots(self.transport, family, torch.float32, slots, _Channel(other))

    def free_slots(self, capture):
        return self.out.free(capture)

    def choose_slot(self):
        return self.out.choose()

    def slot_window(self, j):
        return self.out.windows(j)[0]


_plan = _Plan


def test_an_eager_call_offers_unallocated_slots_and_a_capture_only_allocated_ones():
    plan = _plan()
    assert plan.free_slots(None) == 0b1110 and plan.free_slots(capture=7) == 0
    assert plan.choose_slot() == 1 and plan.out.channel.sent == [0b1110]
    w = plan.slot_window(1)  # allocated when first used
    assert w.shape == (2, *SHAPE) and plan.slot_window(1) is w
    assert plan.slot_window(0) is plan.transport.allocated("ulysses.out", SHAPE, torch.float32)
    assert plan.free_slots(capture=7) == 0b0010  # now allocated: a capture may take it


def test_a_slot_is_offered_again_once_every_view_of_its_output_is_gone():
    plan = _plan()
    w = plan.slot_window(1)
    out = plan.transport.lend(w[0][:, :3])
    assert out.data_ptr() == w[0].data_ptr() and out.shape == (1, 3, 2, 8)
    view = out[:, 1:]
    del out
    assert plan.free_slots(None) == 0b1100  # a view keeps the output (its storage) alive
    assert plan.choose_slot() == 2  # the other rank offered 1, 2, 3: the lowest free on both
    del view
    assert plan.free_slots(None) == 0b1110
    with pytest.raises(ValueError, match="^view: expected a contiguous view"):
        plan.transport.lend(w[0][:, :, :1])


def test_a_set_of_several_windows_is_free_only_when_none_is_lent():
    """The fused backward's sets (dq, dk, dv windows): any one lent tensor alive holds the whole set."""
    family = (("ulysses.dq", SHAPE), ("ulysses.dk", (1, 4, 1, 8)), ("ulysses.dv", (1, 4, 1, 8)))
    plan = _plan(family=family)
    dq, dk, dv = plan.out.windows(1)
    assert [w.shape[1:] for w in (dq, dk, dv)] == [SHAPE, (1, 4, 1, 8), (1, 4, 1, 8)]
    assert plan.transport.allocated("ulysses.dv.1.1x4x2x8-1x4x1x8-1x4x1x8", (1, 4, 1, 8), torch.float32) is dv
    lent = plan.transport.lend(dv[0])
    assert plan.free_slots(None) == 0b1100
    del lent
    lent = [plan.out.lend_or_copy(1, w[0]) for w in (dq, dk)] + [plan.out.lend_or_copy(0, dv[0])]
    assert [t.data_ptr() for t in lent] == [dq[0].data_ptr(), dk[0].data_ptr(), lent[2].data_ptr()]
    assert lent[2].data_ptr() != dv[0].data_ptr()  # the staging set: copied out
    assert plan.out.lend_or_copy(1, dq[0][:, :, :1]).data_ptr() != dq[0].data_ptr()  # not contiguous: copied
    assert plan.free_slots(None) == 0b1100
    lent.pop(0)
    assert plan.free_slots(None) == 0b1100  # dk still lent
    lent.clear()
    assert plan.free_slots(None) == 0b1110


def test_sets_that_share_a_window_shape_share_no_window():
    """Two layers whose gradient sets agree in dk, dv's shape but not dq's (or the reverse): their sets j are
    other windows, so one's lent grads hold only its own set (a shared dk window would have been offered by
    the other's free() and overwritten; a shared dq with another dk failed to find its dk)."""
    a = _plan(family=(("ulysses.dq", SHAPE), ("ulysses.dk", (1, 4, 1, 8)), ("ulysses.dv", (1, 4, 1, 8))))
    b = Slots(a.transport, (("ulysses.dq", (1, 4, 1, 8)), ("ulysses.dk", (1, 4, 1, 8)),
                            ("ulysses.dv", (1, 4, 1, 8))), torch.float32, 3, _Channel(0b1110))
    c = Slots(a.transport, (("ulysses.dq", SHAPE), ("ulysses.dk", (1, 4, 2, 8)), ("ulysses.dv", (1, 4, 2, 8))),
              torch.float32, 3, _Channel(0b1110))
    held = a.transport.lend(b.windows(1)[1][0])  # b's dk of set 1, alive
    assert b.free(None) == 0b1100 and a.free_slots(None) == 0b1110 and c.free(None) == 0b1110
    ptrs = {w.data_ptr() for s in (a.out, b, c) for w in s.windows(1)}
    assert len(ptrs) == 9  # three sets 1, nine windows
    del held


def test_a_lent_tensor_is_the_window_memory_in_the_windows_dtype_and_shape():
    t = EmulatedTransport(2, "cpu")
    w = t.windows("ulysses.out.1", SHAPE, torch.bfloat16)
    w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    view = w[1][:, 1:3]
    lent = t.lend(view)
    assert (lent.dtype, lent.shape, lent.stride(), lent.data_ptr()) == (view.dtype, view.shape, view.stride(),
                                                                        view.data_ptr())
    assert torch.equal(lent, view) and lent.untyped_storage().data_ptr() == view.data_ptr()
    lent.fill_(7)  # the same memory: a write through it shows in the window
    assert bool((w[1][:, 1:3] == 7).all()) and not bool((w[1][:, :1] == 7).any())


def test_a_captured_slot_belongs_to_its_graph():
    plan = _plan()
    a = plan.slot_window(1)[0].data_ptr()
    plan.slot_window(2)
    plan.transport.captured[a] = 5  # a capture with id 5 chose slot 1: its graph owns it
    assert plan.free_slots(None) == 0b1100  # eager calls: not slot 1
    assert plan.free_slots(capture=5) == 0b0110  # the same capture again: slot 1 (its output dropped), 2
    assert plan.free_slots(capture=6) == 0b0100  # another capture: only the free allocated slot 2


def test_slots_off_still_exchange_so_that_the_ranks_meet():
    plan = _plan(slots=0, other=0b10)
    assert plan.choose_slot() == 0 and plan.out.channel.sent == [0]
    plan.out.channel = None  # emulated ranks: no exchange, the staging window
    assert plan.choose_slot() == 0


def test_emulated_ranks_choose_a_set_free_for_every_rank_without_an_exchange():
    """One process holds all P emulated ranks' windows: a set is free when no rank's lent tensor is alive,
    and the lowest such set is every rank's choice (no channel)."""
    t = EmulatedTransport(3, "cpu")
    out = Slots(t, (("ulysses.out", SHAPE),), torch.float32, 3, None)
    assert out.choose() == 1
    held = t.lend(out.windows(1)[0][2][:, :2])  # rank 2's output of set 1, alive
    assert out.free(None) == 0b1100 and out.choose() == 2
    again = t.lend(out.windows(2)[0][0])  # rank 0's of set 2
    assert out.choose() == 3
    del held
    assert out.choose() == 1
    del again
    assert Slots(t, (("ulysses.out", SHAPE),), torch.float32, 0, None).choose() == 0  # slots off: staging


def test_the_lowest_free_set_alone_is_the_full_masks_lowest():
    t = EmulatedTransport(2, "cpu")
    out = Slots(t, (("ulysses.out", SHAPE),), torch.float32, 4, None)
    held = [t.lend(out.windows(j)[0][1]) for j in (1, 3)]
    t.captured[out.windows(2)[0][0].data_ptr()] = 9  # set 2: another graph's
    for capture in (None, 9, 4):
        full = out.free(capture)
        assert out.free(capture, lowest=True) == (full & -full), capture
    assert out.free(None) == 0b10000 and out.free(9) == 0b00100 and out.free(4) == 0
    del held
