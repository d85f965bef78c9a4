"""Warm-up: put every tenant's system prompt into the cache of the backend that
will serve it, and pin it there where the backend can pin (hotprefix's /pin).

A prompt is warmed on its home backend (the first in its routing ranking among
the backends that are up), once per route key: a public prompt shared by ten
tenants is computed once. Private prompts are warmed with their tenant's salt,
so the warm blocks are exactly the ones that tenant's requests will hit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from hotprefix.gateway import keys as K
from hotprefix.gateway.routing import Backend, Router, route_key
from hotprefix.gateway.store import Prompt, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmItem:
    key: str
    tenant: str
    prompt: Prompt


def warm_items(store: Store) -> list[WarmItem]:
    """One item per distinct route key over all tenants with a prompt (blocking: reads the store)."""
    items: dict[str, WarmItem] = {}
    for t in store.list_tenants():
        p = store.tenant_prompt(t)
        if p is not None:
            k = route_key(p.text, p.public, t.name)
            items.setdefault(k, WarmItem(k, t.name, p))
    return list(items.values())


async def warm_backend(client: httpx.AsyncClient, router: Router, backend: Backend, items: list[WarmItem],
                       secret: bytes, headers: dict[str, str], admin_headers: dict[str, str]) -> int:
    """Warm the items whose home is `backend` (/pin with `admin_headers`, a chat with
    `headers`); returns how many succeeded. Never raises for a backend error: it is
    logged with the backend's reason and kept as the backend's last error (the dashboard
    shows it): warm-up is an optimisation."""
    mine = [it for it in items if (r := router.ranking(it.key)) and r[0] is backend]
    done = 0
    for i, it in enumerate(mine, 1):
        system = [{"role": "system", "content": it.prompt.text}]
        salt = None if it.prompt.public else K.tenant_salt(secret, it.tenant)
        try:
            if backend.supports_salt:
                body = {"messages": system} | ({"cache_salt": salt} if salt else {})
                r = await client.post(backend.url + "/pin", json=body, headers=admin_headers, timeout=600)
            else:
                body = {"messages": system + [{"role": "user", "content": "."}], "max_tokens": 1,
                        "cache_salt": K.tenant_salt(secret, it.tenant)}
                if backend.model:
                    body["model"] = backend.model
                r = await client.post(backend.url + "/v1/chat/completions", json=body, headers=headers, timeout=600)
            if (why := refusal(r)) is not None:
                raise WarmUpRefused(why)
            done += 1
            log.info("warm-up %s: %d/%d prompt %s v%d (%s)%s", backend.url, i, len(mine), it.prompt.name,
                     it.prompt.version, "public" if it.prompt.public else f"private to {it.tenant}",
                     f", pinned {r.json().get('pinned_blocks')} blocks" if backend.supports_salt else "")
        except (httpx.HTTPError, ValueError, WarmUpRefused) as e:
            why = str(e) if isinstance(e, WarmUpRefused) else f"{type(e).__name__}: {e}"
            log.warning("warm-up %s: prompt %s v%d failed: %s", backend.url, it.prompt.name, it.prompt.version, why)
            backend.note_error(f"warm-up of prompt {it.prompt.name} v{it.prompt.version}: {why}")
    return done


class WarmUpRefused(Exception):
    """The backend answered a warm-up with an error (the message: its status and reason)."""


def refusal(r: httpx.Response) -> str | None:
    """Why a backend refused a request, in its own words (its OpenAI error message, else
    the start of its body), with the status; None when it did not refuse."""
    if r.status_code < 400:
        return None
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200] or r.reason_phrase
    return f"HTTP {r.status_code}: {message}"
