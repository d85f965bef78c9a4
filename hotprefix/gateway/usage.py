"""Accounting of requests through the gateway: every admitted request has a usage
row from admission on, a reservation and a concurrency lease, and ends exactly once.

- Admission writes the row (`started`) in its own transaction before anything is
  sent to a backend; a store that cannot take it refuses the request (503): no
  request is served unaccounted.
- While a request runs, a heartbeat renews its lease and checkpoints its usage
  so far into its row (one transaction for all running requests).
- The end (`InFlight.end`) settles the reservation with what the backend did,
  releases the lease and completes the row: each step guarded, so a Redis error
  cannot lose the row nor a database error the lease; it runs as a task of its
  own, so a cancelled caller cannot stop it. What the backend did (Outcome.used):
  the usage it reported; for a request it had and whose whole answer never came
  (the client went away, a timeout, a broken connection), its own accounting, asked
  by request id (`lookup`, backend_usage.py), else the whole reservation; nothing
  for a request no backend had, or one a backend refused (an error answer without
  usage).
- Rows a dead gateway left `started` are closed as `interrupted` with the usage
  last checkpointed: at start-up by the same gateway (`--gateway-id`), and by any
  gateway once no heartbeat touched them for `orphan_after_s`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hotprefix.gateway.budgets import Ledger, MemoryLedger, Price, Reservation, Scope
from hotprefix.gateway.ratelimit import Decision, Limiter, Limits, Refusal
from hotprefix.gateway.store import KeyRecord, Prompt, Store, Tenant, Tokens, UsageEnd, UsageRow, UsageStatus, utcnow

log = logging.getLogger(__name__)
Lookup = Callable[[str, str], Awaitable[Tokens | None]]


class UsageStoreUnavailable(RuntimeError):
    """The `started` row could not be written: the request is refused (HTTP 503)."""


@dataclass(frozen=True)
class Caller:
    """The authenticated key, its tenant, the tenant's prompt, the limits and the budgets
    (the key's and the tenant's) that apply."""

    key: KeyRecord
    tenant: Tenant
    prompt: Prompt | None
    limits: Limits
    scopes: tuple[Scope, ...] = ()


def tokens_of(usage: Any, base: Tokens | None = None) -> Tokens:
    """`base` (default: nothing known) with the counts an OpenAI usage object holds
    (non-negative integers only)."""
    base = base or Tokens()
    if not isinstance(usage, dict):
        return base
    details = usage.get("prompt_tokens_details")
    found = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
             "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None}
    return replace(base, **{k: v for k, v in found.items()
                            if isinstance(v, int) and not isinstance(v, bool) and v >= 0})


@dataclass
class Outcome:
    """What the usage row of one request says (filled in as the request goes): how it
    ended, the backend that has the request (set before it is sent: None when no backend
    had it), the backend's HTTP status once its whole answer came (None until then), the
    tokens the backend reported, the stream chunks relayed."""

    status: UsageStatus = UsageStatus.BACKEND_ERROR
    http_status: int = 502
    backend: str | None = None
    answered: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    reported: Tokens = Tokens()
    chunks: int = 0

    def sending(self, backend: str | None) -> None:
        """The request goes to `backend` now (None: it never reached the one it was sent to)."""
        self.backend, self.answered = backend, None

    @property
    def unsettled(self) -> bool:
        """A backend had the request and its whole answer never came: what it did is
        known only to the backend (Accounting asks it, else charges the reservation)."""
        return self.backend is not None and self.answered is None

    def _charged_whole(self) -> bool:
        """Without reported usage: the whole reservation (a backend had the request, and
        did not refuse it with an error answer), else nothing."""
        return self.backend is not None and (self.answered is None or self.answered < 400)

    def take_usage(self, usage: Any) -> None:
        """Take the counts of an OpenAI usage object the backend sent (what it holds)."""
        self.reported = tokens_of(usage, self.reported)

    def take_choices(self, choices: Any) -> None:
        for c in choices if isinstance(choices, list) else ():
            if isinstance(c, dict) and c.get("finish_reason"):
                self.finish_reason = str(c["finish_reason"])[:32]
                return

    def cost(self, price: Price | None, budget: Reservation | None) -> int:
        """Micro-units to charge against a money budget: the reported usage at `price`, else
        the whole reservation or nothing (see _charged_whole)."""
        t = self.reported
        if price is None or budget is None:
            return 0
        if t.prompt_tokens is None and t.completion_tokens is None:
            return budget.micros if self._charged_whole() else 0
        return price.cost_micros(t.prompt_tokens or 0, t.cached_tokens or 0, t.completion_tokens or 0)

    def used(self, reserved: int) -> int:
        """Tokens to charge against the key's limits: what the backend reported, else the
        whole reservation or nothing (see _charged_whole)."""
        t = self.reported
        if t.prompt_tokens is None and t.completion_tokens is None:
            return reserved if self._charged_whole() else 0
        return (t.prompt_tokens or 0) + (t.completion_tokens or 0)

    def progress(self) -> Tokens:
        """The tokens known so far (for checkpoints); completion: the chunks relayed until reported."""
        return replace(self.reported, completion_tokens=self.reported.completion_tokens or self.chunks or None)

    def end(self, latency_s: float) -> UsageEnd:
        """What the request's end writes into its row."""
        done = self.reported.completion_tokens
        return UsageEnd(self.status, self.http_status, latency_s, self.backend, self.finish_reason, self.ttft_s,
                        replace(self.reported, completion_tokens=done if done is not None else (self.chunks or None)))


