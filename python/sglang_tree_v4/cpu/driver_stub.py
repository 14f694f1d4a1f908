"""Build and load the stand-in ``libcuda.so.1`` (see ``driver_stub.c``).

The library is compiled once with the system C compiler into a per-user cache directory and
reused afterwards. It is made visible in two ways: loaded into this process by full path (so the
dynamic linker later satisfies sgl_kernel's ``libcuda.so.1`` dependency by soname), and put on
``LD_LIBRARY_PATH`` so that every process SGLang spawns finds it at startup.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SONAME = "libcuda.so.1"
_SOURCE = Path(__file__).with_name("driver_stub.c")


class StubBuildError(RuntimeError):
    """No stand-in driver library could be built (typically: no C compiler)."""


def cache_dir() -> Path:
    """Where built artefacts live: $SGLANG_TREE_V4_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    root = os.environ.get("SGLANG_TREE_V4_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "sglang-tree-v4"


def _find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def stub_path() -> Path:
    """Path of the built library; its folder holds nothing else, so it can go on LD_LIBRARY_PATH."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"driver-stub-{digest}" / SONAME


def build() -> Path:
    """Return the stand-in library, compiling it first if the cache lacks it."""
    target = stub_path()
    if target.exists():
        return target
    compiler = _find_compiler()
    if compiler is None:
        raise StubBuildError(
            "sglang-tree-v4: SGLang on a CPU needs a stand-in libcuda.so.1 so that the CUDA build "
            "of sgl_kernel can be imported, and building it needs a C compiler, but none was found "
            "(looked for $CC, cc, gcc, clang). Install one (for example `apt-get install gcc`) "
            f"or place a prebuilt stand-in at {target}."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: several SGLang processes may race on first use.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    cmd = [compiler, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{SONAME}", "-o", tmp, str(_SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise StubBuildError(f"sglang-tree-v4: building the stand-in {SONAME} failed:\n{proc.stderr}")
    os.replace(tmp, target)
    return target


def install() -> Path:
    """Build if needed, load into this process and expose to child processes."""
    lib = build()
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    folder = str(lib.parent)
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([folder, *paths])
    return lib
