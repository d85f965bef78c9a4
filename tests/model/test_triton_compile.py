"""Every Triton kernel compiled ahead of time for sm_80 (A100) and sm_90 (H100, H200),
without a GPU, at the shapes, dtypes and tiles the launchers pick (issue 48): what
Triton's interpreter accepts but its compiler refuses (dot shapes, an fp8 type the
architecture lacks, shared memory past the card's) fails here, not on a lent GPU.

The kernels' module imports Triton interpreted where there is no CUDA, so the compiling
runs in a subprocess, this file run as a script (`python -m tests.model.test_triton_compile
90`), which imports the module with Triton's compiler (torch.cuda.is_available patched to
True for that import only). There the launchers run on CPU tensors with each kernel
replaced by a recorder of its launch; each launch is bound as Triton's JIT binds it at a
real launch (signature, constexprs, 16-byte alignment and divisibility) and compiled by
triton.compile for a GPUTarget down to a cubin (Triton's wheel carries ptxas). Compiled
kernels land in Triton's cache (~/.triton/cache): a rerun of unchanged kernels takes
seconds, a first run about 2 minutes of CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (80, 90)
# cudaDevAttrMaxSharedMemoryPerBlockOptin (A100; H100 and H200): Triton refuses a launch past it
SHARED_MEMORY = {80: 166912, 90: 232448}
KERNELS = ("_kv_write_kernel", "_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel")
NO_BINDER = 3  # the subprocess's exit status when this Triton binds launches differently


@dataclass(frozen=True)
class Case:
    """One paged_attention call: a model's attention shape, the compute dtype and
    --kv-cache-dtype, a decode step (max_query_len 1, split-K into `splits`) or a prefill."""

    shape: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kv: str = "auto"
    max_query_len: int = 1
    splits: int = 16

    @property
    def label(self) -> str:
        step = f"decode-splits{self.splits}" if self.max_query_len == 1 else f"prefill-q{self.max_query_len}"
        return f"{self.shape}-{self.dtype}-kv_{self.kv}-{step}"


LLAMA_8B = ("llama-3.1-8b", 32, 8, 128)  # also mistral-7b, qwen3-8b; llama-3.2-3b pads GQA 3 to 4
LLAMA_1B = ("llama-3.2-1b", 32, 8, 64)
GQA_8 = ("llama-3.1-70b", 64, 8, 128)  # also qwen3-32b; qwen2.5-7b pads GQA 7 to 8
SMOLLM2 = ("smollm2-135m", 9, 3, 64)  # GQA 3, padded to 4
TINY = ("tests-tiny-qwen3", 4, 2, 32)  # tests/model/test_gpu.py's model (float32 there)
MHA = ("mha", 4, 4, 64)  # GQA 1: the launch specialises G == 1
MQA = ("mqa", 8, 1, 128)  # one KV head: the launch specialises KVH == 1
PREFILL_TILES = (64, 32, 16)  # max_query_len > 32, 17..32, <= 16: BLOCK_M 64, 32, 16


def cases() -> list[Case]:
    """Every dtype pair at the Llama-8B shape at the largest prefill tile (the most shared
    memory) and in decode; every tile, split count and GQA padding at bf16; the 1B shape
    with fp8; the tests' tiny model in float32 (the GPU tests run it so)."""
    out = [Case(*LLAMA_8B, dtype, kv, q) for dtype in ("bfloat16", "float16") for kv in ("auto", "fp8", "fp8_e5m2")
           for q in (64, 1)]
    out += [Case(*LLAMA_8B, max_query_len=q) for q in PREFILL_TILES[1:]]
    out += [Case(*LLAMA_8B, splits=s) for s in (1, 3)]  # the reduce kernel's S_P2: 1, 4 (16 above)
    out.append(Case(*LLAMA_8B, "float32", "auto", 64))
    out += [Case(*LLAMA_1B, "bfloat16", kv, q) for kv in ("auto", "fp8") for q in (64, 16, 1)]
    out += [Case(*GQA_8, "bfloat16", kv) for kv in ("auto", "fp8")]
    out += [Case(*shape) for shape in (SMOLLM2, MHA, MQA)]
    out += [Case(*TINY, "float32", kv, q) for kv in ("auto", "fp8", "fp8_e5m2") for q in (64, 16, 1)]
    out += [Case(*TINY, "bfloat16", "auto", q) for q in (64, 1)]
    return out


CASES = cases()


# -- the subprocess ---------------------------------------------------------------------

def launch(ta, case: Case) -> None:
    """paged_attention for case on CPU tensors (the kernels are recorders here): two
    sequences of max_query_len new tokens each."""
    import torch

    from hotprefix.model.kv_cache import LayerKV, resolve_kv_dtype

    dtype = getattr(torch, case.dtype)
    kv_dtype = resolve_kv_dtype(case.kv, dtype)
    t, d = 2 * case.max_query_len, case.head_dim
    layer = LayerKV(0, torch.zeros(case.kv_heads, 64, d, dtype=kv_dtype),
                    torch.zeros(case.kv_heads, 64, d, dtype=kv_dtype))
    q = torch.zeros(t, case.heads, d, dtype=dtype)
    k = torch.zeros(t, case.kv_heads, d, dtype=dtype)
    meta = ta.TritonMeta(torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 64, dtype=torch.int32),
                         torch.arange(0, t + 1, case.max_query_len, dtype=torch.int32), case.max_query_len, 16,
                         case.splits)
    ta.paged_attention(q, k, k.clone(), layer, torch.zeros(t, dtype=torch.long), meta, d ** -0.5)


