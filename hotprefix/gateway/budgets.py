"""Budgets: how much a key and its tenant may spend per period, in tokens and in money.

A budget caps the tokens (prompt + completion) and, with a price table, the money spent
in one period of `budget_duration` (`1h`, `1d`, `30d`...; periods are aligned to the
UNIX epoch, so a `1d` budget resets at 00:00 UTC; no duration: it never resets). Money
is counted in micro-units of the price table's currency (prices are per million
tokens, so a token at price P costs P micro-units), rounded up per request.

Admission reserves the worst case in every scope that has a budget (the key's and its
tenant's): the prompt at the input price and every allowed completion token at the
output price. It grants the most completion tokens that fit every scope (the gateway
cuts max_tokens to it, as for tokens per minute) and refuses when not even the least
fits. The end of the request settles each scope with what the backend reported
(cached prompt tokens at the cached price). So the spend of a period never passes its
cap: the reservations of requests in flight count against it. Two stores with one
behaviour: `MemoryLedger` (one process; no await inside a decision) and `RedisLedger`
(every gateway on one Redis; one Lua script per decision, the period from Redis's clock).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hotprefix.config import ConfigError

MAX_DURATION_S = 366 * 86400
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | None) -> int | None:
    """Seconds of a budget period ("30s", "1h", "1d", "30d"); None for none. Raises ConfigError."""
    if text is None or text == "":
        return None
    m = re.fullmatch(r"\s*(\d{1,7})\s*([smhd])\s*", str(text))
    seconds = int(m.group(1)) * _UNITS[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_DURATION_S:
        raise ConfigError(f"budget_duration must be like 30s, 1h, 1d or 30d (at most 366d), got {text!r}")
    return seconds


@dataclass(frozen=True)
class Budget:
    """tokens: the most tokens per period; money: the most spend per period (the price
    table's currency); duration_s: the period (None: never resets)."""

    tokens: int | None = None
    money: float | None = None
    duration_s: int | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 1:
            raise ConfigError(f"max_budget_tokens must be >= 1, got {self.tokens}")
        if self.money is not None and not (0 < self.money < 1e12 and math.isfinite(self.money)):
            raise ConfigError(f"max_budget must be a positive amount, got {self.money}")

    @property
    def active(self) -> bool:
        return self.tokens is not None or self.money is not None

    @property
    def money_micros(self) -> int | None:
        return None if self.money is None else math.floor(self.money * 1e6)


@dataclass(frozen=True)
class Price:
    """Per million tokens: input (uncached prompt), cached input, output."""

    input: float
    cached_input: float
    output: float

    def cost_micros(self, prompt: int, cached: int, completion: int) -> int:
        """The micro-units a request costs (rounded up)."""
        cached = max(0, min(cached, prompt))
        return math.ceil((prompt - cached) * self.input + cached * self.cached_input + completion * self.output - 1e-9)


@dataclass(frozen=True)
class PriceTable:
    """Model name -> Price; "*" prices every model not named."""

    prices: dict[str, Price] = field(default_factory=dict)

    def get(self, model: str | None) -> Price | None:
        return self.prices.get(model or "") or self.prices.get("*")

    @classmethod
    def load(cls, path: str | None) -> PriceTable:
        """A JSON file {"model": {"input": 0.15, "cached_input": 0.075, "output": 0.6}, ...}
        (per million tokens; cached_input defaults to input). Raises ConfigError."""
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--prices {path}: {e}") from None
        return cls.from_dict(raw, f"--prices {path}")

    @classmethod
    def from_dict(cls, raw: Any, where: str = "prices") -> PriceTable:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: an object of model -> prices")
        out = {}
        for model, p in raw.items():
            if not isinstance(p, dict) or set(p) - {"input", "cached_input", "output"} or \
                    not {"input", "output"} <= set(p):
                raise ConfigError(f"{where}: {model!r} needs input and output (and may have cached_input)")
            vals = [p["input"], p.get("cached_input", p["input"]), p["output"]]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9
                       and math.isfinite(v) for v in vals):
                raise ConfigError(f"{where}: {model!r}: prices must be numbers >= 0")
            out[str(model)] = Price(*(float(v) for v in vals))
        return cls(out)


@dataclass(frozen=True)
class Scope:
    """Who a budget belongs to ("key:<id>" or "tenant:<name>") and the budget."""

    name: str
    budget: Budget


