"""The GGUF block kernel (csrc/qgemv.c) against gguf's own dequantize and float32 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from hotprefix.model import qlinear
from hotprefix.model.qlinear import Linear, PackedWeight, qmatmul


def packed(type_name: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, size=(n, 1))).astype(np.float32)
    qt = GGMLQuantizationType[type_name]
    raw = quantize(w, qt)
    ref = torch.from_numpy(np.asarray(dequantize(raw, qt), dtype=np.float32).reshape(n, k))
    return PackedWeight.from_gguf(type_name, torch.from_numpy(raw), n, k), ref


# every code path of the C file: AVX-512, AVX2, and plain C (x86-64 without AVX)
MARCHES = ["native"]
if qlinear.platform.machine() == "x86_64":
    MARCHES += (["x86-64-v3"] if " avx2 " in qlinear._cpu_signature() + " " else []) + ["x86-64"]


@pytest.fixture(scope="module", params=MARCHES)
def lib(request):
    path = qlinear.build_library(march=request.param)
    assert path is not None, f"the kernel did not build for -march={request.param}"
    return qlinear.bind(path)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_kernel_dequantizes_exactly_like_gguf(type_name, lib):
    p, ref = packed(type_name, 37, 96)
    assert torch.equal(qlinear.dequantize(p, lib), ref)  # bit for bit


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
def test_kernel_matmul_equals_float32_matmul(type_name, m, lib):
    p, ref = packed(type_name, 200, 576, seed=m)
    x = torch.randn(m, 576)
    got, want = qmatmul(x, p, lib), x @ ref.t()
    assert got.shape == (m, 200)
    # the same products in another order: float32 rounding only
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_linear_uses_blocks_only_for_small_batches(monkeypatch):
    p, ref = packed("Q4_1", 64, 128)
    lin = Linear(128, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(ref)
        lin.bias.copy_(torch.randn(64))
    calls = []
    real = qlinear.qmatmul
    monkeypatch.setattr("hotprefix.model.qlinear.qmatmul", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    lin.packed = p
    for m in (1, qlinear.MAX_M, qlinear.MAX_M + 1):
        x = torch.randn(m, 128)
        assert torch.allclose(lin(x), x @ ref.t() + lin.bias, rtol=1e-5, atol=1e-4)
    assert calls == [1, qlinear.MAX_M]  # the larger batch ran on the float32 weights


def test_bad_shapes_are_refused():
    assert PackedWeight.from_gguf("Q4_1", torch.zeros(10, dtype=torch.uint8), 1, 40) is None  # K % 32
    assert PackedWeight.from_gguf("Q6_K", torch.zeros(10, dtype=torch.uint8), 1, 256) is None  # not read
