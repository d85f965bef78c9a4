"""The scheduler with a fake model runner: exact schedules, chunking,
preemption, aborts; a seeded random blast with integrity checks every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotprefix.config import ConfigError, SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.outputs import ModelRunnerOutput, SchedulerOutput
from hotprefix.core.request import RequestStatus
from hotprefix.core.scheduler import Scheduler
from tests.unit.builders import make_request


def make_scheduler(num_blocks=32, block_size=4, max_tokens=16, max_seqs=8, chunked=True, host_blocks=0,
                   **cfg_kw) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, enable_chunked_prefill=chunked,
                          **cfg_kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), host_blocks)


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


def run_blast(seed: int, num_blocks: int, block_size: int, budget: int, max_seqs: int, n_requests: int,
              policy: str = "fcfs", mode: str = "recompute", host_blocks: int = 0, threshold: int = 0,
              tenants: int = 1) -> None:
    """Random arrivals and aborts (with tenants > 1: of that many weighted tenants, some
    requests following an earlier one's prompt as n > 1 samples do); integrity every step."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_tokens=budget, max_seqs=max_seqs,
                       host_blocks=host_blocks, scheduling_policy=policy, preemption_mode=mode,
                       long_prefill_token_threshold=threshold,
                       tenant_weights=tuple((f"t{i}", 1.0 + i) for i in range(tenants)))
    cap = num_blocks * block_size
    pending = []
    for i in range(n_requests):
        p = rng.randint(1, max(1, cap // 2))
        lead = pending[-1] if tenants > 1 and pending and rng.random() < 0.3 else None
        r = make_request(f"r{i}", p, max_tokens=rng.randint(1, max(1, cap - p)), priority=rng.randint(0, 3),
                         prompt=lead.prompt_token_ids if lead is not None else None)
        r.tenant, r.follows = (f"t{rng.randrange(tenants)}" if tenants > 1 else None), lead
        pending.append(r)
    finished: set[str] = set()
    aborted: set[str] = set()
    steps_alive: dict[str, int] = {}
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
        if threshold:
            assert all(len(r.token_ids) <= threshold for r in out.requests)
        for r in out.requests:
            assert len(r.block_ids) * block_size >= r.start_pos + len(r.token_ids)
        for o in s.update(out, fake_run(out, rng.randint(0, 50))):
            if o.finished:
                finished.add(o.request_id)
        s.check_integrity()
        for rid in s.requests:
            steps_alive[rid] = steps_alive.get(rid, 0) + 1
            assert steps_alive[rid] < 5000, f"{rid} starves"
        if not pending and not s.requests:
            break
    assert not s.requests and not pending
    assert finished | aborted == {f"r{i}" for i in range(n_requests)}
    s.schedule()  # releases host blocks deferred from the last step
    assert s.kv.pool.num_free_blocks == num_blocks and s.swap.num_free == host_blocks


@pytest.mark.parametrize("policy,mode", [("fcfs", "recompute"), ("priority", "recompute"), ("fcfs", "swap"),
                                         ("priority", "swap")])
def test_seeded_random_blast(policy, mode):
    for seed in range(5):
        run_blast(seed, num_blocks=12, block_size=4, budget=16, max_seqs=4, n_requests=40, policy=policy,
                  mode=mode, host_blocks=6 if mode == "swap" else 0)


def test_priority_victim_is_never_a_request_already_scheduled_this_step():
    """Found by the Hypothesis blast: a lower-priority request scheduled earlier in
    the step was preempted after the fact, leaving its scheduled work on freed blocks."""
    run_blast(0, num_blocks=9, block_size=1, budget=4, max_seqs=2, n_requests=4, policy="priority", mode="swap",
              host_blocks=4, threshold=0)  # the falsifying example, exactly
    s = make_scheduler(num_blocks=4, block_size=1, max_tokens=8, scheduling_policy="priority")
    s.add_request(make_request("low", 2, max_tokens=5, priority=9))
    s.add_request(make_request("high", 2, max_tokens=5, priority=0))
    step(s)  # both admitted: 4 blocks, the pool is full
    out, _ = step(s)  # low (first in running order) is scheduled... then high needs a block
    scheduled = [r.request_id for r in out.requests]
    for r in out.requests:  # whatever runs holds its blocks
        assert s.requests[r.request_id].status == RequestStatus.RUNNING
    assert len(scheduled) == len(set(scheduled)) <= 2


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 40), max_seqs=st.integers(1, 6), n=st.integers(1, 15),
       policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["recompute", "swap"]),
       host_blocks=st.integers(0, 10), threshold=st.sampled_from([0, 0, 3, 7]), tenants=st.integers(1, 3))
def test_hypothesis_blast(seed, num_blocks, block_size, budget, max_seqs, n, policy, mode, host_blocks, threshold,
                          tenants):
    run_blast(seed, num_blocks, block_size, budget, max_seqs, n, policy, mode, host_blocks, threshold, tenants)


