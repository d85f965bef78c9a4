"""OpenAI-style error responses shared by the server and the gateway (no torch import)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotprefix.errors import InvalidRequestError, NotFoundError

log = logging.getLogger(__name__)


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


MAX_ERRORS_SAID = 5  # a body with many bad values gets a message of the first few, not of all


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    errors = exc.errors()
    for err in errors[:MAX_ERRORS_SAID]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter '{where}'")
        elif err.get("type") == "json_invalid":
            parts.append(f"invalid JSON: {err.get('msg')}")
        else:
            parts.append(f"{where or 'body'}: {err.get('msg')}")
    more = f" (and {len(errors) - MAX_ERRORS_SAID} more)" if len(errors) > MAX_ERRORS_SAID else ""
    return ("; ".join(parts) or "invalid request") + more, param


def install_common_handlers(app: FastAPI, on_reject: Callable[[str], None] | None = None) -> None:
    """400 for invalid bodies and parameters, 404 for what a request names that is not
    kept (NotFoundError), the status of HTTP exceptions, 500
    (logged) for anything unexpected: always as an OpenAI error object.
    on_reject("invalid") is called for each 400 (a rejection metric)."""
    reject = on_reject or (lambda _reason: None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        reject("invalid")
        msg, param = validation_message(exc)
        return error_response(400, msg, "BadRequestError", param)

    @app.exception_handler(InvalidRequestError)
    async def _bad(_: Request, exc: InvalidRequestError) -> JSONResponse:
        reject("invalid")
        return error_response(400, str(exc), "BadRequestError", exc.param)

    @app.exception_handler(NotFoundError)
    async def _missing(_: Request, exc: NotFoundError) -> JSONResponse:
        reject("invalid")
        return error_response(404, str(exc), "NotFoundError", exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail),
                              "NotFoundError" if exc.status_code == 404 else "Error")

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
