"""The GGUF block kernels (csrc/) against gguf's own dequantize and float32 matmul, for
every block type they read, on every vector path of the C files (AVX-512 VNNI too, through
the simulated build, on any AVX2 machine)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from hotprefix.model.kernels import abi as kernel_abi
from hotprefix.model.kernels import build, ops
from hotprefix.model.kernels.ops import qmatmul
from hotprefix.model.kernels.weights import FusedWeight, PackedWeight, fuse
from hotprefix.model.layers import Linear
from tests.kquants import quantize

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
# bytes of one regrouped unit (16 rows x one block; csrc/repack.c's layouts)
UNIT_BYTES = {"Q4_0": 288, "Q4_1": 320, "Q5_0": 544, "Q5_1": 576, "Q8_0": 544, "Q4_K": 2368, "Q5_K": 2880,
              "Q6_K": 3360}


def packed(type_name: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, size=(n, 1))).astype(np.float32)
    raw = quantize(w, type_name)
    ref = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32).reshape(n, k))
    return PackedWeight.from_gguf(type_name, torch.from_numpy(raw), n, k), ref


# every code path of the C files: AVX-512 (VNNI), AVX2, and plain C (x86-64 without AVX); the
# AVX-512 paths also as a simulated build (sim512.h) where the CPU has AVX2 to host it
MARCHES = [("native", ())]
if platform.machine() == "x86_64":
    if " avx2 " in build._cpu_signature() + " ":
        MARCHES += [("x86-64-v3", ()), ("x86-64-v3", ("HP_SIM512",))]
    MARCHES += [("x86-64", ())]


@pytest.fixture(scope="module", params=MARCHES, ids=lambda p: "+".join((p[0], *p[1])))
def lib(request):
    march, defines = request.param
    path = build.build_library(march=march, defines=defines)
    assert path is not None, f"the kernel did not build for -march={march} {defines}"
    return kernel_abi.bind(path)


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_dequantizes_exactly_like_gguf(type_name, lib):
    p, ref = packed(type_name, 37, 512)
    assert torch.equal(ops.dequantize(p, lib), ref)  # bit for bit


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
def test_kernel_matmul_equals_float32_matmul(type_name, m, lib):
    k = 768 if type_name in K_TYPES else 576
    p, ref = packed(type_name, 200, k, seed=m)
    x = torch.randn(m, k)
    got, want = qmatmul(x, p, lib), x @ ref.t()
    assert got.shape == (m, 200)
    # the same products in another order: float32 rounding only
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_linear_reads_its_blocks_at_every_batch_size(monkeypatch):
    p, ref = packed("Q4_1", 64, 128)
    lin = Linear(None, torch.randn(64), p)  # no float32 weight: the blocks serve every batch
    calls = []
    real = ops.qmatmul
    monkeypatch.setattr("hotprefix.model.kernels.ops.qmatmul", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    for m in (1, 16, 17, 300):
        x = torch.randn(m, 128)
        assert torch.allclose(lin(x), x @ ref.t() + lin.bias, rtol=1e-5, atol=1e-4)
    assert calls == [1, 16, 17, 300]


@pytest.fixture(scope="module")
def every_lib():
    return [kernel_abi.bind(build.build_library(march=m, defines=d)) for m, d in MARCHES]


@pytest.mark.parametrize("type_name", ["F32", *TYPES])
def test_float32_products_are_the_same_bits_in_every_build_and_batch(type_name, every_lib):
    """Each output is one 16-lane dot product: a row of x gives the same bits alone or among
    40 (M crosses the passes of 16 and 6 rows), on every build (AVX-512 simulated, AVX2, plain C)."""
    k = 768 if type_name in K_TYPES else 576
    if type_name == "F32":
        p = PackedWeight.from_float(torch.randn(50, k, generator=torch.Generator().manual_seed(3)))
    else:
        p = packed(type_name, 50, k, seed=4)[0]
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    outs = [qmatmul(x, p, lb) for lb in every_lib]
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:])
    for i in (0, 5, 17, 39):
        assert torch.equal(qmatmul(x[i:i + 1], p, every_lib[0]), outs[0][i:i + 1])
    assert torch.equal(qmatmul(x[16:23], p, every_lib[-1]), outs[0][16:23])


def test_bad_shapes_are_refused(native_lib):
    assert PackedWeight.from_gguf("Q4_1", torch.zeros(10, dtype=torch.uint8), 1, 40) is None  # K % 32
    assert PackedWeight.from_gguf("Q4_K", torch.zeros(90, dtype=torch.uint8), 1, 160) is None  # K % 256
    assert PackedWeight.from_gguf("Q3_K", torch.zeros(110, dtype=torch.uint8), 1, 256) is None  # not read
    x = torch.zeros(1, 160)
    for fn in (native_lib.hp_qmatmul, native_lib.hp_qmatmul_i8):  # the C side refuses them too
        assert fn(12, x.data_ptr(), 1, 160, x.data_ptr(), 1, x.data_ptr(), 1) == -1
        assert fn(11, x.data_ptr(), 1, 256, x.data_ptr(), 1, x.data_ptr(), 1) == -1  # Q3_K
    assert native_lib.hp_repacked_bytes(12, 16, 160) == -1 and native_lib.hp_repacked_bytes(11, 16, 256) == -1


@pytest.fixture(scope="module")
def native_lib():
    return kernel_abi.bind(build.build_library(march="native"))


def quantized_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] as the int8 kernel quantizes it (per `block` values, 32 or 256 for the
    K-quants: q = round(x * 127 / max|x|), dx = max|x| / 127), returned as q * dx in
    float64. Computed in numpy float32, because torch's scalar / tensor is a reciprocal
    times the scalar and rounds differently."""
    xb = x.numpy().reshape(x.shape[0], -1, block).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return torch.from_numpy((q * (amax / np.float32(127))).astype(np.float64).reshape(x.shape))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 7, 8, 9, 40, 64, 130])  # (64 rows of x a chunk: 130 = 2 chunks and 2 rows)