@dataclass(frozen=True)
class Reservation:
    """What admission took: per scope (name, period index), the tokens and micro-units."""

    parts: tuple[tuple[str, int], ...]
    tokens: int
    micros: int


@dataclass(frozen=True)
class BudgetDecision:
    admitted: bool
    granted: int = 0  # tokens, between least and want
    reservation: Reservation | None = None
    refused_by: str | None = None  # "key:...(tokens)" for the message
    resets_in: float | None = None  # seconds until the refusing budget's period ends (None: never)


def cost_of(tokens: int, prompt: int, price: Price | None) -> int:
    """The worst-case micro-units of `tokens` tokens of which `prompt` are the prompt (no cache)."""
    if price is None:
        return 0
    return math.ceil(prompt * price.input + max(0, tokens - prompt) * price.output - 1e-9)


def most_tokens(spent_tokens: int, cap_tokens: int | None, spent_micros: int, cap_micros: int | None,
                prompt: int, price: Price | None) -> int:
    """The most tokens (prompt included) one scope still allows (may be below prompt: refused)."""
    bound = 2**62
    if cap_tokens is not None:
        bound = min(bound, cap_tokens - spent_tokens)
    if cap_micros is not None and price is not None:
        room = cap_micros - spent_micros - math.ceil(prompt * price.input - 1e-9)
        if room < 0:
            return -1
        bound = min(bound, prompt + (math.floor(room / price.output) if price.output > 0 else 2**62))
    return bound


