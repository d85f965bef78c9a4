"""N hotprefix replicas behind Ray Serve's prefix-affinity router.

Each replica (a Ray Serve deployment replica) runs one `hotprefix serve` process on its
node and forwards the OpenAI requests it is given to it; Ray's PrefixCacheAffinityRouter
(ray.serve.llm.request_router) picks the replica for each request from the prompt text
(a prefix tree of what each replica was sent, balanced against queue lengths), so a
prefix keeps landing on the replica whose KV cache holds it. An ingress deployment serves
/v1/completions and /v1/chat/completions (whole answers: a streamed request is answered
whole).

    serve run deploy.ray.hotprefix_serve:build replicas=2 args="--model /models/x.gguf"

`args` are `hotprefix serve`'s flags (anything but --host/--port, which each replica
sets), as one string. See docs/deploy.md.
"""


import shlex
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:  # (ray.serve.llm's package wants ray[llm]'s dependencies, pyarrow first; the router needs none)
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )


class OpenAIRequest:
    """One request as the router reads it: its `prompt` (completions) or `messages` (chat)
    attribute, present only when the body has it (the router takes the first it finds)."""

    def __init__(self, path: str, body: dict) -> None:
        self.path, self.body = path, body

    def __getattr__(self, name: str) -> Any:
        if name in ("prompt", "messages") and name in self.body:
            return self.body[name]
        raise AttributeError(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter),
                  ray_actor_options={"num_cpus": 1}, health_check_period_s=5)
class HotprefixReplica:
    """One `hotprefix serve` process, started with the replica and stopped with it."""

    def __init__(self, args: str, start_timeout: float = 300.0) -> None:
        port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "hotprefix", "serve", *shlex.split(args),
                                      "--host", "127.0.0.1", "--port", str(port)])
        self.url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + start_timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"hotprefix serve did not start (exit code {self.proc.poll()})")
            time.sleep(0.5)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def check_health(self) -> None:
        """Ray Serve's health check: the server process answers /health."""
        if self.proc.poll() is not None or not self._healthy():
            raise RuntimeError("the hotprefix server is down")

    async def __call__(self, request: OpenAIRequest) -> tuple[int, Any]:
        r = await self.client.post(request.path, json={**request.body, "stream": False})
        return r.status_code, r.json()

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


api = FastAPI(title="hotprefix on Ray Serve")


@serve.deployment
@serve.ingress(api)
class Ingress:
    """The OpenAI routes; each request goes to the replica the router picks."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas

    async def _forward(self, path: str, raw: Request) -> JSONResponse:
        status, body = await self.replicas.remote(OpenAIRequest(path, await raw.json()))
        return JSONResponse(body, status_code=status)

    @api.post("/v1/completions")
    async def completions(self, raw: Request) -> JSONResponse:
        return await self._forward("/v1/completions", raw)

    @api.post("/v1/chat/completions")
    async def chat(self, raw: Request) -> JSONResponse:
        return await self._forward("/v1/chat/completions", raw)


def build(cli_args: dict[str, str]) -> serve.Application:
    """The app: `replicas` hotprefix replicas (default 2) started with `args`."""
    replicas = int(cli_args.get("replicas", 2))
    return Ingress.bind(HotprefixReplica.options(num_replicas=replicas).bind(cli_args.get("args", "")))