def test_priority_policy_admits_lowest_value_first_ties_by_arrival():
    s = make_scheduler(max_seqs=1, scheduling_policy="priority")
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2), ("high2", 0)):
        s.add_request(make_request(rid, 2, max_tokens=1, priority=prio))
    order = []
    while s.has_unfinished():
        out, _ = step(s)
        order += [r.request_id for r in out.requests]
    assert order == ["high", "high2", "mid", "low"]


def test_priority_policy_preempts_the_lowest_priority():
    s = make_scheduler(num_blocks=6, block_size=4, max_tokens=64, scheduling_policy="priority")
    s.add_request(make_request("p0", 7, max_tokens=8, priority=0))
    s.add_request(make_request("p9", 7, max_tokens=8, priority=9))
    s.add_request(make_request("p1", 7, max_tokens=8, priority=1))
    step(s)  # all three admitted: 2 blocks each
    step(s)  # decode into the second block: no new blocks
    out, _ = step(s)  # each needs a 3rd block: p9 (lowest priority) goes, though admitted second
    assert s.requests["p9"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in out.requests] == ["p0", "p1"]


def test_swap_mode_copies_blocks_out_and_back_with_exact_mappings():
    s = make_scheduler(num_blocks=4, block_size=4, max_tokens=32, host_blocks=4, preemption_mode="swap")
    s.add_request(make_request("a", 7, max_tokens=6))
    s.add_request(make_request("b", 7, max_tokens=6))
    step(s)
    step(s)
    out, _ = step(s)  # a needs a third block: b (blocks 2, 3) swaps out to host blocks 0, 1
    assert out.swap_out == [(2, 0), (3, 1)] and plan(out) == [("a", 8, 1)]
    b = s.requests["b"]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8 and b.host_block_ids == [0, 1]
    assert s.swap.num_free == 2
    while "a" in s.requests:
        out, _ = step(s)
    out, _ = step(s)  # b comes back: host 0, 1 -> fresh device blocks, then decodes one token
    assert [h for h, _ in out.swap_in] == [0, 1]
    assert [d for _, d in out.swap_in] == out.requests[0].block_ids[:2]
    assert plan(out)[0][:3] == ("b", 8, 1)  # no recomputation
    assert s.swap.num_free == 4  # released at the end of the step that read them


def test_swap_falls_back_to_recompute_without_host_room():
    s = make_scheduler(num_blocks=4, block_size=4, max_tokens=32, host_blocks=1, preemption_mode="swap")
    s.add_request(make_request("a", 7, max_tokens=6))
    s.add_request(make_request("b", 7, max_tokens=6))
    step(s)
    step(s)
    out, _ = step(s)
    assert out.swap_out == [] and s.requests["b"].status == RequestStatus.PREEMPTED


def test_abort_of_a_swapped_request_returns_its_host_blocks():
    s = make_scheduler(num_blocks=4, block_size=4, max_tokens=32, host_blocks=4, preemption_mode="swap")
    s.add_request(make_request("a", 7, max_tokens=6))
    s.add_request(make_request("b", 7, max_tokens=6))
    for _ in range(3):
        step(s)
    assert s.requests["b"].status == RequestStatus.SWAPPED
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    s.schedule()
    assert s.swap.num_free == 4


def test_long_prefill_threshold_caps_each_request_per_step():
    s = make_scheduler(max_tokens=64, long_prefill_token_threshold=5)
    s.add_request(make_request("long", 12, max_tokens=1))
    s.add_request(make_request("short", 3, max_tokens=2))
    out, _ = step(s)
    assert plan(out) == [("long", 0, 5), ("short", 0, 3)]
    out, _ = step(s)
    assert plan(out) == [("long", 5, 5), ("short", 3, 1)]


def cached_ids(s: Scheduler) -> set[int]:
    return {b.block_id for b in s.kv.pool.cached.values()}


def test_a_failed_step_forgets_its_cache_entries_and_fails_only_its_requests():
    s = make_scheduler(max_tokens=64, max_seqs=3)
    shared = list(range(500, 508))
    s.add_request(make_request("a", 0, prompt=shared + [1], max_tokens=5))
    step(s)  # a's two full blocks are computed and committed
    committed = cached_ids(s)
    assert committed == {0, 1}
    s.add_request(make_request("b", 0, prompt=shared + list(range(600, 609)), max_tokens=3))  # hits a's blocks
    s.add_request(make_request("c", 9, max_tokens=3))
    s.add_request(make_request("d", 5, max_tokens=3))  # max_seqs: stays waiting
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b", "c"]
    # a holds 0-2 (9 tokens); b hits 0, 1 and fills 3, 4 (5 is partial); c fills 6, 7 (8 is partial)
    assert cached_ids(s) == committed | {3, 4, 6, 7}
    outs = s.fail_step(out, "the model step failed: boom")
    assert {(o.request_id, o.finished_status, o.error) for o in outs} == {
        (r, RequestStatus.FINISHED_ERROR, "the model step failed: boom") for r in ("a", "b", "c")}
    assert cached_ids(s) == committed  # nothing the failed step made stays cached
    assert list(s.requests) == ["d"] and s.requests["d"].status == RequestStatus.WAITING
    s.check_integrity()
    assert s.kv.pool.num_free_blocks == 32
    s.add_request(make_request("e", 0, prompt=shared + list(range(600, 609)), max_tokens=1))
    out = s.schedule()
    e = next(r for r in out.requests if r.request_id == "e")
    assert e.start_pos == 8  # a hit on a's committed blocks only, not on b's forgotten ones


