"""The `hotprefix` command and its sub-commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from hotprefix.config import (
    ATTENTION_BACKENDS,
    KEEP_ALIVE_S,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_DTYPES,
    QUANTIZED_MATMUL,
    ConfigError,
    parse_size,
)
from hotprefix.model.presets import PRESETS
from hotprefix.vllm_flags import DTYPE_ALIASES, add_foreign_args, check_foreign, expand_config, human_int

PRESET_NAMES = tuple(PRESETS)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", default=None,
                   help="HF model folder, .gguf file or hub id (default: the bundled SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    g.add_argument("--revision", default=None, help="hub revision to download")
    g.add_argument("--download-dir", default=None, help="where a hub model is downloaded (default: the HF cache)")
    g.add_argument("--dtype", default="auto", choices=MODEL_DTYPES + tuple(DTYPE_ALIASES),
                   help="compute dtype; auto = float32 on CPU, half precision on CUDA (half = float16, "
                        "float = float32)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--quantized-matmul", default="auto", choices=QUANTIZED_MATMUL,
                   help="GGUF block weights on the CPU (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): "
                        "int8 = int8 activations (llama.cpp's method, fastest), float32 = exact float32 "
                        "activations (also widens Q2_K/Q3_K to float32); auto = int8 where the CPU has AVX2 "
                        "or AVX-512 VNNI")
    _add_gpu_path_args(g)
    g.add_argument("--max-model-len", type=human_int, default=None,
                   help="longest prompt + output in tokens, e.g. 4096, 4k (4,000) or 4K (4,096) (default: the "
                        "model's context length)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV storage dtype; fp8 halves the memory of fp16")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", default=None,
                   help="bytes of KV cache on CPU, e.g. 2GiB or 2147483648 (default 1GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV (CUDA only)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, dest="num_blocks",
                   help="fix the number of KV blocks (for testing)")
    g.add_argument("--seed", type=int, default=0, help="seed of the shared sampler generator")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto (the model folder's generation_config.json), vllm (none: "
                        "the API's defaults) or a folder holding a generation_config.json")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="must be 1: one engine per device (run several behind `hotprefix gateway`)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of common prompt prefixes between requests")
    g.add_argument("--prefix-caching-hash-algo", default="sha256", choices=("sha256", "xxhash"),
                   help="block hash: sha256 (same on every server) or xxhash (faster, seeded per process)")
    g.add_argument("--max-pinned-fraction", type=float, default=0.2,
                   help="the most of the KV pool that pinned prefixes may hold")
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for --preemption-mode swap")
    _add_tier_args(g)
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running in one step")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default 2048; without chunked prefill max(2048, max-model-len))")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps within the token budget")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="if > 0, the most tokens one request computes in a step")
    s.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   help="fcfs: arrival order; priority: lowest request `priority` first, ties by arrival")
    s.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"),
                   help="when KV runs out: free a request and recompute it later, or swap its KV to host memory")
    _add_grammar_args(p)


def _add_gpu_path_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights of the model's shape, no weight files (a config.json folder, a GGUF's "
                        "header, or a named shape: " + ", ".join(PRESET_NAMES) + ")")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="how attention reads the paged KV: triton (kernels, CUDA), torch (gather + SDPA), cpu (C "
                        "kernels); auto = triton on CUDA when installed, cpu on the CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs (triton backend on CUDA)")
    g.add_argument("--cuda-graph-sizes", nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs: 1 2 4 8, 1,2,4,8 or [1, 2, 4] (default: 1, 2, "
                        "4 and every multiple of 8 up to --max-num-seqs)")


def _add_tier_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory for a KV tier below the pool: evicted blocks go there; 0 = off")
    g.add_argument("--kv-disk-dir", default=None,
                   help="a directory for a disk KV tier: computed blocks are written behind, and a restarted "
                        "server finds them; unset = off")
    g.add_argument("--kv-disk-size", type=float, default=16.0, help="GiB the disk KV tier may take")
    g.add_argument("--kv-disk-write", default="all", choices=("all", "reused"),
                   help="which blocks the disk KV tier writes: all computed ones (a prefix seen once survives a "
                        "restart), or only those hit again (no cost on traffic that shares nothing)")
    g.add_argument("--kv-disk-insecure", action="store_true",
                   help="use a --kv-disk-dir that other users may write or own (refused otherwise: its files "
                        "become other requests' KV)")


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("structured outputs (limits on a request's JSON schema, regex or grammar; each a 400)")
    c.add_argument("--max-grammar-bytes", type=int, default=128 << 10, help="a constraint's size in bytes")
    c.add_argument("--max-grammar-properties", type=int, default=5000, help="object properties in a JSON schema")
    c.add_argument("--max-grammar-enum-values", type=int, default=1000, help="enum and const values in a JSON schema")
    c.add_argument("--max-grammar-depth", type=int, default=32, help="nesting of a JSON schema")
    c.add_argument("--max-grammar-repeat", type=int, default=10_000,
                   help="the product of nested counted repetitions ({n}) in a regex or schema pattern")
    c.add_argument("--max-grammar-compile-seconds", type=float, default=5.0,
                   help="CPU seconds compiling one constraint may take, in a worker process that is killed when it "
                        "runs over (0: compile in the server's process, where nothing can stop it)")


def engine_config_from_args(a: argparse.Namespace):
    """The EngineConfig of the engine flags. Raises ConfigError."""
    from hotprefix.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StructuredConfig

    if a.tensor_parallel_size != 1:
        raise ConfigError(f"--tensor-parallel-size {a.tensor_parallel_size}: hotprefix runs one engine per device; "
                          "run one server per device behind `hotprefix gateway` instead")
    model = getattr(a, "model_tag", None) or a.model
    if getattr(a, "model_tag", None) and a.model and a.model != a.model_tag:
        raise ConfigError(f"two models given: {a.model_tag} and --model {a.model}")
    return EngineConfig(
        ModelConfig(model=model, tokenizer=a.tokenizer, dtype=DTYPE_ALIASES.get(a.dtype, a.dtype), device=a.device,
                    max_model_len=a.max_model_len, revision=a.revision, download_dir=a.download_dir, seed=a.seed,
                    quantized_matmul=a.quantized_matmul, generation_config=a.generation_config,
                    load_format=a.load_format, attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
                    cuda_graph_sizes=_graph_sizes(a.cuda_graph_sizes)),
        CacheConfig(block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
                    kv_cache_memory=None if a.kv_cache_memory is None else parse_size(a.kv_cache_memory),
                    gpu_memory_utilization=a.gpu_memory_utilization, num_blocks_override=a.num_blocks,
                    enable_prefix_caching=a.enable_prefix_caching,
                    prefix_caching_hash_algo=a.prefix_caching_hash_algo,
                    max_pinned_fraction=a.max_pinned_fraction, swap_space=int(a.swap_space * 2**30),
                    kv_offloading_size=int(a.kv_offloading_size * 2**30), kv_disk_dir=a.kv_disk_dir,
                    kv_disk_size=int(a.kv_disk_size * 2**30), kv_disk_write=a.kv_disk_write,
                    kv_disk_insecure=a.kv_disk_insecure),
        SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        enable_chunked_prefill=a.enable_chunked_prefill,
                        long_prefill_token_threshold=a.long_prefill_token_threshold,
                        scheduling_policy=a.scheduling_policy, preemption_mode=a.preemption_mode),
        StructuredConfig(max_grammar_bytes=a.max_grammar_bytes, max_grammar_properties=a.max_grammar_properties,
                         max_grammar_enum_values=a.max_grammar_enum_values, max_grammar_depth=a.max_grammar_depth,
                         max_grammar_repeat=a.max_grammar_repeat,
                         max_grammar_compile_seconds=a.max_grammar_compile_seconds),
    )


def _graph_sizes(values: list[str] | None) -> tuple[int, ...]:
    """--cuda-graph-sizes as batch sizes (space-, comma-separated or a JSON list). Raises ConfigError."""
    text = " ".join(values or ()).replace(",", " ").strip().removeprefix("[").removesuffix("]")
    try:
        return tuple(int(x) for x in text.split())
    except ValueError:
        raise ConfigError(f"--cuda-graph-sizes must be batch sizes such as 1 2 4 8, got {text!r}") from None


def _list(text: str | None) -> tuple[str, ...]:
    """A list flag as vLLM takes it (a JSON list) or comma-separated. Raises ConfigError."""
    if not text:
        return ()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a JSON list: {text!r} ({e})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ConfigError(f"expected a JSON list of strings, got {text!r}")
        return tuple(items)
    return tuple(x.strip() for x in text.split(",") if x.strip())


def cmd_serve(a: argparse.Namespace) -> int:
    import time

    from hotprefix.config import AdmissionConfig, ServerConfig

    for line in check_foreign(a):  # (raises ConfigError for a value that would change results)
        logging.getLogger("hotprefix.server").info(line)
    t0 = time.monotonic()
    logging.getLogger("hotprefix.server").info("starting: importing torch and the server")
    from hotprefix.server.launcher import serve

    logging.getLogger("hotprefix.server").info("imported in %.1fs", time.monotonic() - t0)

    template = a.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    serve(engine_config_from_args(a),
          ServerConfig(host=a.host, port=a.port, served_model_names=tuple(a.served_model_name or ()),
                       api_key=a.api_key, chat_template=template,
                       admission=AdmissionConfig(a.max_num_queued_requests, a.preprocess_timeout),
                       max_n=a.max_n, max_request_body_bytes=parse_size(a.max_request_body_bytes),
                       trust_request_chat_template=a.trust_request_chat_template,
                       request_log=a.request_log, request_log_prompts=a.request_log_prompts,
                       dashboard_window=60 * a.dashboard_window,
                       shutdown_timeout=a.shutdown_timeout,
                       log_level="debug" if a.verbose else "info", uvicorn_log_level=a.uvicorn_log_level,
                       allowed_origins=_list(a.allowed_origins), allowed_methods=_list(a.allowed_methods),
                       allowed_headers=_list(a.allowed_headers), allow_credentials=a.allow_credentials,
                       root_path=a.root_path, ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile,
                       ssl_ca_certs=a.ssl_ca_certs, timeout_keep_alive=a.timeout_keep_alive,
                       log_stats=not a.disable_log_stats,
                       metrics_prefix=a.metrics_prefix, tool_call_parser=a.tool_call_parser,
                       max_logprobs=a.max_logprobs, return_tokens_as_token_ids=a.return_tokens_as_token_ids,
                       docs=not a.disable_fastapi_docs))
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from hotprefix.engine.llm import LLM
    from hotprefix.errors import InvalidRequestError
    from hotprefix.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                top_k=a.top_k, min_p=a.min_p, seed=a.sampling_seed, stop=tuple(a.stop or ()),
                                ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    llm = LLM(config=engine_config_from_args(a))
    prompts = a.prompt or [sys.stdin.read()]
    outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if a.chat
            else llm.generate(prompts, params))
    for o in outs:
        for c in o.outputs:
            if a.json:
                print(json.dumps({"prompt": o.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                  "prompt_tokens": len(o.prompt_token_ids),
                                  "completion_tokens": len(c.token_ids)}))
            else:
                print(c.text)
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for prompts on the command line (or stdin)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(g)
    g.add_argument("prompt", nargs="*", help="prompts (default: read one from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.set_defaults(func=cmd_generate)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="serve the OpenAI-compatible API",
                        description="Serve /v1/completions, /v1/chat/completions and friends over HTTP. vLLM's "
                                    "launch lines work: `hotprefix serve MODEL --max-model-len 4096 ...`.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as vLLM takes it (the same as --model)")
    sv.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    add_engine_args(sv)
    _add_server_args(sv.add_argument_group("server"))
    _add_limit_args(sv.add_argument_group("limits (what one request may ask for)"))
    _add_http_args(sv.add_argument_group("HTTP (vLLM's flags)"))
    sv.add_argument("--config", default=None, metavar="FILE",
                    help="a YAML file of flags (long names without dashes as keys); the command line wins")
    add_foreign_args(sv.add_argument_group("vLLM's flags with no effect here (each named at start-up with why; "
                                           "a value that would change results is refused)"))
    sv.set_defaults(func=cmd_serve)


def _add_server_args(h: argparse._ArgumentGroup) -> None:
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model names clients may use; the first is reported (default: the file's name)")
    h.add_argument("--api-key", default=os.environ.get("HOTPREFIX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and admin endpoints (env HOTPREFIX_API_KEY)")
    h.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or string) to override the model's")
    h.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (the server renders it; refused by default)")
    h.add_argument("--request-log", default=None,
                   help="append one JSON line per finished request to this file: times, token counts and each "
                        "prompt's block-hash chain (keyed; no text), which `hotprefix lint FILE` reads")
    h.add_argument("--dashboard-window", type=float, default=15.0,
                   help="minutes of history the /dashboard page shows (sampled every 5 s)")
    h.add_argument("--request-log-prompts", action="store_true",
                   help="also write each prompt's rendered text in the request log (lint then names the "
                        "volatile content and writes the fix)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")
    h.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic line of throughput, queue, KV usage and prefix hit rate")
    h.add_argument("--metrics-prefix", default="hotprefix",
                   help="Prometheus names' prefix: hotprefix, or vllm for vLLM's dashboards and autoscalers")
    h.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM launch lines: usage.prompt_tokens_details.cached_tokens is always on")
    h.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="how tool calls are read from the model's output (and written under tool_choice required)")
    h.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs a request may ask for")
    h.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprob tokens written as "token_id:N" (for tokens that are not whole characters)')
    h.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    h.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM launch lines: tool_choice auto is always on")


def _add_limit_args(lim: argparse._ArgumentGroup) -> None:
    lim.add_argument("--max-num-queued-requests", "--max-num-queued-reqs", dest="max_num_queued_requests", type=int,
                     default=1024,
                     help="sequences (prompts x n) that may wait for their first token; beyond it 503 + Retry-After")
    lim.add_argument("--max-n", type=int, default=16, help="the most samples (n, best_of) of one request")
    lim.add_argument("--max-request-body-bytes", default="4MiB", help="a larger request body gets 413")
    lim.add_argument("--preprocess-timeout", type=float, default=20.0,
                     help="seconds one request's chat template and tokenization may take (then 400)")


def _add_http_args(h: argparse._ArgumentGroup) -> None:
    h.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="uvicorn's log level")
    h.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    h.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    h.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    h.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certificates")
    h.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open (longer than clients' and load "
                        "balancers' idle timeouts, so that they close first)")
    h.add_argument("--allowed-origins", default=None,
                   help='CORS origins, a JSON list (\'["*"]\') or comma-separated (default: no CORS headers)')
    h.add_argument("--allowed-methods", default='["*"]', help="CORS methods (with --allowed-origins)")
    h.add_argument("--allowed-headers", default='["*"]', help="CORS headers (with --allowed-origins)")
    h.add_argument("--allow-credentials", action="store_true", help="CORS credentials (with --allowed-origins)")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # server/tool_parsers.PARSERS (a test checks)


def serve_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The option strings of `hotprefix serve` (what a --config file may name)."""
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict) and "serve" in a.choices)
    return frozenset(sub.choices["serve"]._option_string_actions)


def build_parser() -> argparse.ArgumentParser:
    import hotprefix
    from hotprefix.gateway import cli as gateway_cli
    from hotprefix.tools import bench, lint, logs, size, watch

    p = argparse.ArgumentParser(prog="hotprefix", description="LLM inference built around a shared KV cache")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"hotprefix {hotprefix.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    for tool in (size, lint, logs, watch, bench):
        tool.add_parser(sub)
    gateway_cli.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_config(list(sys.argv[1:] if argv is None else argv), serve_flags(parser))
    except ConfigError as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call is noise here
    logging.getLogger("alembic").setLevel(logging.WARNING)  # a dozen lines per migration check
    from hotprefix.errors import InvalidRequestError
    from hotprefix.model.arch import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ConfigError, InvalidRequestError) as e:
        print(f"hotprefix: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
