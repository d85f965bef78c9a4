"""The scheduler with a fake model runner: exact schedules, chunking,
preemption, aborts; a seeded random blast with integrity checks every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hotprefix.config import SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.core.request import RequestStatus
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request


def make_scheduler(num_blocks=32, block_size=4, max_tokens=16, max_seqs=8, chunked=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def fake_run(sched: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A model that always answers `token`."""
    return ModelRunnerOutput({r.request_id: token for r in sched.requests if r.sample})


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(r.request_id, r.start_pos, len(r.token_ids)) for r in out.requests]


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    res = s.update(out, fake_run(out, token))
    s.check_integrity()
    return out, res


def test_prefill_then_decode_in_one_rule():
    s = make_scheduler()
    s.add_request(make_request("a", 6, max_tokens=2))
    out, res = step(s)
    assert plan(out) == [("a", 0, 6)] and out.requests[0].sample
    assert out.requests[0].block_ids == [0, 1]
    out, res = step(s)
    assert plan(out) == [("a", 6, 1)] and out.requests[0].token_ids == [7]
    assert res[0].finished_status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_free_blocks == 32


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    s = make_scheduler(max_tokens=8)
    s.add_request(make_request("a", 20, max_tokens=1))
    s.add_request(make_request("b", 3, max_tokens=1))
    out, _ = step(s)
    assert plan(out) == [("a", 0, 8)] and not out.requests[0].sample
    out, _ = step(s)
    assert plan(out) == [("a", 8, 8)]
    out, _ = step(s)
    assert plan(out) == [("a", 16, 4), ("b", 0, 3)]  # running first, then the waiting one fills the budget
    assert all(r.sample for r in out.requests)


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits():
    s = make_scheduler(max_tokens=8, chunked=False)
    s.add_request(make_request("a", 6, max_tokens=3))
    s.add_request(make_request("b", 5, max_tokens=1))
    out, _ = step(s)
    assert plan(out) == [("a", 0, 6)]  # b (5 tokens) does not fit the 2 left
    out, _ = step(s)
    assert plan(out) == [("a", 6, 1), ("b", 0, 5)]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 2, max_tokens=5))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_out_of_blocks_preempts_the_last_admitted_and_recomputes_it():
    s = make_scheduler(num_blocks=4, block_size=4, max_tokens=32)
    s.add_request(make_request("a", 7, max_tokens=6))
    s.add_request(make_request("b", 7, max_tokens=6))
    out, _ = step(s)  # a: blocks 0-1, b: blocks 2-3; both sampled their first token
    assert plan(out) == [("a", 0, 7), ("b", 0, 7)]
    out, _ = step(s)  # both decode token 8 into their second block: no new block needed
    assert plan(out) == [("a", 7, 1), ("b", 7, 1)]
    out, _ = step(s)  # a needs a third block: b is preempted
    assert plan(out) == [("a", 8, 1)]
    assert s.num_preemptions == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7, 7]
    assert s.kv.block_ids("b") == []
    while "a" in s.requests:
        out, _ = step(s)
        assert plan(out)[0][0] == "a"  # b stays out while a runs alone
    # b comes back and looks the cache up again: a's new block evicted b's
    # second block (released first), but b's first block is still cached, so
    # only positions 4.. of prompt + output so far are recomputed.
    out, _ = step(s)
    assert plan(out) == [("b", 4, 5)] and out.requests[0].token_ids[-2:] == [7, 7]


def test_abort_from_every_state_returns_blocks():
    s = make_scheduler(num_blocks=8, max_tokens=8, max_seqs=1)
    s.add_request(make_request("run", 6, max_tokens=10))
    s.add_request(make_request("wait", 6, max_tokens=10))
    step(s)
    assert s.requests["run"].status == RequestStatus.RUNNING
    assert s.requests["wait"].status == RequestStatus.WAITING
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert s.kv.pool.num_free_blocks == 8 and not s.has_unfinished()
    assert s.schedule().finished_request_ids == {"run", "wait"}


def test_eos_and_stop_tokens_finish():
    s = make_scheduler()
    s.add_request(make_request("e", 3, max_tokens=9, eos=frozenset({7})))
    s.add_request(make_request("s", 3, max_tokens=9, stop_token_ids=(7,)))
    s.add_request(make_request("i", 3, max_tokens=2, eos=frozenset({7}), ignore_eos=True))
    _, res = step(s)
    got = {o.request_id: (o.finished_status, o.stop_reason) for o in res}
    assert got == {"e": (RequestStatus.FINISHED_STOPPED, None), "s": (RequestStatus.FINISHED_STOPPED, 7),
                   "i": (None, None)}


def run_blast(seed: int, num_blocks: int, block_size: int, budget: int, max_seqs: int, n_requests: int) -> None:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_tokens=budget, max_seqs=max_seqs)
    cap = num_blocks * block_size
    pending = []
    for i in range(n_requests):
        p = rng.randint(1, max(1, cap // 2))
        pending.append(make_request(f"r{i}", p, max_tokens=rng.randint(1, max(1, cap - p))))
    finished: set[str] = set()
    aborted: set[str] = set()
    steps_waiting: dict[str, int] = {}
    for _ in range(20000):
        if pending and rng.random() < 0.5:
            s.add_request(pending.pop(0))
        if s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        out = s.schedule()
        assert out.num_scheduled_tokens <= budget
        assert len(out.requests) <= max_seqs
        for r in out.requests:
            assert len(r.block_ids) * block_size >= r.start_pos + len(r.token_ids)
        for o in s.update(out, fake_run(out, rng.randint(0, 50))):
            if o.finished:
                finished.add(o.request_id)
        s.check_integrity()
        for rid in s.requests:
            steps_waiting[rid] = steps_waiting.get(rid, 0) + 1
            assert steps_waiting[rid] < 5000, f"{rid} starves"
        if not pending and not s.requests:
            break
    assert not s.requests and not pending
    assert finished | aborted == {f"r{i}" for i in range(n_requests)}
    assert s.kv.pool.num_free_blocks == num_blocks


def test_seeded_random_blast():
    for seed in range(5):
        run_blast(seed, num_blocks=12, block_size=4, budget=16, max_seqs=4, n_requests=40)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 40), max_seqs=st.integers(1, 6), n=st.integers(1, 15))
def test_hypothesis_blast(seed, num_blocks, block_size, budget, max_seqs, n):
    run_blast(seed, num_blocks, block_size, budget, max_seqs, n)
