"""Compiled kernels kept on disk, shared by the processes of a machine.

Every compile function of this project (compile_fa4, compile_pre_a2a / compile_post_a2a,
compile_barrier, the QKV projection's GEMM) compiles through the CuTe DSL with TVM-FFI, and a
TVM-FFI compiled function can be exported as an object file and loaded back in another process:
the facility FlashAttention-4 (flash_attn.cute.cache_utils) and quack (quack.cache) use for their
own kernels. The on-disk side here is FA4's JITPersistentCache: one `<sha256>.o` per key, loaded
under a shared file lock, exported under an exclusive one into a temporary file that is renamed
into place (P ranks starting at once may all compile a cold key, one export lands, the others see
it; an entry that fails to load is recompiled and replaced). Loading an entry takes milliseconds
where compiling FA4's forward takes seconds.

Beside each object file, its shared library `<sha256>.so`, linked with the C compiler ($CC, else
cc) against the DSL's runtime libraries: a TVM-FFI module that `tvm_ffi.load_module` loads
without the CuTe DSL. Importing the DSL was most of a warm process's first call (1.19 s of 1.45 s
on the H200 machine, 2026-12-03); the key below is read without it too. This CPU machine
(2026-12-04): the barrier's .so loads in 2-3 ms, `import tvm_ffi` after torch 0.03 s, `import
cutlass.cute` 0.52 s. Where no compiler links, the object file loads through the DSL as before.

What is ours is the key and the switch:

- key: the compile function's qualified name and all its arguments (defaults applied, so a
  call with and without a default argument share an entry), the DSL's compile settings (its
  CUTE_DSL_* variables: the target arch, the compiler options, debug/lineinfo, ...; without
  CUTE_DSL_ARCH the GPU's compute capability), FA4's FLASH_ATTENTION_* variables, and a
  fingerprint of everything else that changes the generated code: the Python code that runs while
  compiling (cute_kernels, whose fa4.py holds the attention kernels' compile functions, FA4's
  CuTe package, quack), the versions of the CuTe DSL, TVM-FFI, FA4, quack and torch, and the
  Python version. A change to any of them is a miss (old entries stay on disk under the old
  fingerprint's folder and can be deleted).
- folder: $FA_A2A_CACHE_DIR, else $XDG_CACHE_HOME/fa_a2a, else ~/.cache/fa_a2a.
- switch: FA_A2A_CACHE=0 turns the disk off (compiles are then cached in memory only, per
  process, as before); read at every miss, so it can change during a process.
- a call with a non-empty `extra_options` argument (e.g. "--keep-ptx --dump-dir=DIR") always
  compiles: its point is the compiler's side effects, which a load would skip.

A loaded entry is the bare TVM-FFI function (positional arguments only, all of them passed):
every launcher here calls its compiled kernel that way.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

ENV_DIR = "FA_A2A_CACHE_DIR"
ENV_SWITCH = "FA_A2A_CACHE"
_PACKAGES = ("nvidia-cutlass-dsl", "apache-tvm-ffi", "flash-attn-4", "quack-kernels", "torch")


class CacheInfo(NamedTuple):
    """functools.cache's counters, plus how many of the misses the disk cache served (not compiled)."""

    hits: int
    misses: int
    maxsize: None
    currsize: int
    loads: int


def enabled() -> bool:
    """Whether compiles go through the disk cache (FA_A2A_CACHE: unset or 1 = on, 0 = off)."""
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}: expected 0 (off) or 1 (on), got {value!r}")
    return value == "1"


def cache_dir() -> Path:
    """The cache folder (not created here)."""
    folder = os.environ.get(ENV_DIR, "").strip()  # blank: unset (not a folder named by spaces)
    if folder:
        return Path(folder).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fa_a2a"


