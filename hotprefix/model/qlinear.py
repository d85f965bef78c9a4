"""Linear layers that read GGUF Q4_0 / Q4_1 / Q8_0 blocks directly.

Decoding multiplies a few rows of activations by every weight matrix, so its
speed is the speed of reading the weights. Kept as float32, SmolLM2's weights
are 538 MB a step; as their GGUF blocks they are 96 MB. `csrc/qgemv.c` has two
ways to multiply by the blocks (`--quantized-matmul`):

- float32: each block is dequantized in registers (exactly as gguf's
  `dequantize` does) and multiplied in float32, so results equal the float32
  product with the dequantized weights up to the order of the additions. Used
  for M <= MAX_M rows; larger products use the float32 weights (MKL).
- int8: activations are quantized to int8 per 32-element block (llama.cpp's
  method) and multiplied with integer dot products (AVX-512 VNNI, or AVX2's
  vpmaddubsw) on a regrouped copy of the blocks, for every M: 3-4x faster than
  either float32 route on a VNNI CPU, 2-8x with AVX2. On the default model its
  next-token distributions stay as close to the float32 ones as llama.cpp's
  (mean KL divergence 0.004 on 256 tokens of text).

The same library also holds the decode attention over the paged pool and, for
int8 mode, RMSNorm, RoPE and silu * up. It is compiled at first use with the
system's C compiler (-O3 -march=native -fopenmp, see build_library) into $HOTPREFIX_CACHE/kernels
and loaded with ctypes; without a compiler, or with HOTPREFIX_QKERNEL=0, all of
it falls back to torch on the float32 weights.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotprefix.config import QuantizedMatmul, as_mode, cache_root

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "qgemv.c"
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # GGML type ids
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
MAX_M = 16  # rows of activations up to which the block kernel is used

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


def build_library(force: bool = False, march: str = "native") -> Path | None:
    """Compile csrc/qgemv.c for this CPU (cached by source, CPU flags and `march`);
    the .so path, or None when there is no compiler or it fails."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.info("no C compiler: decoding uses float32 weights")
        return None
    src = SOURCE.read_bytes()
    # no FP traps are ever read: selects of values computed anyway (silu, exp) may vectorize
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    key = hashlib.sha256(src + _cpu_signature().encode() + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"qgemv-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", str(so), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("could not build the GGUF block kernel (%s): decoding uses float32 weights",
                        (r.stderr.strip().splitlines() or ["?"])[-1])
            return None
        os.replace(so, out)
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


def bind(path: Path) -> ctypes.CDLL:
    """Load a built kernel library and declare its functions."""
    lib = ctypes.CDLL(str(path))
    lib.hp_qmatmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.hp_qmatmul.restype = ctypes.c_int
    lib.hp_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.hp_dequantize.restype = ctypes.c_int
    lib.hp_qmatmul_i8.argtypes = lib.hp_qmatmul.argtypes
    lib.hp_qmatmul_i8.restype = ctypes.c_int
    lib.hp_repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.hp_repack.restype = ctypes.c_int
    lib.hp_repacked_bytes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.hp_repacked_bytes.restype = ctypes.c_long
    lib.hp_int8_vectorized.argtypes = []
    lib.hp_int8_vectorized.restype = ctypes.c_int
    p = ctypes.c_void_p
    lib.hp_paged_attention.argtypes = [p, p, p, ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int, p, ctypes.c_float,
                                       p, p, ctypes.c_int]
    lib.hp_paged_attention.restype = ctypes.c_int
    lib.hp_silu_mul.argtypes = [p, ctypes.c_int, ctypes.c_int, p, ctypes.c_int]
    lib.hp_silu_mul.restype = None
    lib.hp_kv_write.argtypes = [p, p, ctypes.c_int64, p, ctypes.c_int, p, ctypes.c_int64, p, ctypes.c_int64,
                                ctypes.c_int, ctypes.c_int]
    lib.hp_kv_write.restype = None
    lib.hp_rmsnorm.argtypes = [p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, p, ctypes.c_float, p, ctypes.c_int]
    lib.hp_rmsnorm.restype = None
    lib.hp_rope.argtypes = [p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, p, p, ctypes.c_int]
    lib.hp_rope.restype = None
    i, f = ctypes.c_int, ctypes.c_float
    lib.hp_decode_layers.argtypes = [p, i, p, i, i, i, i, i, i, f, p, p, p, ctypes.c_int64, p, p, i, p,
                                     p, i, p, i, p, f, i]
    lib.hp_decode_layers.restype = ctypes.c_int
    return lib


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight kept as its GGUF blocks: `raw` is uint8 [N, K / 32 * block bytes],
    or with `int8`, the same blocks regrouped by 16 rows (csrc/qgemv.c's hp_repack)
    for the int8-activation product."""

    qtype: int
    raw: torch.Tensor
    n: int
    k: int
    int8: bool = False

    def serves(self, m: int) -> bool:
        """Whether products with m rows of activations run on these blocks."""
        return self.int8 or m <= MAX_M

    def regrouped(self, lib: ctypes.CDLL | None = None) -> PackedWeight:
        """The int8-activation form of these GGUF rows (a new weight; self is unchanged)."""
        lib = _need(lib)
        if self.int8:
            return self
        out = torch.empty(lib.hp_repacked_bytes(self.qtype, self.n, self.k), dtype=torch.uint8)
        if lib.hp_repack(self.qtype, self.raw.data_ptr(), self.n, self.k, out.data_ptr()):
            raise RuntimeError(f"hp_repack failed for type {self.qtype}, K={self.k}")
        return PackedWeight(self.qtype, out, self.n, self.k, int8=True)

    @classmethod
    def from_gguf(cls, type_name: str, raw: torch.Tensor, n: int, k: int) -> PackedWeight | None:
        """None for a type the kernel does not read."""
        qtype = QTYPES.get(type_name)
        if qtype is None or k % 32:
            return None
        raw = raw.reshape(n, k // 32 * BLOCK_BYTES[qtype]).contiguous()
        return cls(qtype, raw, n, k)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def concat_rows(ws: list[PackedWeight | None]) -> PackedWeight | None:
    """The weights stacked by rows (one product for several projections of the same
    input), or None unless all are given with one type and one K."""
    if not ws or any(w is None or w.int8 for w in ws) or len({(w.qtype, w.k) for w in ws}) != 1:
        return None
    return PackedWeight(ws[0].qtype, torch.cat([w.raw for w in ws]), sum(w.n for w in ws), ws[0].k)


def _need(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the GGUF block kernel is not available")
    return lib


def qmatmul(x: torch.Tensor, w: PackedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] float32 (CPU) @ W^T -> [M, N] float32, with int8 activations when w.int8.
    Raises RuntimeError without the library."""
    lib = _need(lib)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    fn = lib.hp_qmatmul_i8 if w.int8 else lib.hp_qmatmul
    rc = fn(w.qtype, x.data_ptr(), m, w.k, w.raw.data_ptr(), w.n, y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"the block product failed ({rc}) for type {w.qtype}, K={w.k}")
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
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    if lib.hp_dequantize(w.qtype, w.raw.data_ptr(), w.n, w.k, out.data_ptr()):
        raise RuntimeError(f"hp_dequantize failed for type {w.qtype}")
    return out


class Linear(nn.Linear):
    """nn.Linear that, given `packed` blocks of the same weight, multiplies from
    the blocks the batches they serve (PackedWeight.serves; float32 on the CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed: PackedWeight | None = None  # see LlamaForCausalLM.attach_blocks

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
