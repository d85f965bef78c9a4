"""A cache hit never changes an answer: random workloads of requests sharing random
prefixes, at random chunk sizes, token budgets and pool sizes, with the host and disk
tiers, swap and recompute preemption, so that cascades, cached blocks, tier hits and
preemptions all occur; every request's tokens and logprobs (the sampled token's and the
top 20: the logits' bits as far as the API shows them) equal, bit for bit, the same
request run alone with prefix caching off. In int8 and float32 mode, on the machine's
vector build and on the plain C build (-march=x86-64, no AVX)."""

from __future__ import annotations

import platform
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hotprefix.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from hotprefix.core.kv_tiers import Source
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.model.attention import cpu_plan
from hotprefix.model.kernels import build
from hotprefix.model.kernels.abi import bind
from hotprefix.model.loader import load_model
from hotprefix.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.gguf_util import write_gguf

pytestmark = pytest.mark.slow
BUILDS = ["native"] + (["x86-64"] if platform.machine() == "x86_64" else [])
DRAIN = 1000  # steps after adding a request: run until nothing is left


def _sp(seed: int | None, n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, ignore_eos=True, max_tokens=n,
                          logprobs=20)


def _tiered(disk: bool, num_blocks: int = 14) -> tuple:
    """A prefix computed, evicted by another prompt to the host tier (or, with `disk`,
    computed by an engine before a restart on the same disk tier), then three requests on
    it at once: tier hits, a cascade of three decodes, preemption (in a pool of num_blocks
    blocks, times check_workloads' blocks_times)."""
    prefix = list(range(10, 34))
    first = [(prefix + [5], _sp(None, 4), DRAIN)]
    requests = [(list(range(100, 140)), _sp(None, 4), DRAIN), (prefix + [6], _sp(None, 12), 0),
                (prefix + [7], _sp(3, 12), 0), (prefix + [8], _sp(None, 12), 1)]
    config = dict(max_num_batched_tokens=13, num_blocks_override=num_blocks, swap_space=1 << 20,
                  preemption_mode="recompute" if disk else "swap", kv_offloading_size=0 if disk else 1 << 20)
    return (requests, config, disk, first) if disk else (first + requests, config, disk, [])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A Llama-shaped GGUF of K-quant blocks (Q4_K, Q6_K: rows of 256) and its model."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("inv")
    model = build_tiny_model(d / "src", "llama", seed=7, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    path = write_gguf(d / "tiny-Q4_K_M.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q4_K_M")
    return load_model(str(path))


@pytest.fixture(params=BUILDS)
def kernel_build(request, monkeypatch):
    """The process's kernel library, for this test: the native build or plain C."""
    if request.param != "native":
        path = build.build_library(march=request.param)
        assert path is not None
        monkeypatch.setattr(build, "_lib", bind(path))
        monkeypatch.setattr(build, "_tried", True)
    return request.param


def make_engine(loaded, mode: str, caching: bool, tmp=None, **kw) -> LLMEngine:
    cache = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    cache.setdefault("num_blocks_override", 256)
    return LLMEngine(EngineConfig(ModelConfig(quantized_matmul=mode), CacheConfig(
        block_size=4, enable_prefix_caching=caching, kv_disk_dir=tmp, **cache), SchedulerConfig(**kw)), loaded=loaded)


def answer(out) -> tuple:
    """Tokens, and each position's sampled and top-20 logprobs (token id and float value)."""
    o = out.outputs[0]
    return tuple(o.token_ids), tuple((lp.sampled.token_id, lp.sampled.logprob,
                                      tuple((t.token_id, t.logprob) for t in lp.top)) for lp in o.logprobs)


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    prefixes = [[rng.randrange(3, 320) for _ in range(draw(st.integers(0, 28)))]
                for _ in range(draw(st.integers(1, 3)))]
    requests = []
    for _ in range(draw(st.integers(3, 8))):
        prompt = prefixes[draw(st.integers(0, len(prefixes) - 1))] + [rng.randrange(3, 320)
                                                                         for _ in range(draw(st.integers(1, 6)))]
        params = _sp(draw(st.one_of(st.none(), st.integers(0, 1000))), draw(st.integers(1, 12)))
        requests.append((prompt, params, draw(st.sampled_from([0, 1, 3, DRAIN]))))  # steps to run after adding it
    config = dict(max_num_batched_tokens=draw(st.sampled_from([8, 13, 32, 64])),
                  num_blocks_override=draw(st.integers(12, 30)),
                  preemption_mode=draw(st.sampled_from(["recompute", "swap"])), swap_space=1 << 20,
                  kv_offloading_size=draw(st.sampled_from([0, 1 << 16, 1 << 20])))
    disk = draw(st.booleans())
    before = [r for r in requests if draw(st.booleans())] if disk else []  # run by an engine before a restart
    return requests, config, disk, before


def run_interleaved(engine: LLMEngine, requests) -> dict[int, tuple]:
    """Adds each request, then runs its number of steps (while any request is unfinished:
    1000 drains the engine, so that later requests find earlier prefixes evicted to the
    tiers); then runs to the end."""
    final = {}

    def step():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        engine.scheduler.check_integrity()

    for i, (prompt, params, steps) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            step()
        if steps == DRAIN and engine.disk is not None:
            engine.disk.flush()  # what the drained requests computed is on disk before the next one
    while engine.has_unfinished_requests():
        step()
    return final


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_every_answer_is_the_answer_alone_with_caching_off(loaded, kernel_build, mode, tmp_path):
    check_workloads(loaded, mode, tmp_path, 10 if kernel_build == "native" else 4)


@pytest.fixture(scope="module")
def gemma_loaded(tmp_path_factory):
    """A Gemma-3-shaped GGUF (windows of 8 on five layers in seven, rows of 64: the Q4_K_M
    mix falls back to Q5_0 and Q8_0, as llama-quantize does for small Gemma 3 files)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("inv-gemma")
    model = build_tiny_model(d / "src", "gemma3", seed=7, query_pre_attn_scalar=32)
    path = write_gguf(d / "tiny-gemma3-Q4_K_M.gguf", model, AutoTokenizer.from_pretrained(str(d / "src")), "Q4_K_M",
                      arch="gemma3")
    return load_model(str(path))


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_sliding_window_answers_are_the_answer_alone(gemma_loaded, mode, tmp_path):
    """The same promise with layers of two windows: each layer's plans (a window's start
    per query; cascades on the global layers only) give the answer alone's bits."""
    assert len(set(gemma_loaded.arch.layer_windows)) == 2
    # one block table for every layer (--no-kv-cache-groups); the grouped pool: the test below
    check_workloads(gemma_loaded, mode, tmp_path, 6, kv_cache_groups=False)


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_sliding_window_answers_on_the_grouped_pool_are_the_answer_alone(gemma_loaded, mode, tmp_path):
    """The default layout for two windows: window groups that release the blocks left
    behind (core/kv_groups.py), hits on every group's blocks, cascades, the host and disk
    tiers holding blocks of every group, swap and recompute preemption: each answer is
    still the answer alone's bits."""
    # (a grouped pool counts pages of one layer here: the same bytes as the one-table layout's blocks; the tiered
    # examples' pools a third smaller, so that they evict and preempt as the one-table layout's do)
    check_workloads(gemma_loaded, mode, tmp_path, 6, blocks_times=gemma_loaded.arch.num_layers, tiered_blocks=9)


