"""A recording OpenAI-compatible backend for gateway tests.

It remembers every request it was sent (GET /_requests) and answers with
deterministic usage: prompt_tokens = words in the prompt (all message contents
joined), completion_tokens = max_tokens (default 4), one chunk per token when
streaming, usage on every chunk when asked (`continuous_usage_stats`). Markers
in the prompt change its behaviour: `FAIL500` answers 500; `HOLD:n` streams n
chunks and then waits for the client to go away, recording what it sent;
`WAIT:s` (not streamed) waits s seconds before answering, recording "aborted"
if the client goes away first; `DROP` sends its headers and part of a body, then
drops the connection. It also answers /tokenize (a token per word) and records
the Authorization header of every call. `app.state.health_delay` slows /health.

Runs in-process (`make_app`) or as a process: python -m tests.gateway.fake_backend --port P.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    p = body.get("prompt", "")
    return " ".join(p) if isinstance(p, list) else str(p)


class DroppedResponse(Response):
    """Headers that promise a body, a part of it, then the connection is gone."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
        await send({"type": "http.response.body", "body": b'{"id": "x", "choi', "more_body": True})
        raise ConnectionResetError("dropped on purpose")


def make_app(name: str = "fake", kind: str = "openai") -> FastAPI:
    """kind "hotprefix": /version says so, and the gateway treats it as a hotprefix backend."""
    app = FastAPI()
    records: list[dict[str, Any]] = []
    app.state.records = records

    app.state.health_delay = 0.0  # seconds /health waits before answering (tests set it)

    @app.get("/health")
    async def health() -> dict[str, str]:
        await asyncio.sleep(app.state.health_delay)
        return {}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "0-fake", **({"server": "hotprefix"} if kind == "hotprefix" else {})}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/_requests")
    async def requests() -> list[dict[str, Any]]:
        return records

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        records.append({"backend": name, "endpoint": "tokenize", "body": body, "status": "done",
                        "authorization": request.headers.get("authorization")})
        words = prompt_text(body).split()
        return {"count": len(words), "tokens": [sum(map(ord, w)) for w in words]}

    async def generate(request: Request, endpoint: str) -> Any:
        body = await request.json()
        text = prompt_text(body)
        rec = {"backend": name, "endpoint": endpoint, "body": body, "status": "started", "usage": None,
               "authorization": request.headers.get("authorization"),
               "request_id": request.headers.get("x-request-id")}
        records.append(rec)
        if "FAIL500" in text:
            rec["status"] = "failed"
            return JSONResponse({"error": {"message": "boom", "type": "InternalServerError", "code": 500}},
                                status_code=500)
        prompt_tokens = len(text.split())
        max_tokens = body.get("max_tokens") or 4
        hold = re.search(r"HOLD:(\d+)", text)
        obj = "chat.completion" if endpoint == "chat" else "text_completion"

        def usage(n: int) -> dict[str, Any]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                    "prompt_tokens_details": {"cached_tokens": 0}}

        def choice(i: int, last: bool) -> dict[str, Any]:
            piece = f"t{i} "
            c = {"index": 0, "finish_reason": "length" if last else None}
            c |= {"delta": {"content": piece}} if endpoint == "chat" else {"text": piece}
            return c

        if "DROP" in text:
            return DroppedResponse()
        wait = re.search(r"WAIT:([0-9.]+)", text)
        if wait and not body.get("stream"):
            end = time.monotonic() + float(wait.group(1))
            while time.monotonic() < end:
                if await request.is_disconnected():
                    rec["status"] = "aborted"
                    return JSONResponse({}, status_code=499)
                await asyncio.sleep(0.02)
        if not body.get("stream"):
            rec["status"], rec["usage"] = "done", usage(max_tokens)
            msg = {"message": {"role": "assistant", "content": "".join(f"t{i} " for i in range(max_tokens))}} \
                if endpoint == "chat" else {"text": "".join(f"t{i} " for i in range(max_tokens))}
            return {"id": "x", "object": obj, "created": int(time.time()), "model": "fake-model",
                    "choices": [{"index": 0, "finish_reason": "length", **msg}], "usage": usage(max_tokens)}
        opts = body.get("stream_options") or {}

        async def stream():
            n = int(hold.group(1)) if hold else max_tokens
            for i in range(n):
                chunk = {"id": "x", "object": obj + ".chunk", "model": "fake-model",
                         "choices": [choice(i, not hold and i == n - 1)]}
                if opts.get("continuous_usage_stats"):
                    chunk["usage"] = usage(i + 1)
                rec["usage"] = usage(i + 1)
                yield f"data: {json.dumps(chunk)}\n\n"
            if hold:
                rec["status"] = "holding"
                try:  # Starlette cancels this generator when the client goes away
                    while not await request.is_disconnected():
                        await asyncio.sleep(0.02)
                finally:
                    rec["status"] = "aborted"
                return
            if opts.get("include_usage"):
                yield f"data: {json.dumps({'id': 'x', 'object': obj + '.chunk', 'choices': [], 'usage': usage(n)})}\n\n"
            rec["status"] = "done"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, "completions")

    return app


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    a = ap.parse_args()
    uvicorn.run(make_app(a.name), host="127.0.0.1", port=a.port, log_level="warning")
