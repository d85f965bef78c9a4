"""Prompt logprobs kept with their blocks (core/logprob_cache.py): a scoring request takes
cached blocks only as far as the logprobs it needs are kept, gets exactly the kept
values, and the cache stays within its bound. The scheduler with a fake runner."""

from __future__ import annotations

from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.logprob_cache import PromptLogprobCache
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.sampling_params import Logprob, TokenLogprobs
from tests.unit.builders import make_request
from tests.unit.test_scheduler import make_scheduler


def entry(pos: int, token: int, k: int) -> TokenLogprobs:
    """What the fake model says of prompt token `token` at position `pos`."""
    return TokenLogprobs(Logprob(token, -pos / 8, 1 + pos % 3), [Logprob(j, -j / 4, j + 1) for j in range(k)])


def scoring_run(out: SchedulerOutput) -> ModelRunnerOutput:
    res = ModelRunnerOutput({r.request_id: 7 for r in out.requests if r.sample})
    for r in out.requests:
        k = r.sampling_params.prompt_logprobs
        rows = min(len(r.token_ids), len(r.prompt_token_ids) - 1 - r.start_pos)
        if k is not None and rows > 0:
            first = r.start_pos + 1
            res.prompt_logprobs[r.request_id] = (first, [entry(p, r.prompt_token_ids[p], k)
                                                         for p in range(first, first + rows)])
    return res


def run(s, req):
    """Queue a request and step until it finishes; the tokens the runner computed for it."""
    s.add_request(req)
    computed = 0
    while req.request_id in s.requests:
        out = s.schedule()
        computed += sum(len(r.token_ids) for r in out.requests if r.request_id == req.request_id)
        s.update(out, scoring_run(out))
        s.check_integrity()
    return computed


def test_a_repeated_scoring_prompt_takes_its_blocks_with_the_kept_logprobs():
    s = make_scheduler(num_blocks=32, block_size=4, max_tokens=8)
    prompt = list(range(500, 514))  # 14 tokens: 3 full blocks may be hits (the last token is computed)
    first = make_request("a", 14, max_tokens=0, prompt=prompt, prompt_logprobs=2)
    assert run(s, first) == 14 and first.num_cached_tokens == 0
    again = make_request("b", 14, max_tokens=0, prompt=prompt, prompt_logprobs=1)
    assert run(s, again) == 2 and again.num_cached_tokens == 12
    assert again.prompt_logprobs[0] is None
    for p in range(1, 14):
        got, want = again.prompt_logprobs[p], first.prompt_logprobs[p]
        assert got.sampled == want.sampled and got.top == want.top[:1]  # the kept values, cut to its k
    more = make_request("c", 14, max_tokens=0, prompt=prompt, prompt_logprobs=5)
    assert run(s, more) == 14  # kept with 2 alternatives: 5 need every position again
    plain = make_request("d", 14, max_tokens=1, prompt=prompt)
    assert run(s, plain) == 2  # a request not scoring its prompt takes every full block


def test_the_key_holds_the_next_blocks_first_token():
    s = make_scheduler(num_blocks=32, block_size=4, max_tokens=16)
    run(s, make_request("a", 14, max_tokens=0, prompt=list(range(500, 514)), prompt_logprobs=0))
    other = make_request("b", 14, max_tokens=0, prompt=list(range(500, 508)) + [9, 9, 9, 9, 9, 9],
                         prompt_logprobs=0)
    # blocks 0 and 1 are cached; block 1's last target is token 8, which differs: only block 0's logprobs are kept
    assert run(s, other) == 10 and other.num_cached_tokens == 4


def test_what_a_preempted_request_recorded_needs_no_kept_entry():
    kv = KVCacheManager(16, 4)
    req = make_request("a", 14, max_tokens=0, prompt_logprobs=0)
    kv.update_hashes(req)
    assert kv.logprobs.reach(req, 3) == 0
    req.record_prompt_logprobs(1, [entry(p, 0, 0) for p in range(1, 9)])  # targets 1..8: blocks 0 and 1
    assert kv.logprobs.reach(req, 3) == 2 and len(kv.logprobs) == 0


def test_the_cache_keeps_the_most_recently_used_within_its_bound():
    cache = PromptLogprobCache(block_size=4, max_values=3 * 4 * 2)  # three blocks at k=1
    kv = KVCacheManager(64, 4)
    reqs = []
    for i in range(5):
        r = make_request(f"r{i}", 9, max_tokens=0, prompt_logprobs=1)
        kv.update_hashes(r)
        r.record_prompt_logprobs(1, [entry(p, 0, 1) for p in range(1, 9)])
        cache.store(r, 1, 8)
        reqs.append(r)
        assert cache.num_values <= cache.max_values
    assert len(cache) == 3 and cache.num_values == 3 * 8
    fresh = [make_request(r.request_id, 9, max_tokens=0, prompt=r.prompt_token_ids, prompt_logprobs=1) for r in reqs]
    for r in fresh:
        kv.update_hashes(r)
    assert [cache.reach(r, 2) for r in fresh] == [0, 0, 0, 0, 2]  # kept: r4's two blocks, r3's second
    fresh[3].record_prompt_logprobs(1, [entry(p, 0, 1) for p in range(1, 5)])
    assert cache.reach(fresh[3], 2) == 2
    cache.clear()
    assert cache.num_values == 0 and cache.reach(fresh[4], 2) == 0
