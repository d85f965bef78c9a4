"""The gateway's error answered to a client (an OpenAI error object; app.py installs its handler)."""

from __future__ import annotations


class GatewayError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers = status, type_, param, headers or {}
