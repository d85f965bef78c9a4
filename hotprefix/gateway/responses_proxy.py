"""`/v1/responses` through the gateway: what differs from the chat path (proxy.Proxy.handle
serves both: the same admission, limits, budgets, usage rows and routing).

- The body (tenant_api.backend_body): the tenant's fields (the server's own Responses
  model, its operator fields refused), the tenant's prompt as `operator_instructions`
  (a hotprefix backend puts it first and renders tools after it; another backend gets it
  ahead of the client's `instructions`), its cache salt and an explicit
  `max_output_tokens`. The prompt tokens are counted as the chat it renders as.
- Stored responses are scoped to their tenant: a hotprefix backend keeps a response under
  its id and the request's cache salt (the tenant's), so another tenant's id is a 404 there
  as an unknown one is. A `previous_response_id` is looked up first, on the hotprefix
  backends in the tenant's routing order: not found is a 404 (before admission); found, the
  request goes to the backend that holds it, and its reservation counts the stored
  conversation (its input and output tokens). `GET`/`DELETE /v1/responses/{id}` ask the
  same backends with the tenant's salt. Other backends cannot scope what they store: they
  get `store: false`, and their responses cannot be continued or fetched.
- Streams are passed on event by event (ResponsesReader); the usage of the final
  response event settles the request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from hotprefix.gateway import keys as K
from hotprefix.gateway.errors import GatewayError
from hotprefix.gateway.routing import Backend, Router
from hotprefix.gateway.store import UsageRow, UsageStatus
from hotprefix.gateway.tenant_api import TenantRequest, TenantResponses
from hotprefix.gateway.usage import Accounting, Caller, InFlight, Outcome

ENDED = ("response.completed", "response.incomplete", "response.failed", "error")  # a stream's last event
FAILED = ("response.failed", "error")  # ... the backend's failure: no answer (settled by its count)


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses usage object in chat's names (what Outcome takes)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": details and {"cached_tokens": details.get("cached_tokens")}}


def take_response(response: dict[str, Any], outcome: Outcome) -> None:
    """A Response object's usage and how it ended (as chat's finish reasons) into `outcome`."""
    outcome.take_usage(chat_usage(response.get("usage")))
    calls = any(isinstance(o, dict) and o.get("type") == "function_call" for o in response.get("output") or ())
    status = response.get("status")
    finish = "length" if status == "incomplete" else "tool_calls" if calls else "stop" if status == "completed" \
        else None
    outcome.take_choices([{"finish_reason": finish}] if finish else None)


class Proxy(Protocol):
    """What of proxy.Proxy this module uses (it cannot import it: the proxy imports this)."""

    secret: bytes
    router: Router
    client: httpx.AsyncClient
    acct: Accounting

    @property
    def backend_headers(self) -> dict[str, str]:
        ...

    async def authenticate(self, request: Request) -> Caller:
        ...

    def route_key(self, caller: Caller) -> str:
        ...


class ResponsesReader:
    """A Responses stream (`event:` and `data:` lines) passed on as it is; complete at its
    final event, whose response's usage settles the request (a failure's: the backend's count)."""

    end = ""

    def __init__(self) -> None:
        self.done, self.failed, self.seq = False, False, 0

    def line(self, line: str, flight: InFlight) -> str | None:
        if line.startswith("data: "):
            try:
                event = json.loads(line[6:])
            except ValueError:
                event = None
            if isinstance(event, dict):
                self._take(event, flight)
        return line + "\n"

    def _take(self, event: dict[str, Any], flight: InFlight) -> None:
        o = flight.outcome
        self.seq = event.get("sequence_number", self.seq) if isinstance(event.get("sequence_number"), int) \
            else self.seq
        if event.get("type") == "response.output_text.delta":
            o.chunks += 1
            o.ttft_s = o.ttft_s or time.monotonic() - flight.t0
        if event.get("type") in ENDED:
            self.done, self.failed = True, event.get("type") in FAILED
            if isinstance(event.get("response"), dict):
                take_response(event["response"], o)

    def take(self, answer: dict[str, Any], outcome: Outcome) -> None:
        take_response(answer, outcome)

    def error(self, message: str) -> str:
        event = {"type": "error", "sequence_number": self.seq + 1, "code": "502", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n"


def body_for_other(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses body for a backend that is not hotprefix: the tenant's prompt ahead of
    the client's instructions, and nothing stored (it could not scope it to the tenant)."""
    out = {k: v for k, v in body.items() if k not in ("operator_instructions", "cache_salt_offset")}
    lead = [t for t in (body.get("operator_instructions"), body.get("instructions")) if t]
    return out | ({"instructions": "\n\n".join(lead)} if lead else {}) | {"store": False}


@dataclass(frozen=True)
class Held:
    """Where a request's previous response is kept: the backend (none: no previous
    response), and the tokens of its stored conversation (a bound of what it adds)."""

    backends: tuple[Backend, ...] = ()
    tokens: int = 0


async def _kept(proxy: Proxy, caller: Caller, rid: str, method: str = "GET") -> tuple[Backend, httpx.Response] | None:
    """The first hotprefix backend in the caller's routing order that keeps response `rid`
    for the caller's tenant, and its answer to `method` on it; None when none does."""
    if rid in (".", ".."):  # a dot segment, not an id: the URL would name the path above
        return None
    salt = K.tenant_salt(proxy.secret, caller.tenant.name)
    for backend in proxy.router.order(proxy.route_key(caller)):
        if not backend.supports_salt:
            continue
        try:  # (the id quoted: one segment of the path, never another endpoint of the backend)
            r = await proxy.client.request(method, f"{backend.url}/v1/responses/{quote(rid, safe='')}",
                                           params={"cache_salt": salt},
                                           headers=proxy.backend_headers, timeout=10)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            return backend, r
    return None


async def previous_of(proxy: Proxy, req: TenantRequest, caller: Caller, row: UsageRow, t0: float) -> Held:
    """Where the request's previous response is kept. Raises GatewayError(404), its usage
    row refused, when no backend keeps it for this tenant."""
    rid = req.previous_response_id if isinstance(req, TenantResponses) else None
    if rid is None:
        return Held()
    kept = await _kept(proxy, caller, rid)
    if kept is None:
        await proxy.acct.record_refused(caller, row, UsageStatus.INVALID, 404, t0)
        raise GatewayError(404, f"previous response {rid!r} is not kept for this key's tenant", "NotFoundError",
                           "previous_response_id")
    usage = kept[1].json().get("usage") or {}
    return Held((kept[0],), sum(v for k in ("input_tokens", "output_tokens") if isinstance(v := usage.get(k), int)))


def responses_router(proxy: Proxy) -> APIRouter:
    """GET and DELETE /v1/responses/{id}: a stored response of the key's tenant (else 404)."""
    api = APIRouter()

    async def one(request: Request, response_id: str, method: str) -> Response:
        kept = await _kept(proxy, await proxy.authenticate(request), response_id, method)
        if kept is None:
            raise GatewayError(404, f"response {response_id!r} is not kept for this key's tenant", "NotFoundError",
                               "response_id")
        return Response(kept[1].content, media_type="application/json")

    @api.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await one(request, response_id, "GET")

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await one(request, response_id, "DELETE")

    return api
