"""Device-initiated Ulysses all-to-all copies, host side: PreA2A (sequence -> head layout, q, k, v
in one launch) and PostA2A (head -> sequence layout, or an all-gather of heads) compiled once
through the disk cache and launched through checked launchers. The kernels, their row conventions
and measured speed: cute_kernels.a2a_device. Nothing here imports the CuTe DSL at module level:
a process whose kernels are all in the disk cache launches them without it (compile_cache).
"""

from __future__ import annotations

from cute_kernels.compile_cache import disk_cache
from cute_kernels.limits import aligned16


@disk_cache
def compile_pre_a2a(torch_dtype, head_dim: int, world_size: int, has_joint: bool, extra_options: str = ""):
    """The compiled PreA2A for (dtype, D, P, joint); fake tensors, so no GPU is needed.

    The arguments are the cache key; extra_options (e.g. "--keep-ptx --dump-dir=DIR") are passed
    to the compiler."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_kernels.a2a_device import PreA2A, cute_dtype, fake_tensor, vec_elems

    dtype = cute_dtype(torch_dtype)
    div = vec_elems(dtype)
    kernel = PreA2A(dtype, head_dim, world_size, has_joint)
    sym = cute.sym_int
    src = lambda: fake_tensor(dtype, (sym(), sym(), sym(), head_dim), div)  # noqa: E731
    dst = lambda: fake_tensor(dtype, (world_size, sym(), sym(), sym(), head_dim), div)  # noqa: E731
    maps = [fake_tensor(Int32, (sym(),), 1) for _ in range(2)]
    joint = [src() for _ in range(3)] if has_joint else [None] * 3
    return cute.compile(
        kernel, src(), src(), src(), dst(), dst(), dst(), *maps, *joint, *[Int32(0)] * 5,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi {extra_options}".strip(),
    )


@disk_cache
def compile_post_a2a(torch_dtype, head_dim: int, world_size: int, broadcast: bool = False,
                     extra_options: str = ""):
    """The compiled PostA2A for (dtype, D, P, broadcast); see compile_pre_a2a."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_kernels.a2a_device import PostA2A, cute_dtype, fake_tensor, vec_elems

    dtype = cute_dtype(torch_dtype)
    div = vec_elems(dtype)
    kernel = PostA2A(dtype, head_dim, world_size, broadcast)
    sym = cute.sym_int
    mO = fake_tensor(dtype, (sym(), sym(), sym(), head_dim), div)
    mOut = fake_tensor(dtype, (world_size, sym(), sym(), sym(), head_dim), div)
    return cute.compile(
        kernel, mO, mOut, Int32(0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi {extra_options}".strip(),
    )


def _aligned(t, name: str):
    """16-byte vectors need a 16-byte aligned base, contiguous last dim, 16-byte-multiple strides
    (cute_kernels.limits.aligned16)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim, got strides {tuple(t.stride())}")
    if not aligned16(t):
        raise ValueError(f"{name}: expected base address and strides in multiples of 16 bytes, got address "
                         f"{t.data_ptr():#x} and strides {tuple(t.stride())} ({t.element_size()}-byte elements)")


def pre_a2a_launcher(dq, dk, dv, q_map, kv_map, rank: int, seq_len: int, key_rows, has_joint: bool):
    """PreA2A into these windows, checked and compiled once -> launch(q, k, v, joint=None) on the
    current stream. The sources q, k, v (and joint) change per call and are not checked there:
    the caller passes 16-byte-aligned tensors (fa_a2a.engine.forward.contiguous16 makes them so)."""
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        _aligned(t, name)
    compiled = compile_pre_a2a(dq.dtype, dq.shape[-1], dq.shape[0], has_joint)
    key_rows = tuple(int(r) for r in key_rows)

    def launch(q, k, v, joint=None) -> None:
        jq, jk, jv = joint if joint is not None else (None, None, None)
        compiled(q, k, v, dq, dk, dv, q_map, kv_map, jq, jk, jv, rank, seq_len, *key_rows)

    return launch


def launch_pre_a2a(q, k, v, dq, dk, dv, q_map, kv_map, rank: int, seq_len: int, key_rows, joint=None) -> None:
    """Launch PreA2A on the current stream (shapes are checked by the caller, fa_a2a.op).

    key_rows: (valid rows of this rank's shard, head-layout row of its first valid key, of its first
    padded key): ulysses.layout.UlyssesLayout.key_rows(rank) with the valid-row count in front."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _aligned(t, name)
    if joint is not None:
        for name, t in zip(("joint q", "joint k", "joint v"), joint):
            _aligned(t, name)
    pre_a2a_launcher(dq, dk, dv, q_map, kv_map, rank, seq_len, key_rows, joint is not None)(q, k, v, joint)


def post_a2a_launcher(o, out_windows, rank: int, broadcast: bool = False):
    """PostA2A from o into these windows, checked and compiled once -> launch(src=o) on the current
    stream; src: o or a tensor of o's shape, dtype and strides with a 16-byte aligned base (a fresh
    torch.empty_like of a contiguous o; the caller keeps to that: not checked per launch)."""
    _aligned(o, "o")
    _aligned(out_windows, "out_windows")
    kernel = compile_post_a2a(o.dtype, o.shape[-1], out_windows.shape[0], broadcast)

    def launch(src=o) -> None:
        kernel(src, out_windows, rank)

    return launch


def launch_post_a2a(o, out_windows, rank: int, broadcast: bool = False) -> None:
    """Launch PostA2A on the current stream (shapes are checked by the caller, fa_a2a.op)."""
    post_a2a_launcher(o, out_windows, rank, broadcast)()
