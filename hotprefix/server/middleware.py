"""ASGI middleware of the server (besides server.body_guard): the API key."""

from __future__ import annotations

import hmac

from hotprefix.server.http_errors import error_response

PROTECTED = ("/v1/", "/reset_prefix_cache", "/pin", "/unpin", "/tokenize", "/detokenize", "/prefix_groups",
             "/dashboard/data")


def app_path(scope) -> str:
    """The request's path below --root-path (uvicorn puts the root path in front)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class ApiKeyGuard:
    """ASGI middleware: with an API key set, the protected paths need
    `Authorization: Bearer <key>` (checked before any body is read)."""

    def __init__(self, app, api_key: str | None, on_reject) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is None or scope["type"] != "http" or not app_path(scope).startswith(PROTECTED):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        self.on_reject("unauthorized")
        resp = error_response(401, "invalid or missing API key (Authorization: Bearer <key>)", "AuthenticationError")
        await resp(scope, receive, send)
