"""Frozen configuration, one dataclass per concern.

Values that are only known at start-up (the number of KV blocks, the model's
shape) live in plans built from these configs, never by mutating them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")


class SchedulingPolicy(str, Enum):
    """fcfs: arrival order; priority: lowest request `priority` first, ties by arrival."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class DiskWritePolicy(str, Enum):
    """Which computed blocks the disk KV tier writes: every one (a single request's
    prefix survives a restart), or only blocks that were hit again (nothing is written
    for prompts that are never shared: no cost on unique traffic)."""

    ALL = "all"
    REUSED = "reused"


class PreemptionMode(str, Enum):
    """What happens to a preempted request's KV: freed and recomputed, or swapped to host memory."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class QuantizedMatmul(str, Enum):
    """How GGUF block weights multiply on the CPU (see ModelConfig)."""

    AUTO = "auto"
    INT8 = "int8"
    FLOAT32 = "float32"


class LoadFormat(str, Enum):
    """Where the weights come from: the model's files, or random values of its shape
    (vLLM's "dummy": a config.json folder, a GGUF's header or a named shape such as
    llama-3.1-8b; for measuring speed without weights to carry)."""

    AUTO = "auto"
    DUMMY = "dummy"


class AttentionBackend(str, Enum):
    """How attention reads the paged KV, chosen once when the runner is built:
    torch: gather each sequence's K/V from the block table, then SDPA (the reference);
    cpu: the C kernels on a float32 CPU pool (decode batch, cascades, fused decode),
    torch's where they do not apply; triton: the Triton kernels (model/kernels/triton_attention.py)
    read the pool in place, compiled on CUDA, interpreted on the CPU (tests only: slow);
    auto: triton on CUDA where it is installed, else torch there; cpu on the CPU."""

    AUTO = "auto"
    TORCH = "torch"
    CPU = "cpu"
    TRITON = "triton"


SCHEDULING_POLICIES = tuple(m.value for m in SchedulingPolicy)
LOAD_FORMATS = tuple(m.value for m in LoadFormat)
ATTENTION_BACKENDS = tuple(m.value for m in AttentionBackend)
QUANTIZED_MATMUL = tuple(m.value for m in QuantizedMatmul)


def as_mode(cls: type[Enum], flag: str, value: object) -> Enum:
    """value as a member of the mode Enum cls. Raises ConfigError naming the flag."""
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"{flag} must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None


def cache_root() -> Path:
    """Where derived files are kept (converted GGUF tokenizers, built kernels):
    $HOTPREFIX_CACHE, default ~/.cache/hotprefix."""
    return Path(os.environ.get("HOTPREFIX_CACHE", Path.home() / ".cache" / "hotprefix"))


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the value."""


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int | float) -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512MB"`` or ``1073741824`` into bytes.

    Raises ConfigError on anything that is not a non-negative size.
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"memory size must be non-negative, got {text}")
        return int(text)
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"cannot parse memory size {text!r} (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and in what precision.

    model: a HF folder, a .gguf file, a hub id, or None for the bundled default.
    dtype: compute dtype; "auto" means float32 on CPU (bf16 is very slow there)
    and the checkpoint's dtype on CUDA.
    quantized_matmul: how a GGUF's block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    Q6_K) are multiplied on the CPU: "int8" quantizes activations to int8 per 32 values (per
    256 for the K-quants: llama.cpp's methods, ~0.5-2% relative error per product, 2-8x
    faster with AVX2 or AVX-512 VNNI); "float32" keeps
    activations in float32 (results equal the dequantized weights' float32 product);
    "auto" is int8 where the kernel build has AVX2 or AVX-512 VNNI, else float32.
    generation_config: where default sampling parameters come from (vLLM's flag):
    "auto", the model folder's generation_config.json (temperature, top_p, top_k,
    min_p, repetition_penalty, max_new_tokens); "vllm", none (the API's defaults);
    or a folder holding a generation_config.json.
    download_dir: where a hub model is downloaded (default: huggingface_hub's cache).
    load_format: LoadFormat (dummy: random weights of the model's shape).
    attention_backend: AttentionBackend.
    enforce_eager: never replay CUDA graphs (decode steps run eagerly, as prefill always does).
    cuda_graph_sizes: the decode batch sizes captured as CUDA graphs (a step pads up to the
    next one); empty: 1, 2, 4, 8, then every multiple of 8 up to --max-num-seqs (vLLM's).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    revision: str | None = None
    download_dir: str | None = None
    seed: int = 0
    quantized_matmul: QuantizedMatmul = QuantizedMatmul.AUTO
    generation_config: str = "auto"
    load_format: LoadFormat = LoadFormat.AUTO
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantized_matmul",
                           as_mode(QuantizedMatmul, "--quantized-matmul", self.quantized_matmul))
        object.__setattr__(self, "load_format", as_mode(LoadFormat, "--load-format", self.load_format))
        object.__setattr__(self, "attention_backend",
                           as_mode(AttentionBackend, "--attention-backend", self.attention_backend))
        object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
        if any(not isinstance(n, int) or n < 1 or n > 4096 for n in self.cuda_graph_sizes):
            raise ConfigError(f"--cuda-graph-sizes must be batch sizes in 1..4096, got {list(self.cuda_graph_sizes)}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")

    def context_length(self, model_context: int) -> int:
        """The longest prompt + output served: --max-model-len, else the model's own context."""
        return self.max_model_len or model_context


DISK_STAGING_BYTES = 512 << 20


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    kv_cache_memory: bytes for KV on CPU (None: a default of 1 GiB).
    gpu_memory_utilization: share of the GPU's memory for weights + activations + KV.
    num_blocks_override: fix the number of blocks (tests; small pools).
    enable_prefix_caching: share full blocks between requests by chained hash.
    max_pinned_fraction: the most of the pool that pinned prefixes may hold.
    swap_space: bytes of host memory for swap-mode preemption (allocated only in that mode).
    kv_offloading_size: bytes of host memory for the host KV tier (0: none; see core/kv_tiers.py).
    kv_disk_dir: a directory for the disk KV tier (None: none); it survives restarts.
    kv_disk_size: the most bytes the disk tier's files may take.
    kv_disk_write: which computed blocks the disk tier writes (DiskWritePolicy).
    kv_disk_insecure: use a --kv-disk-dir that others may write (refused otherwise).
    """

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_pinned_fraction: float = 0.2
    swap_space: int = 4 << 30
    kv_offloading_size: int = 0
    kv_disk_dir: str | None = None
    kv_disk_size: int = 16 << 30
    kv_disk_write: DiskWritePolicy = DiskWritePolicy.ALL
    kv_disk_insecure: bool = False

    @property
    def host_tier_bytes(self) -> int:
        """The host tier's size: --kv-offloading-size, or DISK_STAGING_BYTES when only
        the disk tier is on (disk reads land in host memory before the pool)."""
        return self.kv_offloading_size or (DISK_STAGING_BYTES if self.kv_disk_dir else 0)

    def __post_init__(self) -> None:
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must be >= 0, got {self.swap_space}")
        object.__setattr__(self, "kv_disk_write", as_mode(DiskWritePolicy, "--kv-disk-write", self.kv_disk_write))
        if self.kv_offloading_size < 0 or self.kv_disk_size < 0:
            raise ConfigError("--kv-offloading-size and --kv-disk-size must be >= 0")
        if self.kv_disk_dir and self.prefix_caching_hash_algo != "sha256":
            raise ConfigError("--kv-disk-dir needs --prefix-caching-hash-algo sha256: xxhash is seeded per process, "
                              "so its hashes would never match after a restart")
        if self.prefix_caching_hash_algo not in ("sha256", "xxhash"):
            raise ConfigError(f"--prefix-caching-hash-algo must be sha256 or xxhash, "
                              f"got {self.prefix_caching_hash_algo!r}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError(f"--max-pinned-fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError(f"--block-size must be in 1..1024, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks_override}")


DEFAULT_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests and tokens one engine step may take, in what order,
    and what happens when KV blocks run out.

    max_num_batched_tokens: the step's token budget; None: 2048, or without chunked
    prefill max(2048, max_model_len) (vLLM's rule), since a prompt (or a preempted
    prompt with its output) must then fit one step whole (see `resolved`).
    long_prefill_token_threshold: if > 0, no request computes more than this
    many tokens in one step (long prompts cannot crowd out decodes); needs
    chunked prefill.
    preemption_mode: recompute (free and recompute) or swap (copy to host memory).
    How many requests may wait is the server's admission limit
    (ServerConfig.max_num_queued_requests), not the scheduler's.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    long_prefill_token_threshold: int = 0
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption_mode", as_mode(PreemptionMode, "--preemption-mode",
                                                            self.preemption_mode))
        object.__setattr__(self, "scheduling_policy", as_mode(SchedulingPolicy, "--scheduling-policy",
                                                              self.scheduling_policy))
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("--long-prefill-token-threshold splits prompts over steps: it needs chunked prefill "
                              "(drop --no-enable-chunked-prefill)")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def token_budget(self) -> int:
        """The step's token budget (DEFAULT_BATCHED_TOKENS when not set)."""
        return self.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS

    def resolved(self, max_model_len: int) -> SchedulerConfig:
        """This config with the budget filled in for a model of max_model_len tokens.
        Raises ConfigError when chunked prefill is off and an explicit budget is
        smaller than max_model_len: such a prompt could never be scheduled."""
        budget = self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return replace(self, max_num_batched_tokens=budget or DEFAULT_BATCHED_TOKENS)
        if budget is None:
            return replace(self, max_num_batched_tokens=max(DEFAULT_BATCHED_TOKENS, max_model_len))
        if budget < max_model_len:
            raise ConfigError(f"--max-num-batched-tokens {budget} is smaller than --max-model-len {max_model_len}: "
                              "without chunked prefill a prompt must fit one step; raise the one or lower the "
                              "other")
        return self


@dataclass(frozen=True)
class StructuredConfig:
    """Output constraints (JSON schema, regex, choice, grammars; tools' calls): the size
    a request's may have (grammar_limits.GrammarLimits: bytes, object properties, enum
    and const values, nesting depth, nested regex repetition), each refused with a 400
    naming it; and the CPU seconds compiling one may take in a worker process that is
    killed when it runs over (grammar_sandbox.py; 0: compile in the server's process, which
    nothing can stop)."""

    max_grammar_bytes: int = 128 << 10
    max_grammar_properties: int = 5_000
    max_grammar_enum_values: int = 1_000
    max_grammar_depth: int = 32
    max_grammar_repeat: int = 10_000
    max_grammar_compile_seconds: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_grammar_bytes", "max_grammar_properties", "max_grammar_enum_values", "max_grammar_depth",
                     "max_grammar_repeat"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_grammar_compile_seconds <= 3600:
            raise ConfigError(f"--max-grammar-compile-seconds must be in [0, 3600], got "
                              f"{self.max_grammar_compile_seconds}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)


@dataclass(frozen=True)
class AdmissionConfig:
    """What the async engine admits (the one owner of the queue limit).

    max_num_queued_requests: sequences (a request with n samples over k prompts
    counts n x k) that may wait for their first token; a request that would pass
    it gets 503 with Retry-After before any response starts, one larger than the
    whole limit a 400.
    preprocess_timeout: seconds one request's template rendering and tokenization
    (in worker threads, never on the event loop) may take before it gets a 400.
    preprocess_workers: those worker threads.
    """

    max_num_queued_requests: int = 1024
    preprocess_timeout: float = 20.0
    preprocess_workers: int = 2

    def __post_init__(self) -> None:
        if self.max_num_queued_requests < 1:
            raise ConfigError(f"--max-num-queued-requests must be >= 1, got {self.max_num_queued_requests}")
        if not self.preprocess_timeout > 0:
            raise ConfigError(f"--preprocess-timeout must be > 0, got {self.preprocess_timeout}")
        if self.preprocess_workers < 1:
            raise ConfigError(f"preprocess_workers must be >= 1, got {self.preprocess_workers}")


# How long an idle HTTP keep-alive connection stays open, server and gateway. Longer than
# what clients and load balancers keep an idle connection for (httpx and the openai client
# 5 s, aiohttp 15 s, AWS ALB 60 s): the side that closes an idle connection must be the
# client, or a request sent as the server closes it fails ("Server disconnected without
# sending a response"; uvicorn's own default, 5 s, equals httpx's).
KEEP_ALIVE_S = 65.0


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server around the engine.

    served_model_names: the names clients may use (the first is reported and labels
    metrics; default: the model file's or folder's name).
    api_key: when set, /v1/* and the admin endpoints need `Authorization: Bearer <key>`.
    request_log: a file to append one JSON line per finished request to (with each prompt's
    keyed block-hash chain, never its text unless request_log_prompts).
    request_log_prompts: also write each prompt's rendered text in the request log (and
    show the start of each prefix group's first prompt on /dashboard and /prefix_groups).
    dashboard_interval / dashboard_window: seconds between the dashboard's samples, and
    how far back its series goes.
    shutdown_timeout: seconds to let running requests finish after SIGTERM.
    admission: how many sequences may wait, and the preprocessing budget (AdmissionConfig).
    max_n: the most samples (n, best_of) one request may ask for.
    max_request_body_bytes: a larger body gets 413 before it is parsed.
    trust_request_chat_template: accept a request's own `chat_template` (the server runs it).
    allowed_origins / allowed_methods / allowed_headers / allow_credentials: CORS
    (no origins: no CORS headers at all; vLLM allows every origin by default).
    root_path: the path prefix a proxy serves the app under.
    ssl_keyfile / ssl_certfile / ssl_ca_certs: serve HTTPS.
    timeout_keep_alive: seconds an idle keep-alive connection stays open (KEEP_ALIVE_S).
    log_stats: log throughput, queue, KV usage and prefix hit rate every stats_interval s.
    metrics_prefix: the Prometheus names' prefix ("hotprefix"; "vllm" for vLLM dashboards).
    tool_call_parser: how tool calls are read from the model's output (server/tool_parsers.py).
    max_logprobs: the most logprobs a request may ask for (at most 20, the sampler's limit).
    return_tokens_as_token_ids: logprob tokens as "token_id:N" (vLLM's flag).
    docs: serve /docs, /redoc and /openapi.json (off: --disable-fastapi-docs).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    chat_template: str | None = None
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig())
    max_n: int = 16
    max_request_body_bytes: int = 4 << 20
    trust_request_chat_template: bool = False
    request_log: str | None = None
    request_log_prompts: bool = False
    dashboard_interval: float = 5.0
    dashboard_window: float = 900.0
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    uvicorn_log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    timeout_keep_alive: float = KEEP_ALIVE_S
    log_stats: bool = True
    stats_interval: float = 10.0
    metrics_prefix: str = "hotprefix"
    tool_call_parser: str = "hermes"
    max_logprobs: int = 20
    return_tokens_as_token_ids: bool = False
    docs: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"--max-logprobs must be in 0..20 (the sampler returns at most 20), "
                              f"got {self.max_logprobs}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ConfigError(f"--metrics-prefix must be a Prometheus name (letters, digits, _), "
                              f"got {self.metrics_prefix!r}")
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
        for flag, value in (("--max-n", self.max_n), ("--max-request-body-bytes", self.max_request_body_bytes)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