def check_workloads(loaded, mode: str, tmp_path, max_examples: int,
                    expect: tuple[str, ...] = ("cached", "preempted", "cascades", "host hits", "disk hits"),
                    blocks_times: int = 1, tiered_blocks: int = 14, **fixed) -> None:
    """Random workloads (and the tiered examples, in pools of tiered_blocks) on `loaded` with
    caching on: every answer equals the request's answer alone with caching off, and the
    workloads did hit the cache, cascade, preempt and load from both tiers. fixed: config
    every engine takes."""
    reference = make_engine(loaded, mode, caching=False, **fixed)
    alone: dict[tuple, tuple] = {}
    seen: Counter = Counter()
    runs = iter(range(10**6))
    real = cpu_plan.cascades

    def counting(batch, *a):
        out = real(batch, *a)
        seen["cascades"] += len(out)
        return out

    def reference_answer(prompt: list[int], params: SamplingParams) -> tuple:
        key = (tuple(prompt), params.seed, params.max_tokens)
        if key not in alone:
            alone[key] = answer(run_interleaved(reference, [(prompt, params, 0)])[0])
        return alone[key]

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(workloads())
    @example(_tiered(disk=False, num_blocks=tiered_blocks))
    @example(_tiered(disk=True, num_blocks=tiered_blocks))
    def check(w):
        requests, config, disk, before = w
        config = {**config, "num_blocks_override": config["num_blocks_override"] * blocks_times}
        tmp = str(tmp_path / f"d{next(runs)}") if disk else None
        if before:  # the disk tier's blocks from a previous start
            engine = make_engine(loaded, mode, caching=True, tmp=tmp, **config, **fixed)
            try:
                finals = run_interleaved(engine, before)
            finally:
                engine.close()
            for i, (prompt, params, _) in enumerate(before):
                assert answer(finals[i]) == reference_answer(prompt, params)
        engine = make_engine(loaded, mode, caching=True, tmp=tmp, **config, **fixed)
        try:
            finals = run_interleaved(engine, requests)
            stats = engine.scheduler.make_stats()
        finally:
            engine.close()
        for i, (prompt, params, _) in enumerate(requests):
            assert answer(finals[i]) == reference_answer(prompt, params), (i, requests[i], config)
            seen["cached"] += finals[i].num_cached_tokens > 0
        seen["preempted"] += engine.scheduler.num_preemptions
        seen["host hits"] += stats.tiers.hit_blocks[Source.HOST]
        seen["disk hits"] += stats.tiers.hit_blocks[Source.DISK]

    cpu_plan.cascades = counting
    try:
        check()
    finally:
        cpu_plan.cascades = real
    # the workloads did exercise what they are for
    assert all(seen[k] for k in expect), seen