def test_int8_product_is_the_quantized_activations_times_the_weights(type_name, m, lib, native_lib):
    k, bv = (768, 256) if type_name in K_TYPES else (576, 32)
    p, ref = packed(type_name, 200, k, seed=m)  # 200 rows: the last group of 16 is padded
    x = torch.randn(m, k)
    x[0, 5] = 40.0  # an outlier coarsens its block
    x[-1, 256:512] = 0.0  # a block of zeros has scale 0
    g = p.regrouped(lib)
    assert g.int8
    assert g.nbytes == 13 * (k // bv) * UNIT_BYTES[type_name]  # 13 groups of 16 rows, the last padded
    got = qmatmul(x, g, lib)
    want = quantized_rows(x, bv) @ ref.double().t()
    # the integer sums are exact; the scales are applied in float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # every build (VNNI, plain C) repacks the same bytes and returns the same bits
    g_native = p.regrouped(native_lib)
    assert torch.equal(g.raw, g_native.raw)
    assert torch.equal(got, qmatmul(x, g_native, native_lib))
    # and what the quantization costs against float32 activations: about 1% RMS; per 256
    # values the outlier coarsens 8x more values (up to 3.7% when its row is the only one)
    exact = x.double() @ ref.double().t()
    rel = ((got.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    assert rel < (0.05 if bv == 256 else 0.03), rel


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_K"), ("Q5_0", "Q5_1", "Q4_0")])
def test_fused_products_of_mixed_types_are_their_parts_side_by_side(types, lib):
    """A Q4_K_M layer's q, k (Q4_K) and v (Q6_K) in one product; block families mixed
    (per-32 and per-256 activations) over the same x: each part's columns are the bits of
    its own product."""
    parts = [packed(t, n, 512, seed=i)[0] for i, (t, n) in enumerate(zip(types, (64, 40, 24)))]
    x = torch.randn(9, 512)
    rows = FusedWeight(tuple(parts))
    got_f32 = qmatmul(x, rows, lib)
    assert torch.equal(got_f32, torch.cat([qmatmul(x, p, lib) for p in parts], dim=1))
    fused = rows.regrouped(lib)
    assert fused.int8 and fused.n == sum(p.n for p in parts) and fused.k == 512
    got = qmatmul(x, fused, lib)
    assert torch.equal(got, torch.cat([qmatmul(x, p.regrouped(lib), lib) for p in parts], dim=1))
    with pytest.raises(ValueError):  # one K and one form
        FusedWeight((parts[0], packed("Q4_K", 16, 256)[0]))
    assert fuse([parts[0], parts[1].regrouped(lib)]) is None and fuse([parts[0], None]) is None


def test_int8_weights_serve_every_batch_size(monkeypatch):
    p, ref = packed("Q8_0", 48, 64)
    lin = Linear(None, None, p.regrouped())  # int8 blocks serve every batch: no float32 weight
    calls = []
    real = ops.qmatmul
    monkeypatch.setattr("hotprefix.model.kernels.ops.qmatmul", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    x = torch.randn(300, 64)
    assert torch.allclose(lin(x).double(), quantized_rows(x) @ ref.double().t(), rtol=1e-5, atol=1e-4)
    assert calls == [300]
    with pytest.raises(RuntimeError, match="regrouped"):
        ops.dequantize(lin.blocks)


def test_auto_takes_int8_only_where_it_is_vectorized(native_lib):
    want = "int8" if native_lib.hp_int8_vectorized() else "float32"
    assert build.resolve_matmul("auto") == want
    assert build.resolve_matmul("float32") == "float32" and build.resolve_matmul("int8") == "int8"
    with pytest.raises(ValueError, match="--quantized-matmul"):
        build.resolve_matmul("int4")


def test_silu_mul_matches_torch(lib):
    gate_up = torch.randn(7, 2 * 100) * 6
    gate_up[0, :6] = torch.tensor([0.0, -1000.0, 1000.0, 88.0, -88.0, 1e-30])  # underflow, overflow, zero
    got = ops.silu_mul(gate_up, lib)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == (7, 100)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-30)


def test_rms_norm_and_rope_match_torch(lib):
    from hotprefix.model.layers import RMSNorm, TorchOps, rotate_half

    norm = RMSNorm(torch.randn(64), 1e-5, TorchOps())
    rows = torch.randn(5, 3 * 64)[:, 64:128]  # rows apart, as the model's views are
    assert torch.allclose(ops.rms_norm(rows, norm.weight, 1e-5, lib), norm(rows), rtol=1e-5, atol=1e-6)
    qkv = torch.randn(4, (3 + 2) * 16)
    q = qkv[:, :48].view(4, 3, 16)  # 3 heads of 16, inside a wider row
    want = q * 0 + q  # a copy
    cos, sin = torch.randn(4, 1, 8).repeat(1, 1, 2), torch.randn(4, 1, 8).repeat(1, 1, 2)  # halves equal
    want = want * cos + rotate_half(want) * sin
    untouched = qkv[:, 48:].clone()
    assert ops.rope_(q, cos, sin, lib) is q
    assert torch.allclose(q, want, rtol=1e-5, atol=1e-6) and torch.equal(qkv[:, 48:], untouched)


def test_the_flags_reported_with_benchmarks_are_the_ones_the_native_build_used(native_lib):
    """cpu_vector_flags (written into every benchmark result) says AVX2 or AVX-512 VNNI
    exactly when the native kernel build multiplies int8 on vector instructions."""
    flags = build.cpu_vector_flags()
    assert set(flags) <= {"amx_int8", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "fma"} and flags == sorted(flags)
    assert bool(native_lib.hp_int8_vectorized()) == bool({"avx2", "avx512_vnni"} & set(flags))
    assert ("amx_int8" in flags) == ("amx_int8" in build._cpu_flags_line().split())


def test_a_struct_edited_on_one_side_is_refused_at_load(native_lib, monkeypatch):
    """kernel_abi's ctypes mirrors are checked against the C structs' sizes and offsets."""
    kernel_abi.check_layouts(native_lib)  # as built: they match

    class Shifted(kernel_abi.ctypes.Structure):
        _fields_ = [("qtype", kernel_abi.c_int), ("w", kernel_abi.c_void_p), ("n", kernel_abi.c_int)]

    monkeypatch.setattr(kernel_abi, "STRUCTS", (Shifted, *kernel_abi.STRUCTS[1:]))
    with pytest.raises(RuntimeError, match="Shifted does not match"):
        kernel_abi.check_layouts(native_lib)
