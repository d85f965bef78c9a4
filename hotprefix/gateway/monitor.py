"""The backends' health, kind and warm-up: one task checks every backend every
--health-interval seconds; a backend that comes (back) up is probed (hotprefix or
another OpenAI-compatible server, its model and context) and warmed (warmup.py).

A backend is marked down at once when it refuses the connection or answers its
health check with an error status, but only after --health-fails checks in a row
time out: a backend busy with a burst answers late, and marking the only one down
turned a burst into 503s. The checks use their own HTTP client, so they never
wait for a connection behind the traffic they are checking."""

from __future__ import annotations

import asyncio
import logging

import httpx

from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.routing import Backend, BackendKind, Router
from hotprefix.gateway.store import Store
from hotprefix.gateway.warmup import warm_backend, warm_items

log = logging.getLogger(__name__)


async def probe(client: httpx.AsyncClient, backend: Backend, headers: dict[str, str]) -> None:
    """Learn the backend's kind (hotprefix or other), its first model id, its context and its
    limit of samples per request (hotprefix's model card says both)."""
    try:
        v = await client.get(backend.url + "/version", headers=headers, timeout=5)
        ours = v.status_code == 200 and v.json().get("server") == "hotprefix"
        backend.kind = BackendKind.HOTPREFIX if ours else BackendKind.OPENAI
    except (httpx.HTTPError, ValueError, AttributeError):
        backend.kind = BackendKind.OPENAI
    try:
        m = (await client.get(backend.url + "/v1/models", headers=headers, timeout=5)).json()["data"][0]
        backend.model = m["id"]
        backend.max_model_len, backend.max_n = _positive(m.get("max_model_len")), _positive(m.get("max_n"))
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        backend.model = backend.max_model_len = backend.max_n = None


def _positive(n: object) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class BackendMonitor:
    """Owns the Backend objects' health fields (on the event loop); `warmups` counts
    finished warm-ups. `spawn` runs its background work."""

    def __init__(self, cfg: GatewayConfig, store: Store, secret: bytes, router: Router, client: httpx.AsyncClient,
                 health_client: httpx.AsyncClient, spawn) -> None:
        """`client` carries the warm-up traffic; `health_client` only the checks and probes."""
        self.cfg, self.store, self.secret, self.router, self.client = cfg, store, secret, router, client
        self.health_client = health_client
        self.headers = cfg.backend_headers()
        self.spawn = spawn
        self.warmups = 0
        self.timeouts: dict[str, int] = {}  # backend url -> health checks timed out in a row

    async def warm(self, backend: Backend) -> None:
        """Send every prompt whose home is `backend` to it (and pin it on hotprefix)."""
        items = await asyncio.to_thread(warm_items, self.store)
        n = await warm_backend(self.client, self.router, backend, items, self.secret, self.headers,
                               self.cfg.backend_headers(admin=True))
        self.warmups += 1
        log.info("warm-up of %s done: %d prompt(s)", backend.url, n)

    async def check(self, backend: Backend) -> None:
        """One health check; a backend that comes up is probed and (with --warmup) warmed.
        Mutates the backend's health fields."""
        timed_out = False
        try:
            r = await self.health_client.get(backend.url + "/health", headers=self.headers,
                                             timeout=self.cfg.health_timeout)
            ok = r.status_code == 200
            err = None if ok else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            ok, err = False, f"{type(e).__name__}: {e}"
            timed_out = isinstance(e, httpx.TimeoutException)
        self.timeouts[backend.url] = self.timeouts.get(backend.url, 0) + 1 if timed_out else 0
        if timed_out and backend.healthy and self.timeouts[backend.url] < self.cfg.health_fails:
            log.info("backend %s: health check %d of %d in a row timed out", backend.url,
                     self.timeouts[backend.url], self.cfg.health_fails)
            return
        if ok and not backend.healthy:
            await probe(self.health_client, backend, self.headers)
            backend.mark_up()
            log.info("backend %s is up (%s, model %s)", backend.url, backend.kind.value, backend.model)
            if self.cfg.warmup:
                self.spawn(self.warm(backend))
        elif not ok:
            backend.mark_down(err)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.router.backends))

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.health_interval)
