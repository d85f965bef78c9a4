"""One request through the gateway: authenticate, force the tenant's system
prompt, salt the cache, admit under the key's limits, route, forward, stream
back, settle the limits and write the usage row.

What a request becomes on its way to a backend:
- chat: every system/developer message the client sent is dropped and the
  tenant's prompt placed first; completions: the prompt text is prefixed with it.
- `cache_salt` is the tenant's (HMAC of the gateway secret), never the client's
  (a client's `cache_salt` is refused). Private prompts are salted from token 0.
  Public prompts are salted from the first token that depends on the client's
  input, found once per backend and prompt by tokenizing two probe requests
  that differ only in the client's part (hotprefix backends; other backends get
  the salt from token 0, which isolates tenants but shares nothing).
- streams always ask the backend for usage on every chunk, so a client that
  disconnects is billed for exactly the tokens the gateway received; chunks and
  fields the client did not ask for are removed before they reach it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from hotprefix.gateway import keys as K
from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.ratelimit import Limiter, Limits
from hotprefix.gateway.routing import Backend, Router, route_key
from hotprefix.gateway.store import KeyRecord, Prompt, Store, Tenant, utcnow

log = logging.getLogger(__name__)
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PROBES = ("A", "z")  # two client inputs that share no first character


class GatewayError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers = status, type_, param, headers or {}


@dataclass(frozen=True)
class Caller:
    """The authenticated key, its tenant, the tenant's prompt and the limits that apply."""

    key: KeyRecord
    tenant: Tenant
    prompt: Prompt | None
    limits: Limits


@dataclass
class Outcome:
    """What the usage row of one request says."""

    status: str = "backend_error"
    http_status: int = 502
    backend: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    chunks: int = 0
    error: str | None = None  # why no backend answered (not stored)

    def take_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = details.get("cached_tokens", self.cached_tokens)

    def take_choices(self, choices: list[dict[str, Any]] | None) -> None:
        for c in choices or ():
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]
                return

    def used(self, reserved: int) -> int:
        """Tokens to charge against the key's tokens-per-minute limit."""
        if self.prompt_tokens is None and self.completion_tokens is None:
            return reserved if self.status in ("ok", "client_aborted") else 0
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


@dataclass
class Ending:
    """Ends one admitted request exactly once: settles its reservation and writes its usage row."""

    proxy: Proxy
    caller: Caller
    endpoint: str
    body: dict[str, Any]
    stream: bool
    reserved: int
    rid: str
    t0: float
    done: bool = False

    async def __call__(self, outcome: Outcome) -> None:
        if self.done:
            return
        self.done = True
        await self.proxy.limiter.settle(self.caller.key.id, self.caller.limits, self.reserved,
                                        outcome.used(self.reserved), self.rid)
        await self.proxy.record(self.caller, self.endpoint, self.body, self.stream, outcome, self.t0)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A deliberately high guess (UTF-8 bytes / 3, plus a few per message); the
    reservation is settled with the backend's real count when the request ends."""
    if "messages" in body:
        text = json.dumps([m.get("content") for m in body["messages"]], ensure_ascii=False)
        return math.ceil(len(text.encode()) / 3) + 4 * len(body["messages"])
    p = body.get("prompt")
    texts = p if isinstance(p, list) else [p or ""]
    return sum(math.ceil(len(str(t).encode()) / 3) + 1 for t in texts)


def join_prompt(system: str, user: str) -> str:
    """A tenant prompt before a completions prompt: a blank line between them unless
    the tenant's text already ends in whitespace."""
    return system + user if not system or system[-1].isspace() else system + "\n\n" + user


def force_prompt(endpoint: str, body: dict[str, Any], prompt: Prompt | None) -> dict[str, Any]:
    """The body with the tenant's prompt in force (a new dict). Raises GatewayError(400)
    for a body the gateway cannot rewrite."""
    body = dict(body)
    for k in ("cache_salt", "cache_salt_offset"):
        if k in body:
            raise GatewayError(400, f"'{k}' is set by the gateway, per tenant; remove it from the request",
                               "BadRequestError", k)
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise GatewayError(400, "'messages' must be a list of message objects", "BadRequestError", "messages")
        kept = [m for m in msgs if m.get("role") not in ("system", "developer")]
        body["messages"] = ([{"role": "system", "content": prompt.text}] if prompt else []) + kept
        return body
    p = body.get("prompt")
    if isinstance(p, str):
        texts, single = [p], True
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        texts, single = p, False
    else:
        raise GatewayError(400, "the gateway accepts 'prompt' as a string or a list of strings (token-id prompts "
                           "cannot be prefixed with the tenant's system prompt)", "BadRequestError", "prompt")
    if prompt:
        texts = [join_prompt(prompt.text, t) for t in texts]
    body["prompt"] = texts[0] if single else texts
    return body