def _package_dir(name: str) -> Path:
    """The folder of package `name`, found without running its __init__ (importing FA4's or
    quack's package costs ~2 s: both import torch._dynamo)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} not found")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _source_roots() -> tuple:
    """The Python code that runs while compiling: this package (the kernels and their compile
    functions: fa4.py, a2a.py, qkv_a2a_sm90.py, ...; kernel sources only, so an edit elsewhere in the
    tree keeps every cached kernel), FA4's CuTe package and quack. A compile function that starts
    using code outside them must add it here."""
    here = Path(__file__).resolve().parent
    return (here, _package_dir("flash_attn.cute"), _package_dir("quack"))


@functools.cache
def source_fingerprint(roots: tuple) -> str:
    """sha256 over the Python version, the versions of _PACKAGES and the .py files of `roots`
    (files, or folders searched recursively: name, length and bytes of each). Computed once per
    process per `roots`."""
    h = hashlib.sha256(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
    for name in _PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{name}={version};".encode())
    for root in map(Path, roots):
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for src in files:
            data = src.read_bytes()
            h.update(f"{root.name}/{src.relative_to(root).as_posix()}:{len(data)}:".encode())
            h.update(data)
    return h.hexdigest()


def _compile_settings() -> str:
    """What besides the arguments and the sources changes the generated code, read without
    importing the CuTe DSL (~1.2 s on the H200 machine, the most of a warm first call): every
    CUTE_DSL_* variable (the DSL's compile settings: arch, optimization, debug/lineinfo, options;
    variables that do not change the code only split the cache), FA4's FLASH_ATTENTION_* ones and,
    without CUTE_DSL_ARCH, the current GPU's compute capability (the DSL's default target). The
    DSL's own defaults come with its version (in the fingerprint). Raises RuntimeError with neither
    a GPU nor CUTE_DSL_ARCH (the compile then reports it)."""
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("CUTE_DSL_") or (k.startswith("FLASH_ATTENTION_") and "_CACHE_" not in k))
    target = None
    if "CUTE_DSL_ARCH" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no GPU and no CUTE_DSL_ARCH: no compile target")
        target = torch.cuda.get_device_capability()
    return repr((env, target))


@functools.cache
def _store(path: Path):
    from flash_attn.cute.cache_utils import JITPersistentCache

    return JITPersistentCache(path)


# FA4's JITPersistentCache names an entry f"{sha256(pickle.dumps(key))}.o" and exports its function
# as "func" (flash_attn/cute/cache_utils.py, 4.0.0b36; tests/cpu/test_compile_cache.py checks both)
_EXPORTED_NAME = "func"


def _entry_file(folder: Path, full_key: tuple) -> Path:
    return folder / f"{hashlib.sha256(pickle.dumps(full_key)).hexdigest()}.o"


@functools.cache
def _load_runtime_globally() -> None:
    """Load the CuTe DSL runtime libraries with RTLD_GLOBAL, as FA4's cache module does at its
    import: a loaded entry's object file needs their symbols (e.g. _cudaLibraryLoadData)."""
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


_loaded_modules: list = []


def _load_entry(folder: Path, full_key: tuple):
    """The exported function of full_key in folder, or None (no entry, or one that fails to load:
    FA4's store then recompiles and replaces it). The entry's shared library (`.so`, linked from
    its object file) loads through TVM-FFI alone, in milliseconds and without importing the CuTe
    DSL; without one (no linker where it was compiled, or not linked yet) the object file loads
    through the DSL and is linked for the next process. Never imports FA4's package (~2 s,
    torch._dynamo). No lock: entries are renamed into place, so a file is either absent or whole."""
    obj = _entry_file(folder, full_key)
    shared = obj.with_suffix(".so")
    if shared.is_file():
        import tvm_ffi

        try:
            module = tvm_ffi.load_module(str(shared))
            _loaded_modules.append(module)  # the library stays loaded while its function lives
            return module[_EXPORTED_NAME]
        except Exception:
            pass
    if not obj.is_file():
        return None
    import cutlass.cute as cute

    _load_runtime_globally()
    try:
        loaded = getattr(cute.runtime.load_module(str(obj), enable_tvm_ffi=True), _EXPORTED_NAME)
    except Exception:
        return None
    _link_shared(obj)
    return loaded


def _link_shared(obj: Path) -> None:
    """Link the entry's object file into its shared library (`.so` beside it, replacing one that
    did not load) with the C compiler ($CC, else cc): the DSL's runtime libraries are its
    dependencies, found through their folders. Renamed into place. Without a compiler, or when
    linking fails, the entry stays object-only (its loads import the DSL)."""
    import shutil
    import subprocess

    shared = obj.with_suffix(".so")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or not obj.is_file():
        return
    import cutlass.cute as cute

    libs = [lib for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True) if Path(lib).exists()]
    tmp = shared.with_name(f".{shared.name}.{os.getpid()}.tmp")
    rpaths = [f"-Wl,-rpath,{Path(lib).parent}" for lib in libs]
    try:
        subprocess.run([compiler, "-shared", "-o", str(tmp), str(obj), *libs, *rpaths], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, shared)
    except (OSError, subprocess.SubprocessError):
        tmp.unlink(missing_ok=True)