def period_of(duration_s: int | None, now: float) -> int:
    return 0 if duration_s is None else int(now // duration_s)


class Ledger(Protocol):
    async def reserve(self, scopes: list[Scope], want: int, least: int, prompt: int,
                      price: Price | None) -> BudgetDecision:
        """Admit or refuse against every scope, atomically; admitting reserves the grant."""

    async def settle(self, r: Reservation, used_tokens: int, used_micros: int) -> None:
        """Replace a reservation with what was used (in the periods it was made in)."""

    async def spent(self, scopes: list[Scope]) -> dict[str, dict[str, Any]]:
        """Per scope: tokens and money spent (reservations included) in the current period."""

    async def close(self) -> None:
        ...


class MemoryLedger:
    """Counters in this process (no await inside a decision: atomic on one event loop)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self.used: dict[tuple[str, int], list[int]] = {}  # (scope, period) -> [tokens, micros]

    async def reserve(self, scopes: list[Scope], want: int, least: int, prompt: int,
                      price: Price | None) -> BudgetDecision:
        now = self.clock()
        active = [s for s in scopes if s.budget.active]
        granted = want
        for s in active:
            used = self.used.get((s.name, period_of(s.budget.duration_s, now)), [0, 0])
            bound = most_tokens(used[0], s.budget.tokens, used[1], s.budget.money_micros, prompt, price)
            if bound < least:
                return _refused(s, bound, now)
            granted = min(granted, bound)
        micros = cost_of(granted, prompt, price)
        parts = tuple((s.name, period_of(s.budget.duration_s, now)) for s in active)
        for p in parts:
            used = self.used.setdefault(p, [0, 0])
            used[0] += granted
            used[1] += micros
        return BudgetDecision(True, granted, Reservation(parts, granted, micros))

    async def settle(self, r: Reservation, used_tokens: int, used_micros: int) -> None:
        for p in r.parts:
            used = self.used.setdefault(p, [0, 0])
            used[0] += used_tokens - r.tokens
            used[1] += used_micros - r.micros

    async def spent(self, scopes: list[Scope]) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {s.name: _status(s, self.used.get((s.name, period_of(s.budget.duration_s, now)), [0, 0]), now)
                for s in scopes if s.budget.active}

    async def close(self) -> None:
        pass


def _refused(s: Scope, bound: int, now: float) -> BudgetDecision:
    unit = "tokens" if s.budget.tokens is not None and (s.budget.money is None or bound >= 0) else "money"
    d = s.budget.duration_s
    return BudgetDecision(False, refused_by=f"{s.name} ({unit})", resets_in=None if d is None else d - now % d)


def _status(s: Scope, used: list[int], now: float) -> dict[str, Any]:
    d = s.budget.duration_s
    return {"tokens_spent": used[0], "max_budget_tokens": s.budget.tokens,
            "spend": used[1] / 1e6, "max_budget": s.budget.money,
            "resets_in_s": None if d is None else d - now % d}


# KEYS: per scope, its counter hash prefix (the period is appended here, from Redis's clock).
# ARGV: want, least, prompt, input price, output price (-1: no price), then per scope:
# duration (0: never resets), max tokens (-1: none), max micro-units (-1: none).
# Returns {granted or -1, refusing scope index (1-based, 0: none), period list...}.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local want, least, prompt = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local pin, pout = tonumber(ARGV[4]), tonumber(ARGV[5])
local granted, periods = want, {}
for i = 1, #KEYS do
  local d, capt, capm = tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i]), tonumber(ARGV[5 + 3 * i])
  local period = 0
  if d > 0 then period = math.floor(now / d) end
  periods[i] = period
  local v = redis.call('HMGET', KEYS[i] .. ':' .. period, 'tokens', 'micros')
  local ut, um = tonumber(v[1]) or 0, tonumber(v[2]) or 0
  local bound = 4611686018427387904
  if capt >= 0 then bound = math.min(bound, capt - ut) end
  if capm >= 0 and pin >= 0 then
    local room = capm - um - math.ceil(prompt * pin - 1e-9)
    if room < 0 then bound = -1
    elseif pout > 0 then bound = math.min(bound, prompt + math.floor(room / pout)) end
  end
  if bound < least then return {-1, i, tostring(bound), tostring(now)} end
  granted = math.min(granted, bound)
end
local micros = 0
if pin >= 0 then micros = math.ceil(prompt * pin + math.max(0, granted - prompt) * pout - 1e-9) end
for i = 1, #KEYS do
  local key, d = KEYS[i] .. ':' .. periods[i], tonumber(ARGV[3 + 3 * i])
  redis.call('HINCRBY', key, 'tokens', granted)
  redis.call('HINCRBY', key, 'micros', micros)
  if d > 0 then redis.call('EXPIRE', key, 2 * d + 60) end
end
local out = {granted, 0, tostring(micros), tostring(now)}
for i = 1, #KEYS do out[#out + 1] = periods[i] end
return out
"""

# KEYS: the counter hashes (period included). ARGV: tokens and micro-units to add (may be negative).
_SETTLE = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HINCRBY', KEYS[i], 'tokens', ARGV[1])
    redis.call('HINCRBY', KEYS[i], 'micros', ARGV[2])
  end
end
return 1
"""


class RedisLedger:
    """Counters in Redis at `url`, shared by every gateway that uses it (one Lua script per decision)."""

    def __init__(self, url: str, prefix: str = "hotprefix:budget:") -> None:
        import redis.asyncio as aioredis

        self.prefix = prefix
        self.r = aioredis.from_url(url)
        self._reserve = self.r.register_script(_RESERVE)
        self._settle = self.r.register_script(_SETTLE)

    def _key(self, scope: str) -> str:
        return self.prefix + scope

    async def reserve(self, scopes: list[Scope], want: int, least: int, prompt: int,
                      price: Price | None) -> BudgetDecision:
        active = [s for s in scopes if s.budget.active]
        if not active:
            return BudgetDecision(True, want, Reservation((), want, cost_of(want, prompt, price)))
        args: list[Any] = [want, least, prompt, price.input if price else -1, price.output if price else -1]
        for s in active:
            b = s.budget
            args += [b.duration_s or 0, -1 if b.tokens is None else b.tokens,
                     -1 if b.money_micros is None else b.money_micros]
        out = await self._reserve(keys=[self._key(s.name) for s in active], args=args)
        granted, who, now = int(out[0]), int(out[1]), float(out[3])
        if granted < 0:
            return _refused(active[who - 1], int(float(out[2])), now)
        parts = tuple((s.name, int(p)) for s, p in zip(active, out[4:]))
        return BudgetDecision(True, granted, Reservation(parts, granted, int(float(out[2]))))

    async def settle(self, r: Reservation, used_tokens: int, used_micros: int) -> None:
        if r.parts:
            await self._settle(keys=[f"{self._key(s)}:{p}" for s, p in r.parts],
                               args=[used_tokens - r.tokens, used_micros - r.micros])

    async def spent(self, scopes: list[Scope]) -> dict[str, dict[str, Any]]:
        sec, usec = await self.r.time()
        now = sec + usec / 1e6
        out = {}
        for s in scopes:
            if s.budget.active:
                v = await self.r.hmget(f"{self._key(s.name)}:{period_of(s.budget.duration_s, now)}",
                                       "tokens", "micros")
                out[s.name] = _status(s, [int(v[0] or 0), int(v[1] or 0)], now)
        return out

    async def close(self) -> None:
        await self.r.aclose()
