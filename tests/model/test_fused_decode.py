"""The fused decode step (model/fused_decode.py, csrc/decode.c's hp_decode_layers) gives
the same bits as the layer-by-layer int8 path, writes the same keys and values, and
serves exactly the steps it was built for."""

from __future__ import annotations

import pytest
import torch

from hotprefix.config import CacheConfig, ModelConfig, SchedulerConfig
from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
from hotprefix.model.loader import default_model_path, load_model
from hotprefix.model.runner import AttentionPaths, ModelRunner
from hotprefix.model.steps.fused_decode import MAX_TOKENS, FusedDecode
from hotprefix.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf

GREEDY = SamplingParams(temperature=0)
LAYERED = AttentionPaths(fused_decode=False)


def runner_for(path, block_size: int = 8, blocks: int = 64, kv: str = "auto", groups: bool = False) -> ModelRunner:
    r = ModelRunner(load_model(str(path)), ModelConfig(device="cpu", quantized_matmul="int8"),
                    CacheConfig(block_size=block_size, num_blocks_override=blocks, kv_cache_dtype=kv,
                                kv_cache_groups=groups), SchedulerConfig())
    assert r.strategy(FusedDecode) is not None, "int8 mode with a C compiler always builds the fused path"
    return r


def tiny_gemma3_gguf(tmp_path):
    """A Gemma-3-shaped GGUF (Q4_K_M mix: Q5_0 / Q8_0 on rows of 64; windows of 8 on six
    layers in seven, layer 5 global)."""
    from transformers import AutoTokenizer

    d = tmp_path / "src"
    model = build_tiny_model(d, "gemma3", seed=5, query_pre_attn_scalar=32)
    return write_gguf(tmp_path / "tiny-gemma3.gguf", model, AutoTokenizer.from_pretrained(str(d)), "Q4_K_M",
                      arch="gemma3")


def prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> None:
    for i, (p, t) in enumerate(zip(prompts, tables)):
        runner.all_logits(SchedulerOutput([ScheduledRequest(f"p{i}", p[:-1], 0, t, False, GREEDY, p, [])]))


def decode_step(prompts: list[list[int]], tables: list[list[int]]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(f"d{i}", [p[-1]], len(p) - 1, t, True, GREEDY, p, [])
                            for i, (p, t) in enumerate(zip(prompts, tables))])


def pool(runner: ModelRunner) -> list[torch.Tensor]:
    """A copy of every layer's K and V, as bits (the pool starts as uninitialised memory, NaNs included)."""
    return [t.clone().view(torch.uint8) for layer in runner.kv_cache.layers for t in (layer.k, layer.v)]