class RelayResponse(StreamingResponse):
    """A streaming response that calls `on_close` when it is over, however it ended."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def trim_chunk(obj: dict[str, Any], want_usage: bool, want_continuous: bool) -> dict[str, Any] | None:
    """A stream chunk as the client asked for it: the gateway always asks the
    backend for usage on every chunk; None drops the chunk."""
    if not obj.get("choices") and "usage" in obj:
        return obj if want_usage else None  # the final usage-only chunk
    if "usage" in obj and not want_continuous:
        obj = dict(obj)
        if want_usage:
            obj["usage"] = None
        else:
            del obj["usage"]
    return obj


def sse_error(message: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": "BadGatewayError", "param": None,
                                            "code": 502}}) + "\n\n"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Proxy:
    """The per-request pipeline. Holds no per-request state itself; `tasks` keeps
    finishing work alive after a client disconnects."""

    cfg: GatewayConfig
    store: Store
    secret: bytes
    limiter: Limiter
    router: Router
    client: httpx.AsyncClient
    counters: Any
    auth_cache: dict[str, tuple[float, Caller]] = field(default_factory=dict)  # digest -> (expiry, caller)
    tasks: set[asyncio.Task] = field(default_factory=set)

    # --- who is asking ------------------------------------------------------------------------------

    def _lookup(self, key: str) -> Caller | None:
        rec = self.store.authenticate(self.secret, key)
        if rec is None:
            return None
        tenant = self.store.tenant(rec.tenant)
        limits = Limits(rec.rpm or self.cfg.default_rpm, rec.tpm or self.cfg.default_tpm,
                        rec.max_concurrent or self.cfg.default_max_concurrent)
        return Caller(rec, tenant, self.store.tenant_prompt(tenant), limits)

    async def authenticate(self, request: Request) -> Caller:
        """The caller of `request`. Raises GatewayError(401) for a missing, unknown,
        revoked or expired key."""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key.startswith(K.KEY_PREFIX):
            raise GatewayError(401, "missing or malformed API key (Authorization: Bearer sk-hp-...)",
                               "AuthenticationError")
        d = K.digest(self.secret, key)
        now = time.monotonic()
        hit = self.auth_cache.get(d)
        if hit is not None and hit[0] >= now:
            caller = hit[1]
        else:
            caller = await asyncio.to_thread(self._lookup, key)
            if caller is None:  # unknown keys are not cached: random keys cannot grow the cache
                self.auth_cache.pop(d, None)
            else:
                self.auth_cache[d] = (now + self.cfg.auth_cache_s, caller)
        if caller is None or not caller.key.active(utcnow()):
            raise GatewayError(401, "invalid, revoked or expired API key", "AuthenticationError")
        return caller

    # --- what goes to the backend -------------------------------------------------------------------

    async def _salt_offset(self, backend: Backend, endpoint: str, prompt: Prompt) -> int:
        """The number of leading tokens that do not depend on the client's input
        (0 when it cannot be found: salting everything is always safe)."""
        ck = f"{endpoint}\0{hashlib.sha256(prompt.text.encode()).hexdigest()}"
        if ck in backend.token_counts:
            return backend.token_counts[ck]
        counts = []
        for probe in PROBES:
            req = ({"messages": [{"role": "system", "content": prompt.text}, {"role": "user", "content": probe}]}
                   if endpoint == "chat" else {"prompt": join_prompt(prompt.text, probe)})
            try:
                r = await self.client.post(backend.url + "/tokenize", json=req, timeout=10)
                r.raise_for_status()
                counts.append(r.json()["tokens"])
            except (httpx.HTTPError, KeyError, ValueError) as e:
                log.warning("tokenize on %s failed (%s): salting the whole prompt", backend.url, e)
                return 0
        n = _common_prefix(*counts)
        backend.token_counts[ck] = n
        return n

    async def body_for(self, backend: Backend, endpoint: str, body: dict[str, Any], caller: Caller) -> dict[str, Any]:
        out = dict(body, cache_salt=K.tenant_salt(self.secret, caller.tenant.name))
        if backend.supports_salt and caller.prompt is not None and caller.prompt.public:
            out["cache_salt_offset"] = await self._salt_offset(backend, endpoint, caller.prompt)
        return out

    # --- one request --------------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Serve one /v1/chat/completions or /v1/completions request. Raises GatewayError."""
        t0 = time.monotonic()
        caller = await self.authenticate(request)
        raw: dict[str, Any] = {}
        try:
            raw, body, reserved = await self._admissible(request, endpoint, caller)
        except GatewayError as e:  # refused before it reached a backend: recorded all the same
            await self.record(caller, endpoint, raw, bool(raw.get("stream")), Outcome("invalid", e.status), t0)
            raise
        stream = bool(body.get("stream"))
        rid = "gw-" + uuid.uuid4().hex
        decision = await self.limiter.acquire(caller.key.id, caller.limits, reserved, rid)
        if not decision.admitted:
            await self.record(caller, endpoint, body, stream, Outcome("rate_limited", 429), t0)
            retry = max(1, math.ceil(decision.retry_after))
            what = {"too_large": f"this request may use {reserved} tokens, more than the key's "
                                 f"{caller.limits.tpm} tokens per minute",
                    "requests": f"rate limit of {caller.limits.rpm} requests per minute reached",
                    "tokens": f"rate limit of {caller.limits.tpm} tokens per minute reached",
                    "concurrency": f"limit of {caller.limits.max_concurrent} concurrent requests reached"}
            raise GatewayError(429, what[decision.reason] + f"; retry after {retry}s", "RateLimitError",
                               headers={**decision.headers, "Retry-After": str(retry)})
        headers = {**decision.headers, "x-request-id": rid}
        finish = Ending(self, caller, endpoint, body, stream, reserved, rid, t0)
        try:
            upstream, backend, outcome = await self._send(endpoint, body, caller, rid)
        except BaseException:
            await finish(Outcome())
            raise
        if upstream is None:
            await finish(outcome)
            raise GatewayError(503, "no backend could serve the request: " + (outcome.error or "none is up"),
                               "ServiceUnavailableError", headers=headers)
        if stream and upstream.status_code == 200:
            return RelayResponse(self._relay(request, upstream, backend, raw, outcome, t0, finish),
                                 lambda: self._ensure_ended(upstream, backend, outcome, finish),
                                 media_type="text/event-stream", headers=headers)
        try:
            data = await upstream.aread()
        finally:
            await upstream.aclose()
            backend.inflight -= 1
        outcome.http_status = upstream.status_code
        outcome.status = "ok" if upstream.status_code == 200 else "error"
        outcome.ttft_s = time.monotonic() - t0
        try:
            parsed = json.loads(data)
            if upstream.status_code == 200:
                outcome.take_usage(parsed.get("usage"))
                outcome.take_choices(parsed.get("choices"))
        except (ValueError, AttributeError):
            pass
        await finish(outcome)
        return Response(data, status_code=upstream.status_code, headers=headers,
                        media_type=upstream.headers.get("content-type", "application/json"))

    async def _admissible(self, request: Request, endpoint: str, caller: Caller
                          ) -> tuple[dict[str, Any], dict[str, Any], int]:
        """(the client's body, the body with the tenant's prompt in force, tokens to
        reserve). Raises GatewayError(400) for a body the gateway will not forward."""
        try:
            raw = await request.json()
        except ValueError as e:
            raise GatewayError(400, f"invalid JSON body: {e}", "BadRequestError") from None
        if not isinstance(raw, dict):
            raise GatewayError(400, "the request body must be a JSON object", "BadRequestError")
        body = force_prompt(endpoint, raw, caller.prompt)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.cfg.reserve_max_tokens
        n = body.get("n") or 1
        if not isinstance(max_tokens, int) or not isinstance(n, int) or max_tokens < 1 or n < 1:
            raise GatewayError(400, "max_tokens and n must be positive integers", "BadRequestError", "max_tokens")
        return raw, body, estimate_prompt_tokens(body) + max_tokens * n

    async def _send(self, endpoint: str, body: dict[str, Any], caller: Caller, rid: str
                    ) -> tuple[httpx.Response | None, Backend | None, Outcome]:
        """Try backends in routing order until one answers with less than 500.
        The returned backend's in-flight count has been raised; the caller lowers it."""
        key = route_key(caller.prompt.text if caller.prompt else None, bool(caller.prompt and caller.prompt.public),
                        caller.tenant.name)
        outcome = Outcome()
        fwd = {"x-request-id": rid}
        if self.cfg.backend_api_key:
            fwd["authorization"] = f"Bearer {self.cfg.backend_api_key}"
        errors = []
        for backend in self.router.order(key):
            b = await self.body_for(backend, endpoint, body, caller)
            if b.get("stream"):
                b["stream_options"] = {**(b.get("stream_options") or {}), "include_usage": True,
                                       "continuous_usage_stats": True}
            backend.inflight += 1
            try:
                req = self.client.build_request("POST", backend.url + ENDPOINTS[endpoint], json=b, headers=fwd)
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                backend.inflight -= 1
                self.mark_down(backend, e)
                errors.append(f"{backend.url}: {type(e).__name__}")
                continue
            except BaseException:
                backend.inflight -= 1
                raise
            if resp.status_code >= 500:  # nothing reached the client yet: try the next backend
                await resp.aclose()
                backend.inflight -= 1
                errors.append(f"{backend.url}: HTTP {resp.status_code}")
                continue
            outcome.backend = backend.url
            self.counters.routed(backend.url)
            return resp, backend, outcome
        outcome.error = "; ".join(errors) or None
        return None, None, outcome

    def mark_down(self, backend: Backend, err: BaseException) -> None:
        if backend.healthy:
            log.warning("backend %s is down: %s", backend.url, err)
        backend.healthy = False
        backend.last_error = f"{type(err).__name__}: {err}"

    async def _relay(self, request: Request, upstream: httpx.Response, backend: Backend, raw: dict[str, Any],
                     outcome: Outcome, t0: float, finish: Ending) -> AsyncIterator[str]:
        """The backend's SSE stream, trimmed to what the client asked for. Ends the
        request (limits, usage row) when the stream ends or the client goes away:
        a watcher notices a disconnect even while the backend sends nothing, and
        closes the upstream connection so that the backend aborts too."""
        opts = raw.get("stream_options") or {}
        want_usage, want_continuous = bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))
        outcome.status, outcome.http_status = "client_aborted", 200
        gone = asyncio.Event()

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            gone.set()
            await self._abort(upstream, backend, outcome, finish)

        watcher = asyncio.get_running_loop().create_task(watch())
        done = False
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:].strip() == "[DONE]":
                    done = True
                    continue
                try:
                    obj = json.loads(line[6:])
                except ValueError:
                    yield line + "\n\n"
                    continue
                outcome.take_usage(obj.get("usage"))
                outcome.take_choices(obj.get("choices"))
                if obj.get("choices"):
                    outcome.chunks += 1
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - t0
                obj = trim_chunk(obj, want_usage, want_continuous)
                if obj is not None:
                    yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
            watcher.cancel()
            outcome.status = "ok" if done else "backend_error"
            await self._close(upstream, backend)
            await finish(outcome)
            yield "data: [DONE]\n\n" if done else sse_error("the backend ended the stream early")
        except Exception as e:
            watcher.cancel()
            if gone.is_set():  # the watcher closed the upstream under us: the client's abort
                return
            if not isinstance(e, httpx.HTTPError):
                raise
            outcome.status = "backend_error"
            self.mark_down(backend, e)
            await self._close(upstream, backend)
            await finish(outcome)
            yield sse_error(f"the backend failed mid-stream: {e}")
        finally:
            watcher.cancel()

    def _ensure_ended(self, upstream: httpx.Response, backend: Backend, outcome: Outcome, finish: Ending) -> None:
        """After the response is over, however it ended (the client went away, even
        before the first chunk): end the request if nothing else did, in a task of
        its own (the caller may be in a cancelled scope)."""
        if finish.done:
            return
        task = asyncio.get_running_loop().create_task(self._abort(upstream, backend, outcome, finish))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _close(self, upstream: httpx.Response, backend: Backend) -> None:
        if not upstream.is_closed:
            await upstream.aclose()
            backend.inflight -= 1

    async def _abort(self, upstream: httpx.Response, backend: Backend, outcome: Outcome, finish: Ending) -> None:
        outcome.status = "client_aborted"
        await self._close(upstream, backend)  # the backend sees the disconnect and aborts the request
        await finish(outcome)

    async def record(self, caller: Caller, endpoint: str, body: dict[str, Any], stream: bool, o: Outcome,
                     t0: float) -> None:
        """Write the usage row (never raises: a lost row is logged, the answer still goes out)."""
        row = {"key_id": caller.key.id, "tenant": caller.tenant.name, "endpoint": endpoint,
               "model": body.get("model") if isinstance(body.get("model"), str) else None,
               "prompt_name": caller.prompt.name if caller.prompt else None,
               "prompt_version": caller.prompt.version if caller.prompt else None,
               "backend": o.backend, "stream": stream, "status": o.status, "http_status": o.http_status,
               "finish_reason": o.finish_reason,
               "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
               "completion_tokens": o.completion_tokens if o.completion_tokens is not None else (o.chunks or None),
               "ttft_s": o.ttft_s, "latency_s": time.monotonic() - t0}
        self.counters.finished(caller.tenant.name, o.status)
        try:
            await asyncio.to_thread(self.store.record_usage, row)
        except Exception:
            log.exception("could not write the usage row of a %s request", caller.tenant.name)

