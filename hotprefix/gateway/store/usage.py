"""Usage rows: one per request through the gateway (a dataclass, schema.usage's columns),
written `started` at admission, checkpointed while it runs and completed once; and the
sums the reports and the dashboard read."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import sqlalchemy as sa

from hotprefix.gateway.budgets import PriceTable
from hotprefix.gateway.schema import usage
from hotprefix.gateway.store.database import Database, StoreError, from_columns, utcnow

USAGE_GROUPS = ("key", "tenant", "day", "model")
TOKENS = ("prompt_tokens", "cached_tokens", "completion_tokens")


class UsageStatus(str, Enum):
    """A usage row's status. `started` is written at admission; every other one ends it."""

    STARTED = "started"
    OK = "ok"  # the backend answered 200 and the response reached the client
    CLIENT_ABORTED = "client_aborted"  # the client went away; the backend was told
    ERROR = "error"  # the backend answered 4xx
    BACKEND_ERROR = "backend_error"  # no backend answered, or one failed mid-way
    TIMEOUT = "timeout"  # the backend did not answer within --backend-timeout
    RATE_LIMITED = "rate_limited"
    INVALID = "invalid"  # refused by the gateway before any backend
    INTERRUPTED = "interrupted"  # its gateway died; closed by a gateway that saw it orphaned


def _columns(obj: Any) -> dict[str, Any]:
    """A row dataclass's fields as column values (enums as their values)."""
    return {f.name: v.value if isinstance(v := getattr(obj, f.name), Enum) else v for f in fields(obj)}


