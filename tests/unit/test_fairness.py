"""Tenant-fair steps (core/fairness.py) and samples that follow their first (n > 1), on
the scheduler with a fake runner: exact plans, integrity after every step."""

from __future__ import annotations

import pytest

from hotprefix.core.fairness import FairShares, water_fill
from hotprefix.core.request import RequestStatus
from tests.unit.builders import make_request
from tests.unit.test_scheduler import make_scheduler, plan, run_blast, step


def tenant_request(rid: str, tenant: str | None, n: int, max_tokens: int = 4, **kw):
    r = make_request(rid, n, max_tokens=max_tokens, **kw)
    r.tenant = tenant
    return r


@pytest.mark.parametrize("capacity,demands,weights,want", [
    (16, {"a": 100, "b": 5}, {}, {"a": 11, "b": 5}),  # b needs less than half: a takes the rest
    (16, {"a": 100, "b": 100}, {}, {"a": 8, "b": 8}),
    (16, {"a": 100, "b": 100}, {"a": 3.0}, {"a": 12, "b": 4}),
    (10, {"a": 100, "b": 100, "c": 100}, {}, {"a": 4, "b": 3, "c": 3}),  # the remainder: one each, by name
    (16, {"a": 3, "b": 4, "c": 0}, {}, {"a": 3, "b": 4, "c": 0}),  # less demand than capacity: all of it
    (16, {"a": 100, "b": 7, "c": 100}, {"b": 0.5}, {"a": 7, "b": 3, "c": 6}),  # b: 3.2 of 16, a and c 6.4
])
def test_water_fill_is_weighted_max_min_fair(capacity, demands, weights, want):
    w = {t: weights.get(t, 1.0) for t in demands}
    got = water_fill(capacity, demands, w)
    assert got == want
    assert sum(got.values()) == min(capacity, sum(demands.values()))


def test_a_tenant_overdrawing_without_chunking_repays_from_its_next_allowances():
    shares = FairShares({})
    shares.plan(16, 4, {"a": 30, "b": 30}, {"a": 1, "b": 1}, {})
    assert shares.left("a") == 8
    shares.take("a", 20, seated=True)  # a whole prompt of 20 on an allowance of 8
    shares.end_step()
    shares.plan(16, 4, {"a": 30, "b": 30}, {"a": 1, "b": 1}, {"a": 1})
    assert shares.left("a") == -4 and shares.left("b") == 16  # b: a's 8 too
    shares.end_step()
    shares.plan(16, 4, {"a": 30, "b": 30}, {"a": 1, "b": 1}, {"a": 1})
    assert shares.left("a") == 4 and shares.left("b") == 12  # repaid: 8 - 4
    shares.take("a", 6, seated=False)
    shares.end_step()
    shares.plan(16, 4, {"a": 1, "b": 2}, {"a": 1, "b": 1}, {"a": 1})
    assert shares.left("a") == 1 + 13  # the step holds everyone's work: its debt of 2 delays nobody; 13 spare
    shares.take("a", 3, seated=False)  # its 1, then 2 of the spare: no debt
    assert shares.left("b") == 2 + 11
    shares.end_step()
    shares.plan(16, 4, {"a": 30, "b": 30}, {"a": 1, "b": 1}, {})
    assert shares.left("a") == 8
    shares.take("a", 20, seated=True)
    shares.end_step()
    shares.plan(16, 4, {"b": 30}, {"b": 1}, {})  # a has no work: its debt is forgiven
    shares.end_step()
    shares.plan(16, 4, {"a": 30}, {"a": 1}, {})
    assert shares.left("a") == 16


def test_seats_are_shared_and_the_spare_ones_are_anyones():
    shares = FairShares({})
    shares.plan(16, 2, {"a": 30, "b": 30}, {"a": 5, "b": 5}, {"a": 1})
    assert not shares.may_seat("a") and shares.may_seat("b")
    shares.plan(16, 4, {"a": 30, "b": 30}, {"a": 5, "b": 1}, {"a": 3})
    assert not shares.may_seat("a") and shares.may_seat("b")
    shares.take("b", 1, seated=True)
    shares.plan(16, 4, {"a": 30, "b": 1}, {"a": 1, "b": 1}, {"a": 1})
    assert shares.may_seat("a")  # 2 seats nobody's demand counted on
    shares.take("a", 1, seated=True)
    shares.take("a", 1, seated=True)
    assert not shares.may_seat("a") and shares.may_seat("b")


