"""Prefix caching with a real (tiny) model: identical outputs with caching on
and off, and a hit computes only the uncached tokens."""

from __future__ import annotations

import random

import pytest

from hotprefix import LLM, SamplingParams
from hotprefix.engine.requests import CacheScope, RequestOptions
from hotprefix.model.runner import AttentionPaths

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def workload(seed: int = 0, n: int = 24) -> list[list[int]]:
    """Prompts built from 3 shared 'system prompts' of various lengths, some
    repeated whole, plus unique tails."""
    rng = random.Random(seed)
    systems = [[rng.randint(3, 319) for _ in range(k)] for k in (13, 21, 8)]
    out = []
    for _ in range(n):
        sys_p = rng.choice(systems)
        tail = [rng.randint(3, 319) for _ in range(rng.randint(1, 9))]
        out.append(sys_p + tail if rng.random() < 0.8 else list(sys_p))
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=256, enable_prefix_caching=False)
    return {tuple(p): llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in workload()}


@pytest.mark.parametrize("kw", [
    {"num_blocks_override": 256},                                  # plenty of room: many hits
    {"num_blocks_override": 24, "max_num_seqs": 3},                # eviction pressure
    {"num_blocks_override": 12, "max_num_batched_tokens": 16},     # preemption and chunks
    {"num_blocks_override": 256, "max_num_batched_tokens": 5},     # tiny chunks over cached prefixes
])
def test_outputs_identical_with_caching_on_and_off(tiny_llama, reference, kw):
    llm = LLM(model=str(tiny_llama[0]), block_size=4, **kw)
    prompts = workload()
    # Submit in waves so later waves find earlier waves' blocks cached.
    for i in range(0, len(prompts), 6):
        outs = llm.generate(prompts[i:i + 6], GREEDY)
        for p, o in zip(prompts[i:i + 6], outs):
            assert o.outputs[0].token_ids == reference[tuple(p)]
    stats = llm.engine.kv.make_stats()
    assert stats.hits > 0
    if kw["num_blocks_override"] <= 24:
        assert stats.evicted_blocks > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_a_hit_computes_only_the_uncached_tokens(tiny_llama):
    llm = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=64)
    runner = llm.engine.runner
    shared = list(range(10, 30))  # 20 tokens: 5 full blocks
    before = runner.num_computed_tokens_total
    a = llm.generate([shared + [40, 41, 42]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert runner.num_computed_tokens_total - before == 23 and a.num_cached_tokens == 0
    before = runner.num_computed_tokens_total
    b = llm.generate([shared + [50, 51]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert b.num_cached_tokens == 20
    assert runner.num_computed_tokens_total - before == 2  # only the two new tokens ran


def test_salted_requests_do_not_share(tiny_llama):
    llm = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=64)
    p = list(range(10, 30)) + [7]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.engine.add_request("a", p, one, RequestOptions(cache_scope=CacheScope("A")))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for salt, cached in (("B", 0), ("A", 20), (None, 0)):
        rid = f"x-{salt}"
        llm.engine.add_request(rid, p, one, RequestOptions(cache_scope=CacheScope(salt)))
        outs = []
        while llm.engine.has_unfinished_requests():
            outs += llm.engine.step()
        assert outs[-1].num_cached_tokens == cached, salt


def test_two_engines_compute_the_same_hashes(tiny_llama):
    a = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=16).engine
    b = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=16).engine
    ids = list(range(3, 40))
    assert a.prefix_hashes(ids, CacheScope("t", 8)) == b.prefix_hashes(ids, CacheScope("t", 8))
    assert len(a.prefix_hashes(ids)) == 9


def test_pin_and_reset_through_the_offline_api(tiny_llama):
    llm = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=20, max_pinned_fraction=0.5)
    sys_p = list(range(100, 124))  # 6 blocks
    assert llm.pin(sys_p) == 6
    # Churn through the pool with unrelated prompts: the pinned prefix survives.
    llm.generate([list(range(200 + 20 * i, 213 + 20 * i)) for i in range(6)], GREEDY)
    out = llm.generate([sys_p + [5]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.num_cached_tokens == 24
    assert llm.reset_prefix_cache() > 0
    out = llm.generate([sys_p + [6]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.num_cached_tokens == 24  # pinned blocks are referenced: reset keeps them
    assert llm.unpin(sys_p) == 6
    llm.reset_prefix_cache()
    out = llm.generate([sys_p + [7]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.num_cached_tokens == 0
    from hotprefix.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="allowed by --max-pinned-fraction"):
        llm.engine.add_request("big", list(range(250, 294)), GREEDY, RequestOptions(pin_prefix=True))


def test_cascade_attention_over_shared_blocks_is_plain_attention_bit_for_bit(tiny_llama):
    """Decodes sharing leading blocks attend to them once (a cascade: the shared prefix,
    rounded down to whole tiles of 16, saved as state, then each member's own keys): the
    logits are the bits of the same step without cascades, and of each decode alone."""
    from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
    from hotprefix.model.attention.cpu_plan import Cascade

    llm = LLM(model=str(tiny_llama[0]), block_size=4, num_blocks_override=64, device="cpu")
    runner = llm.engine.runner
    assert runner.backend.kernels, "the C kernel did not build (gcc is part of the set-up)"
    shared = list(range(10, 30))  # 5 full blocks
    prompts = [shared + [40 + i] * (2 + i) for i in range(4)]  # tails of 2-5 tokens (chunks never empty)
    tables = [[0, 1, 2, 3, 4] + [5 + 2 * i, 6 + 2 * i] for i in range(4)]
    # Prefill: the first sequence writes the shared blocks; each writes its own tail.
    runner.all_logits(SchedulerOutput([ScheduledRequest("p", shared, 0, tables[0], False, GREEDY, shared, [])]))
    for i, p in enumerate(prompts):
        runner.all_logits(SchedulerOutput([ScheduledRequest(f"t{i}", p[20:-1], 20, tables[i], False, GREEDY, p,
                                                            [])]))
    requests = [ScheduledRequest(f"d{i}", [p[-1]], len(p) - 1, tables[i], True, GREEDY, p, [])
                for i, p in enumerate(prompts)]
    decode = SchedulerOutput(requests)
    _, step = runner.prepare(decode)
    meta = step.windows[None]  # (no window: the model's only plans)
    assert meta.cascades == [Cascade((0, 1, 2, 3), 16)]
    h, kvh = runner.arch.num_heads, runner.arch.num_kv_heads
    g = h // kvh
    assert meta.shared.task[:, 1].sum() == 4 * h and {tuple(r) for r in meta.shared.lims.tolist()} == {(0, 16)}
    assert meta.own.lims.tolist() == [[16, len(p)] for p in prompts for _ in range(h)]  # each its own keys
    assert meta.own.task[:, 1].tolist() == [g] * 4 * kvh
    with_cascade = runner.all_logits(decode)
    assert runner.all_logits(decode).equal(with_cascade)  # the same step again: the same bits
    assert runner.all_logits(decode, AttentionPaths(cascade=False)).equal(with_cascade)
    for i, r in enumerate(requests):
        assert runner.all_logits(SchedulerOutput([r])).equal(with_cascade[i:i + 1])
