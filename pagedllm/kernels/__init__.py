"""C++ CPU kernels, compiled on first use and cached; each has a pure-torch reference in layers/.

The build goes into a folder keyed by the sources and the whole toolchain (compiler, flags, torch, Python,
ninja, CPU), so checkouts and venvs that share a home folder never rebuild each other's kernels, and it runs
with the ninja of this interpreter's environment (the `ninja` pip package) ahead of any other on PATH.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
_DIR = os.path.dirname(__file__)
_NAME = "pagedllm_cpu_ops"
_SOURCES = (
    "paged_attention.cpp",
    "fused_ops.cpp",
    "packed_linear.cpp",
    "decoder_stack.cpp",
    "quant_linear.cpp",
    "shm_collectives.cpp",
    "lora.cpp",
    "moe.cpp",
)
_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_KEY_CHARS = 16  # 64 bits of the hash: collisions between toolchains are not a concern
_build_error: str | None = None


def build_search_path(path: str, interpreter: str) -> str:
    """PATH for the build: the interpreter's bin folder first where a ninja is there, else PATH unchanged.

    torch runs `ninja` from PATH; `make` and an activated venv see different PATHs, and a ninja of another
    version rewrites the build log, which rebuilds everything. The interpreter's own folder is the same for both.
    """
    bin_dir = os.path.dirname(interpreter)
    if not bin_dir or shutil.which("ninja", path=bin_dir) is None:
        return path
    rest = [p for p in path.split(os.pathsep) if p and os.path.normpath(p) != os.path.normpath(bin_dir)]
    return os.pathsep.join([bin_dir, *rest])


def march() -> str:
    """The -march the kernels are built for: this CPU's unless $PAGEDLLM_KERNEL_MARCH names another
    (x86-64-v3: the AVX2 path, as on CPUs without AVX-512; x86-64: the portable one)."""
    return os.environ.get("PAGEDLLM_KERNEL_MARCH") or "native"


def _cflags() -> list[str]:
    return [*_CFLAGS, f"-march={march()}"]


def build_key(sources: Mapping[str, bytes], flags: Sequence[str], toolchain: Mapping[str, str]) -> str:
    """A short hash naming the build folder: any change to a source byte, a flag or the toolchain changes it."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        # The name and length delimit each file, so bytes cannot shift from one file into the next unnoticed.
        digest.update(f"{name}\0{len(sources[name])}\0".encode())
        digest.update(sources[name])
    digest.update(json.dumps([list(flags), dict(sorted(toolchain.items()))]).encode())
    return digest.hexdigest()[:_KEY_CHARS]


def kernels_expected() -> str | None:
    """None where the kernels should build here (so a failure is a bug), else the reason they cannot."""
    if os.environ.get("PAGEDLLM_NO_KERNELS") == "1":
        return "PAGEDLLM_NO_KERNELS=1 is set"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are built for x86-64 Linux only, not {sys.platform} on {platform.machine()}"
    path = build_search_path(os.environ.get("PATH", ""), sys.executable)
    if _compiler(path) is None:
        return "no C++ compiler found ($CXX, c++ or g++)"
    if shutil.which("ninja", path=path) is None:
        return f"no ninja found (neither in {os.path.dirname(sys.executable)} nor on PATH): pip install ninja"
    return None


def build_error() -> str | None:
    """The error of the last failed build in this process (the compiler's output included), else None."""
    return _build_error


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module, or None (with a warning saying why) where it cannot or did not build."""
    global _build_error
    reason = kernels_expected()
    if reason is not None:
        # Asked for by the user: no warning. Otherwise the slow path deserves one.
        log = logger.info if os.environ.get("PAGEDLLM_NO_KERNELS") == "1" else logger.warning
        log("C++ kernels unavailable (%s); using the pure-torch kernels", reason)
        return None
    try:
        return _load()
    except Exception as exc:  # noqa: BLE001 - the torch path still works; build_error() keeps the cause
        _build_error = f"{type(exc).__name__}: {exc}"
        logger.warning("C++ kernels failed to build (%s); using the pure-torch kernels", exc)
        return None


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The compiled module where its elementwise kernels take x (fp32 or bf16 on the CPU), else None."""
    return cpu_ops() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None