def entry_folder(name: str) -> Path:
    """Where the entries of compile function `name` live under the current fingerprint."""
    return cache_dir() / source_fingerprint(_source_roots())[:32] / name


def load_or_compile(name: str, key: tuple, compile: Callable[[], Any]) -> tuple:
    """(compiled function of `key`, whether it was found rather than compiled): the entry of (name,
    key) if there is a loadable one, else compile() (a TVM-FFI compiled function), exported for
    the next process. With the cache off (FA_A2A_CACHE=0), or when the folder cannot be created
    (warned once), compile() alone."""
    if not enabled():
        return compile(), False
    try:
        settings = _compile_settings()
    except Exception:  # e.g. no GPU and no CUTE_DSL_ARCH: let the compile report it
        return compile(), False
    folder = entry_folder(name)
    full_key = (name, key, settings)
    loaded = _load_entry(folder, full_key)
    if loaded is not None:
        return loaded, True
    try:
        store = _store(folder)
    except OSError as e:
        _warn_once(f"fa_a2a compile cache: cannot use {folder} ({e}); compiling in memory only "
                   f"(set {ENV_DIR}, or {ENV_SWITCH}=0)")
        return compile(), False
    try:
        if full_key in store:  # loads the entry (shared lock) into the store's memory
            _link_shared(_entry_file(folder, full_key))
            return store[full_key], True
    except OSError as e:  # e.g. a lock path that is a folder
        _warn_once(f"fa_a2a compile cache: cannot read {folder} ({e}); compiling in memory only")
        return compile(), False
    compiled = compile()
    try:
        store[full_key] = compiled  # exports (exclusive lock, temporary file renamed into place)
        _link_shared(_entry_file(folder, full_key))
    except OSError as e:
        _warn_once(f"fa_a2a compile cache: cannot write {folder} ({e}); this kernel stays in memory")
    return compiled, False


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def disk_cache(fn: Callable) -> Callable:
    """functools.cache for a compile function, backed by the disk cache (see the module
    docstring). The arguments, defaults applied, are the key; they must be hashable and
    picklable. A non-empty `extra_options` argument bypasses the disk. cache_info() /
    cache_clear() as functools.cache's (cache_clear empties the memory, not the disk)."""
    signature = inspect.signature(fn)
    memory: dict = {}  # key: the arguments with defaults applied
    as_called: dict = {}  # the same results keyed by the call's own args and kwargs (no binding)
    counts = {"hits": 0, "misses": 0, "loads": 0}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        call = (args, tuple(kwargs.items()))
        if call in as_called:
            counts["hits"] += 1
            return as_called[call]
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple(bound.arguments.values())
        if key in memory:
            counts["hits"] += 1
        else:
            counts["misses"] += 1
            if bound.arguments.get("extra_options"):
                memory[key] = fn(*args, **kwargs)
            else:
                memory[key], loaded = load_or_compile(fn.__qualname__, key, lambda: fn(*args, **kwargs))
                counts["loads"] += loaded
        as_called[call] = memory[key]
        return memory[key]

    def cache_info() -> CacheInfo:
        return CacheInfo(counts["hits"], counts["misses"], None, len(memory), counts["loads"])

    def cache_clear() -> None:
        memory.clear()
        as_called.clear()
        counts.update(hits=0, misses=0, loads=0)

    wrapper.cache_info = cache_info
    wrapper.cache_clear = cache_clear
    return wrapper


def disk_value(fn: Callable) -> Callable:
    """functools.cache for a small function of FA4's or quack's code (e.g. FA4's tile table), its
    results kept on disk beside the compiled kernels under the same fingerprint (so a change to
    that code is a miss): a warm process gets them without importing the package that computes
    them. Positional arguments, hashable and picklable; the result picklable. FA_A2A_CACHE=0, or
    a folder that cannot be written: computed in memory only."""

    @functools.cache
    @functools.wraps(fn)
    def wrapper(*args):
        path = None
        if enabled():
            try:
                path = entry_folder(fn.__qualname__) / f"{hashlib.sha256(pickle.dumps(args)).hexdigest()}.pkl"
                return pickle.loads(path.read_bytes())
            except Exception:  # absent or unreadable: computed, and written below
                pass
        value = fn(*args)
        if path is not None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(pickle.dumps(value))
                os.replace(tmp, path)  # whole or absent for the other processes
            except OSError:
                tmp.unlink(missing_ok=True)
        return value

    return wrapper