@dataclass(eq=False)
class InFlight:
    """One admitted request, from admission to its one end. `outcome` is filled in by
    the proxy; `end()`/`end_soon()` may be called any number of times, from anywhere.
    `start_end(flight)` is its owner's (Accounting's): it starts the one end, as a task
    that the owner tracks."""

    start_end: Callable[[InFlight], asyncio.Task]
    request_id: str
    caller: Caller
    reserved: int
    t0: float
    budget: Reservation | None = None
    price: Price | None = None
    outcome: Outcome = field(default_factory=Outcome)
    _ending: asyncio.Task | None = None

    def end_soon(self) -> asyncio.Task:
        """Start ending the request (once) in a task of its own; returns that task."""
        if self._ending is None:
            self._ending = self.start_end(self)
        return self._ending

    async def end(self) -> None:
        """End the request and wait for it; a cancelled caller does not stop the end."""
        await asyncio.shield(self.end_soon())


class Accounting:
    """Admission, the in-flight registry and its heartbeat. Lives on the event loop."""

    def __init__(self, store: Store, limiter: Limiter, counters: Any, gateway_id: str, heartbeat_s: float = 5.0,
                 orphan_after_s: float = 60.0, ledger: Ledger | None = None, lookup: Lookup | None = None) -> None:
        """lookup(backend url, request id): the backend's own count of a request's tokens
        (None: it cannot say), for requests that end unsettled."""
        self.store = store
        self.lookup = lookup
        self.limiter = limiter
        self.ledger = ledger or MemoryLedger()
        self.counters = counters
        self.gateway_id = gateway_id
        self.heartbeat_s = heartbeat_s
        self.orphan_after_s = orphan_after_s
        self.inflight: dict[str, InFlight] = {}
        self.tasks: set[asyncio.Task] = set()

    def _start_end(self, flight: InFlight) -> asyncio.Task:
        """The task that ends `flight` (tracked until it is done)."""
        task = asyncio.get_running_loop().create_task(self._end(flight))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def admit(self, caller: Caller, request_id: str, row: UsageRow, want: int, least: int,
                    t0: float, prompt: int = 0, price: Price | None = None) -> tuple[Decision, InFlight | None]:
        """Reserve in the budgets, then ask the limiter (for no more than the budgets
        granted); if admitted, write the `started` row. If that fails, the reservations
        are returned and UsageStoreUnavailable raised: nothing runs unaccounted."""
        budget = await self.ledger.reserve(list(caller.scopes), want, least, prompt, price)
        if not budget.admitted:
            await self.record_refused(caller, row, UsageStatus.RATE_LIMITED, 429, t0)
            return Decision(False, Refusal.BUDGET, budget.resets_in or 0.0, detail=budget.refused_by or ""), None
        decision = await self.limiter.acquire(caller.key.id, caller.limits, budget.granted, least, request_id)
        if not decision.admitted:
            await self.ledger.settle(budget.reservation, 0, 0)
            await self.record_refused(caller, row, UsageStatus.RATE_LIMITED, 429, t0)
            return decision, None
        flight = InFlight(self._start_end, request_id, caller, decision.granted, t0, budget.reservation, price)
        try:
            await asyncio.to_thread(self.store.start_usage, replace(
                row, request_id=request_id, gateway_id=self.gateway_id, reserved_tokens=decision.granted))
        except Exception as e:
            log.exception("could not write the usage row of request %s: refusing it", request_id)
            try:
                await self.limiter.settle(caller.key.id, caller.limits, decision.granted, 0, request_id)
                await self.ledger.settle(budget.reservation, 0, 0)
            except Exception:  # its lease then ends by itself after lease_s
                log.exception("could not return the reservation of refused request %s", request_id)
            raise UsageStoreUnavailable(f"the usage store is unavailable ({type(e).__name__})") from None
        self.inflight[request_id] = flight
        return decision, flight

    async def record_refused(self, caller: Caller, row: UsageRow, status: UsageStatus, http_status: int,
                             t0: float) -> None:
        """The row of a request refused before admission (never raises: logged)."""
        self.counters.finished(caller.tenant.name, status.value)
        try:
            await asyncio.to_thread(self.store.record_usage, replace(
                row, status=status, http_status=http_status, latency_s=time.monotonic() - t0))
        except Exception:
            log.exception("could not write the usage row of a refused %s request", caller.tenant.name)

    async def _settle_from_backend(self, f: InFlight) -> None:
        """An unsettled request's tokens from its backend's own accounting (left as they are
        when the backend cannot say). Mutates f.outcome.reported."""
        o = f.outcome
        if self.lookup is None or not o.unsettled or o.backend is None:
            return
        try:
            found = await self.lookup(o.backend, f.request_id)
        except Exception:
            log.exception("could not ask %s for the usage of request %s", o.backend, f.request_id)
            return
        if found is not None:
            o.reported = found

    async def _end(self, f: InFlight) -> None:
        await self._settle_from_backend(f)  # (still in flight meanwhile: its lease is renewed)
        self.inflight.pop(f.request_id, None)
        o, k = f.outcome, f.caller
        try:
            await self.limiter.settle(k.key.id, k.limits, f.reserved, o.used(f.reserved), f.request_id)
        except Exception:  # the lease then ends by itself after lease_s
            log.exception("could not settle request %s with the limiter", f.request_id)
        try:
            if f.budget is not None:
                await self.ledger.settle(f.budget, o.used(f.budget.tokens), o.cost(f.price, f.budget))
        except Exception:  # the reservation then stays counted: the budget errs on the safe side
            log.exception("could not settle request %s with the budgets", f.request_id)
        try:
            await asyncio.to_thread(self.store.finish_usage, f.request_id, o.end(time.monotonic() - f.t0))
        except Exception:  # the row stays `started` and is closed as interrupted later
            log.exception("could not complete the usage row of request %s", f.request_id)
        self.counters.finished(k.tenant.name, o.status.value)

    async def heartbeat(self) -> None:
        """Renew the leases of running requests and checkpoint their usage; close
        orphaned rows. Never raises (each failure is logged)."""
        flights = list(self.inflight.values())
        for f in flights:
            try:
                await self.limiter.renew(f.caller.key.id, f.request_id)
            except Exception:
                log.exception("could not renew the lease of request %s", f.request_id)
        try:
            await asyncio.to_thread(self.store.heartbeat_usage, {f.request_id: f.outcome.progress() for f in flights})
            silent = utcnow() - dt.timedelta(seconds=self.orphan_after_s)
            n = await asyncio.to_thread(self.store.close_orphans, None, silent)
            if n:
                log.warning("closed %d usage rows left running by a gateway that stopped", n)
        except Exception:
            log.exception("usage heartbeat failed")

    async def run(self) -> None:
        """At start, close this gateway's own orphans (left by its previous run); then beat."""
        try:
            n = await asyncio.to_thread(self.store.close_orphans, self.gateway_id, None)
            if n:
                log.warning("closed %d usage rows left running when this gateway (%s) last stopped", n,
                            self.gateway_id)
        except Exception:
            log.exception("could not close this gateway's orphaned usage rows")
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.heartbeat()

    async def drain(self) -> None:
        """At shutdown: wait for the ends already under way."""
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
