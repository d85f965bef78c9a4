"""`hotprefix gateway`, `hotprefix tenants`, `hotprefix keys` and `hotprefix usage`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import socket
import sys
from decimal import Decimal
from pathlib import Path

from hotprefix.config import KEEP_ALIVE_S, ConfigError, parse_size
from hotprefix.flags import DefaultsOnce
from hotprefix.gateway.budgets import Budget, PriceTable
from hotprefix.gateway.budgets import parse_duration as parse_budget_duration
from hotprefix.gateway.cli_limits import add_gateway_limits

MAX_DURATION_S = 10 * 365 * 86400.0

ADMIN_ENV = "HOTPREFIX_ADMIN_KEY"


def parse_duration(text: str) -> float:
    """'90s', '15m', '12h', '30d' or a number of seconds. Raises ConfigError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ConfigError(f"not a duration: {text!r} (examples: 90s, 15m, 12h, 30d)")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"a duration of at most ten years, not {text!r}")
    return seconds


def _store_args(p: argparse.ArgumentParser) -> None:
    from hotprefix.gateway.keys import SECRET_ENV

    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL of the gateway database: sqlite:///path or postgresql://user@host/db "
                        "(default: $HOTPREFIX_DATABASE_URL, else ~/.hotprefix/gateway.db)")
    p.add_argument("--secret-file", default=None,
                   help=f"the HMAC secret keys are stored under (default: ${SECRET_ENV}, "
                        "else ~/.hotprefix/gateway.secret, created on first use)")


def _open(a: argparse.Namespace):
    from hotprefix.gateway.keys import default_database_url
    from hotprefix.gateway.store import Store

    store = Store(a.database_url or default_database_url())
    store.migrate()
    return store


def _cell(value: object) -> str:
    """A table cell: a float as a plain decimal (0.00003, never 3e-05), None as nothing."""
    if isinstance(value, float):
        return format(Decimal(repr(value)), "f")
    return "" if value is None else str(value)


def _print(rows: list[dict], as_json: bool, columns: list[str]) -> None:
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    widths = {c: max([len(c)] + [len(_cell(r.get(c))) for r in rows]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_cell(r.get(c)).ljust(widths[c]) for c in columns))


# --- tenants and prompts --------------------------------------------------------------------------------

def _prompt_text(a: argparse.Namespace) -> str | None:
    if getattr(a, "system_prompt_file", None):
        try:
            return Path(a.system_prompt_file).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {a.system_prompt_file}: {e}") from None
    return getattr(a, "system_prompt", None)


def cmd_tenants(a: argparse.Namespace) -> int:
    store = _open(a)
    if a.action == "list":
        rows = []
        for t in store.list_tenants():
            p = store.tenant_prompt(t)
            rows.append({"name": t.name, "prompt": t.prompt_name, "version": p.version if p else None,
                         "public": p.public if p else None,
                         "keys": sum(1 for k in store.list_keys(t.name) if k.revoked_at is None)})
        _print(rows, a.json, ["name", "prompt", "version", "public", "keys"])
        return 0
    if a.action == "prompts":
        _print(store.list_prompts(), a.json, ["name", "version", "public", "chars", "created_at"])
        return 0
    if a.action == "set-budget":
        store.set_budget(tenant=a.name, tokens=a.max_budget_tokens, money=a.max_budget, duration=a.budget_duration)
        t = store.tenant(a.name)
        print(f"tenant {a.name}: {_budget_text(t.budget, t.budget_duration)}")
        return 0
    if a.action == "add-prompt":
        text = _prompt_text(a)
        if not text:
            raise ConfigError("give the prompt with --system-prompt TEXT or --system-prompt-file FILE")
        p = store.add_prompt(a.name, text, a.public)
        print(f"prompt {p.name} version {p.version} ({'public' if p.public else 'private'}, {len(text)} chars)")
        return 0
    text = _prompt_text(a)
    if text and a.prompt:
        raise ConfigError("give either --prompt (a pool prompt) or the prompt's text, not both")
    prompt_name = a.prompt
    if text:  # the tenant's own pool prompt, named after it
        prompt_name = store.add_prompt(a.name, text, a.public).name
    if a.action == "create":
        if _has_budget(a):  # checked before anything is written
            Budget(a.max_budget_tokens, a.max_budget, parse_budget_duration(a.budget_duration))
        t = store.create_tenant(a.name, prompt_name)
        if _has_budget(a):
            store.set_budget(tenant=t.name, tokens=a.max_budget_tokens, money=a.max_budget,
                             duration=a.budget_duration)
    else:
        if prompt_name is None and not a.no_prompt:
            raise ConfigError("give --prompt, --system-prompt(-file) or --no-prompt")
        t = store.set_tenant_prompt(a.name, prompt_name)
    p = store.tenant_prompt(t)
    print(f"tenant {t.name}: " + (f"system prompt {p.name} v{p.version} ({'public' if p.public else 'private'})"
                                  if p else "no system prompt"))
    return 0


