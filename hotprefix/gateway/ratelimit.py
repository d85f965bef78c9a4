"""Per-key rate limits: requests per minute, tokens per minute, concurrent requests.

Each per-minute limit is a token bucket of capacity `limit` refilled at
`limit / 60` per second, so a full minute's budget can be spent at once and then
refills smoothly. Tokens are reserved at admission (prompt estimate +
max_tokens) and settled when the request ends: the bucket gets back what was
reserved and not used (or gives up more, down to below zero, if the estimate
was low). Concurrency is a set of leases that end with the request or, if a
gateway dies, after `lease_s`.

Two stores with one behaviour: `MemoryLimiter` (one process) and `RedisLimiter`
(several gateway processes share counters; one Lua script per decision, so
admission is atomic across processes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """None: no limit."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass
class Decision:
    admitted: bool
    reason: str = ""  # why not: "requests", "tokens", "concurrency" or "too_large"
    retry_after: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


class Limiter(Protocol):
    async def acquire(self, key_id: str, limits: Limits, tokens: int, request_id: str) -> Decision:
        """Admit (and reserve `tokens` and one request and one concurrency lease) or refuse, atomically."""

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

    async def acquire(self, key_id: str, limits: Limits, tokens: int, request_id: str) -> Decision:
        now = self.clock()
        rb = self._bucket(self.req, key_id, limits.rpm, now) if limits.rpm else None
        tb = self._bucket(self.tok, key_id, limits.tpm, now) if limits.tpm else None
        leases = self.leases.setdefault(key_id, {})
        for rid in [r for r, end in leases.items() if end <= now]:
            del leases[rid]
        hdr = headers_for(limits, rb.level if rb else None, tb.level if tb else None)
        if limits.tpm and tokens > limits.tpm:
            return Decision(False, "too_large", 60.0, hdr)
        if rb and rb.level < 1:
            return Decision(False, "requests", (1 - rb.level) * 60.0 / limits.rpm, hdr)
        if tb and tb.level < tokens:
            return Decision(False, "tokens", (tokens - tb.level) * 60.0 / limits.tpm, hdr)
        if limits.max_concurrent and len(leases) >= limits.max_concurrent:
            return Decision(False, "concurrency", 1.0, hdr)
        if rb:
            rb.level -= 1
        if tb:
            tb.level -= tokens
        leases[request_id] = now + self.lease_s
        return Decision(True, "", 0.0, headers_for(limits, rb.level if rb else None, tb.level if tb else None))

    async def settle(self, key_id: str, limits: Limits, reserved: int, used: int, request_id: str) -> None:
        now = self.clock()
        if limits.tpm:
            b = self._bucket(self.tok, key_id, limits.tpm, now)
            b.level = min(float(limits.tpm), b.level + reserved - used)
        self.leases.get(key_id, {}).pop(request_id, None)

    async def close(self) -> None:
        pass


# KEYS: requests bucket, tokens bucket, leases (sorted set). ARGV: rpm, tpm,
# max_concurrent (0: none), tokens, request id, lease seconds. Levels are stored
# as "level stamp" in a hash; time is the server's, shared by every gateway.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, rid, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
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
local reason, wait = '', 0
if tpm > 0 and tokens > tpm then reason, wait = 'too_large', 60
elseif rpm > 0 and rl < 1 then reason, wait = 'requests', (1 - rl) * 60.0 / rpm
elseif tpm > 0 and tl < tokens then reason, wait = 'tokens', (tokens - tl) * 60.0 / tpm
elseif maxc > 0 and active >= maxc then reason, wait = 'concurrency', 1
end
if reason == '' then
  if rpm > 0 then rl = rl - 1 end
  if tpm > 0 then tl = tl - tokens end
  redis.call('ZADD', KEYS[3], now + lease, rid)
  redis.call('EXPIRE', KEYS[3], math.ceil(lease) + 60)
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'level', rl, 'stamp', now); redis.call('EXPIRE', KEYS[1], 120) end
if tpm > 0 then redis.call('HSET', KEYS[2], 'level', tl, 'stamp', now); redis.call('EXPIRE', KEYS[2], 120) end
return {reason, tostring(wait), tostring(rl), tostring(tl)}
"""

# KEYS: tokens bucket, leases. ARGV: tpm (0: none), tokens to give back (may be negative), request id.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local tpm, back = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 then
  local v = redis.call('HMGET', KEYS[1], 'level', 'stamp')
  local lvl, st = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then lvl, st = tpm, now end
  lvl = math.min(tpm, math.min(tpm, lvl + (now - st) * tpm / 60.0) + back)
  redis.call('HSET', KEYS[1], 'level', lvl, 'stamp', now)
  redis.call('EXPIRE', KEYS[1], 120)
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

    async def acquire(self, key_id: str, limits: Limits, tokens: int, request_id: str) -> Decision:
        reason, wait, rl, tl = await self._acquire(
            keys=self._keys(key_id),
            args=[limits.rpm or 0, limits.tpm or 0, limits.max_concurrent or 0, tokens, request_id, self.lease_s])
        reason = reason.decode() if isinstance(reason, bytes) else reason
        hdr = headers_for(limits, float(rl) if limits.rpm else None, float(tl) if limits.tpm else None)
        return Decision(not reason, reason, float(wait), hdr)

    async def settle(self, key_id: str, limits: Limits, reserved: int, used: int, request_id: str) -> None:
        k = self._keys(key_id)
        await self._settle(keys=[k[1], k[2]], args=[limits.tpm or 0, reserved - used, request_id])

    async def close(self) -> None:
        await self.r.aclose()
