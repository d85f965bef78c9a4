"""Per-key rate limits: requests per minute, tokens per minute, concurrent requests.

Each per-minute limit is a token bucket of capacity `limit` refilled at
`limit / 60` per second, so a full minute's budget can be spent at once and then
refills smoothly. Tokens are reserved at admission and settled when the
request ends: the bucket gets back what was reserved and not used (or gives up
more, down to below zero, if the estimate was low). A request asks for as much
as it wants (prompt estimate + max_tokens x sequences) but at least the least it
can run with (one token per sequence); it is granted what the bucket holds up to
what it wants, so the gateway can cut its max_tokens to the key's remaining budget.
A bucket in debt refills at the same rate in both stores; Redis keeps a bucket
until it would be full again, never forgiving debt early. Concurrency is a set
of leases that end with the request, renewed while it runs; if a gateway dies,
its leases expire after `lease_s`.

Two stores with one behaviour: `MemoryLimiter` (one process) and `RedisLimiter`
(several gateway processes share counters; one Lua script per decision, so
admission is atomic across processes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """None: no limit."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


class Refusal(str, Enum):
    """Why a request was not admitted."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    TOO_LARGE = "too_large"
    BUDGET = "budget"  # a key's or tenant's budget (gateway/budgets.py) is spent


@dataclass
class Decision:
    admitted: bool
    reason: Refusal | None = None
    retry_after: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    granted: int = 0  # tokens reserved, between `least` and `want`
    detail: str = ""  # which budget refused (Refusal.BUDGET)


class Limiter(Protocol):
    async def acquire(self, key_id: str, limits: Limits, want: int, least: int, request_id: str) -> Decision:
        """Admit or refuse, atomically. Admitting takes one request, one concurrency
        lease and `granted` tokens: as many as the bucket holds up to `want`, at
        least `least` (else refused)."""

    async def renew(self, key_id: str, request_id: str) -> None:
        """The request still runs: extend its lease by lease_s from now."""

    async def settle(self, key_id: str, limits: Limits, reserved: int, used: int, request_id: str) -> None:
        """End the request: return reserved - used tokens to the bucket, end its lease."""

    async def close(self) -> None:
        ...


def _fmt(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}s"


def headers_for(limits: Limits, req_level: float | None, tok_level: float | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits that are set."""
    h: dict[str, str] = {}
    for kind, limit, level in (("requests", limits.rpm, req_level), ("tokens", limits.tpm, tok_level)):
        if limit is None or level is None:
            continue
        h[f"x-ratelimit-limit-{kind}"] = str(limit)
        h[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
        h[f"x-ratelimit-reset-{kind}"] = _fmt((limit - level) * 60.0 / limit)
    return h


@dataclass
class _Bucket:
    level: float
    stamp: float

    def refill(self, limit: int, now: float) -> float:
        self.level = min(float(limit), self.level + (now - self.stamp) * limit / 60.0)
        self.stamp = now
        return self.level


class MemoryLimiter:
    """Counters in this process. Every method runs without awaiting, so on one
    event loop a decision is atomic."""

    def __init__(self, lease_s: float = 3600.0, clock=time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.req: dict[str, _Bucket] = {}
        self.tok: dict[str, _Bucket] = {}
        self.leases: dict[str, dict[str, float]] = {}

    def _bucket(self, table: dict[str, _Bucket], key: str, limit: int, now: float) -> _Bucket:
        b = table.setdefault(key, _Bucket(float(limit), now))
        b.refill(limit, now)
        return b

    async def acquire(self, key_id: str, limits: Limits, want: int, least: int, request_id: str) -> Decision:
        now = self.clock()
        rb = self._bucket(self.req, key_id, limits.rpm, now) if limits.rpm else None
        tb = self._bucket(self.tok, key_id, limits.tpm, now) if limits.tpm else None
        leases = self.leases.setdefault(key_id, {})
        for rid in [r for r, end in leases.items() if end <= now]:
            del leases[rid]
        hdr = headers_for(limits, rb.level if rb else None, tb.level if tb else None)
        if limits.tpm and least > limits.tpm:
            return Decision(False, Refusal.TOO_LARGE, 60.0, hdr)
        if rb and rb.level < 1:
            return Decision(False, Refusal.REQUESTS, (1 - rb.level) * 60.0 / limits.rpm, hdr)
        if tb and tb.level < least:
            return Decision(False, Refusal.TOKENS, (least - tb.level) * 60.0 / limits.tpm, hdr)
        if limits.max_concurrent and len(leases) >= limits.max_concurrent:
            return Decision(False, Refusal.CONCURRENCY, 1.0, hdr)
        granted = min(want, math.floor(tb.level)) if tb else want
        if rb:
            rb.level -= 1
        if tb:
            tb.level -= granted
        leases[request_id] = now + self.lease_s
        return Decision(True, None, 0.0, headers_for(limits, rb.level if rb else None, tb.level if tb else None),
                        granted)

    async def renew(self, key_id: str, request_id: str) -> None:
        leases = self.leases.get(key_id, {})
        if request_id in leases:
            leases[request_id] = self.clock() + self.lease_s

    async def settle(self, key_id: str, limits: Limits, reserved: int, used: int, request_id: str) -> None:
        now = self.clock()
        if limits.tpm:
            b = self._bucket(self.tok, key_id, limits.tpm, now)
            b.level = min(float(limits.tpm), b.level + reserved - used)
        self.leases.get(key_id, {}).pop(request_id, None)

    async def close(self) -> None:
        pass


# KEYS: requests bucket, tokens bucket, leases (sorted set). ARGV: rpm, tpm,
# max_concurrent (0: none), tokens wanted, request id, lease seconds, least tokens.
# Levels are stored as "level stamp" in a hash; time is the server's, shared by
# every gateway. A bucket key lives until the bucket would be full again (plus a
# minute), so a key in debt stays in debt exactly as long as in memory.
_KEEP = """
local function keep(key, limit, lvl)
  redis.call('EXPIRE', key, math.ceil((limit - math.min(limit, lvl)) * 60.0 / limit) + 60)
end
"""
_ACQUIRE = _KEEP + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local want, rid, lease, least = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local function level(key, limit)
  if limit <= 0 then return -1 end
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lvl, st = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then return limit end
  return math.min(limit, lvl + (now - st) * limit / 60.0)
end
local rl, tl = level(KEYS[1], rpm), level(KEYS[2], tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local active = redis.call('ZCARD', KEYS[3])
local reason, wait, granted = '', 0, want
if tpm > 0 and least > tpm then reason, wait = 'too_large', 60
elseif rpm > 0 and rl < 1 then reason, wait = 'requests', (1 - rl) * 60.0 / rpm
elseif tpm > 0 and tl < least then reason, wait = 'tokens', (least - tl) * 60.0 / tpm
elseif maxc > 0 and active >= maxc then reason, wait = 'concurrency', 1
end
if reason == '' then
  if rpm > 0 then rl = rl - 1 end
  if tpm > 0 then granted = math.min(want, math.floor(tl)); tl = tl - granted end
  redis.call('ZADD', KEYS[3], now + lease, rid)
  redis.call('EXPIRE', KEYS[3], math.ceil(lease) + 60)
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'level', rl, 'stamp', now); keep(KEYS[1], rpm, rl) end
if tpm > 0 then redis.call('HSET', KEYS[2], 'level', tl, 'stamp', now); keep(KEYS[2], tpm, tl) end
return {reason, tostring(wait), tostring(rl), tostring(tl), tostring(granted)}
"""

# KEYS: leases. ARGV: request id, lease seconds. Extends a lease that still exists.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 60)
end
return 1
"""

# KEYS: tokens bucket, leases. ARGV: tpm (0: none), tokens to give back (may be negative), request id.
_SETTLE = _KEEP + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local tpm, back = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 then
  local v = redis.call('HMGET', KEYS[1], 'level', 'stamp')
  local lvl, st = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then lvl, st = tpm, now end
  lvl = math.min(tpm, math.min(tpm, lvl + (now - st) * tpm / 60.0) + back)
  redis.call('HSET', KEYS[1], 'level', lvl, 'stamp', now)
  keep(KEYS[1], tpm, lvl)
end
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""


class RedisLimiter:
    """Counters in Redis at `url`, shared by every gateway that uses it. Raises
    ConfigError at `check()` when Redis cannot be reached."""

    def __init__(self, url: str, lease_s: float = 3600.0, prefix: str = "hotprefix:rl:") -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.lease_s = lease_s
        self.prefix = prefix
        self.r = aioredis.from_url(url)
        self._acquire = self.r.register_script(_ACQUIRE)
        self._renew = self.r.register_script(_RENEW)
        self._settle = self.r.register_script(_SETTLE)

    async def check(self) -> None:
        from redis.exceptions import RedisError

        from hotprefix.config import ConfigError

        try:
            await self.r.ping()
        except (RedisError, OSError) as e:
            raise ConfigError(f"cannot reach Redis at {self.url}: {e}") from None

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self.prefix}{key_id}:req", f"{self.prefix}{key_id}:tok", f"{self.prefix}{key_id}:leases"]

    async def acquire(self, key_id: str, limits: Limits, want: int, least: int, request_id: str) -> Decision:
        reason, wait, rl, tl, granted = await self._acquire(
            keys=self._keys(key_id),
            args=[limits.rpm or 0, limits.tpm or 0, limits.max_concurrent or 0, want, request_id, self.lease_s,
                  least])
        reason = reason.decode() if isinstance(reason, bytes) else reason
        hdr = headers_for(limits, float(rl) if limits.rpm else None, float(tl) if limits.tpm else None)
        return Decision(not reason, Refusal(reason) if reason else None, float(wait), hdr, int(float(granted)))

    async def renew(self, key_id: str, request_id: str) -> None:
        await self._renew(keys=[self._keys(key_id)[2]], args=[request_id, self.lease_s])

    async def settle(self, key_id: str, limits: Limits, reserved: int, used: int, request_id: str) -> None:
        k = self._keys(key_id)
        await self._settle(keys=[k[1], k[2]], args=[limits.tpm or 0, reserved - used, request_id])

    async def close(self) -> None:
        await self.r.aclose()
