"""The C kernels' ABI, the Python side of csrc/hp_api.h (the one header that declares
every exported function and the structs): ctypes mirrors of the structs the library
reads and the signature of every function it exports (tests/model/test_kernel_abi.py
compares SIGNATURES with the header's prototypes).

`bind` loads a built library, declares the signatures and compares each struct's size
and field offsets with the library's own (`hp_struct_layout`), so that a struct edited
on one side only raises RuntimeError at load instead of corrupting memory at the first
call.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_long, c_void_p
from pathlib import Path

_p = c_void_p
REDUCE = ctypes.CFUNCTYPE(None, _p, c_int64)  # hp_stack.reduce: x [n] float32, summed over the ranks in place


class HpPart(ctypes.Structure):
    """hp_part: one regrouped weight of a product (its bytes, GGML type and rows)."""

    _fields_ = [("w", _p), ("qtype", c_int), ("n", c_int)]


class HpLayer(ctypes.Structure):
    """hp_layer: one decoder layer's weights (projections as parts) and KV pools."""

    _fields_ = [("norm1", _p), ("norm2", _p), ("qkv", HpPart * 3), ("o", HpPart), ("gu", HpPart * 2),
                ("down", HpPart), ("nqkv", c_int), ("ngu", c_int), ("b_qkv", _p), ("b_o", _p),
                ("kpool", _p), ("vpool", _p), ("k_scale", c_float), ("v_scale", c_float), ("q_norm", _p),
                ("k_norm", _p), ("post1", _p), ("post2", _p), ("act", c_int), ("kind", c_int)]


class HpStack(ctypes.Structure):
    """hp_stack: the decoder layers and the model's shape."""

    _fields_ = [("layers", POINTER(HpLayer)), ("nlayers", c_int), ("E", c_int), ("H", c_int), ("KVH", c_int),
                ("D", c_int), ("I", c_int), ("eps", c_float), ("scale", c_float), ("head_stride", c_int64),
                ("kv_type", c_int), ("reduce", REDUCE)]


class HpPlan(ctypes.Structure):
    """hp_plan: an attention plan's tasks, rows, key ranges and slots."""

    _fields_ = [("rows", _p), ("lims", _p), ("task", _p), ("slots", _p), ("ntasks", c_int)]


class HpAtt(ctypes.Structure):
    """hp_att: what an attention pass reads and writes (q, a layer's pools, out, the rows' state)."""

    _fields_ = [("q", _p), ("k", _p), ("v", _p), ("head_stride", c_int64), ("KVH", c_int), ("D", c_int),
                ("kv_type", c_int), ("scale", c_float), ("k_scale", c_float), ("v_scale", c_float), ("out", _p),
                ("st_m", _p), ("st_l", _p), ("st_acc", _p)]


KINDS = 8  # hp_api.h's HP_KINDS: attention kinds of a step (their rotary tables, plans and write slots)
ACT_SILU, ACT_GELU_TANH = 0, 1  # hp_api.h's ACT_*


class HpStep(ctypes.Structure):
    """hp_step: one decode step's rows, and per attention kind its rotary tables, write slots and plans."""

    _fields_ = [("x", _p), ("cos", _p * KINDS), ("sin", _p * KINDS), ("wslots", _p * KINDS), ("own", HpPlan * KINDS),
                ("shared", HpPlan * KINDS), ("M", c_int)]


class HpMoe(ctypes.Structure):
    """hp_moe: a mixture's experts (each projection's expert 0 and the bytes to the next) and shape."""

    _fields_ = [("gate", HpPart), ("up", HpPart), ("down", HpPart), ("gate_stride", c_int64),
                ("up_stride", c_int64), ("down_stride", c_int64), ("X", c_int), ("E", c_int), ("I", c_int),
                ("int8", c_int)]


STRUCTS = (HpPart, HpLayer, HpStack, HpStep, HpPlan, HpAtt, HpMoe)  # hp_struct_layout's `which`, in order

_i, _f = c_int, c_float
SIGNATURES: dict[str, tuple[type | None, list]] = {
    "hp_qmatmul": (_i, [_i, _p, _i, _i, _p, _i, _p, _i]),
    "hp_dequantize": (_i, [_i, _p, _i, _i, _p]),
    "hp_qmatmul_i8": (_i, [_i, _p, _i, _i, _p, _i, _p, _i]),
    "hp_qmatmul_i8_parts": (_i, [POINTER(HpPart), _i, _p, _i, _i, _p, _i]),
    "hp_repack": (_i, [_i, _p, _i, _i, _p]),
    "hp_repacked_bytes": (c_long, [_i, _i, _i]),
    "hp_int8_vectorized": (_i, []),
    "hp_vector_paths": (_i, []),
    "hp_amx": (_i, [_i]),
    "hp_attend": (_i, [POINTER(HpAtt), POINTER(HpPlan), _i]),
    "hp_silu_mul": (None, [_p, _i, _i, _p, _i]),
    "hp_gelu_tanh_mul": (None, [_p, _i, _i, _p, _i]),
    "hp_kv_write": (None, [_p, _p, c_int64, _p, _i, _p, c_int64, _p, c_int64, _i, _i]),
    "hp_kv_write_fp8": (None, [_p, _p, c_int64, _p, _i, _p, c_int64, _p, c_int64, _i, _i, _i, _f, _f]),
    "hp_rmsnorm": (None, [_p, _i, _i, c_int64, _p, _f, _p, _i]),
    "hp_rope": (None, [_p, _i, _i, c_int64, _i, _p, _p, _i]),
    "hp_score_rows": (None, [_p, _i, _i, _p, _i, _p, _p, _p, _p, _i]),
    "hp_score_head": (_i, [POINTER(HpPart), _p, _i, _i, _p, _i, _p, _p, _p, _p, _i]),
    "hp_decode_layers": (_i, [POINTER(HpStack), POINTER(HpStep), _i]),
    "hp_moe_ffn": (_i, [POINTER(HpMoe), _p, _i, _p, _p, _i, _p, _p, _i]),
    "hp_struct_layout": (_i, [_i, POINTER(c_int64)]),
}


def struct_layout(cls: type[ctypes.Structure]) -> list[int]:
    """[sizeof, offset of each field in declaration order] of a ctypes mirror."""
    return [ctypes.sizeof(cls)] + [getattr(cls, name).offset for name, _ in cls._fields_]


def check_layouts(lib: ctypes.CDLL) -> None:
    """Raises RuntimeError when a mirror's size or field offsets differ from the C struct's."""
    for which, cls in enumerate(STRUCTS):
        out = (c_int64 * 32)()
        n = lib.hp_struct_layout(which, out)
        if list(out[:n]) != struct_layout(cls):
            raise RuntimeError(f"{cls.__name__} does not match the C struct (C {list(out[:n])}, "
                               f"ctypes {struct_layout(cls)}): rebuild or fix kernels/abi.py")


def bind(path: Path) -> ctypes.CDLL:
    """Load a built kernel library, declare its functions and check its structs.
    Raises OSError for a file that is not a library, RuntimeError for a struct mismatch."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    check_layouts(lib)
    return lib