def check_same_bits(runner: ModelRunner, step: SchedulerOutput) -> None:
    """The step fused and layer by layer: the same pool and the same logits, bit for bit."""
    before = pool(runner)
    layered = runner.all_logits(step, LAYERED)
    after_layered = pool(runner)
    for live, saved in zip((t for layer in runner.kv_cache.layers for t in (layer.k, layer.v)), before):
        live.view(torch.uint8).copy_(saved)  # as it was: the fused run must write the step's keys and values
    fused = runner.all_logits(step)
    after_fused = pool(runner)
    assert fused.equal(layered), float((fused - layered).abs().max())
    assert all(a.equal(b) for a, b in zip(after_fused, after_layered))
    assert not all(a.equal(b) for a, b in zip(before, after_layered))  # the step did write keys and values


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gemma3_fused_step_is_the_layered_step_bit_for_bit(tmp_path, kv):
    """A Gemma-3-shaped model (Q4_K_M mix: Q5_0 / Q8_0 on rows of 64): q/k norms per head,
    sandwich norms, GeGLU, local layers (window 8, their own rotary tables and plans) and
    global ones, whose plans cascade over two sequences' shared blocks; contexts shorter
    and longer than the window."""
    runner = runner_for(tiny_gemma3_gguf(tmp_path), kv=kv)
    stack = runner.strategy(FusedDecode).stack
    assert [layer.kind for layer in stack.layers] == [0, 0, 0, 0, 0, 1, 0] and stack.layers[0].act == 1
    shared = [(3 * j) % 300 + 3 for j in range(16)]
    prompts = [shared + [7, 8, 9], shared + [10, 11, 12, 13, 14], [(5 * j) % 300 + 3 for j in range(6)]]
    tables = [[0, 1, 2], [0, 1, 3], [4, 5, 6]]
    prefill(runner, prompts[:1], tables[:1])
    runner.all_logits(SchedulerOutput([ScheduledRequest("p1", prompts[1][16:-1], 16, tables[1], False, GREEDY,
                                                         prompts[1], [])]))
    prefill(runner, prompts[2:], tables[2:])
    _, meta = runner.prepare(decode_step(prompts, tables))
    assert [c.members for c in meta.windows[None].cascades] == [(0, 1)] and not meta.windows[8].cascades
    check_same_bits(runner, decode_step(prompts, tables))


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gemma3_fused_step_on_a_grouped_pool_is_the_layered_step_bit_for_bit(tmp_path, kv):
    """The grouped pool (core/kv_groups.py; blocks of 4: one full group, layer 5, and six
    window groups of one layer each): each layer writes its group's slots and reads its
    group's tables within its window, fused as layer by layer. The window groups' tables
    name the pool's null block (filled with NaN) where a window released a block, so a
    step that read one would not be finite; the full group's shared blocks cascade."""
    runner = runner_for(tiny_gemma3_gguf(tmp_path), block_size=4, blocks=80, kv=kv, groups=True)
    kv_cache, groups = runner.kv_cache, runner.kv_groups
    assert groups.windows == (None,) + (8,) * 6 and groups.layers[0] == (5,)
    assert [layer.kind for layer in runner.strategy(FusedDecode).stack.layers] == [1, 2, 3, 4, 5, 0, 6]
    null = kv_cache.null_block
    for page in kv_cache.pages:
        page.k[:, null * 4:(null + 1) * 4] = page.v[:, null * 4:(null + 1) * 4] = float("nan")
    shared = [(3 * j) % 300 + 3 for j in range(16)]
    prompts = [shared + [7, 8, 9, 10, 11], shared + [12 + j for j in range(10)], [(5 * j) % 300 + 3 for j in range(6)]]
    tables = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7, 8], [9, 10]]

    def step(requests: list[tuple[str, list[int], int, list[int]]], released: int = 0) -> SchedulerOutput:
        """(id, tokens, start, table) each; a window group's table is the full group's
        moved by 11 blocks a group, its blocks below `released` tokens before the last
        position's window (8) named null."""
        def group_tables(table: list[int], last: int) -> tuple[list[int], ...]:
            gone = max(0, last - 7) // 4 if released else 0
            return (table,) + tuple([null] * gone + [b + 11 * g for b in table[gone:]] for g in range(1, 7))
        return SchedulerOutput([ScheduledRequest(i, t, start, table, False, GREEDY, t, [],
                                                 group_block_ids=group_tables(table, start + len(t) - 1))
                                for i, t, start, table in requests])

    runner.all_logits(step([("p0", prompts[0][:-1], 0, tables[0])]))
    runner.all_logits(step([("p1", prompts[1][16:-1], 16, tables[1])]))  # after the shared blocks
    runner.all_logits(step([("p2", prompts[2][:-1], 0, tables[2])]))
    decode = step([(f"d{i}", [p[-1]], len(p) - 1, t) for i, (p, t) in enumerate(zip(prompts, tables))], released=1)
    assert [t[1][:4] for t in (r.group_block_ids for r in decode.requests)] == [[null] * 3 + [14], [null] * 4, [20, 21]]
    _, meta = runner.prepare(decode)
    assert [c.members for c in meta.windows[0].cascades] == [(0, 1)]
    check_same_bits(runner, decode)
    assert bool(runner.all_logits(decode).isfinite().all())


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
def test_default_model_fused_step_is_the_layered_step_bit_for_bit(kv):
    """SmolLM2 (Q4_1 and Q8_0 blocks): one sequence, then four of different lengths; with a
    float32 pool and with fp8 ones (written and read in C by both paths); then a warm prefix's
    question, a 30-token prefill chunk after 35 cached positions (a partial AMX tile where
    the CPU has them), and a step of two prefill chunks and a decode."""
    runner = runner_for(default_model_path(), block_size=16, blocks=64, kv=kv)
    prompts = [[(7 * i + 3 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate((9, 30, 17, 64))]
    tables = [[4 * i + b for b in range(4)] for i in range(4)]
    prefill(runner, prompts, tables)
    check_same_bits(runner, decode_step(prompts[:1], tables[:1]))
    check_same_bits(runner, decode_step(prompts, tables))
    q = [(11 * j) % 4000 + 100 for j in range(65)]
    table = [16, 17, 18, 19, 20]
    runner.all_logits(SchedulerOutput([ScheduledRequest("w", q[:35], 0, table, False, GREEDY, q, [])]))
    check_same_bits(runner, SchedulerOutput([ScheduledRequest("w", q[35:], 35, table, False, GREEDY, q, [])]))
    fresh = [(13 * j) % 4000 + 100 for j in range(20)]  # on blocks no step wrote before
    check_same_bits(runner, SchedulerOutput([ScheduledRequest("a", fresh, 0, [21, 22], False, GREEDY, fresh, []),
                                             ScheduledRequest("b", q[35:50], 35, table, False, GREEDY, q, []),
                                             *decode_step(prompts[3:], tables[3:]).requests]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M"])
def test_qkv_biases_and_other_block_types_fused(tmp_path, qtype):
    """A Qwen2-shaped model (q/k/v biases) in Q4_0 and Q8_0 blocks, and in K-quant mixes
    whose q/k/v are parts of different types (Q4_K, Q4_K, Q6_K on layer 0)."""
    from transformers import AutoTokenizer

    d = tmp_path / "src"
    model = build_tiny_model(d, "qwen2", seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2)
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", model, AutoTokenizer.from_pretrained(str(d)), qtype)
    runner = runner_for(path)
    assert runner.model.model.layers[0].self_attn.qkv_bias is not None
    qkv_types = [p.type_name for p in runner.model.model.layers[0].self_attn.qkv_blocks.parts]
    assert qkv_types == {"Q4_0": ["Q4_0"] * 3, "Q8_0": ["Q8_0"] * 3, "Q4_K_M": ["Q4_K", "Q4_K", "Q6_K"],
                         "Q5_K_M": ["Q5_K", "Q5_K", "Q6_K"]}[qtype]
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 21, 12))]
    tables = [[8 * i + b for b in range(8)] for i in range(3)]
    prefill(runner, prompts, tables)
    check_same_bits(runner, decode_step(prompts, tables))


def test_cascade_steps_fused_are_the_layered_and_the_plain_steps_bit_for_bit():
    """Three sequences sharing two blocks (one cascade) and one alone: the shared prefix is
    attended once and continued by each member (the same C arithmetic as one pass), so the
    fused step, the layered step, the step without cascades and each decode alone agree
    bit for bit (this failed on AVX-512 machines while a cascade merged by log-sum-exp)."""
    runner = runner_for(default_model_path(), block_size=16, blocks=64)
    shared = [(11 * j) % 3000 + 150 for j in range(32)]
    prompts = [shared + [400 + i] * (2 + 5 * i) for i in range(3)] + [[(13 * j) % 3000 + 90 for j in range(40)]]
    tables = [[0, 1, 2 + i] for i in range(3)] + [[10, 11, 12]]
    runner.all_logits(SchedulerOutput([ScheduledRequest("s", shared, 0, tables[0], False, GREEDY, shared, [])]))
    for i, (p, t) in enumerate(zip(prompts, tables)):  # the rest of each prompt after the shared blocks
        start = 32 if i < 3 else 0
        runner.all_logits(SchedulerOutput([ScheduledRequest(f"p{i}", p[start:-1], start, t, False, GREEDY, p, [])]))
    calls = []
    fused = runner.strategy(FusedDecode)
    original = fused.forward
    fused.forward = lambda *a: calls.append(a[1].windows[None].cascades[:]) or original(*a)
    step = decode_step(prompts, tables)
    check_same_bits(runner, step)
    assert [[c.members for c in cs] for cs in calls] == [[(0, 1, 2)]]  # fused, with the one cascade
    got = runner.all_logits(step)
    assert runner.all_logits(step, AttentionPaths(cascade=False)).equal(got)
    for i, r in enumerate(step.requests):
        assert runner.all_logits(SchedulerOutput([r])).equal(got[i:i + 1])


def test_decode_steps_and_small_steps_take_the_fused_path():
    runner = runner_for(default_model_path(), block_size=16, blocks=64)
    calls = []
    fused = runner.strategy(FusedDecode)
    original = fused.forward

    def spy(*a):
        calls.append(a[0].num_tokens)
        return original(*a)

    fused.forward = spy
    shared = list(range(200, 232))  # two full blocks, shared by two sequences: a cascade when both decode
    prompts = [shared + [300], shared + [301, 302, 303]]
    tables = [[0, 1, 2], [0, 1, 3]]
    runner.all_logits(SchedulerOutput([ScheduledRequest("s", shared, 0, tables[0], False, GREEDY, shared, [])]))
    runner.all_logits(SchedulerOutput([ScheduledRequest("t", [301, 302], 32, tables[1], False, GREEDY, prompts[1],
                                                        [])]))
    assert calls == [32, 2]  # prefill steps of at most MAX_TOKENS tokens: fused
    runner.all_logits(decode_step(prompts[:1], tables[:1]))  # one decode: fused
    assert calls == [32, 2, 1]
    runner.all_logits(decode_step(prompts, tables))  # two decodes sharing two blocks: a cascade, fused too
    assert calls == [32, 2, 1, 2]
    runner.all_logits(decode_step(prompts, tables), AttentionPaths(fused_decode=False))  # asked layered
    big = [(7 * j) % 3000 + 90 for j in range(MAX_TOKENS + 1)]
    runner.all_logits(SchedulerOutput([ScheduledRequest("u", big, 0, [4, 5, 6, 7, 8], False, GREEDY, big, [])]))
    assert calls == [32, 2, 1, 2]  # a larger prefill step: layered
