"""Every refusal of the server as an OpenAI error object, counted by reason."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hotprefix.engine.async_engine import EngineDeadError
from hotprefix.errors import PinError, QueueFullError, RequestFailedError
from hotprefix.server.http_errors import error_response as _error
from hotprefix.server.http_errors import install_common_handlers
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.responses import ClientGone

log = logging.getLogger("hotprefix.requests")


class ModelNotFound(Exception):
    pass


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """OpenAI error objects for every refusal, each counted in
    hotprefix:request_rejections_total{reason}."""
    reject = metrics.rejected
    install_common_handlers(app, reject)

    @app.exception_handler(PinError)
    async def _pin(_: Request, exc: PinError) -> JSONResponse:
        reject("invalid")
        return _error(400, str(exc), "BadRequestError", "prompt")

    @app.exception_handler(ModelNotFound)
    async def _model(_: Request, exc: ModelNotFound) -> JSONResponse:
        reject("invalid")
        return _error(404, f"The model `{exc}` does not exist.", "NotFoundError", "model")

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        reject("queue_full")
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        reject("engine_not_running")
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        log.info("%s %s: the client went away before the answer; request %s aborted", request.method,
                 request.url.path, exc)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        if exc.own:  # its grammar or sampling parameters: the same request fails again anywhere
            return _error(400, f"the request failed: {exc}", "BadRequestError")
        return _error(500, f"the request failed in the engine: {exc}", "InternalServerError")