def why(e: BaseException) -> str:
    """A compile error: where in the kernel, and its innermost cause (Triton nests one per
    inlined call; the message is in the last)."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(nxt)
    return "\n  caused by: ".join(f"{type(x).__name__}: {x}"[-700:] for x in (chain[0], chain[-1])[:len(chain)])


def compile_all(capability: int) -> int:
    """Compile every case's launches for sm_<capability>; one JSON line per case on
    stdout: {"case", "kernels": [{"kernel", "constexprs", "error", "shared", "cubin"}]}."""
    from unittest import mock

    import torch

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        from hotprefix.model.kernels import triton_attention as ta
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit

    assert not ta.INTERPRETED
    if not hasattr(jit, "create_function_from_signature") or not hasattr(jit.JITFunction, "_pack_args"):
        print(f"triton {triton.__version__} binds launches differently (written against 3.9)", file=sys.stderr)
        return NO_BINDER
    launches: list[tuple] = []

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for name in KERNELS:
        setattr(ta, name, Recorder(getattr(ta, name)))
    ta.e4m3_native = lambda device: capability >= 89  # what the launcher finds on such a GPU
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    done: dict[tuple, dict] = {}
    for case in CASES:
        launches.clear()
        launch(ta, case)
        results = []
        for kernel, args, kwargs in launches:
            binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
            key = (kernel.__name__, repr(signature), repr(constexprs), repr(attrs))
            if key not in done:
                r = {"kernel": kernel.__name__, "constexprs": kwargs, "error": None, "shared": None, "cubin": False}
                try:
                    c = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                       options=options.__dict__)
                    r.update(shared=c.metadata.shared, cubin="cubin" in c.asm)
                except Exception as e:  # reported per kernel: the test names the case
                    r["error"] = why(e)
                done[key] = r
            results.append(done[key])
        print(json.dumps({"case": case.label, "kernels": results}), flush=True)
    return 0


# -- the tests --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled() -> dict[int, dict[str, list[dict]]]:
    """{capability: {case label: its kernels' results}}, the targets compiled side by side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {cap: subprocess.Popen([sys.executable, "-m", "tests.model.test_triton_compile", str(cap)], cwd=ROOT,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cap in TARGETS}
    out = {}
    for cap, p in procs.items():
        stdout, stderr = p.communicate(timeout=1500)
        assert p.returncode != NO_BINDER, "Triton's compiler binder is part of the pinned triton: " + stderr.strip()
        assert p.returncode == 0, stderr[-4000:]
        out[cap] = {r["case"]: r["kernels"] for r in map(json.loads, stdout.splitlines())}
    return out


@pytest.mark.parametrize("capability", TARGETS)
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_kernels_compile(compiled, capability, case):
    """The case's kernels (the write, then the prefill or the decode and its reduce)
    compile to a cubin for sm_<capability> within the card's shared memory."""
    kernels = compiled[capability][case.label]
    assert [k["kernel"] for k in kernels] == (["_kv_write_kernel", "_prefill_kernel"] if case.max_query_len > 1 else
                                              ["_kv_write_kernel", "_decode_kernel", "_decode_reduce_kernel"])
    for k in kernels:
        assert k["error"] is None, f"{k['kernel']} {k['constexprs']}: {k['error']}"
        assert k["cubin"] and k["shared"] <= SHARED_MEMORY[capability], k


def test_every_tile_the_launchers_pick_is_compiled(compiled):
    """The cases reach every tile the launchers choose: BLOCK_M 16/32/64, the GQA group
    padded to 1/2/4/8, head sizes 32/64/128, each fp8 kind the target gets (e4m3 in
    integers on sm_80, which has no fp8e4nv), and the reduce over 1, 4 and 16 splits."""
    for cap in TARGETS:
        seen: dict[str, set] = {}
        for kernels in compiled[cap].values():
            for k in kernels:
                for name, value in k["constexprs"].items():
                    seen.setdefault(f"{k['kernel']}.{name}", set()).add(value)
        assert seen["_prefill_kernel.BLOCK_M"] == {16, 32, 64}
        assert seen["_decode_kernel.G_P2"] == {1, 2, 4, 8}
        assert seen["_prefill_kernel.D_P2"] == seen["_decode_kernel.D_P2"] == {32, 64, 128}
        assert seen["_decode_reduce_kernel.S_P2"] == {1, 4, 16}
        fp8 = {0, 2, 1 if cap >= 89 else 3}
        assert seen["_kv_write_kernel.FP8"] == seen["_prefill_kernel.FP8"] == seen["_decode_kernel.FP8"] == fp8


if __name__ == "__main__":
    sys.exit(compile_all(int(sys.argv[1])))