def test_a_burst_of_one_tenant_leaves_the_other_its_share_of_every_step():
    s = make_scheduler(num_blocks=64, max_tokens=16, max_seqs=8)
    for i in range(6):
        s.add_request(tenant_request(f"a{i}", "acme", 20))
    out, _ = step(s)
    assert plan(out) == [("a0", 0, 16)]  # alone, acme takes the whole budget
    s.add_request(tenant_request("b", "beta", 5, max_tokens=1))
    out, res = step(s)
    assert plan(out) == [("a0", 16, 4), ("a1", 0, 7), ("b", 0, 5)]  # beta's 5 first; acme the other 11
    assert [o.request_id for o in res if o.finished] == ["b"]  # its first (and only) token, one step after it came
    s.add_request(tenant_request("b2", "beta", 30, max_tokens=1))
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests if r.request_id.startswith("b")] == [("b2", 8)]
    assert out.num_scheduled_tokens == 16


def test_weights_split_the_budget():
    s = make_scheduler(num_blocks=64, max_tokens=16, tenant_weights=(("acme", 3.0),))
    s.add_request(tenant_request("a", "acme", 40))
    s.add_request(tenant_request("b", "beta", 40))
    for _ in range(2):
        out, _ = step(s)
        assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 12), ("b", 4)]


def test_a_tenant_holding_its_seats_is_passed_over_for_another_tenants_request():
    s = make_scheduler(num_blocks=64, max_tokens=16, max_seqs=2)
    for i in range(3):
        s.add_request(tenant_request(f"a{i}", "acme", 2, max_tokens=2 + i))
    out, _ = step(s)
    assert plan(out) == [("a0", 0, 2), ("a1", 0, 2)]  # both seats, nobody else waits
    s.add_request(tenant_request("b", "beta", 2, max_tokens=1))
    step(s)
    out, _ = step(s)  # a0 finished: its seat goes to beta, whose share is one seat, not to a2 queued before it
    assert [r.request_id for r in out.requests] == ["a1", "b"]


def test_without_chunking_a_prompt_goes_whole_on_a_positive_allowance():
    s = make_scheduler(num_blocks=64, max_tokens=16, chunked=False)
    s.add_request(tenant_request("a", "acme", 12, max_tokens=2))
    s.add_request(tenant_request("b", "beta", 12, max_tokens=2))
    out, _ = step(s)
    assert plan(out) == [("a", 0, 12)]  # beta's prompt no longer fits the step; acme overdrew its 8 by 4
    out, _ = step(s)
    assert plan(out) == [("a", 12, 1), ("b", 0, 12)]


def test_samples_follow_the_first_and_start_from_its_blocks():
    s = make_scheduler(num_blocks=64, max_tokens=8)
    first = make_request("r#0", 10, max_tokens=1)
    others = [make_request(f"r#{i}", 10, max_tokens=1, prompt=first.prompt_token_ids) for i in (1, 2)]
    s.add_request(first)
    for o in others:
        o.follows = first
        s.add_request(o)
    out, _ = step(s)
    assert plan(out) == [("r#0", 0, 8)]  # the others wait though the step has room
    out, _ = step(s)
    assert plan(out) == [("r#0", 8, 2), ("r#1", 8, 2), ("r#2", 8, 2)]  # its 2 full blocks are theirs
    assert [s.requests.get(o.request_id) for o in others] == [None, None]
    assert all(o.num_cached_tokens == 8 for o in others)


def test_a_sample_whose_first_was_aborted_does_not_wait_for_it():
    s = make_scheduler(num_blocks=64, max_tokens=4)
    first = make_request("r#0", 10, max_tokens=1)
    other = make_request("r#1", 10, max_tokens=1, prompt=first.prompt_token_ids)
    other.follows = first
    s.add_request(first)
    s.add_request(other)
    step(s)
    s.finish_requests(["r#0"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert plan(out) == [("r#1", 4, 4)]  # the block r#0 computed is a hit


@pytest.mark.parametrize("policy,mode", [("fcfs", "recompute"), ("priority", "swap")])
def test_seeded_random_blast_with_tenants(policy, mode):
    for seed in range(4):
        run_blast(seed, num_blocks=12, block_size=4, budget=16, max_seqs=4, n_requests=40, policy=policy,
                  mode=mode, host_blocks=6 if mode == "swap" else 0, tenants=3)
