"""The C library: compiled at first use with the system's C compiler (-O3 -march=native
-fopenmp) from csrc/ into $HOTPREFIX_CACHE/kernels, cached by the sources' digest, the
CPU's flags and the compiler's flags, and loaded with ctypes (abi.bind states its ABI).
Without a compiler, or with HOTPREFIX_QKERNEL=0, there is no library and every caller
falls back to torch on float32 weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hotprefix.config import QuantizedMatmul, as_mode, cache_root
from hotprefix.model.kernels.abi import bind

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"

_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags_line() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_signature() -> str:
    return f"{platform.machine()}|{_cpu_flags_line()}"


def cpu_vector_flags() -> list[str]:
    """The CPU flags that decide which kernels run (sorted; empty off Linux/x86), for
    benchmark results: amx_int8, avx2, avx512f, avx512_vnni, avx_vnni, fma."""
    have = set(_cpu_flags_line().split())
    return sorted(have & {"amx_int8", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma"})


def sources() -> list[Path]:
    """The kernel library's C files and headers (csrc/), in a fixed order."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def source_digest() -> str:
    """A digest of every kernel source: it names the built library and, since the
    regrouped layouts are defined there, the regrouped-weight caches (weight_cache.py)."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def compile_flags(march: str = "native", defines: tuple[str, ...] = ()) -> list[str]:
    """The C compiler's flags of the kernel library (benchmarks build with them too)."""
    # no FP traps are ever read: selects of values computed anyway (silu, exp) may vectorize
    return ["-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
            *(f"-D{d}" for d in defines)]


def build_library(force: bool = False, march: str = "native", defines: tuple[str, ...] = ()) -> Path | None:
    """Compile csrc/*.c for this CPU (cached by sources, CPU flags, `march` and `defines`,
    e.g. ("HP_SIM512",) for tests of the AVX-512 paths on any x86-64 CPU); the .so path,
    or None when there is no compiler or it fails."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.info("no C compiler: decoding uses float32 weights")
        return None
    flags = compile_flags(march, defines)
    key = hashlib.sha256((source_digest() + _cpu_signature() + cc + " ".join(flags)).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"hp-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the C kernels for this CPU (once; cached in %s) ...", out.parent)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [cc, *flags, "-shared", "-fPIC", *(str(p) for p in sources() if p.suffix == ".c"), "-o", str(so), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("could not build the GGUF block kernel (%s): decoding uses float32 weights",
                        (r.stderr.strip().splitlines() or ["?"])[-1])
            return None
        os.replace(so, out)
    log.info("built the C kernels in %.1fs", time.monotonic() - t0)
    return out


def library() -> ctypes.CDLL | None:
    """The kernel library, built and loaded once per process (None when unavailable or
    disabled by HOTPREFIX_QKERNEL=0)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("HOTPREFIX_QKERNEL", "1") == "0":
        return None
    path = build_library()
    _lib = None if path is None else bind(path)
    return _lib


PATH_NAMES = {1: "float AVX-512", 2: "float AVX2", 4: "int8 AVX-512 VNNI", 8: "int8 AVX2", 16: "simulated AVX-512",
              32: "int8 AMX tiles"}


def vector_paths(lib: ctypes.CDLL | None = None) -> list[str]:
    """The vector paths a build of the library runs (["plain C"] when none): what a test
    run or a benchmark exercised."""
    bits = need(lib).hp_vector_paths()
    return [name for bit, name in PATH_NAMES.items() if bits & bit] or ["plain C"]


def amx(lib: ctypes.CDLL | None = None, on: bool | None = None) -> bool:
    """Whether the int8 products of 16 or more rows of x run on AMX tiles (int8_amx.c):
    on where this build compiled them (-march=native on a CPU with amx_int8), the kernel
    granted the tile data and HOTPREFIX_NO_AMX=1 was not set when the library loaded.
    `on` switches them for this process (True only where granted; the same bits either
    way). Raises RuntimeError without a library."""
    return bool(need(lib).hp_amx(-1 if on is None else int(on)))


def need(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """`lib`, else the process's library. Raises RuntimeError when there is none."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the C kernel library is not available")
    return lib


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the block kernels can serve a model on `device` in `dtype` (float32, CPU)."""
    import torch

    return device.type == "cpu" and dtype == torch.float32 and library() is not None


def resolve_matmul(mode: QuantizedMatmul | str) -> QuantizedMatmul:
    """INT8 or FLOAT32 for a --quantized-matmul mode; AUTO is INT8 where this build
    runs it on vector instructions (AVX-512 VNNI or AVX2). Raises ConfigError (a
    ValueError) for an unknown mode."""
    mode = as_mode(QuantizedMatmul, "--quantized-matmul", mode)
    if mode is not QuantizedMatmul.AUTO:
        return mode
    lib = library()
    return QuantizedMatmul.INT8 if lib is not None and lib.hp_int8_vectorized() else QuantizedMatmul.FLOAT32
