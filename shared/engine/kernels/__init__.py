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

import torch

from shared.engine.default_model import build_once, cache_root
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_HERE = Path(__file__).parent
# Fast math vectorizes expf (glibc's libmvec) and reductions; the kernels never produce infinities or NaNs from
# finite inputs (softmax subtracts the max, silu caps its exponent), which is what fast math assumes. It is a
# compile flag only: linked with -ffast-math, the library would flush subnormals to zero in the whole process
# that loads it (gcc's crtfastmath), changing torch's arithmetic too.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]

i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_DECODE_ATTENTION = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, c_int, c_int]
_PREFILL_ATTENTION = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr, c_int, c_int]
_SIGNATURES = {
    "paged_decode_attention": _DECODE_ATTENTION,
    "paged_decode_attention_portable": _DECODE_ATTENTION,
    "paged_prefill_attention": _PREFILL_ATTENTION,
    "paged_prefill_attention_simd_float": _PREFILL_ATTENTION,
    "paged_prefill_attention_portable": _PREFILL_ATTENTION,
    "add_rms_norm": [ptr, ptr, ptr, i64, i64, f32, c_int, c_int, c_int],
    "rotary": [ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int],
    "silu_and_mul": [ptr, ptr, i64, i64, c_int, c_int],
    "small_linear": [ptr, i64, i64, ptr, ptr, ptr, i64, c_int, c_int],
    "small_linear_portable": [ptr, i64, i64, ptr, ptr, ptr, i64, c_int, c_int],
}


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


def _build(compiler: str, name: str, flags: list[str], out_dir: Path) -> None:
    objects = out_dir / f"{name}.o"
    for command in ([compiler, *flags, "-c", "-o", str(objects), str(_HERE / f"{name}.c")],
                    [compiler, *_LINK_FLAGS, "-o", str(out_dir / f"{name}.so"), str(objects), "-lm"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[:2000]}")
    objects.unlink()


DISABLED = "turned off (SPLITSERVE_NATIVE_KERNELS=0)"
NO_COMPILER = "no C compiler on this machine"
_unavailable: dict[str, str] = {}  # kernels' name -> why `native_library` gave None for them last


def unavailable_reason(name: str) -> str | None:
    """Why `native_library(name)` gives None (`DISABLED`, `NO_COMPILER`, or the build's error), None if it does
    not: where the platform lacks what the kernels need, the torch path serves; a build that fails is a bug."""
    return None if native_library(name) is not None else _unavailable.get(name)


@cache
def native_library(name: str) -> ctypes.CDLL | None:
    """The compiled kernels of `<name>.c`, or None (disabled, no compiler, or the build failed: `unavailable_reason`
    says which)."""
    if os.environ.get("SPLITSERVE_NATIVE_KERNELS", "1") == "0":
        _unavailable[name] = DISABLED
        return None
    compiler = _compiler()
    if compiler is None:
        _unavailable[name] = NO_COMPILER
        log.warning("no C compiler found: the slower torch path runs instead of native kernels", kernels=name)
        return None
    flags = _FLAGS
    sources = b"".join(path.read_bytes() for path in [_HERE / f"{name}.c", *sorted(_HERE.glob("*.h"))])
    key = hashlib.blake2b(sources + " ".join([*flags, *_LINK_FLAGS]).encode() + _cpu_id().encode() + compiler.encode(),
                          digest_size=8).hexdigest()
    try:
        directory = build_once(cache_root() / "kernels" / f"{name}-{key}", lambda tmp: _build(compiler, name, flags, tmp))
        library = ctypes.CDLL(str(directory / f"{name}.so"))
    except (OSError, subprocess.SubprocessError) as exc:
        _unavailable[name] = f"the build failed: {exc}"
        log.warning("native kernels unavailable, using the torch path", kernels=name, error=str(exc))
        return None
    for function, argtypes in _SIGNATURES.items():
        if hasattr(library, function):
            getattr(library, function).argtypes = argtypes
            getattr(library, function).restype = c_int if function.startswith("paged_") else None
    return library


def native_library_for(name: str, device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """`native_library(name)` where its kernels can serve tensors of `device` and `dtype` (CPU, float32 or
    bfloat16), else None."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return native_library(name)


def all_threads_or_one(split: bool, max_threads: int) -> int:
    """How many of torch's OpenMP threads a kernel's parallel region asks for: all of them, or one (no region).
    Never some: libgomp ends a team's threads that a smaller region does not use, and torch's next parallel
    region starts them again."""
    return max(1, max_threads) if split else 1


def bf16_flag(tensor: torch.Tensor) -> int:
    """The kernels' storage argument: 1 for bfloat16, 0 for float32."""
    return int(tensor.dtype == torch.bfloat16)
