"""The compile cache on disk (cute_kernels.compile_cache): kernels compiled for sm_90a against fake
tensors (no GPU) are stored, found again by fresh processes (also two racing for one entry),
keyed by arguments and sources, and skipped with the switch off. Whether a loaded entry launches
is checked on a GPU by examples/first_call_time.py."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cute_kernels import compile_cache as C
from cute_kernels.signal import compile_barrier
from tests.helpers import repo_env

ROOT = Path(__file__).resolve().parents[2]
HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None  # entries linked into shared libraries

# One fresh process: the barrier first (the first compile or load of a process pays one-time
# costs), then the timed kernel. Prints "<barrier loads> <post_a2a loads> <post_a2a seconds>
# <whether FA4's package, quack or torch._dynamo got imported>".
_CHILD = """
import sys, time, torch
from cute_kernels.a2a import compile_post_a2a
from cute_kernels.signal import compile_barrier
compile_barrier(3, 1)
t = time.perf_counter()
compile_post_a2a(torch.bfloat16, 64, 3, True)
dt = time.perf_counter() - t
heavy = int(any(m in sys.modules for m in ("flash_attn.cute", "quack", "torch._dynamo")))
print(compile_barrier.cache_info().loads, compile_post_a2a.cache_info().loads, dt, heavy)
"""


def _child(cache: Path) -> subprocess.Popen:
    env = repo_env(FA_A2A_CACHE_DIR=str(cache), FA_A2A_CACHE="1")
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc: subprocess.Popen) -> tuple:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    barrier, post, seconds, heavy = out.split()[-4:]
    return int(barrier), int(post), float(seconds), heavy == "1"


def _entries(cache: Path, pattern: str = "*") -> list:
    return sorted(p.relative_to(cache) for p in cache.rglob(pattern) if p.is_file())


def test_racing_processes_store_one_entry_that_a_fresh_process_loads(tmp_path):
    racers = [_child(tmp_path), _child(tmp_path)]  # start at once on an empty cache
    raced = [_result(p) for p in racers]
    objects = _entries(tmp_path, "*.o")
    assert [p.parent.name for p in objects] == ["compile_barrier", "compile_post_a2a"], objects
    assert all((tmp_path / p).stat().st_size > 0 for p in objects)
    if HAS_CC:
        assert [p.with_suffix(".o") for p in _entries(tmp_path, "*.so")] == objects, "an entry without its library"
    assert not [p for p in _entries(tmp_path) if p.suffix not in (".o", ".so", ".lock")], "temporary files left"
    compiled = [seconds for _, loads, seconds, _ in raced if loads == 0]
    assert compiled, "neither racer compiled compile_post_a2a"

    barrier, post, warm, heavy = _result(_child(tmp_path))
    assert (barrier, post) == (1, 1), "the fresh process compiled instead of loading"
    assert not heavy, "a warm process imported FA4's package, quack or torch._dynamo (~2 s) to load its kernels"
    assert warm < min(compiled) / 5, f"load {warm:.3f} s, compile {min(compiled):.3f} s"


def _fresh_barrier():
    """compile_barrier with its own memory (same name, so the same disk entries)."""
    return C.disk_cache(compile_barrier.__wrapped__)


def test_keys_follow_the_arguments_with_defaults_applied(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    fn = _fresh_barrier()
    fn(2, 1)
    fn(2)  # same key: the default num_local = 1
    fn(2, num_local=1, extra_options="")
    assert fn.cache_info()[:2] == (2, 1)
    fn(3, 1)
    assert len(_entries(tmp_path, "*.o")) == 2
    again = _fresh_barrier()
    again(3)
    assert again.cache_info().loads == 1


def test_keys_follow_the_compile_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    settings = C._compile_settings()
    assert "('CUTE_DSL_ARCH', 'sm_90a')" in settings
    _fresh_barrier()(2, 1)
    monkeypatch.setattr(C, "_compile_settings", lambda: settings.replace("sm_90a", "sm_100a"))
    other = _fresh_barrier()
    other(2, 1)  # same arguments, another target: compiled, a second entry
    assert other.cache_info().loads == 0 and len(_entries(tmp_path, "*.o")) == 2


def test_fingerprint_follows_the_sources(tmp_path):
    (tmp_path / "pkg").mkdir()
    src = tmp_path / "pkg" / "kernel.py"
    src.write_text("X = 1\n")
    one = tmp_path / "one.py"
    one.write_text("Y = 1\n")
    base = C.source_fingerprint((tmp_path / "pkg", one))
    src.write_text("X = 2\n")
    assert C.source_fingerprint((tmp_path / "pkg", one)) == base  # cached for the process
    C.source_fingerprint.cache_clear()
    edited = C.source_fingerprint((tmp_path / "pkg", one))
    one.write_text("Y = 2\n")
    C.source_fingerprint.cache_clear()
    assert len({base, edited, C.source_fingerprint((tmp_path / "pkg", one))}) == 3
    (tmp_path / "pkg" / "new.py").write_text("")
    C.source_fingerprint.cache_clear()
    assert C.source_fingerprint((tmp_path / "pkg", one)) not in {base, edited}
    C.source_fingerprint.cache_clear()


def test_project_sources_are_in_the_fingerprint():
    """The kernels' sources and compile functions (cute_kernels, fa4.py among them), FA4's and quack's:
    nothing of fa_a2a, so an edit to its runtime or tools keeps every cached kernel."""
    roots = C._source_roots()
    names = {Path(r).name for r in roots}
    assert names == {"cute_kernels", "cute", "quack"}
    assert all(Path(r).exists() for r in roots) and (Path(roots[0]) / "fa4.py").exists()


def test_entries_are_named_as_fa4s_store_names_them(tmp_path):
    """The warm path loads entries itself (without FA4's package): its naming must be FA4's."""
    from flash_attn.cute.cache_utils import JITPersistentCache

    store = JITPersistentCache(tmp_path)
    key = ("compile_barrier", (2, 1), "settings", torch.bfloat16)
    assert C._entry_file(tmp_path, key) == tmp_path / f"{store._key_to_hash(key)}.o"
    assert C._EXPORTED_NAME == JITPersistentCache.EXPORT_FUNCTION_PREFIX


def test_source_roots_are_found_without_importing_the_packages():
    code = ("import sys; from cute_kernels.compile_cache import _source_roots; _source_roots(); "
            "print(sorted(m for m in ('flash_attn.cute', 'quack') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=repo_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]"


def test_disk_values_are_kept_beside_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    calls = []

    def table(d, causal):
        calls.append((d, causal))
        return (d, 2 * d, causal)

    assert C.disk_value(table)(64, True) == (64, 128, True)
    (entry,) = _entries(tmp_path, "*.pkl")
    assert entry.parent.name.endswith("table") and entry.parent.parent.name == C.source_fingerprint(C._source_roots())[:32]
    assert C.disk_value(table)(64, True) == (64, 128, True)  # a fresh process: read, not computed
    assert calls == [(64, True)]
    (tmp_path / entry).write_bytes(b"junk")  # unreadable: computed again and replaced
    assert C.disk_value(table)(64, True) == (64, 128, True) and len(calls) == 2
    assert C.disk_value(table)(64, True) == (64, 128, True) and len(calls) == 2
    monkeypatch.setenv(C.ENV_SWITCH, "0")
    assert C.disk_value(table)(32, False) == (32, 64, False) and len(calls) == 3
    assert len(_entries(tmp_path, "*.pkl")) == 1
    assert not [p for p in _entries(tmp_path) if p.name.endswith(".tmp")]


def test_fa4_tile_table_is_fa4s_own(tmp_path, monkeypatch):
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    from cute_kernels.fa4 import fa4_sm90_config

    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    fa4_sm90_config.cache_clear()
    for d in (64, 128):
        cfg = _tile_size_fwd_sm90(d, d, False, False)
        assert fa4_sm90_config(d, False) == (cfg.m_block_size, cfg.n_block_size, cfg.intra_wg_overlap,
                                             cfg.mma_pv_is_rs)
    fa4_sm90_config.cache_clear()


def test_unloadable_entry_is_recompiled_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    _fresh_barrier()(2, 1)
    (entry,) = [tmp_path / p for p in _entries(tmp_path, "*.o")]
    shared = entry.with_suffix(".so")
    good, good_shared = entry.read_bytes(), shared.read_bytes() if HAS_CC else b""
    _replace(entry, good[:100])  # truncated writes
    if HAS_CC:
        _replace(shared, good_shared[:100])
    C._store.cache_clear()  # a fresh process's store
    fn = _fresh_barrier()
    fn(2, 1)
    assert fn.cache_info().loads == 0
    assert entry.stat().st_size == len(good) and (not HAS_CC or shared.stat().st_size == len(good_shared))
    C._store.cache_clear()
    again = _fresh_barrier()
    again(2, 1)
    assert again.cache_info().loads == 1


def _replace(path: Path, data: bytes) -> None:
    """Write a file as a new one (a library this process has loaded stays mapped as it was)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# A fresh process loads the barrier's entry: prints whether it was loaded, the function's type and
# which of the CuTe DSL, FA4's package and quack it imported.
_WARM_CHILD = """
import sys
from cute_kernels import compile_cache as C
fn, loaded = C.load_or_compile("compile_barrier", (2, 1, ""), lambda: sys.exit("compiled"))
imported = ",".join(m for m in ("cutlass", "flash_attn.cute", "quack") if m in sys.modules)
print(loaded, type(fn).__name__, imported or "-")
"""


def _warm_child() -> tuple:
    out = subprocess.run([sys.executable, "-c", _WARM_CHILD], cwd=ROOT, env=repo_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return tuple(out.stdout.split("\n")[-2].split(" "))


def test_warm_entries_load_without_the_cute_dsl(tmp_path, monkeypatch):
    """A fresh process finds a compiled entry through its shared library: a TVM-FFI function, and
    neither the CuTe DSL nor FA4's package imported. A library that does not load: the object file
    loads through the DSL and the library is linked again. Without a C compiler the entry is
    object-only and loads through the DSL."""
    if not HAS_CC:
        pytest.skip("no C compiler ($CC, cc) links the entries here")
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    _fresh_barrier()(2, 1)
    assert _warm_child() == ("True", "Function", "-")
    (shared,) = [tmp_path / p for p in _entries(tmp_path, "*.so")]
    good = shared.read_bytes()
    _replace(shared, good[:100])
    assert _warm_child() == ("True", "Function", "cutlass")
    assert shared.read_bytes() == good
    assert _warm_child() == ("True", "Function", "-")

    no_cc = tmp_path / "no_cc"
    monkeypatch.setenv(C.ENV_DIR, str(no_cc))
    monkeypatch.setenv("CC", str(tmp_path / "absent-cc"))
    _fresh_barrier()(2, 1)
    assert _entries(no_cc, "*.o") and not _entries(no_cc, "*.so")
    again = _fresh_barrier()
    again(2, 1)
    assert again.cache_info().loads == 1


def test_switch_off_and_extra_options_skip_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "0")
    fn = _fresh_barrier()
    fn(2, 1)
    assert fn.cache_info().misses == 1 and not list(tmp_path.iterdir())

    calls = []

    @C.disk_cache
    def compile_thing(n, extra_options=""):
        calls.append(n)
        return n

    monkeypatch.setenv(C.ENV_SWITCH, "1")
    monkeypatch.setattr(C, "load_or_compile", lambda *a: pytest.fail("extra_options went to the disk"))
    assert compile_thing(1, "--keep-ptx") == 1 and compile_thing(1, "--keep-ptx") == 1
    assert calls == [1]


def test_bad_switch_and_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(C.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="FA_A2A_CACHE: expected 0 .* got 'yes'"):
        C.enabled()
    monkeypatch.delenv(C.ENV_SWITCH)
    assert C.enabled()
    monkeypatch.delenv(C.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert C.cache_dir() == tmp_path / "fa_a2a"
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(C.ENV_DIR, str(blocker))  # a file where the folder should be
    fn = _fresh_barrier()
    with pytest.warns(RuntimeWarning, match="compiling in memory only"):
        fn(2, 1)
    assert fn.cache_info().loads == 0 and blocker.is_file()


def test_unhashable_argument_is_refused():
    with pytest.raises(TypeError):
        _fresh_barrier()([2], 1)


def test_projection_gemm_goes_through_the_disk(tmp_path, monkeypatch):
    """compile_projection keeps its in-memory lru_cache; its GEMM is a disk entry."""
    import cute_kernels.qkv_a2a_sm90 as K

    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    args = (torch.float16, 128, 64, None, False, False, K.GemmConfig(tile_n=128), False)
    first = K.compile_projection.__wrapped__(*args)
    assert [p.parent.name for p in _entries(tmp_path, "*.o")] == ["compile_projection"]
    t = time.perf_counter()
    again = K.compile_projection.__wrapped__(*args)
    assert time.perf_counter() - t < 1.0
    assert again.fields == first.fields and again.cluster_size == first.cluster_size


def test_the_launch_paths_import_no_cute_dsl():
    """What a warm process imports to launch the op's and the block's kernels (the op, its forwards
    and pacing, the A2A and barrier launchers, FA4's launcher, the transports; the block and the
    QKV projection's launcher) imports neither the CuTe DSL nor FA4's package nor quack: with every
    kernel in the disk cache it never needs them."""
    code = ("import sys, fa_a2a, fa_a2a.op, fa_a2a.engine.forward, fa_a2a.engine.pacing, cute_kernels.fa4, cute_kernels.a2a, "
            "cute_kernels.signal, ulysses.transport, ulysses.vmm, fa_a2a.block, cute_kernels.qkv_a2a_sm90\n"
            "print(','.join(m for m in ('cutlass', 'flash_attn.cute', 'quack') if m in sys.modules) or '-')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=repo_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "-"


def test_lock_paths_that_are_folders_and_a_blank_folder_setting(tmp_path, monkeypatch):
    """A hostile pass (2026-12-05): lock paths that are folders raised IsADirectoryError from inside the
    store (only opening the store was guarded); FA_A2A_CACHE_DIR of blanks made a folder named by them."""
    monkeypatch.setenv(C.ENV_SWITCH, "1")
    monkeypatch.setenv(C.ENV_DIR, str(tmp_path))
    C._warn_once.cache_clear()
    fn = _fresh_barrier()
    bound = C.inspect.signature(compile_barrier.__wrapped__).bind(2, 1)
    bound.apply_defaults()
    folder = C.entry_folder("compile_barrier")
    entry = C._entry_file(folder, ("compile_barrier", tuple(bound.arguments.values()), C._compile_settings()))
    folder.mkdir(parents=True)
    (folder / (entry.name + ".lock")).mkdir()
    (folder / (entry.stem + ".lock")).mkdir()
    with pytest.warns(RuntimeWarning, match="fa_a2a compile cache: cannot"):
        fn(2, 1)
    assert fn.cache_info().loads == 0
    monkeypatch.setenv(C.ENV_DIR, "  ")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.cache_dir() == tmp_path / "xdg" / "fa_a2a"
