"""The C library's interface is stated once (csrc/hp_api.h) and Python's ctypes table
(kernel_abi.SIGNATURES) says the same: every exported function, its return type and each
parameter's type, by name; the structs are compared byte for byte at bind()
(check_layouts, tested in test_qlinear.py)."""

from __future__ import annotations

import ctypes
import re

from hotprefix.model.kernels.abi import SIGNATURES
from hotprefix.model.kernels.build import CSRC

# a C parameter type -> the ctypes type kernel_abi declares for it
C_TO_CTYPES = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float, "int64_t": ctypes.c_int64,
               "void": None}
PROTOTYPE = re.compile(r"^(int|long|void)\s+(hp_\w+)\(([^)]*)\);", re.M | re.S)


def c_declarations() -> dict[str, tuple[str, list[str]]]:
    text = (CSRC / "hp_api.h").read_text()
    out = {}
    for ret, name, params in PROTOTYPE.findall(text):
        args = [] if params.strip() == "void" else [" ".join(p.split()) for p in params.split(",")]
        out[name] = (ret, args)
    return out


def matches(param: str, ct) -> bool:
    """Whether ctypes type `ct` declares C parameter `param`: a scalar by its ctypes type; a
    pointer as c_void_p, or as POINTER(the same scalar or the mirrored struct)."""
    decl = param.replace("const ", "")
    if "*" not in decl:
        return ct is C_TO_CTYPES[decl.rsplit(" ", 1)[0]]
    base = decl.split("*")[0].strip()
    pointee = getattr(ct, "_type_", None)
    if base.startswith("hp_"):  # hp_part -> HpPart, hp_stack -> HpStack, ...
        return isinstance(pointee, type) and pointee.__name__.lower() == base.replace("_", "")
    return ct is ctypes.c_void_p or pointee is C_TO_CTYPES.get(base)


def test_every_exported_function_has_the_same_signature_on_both_sides():
    declared = c_declarations()
    assert len(declared) >= 14 and set(declared) == set(SIGNATURES)
    for name, (ret, params) in declared.items():
        restype, argtypes = SIGNATURES[name]
        assert restype is C_TO_CTYPES[ret], name
        assert len(argtypes) == len(params), name
        for param, ct in zip(params, argtypes):
            assert matches(param, ct), (name, param, ct)


def test_every_definition_is_checked_against_the_header():
    """Each .c file that defines an exported function includes hp_api.h (so gcc compares them)."""
    for path in sorted(CSRC.glob("*.c")):
        text = path.read_text()
        if re.search(r"^(int|long|void) hp_\w+\(", text, re.M):
            assert '#include "hp_api.h"' in text, path.name
