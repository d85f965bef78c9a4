"""The async engine's parts that need no model: a request's cache scope and options, the
queue limit, the stream table and the tenants' shares of the preprocessing workers."""

from __future__ import annotations

import asyncio

import pytest

from hotprefix.core.hashing import MAX_CACHE_SALT_CHARS, UNSALTED, BlockHasher, CacheScope
from hotprefix.engine.admission import Admission
from hotprefix.engine.outputs import CompletionOutput, RequestOutput
from hotprefix.engine.prepare import PreparedRequest
from hotprefix.engine.preprocess import TenantShares
from hotprefix.engine.requests import RequestOptions
from hotprefix.engine.streams import StreamTable
from hotprefix.errors import InvalidRequestError, QueueFullError


@pytest.mark.parametrize("salt,offset,param,match", [
    ("x" * (MAX_CACHE_SALT_CHARS + 1), 0, "cache_salt", "at most 1024"),
    (7, 0, "cache_salt", "must be a string"),
    ("a\ud800b", 0, "cache_salt", "lone surrogate"),
    (None, -1, "cache_salt_offset", ">= 0"),
    ("t", 2**63, "cache_salt_offset", ">= 0"),
    ("t", 1.5, "cache_salt_offset", ">= 0"),
])
def test_a_cache_scope_no_request_may_carry_is_refused_when_made(salt, offset, param, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        CacheScope(salt, offset)
    assert e.value.param == param


def test_the_salt_keys_its_first_salted_block_only():
    assert [CacheScope("t", 9).extra_keys(i, 4) for i in range(4)] == [(), (), ("salt", "t"), ()]
    assert [UNSALTED.extra_keys(i, 4) for i in range(3)] == [(), (), ()]
    assert CacheScope("x" * MAX_CACHE_SALT_CHARS, 2**63 - 1).offset == 2**63 - 1  # the limits themselves pass
    h = BlockHasher(4)
    toks = list(range(16))
    # blocks before the salted one are shared with unsalted requests; from it on, none are
    assert h.hashes_of(toks, CacheScope("t", 9))[:2] == h.hashes_of(toks)[:2]
    assert set(h.hashes_of(toks, CacheScope("t", 9))[2:]).isdisjoint(h.hashes_of(toks))


def test_request_options_refuse_a_priority_outside_int64():
    with pytest.raises(InvalidRequestError) as e:
        RequestOptions(priority=2**63)
    assert e.value.param == "priority"
    assert RequestOptions(priority=-(2**63)).priority == -(2**63)
    assert RequestOptions().tenant is None and RequestOptions().cache_scope == UNSALTED


def test_admission_counts_sequences_against_the_one_limit():
    a = Admission(4)
    a.admit(3)
    with pytest.raises(QueueFullError, match="3 sequences waiting"):
        a.admit(2)
    with pytest.raises(InvalidRequestError, match="more than the 4") as e:
        a.admit(5)
    assert e.value.param == "n" and a.num_queued == 3  # refused requests count nothing
    a.release(3)
    a.admit(4)
    assert a.num_queued == 4


def _prepared(request_id: str, samples: int) -> PreparedRequest:
    return PreparedRequest(request_id, None, [1, 2, 3], [None] * samples, 0.0)  # (only their number counts here)


def _output(request_id: str, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2, 3], [CompletionOutput(0, "x", [5], "stop" if finished else None)],
                         ["x"], finished)


def test_streams_leave_the_queued_count_once_and_abort_only_when_unended():
    async def main():
        admission, aborted = Admission(10), []
        admission.admit(3)
        table = StreamTable(admission, aborted.append)
        s1, s2 = table.open([_prepared("r1", 2), _prepared("r2", 1)])
        assert len(table) == 2 and s1.weight == 2 and s2.weight == 1
        table.deliver("r1", _output("r1", False))
        table.deliver("r1", _output("r1", False))
        assert admission.num_queued == 1 and len(table) == 2  # r1 started: its 2 sequences left, once
        table.deliver("r1", _output("r1", True))
        table.deliver("nobody", _output("nobody", True))  # an id no stream holds: dropped
        assert [o.finished async for o in s1] == [False, False, True]
        assert len(table) == 1 and aborted == []  # r1 ended: closing it aborts nothing
        s2.close()  # before its first output: it stops counting and is aborted
        assert admission.num_queued == 0 and len(table) == 0 and aborted == ["r2"]
        s2.close()
        assert admission.num_queued == 0 and aborted == ["r2"]  # closing is idempotent

    asyncio.run(main())


def test_failing_every_stream_ends_each_with_the_error():
    async def main():
        admission = Admission(10)
        admission.admit(2)
        table = StreamTable(admission, lambda rid: None)
        streams = table.open([_prepared("a", 1), _prepared("b", 1)])
        table.fail_all(RuntimeError("gone"))
        for s in streams:
            with pytest.raises(RuntimeError, match="gone"):
                [o async for o in s]
        assert len(table) == 0 and admission.num_queued == 0

    asyncio.run(main())


async def _settle() -> None:
    """Let every ready task run until it waits (no time passes: the loop has nothing else)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_tenant_holds_at_most_half_of_the_workers_and_no_tenant_is_not_counted():
    async def main():
        shares = TenantShares(workers=4, timeout=30)
        assert await shares.take(None) is None and shares.busy == {}
        a1, a2 = await shares.take("a"), await shares.take("a")
        waiting = asyncio.ensure_future(shares.take("a"))
        b = await shares.take("b")  # another tenant is not held up
        await _settle()
        assert not waiting.done() and shares.busy == {"a": 2, "b": 1}
        a1()
        a3 = await waiting
        assert shares.busy == {"a": 2, "b": 1}
        for release in (a2, a3, b):
            release()
        await _settle()
        assert shares.busy == {}
        assert await TenantShares(workers=1, timeout=30).take("a") is None  # one worker: a share would be all

    asyncio.run(main())


def test_a_tenant_waiting_past_the_budget_gets_a_400():
    async def main():
        shares = TenantShares(workers=2, timeout=0.01)
        await shares.take("a")
        with pytest.raises(InvalidRequestError, match="held its share"):
            await shares.take("a")
        assert shares.busy == {"a": 1}

    asyncio.run(main())