def _load() -> ModuleType:
    """Build (or find built) and import the module, logging which and how long a build took."""
    from torch.utils.cpp_extension import load

    path = build_search_path(os.environ.get("PATH", ""), sys.executable)
    cxx = _compiler(path)
    assert cxx is not None, "kernels_expected() checked for a compiler"
    directory = _build_directory(path, cxx)
    os.makedirs(directory, exist_ok=True)
    # Decided before load(): afterwards the .so is always there.
    cached = os.path.exists(os.path.join(directory, _NAME + ".so"))
    if cached:
        logger.info("Loading the C++ kernels from %s", directory)
    else:
        logger.info("Building the C++ kernels into %s (about 1-2 minutes, once per source/toolchain)", directory)
    logger.debug("C++ kernels: compiler %r, ninja %s", cxx, shutil.which("ninja", path=path))
    start = time.perf_counter()
    with _build_lock(directory), _build_environment(path, cxx):
        module = load(
            name=_NAME,
            sources=[os.path.join(_DIR, f) for f in _SOURCES],
            extra_cflags=_cflags(),
            extra_ldflags=list(_LDFLAGS),
            build_directory=directory,
            verbose=False,
        )
    if not cached:
        logger.info("C++ kernels built in %.1f s", time.perf_counter() - start)
    return module


@contextlib.contextmanager
def _build_lock(directory: str) -> Iterator[None]:
    """The folder's build to this process alone, a second process starting at once waiting for it.

    torch's load() takes a lock of its own, a `lock` file that a build killed mid-way leaves behind,
    and every later load of the folder then waits on it forever. This lock is the kernel's (flock):
    it goes with its process. Whoever holds it is the only builder, so a `lock` file found then is
    such a leftover, and is removed."""
    import fcntl

    with open(os.path.join(directory, "build.flock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process's build of the C++ kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                logger.warning("Removing %s, left by a kernel build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_directory(path: str, cxx: str) -> str:
    """<cache>/pagedllm/kernels/<key>, the key from the sources, the flags, the toolchain and the
    sources' folder: ninja's commands name the sources by path, so two checkouts sharing one
    folder would each find the other's build out of date and rebuild it (seen with git worktrees)."""
    key = build_key(_source_files(), [*_cflags(), "|", *_LDFLAGS, "|", os.path.abspath(_DIR)], _toolchain(path, cxx))
    return os.path.join(_cache_root(), key)


def _cache_root() -> str:
    """$PAGEDLLM_CACHE_DIR/kernels, else the user's cache folder (XDG) /pagedllm/kernels."""
    if os.environ.get("PAGEDLLM_CACHE_DIR"):
        return os.path.join(os.environ["PAGEDLLM_CACHE_DIR"], "kernels")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pagedllm", "kernels")


def _source_files() -> dict[str, bytes]:
    """Every source and header, the headers included because the .cpp files include them."""
    files = sorted(glob.glob(os.path.join(_DIR, "*.cpp")) + glob.glob(os.path.join(_DIR, "*.h")))
    contents = {}
    for file in files:
        with open(file, "rb") as f:
            contents[os.path.basename(file)] = f.read()
    return contents


def _toolchain(path: str, cxx: str) -> dict[str, str]:
    """Whatever else makes a built .so differ: compiler, ninja, torch, Python ABI and CPU (-march=native)."""
    return {
        "compiler": cxx,
        "compiler_version": _version_output([*shlex.split(cxx), "--version"], path),
        "ninja_version": _version_output(["ninja", "--version"], path),
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "python": f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')}",
        "machine": platform.machine(),
        "cpu_flags": _cpu_flags(),
    }


def _compiler(path: str) -> str | None:
    """$CXX where set (as torch uses it), else c++, else g++; None where none is found."""
    if os.environ.get("CXX"):
        cxx = os.environ["CXX"]
        words = shlex.split(cxx)
        return cxx if words and shutil.which(words[0], path=path) else None
    return next((name for name in ("c++", "g++") if shutil.which(name, path=path)), None)


def _version_output(command: list[str], path: str) -> str:
    """The command's --version output, or '' where it cannot run (the key then still differs from a working one)."""
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=30, check=False, env={**os.environ, "PATH": path}
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code built on one CPU may crash on another sharing the home."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@contextlib.contextmanager
def _build_environment(path: str, cxx: str) -> Iterator[None]:
    """PATH (and CXX, which torch reads) set for the build, restored afterwards."""
    saved = {name: os.environ.get(name) for name in ("PATH", "CXX")}
    os.environ["PATH"] = path
    os.environ["CXX"] = cxx  # g++ where there is no c++, which torch would otherwise try
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