def _has_budget(a: argparse.Namespace) -> bool:
    return any(getattr(a, k, None) is not None for k in ("max_budget_tokens", "max_budget", "budget_duration"))


def _models(a: argparse.Namespace) -> list[str] | None:
    return None if a.models is None else [m.strip() for m in a.models.split(",") if m.strip()]


def _budget_text(b: Budget, duration: str | None) -> str:
    caps = [f"{b.tokens} tokens" if b.tokens is not None else "", f"{b.money:g} in money" if b.money else ""]
    caps = [c for c in caps if c]
    if not caps:
        return "no budget"
    return " and ".join(caps) + (f" per {duration}" if duration else " (never resets)")


def _budget_args(c: argparse.ArgumentParser, models: bool = False) -> None:
    c.add_argument("--max-budget-tokens", type=int, default=None, help="the most tokens (prompt + output) per period")
    c.add_argument("--max-budget", type=float, default=None,
                   help="the most spend per period, in the price table's currency (the gateway's --prices)")
    c.add_argument("--budget-duration", default=None, help="the period: 1h, 1d, 30d (aligned to UTC; default: never "
                                                           "resets)")
    if models:
        c.add_argument("--models", default=None, help="comma-separated models the key may use (default: any)")


# --- keys -----------------------------------------------------------------------------------------------

def cmd_keys(a: argparse.Namespace) -> int:
    from hotprefix.gateway.keys import load_secret

    store = _open(a)
    if a.action == "list":
        now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
        rows = [k.public() | {"key": f"sk-hp-...{k.hint}", "active": k.active(now)}
                | ({} if a.json or k.models is None else {"models": ",".join(k.models)})
                for k in store.list_keys(a.tenant)]
        _print(rows, a.json, ["id", "tenant", "name", "key", "active", "rpm", "tpm", "max_concurrent",
                              "max_budget_tokens", "max_budget", "budget_duration", "models", "expires_at",
                              "revoked_at"])
        return 0
    if a.action == "set-budget":
        store.set_budget(key_id=a.key_id, tokens=a.max_budget_tokens, money=a.max_budget, duration=a.budget_duration,
                         models=_models(a))
        rec = store.key(a.key_id)
        print(f"key {rec.id}: {_budget_text(rec.budget, rec.budget_duration)}; models: "
              f"{', '.join(rec.models) if rec.models else 'any'}")
        return 0
    if a.action == "revoke":
        rec = store.revoke_key(a.key_id)
        print(f"revoked {rec.id} ({rec.tenant})")
        return 0
    secret = load_secret(a.secret_file)
    if a.action == "rotate":
        key, rec = store.rotate_key(secret, a.key_id, parse_duration(a.grace))
    else:
        expires = None if a.expires_in is None else (
            dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) + dt.timedelta(seconds=parse_duration(a.expires_in)))
        if _has_budget(a):  # checked before anything is written
            Budget(a.max_budget_tokens, a.max_budget, parse_budget_duration(a.budget_duration))
        key, rec = store.create_key(secret, a.tenant, a.name, expires, a.rpm, a.tpm, a.max_concurrent)
        if _has_budget(a) or a.models is not None:
            store.set_budget(key_id=rec.id, tokens=a.max_budget_tokens, money=a.max_budget,
                             duration=a.budget_duration, models=_models(a))
            rec = store.key(rec.id)
    if a.json:
        print(json.dumps({"key": key, **rec.public()}, indent=2))
    else:
        print(key)
        print(f"{rec.id} for tenant {rec.tenant}: the key is shown this once; it is stored only as an HMAC.",
              file=sys.stderr)
    return 0


