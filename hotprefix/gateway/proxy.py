"""One request through the gateway: authenticate, rebuild the request from what a
tenant may send, admit it under the key's limits (with a durable usage row), route,
forward, relay the answer, end it exactly once.

What a request becomes on its way to a backend (see tenant_api):
- a new body built from the allow-listed fields the client set, with the tenant's
  prompt in force (chat: first, the client's system/developer messages dropped;
  completions: before each prompt; Responses: first, as the operator's instructions,
  responses_proxy.py) and an explicit `max_tokens` (Responses: `max_output_tokens`): the client's (or
  --default-max-tokens), cut to the key's remaining token budget and to the
  backend's max_model_len;
- `cache_salt` is the tenant's (HMAC of the gateway secret). Private prompts are
  salted from token 0; public prompts from the first token that depends on the
  client's input, found once per backend and prompt by tokenizing two probe
  requests (hotprefix backends; other backends get the salt from token 0);
- to hotprefix backends, completions also carry `split_special_tokens` (chat
  content never becomes special tokens on hotprefix at all);
- streams always ask the backend for usage on every chunk, so a client that
  disconnects is billed for exactly the tokens the gateway received; chunks and
  fields the client did not ask for are removed before they reach it (relay.py
  passes the answer on).

A client that goes away, streaming or not, closes the upstream connection, so
the backend aborts too; the request is charged what the backend did (usage.Outcome:
the backend is recorded before the request is sent; a hotprefix backend is asked for
its count by request id, backend_usage.py). A backend that does not answer within
--backend-timeout is a 504 (not a dead backend: it is not marked down, and the
request is not sent again); only a backend that cannot be connected to is skipped
for the next one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from hotprefix.gateway import keys as K
from hotprefix.gateway.budgets import Price, Scope
from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.errors import GatewayError
from hotprefix.gateway.ratelimit import Decision, Limits, Refusal
from hotprefix.gateway.relay import ChatReader, Upstream, answer, relay
from hotprefix.gateway.responses_proxy import ResponsesReader, body_for_other, previous_of
from hotprefix.gateway.routing import Backend, Router, route_key
from hotprefix.gateway.store import Prompt, Store, UsageRow, UsageStatus, utcnow
from hotprefix.gateway.tenant_api import (
    LIMIT_FIELDS,
    TenantRequest,
    TenantRequestError,
    TenantResponses,
    backend_body,
    check_forced,
    join_prompt,
    num_sequences,
    parse_tenant_request,
    prompt_token_bound,
    token_prompts,
)
from hotprefix.gateway.usage import Accounting, Caller, InFlight, UsageStoreUnavailable
from hotprefix.server.body_guard import BodyRejected, parse_json_object
from hotprefix.server.responses import ClosingStreamingResponse, wait_disconnect

log = logging.getLogger(__name__)
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
TOKENIZE_ERRORS = (httpx.HTTPError, KeyError, ValueError, TypeError)  # a backend's /tokenize that did not answer
PROBES = ("A", "z")  # two client inputs that share no first character
REFUSALS = {Refusal.TOO_LARGE: "this request needs at least {least} tokens, more than the key's {tpm} tokens per "
                               "minute",
            Refusal.REQUESTS: "rate limit of {rpm} requests per minute reached",
            Refusal.TOKENS: "rate limit of {tpm} tokens per minute reached",
            Refusal.CONCURRENCY: "limit of {max_concurrent} concurrent requests reached",
            Refusal.BUDGET: "the budget of {detail} is spent for this period"}


def tokenize_bodies(endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """/tokenize requests that count exactly what the backend will render for `body`
    (a hotprefix backend: the same template, tools and operator_messages; completions
    prompts with their special-token text kept as text, as body_for sends them)."""
    if endpoint == "chat":
        extra = {k: body[k] for k in ("tools", "operator_messages") if body.get(k)}
        return [{"messages": body["messages"], **extra}]
    p = body["prompt"]
    return [{"prompt": t, "split_special_tokens": True} for t in (p if isinstance(p, list) else [p])]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Proxy:
    """The per-request pipeline. Holds no per-request state itself."""

    cfg: GatewayConfig
    store: Store
    secret: bytes
    router: Router
    client: httpx.AsyncClient
    acct: Accounting
    auth_cache: dict[str, tuple[float, Caller]] = field(default_factory=dict)  # digest -> (expiry, caller)

    @property
    def backend_headers(self) -> dict[str, str]:
        return self.cfg.backend_headers()

    # --- who is asking ------------------------------------------------------------------------------

    def _lookup(self, key: str) -> Caller | None:
        rec = self.store.authenticate(self.secret, key)
        if rec is None:
            return None
        tenant = self.store.tenant(rec.tenant)
        limits = Limits(rec.rpm or self.cfg.default_rpm, rec.tpm or self.cfg.default_tpm,
                        rec.max_concurrent or self.cfg.default_max_concurrent)
        scopes = (Scope(f"key:{rec.id}", rec.budget), Scope(f"tenant:{tenant.name}", tenant.budget))
        return Caller(rec, tenant, self.store.tenant_prompt(tenant), limits, scopes)

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
                   if endpoint != "completions" else {"prompt": join_prompt(prompt.text, probe),
                                                      "split_special_tokens": True})
            try:
                counts.append((await self._tokenize(backend, req))["tokens"])
            except TOKENIZE_ERRORS as e:
                log.warning("tokenize on %s failed (%s): salting the whole prompt", backend.url, e)
                return 0
        n = _common_prefix(*counts)
        backend.token_counts[ck] = n
        return n

    def route_key(self, caller: Caller) -> str:
        return route_key(caller.prompt.text if caller.prompt else None, bool(caller.prompt and caller.prompt.public),
                         caller.tenant.name)

    async def _tokenize(self, backend: Backend, req: dict[str, Any]) -> dict[str, Any]:
        """A hotprefix backend's /tokenize answer to `req`. Raises one of TOKENIZE_ERRORS."""
        r = await self.client.post(backend.url + "/tokenize", json=req, headers=self.backend_headers, timeout=10)
        r.raise_for_status()
        return r.json()

    async def _prompt_tokens(self, endpoint: str, body: dict[str, Any], caller: Caller) -> int:
        """The prompt tokens `body` will carry: counted by the first hotprefix backend in
        its routing order (its /tokenize renders exactly what it will serve, tools and
        all), else prompt_token_bound, which never counts low."""
        if endpoint == "responses":  # counted as the chat it renders as
            view = {k: v for k, v in body.items() if k != LIMIT_FIELDS[endpoint]}  # (its limit is not set yet)
            endpoint, body = "chat", TenantResponses.model_validate(view).chat_view()
        if endpoint == "completions" and token_prompts(body) is not None:  # token ids: their count is exact
            return prompt_token_bound(body)
        backend = next((b for b in self.router.order(self.route_key(caller)) if b.supports_salt), None)
        if backend is not None:
            try:
                return sum([int((await self._tokenize(backend, req))["count"])
                            for req in tokenize_bodies(endpoint, body)])
            except TOKENIZE_ERRORS as e:  # a 400 too: the bound, and the backend answers the request
                log.debug("tokenize on %s: %s; reserving the bound", backend.url, e)
        return prompt_token_bound(body)

    async def body_for(self, backend: Backend, endpoint: str, body: dict[str, Any], caller: Caller,
                       request_id: str) -> dict[str, Any]:
        """`body` for one backend: salted, capped to its context, asking for usage when streamed;
        to a backend that can say later what a request used, with the gateway's request id."""
        out = dict(body, cache_salt=K.tenant_salt(self.secret, caller.tenant.name))
        if not backend.supports_salt:  # another server renders tools as its template does (docs/gateway.md)
            out.pop("operator_messages", None)
            out = body_for_other(out) if endpoint == "responses" else out
        if backend.supports_lookup:
            out["request_id"] = request_id
        if backend.supports_salt and caller.prompt is not None and caller.prompt.public:
            out["cache_salt_offset"] = await self._salt_offset(backend, endpoint, caller.prompt)
        if backend.supports_salt and endpoint == "completions":
            out["split_special_tokens"] = True
        if backend.max_model_len:
            out[LIMIT_FIELDS[endpoint]] = min(out[LIMIT_FIELDS[endpoint]], backend.max_model_len)
        if out.get("stream") and endpoint != "responses":  # (a Responses stream reports its usage at its end)
            out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True,
                                     "continuous_usage_stats": True}
        return out

    # --- one request --------------------------------------------------------------------------------

    async def _check_model(self, caller: Caller, req: TenantRequest, row: UsageRow,
                           t0: float) -> Price | None:
        """The model's price. Raises GatewayError: 403 for a model the key may not use, 400
        for a model without a price when a budget of the caller is in money, or for more
        samples per prompt than the backends take (--max-n: refused here, not charged there)."""
        model, allowed, most = req.model, caller.key.models, self.router.max_n()
        if most is not None and max(req.n, getattr(req, "best_of", None) or 1) > most:
            await self.acct.record_refused(caller, row, UsageStatus.INVALID, 400, t0)
            raise GatewayError(400, f"n and best_of must be <= {most} (the backends' limit)", "BadRequestError",
                               "n")
        if allowed is not None and model not in allowed:
            await self.acct.record_refused(caller, row, UsageStatus.INVALID, 403, t0)
            raise GatewayError(403, f"this key may not use model {model!r}; it may use: {', '.join(allowed)}",
                               "PermissionDeniedError", "model")
        price = self.cfg.prices.get(model)
        if price is None and any(s.budget.money is not None for s in caller.scopes):
            await self.acct.record_refused(caller, row, UsageStatus.INVALID, 400, t0)
            raise GatewayError(400, f"model {model!r} has no price in the gateway's price table (--prices), and "
                               "this key's or tenant's budget is in money", "BadRequestError", "model")
        return price

    async def _parse(self, request: Request, endpoint: str, caller: Caller, row: UsageRow, t0: float) -> TenantRequest:
        """The client's body as what a tenant may send. Raises GatewayError(400), the row refused."""
        try:
            try:
                raw = parse_json_object(await request.body())  # whatever its content type says
            except BodyRejected as e:
                raise TenantRequestError(str(e)) from None
            req = parse_tenant_request(endpoint, raw)
            check_forced(req, caller.prompt.text if caller.prompt else None)
            return req
        except TenantRequestError as e:
            await self.acct.record_refused(caller, row, UsageStatus.INVALID, 400, t0)
            raise GatewayError(400, str(e), "BadRequestError", e.param) from None

    @staticmethod
    def _refusal(decision: Decision, caller: Caller, least: int) -> GatewayError:
        """The 429 of a request the limiter or a budget refused."""
        retry = max(1, math.ceil(decision.retry_after))
        lim = caller.limits
        what = REFUSALS[decision.reason].format(least=least, tpm=lim.tpm, rpm=lim.rpm,
                                                max_concurrent=lim.max_concurrent, detail=decision.detail)
        if decision.reason is Refusal.BUDGET and not decision.retry_after:  # a budget that never resets
            return GatewayError(429, f"{what}; it does not reset", "RateLimitError", headers=decision.headers)
        return GatewayError(429, f"{what}; retry after {retry}s", "RateLimitError",
                            headers={**decision.headers, "Retry-After": str(retry)})

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Serve one /v1/chat/completions, /v1/completions or /v1/responses request.
        Raises GatewayError."""
        t0 = time.monotonic()
        caller = await self.authenticate(request)
        rid = "gw-" + uuid.uuid4().hex
        row = UsageRow(caller.key.id, caller.tenant.name, endpoint,
                       prompt_name=caller.prompt.name if caller.prompt else None,
                       prompt_version=caller.prompt.version if caller.prompt else None)
        req = await self._parse(request, endpoint, caller, row, t0)
        row = replace(row, stream=req.stream, model=req.model[:256] if req.model else None)
        price = await self._check_model(caller, req, row, t0)
        system = caller.prompt.text if caller.prompt else None
        body = backend_body(endpoint, req, system, 0)
        held = await previous_of(self, req, caller, row, t0)  # (Responses: where its previous response is)
        seqs, estimate = num_sequences(req), await self._prompt_tokens(endpoint, body, caller) + held.tokens
        cap = min(req.wanted_max_tokens() or self.cfg.default_max_tokens, self.router.max_model_len() or 2**31)
        try:
            decision, flight = await self.acct.admit(caller, rid, row, estimate + cap * seqs, estimate + seqs, t0,
                                                     estimate, price)
        except UsageStoreUnavailable as e:
            raise GatewayError(503, f"{e}; try again later", "ServiceUnavailableError",
                               headers={"Retry-After": "1"}) from None
        if flight is None:
            raise self._refusal(decision, caller, estimate + seqs)
        body[LIMIT_FIELDS[endpoint]] = max(1, (decision.granted - estimate) // seqs)
        headers = {**decision.headers, "x-request-id": rid}
        try:
            return await self._forward(request, endpoint, req, body, caller, flight, headers, held.backends)
        except BaseException as e:
            ending = flight.end_soon()
            if not isinstance(e, asyncio.CancelledError):  # the error answer goes out once the row is complete
                await asyncio.shield(ending)
            raise

    async def _forward(self, request: Request, endpoint: str, req: TenantRequest, body: dict[str, Any],
                       caller: Caller, flight: InFlight, headers: dict[str, str],
                       backends: tuple[Backend, ...] = ()) -> Response:
        """Send (to `backends`, else in routing order) and answer, while watching the
        client: one that goes away before the answer (or the stream) starts cancels the
        upstream call, which closes its connection, so the backend aborts too."""
        reader = ResponsesReader() if endpoint == "responses" else ChatReader(req.stream_options)

        async def work() -> Response:
            up = await self._send(endpoint, body, caller, flight, backends)
            if req.stream and up.resp.status_code == 200:
                return ClosingStreamingResponse(relay(request, up, reader, flight), flight.end_soon,
                                                media_type="text/event-stream", headers=headers)
            return await answer(up, flight, headers, self.cfg.backend_timeout, reader)

        task = asyncio.ensure_future(work())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled() or not task.done():
            flight.outcome.status, flight.outcome.http_status = UsageStatus.CLIENT_ABORTED, 499
            await asyncio.gather(task, return_exceptions=True)
            await flight.end()
            return Response(status_code=499)  # nobody reads it
        return task.result()

    async def _send(self, endpoint: str, body: dict[str, Any], caller: Caller, flight: InFlight,
                    backends: tuple[Backend, ...] = ()) -> Upstream:
        """Try `backends` (default: in routing order) until one answers with less than 500. Only a
        backend that cannot be connected to is skipped (the request never reached
        it; one that refuses is marked down); a timeout or a broken answer ends the request. Raises GatewayError."""
        key = self.route_key(caller)
        outcome = flight.outcome
        fwd = {"x-request-id": flight.request_id, **self.backend_headers}
        errors = []
        for backend in backends or self.router.order(key):
            b = await self.body_for(backend, endpoint, body, caller, flight.request_id)
            outcome.sending(backend.url)  # before it is sent: from here on the backend may be computing
            try:
                up = await self._open(backend, self.client.build_request("POST", backend.url + ENDPOINTS[endpoint],
                                                                         json=b, headers=fwd))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached it: try the next
                outcome.sending(None)
                if isinstance(e, httpx.ConnectError):  # refused: down. A connect timeout may be a busy
                    backend.mark_down(f"{type(e).__name__}: {e}")  # back up: the health checks decide
                errors.append(f"{backend.url}: {type(e).__name__}")
                continue
            except httpx.TimeoutException:
                outcome.status, outcome.http_status = UsageStatus.TIMEOUT, 504
                raise GatewayError(504, f"the backend did not answer within {self.cfg.backend_timeout:g}s "
                                        "(--backend-timeout)", "GatewayTimeoutError") from None
            except httpx.TransportError as e:
                raise GatewayError(502, f"the backend failed: {type(e).__name__}", "BadGatewayError") from None
            if up.resp.status_code >= 500:  # it answered, with an error: nothing reached the client yet
                outcome.answered = up.resp.status_code
                await up.close()
                errors.append(f"{backend.url}: HTTP {up.resp.status_code}")
                continue
            self.acct.counters.routed(backend.url)
            return up
        raise GatewayError(503, "no backend could serve the request: " + ("; ".join(errors) or "none is up"),
                           "ServiceUnavailableError")

    async def _open(self, backend: Backend, req: httpx.Request) -> Upstream:
        """Send req; the response counts in the backend's in-flight load until the
        Upstream is closed (a failure to get it counts nothing). Raises httpx errors."""
        backend.inflight += 1
        try:
            resp = await self.client.send(req, stream=True)
        except BaseException:
            backend.inflight -= 1
            raise
        return Upstream(resp, backend)
