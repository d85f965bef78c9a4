"""The AMX tiles of the int8 products (csrc/int8_amx.c, int8_amx_kq.c) against the VNNI
kernels, bit for bit: every int8 block type, fused parts of mixed types, rows of x in
whole tiles of 16 and a partial tile (from 16 rows on) or a tail (VNNI: fewer than 16),
a padded last group, outliers and zero blocks. Collected
only where the CPU has amx_int8 (decided from /proc/cpuinfo); elsewhere the VNNI or AVX2
kernels are what runs and test_block_kernels.py compares every build's bits."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model.kernels import abi as kernel_abi
from hotprefix.model.kernels import build
from hotprefix.model.kernels.ops import qmatmul
from hotprefix.model.kernels.weights import FusedWeight
from tests.model.test_block_kernels import K_TYPES, TYPES, packed

pytestmark = pytest.mark.skipif("amx_int8" not in build._cpu_flags_line().split(),
                                reason="no AMX-INT8 on this CPU: the VNNI/AVX2 kernels run (test_block_kernels.py)")


@pytest.fixture(scope="module")
def lib():
    lib = kernel_abi.bind(build.build_library(march="native"))
    assert build.amx(lib, True), "the CPU has amx_int8 but the native build did not turn the tiles on"
    yield lib
    build.amx(lib, True)


def both(x: torch.Tensor, w, lib) -> tuple[torch.Tensor, torch.Tensor]:
    """The product with the tiles off, then on."""
    assert not build.amx(lib, False)
    off = qmatmul(x, w, lib)
    assert build.amx(lib, True)
    return off, qmatmul(x, w, lib)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [16, 17, 30, 37, 64, 130])  # one tile; one and a 1-row partial tile; one and a
# 14-row one (a warm prefix's 30-token question); 2 and a partial one; a chunk; 2 chunks and a 2-row tail (VNNI)
def test_amx_products_are_the_vnni_bits(type_name, m, lib):
    k = 768 if type_name in K_TYPES else 1088  # 3 super-blocks; 34 blocks: more than a slice of 16, odd tail
    g = packed(type_name, 200, k, seed=m)[0].regrouped(lib)  # 200 rows: the last group padded
    x = torch.randn(m, k)
    x[0, 5] = 40.0  # an outlier coarsens its block
    x[-1, 256:512] = 0.0  # a block of zeros has scale 0
    x[3, :256] = -x[3, :256].abs()  # a block of negatives: codes + 128 near 0
    off, on = both(x, g, lib)
    assert torch.equal(off, on)
    assert on.abs().max().item() > 0  # a product, not a zeroed buffer


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_1", "Q8_0"), ("Q5_K", "Q4_0", "Q5_1")])
def test_fused_amx_products_are_the_vnni_bits(types, lib):
    """A Q4_K_M layer's q|k|v, and parts of both block families over one x."""
    parts = [packed(t, n, 512, seed=i)[0].regrouped(lib) for i, (t, n) in enumerate(zip(types, (64, 40, 24)))]
    x = torch.randn(70, 512)
    off, on = both(x, FusedWeight(tuple(parts)), lib)
    assert torch.equal(off, on)


def test_the_tiles_are_reported_and_switched(lib):
    assert "int8 AMX tiles" in build.vector_paths(lib)
    assert not build.amx(lib, False) and "int8 AMX tiles" not in build.vector_paths(lib)
    assert build.amx(lib) is False  # asking does not switch
    assert build.amx(lib, True) and build.amx(lib)