def cmd_usage(a: argparse.Namespace) -> int:
    store = _open(a)
    try:
        since = None if a.since is None else dt.datetime.fromisoformat(a.since)
        until = None if a.until is None else dt.datetime.fromisoformat(a.until)
    except ValueError as e:
        raise ConfigError(f"--since/--until must be ISO dates (2026-11-22 or 2026-11-22T10:00): {e}") from None
    prices = PriceTable.load(a.prices) if a.prices else None
    rows = [r.to_json(a.by, prices is not None) for r in store.usage_report(a.by, since, until, prices)]
    _print(rows, a.json, [a.by, "requests", "ok", "prompt_tokens", "cached_tokens", "completion_tokens",
                          *(["spend"] if prices else [])])
    return 0


# --- the gateway ----------------------------------------------------------------------------------------

def cmd_gateway(a: argparse.Namespace) -> int:
    import uvicorn

    from hotprefix.gateway.app import build_gateway_app, make_limiter
    from hotprefix.gateway.config import GatewayConfig
    from hotprefix.gateway.keys import default_database_url, load_secret
    from hotprefix.server.log_lines import escape_log_lines

    cfg = GatewayConfig(backends=tuple(u.rstrip("/") for u in a.backend), host=a.host, port=a.port,
                        database_url=a.database_url or default_database_url(), redis_url=a.redis_url,
                        admin_key=a.admin_key, secret_file=a.secret_file, backend_api_key=a.backend_api_key,
                        backend_admin_key=a.backend_admin_key, docs=a.docs,
                        health_interval=a.health_interval, health_fails=a.health_fails,
                        timeout_keep_alive=a.timeout_keep_alive,
                        load_factor=a.load_factor, min_cap=a.min_cap,
                        default_rpm=a.default_rpm, default_tpm=a.default_tpm,
                        default_max_concurrent=a.default_max_concurrent,
                        default_max_tokens=a.default_max_tokens, auth_cache_s=a.auth_cache_s,
                        backend_timeout=a.backend_timeout,
                        gateway_id=a.gateway_id or f"{socket.gethostname()}:{a.port}",
                        heartbeat_s=a.heartbeat, metrics_key=a.metrics_key,
                        max_request_body_bytes=parse_size(a.max_request_body_bytes),
                        warmup=a.warmup, log_level="debug" if a.verbose else "info",
                        prices=PriceTable.load(a.prices))
    store = _open(a)
    secret = load_secret(a.secret_file)
    if cfg.redis_url:
        import redis

        try:
            redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=5).ping()
        except (redis.RedisError, OSError) as e:
            raise ConfigError(f"cannot reach Redis at {cfg.redis_url}: {e}") from None
    app = build_gateway_app(cfg, store, secret, make_limiter(cfg))
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                            timeout_graceful_shutdown=30, timeout_keep_alive=cfg.timeout_keep_alive)
    escape_log_lines()
    uvicorn.Server(config).run()
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`gateway`, `tenants`, `keys`, `usage`."""
    _add_gateway_parser(sub)
    _add_tenants_parser(sub)
    _add_keys_parser(sub)
    _add_usage_parser(sub)


def _add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    gw = sub.add_parser("gateway", help="the multi-tenant gateway in front of OpenAI-compatible backends",
                        description="Keys, forced system prompts, cache salts, rate limits, usage, warm-up "
                                    "and prefix-affinity routing in front of one or more backends.",
                        formatter_class=DefaultsOnce)
    gw.add_argument("--backend", action="append", required=True, metavar="URL",
                    help="base URL of a backend (hotprefix, vLLM, llama.cpp); repeat for several")
    gw.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    gw.add_argument("--port", type=int, default=8080, help="port to listen on")
    _store_args(gw)
    gw.add_argument("--prices", default=None,
                    help="a JSON price table: {model: {input, cached_input, output}} per million tokens, for "
                         "budgets in money and spend reports ('*' prices every other model)")
    gw.add_argument("--redis-url", default=os.environ.get("HOTPREFIX_REDIS_URL"),
                    help="share rate-limit counters between gateway processes in Redis, e.g. redis://localhost:6379/0 "
                         "(default: in this process)")
    gw.add_argument("--admin-key", default=os.environ.get(ADMIN_ENV),
                    help=f"bearer key of the /admin API (env {ADMIN_ENV}; without it the admin API is off)")
    gw.add_argument("--backend-api-key", default=os.environ.get("HOTPREFIX_BACKEND_API_KEY"),
                    help="bearer key the backends expect (env HOTPREFIX_BACKEND_API_KEY)")
    gw.add_argument("--backend-admin-key", default=os.environ.get("HOTPREFIX_BACKEND_ADMIN_KEY"),
                    help="the backends' --admin-api-key, for warm-up pins and a request's usage by id (env "
                         "HOTPREFIX_BACKEND_ADMIN_KEY; default: --backend-api-key)")
    gw.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="serve /docs, /redoc and /openapi.json (their pages load Swagger UI from a CDN)")
    gw.add_argument("--health-interval", type=float, default=2.0, help="seconds between backend health checks")
    gw.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                    help="seconds an idle client keep-alive connection stays open")
    gw.add_argument("--health-fails", type=int, default=3,
                    help="health checks in a row that must time out before a backend is marked down "
                         "(a refused connection or an error status marks it down at once)")
    gw.add_argument("--load-factor", type=float, default=1.25,
                    help="bounded load: skip a tenant's home backend when it has this many times the mean load")
    gw.add_argument("--load-min-cap", type=int, default=4, dest="min_cap",
                    help="bounded load: never skip a home backend with fewer requests in flight than this")
    add_gateway_limits(gw)
    gw.set_defaults(func=cmd_gateway)


def _add_tenants_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tenants", help="tenants and the pool of system prompts in the gateway database")
    ts = t.add_subparsers(dest="action", required=True)
    for action, hlp in (("create", "a new tenant"), ("set-prompt", "change a tenant's system prompt")):
        c = ts.add_parser(action, help=hlp)
        c.add_argument("name")
        c.add_argument("--prompt", default=None, help="use this pool prompt (its newest version)")
        c.add_argument("--system-prompt", default=None, help="the prompt's text (a pool prompt named after the tenant)")
        c.add_argument("--system-prompt-file", default=None, help="read the prompt's text from this file")
        c.add_argument("--public", action="store_true",
                       help="share the prompt's KV across tenants (what follows it stays private)")
        if action == "set-prompt":
            c.add_argument("--no-prompt", action="store_true", help="no forced system prompt")
        else:
            _budget_args(c)
    b = ts.add_parser("set-budget", help="replace a tenant's budget (no flag: no cap)")
    b.add_argument("name")
    _budget_args(b)
    ap = ts.add_parser("add-prompt", help="add a pool prompt, or a new version of one")
    ap.add_argument("name")
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--system-prompt-file", default=None)
    ap.add_argument("--public", action="store_true")
    for action in ("list", "prompts"):
        c = ts.add_parser(action, help="list tenants" if action == "list" else "list the prompt pool")
        c.add_argument("--json", action="store_true")
    for c in ts.choices.values():
        _store_args(c)
    t.set_defaults(func=cmd_tenants)


def _add_keys_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="API keys of the gateway: create, list, revoke, rotate")
    ks = k.add_subparsers(dest="action", required=True)
    c = ks.add_parser("create", help="a new key for a tenant (printed once)")
    c.add_argument("--tenant", required=True)
    c.add_argument("--name", default=None, help="a label")
    c.add_argument("--expires-in", default=None, help="e.g. 30d, 12h (default: never)")
    c.add_argument("--rpm", type=int, default=None, help="requests per minute")
    c.add_argument("--tpm", type=int, default=None, help="tokens (prompt + output) per minute")
    c.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once")
    _budget_args(c, models=True)
    c.add_argument("--json", action="store_true")
    c = ks.add_parser("set-budget", help="replace a key's budget and models (no flag: no cap, any model)")
    c.add_argument("key_id")
    _budget_args(c, models=True)
    c = ks.add_parser("list", help="keys (never their secret part)")
    c.add_argument("--tenant", default=None)
    c.add_argument("--json", action="store_true")
    c = ks.add_parser("revoke", help="stop a key now")
    c.add_argument("key_id")
    c = ks.add_parser("rotate", help="a new key with the same tenant and limits; the old one stops after --grace")
    c.add_argument("key_id")
    c.add_argument("--grace", default="0", help="how long the old key keeps working, e.g. 1h (default: 0)")
    c.add_argument("--json", action="store_true")
    for c in ks.choices.values():
        _store_args(c)
    k.set_defaults(func=cmd_keys)


def _add_usage_parser(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("usage", help="gateway usage per tenant, key or day")
    u.add_argument("--by", default="tenant", choices=("tenant", "key", "day", "model"))
    u.add_argument("--prices", default=None, help="a price table (JSON, per million tokens): adds each row's spend")
    u.add_argument("--since", default=None, help="ISO date or time (UTC)")
    u.add_argument("--until", default=None, help="ISO date or time (UTC), exclusive")
    u.add_argument("--json", action="store_true")
    _store_args(u)
    u.set_defaults(func=cmd_usage)
