"""Gemma 3 on a grouped KV pool (core/kv_groups.py): the tiny model of test_gemma3.py
(seven layers: six local ones of a window of 8, one global; blocks of 4, so seven
KV-cache groups of one layer each). The pool's null block, which window groups' tables
name where they released a block, is filled with NaN: greedy tokens still equal
transformers', on each backend, for prompts far past the window and prefix hits inside
and past it, so no kernel reads a released block."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.core.hashing import UNSALTED
from hotprefix.core.kv_tiers import Source
from tests.model.test_gemma3 import BLOCK, hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import build_tiny_model

    d = tmp_path_factory.mktemp("gemma3g")
    return d, build_tiny_model(d, "gemma3", seed=3)


def _poison_null_block(llm: LLM) -> None:
    kv = llm.engine.runner.kv_cache
    null = slice(kv.null_block * kv.block_size, (kv.null_block + 1) * kv.block_size)
    for page in kv.pages:
        page.k[:, null] = float("nan")
        page.v[:, null] = float("nan")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_no_kernel_reads_a_released_block(tiny, backend):
    folder, hf = tiny
    llm = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=7 * 64, attention_backend=backend,
              max_num_batched_tokens=16)  # chunks of 16: prefills cross the window and blocks in several steps
    kv = llm.engine.kv
    assert kv.windows is not None and len(kv.windows.windows) == 6 and kv.null_block_id == 7 * 64
    _poison_null_block(llm)
    g = torch.Generator().manual_seed(13)
    base = torch.randint(3, 320, (37,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate([base], params)[0]
    assert first.outputs[0].token_ids == hf_greedy(hf, base, 10)
    for keep, cached in ((6, 4), (33, 32), (37 + 10, 44)):  # inside the window, past it, the whole last turn
        prompt = (base + first.outputs[0].token_ids)[:keep] + torch.randint(3, 320, (5,), generator=g).tolist()
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached, keep
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10), keep
        kv.check_integrity()
    nulls = [p.k[:, kv.null_block_id * BLOCK:(kv.null_block_id + 1) * BLOCK] for p in llm.engine.runner.kv_cache.pages]
    assert all(bool(t.isnan().all()) for t in nulls)  # and nothing wrote there


def _answers(outs) -> list[tuple]:
    """Each request's tokens and each position's sampled and top-5 logprobs (their bits)."""
    return [(tuple(o.outputs[0].token_ids), tuple((lp.sampled.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                                                  for lp in o.outputs[0].logprobs)) for o in outs]


def test_swap_preemption_gives_the_unpreempted_answers(tiny):
    """Four requests that do not fit a pool of 56 blocks together: the scheduler swaps every
    group's held blocks out and back (nothing is recomputed: the model runs exactly the
    tokens of the roomy run), and every answer is the roomy run's, bit for bit."""
    folder, _ = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 27, 33, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    roomy = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=7 * 64, max_num_batched_tokens=16)
    want = _answers(roomy.generate(prompts, params))
    llm = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=56, max_num_batched_tokens=16,
              preemption_mode="swap", swap_space="1MiB")
    assert llm.engine.kv.windows is not None and llm.engine.runner.num_host_blocks > 0
    assert _answers(llm.generate(prompts, params)) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.num_swapped_blocks_total > 0
    assert llm.engine.runner.num_computed_tokens_total == roomy.engine.runner.num_computed_tokens_total \
        == sum(len(p) + 11 for p in prompts)
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize(("others", "device", "host"), [(1, 9, 0), (2, 0, 9)])
def test_a_hit_loaded_from_the_host_tier_gives_the_recomputed_answer(tiny, others, device, host):
    """A 37-token prompt is computed, then other prompts evict its blocks from a pool of 60
    to the host tier: after one, its window groups' tails (the full group's blocks stay in
    the pool: the retention rule reuses out-of-window blocks first); after two, every block.
    The prompt again with 5 more tokens hits 36 tokens: the full group's 9 blocks from
    where they are, each window group's tail at 36 (blocks 7 and 8) from the host, and its
    tokens and logprobs are those of the prompt with caching off, bit for bit."""
    folder, _ = tiny
    g = torch.Generator().manual_seed(21)
    base, other = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (37, 45))
    again = base + torch.randint(3, 320, (5,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    alone = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=7 * 64, enable_prefix_caching=False)
    want = _answers(alone.generate([again], params))
    llm = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=60, kv_offloading_size="1MiB",
              max_num_batched_tokens=16)
    kv = llm.engine.kv
    assert kv.windows is not None and kv.tiers is not None
    for prompt in [base, other, other[::-1]][:1 + others]:
        llm.generate([prompt], params)
    assert [kv.pool.lookup(h) is not None for h in kv.hasher.hashes_of(base, UNSALTED)] == [others == 1] * 9
    llm.engine.scheduler.make_stats()  # (the counters start again)
    out = llm.generate([again], params)
    assert out[0].num_cached_tokens == 36 and _answers(out) == want
    tiers = llm.engine.scheduler.make_stats().tiers
    assert (tiers.hit_blocks[Source.DEVICE], tiers.hit_blocks[Source.HOST]) == (device, host)
    assert tiers.loaded_blocks == host + 6 * 2
    kv.check_integrity()
