"""A backend's own count of a request's tokens, asked by the request's id: how a request
whose whole answer never came (its client went away, a timeout, a broken connection) is
charged what the backend did.

The gateway gives hotprefix backends its request id as the body's `request_id`; they
answer `GET /requests/{id}?wait=S` with the usage row of a finished or aborted request,
waiting up to S seconds for one still running, or not arrived yet (server/routes.py).
Other backends cannot say (None: the reservation is charged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from hotprefix.gateway.routing import Router
from hotprefix.gateway.store import Tokens
from hotprefix.gateway.usage import tokens_of

log = logging.getLogger(__name__)
LOOKUP_WAIT_S = 30.0  # how long a backend may take to finish aborting a request and write its row


@dataclass(frozen=True)
class UsageLookup:
    """Accounting's `lookup`: (backend url, request id) -> the backend's token counts."""

    client: httpx.AsyncClient
    router: Router
    headers: dict[str, str]
    wait_s: float = LOOKUP_WAIT_S

    async def __call__(self, backend_url: str, request_id: str) -> Tokens | None:
        """The backend's count, or None when it cannot say (not a hotprefix backend, it
        does not know the request, it fails). Never raises for the backend's failures."""
        backend = self.router.find(backend_url)
        if backend is None or not backend.supports_lookup:
            return None
        try:
            r = await self.client.get(f"{backend.url}/requests/{quote(request_id, safe='')}",
                                      params={"wait": self.wait_s}, headers=self.headers, timeout=self.wait_s + 10)
            if r.status_code != 200:
                log.warning("%s does not say what request %s used (HTTP %d): charging its reservation",
                            backend.url, request_id, r.status_code)
                return None
            found = tokens_of(r.json().get("usage"))
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("could not ask %s what request %s used (%s): charging its reservation", backend.url,
                        request_id, type(e).__name__)
            return None
        return found if found.prompt_tokens is not None else None
