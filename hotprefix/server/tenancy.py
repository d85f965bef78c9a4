"""Whose share of the engine a request takes (RequestOptions.tenant: the preprocessing
workers, each step's tokens and seats; core/fairness.py, engine/preprocess.py).

A salted request is its salt's: the gateway gives each of its tenants its own salt
(gateway/keys.tenant_salt), so behind the gateway the salt names the tenant. A direct
client is keyed by its address, "ip:ADDRESS": not by connection (one client's concurrent
requests come over as many connections) and not by API key (the server has one, which
every client presents). Clients behind one proxy or NAT share a tenant; a direct client
that sends its own cache_salt is keyed by that salt.
"""

from __future__ import annotations

from contextvars import ContextVar

from hotprefix.core.hashing import CacheScope

_client: ContextVar[str | None] = ContextVar("hotprefix_client_tenant", default=None)


class ClientTenant:
    """ASGI middleware: the client's address, as the tenant of what the request submits."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        client = scope.get("client") if scope["type"] == "http" else None
        token = _client.set(f"ip:{client[0]}" if client else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _client.reset(token)


def tenant_of(scope: CacheScope) -> str | None:
    """The tenant of a request of the current HTTP request: its salt's owner, else the
    client's address (None outside a request, e.g. the server's own)."""
    return scope.salt or _client.get()
