"""The GPU path proven on the CPU: the triton attention backend (Triton's interpreter)
inside the whole model against the torch reference backend, CUDA-graph padding run
eagerly, and --load-format dummy. (tests/model/test_gpu.py runs compiled on CUDA.)"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config import AttentionBackend, CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model.attention import resolve_backend
from hotprefix.model.dummy import dummy_weights
from hotprefix.model.loader import load_dummy, load_model
from hotprefix.model.runner import ALL_PATHS, ModelRunner
from hotprefix.model.steps.cuda_graphs import DecodeGraphs, default_sizes
from tests.conftest import build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-path-tiny")
    build_tiny_model(d, "qwen3", seed=7)  # GQA 2, head size 32, q/k norms
    return str(d)


def runner(model: str, backend: str, kv: str = "auto", blocks: int = 40, **model_kw) -> ModelRunner:
    return ModelRunner(load_model(model), ModelConfig(device="cpu", attention_backend=backend, **model_kw),
                       CacheConfig(block_size=4, num_blocks_override=blocks, kv_cache_dtype=kv), SchedulerConfig())


def step(*reqs: tuple[str, list[int], int, list[int]]) -> SchedulerOutput:
    """(id, all prompt ids, start, block ids) -> one chunk each, from start to the end."""
    return SchedulerOutput([ScheduledRequest(rid, ids[start:], start, blocks, True, SamplingParams(), ids, [])
                            for rid, ids, start, blocks in reqs])


A = list(range(3, 40))  # 37 tokens
B = A[:16] + list(range(100, 121))  # shares A's first four blocks


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_triton_backend_logits_match_the_torch_backend(tiny, kv):
    """The same steps through both backends: a cold prefill, a chunk after a cached
    prefix with a shared prefix's blocks (B reuses A's 0-3), then a batch of decodes."""
    blocks_b = [0, 1, 2, 3, 20, 21, 22, 23, 24, 25]
    steps = [step(("a", A[:21], 0, list(range(6)))),
             step(("a", A, 21, list(range(10))), ("b", B, 16, blocks_b)),
             step(("a", A + [5], 37, list(range(10))), ("b", B + [6], 37, blocks_b))]
    ref, tri = runner(tiny, "torch", kv), runner(tiny, "triton", kv)
    # no CUDA: interpreted, eager
    assert tri.backend_kind is AttentionBackend.TRITON and tri.strategy(DecodeGraphs) is None
    # fp8: a key one float32 rounding apart in layer 0 can land on the next e4m3 value (6 %),
    # which moves later layers' outputs and the logits by ~1e-4 (the KV check below)
    tol = 1e-3 if kv == "fp8" else 1e-5
    for so in steps:
        want, got = ref.all_logits(so), tri.all_logits(so)
        assert float((got - want).abs().max() / want.abs().max()) <= tol
    used = torch.tensor([p // 4 * 4 + p % 4 for p in range(38)] + [blocks_b[p // 4] * 4 + p % 4 for p in range(16, 38)])
    for i, (a, b) in enumerate(zip(ref.kv_cache.layers, tri.kv_cache.layers)):
        if i == 0:  # the same inputs: the written slots hold the same bytes
            assert torch.equal(a.k[:, used].view(torch.uint8), b.k[:, used].view(torch.uint8))
            assert torch.equal(a.v[:, used].view(torch.uint8), b.v[:, used].view(torch.uint8))
        for x, y in zip(a.read(used, torch.float32), b.read(used, torch.float32)):  # later: within rounding
            bound = x.abs() / 8 + 1e-6 if kv == "fp8" else 1e-5 * x.abs().max()  # (fp8: one e4m3 value apart)
            assert ((x - y).abs() <= bound).all()


def test_generation_is_token_identical_across_backends(tiny):
    prompts = [A, B, A[:9]]
    outs = {b: [o.outputs[0].token_ids for o in LLM(tiny, device="cpu", block_size=4, num_blocks_override=64,
                                                     attention_backend=b).generate(prompts, GREEDY)]
            for b in ("torch", "cpu", "triton")}
    assert outs["triton"] == outs["torch"] == outs["cpu"]


def test_decode_graph_padding_equals_the_eager_step(tiny):
    """DecodeGraphs' padded batch (run eagerly: no CUDA here) gives the eager step's
    hidden states, writes the KV of the real rows only, and a step it cannot serve
    (a prefill) is left to the eager path."""
    r = runner(tiny, "triton", blocks=40)
    r.forward(step(("a", A, 0, list(range(10))), ("b", B, 0, list(range(10, 20)))))
    graphs = DecodeGraphs(r.model, r.kv_cache, (1, 4), 16, 2, (None,), r.device, capture=False)
    so = step(("a", A + [5], 37, list(range(10))), ("b", B + [6], 37, list(range(10, 20))))
    pool = [(layer.k.clone(), layer.v.clone()) for layer in r.kv_cache.layers]
    want = r.forward(so)  # eager (no CUDA graphs without CUDA)
    after = [(layer.k.clone(), layer.v.clone()) for layer in r.kv_cache.layers]
    for layer, (k, v) in zip(r.kv_cache.layers, pool):
        layer.k.copy_(k)
        layer.v.copy_(v)
    batch, meta = r.prepare(so, ALL_PATHS)
    assert graphs.refusal(batch, meta, ALL_PATHS) is None
    got = graphs.forward(batch, meta)  # padded to 4 rows
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    real = meta.slot_mapping  # the two decodes' slots
    rest = torch.ones(r.kv_cache.layers[0].k.shape[1], dtype=torch.bool)
    rest[real] = False
    for layer, (k, v), (k2, v2) in zip(r.kv_cache.layers, pool, after):
        u8 = torch.uint8  # (bytes: the pool is uninitialised, so it may hold NaNs)
        assert torch.equal(layer.k[:, rest].view(u8), k[:, rest].view(u8))  # the padding
        assert torch.equal(layer.v[:, rest].view(u8), v[:, rest].view(u8))
        assert torch.allclose(layer.k[:, real], k2[:, real], atol=1e-5)  # wrote nothing; the real rows as eager
        assert torch.allclose(layer.v[:, real], v2[:, real], atol=1e-5)
    pbatch, prefill = r.prepare(step(("c", A, 0, list(range(20, 30)))), ALL_PATHS)
    assert graphs.refusal(pbatch, prefill, ALL_PATHS) == "not a decode-only step"
    five = replace(batch, input_ids=torch.zeros(5, dtype=torch.long))
    assert graphs.refusal(five, meta, ALL_PATHS) == "larger than the largest graph captured"


def test_decode_graph_padding_on_a_grouped_pool_equals_the_eager_step(tmp_path):
    """A Gemma 3 grouped pool (blocks of 4: one full group and six window groups of one
    layer each): the graphs' buffers hold every group's table and slots, the window
    groups' tables naming the null block (NaN) where a window released one; the padded
    batch gives the eager step's hidden states and writes only the real rows' slots."""
    build_tiny_model(tmp_path, "gemma3", seed=3)
    r = runner(str(tmp_path), "triton", blocks=140)
    kv, groups = r.kv_cache, r.kv_groups
    assert groups.windows == (None,) + (8,) * 6
    null = kv.null_block
    for page in kv.pages:
        page.k[:, null * 4:(null + 1) * 4] = page.v[:, null * 4:(null + 1) * 4] = float("nan")

    def req(rid: str, ids: list[int], start: int, blocks: list[int], released: bool = False) -> ScheduledRequest:
        gone = max(0, len(ids) - 8) // 4 if released else 0  # blocks wholly before the last position's window
        tables = (blocks,) + tuple([null] * gone + [b + 20 * g for b in blocks[gone:]] for g in range(1, 7))
        return ScheduledRequest(rid, ids[start:], start, blocks, True, SamplingParams(), ids, [],
                                group_block_ids=tables)

    r.forward(SchedulerOutput([req("a", A, 0, list(range(10))), req("b", B, 0, list(range(10, 20)))]))
    windows = tuple(dict.fromkeys(r.model.arch.layer_windows))
    graphs = DecodeGraphs(r.model, kv, (1, 4), 16, 2, windows, r.device, capture=False, groups=groups)
    so = SchedulerOutput([req("a", A + [5], 37, list(range(10)), True),
                          req("b", B + [6], 37, list(range(10, 20)), True)])
    assert so.requests[0].group_block_ids[1][:8] == [null] * 7 + [27]
    pool = [(page.k.clone(), page.v.clone()) for page in kv.pages]
    want = r.forward(so)  # eager
    for page, (k, v) in zip(kv.pages, pool):
        page.k.copy_(k)
        page.v.copy_(v)
    batch, meta = r.prepare(so, ALL_PATHS)
    assert graphs.refusal(batch, meta, ALL_PATHS) is None
    got = graphs.forward(batch, meta)  # padded to 4 rows
    assert bool(got.isfinite().all()) and torch.allclose(got, want, atol=1e-5, rtol=0)
    assert graphs.slot_mapping[:, 2:].eq(-1).all() and graphs.seq_lens[2:].eq(0).all()
    for g, (slots, t) in enumerate(meta.tables()):
        assert graphs.slot_mapping[g, :2].equal(slots) and graphs.block_tables[g, :2, :10].equal(t.block_tables)
    rest = torch.ones(kv.pages[0].k.shape[1], dtype=torch.bool)
    rest[torch.cat([s for s, _ in meta.tables()])] = False
    for page, (k, v) in zip(kv.pages, pool):  # (bytes: the pool is uninitialised, so it may hold NaNs)
        assert torch.equal(page.k[:, rest].view(torch.uint8), k[:, rest].view(torch.uint8))
        assert torch.equal(page.v[:, rest].view(torch.uint8), v[:, rest].view(torch.uint8))
    one_table = replace(meta, windows={None: meta.triton}, group_slots={})  # a step of one block table
    assert graphs.refusal(batch, one_table, ALL_PATHS) == "other sliding windows"


def test_default_graph_sizes():
    assert default_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_sizes(3) == (1, 2, 3)
    assert default_sizes(20) == (1, 2, 4, 8, 16, 20)


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend(AttentionBackend.AUTO, cpu) is AttentionBackend.CPU
    assert resolve_backend(AttentionBackend.AUTO, cuda) is AttentionBackend.TRITON
    assert resolve_backend(AttentionBackend.TORCH, cpu) is AttentionBackend.TORCH
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        resolve_backend(AttentionBackend.CPU, cuda)
    with pytest.raises(ConfigError, match="--attention-backend must be one of"):
        ModelConfig(attention_backend="flash")


def test_dummy_load_of_a_config_folder_equals_loading_those_weights(tiny, tmp_path):
    """A folder with only config.json (and the tokenizer) serves random weights; saved
    as safetensors and loaded normally, the same weights give the same logits."""
    from safetensors.torch import save_file

    loaded = load_dummy(tiny)
    assert loaded.dummy and loaded.weights == {} and loaded.arch.num_layers == 2
    weights = dummy_weights(loaded.arch, torch.float32, torch.device("cpu"), seed=3)
    assert torch.equal(weights["model.norm.weight"], torch.ones(loaded.arch.hidden_size))
    assert torch.equal(weights["model.layers.1.self_attn.q_proj.weight"],
                       dummy_weights(loaded.arch, torch.float32, torch.device("cpu"), seed=3)[
                           "model.layers.1.self_attn.q_proj.weight"])
    real = tmp_path / "saved"
    real.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny, f), real / f)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(real / "model.safetensors"))
    so = step(("a", A, 0, list(range(10))))
    dummy = ModelRunner(loaded, ModelConfig(device="cpu", seed=3, attention_backend="torch"),
                        CacheConfig(block_size=4, num_blocks_override=16), SchedulerConfig())
    saved = runner(str(real), "torch", blocks=16)
    assert torch.equal(dummy.all_logits(so), saved.all_logits(so))


def test_dummy_named_shapes_and_the_default_tokenizer():
    a = load_dummy("llama-3.1-8b")
    assert (a.arch.num_layers, a.arch.hidden_size, a.arch.num_kv_heads, a.arch.vocab_size, a.arch.rope_type) == \
        (32, 4096, 8, 128256, "llama3")
    assert a.tokenizer.decode(a.tokenizer.encode("hello world")).endswith("hello world")
    q = load_dummy("qwen3-8b").arch
    assert (q.family, q.num_layers, q.head_dim, q.qk_norm) == ("qwen3", 36, 128, True)
    with pytest.raises(Exception, match="does not exist"):
        load_dummy("no-such-shape-7b")


def test_dummy_generates_through_the_offline_api(tiny):
    outs = LLM(tiny, load_format="dummy", device="cpu", block_size=4, num_blocks_override=32).generate([A], GREEDY)
    again = LLM(tiny, load_format="dummy", device="cpu", block_size=4, num_blocks_override=32).generate([A], GREEDY)
    assert len(outs[0].outputs[0].token_ids) == 6
    assert outs[0].outputs[0].token_ids == again[0].outputs[0].token_ids  # the seed fixes the weights
