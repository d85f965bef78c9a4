"""The hit-rate curve's models (hotprefix/cachecurve) against replays through the engine's
own Scheduler and KVCacheManager (tools/cache_sim.py): the policy simulation request by
request, the one-pass curve at every pool size (exactly where the policy is a stack
algorithm, within the stated bound where it is not), a sample within its stated error."""

from __future__ import annotations

import numpy as np
import pytest

from hotprefix.cachecurve.advice import Size, advise, flag_bytes, to_json
from hotprefix.cachecurve.curve import Options, build
from hotprefix.cachecurve.policy_sim import PolicySim
from hotprefix.cachecurve.request import SimRequest
from hotprefix.cachecurve.spatial import Sample
from hotprefix.cachecurve.stack_pass import Pass
from hotprefix.tokenizers.prompt_encoder import PromptEncoder
from hotprefix.tools.cache_sim import CacheSize, replay
from hotprefix.tools.lint import Linter
from tests.tools.curve_logs import chats
from tests.tools.lint_logs import LOGS


def replayed(reqs: list[SimRequest], bs: int, device: int | None, host: int = 0,
             pinned: list[SimRequest] = ()) -> int:
    return replay(reqs, bs, CacheSize(device, host), pinned).total_hits


@pytest.mark.parametrize("seed", range(12))
def test_the_policy_simulation_is_the_engine_request_by_request(seed):
    bs = (1, 2, 4, 16)[seed % 4]
    reqs, _ = chats(50, seed, bs, repeat=0.15)
    for device in (1, 3, 8, 21, 80):
        for host in (0, 1, 10, 50):
            engine = replay(reqs, bs, CacheSize(device, host))
            sim = PolicySim(device, host, bs)
            got = [sim.run(r) for r in reqs]
            assert [g or 0 for g in got] == engine.hits and sum(g is None for g in got) == engine.too_big


@pytest.mark.parametrize("seed", range(4))
def test_the_pass_is_exact_at_every_size_where_the_policy_is_a_stack_algorithm(seed):
    """No prompt sent again: every pool that holds the largest request gets exactly the
    replay's hits, the unbounded cache included."""
    bs = (1, 2, 4, 16)[seed % 4]
    reqs, _ = chats(60, seed, bs)
    p = Pass(bs)
    for r in reqs:
        p.feed(r)
    curve = build(reqs, [None] * len(reqs), bs, None, Options(checks=0))
    assert p.moved == 0 and curve.moved == 0 and curve.largest == p.largest
    for device in range(p.largest, curve.grid()[-1] + 3):
        assert curve.hits.at(device) * bs == replayed(reqs, bs, device), device
    assert curve.hits.total * bs == replayed(reqs, bs, None)


def test_pinned_prefixes_hold_their_blocks_and_always_hit():
    bs = 4
    reqs, _ = chats(60, 3, bs)
    pins = [SimRequest(reqs[0].hashes, reqs[0].prompt_tokens)]
    keys = frozenset(reqs[0].hashes[:reqs[0].prompt_tokens // bs])
    curve = build(reqs, [None] * len(reqs), bs, None, Options(checks=0, pinned=keys))
    assert curve.moved == 0 and keys
    for device in range(curve.largest + len(keys), curve.grid()[-1] + 3):
        assert curve.hits.at(device) * bs == replayed(reqs, bs, device, pinned=pins), device


@pytest.fixture(scope="module")
def encoder(tiny_llama):
    from transformers import AutoTokenizer

    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_llama[0])))


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("name", list(LOGS))
def test_the_curve_of_the_lint_logs_is_the_engine_replay_at_every_size(name, bs, encoder):
    """Support bot, RAG, interleaved chats: the one-pass curve equals a full replay at
    every pool size; the host tier's points equal the replay with that tier."""
    linter = Linter(encoder, bs)
    reqs = [linter.prepare(b).sim for b in LOGS[name]()]
    tokens = sum(r.prompt_tokens for r in reqs)
    curve = build(reqs, [None] * len(reqs), bs, None, Options(host_blocks=12, pools=(2 * len(reqs),)))
    assert curve.moved == 0 and curve.check_error in (0.0, None)
    for device in range(curve.largest, curve.grid()[-1] + 3):
        assert curve.rate(device) == replayed(reqs, bs, device) / tokens, device
    assert curve.unbounded == replayed(reqs, bs, None) / tokens
    assert len(curve.host_points) >= 2 and 2 * len(reqs) in dict(curve.host_points)
    for device, rate in curve.host_points:
        assert rate == replayed(reqs, bs, device, 12) / tokens, device


