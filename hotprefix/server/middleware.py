"""ASGI middleware of the server (besides server.body_guard): the API keys.

Two kinds of paths: the clients' (CLIENT_PATHS: the OpenAI API, tokenizing) need
--api-key; the operator's (OPERATOR_PATHS: the prefix cache's controls, what other
requests shared and used, the dashboard's data) need --admin-api-key when it is set
(the client key then does not open them), else --api-key."""

from __future__ import annotations

import hmac

from hotprefix.server.http_errors import error_response

CLIENT_PATHS = ("/v1", "/tokenize", "/detokenize")
OPERATOR_PATHS = ("/reset_prefix_cache", "/pin", "/unpin", "/prefix_groups", "/requests", "/dashboard/data")


def app_path(scope) -> str:
    """The request's path below --root-path (uvicorn puts the root path in front)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def under(path: str, areas: tuple[str, ...]) -> bool:
    """Whether `path` is one of `areas` or below one (/pin, /pin/x: yes; /ping: no)."""
    return any(path == a or path.startswith(a + "/") for a in areas)


def _bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key else None


class ApiKeyGuard:
    """ASGI middleware: the protected paths need `Authorization: Bearer <key>` of their
    kind (see the module doc), checked before any body is read."""

    def __init__(self, app, api_key: str | None, on_reject, admin_key: str | None = None) -> None:
        self.app = app
        self.client = _bearer(api_key)
        self.operator = _bearer(admin_key) or self.client
        self.admin_named = admin_key is not None
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        path = app_path(scope) if scope["type"] == "http" else ""
        operator = under(path, OPERATOR_PATHS)
        expected = self.operator if operator else self.client if under(path, CLIENT_PATHS) else None
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if expected is None or hmac.compare_digest(given, expected):
            await self.app(scope, receive, send)
            return
        self.on_reject("unauthorized")
        which = "admin API key (--admin-api-key)" if operator and self.admin_named else "API key"
        resp = error_response(401, f"invalid or missing {which} (Authorization: Bearer <key>)", "AuthenticationError")
        await resp(scope, receive, send)