@dataclass(frozen=True)
class Tokens:
    """A request's token counts so far (None: not reported yet)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    def known(self) -> dict[str, int]:
        """The counts reported, as columns."""
        return {k: v for k, v in _columns(self).items() if v is not None}


@dataclass(frozen=True)
class UsageEnd:
    """How a request ended: what its end writes into its row (every token column: None
    where the backend reported nothing)."""

    status: UsageStatus
    http_status: int
    latency_s: float
    backend: str | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    tokens: Tokens = Tokens()

    def columns(self) -> dict[str, Any]:
        out = _columns(self)
        del out["tokens"]
        return out | _columns(self.tokens)


@dataclass(frozen=True)
class UsageRow:
    """One request through the gateway: who (key, tenant, the tenant's prompt), what
    (endpoint, model, stream), how it ended and its tokens; request_id, gateway_id and
    reserved_tokens for admitted requests. created_at None: now, when written; id: the
    database's, when read."""

    key_id: str
    tenant: str
    endpoint: str
    stream: bool = False
    model: str | None = None
    prompt_name: str | None = None
    prompt_version: int | None = None
    status: UsageStatus = UsageStatus.STARTED
    http_status: int = 0
    latency_s: float = 0.0
    backend: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    request_id: str | None = None
    gateway_id: str | None = None
    reserved_tokens: int | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", UsageStatus(self.status))  # raises ValueError for an unknown one

    def columns(self, now: dt.datetime) -> dict[str, Any]:
        """The row to insert: its values that are set (created_at: now unless set; the
        database gives the id)."""
        return {k: v for k, v in _columns(self).items() if v is not None} | {"created_at": self.created_at or now}


@dataclass(frozen=True)
class UsageGroup:
    """A row of a usage report: one group's requests, how many were answered, token sums,
    and with a price table what they cost (None: a model of the group has no price)."""

    group: str
    requests: int
    ok: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    spend: float | None = None

    def to_json(self, group_by: str, priced: bool) -> dict[str, Any]:
        out = _columns(self)
        del out["group"]
        if not priced:
            del out["spend"]
        return {group_by: self.group, **out}


@dataclass(frozen=True)
class ActivityRow:
    """Requests of one (tenant, key, status), and in a series one time bucket (its start,
    unix seconds), with their token sums."""

    tenant: str
    key_id: str
    status: UsageStatus
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    bucket: int | None = None


@dataclass(frozen=True)
class Activity:
    """Usage since a time: totals per (tenant, key, status), and the same per time bucket."""

    totals: list[ActivityRow]
    series: list[ActivityRow]


def _in_window(q, since: dt.datetime | None, until: dt.datetime | None):
    """q restricted to usage rows created in [since, until) (either end open when None)."""
    if since is not None:
        q = q.where(usage.c.created_at >= since)
    if until is not None:
        q = q.where(usage.c.created_at < until)
    return q


def _sums() -> list:
    return [sa.func.count().label("requests"),
            *(sa.func.coalesce(sa.func.sum(usage.c[k]), 0).label(k) for k in TOKENS)]


class UsageStore(Database):
    """Usage rows: written, ended once, checkpointed, closed when orphaned, reported."""

    def record_usage(self, row: UsageRow) -> None:
        """Insert one finished usage row."""
        with self.engine.begin() as c:
            c.execute(usage.insert().values(row.columns(utcnow())))

    def start_usage(self, row: UsageRow) -> None:
        """Insert the row of an admitted request, status `started` (one transaction)."""
        now = utcnow()
        with self.engine.begin() as c:
            c.execute(usage.insert().values(row.columns(now) | {"updated_at": now,
                                                                "status": UsageStatus.STARTED.value}))

    def finish_usage(self, request_id: str, end: UsageEnd) -> bool:
        """Complete a started row (one transaction). False if it is not started
        (unknown, or already finished: a request ends once)."""
        with self.engine.begin() as c:
            n = c.execute(usage.update().where(usage.c.request_id == request_id,
                                               usage.c.status == UsageStatus.STARTED.value)
                          .values({**end.columns(), "updated_at": utcnow()})).rowcount
        return n == 1

    def heartbeat_usage(self, progress: dict[str, Tokens]) -> None:
        """Mark running requests alive, with their usage so far (request_id -> the
        tokens reported); one transaction for all."""
        if not progress:
            return
        now = utcnow()
        with self.engine.begin() as c:
            for rid, tokens in progress.items():
                c.execute(usage.update().where(usage.c.request_id == rid,
                                               usage.c.status == UsageStatus.STARTED.value)
                          .values({**tokens.known(), "updated_at": now}))

    def close_orphans(self, gateway_id: str | None = None, silent_since: dt.datetime | None = None) -> int:
        """End as `interrupted` the started rows of `gateway_id` (a restarted gateway's
        former self) and those no heartbeat touched since `silent_since` (their
        gateway died). They keep the usage last reported. Returns how many."""
        conds = []
        if gateway_id is not None:
            conds.append(usage.c.gateway_id == gateway_id)
        if silent_since is not None:
            conds.append(usage.c.updated_at < silent_since)
        if not conds:
            return 0
        with self.engine.begin() as c:
            return c.execute(usage.update().where(usage.c.status == UsageStatus.STARTED.value, sa.or_(*conds))
                             .values(status=UsageStatus.INTERRUPTED.value, http_status=0,
                                     updated_at=utcnow())).rowcount

    def usage_rows(self, key_id: str | None = None) -> list[UsageRow]:
        """Every usage row (of one key), oldest first."""
        q = sa.select(usage).order_by(usage.c.id)
        if key_id is not None:
            q = q.where(usage.c.key_id == key_id)
        with self.engine.connect() as c:
            return [from_columns(UsageRow, m) for m in c.execute(q).mappings()]

    def usage_report(self, group_by: str = "tenant", since: dt.datetime | None = None,
                     until: dt.datetime | None = None, prices: PriceTable | None = None) -> list[UsageGroup]:
        """Requests and token sums grouped by key, tenant, day (UTC) or model, oldest window
        first; with a price table, each group's `spend` (None when a model in it has no
        price). Raises StoreError for an unknown grouping."""
        if group_by not in USAGE_GROUPS:
            raise StoreError(f"group by one of {', '.join(USAGE_GROUPS)}, not {group_by!r}")
        col = {"key": usage.c.key_id, "tenant": usage.c.tenant, "model": usage.c.model,
               "day": sa.func.date(usage.c.created_at)}[group_by].label(group_by)
        ok = sa.func.sum(sa.case((usage.c.status == UsageStatus.OK.value, 1), else_=0)).label("ok")
        q = _in_window(sa.select(col, ok, *_sums()).group_by(col).order_by(col), since, until)
        with self.engine.connect() as c:
            rows = list(c.execute(q).mappings())
        spend = self._spend(col, since, until, prices) if prices is not None else {}
        return [UsageGroup(str(r[group_by]), int(r["requests"]), int(r["ok"]), *(int(r[k]) for k in TOKENS),
                           spend.get(r[group_by])) for r in rows]

    def _spend(self, col, since: dt.datetime | None, until: dt.datetime | None,
               prices: PriceTable) -> dict[Any, float | None]:
        """Per group: what its usage cost at `prices` (None if a model of it has no price)."""
        q = sa.select(col, usage.c.model, *(sa.func.coalesce(sa.func.sum(usage.c[k]), 0) for k in TOKENS)
                      ).group_by(col, usage.c.model)
        q = _in_window(q, since, until)
        out: dict[Any, float | None] = {}
        with self.engine.connect() as c:
            for group, model, prompt, cached, completion in c.execute(q):
                price = prices.get(model)
                cost = None if price is None else price.cost_micros(int(prompt), int(cached), int(completion)) / 1e6
                out[group] = None if cost is None or (group in out and out[group] is None) else \
                    out.get(group, 0.0) + cost
        return out

    def usage_activity(self, since: dt.datetime, bucket_s: int) -> Activity:
        """Usage rows created since `since`: totals per (tenant, key, status), and the same per
        time bucket of bucket_s seconds (the gateway's dashboard)."""
        epoch = sa.cast(sa.extract("epoch", usage.c.created_at), sa.BigInteger)
        bucket = ((epoch // bucket_s) * bucket_s).label("bucket")
        out = []
        with self.engine.connect() as c:
            for extra in ([], [bucket]):
                cols = [usage.c.tenant, usage.c.key_id, usage.c.status, *extra]
                q = sa.select(*cols, *_sums()).where(usage.c.created_at >= since).group_by(*cols).order_by(*cols)
                out.append([ActivityRow(m["tenant"], m["key_id"], UsageStatus(m["status"]), int(m["requests"]),
                                        *(int(m[k]) for k in TOKENS), int(m["bucket"]) if extra else None)
                            for m in c.execute(q).mappings()])
        return Activity(*out)
