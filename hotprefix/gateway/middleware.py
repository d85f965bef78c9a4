"""ASGI middleware of the gateway (besides server.body_guard): the operator's keys."""

from __future__ import annotations

import hmac

from hotprefix.server.http_errors import error_response as _error


class OperatorGuard:
    """ASGI middleware: /admin needs the admin key; /metrics the metrics key (else the
    admin key). Checked before any body is read; a key that is not configured turns
    its endpoints off (403)."""

    def __init__(self, app, admin_key: str | None, metrics_key: str | None) -> None:
        self.app = app
        self.keys = {"/admin": admin_key, "/metrics": metrics_key or admin_key}

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        area = next((a for a in self.keys if path == a or path.startswith(a + "/")), None)
        if area is None:
            await self.app(scope, receive, send)
            return
        key = self.keys[area]
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if key is None:
            flag = "--admin-key" if area == "/admin" else "--metrics-key or --admin-key"
            resp = _error(403, f"{area} is off: start the gateway with {flag}", "PermissionDeniedError")
        elif not hmac.compare_digest(given, f"Bearer {key}".encode()):
            resp = _error(401, f"invalid or missing {area[1:]} key", "AuthenticationError")
        else:
            await self.app(scope, receive, send)
            return
        await resp(scope, receive, send)
