"""Ulysses sequence parallelism: layouts, transports and the serial reference."""
from .layout import (UlyssesLayout, gather_heads, gather_seq, head_to_seq, seq_to_head, split_seq,
                     take_heads)
from .reference import (emulated_post_a2a, emulated_pre_a2a, emulated_ulysses_attention,
                        full_attention, local_attention, ulysses_reference_attention)

__all__ = [
    "UlyssesLayout", "take_heads", "seq_to_head", "head_to_seq", "gather_heads", "split_seq",
    "gather_seq", "local_attention", "full_attention", "emulated_pre_a2a", "emulated_post_a2a",
    "emulated_ulysses_attention", "ulysses_reference_attention",
]
