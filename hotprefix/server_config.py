"""The HTTP server's configuration (re-exported by hotprefix.config, where callers import
it from). Each field a flag sets is declared here with `flag(...)` (hotprefix/flags.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hotprefix.flags import FILE_OR_TEXT, MINUTES, SIZE, TEXT_LIST, ConfigError, flag
from hotprefix.flags import FlagGroup as G

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # server/tool_parsers.PARSERS (a test checks)


@dataclass(frozen=True)
class AdmissionConfig:
    """What the async engine admits (the one owner of the queue limit). A request that
    would pass max_num_queued_requests gets 503 with Retry-After before any response
    starts, one larger than the whole limit a 400. Preprocessing runs in
    preprocess_workers threads, never on the event loop."""

    max_num_queued_requests: int = flag(1024, "sequences (prompts x n) that may wait for their first token; beyond "
                                        "it 503 + Retry-After", group=G.LIMITS,
                                        names=("--max-num-queued-requests", "--max-num-queued-reqs"))
    preprocess_timeout: float = flag(20.0, "seconds one request's chat template and tokenization may take (then 400)",
                                     group=G.LIMITS)
    preprocess_workers: int = 2
    max_scoring_tokens: int = flag(16_384, "prompt tokens x n of a request asking for its prompt's logprobs "
                                   "(prompt_logprobs, or echo with logprobs); above it a 400", group=G.LIMITS)

    def __post_init__(self) -> None:
        if self.max_num_queued_requests < 1:
            raise ConfigError(f"--max-num-queued-requests must be >= 1, got {self.max_num_queued_requests}")
        if not self.preprocess_timeout > 0:
            raise ConfigError(f"--preprocess-timeout must be > 0, got {self.preprocess_timeout}")
        if self.preprocess_workers < 1:
            raise ConfigError(f"preprocess_workers must be >= 1, got {self.preprocess_workers}")
        if self.max_scoring_tokens < 1:
            raise ConfigError(f"--max-scoring-tokens must be >= 1, got {self.max_scoring_tokens}")


# How long an idle HTTP keep-alive connection stays open, server and gateway. Longer than
# what clients and load balancers keep an idle connection for (httpx and the openai client
# 5 s, aiohttp 15 s, AWS ALB 60 s): the side that closes an idle connection must be the
# client, or a request sent as the server closes it fails ("Server disconnected without
# sending a response"; uvicorn's own default, 5 s, equals httpx's).
KEEP_ALIVE_S = 65.0


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server around the engine. dashboard_interval: seconds between the
    dashboard's samples; log_level: the server's (debug with -v); stats_interval: seconds
    between the stats lines; CORS headers are sent only with allowed_origins (vLLM allows
    every origin by default)."""

    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0 for all)", group=G.SERVER)
    port: int = flag(8000, "port to listen on", group=G.SERVER)
    served_model_names: tuple[str, ...] = flag(
        (), "the model names clients may use; the first is reported and labels metrics", group=G.SERVER,
        names=("--served-model-name",), nargs="+", shown="the model file's or folder's name")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on /v1 and admin endpoints",
                               group=G.SERVER, env="HOTPREFIX_API_KEY")
    admin_api_key: str | None = flag(None, "require this key instead of --api-key on the operator's endpoints "
                                     "(/pin, /unpin, /reset_prefix_cache, /prefix_groups, /requests, "
                                     "/dashboard/data): the client key then cannot use them", group=G.SERVER,
                                     env="HOTPREFIX_ADMIN_API_KEY")
    chat_template: str | None = flag(None, "a Jinja chat template (file or string) to override the model's",
                                     group=G.SERVER, unit=FILE_OR_TEXT)
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig())
    max_n: int = flag(16, "the most samples (n, best_of) of one request", group=G.LIMITS)
    max_request_body_bytes: int = flag(4 << 20, "a larger request body gets 413 before it is parsed",
                                       group=G.LIMITS, unit=SIZE)
    trust_request_chat_template: bool = flag(False, "accept a request's own chat_template (the server renders it; "
                                             "refused by default)", group=G.SERVER, negatable=True)
    request_log: str | None = flag(None, "append one JSON line per finished request to this file: times, token "
                                   "counts and each prompt's block-hash chain (keyed; no text), which `hotprefix "
                                   "lint FILE` reads", group=G.SERVER)
    request_log_prompts: bool = flag(False, "also write each prompt's rendered text in the request log (lint then "
                                     "names the volatile content and writes the fix; /dashboard and /prefix_groups "
                                     "show the start of each prefix group's first prompt)", group=G.SERVER)
    dashboard_interval: float = 5.0
    dashboard_window: float = flag(900.0, "minutes of history the /dashboard page shows (sampled every 5 s)",
                                   group=G.SERVER, unit=MINUTES)
    shutdown_timeout: float = flag(30.0, "on SIGTERM, seconds to let running requests finish", group=G.SERVER)
    log_level: str = "info"
    uvicorn_log_level: str = flag("info", "uvicorn's log level", group=G.HTTP,
                                  choices=("critical", "error", "warning", "info", "debug", "trace"))
    allowed_origins: tuple[str, ...] = flag((), "CORS origins, a JSON list ('[\"*\"]') or comma-separated",
                                            group=G.HTTP, unit=TEXT_LIST, shown="no CORS headers")
    allowed_methods: tuple[str, ...] = flag(("*",), "CORS methods (with --allowed-origins)", group=G.HTTP,
                                            unit=TEXT_LIST)
    allowed_headers: tuple[str, ...] = flag(("*",), "CORS headers (with --allowed-origins)", group=G.HTTP,
                                            unit=TEXT_LIST)
    allow_credentials: bool = flag(False, "CORS credentials (with --allowed-origins)", group=G.HTTP, negatable=True)
    root_path: str = flag("", "the path prefix a proxy serves the API under", group=G.HTTP)
    ssl_keyfile: str | None = flag(None, "serve HTTPS with this key (and --ssl-certfile)", group=G.HTTP)
    ssl_certfile: str | None = flag(None, "serve HTTPS with this certificate", group=G.HTTP)
    ssl_ca_certs: str | None = flag(None, "CA certificates for client certificates", group=G.HTTP)
    timeout_keep_alive: float = flag(KEEP_ALIVE_S, "seconds an idle keep-alive connection stays open (longer than "
                                     "clients' and load balancers' idle timeouts, so that they close first)",
                                     group=G.HTTP)
    log_stats: bool = flag(True, "no periodic line of throughput, queue, KV usage and prefix hit rate",
                           group=G.SERVER, names=("--disable-log-stats",), negate=True)
    stats_interval: float = 10.0
    metrics_prefix: str = flag("hotprefix", "Prometheus names' prefix: hotprefix, or vllm for vLLM's dashboards and "
                               "autoscalers", group=G.SERVER)
    tool_call_parser: str = flag("hermes", "how tool calls are read from the model's output (and written under "
                                 "tool_choice required)", group=G.SERVER, choices=TOOL_CALL_PARSERS)
    max_logprobs: int = flag(20, "the most logprobs a request may ask for (at most 20, the sampler's limit)",
                             group=G.SERVER)
    return_tokens_as_token_ids: bool = flag(False, 'logprob tokens written as "token_id:N" (for tokens that are not '
                                            "whole characters)", group=G.SERVER, negatable=True)
    docs: bool = flag(True, "no /docs, /redoc or /openapi.json", group=G.SERVER, names=("--disable-fastapi-docs",),
                      negate=True, negatable=True, inverse=True)

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"--max-logprobs must be in 0..20 (the sampler returns at most 20), "
                              f"got {self.max_logprobs}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ConfigError(f"--metrics-prefix must be a Prometheus name (letters, digits, _), "
                              f"got {self.metrics_prefix!r}")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ConfigError("--admin-api-key must differ from --api-key (the client key would open the operator's "
                              "endpoints)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("give --ssl-keyfile and --ssl-certfile together")
        if not self.stats_interval > 0:
            raise ConfigError(f"the stats interval must be > 0, got {self.stats_interval}")
        if not 0 < self.dashboard_interval <= self.dashboard_window <= 7 * 86400:
            raise ConfigError("the dashboard needs 0 < its interval <= its window (--dashboard-window) <= 7 days, got "
                              f"{self.dashboard_interval} s and {self.dashboard_window} s")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.timeout_keep_alive > 0:
            raise ConfigError(f"--timeout-keep-alive must be > 0, got {self.timeout_keep_alive}")
        for name, value in (("--max-n", self.max_n), ("--max-request-body-bytes", self.max_request_body_bytes)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
