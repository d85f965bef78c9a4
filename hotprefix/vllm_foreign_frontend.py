"""vLLM's `serve` flags about the HTTP frontend, logging and observability that have no
counterpart here (see vllm_foreign.py for the rules)."""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.vllm_foreign import EMPTY, NO_PROMPT_LOGS, OFF, check_given, no_effect, one_of, refused, value

METRICS = ("hotprefix exports its own Prometheus metrics on /metrics (vLLM's names with --metrics-prefix vllm), and "
           "no traces or profiles")
NO_ACCESS_LOG = ("uvicorn's access log is always off here; --request-log writes one line per finished request")
ONLY_HTTP = "only the HTTP OpenAI-compatible API is served, on --host and --port"
NO_REASONING = "no reasoning parser: a reasoning model's thoughts would stay in the answer's content"
LOGGING = "hotprefix logs to stderr in its own format (-v: debug; --uvicorn-log-level: uvicorn's)"


@dataclass(frozen=True)
class FrontendFlags:
    """The HTTP server, its endpoints, chat rendering, tools and logging."""

    enable_log_requests: bool | None = no_effect(NO_PROMPT_LOGS)
    enable_log_outputs: bool | None = no_effect(NO_PROMPT_LOGS)
    enable_log_deltas: bool | None = no_effect(NO_PROMPT_LOGS)
    max_log_len: str | None = value(NO_PROMPT_LOGS)
    disable_uvicorn_access_log: bool | None = no_effect(NO_ACCESS_LOG)
    disable_access_log_for_endpoints: str | None = value(NO_ACCESS_LOG)
    log_error_stack: bool | None = no_effect("an unexpected error is logged with its traceback")
    log_level: str | None = value(LOGGING)
    logging_config: str | None = value(LOGGING)
    log_config_file: str | None = value(LOGGING)
    response_role: str | None = refused("chat replies always have the role assistant here; another role would "
                                        "change them", harmless=one_of("assistant"),
                                        reason="chat replies have the role assistant")
    chat_template_content_format: str | None = refused("a message's content reaches the chat template as text",
                                                       harmless=one_of("auto", "string"))
    default_chat_template_kwargs: str | None = refused("the chat template renders with the request's own "
                                                       "chat_template_kwargs only", harmless=EMPTY)
    exclude_tools_when_tool_choice_none: bool | None = refused(
        "tools render in the prompt whatever tool_choice says (the prompt, and its cached prefix, stay the same)",
        takes_value=False, harmless=OFF)
    enable_auto_tool_choice: bool | None = no_effect("tool_choice auto is always on")
    tool_parser_plugin: str | None = refused("no plugin is loaded: --tool-call-parser is hermes, llama3_json or "
                                             "mistral", harmless=EMPTY)
    tool_server: str | None = refused("no tool server runs here: the client runs its tools", harmless=EMPTY)
    tool_strict_level: str | None = value("a forced call (tool_choice required or a function) always follows the "
                                          "function's parameters schema")
    reasoning_parser: str | None = refused(NO_REASONING, harmless=EMPTY)
    reasoning_parser_plugin: str | None = refused(NO_REASONING, harmless=EMPTY)
    reasoning_effort_map: str | None = value("no model served here reasons before answering")
    cohere_format: str | None = value("no Cohere model is served here")
    cohere_is_reasoning_model: bool | None = no_effect("no Cohere model is served here")
    anthropic_disabled_thinking_effort: str | None = value("no Anthropic API is served here")
    enable_flash_late_interaction: bool | None = no_effect("this server generates text (no late-interaction scoring)")
    guided_decoding_backend: str | None = value(
        "output constraints are enforced by llguidance: a token is allowed exactly when the constraint allows it, as "
        "with every backend", "--guided-decoding-backend", "--structured-outputs-config.backend",
        "--structured-outputs-config")
    enable_prompt_tokens_details: bool | None = no_effect("usage.prompt_tokens_details.cached_tokens is always "
                                                          "reported")
    enable_force_include_usage: bool | None = refused("usage comes in a stream when the request asks for it "
                                                      "(stream_options.include_usage)", takes_value=False,
                                                      harmless=OFF)
    enable_request_id_headers: bool | None = no_effect("answers carry no X-Request-Id header (the id is in the body)")
    enable_server_load_tracking: bool | None = no_effect("GET /load always reports the server's load")
    enable_tokenizer_info_endpoint: bool | None = no_effect("no /tokenizer_info here (/tokenize and /detokenize are)")
    enable_offline_docs: bool | None = no_effect("/docs is FastAPI's page (--disable-fastapi-docs turns it off)")
    enable_scale_out: bool | None = no_effect("no data-parallel group to scale: this server is one engine")
    fingerprint_mode: str | None = value("no system_fingerprint is returned")
    fingerprint_value: str | None = value("no system_fingerprint is returned")
    sse_keep_alive_interval: str | None = value("no keep-alive comments are sent in streams")
    h11_max_header_count: str | None = value("uvicorn's own limits apply; bodies are bounded by "
                                             "--max-request-body-bytes")
    h11_max_incomplete_event_size: str | None = value("uvicorn's own limits apply; bodies are bounded by "
                                                      "--max-request-body-bytes")
    enable_ssl_refresh: bool | None = no_effect("certificates are read once, at start")
    ssl_cert_reqs: str | None = refused("client certificates are not required here (put a proxy that checks them in "
                                        "front)", harmless=one_of("0"))
    ssl_ciphers: str | None = refused("TLS uses Python's default ciphers", harmless=EMPTY)
    middleware: str | None = refused("no extra ASGI middleware is imported (it would run code that is not "
                                     "hotprefix's)", harmless=EMPTY)
    tokens_only: bool | None = refused("this server takes and answers OpenAI's API (text)", takes_value=False,
                                       harmless=OFF)
    grpc: bool | None = refused(ONLY_HTTP, takes_value=False, harmless=OFF)
    grpc_port: str | None = refused(ONLY_HTTP, harmless=EMPTY)
    uds: str | None = refused(ONLY_HTTP + " (no Unix socket)", harmless=EMPTY)

    def __post_init__(self) -> None:
        check_given(self)


@dataclass(frozen=True)
class MetricsFlags:
    """Metrics, traces and profiles."""

    otlp_traces_endpoint: str | None = value(METRICS)
    collect_detailed_traces: str | None = value(METRICS)
    show_hidden_metrics_for_version: str | None = value(METRICS)
    kv_cache_metrics: bool | None = no_effect(METRICS)
    kv_cache_metrics_sample: str | None = value(METRICS)
    enable_mfu_metrics: bool | None = no_effect(METRICS)
    enable_logging_iteration_details: bool | None = no_effect(METRICS)
    custom_histogram_buckets: str | None = value(METRICS)
    jit_monitor_mode: str | None = value(METRICS)
    jit_monitor_verbose: bool | None = no_effect(METRICS)
    enable_per_request_metrics: bool | None = no_effect(METRICS)
    profiler_config: str | None = value(METRICS)
    cudagraph_metrics: bool | None = no_effect(METRICS)
    enable_layerwise_nvtx_tracing: bool | None = no_effect(METRICS)

    def __post_init__(self) -> None:
        check_given(self)
