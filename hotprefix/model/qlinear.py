"""Linear layers that read GGUF weight blocks directly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
and the K-quants Q4_K, Q5_K, Q6_K that Q4_K_M files are made of).

Decoding multiplies a few rows of activations by every weight matrix, so its speed is
the speed of reading the weights: as float32, a 1B model's weights are 4.9 GB a step;
as Q4_K_M blocks 0.7 GB. The C kernels (csrc/, see hp.h for the files) multiply by the
blocks in two ways (`--quantized-matmul`):

- float32: each block is dequantized in registers (exactly as gguf's `dequantize`
  does) and multiplied in float32, so results equal the float32 product with the
  dequantized weights up to the order of the additions. Used for M <= MAX_M rows;
  larger products use the float32 weights (MKL).
- int8: activations are quantized to int8 (per 32 values for the 32-value types, per
  256 for the K-quants, llama.cpp's methods) and multiplied with integer dot products
  (AVX-512 VNNI, or AVX2's vpmaddubsw) on a regrouped copy of the blocks, for every M:
  3-4x faster than either float32 route on a VNNI CPU, 2-8x with AVX2. On the default
  model its next-token distributions stay as close to the float32 ones as llama.cpp's
  (mean KL divergence 0.004 on 256 tokens of text).

The same library also holds the decode attention over the paged pool and, for int8
mode, RMSNorm, RoPE, silu * up and the fused decode step. It is compiled at first use
with the system's C compiler (-O3 -march=native -fopenmp, see build_library) into
$HOTPREFIX_CACHE/kernels and loaded with ctypes (kernel_abi.py states its ABI); without
a compiler, or with HOTPREFIX_QKERNEL=0, all of it falls back to torch on the float32
weights.
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
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotprefix.config import QuantizedMatmul, as_mode, cache_root
from hotprefix.model import kernel_abi

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # GGML ids
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}
BLOCK_VALUES = {t: 256 if t >= 12 else 32 for t in BLOCK_BYTES}  # values per block
TYPE_NAMES = {v: k for k, v in QTYPES.items()}
MAX_M = 16  # rows of activations up to which float32 mode multiplies from the blocks

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
    benchmark results: avx2, avx512f, avx512_vnni, avx_vnni, fma."""
    have = set(_cpu_flags_line().split())
    return sorted(have & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma"})


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


def build_library(force: bool = False, march: str = "native", defines: tuple[str, ...] = ()) -> Path | None:
    """Compile csrc/*.c for this CPU (cached by sources, CPU flags, `march` and `defines`,
    e.g. ("HP_SIM512",) for tests of the AVX-512 paths on any x86-64 CPU); the .so path,
    or None when there is no compiler or it fails."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.info("no C compiler: decoding uses float32 weights")
        return None
    # no FP traps are ever read: selects of values computed anyway (silu, exp) may vectorize
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
             *(f"-D{d}" for d in defines)]
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
    """The kernel library, built and loaded once per process (None when unavailable or disabled)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("HOTPREFIX_QKERNEL", "1") == "0":
        return None
    path = build_library()
    _lib = None if path is None else bind(path)
    return _lib


bind = kernel_abi.bind


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight kept as its GGUF blocks: `raw` is uint8 [N, K / block values *
    block bytes] (the file's rows, often a view of the mapped file), or with `int8`, the
    same blocks regrouped by 16 rows (csrc/repack.c) for the int8-activation product."""

    qtype: int
    raw: torch.Tensor
    n: int
    k: int
    int8: bool = False

    def serves(self, m: int) -> bool:
        """Whether products with m rows of activations run on these blocks."""
        return self.int8 or m <= MAX_M

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    @cached_property
    def part_table(self) -> ctypes.Array:
        """The kernel's HpPart table for this weight, built once (it points into `raw`)."""
        return _part_table(self.parts)

    def regrouped_bytes(self, lib: ctypes.CDLL | None = None) -> int:
        """Bytes of the int8 form of these rows."""
        return int(_need(lib).hp_repacked_bytes(self.qtype, self.n, self.k))

    def regrouped(self, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> PackedWeight:
        """The int8-activation form of these GGUF rows (a new weight; self is unchanged),
        written into `out` (uint8, regrouped_bytes long: e.g. a view of a mapped cache
        file) or a new tensor. Raises RuntimeError without the library."""
        lib = _need(lib)
        if self.int8:
            return self
        size = self.regrouped_bytes(lib)
        out = torch.empty(size, dtype=torch.uint8) if out is None else out
        if out.numel() != size or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"regrouped: out must be {size} contiguous bytes")
        if lib.hp_repack(self.qtype, self.raw.data_ptr(), self.n, self.k, out.data_ptr()):
            raise RuntimeError(f"hp_repack failed for type {self.qtype}, K={self.k}")
        return PackedWeight(self.qtype, out, self.n, self.k, int8=True)

    @classmethod
    def from_gguf(cls, type_name: str, raw: torch.Tensor, n: int, k: int) -> PackedWeight | None:
        """The rows of a GGUF tensor of `type_name` ([N, K] in HF's order), or None for a
        type the kernels do not read or a K its blocks do not divide."""
        qtype = QTYPES.get(type_name)
        if qtype is None or k <= 0 or k % BLOCK_VALUES[qtype]:
            return None
        raw = raw.reshape(n, k // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype])
        return cls(qtype, raw if raw.is_contiguous() else raw.contiguous(), n, k)

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


@dataclass(frozen=True)
class FusedWeight:
    """Weights over one input multiplied as one product whose outputs are their columns
    side by side (q, k and v; gate and up). The parts may differ in type: a Q4_K_M layer's
    q and k are Q4_K and its v Q6_K. In int8 mode the kernel runs every part's groups in
    one work-sharing loop; in float32 mode each part is its own product."""

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({p.k for p in self.parts}) != 1 or len({p.int8 for p in self.parts}) != 1:
            raise ValueError("fused weights need one K and one form")

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def int8(self) -> bool:
        return self.parts[0].int8

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def serves(self, m: int) -> bool:
        return self.parts[0].serves(m)

    @cached_property
    def part_table(self) -> ctypes.Array:
        """The kernel's HpPart table for these parts, built once (it points into their `raw`)."""
        return _part_table(self.parts)

    def regrouped(self, lib: ctypes.CDLL | None = None) -> FusedWeight:
        return FusedWeight(tuple(p.regrouped(lib) for p in self.parts))


Blocks = PackedWeight | FusedWeight


def fuse(ws: list[PackedWeight | None]) -> FusedWeight | None:
    """One product for several projections of the same input, or None unless all are
    given with one K, as GGUF rows or all regrouped."""
    if not ws or any(w is None for w in ws) or len({(w.k, w.int8) for w in ws}) != 1:
        return None
    return FusedWeight(tuple(ws))


def _part_table(parts: tuple[PackedWeight, ...]) -> ctypes.Array:
    return (kernel_abi.HpPart * len(parts))(*(kernel_abi.HpPart(p.raw.data_ptr(), p.qtype, p.n) for p in parts))


def _need(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the GGUF block kernel is not available")
    return lib


def qmatmul(x: torch.Tensor, w: Blocks, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] float32 (CPU) @ W^T -> [M, N] float32, with int8 activations when w.int8.
    Raises RuntimeError without the library or when the kernel refuses the weight."""
    lib = _need(lib)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if w.int8:
        rc = lib.hp_qmatmul_i8_parts(w.part_table, len(w.parts), x.data_ptr(), m, w.k, y.data_ptr(), threads)
    elif isinstance(w, FusedWeight):
        return torch.cat([qmatmul(x, p, lib) for p in w.parts], dim=1)
    else:
        rc = lib.hp_qmatmul(w.qtype, x.data_ptr(), m, w.k, w.raw.data_ptr(), w.n, y.data_ptr(), threads)
    if rc:
        raise RuntimeError(f"the block product failed ({rc}) for {[p.type_name for p in w.parts]}, K={w.k}")
    return y


def silu_mul(gate_up: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2I] float32 (CPU) = [gate | up] -> [M, I], in one pass
    (exp to about one float ulp). Raises RuntimeError without the library."""
    lib = _need(lib)
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    lib.hp_silu_mul(gate_up.data_ptr(), m, i, out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL) -> torch.Tensor:
    """RMSNorm of x [M, E] float32 (rows may be apart, each contiguous) -> new [M, E]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, e = x.shape
    out = torch.empty(m, e, dtype=torch.float32)
    lib.hp_rmsnorm(x.data_ptr(), m, e, x.stride(0), weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """Rotate x [T, NH, D] float32 in place (each row's NH * D values contiguous) by
    cos, sin [T, 1, D] contiguous; returns x."""
    t, nh, d = x.shape
    lib.hp_rope(x.data_ptr(), t, nh, x.stride(0), d, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return x


def dequantize(w: PackedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The weight as float32 [N, K], dequantized by the kernel's own code (for tests).
    Raises RuntimeError for a regrouped (int8) weight."""
    lib = _need(lib)
    if w.int8:
        raise RuntimeError("dequantize reads GGUF rows, not the regrouped form")
    if not w.raw.is_contiguous():
        raise ValueError("dequantize needs contiguous rows")
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    if lib.hp_dequantize(w.qtype, w.raw.data_ptr(), w.n, w.k, out.data_ptr()):
        raise RuntimeError(f"hp_dequantize failed for type {w.qtype}")
    return out


class Linear(nn.Linear):
    """nn.Linear that, given `packed` blocks of the same weight, multiplies from
    the blocks the batches they serve (PackedWeight.serves; float32 on the CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed: Blocks | None = None  # see LlamaForCausalLM.attach_blocks

    def reset_parameters(self) -> None:
        """No random initialisation: every weight comes from the checkpoint
        (LlamaForCausalLM.from_weights refuses a missing one), and initialising on the
        meta device imported torch._dynamo (1.5 s of every start)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p is not None and x.dim() == 2 and p.serves(x.shape[0]):
            y = qmatmul(x, p)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


class Embedding(nn.Embedding):
    """nn.Embedding that, given `packed` GGUF rows of its table and no float32 table
    (int8 mode releases it, see LlamaForCausalLM.release_served_weights), looks rows up
    in the blocks and dequantizes just those (exactly as gguf does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed: PackedWeight | None = None  # GGUF rows (not regrouped), see attach_blocks

    def reset_parameters(self) -> None:
        """No random initialisation (see Linear.reset_parameters)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p is None or self.weight.numel():
            return super().forward(ids)
        rows = p.raw.index_select(0, ids.reshape(-1))  # [T, bytes per row]
        return dequantize(PackedWeight(p.qtype, rows, rows.shape[0], p.k)).reshape(*ids.shape, p.k)


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the block kernel can serve a model on `device` in `dtype`."""
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
