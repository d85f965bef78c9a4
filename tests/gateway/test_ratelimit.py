"""Rate limits, the same behaviour from the in-memory store and from a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from hotprefix.gateway.ratelimit import Limits, MemoryLimiter, RedisLimiter


@pytest.fixture(params=["memory", "redis"])
def limiter(request):
    if request.param == "memory":
        return MemoryLimiter()
    return RedisLimiter(request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex[:8]}:")


def run(coro):
    return asyncio.run(coro)


def test_requests_per_minute(limiter):
    async def go():
        lim = Limits(rpm=3)
        got = [await limiter.acquire("k", lim, 1, 1, f"r{i}") for i in range(4)]
        await limiter.close()
        return got
    got = run(go())
    assert [d.admitted for d in got] == [True, True, True, False]
    assert got[0].headers["x-ratelimit-limit-requests"] == "3"
    assert got[0].headers["x-ratelimit-remaining-requests"] == "2"
    assert got[3].reason == "requests" and 19 < got[3].retry_after <= 20  # one request refills in 60/3 s
    assert got[3].headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_reserved_then_settled(limiter):
    async def go():
        lim = Limits(tpm=100)
        a = await limiter.acquire("k", lim, 60, 60, "a")
        b = await limiter.acquire("k", lim, 60, 60, "b")          # 40 left: refused
        await limiter.settle("k", lim, reserved=60, used=10, request_id="a")  # 50 back: 90 left
        c = await limiter.acquire("k", lim, 60, 60, "c")
        d = await limiter.acquire("k", lim, 101, 101, "d")         # can never fit
        await limiter.close()
        return a, b, c, d
    a, b, c, d = run(go())
    assert a.admitted and not b.admitted and b.reason == "tokens" and 11 < b.retry_after <= 12
    assert c.admitted and int(c.headers["x-ratelimit-remaining-tokens"]) == 30
    assert not d.admitted and d.reason == "too_large"


def test_concurrency_leases(limiter):
    async def go():
        lim = Limits(max_concurrent=2)
        got = [(await limiter.acquire("k", lim, 1, 1, r)).admitted for r in ("a", "b", "c")]
        await limiter.settle("k", lim, 1, 1, "a")
        got.append((await limiter.acquire("k", lim, 1, 1, "d")).admitted)
        other = (await limiter.acquire("other-key", lim, 1, 1, "e")).admitted  # keys do not share limits
        await limiter.close()
        return got, other
    got, other = run(go())
    assert got == [True, True, False, True] and other


def test_concurrent_acquires_admit_exactly_the_limit(limiter):
    async def go():
        lim = Limits(rpm=10, max_concurrent=50)
        got = await asyncio.gather(*(limiter.acquire("k", lim, 1, 1, f"r{i}") for i in range(50)))
        await limiter.close()
        return got
    assert sum(d.admitted for d in run(go())) == 10


def test_memory_bucket_refills_with_time():
    now = [1000.0]
    lim = MemoryLimiter(clock=lambda: now[0])
    limits = Limits(rpm=6)  # one request per 10 s

    async def go():
        got = [(await lim.acquire("k", limits, 1, 1, f"r{i}")).admitted for i in range(7)]
        now[0] += 9.9
        got.append((await lim.acquire("k", limits, 1, 1, "x")).admitted)
        now[0] += 0.2
        got.append((await lim.acquire("k", limits, 1, 1, "y")).admitted)
        now[0] += 3600  # never more than the limit, however long the pause
        got += [(await lim.acquire("k", limits, 1, 1, f"z{i}")).admitted for i in range(7)]
        return got
    assert run(go()) == [True] * 6 + [False, False, True] + [True] * 6 + [False]


def test_memory_lease_expires():
    now = [0.0]
    lim = MemoryLimiter(lease_s=30, clock=lambda: now[0])

    async def go():
        limits = Limits(max_concurrent=1)
        a = (await lim.acquire("k", limits, 1, 1, "a")).admitted
        b = (await lim.acquire("k", limits, 1, 1, "b")).admitted
        now[0] = 31  # the gateway that held "a" died: its lease runs out
        c = (await lim.acquire("k", limits, 1, 1, "c")).admitted
        return a, b, c
    assert run(go()) == (True, False, True)


def test_a_request_is_granted_what_the_bucket_holds_up_to_what_it_wants(limiter):
    async def go():
        lim = Limits(tpm=100)
        a = await limiter.acquire("k", lim, want=70, least=5, request_id="a")
        b = await limiter.acquire("k", lim, want=70, least=5, request_id="b")  # 30 left: granted 30
        c = await limiter.acquire("k", lim, want=70, least=5, request_id="c")  # 0 left: refused
        await limiter.close()
        return a, b, c
    a, b, c = run(go())
    assert (a.admitted, a.granted) == (True, 70) and (b.admitted, b.granted) == (True, 30)
    assert not c.admitted and c.reason == "tokens"


def test_a_renewed_lease_outlives_its_first_term():
    now = [0.0]
    lim = MemoryLimiter(lease_s=30, clock=lambda: now[0])

    async def go():
        limits = Limits(max_concurrent=1)
        assert (await lim.acquire("k", limits, 1, 1, "a")).admitted
        for t in (20, 40, 60):  # a long stream, renewed by the heartbeat
            now[0] = t
            await lim.renew("k", "a")
        now[0] = 75
        blocked = (await lim.acquire("k", limits, 1, 1, "b")).admitted
        await lim.settle("k", limits, 1, 1, "a")
        return blocked, (await lim.acquire("k", limits, 1, 1, "c")).admitted
    assert run(go()) == (False, True)


def test_redis_keeps_a_bucket_in_debt_until_it_would_be_full(redis_url):
    """The same debt rule as in memory: a key 300 tokens in debt on a 100-per-minute
    bucket needs 4 minutes to be full again, so Redis keeps it at least that long."""
    import redis

    prefix = f"t{uuid.uuid4().hex[:8]}:"
    lim = RedisLimiter(redis_url, prefix=prefix)

    async def go():
        limits = Limits(tpm=100)
        assert (await lim.acquire("k", limits, 100, 100, "a")).admitted
        await lim.settle("k", limits, reserved=100, used=400, request_id="a")
        refused = await lim.acquire("k", limits, 10, 10, "b")
        await lim.close()
        return refused
    refused = run(go())
    assert not refused.admitted and refused.retry_after > 180
    assert redis.Redis.from_url(redis_url).ttl(f"{prefix}k:tok") >= 240
