"""Native CPU kernels: C compiled once per machine with its compiler, loaded with ctypes.

The C source ships with the package; the first process that needs a kernel
compiles it (`cc -O3 -march=native`, a second or two) into the splitserve
cache, keyed by the source, the flags and the CPU, and later processes load
it from there. Where no compiler is found, or `SPLITSERVE_NATIVE_KERNELS=0`,
callers fall back to their plain torch path: slower, never wrong.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

from shared.engine.default_model import build_once, cache_root
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC", "-pthread"]
_LIBRARY_NAME = "paged_decode.so"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") or line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, out_dir: Path) -> None:
    result = subprocess.run([compiler, *_FLAGS, "-o", str(out_dir / _LIBRARY_NAME), str(_SOURCE), "-lm"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise OSError(f"{compiler} failed: {result.stderr.strip()[:2000]}")


@cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The compiled paged decode attention kernel, or None (disabled, no compiler, or the build failed)."""
    if os.environ.get("SPLITSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: decode attention runs on the slower torch path")
        return None
    key = hashlib.blake2b(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_id().encode() + compiler.encode(),
                          digest_size=8).hexdigest()
    try:
        directory = build_once(cache_root() / "kernels" / f"paged_decode-{key}", lambda tmp: _build(compiler, tmp))
        library = ctypes.CDLL(str(directory / _LIBRARY_NAME))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native decode attention unavailable, using the torch path", error=str(exc))
        return None
    function = library.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                         ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return library
