"""lint's cache simulator on a window model's grouped pool (core/kv_groups.py): the same
requests, one after another, through a real engine of the tiny Gemma 3 (seven KV groups:
one full, six of a window of 8; blocks of 4) in a pool too small for them, and through
tools/cache_sim.replay given the engine's block hashes, pool and groups: every request's
cached tokens are the engine's."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.cachecurve.request import SimRequest
from hotprefix.tools.cache_sim import CacheSize, replay

BLOCK, OUT = 4, 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.conftest import build_tiny_model

    d = tmp_path_factory.mktemp("gemma3-sim")
    build_tiny_model(d, "gemma3", seed=3)
    return d


def _sessions() -> list[list[int]]:
    """Three chat sessions on a shared 22-token system prompt, interleaved, three turns each
    (a turn: the last prompt, its answer stands in as 5 tokens of the next, and a question)."""
    g = torch.Generator().manual_seed(11)
    def draw(n: int) -> list[int]:
        return torch.randint(3, 320, (n,), generator=g).tolist()

    system = draw(22)
    turns = [[system + draw(6)] for _ in range(3)]
    for _ in range(2):
        for t in turns:
            t.append(t[-1] + draw(OUT) + draw(7))
    return [t[i] for i in range(3) for t in turns]


@pytest.mark.parametrize("num_blocks", [105, 120])
def test_the_simulators_hits_are_the_engines_on_a_grouped_pool(folder, num_blocks):
    llm = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=num_blocks, max_num_batched_tokens=256)
    kv = llm.engine.kv
    assert kv.windows is not None
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    prompts, outs = _sessions(), []
    for p in prompts:
        outs.append(llm.generate([p], params)[0])
        kv.check_integrity()
    measured = [o.num_cached_tokens for o in outs]
    size = CacheSize(num_blocks, windows=llm.engine.runner.plan.windows,
                     retain_every=llm.engine.config.cache.kv_window_retain_interval)
    sims = [SimRequest(o.block_hashes, len(p), OUT) for p, o in zip(prompts, outs)]
    assert replay(sims, BLOCK, size).hits == measured
    assert sum(measured) > 0
    if num_blocks == 105:  # a pool too small: eviction costs hits an unbounded cache keeps
        assert sum(measured) < sum(replay(sims, BLOCK, CacheSize()).hits)
        one_group = replay(sims, BLOCK, CacheSize(num_blocks))  # (what the simulator replayed before: one group)
        assert one_group.hits != measured