def test_same_step_hits_on_a_failed_step_are_rolled_back_too():
    s = make_scheduler(max_tokens=64)
    prompt = list(range(700, 709))
    s.add_request(make_request("x", 0, prompt=prompt, max_tokens=2))
    s.add_request(make_request("y", 0, prompt=prompt, max_tokens=2))
    out = s.schedule()
    assert plan(out) == [("x", 0, 9), ("y", 8, 1)]  # y hit x's blocks in the same step
    s.fail_step(out, "boom")
    assert s.kv.pool.cached == {} and s.kv.pool.num_free_blocks == 32
    s.check_integrity()


def test_a_successful_step_commits_and_a_sampling_failure_fails_that_request_alone():
    s = make_scheduler(max_tokens=64)
    s.add_request(make_request("a", 8, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3))
    out = s.schedule()
    res = s.update(out, ModelRunnerOutput({"a": 7}, failed={"b": "sampling failed: bad seed"}))
    s.check_integrity()
    assert [(o.request_id, o.finished_status, o.error) for o in res] == [
        ("b", RequestStatus.FINISHED_ERROR, "sampling failed: bad seed"), ("a", None, None)]
    # committed: b's KV was computed (only its sampling failed), so its freed blocks stay cached
    assert cached_ids(s) == {0, 1, 2, 3}
    assert [b.ref_cnt for b in s.kv.pool.blocks[:4]] == [1, 1, 0, 0]
    assert list(s.requests) == ["a"] and s.requests["a"].output_token_ids == [7]
    step(s)
    assert s.requests["a"].output_token_ids == [7, 7]


def test_a_bug_in_schedule_rolls_back_then_fail_all_frees_everything():
    s = make_scheduler(max_tokens=64)
    s.add_request(make_request("a", 8, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3))
    real = s.kv.get_computed_blocks

    def broken(req):
        if req.request_id == "b":
            raise RuntimeError("a bug")
        return real(req)

    s.kv.get_computed_blocks = broken
    with pytest.raises(RuntimeError, match="a bug"):
        s.schedule()  # a was scheduled (its blocks cached) before b broke
    assert s.kv.pool.cached == {}
    outs = s.fail_all("internal error: a bug")
    assert sorted(o.request_id for o in outs) == ["a", "b"] and not s.requests
    s.check_integrity()
    assert s.kv.pool.num_free_blocks == 32


def test_without_chunked_prefill_the_budget_holds_any_prompt_the_model_takes():
    cfg = SchedulerConfig(enable_chunked_prefill=False)
    assert cfg.resolved(8192).max_num_batched_tokens == 8192
    assert cfg.resolved(512).max_num_batched_tokens == 2048
    assert SchedulerConfig().resolved(8192).max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match="smaller than --max-model-len 4096"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1000).resolved(4096)
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=8)


def test_without_chunked_prefill_a_prompt_of_the_whole_budget_runs_once_the_step_is_free():
    s = make_scheduler(max_tokens=16, chunked=False)
    s.add_request(make_request("a", 4, max_tokens=3))
    step(s)
    s.add_request(make_request("big", 16, max_tokens=1))
    out, _ = step(s)  # a's decode takes one token of the budget: big does not fit whole yet
    assert plan(out) == [("a", 4, 1)]
    out, _ = step(s)
    assert plan(out) == [("a", 5, 1)]
    out, _ = step(s)  # a is done: big runs whole
    assert plan(out) == [("big", 0, 16)]


def test_step_stats():
    s = make_scheduler(max_tokens=10, max_seqs=2)
    s.add_request(make_request("a", 6, max_tokens=3))
    s.add_request(make_request("b", 6, max_tokens=3))
    s.add_request(make_request("c", 6, max_tokens=3))
    step(s)
    st = s.make_stats()
    assert (st.num_running, st.num_waiting, st.num_prefill_tokens, st.num_decode_tokens) == (2, 1, 10, 0)
    step(s)
    st = s.make_stats()
    assert (st.num_prefill_tokens, st.num_decode_tokens) == (2, 1)  # b's last prompt chunk, a's decode
    assert st.kv_cache_usage == 4 / 32 and st.prefix_cache.requests == 0