def test_prompts_sent_again_stay_within_the_stated_bound_at_every_size(encoder):
    """An identical prompt sent again recomputes past the cap what is still cached: the
    engine keeps the old copy where it was, the pass moves it (not a stack algorithm).
    Each chat prompt is sent twice: every size within 1 point, and the checks at three
    sizes state that bound."""
    bs = 4
    linter = Linter(encoder, bs)
    bodies = LOGS["multi_turn"]()
    reqs = [r for b in bodies for r in [linter.prepare(b, 5).sim] * 2]
    tokens = sum(r.prompt_tokens for r in reqs)
    curve = build(reqs, [None] * len(reqs), bs, None, Options(checks=3))
    assert curve.moved > 0 and len(curve.checks) == 3
    worst = max(abs(curve.rate(d) - replayed(reqs, bs, d) / tokens) for d in range(curve.largest, curve.grid()[-1]))
    assert worst <= 0.01 and curve.check_error <= 1.0
    assert all(c.replayed == replayed(reqs, bs, c.blocks) / tokens for c in curve.checks)


def test_a_sample_is_within_its_stated_error():
    bs = 16
    reqs, tenants = chats(3000, 11, bs, convs=400, systems=12, tenants=3)
    exact = build(reqs, tenants, bs, None, Options(checks=0))
    sampled = build(reqs, tenants, bs, None, Options(checks=0, sample_rate=0.25))
    assert exact.sample_rate == 1 and exact.sample_error is None
    assert sampled.sample_rate == 0.25 and sampled.sample_error > 0
    sizes = exact.grid()
    err = max(abs(sampled.rate(s) - exact.rate(s)) * 100 for s in sizes)
    assert err <= sampled.sample_error, (err, sampled.sample_error)
    assert sampled.prompt_tokens == exact.prompt_tokens and sampled.requests == exact.requests


def test_a_sample_keeps_whole_prefixes():
    keys = [bytes([a, b]) + b"rest" for a in range(256) for b in (0, 255)]
    shards = Sample.shards(0.5, 4)
    kept = [s.keep(keys) for s in shards]
    assert [len(k) for k in kept] == [64] * 4 and len(set().union(*map(set, kept))) == 256
    assert shards[0].keep(["00ff" + "0" * 12, "2000" + "0" * 12]) == ["00ff" + "0" * 12]  # a log's hex digests


def test_empty_and_single_request_curves():
    empty = build([], [], 16)
    assert empty.requests == 0 and empty.unbounded == 0 and empty.rate(100) == 0 and empty.checks == ()
    js = to_json(empty, advise(empty, 1024, 8), 1024)
    assert js["advice"]["recommended"] is None and js["points"][0]["hit_rate"] == 0
    one = build([SimRequest(tuple(b"%d" % i for i in range(4)), 64, 3)], [None], 16)
    assert one.unbounded == 0 and one.largest == 5 and one.rate(5) == 0


def test_the_advice_speaks_in_flags():
    assert flag_bytes(6 << 30) == "6GiB" and flag_bytes((6 << 30) + 1) == "6.1GiB"
    assert flag_bytes(5 << 20) == "5MiB" and flag_bytes(1000) == "1000"
    s = Size.of(1000, 737_280)  # smollm2 in float32: --kv-cache-memory gives at least the pool asked
    assert s.flag == "704MiB" and s.blocks >= 1000 and s.bytes == 704 << 20
    reqs, tenants = chats(400, 5, 16, convs=40, tenants=2)
    curve = build(reqs, tenants, 16, 100.0, Options(checks=0, host_blocks=50, pools=(200,)))
    a = advise(curve, 737_280, 200)
    assert a.recommended and curve.rate(a.recommended.blocks) >= 0.95 * curve.unbounded
    assert curve.rate(a.recommended.blocks - 1) < 0.95 * curve.unbounded or a.recommended.blocks > curve.pool_for(0.95)
    assert a.host_gain == pytest.approx(curve.host_rate(200) - curve.rate(200))
    assert {t["salt"] for t in a.tenants} == {"t0", "t1"}
    pts = to_json(curve, a, 737_280)["points"]
    assert {p["host_blocks"] for p in pts} == {0, 50} and all(p["bytes"] == p["blocks"] * 737_280 for p in pts)
    assert np.all(np.diff([p["hit_rate"] for p in pts if not p["host_blocks"]]) >= 0)  # more pool, no fewer hits
