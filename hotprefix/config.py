"""Frozen configuration, one dataclass per concern.

Each field that a flag sets is declared once, here, with `flag(...)` (hotprefix/flags.py):
its help, --help section, unit and choices; the `serve` and `generate` parsers and
`LLM(**kwargs)` are built from these declarations. A field holds the engine's unit
(bytes, seconds); its flag and LLM keyword take the user's (GiB, minutes) and the
declaration's Unit converts. Values that are only known at start-up (the number of KV
blocks, the model's shape) live in plans built from these configs, never by mutating them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from hotprefix.config_json import SPECULATIVE as SPECULATIVE
from hotprefix.config_json import EventEncoding as EventEncoding
from hotprefix.config_json import KVEventsConfig as KVEventsConfig
from hotprefix.config_json import SpecMethod as SpecMethod
from hotprefix.config_json import SpeculativeConfig as SpeculativeConfig
from hotprefix.config_json import as_mode as as_mode
from hotprefix.flags import GIB, SIZE, ConfigError, Unit, flag
from hotprefix.flags import FlagGroup as G
from hotprefix.flags import parse_size as parse_size  # (re-exported: where callers import them from)
from hotprefix.server_config import KEEP_ALIVE_S as KEEP_ALIVE_S
from hotprefix.server_config import AdmissionConfig as AdmissionConfig
from hotprefix.server_config import ServerConfig as ServerConfig
from hotprefix.vllm_flags import DTYPE_ALIASES, Inert, human_int, on_cpu

NO_GRAPHS = "CUDA graphs are captured on CUDA only: on a CPU every step runs eagerly"
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
    """How GGUF block weights multiply on the CPU: int8 quantizes activations per 32 values
    (256 for the K-quants: llama.cpp's methods, ~0.5-2% relative error per product, 2-8x
    faster with AVX2 or AVX-512 VNNI); float32 keeps them (the dequantized weights' float32
    product); auto is int8 where the kernel build has AVX2 or AVX-512 VNNI, else float32."""

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




def cache_root() -> Path:
    """Where derived files are kept (converted GGUF tokenizers, built kernels):
    $HOTPREFIX_CACHE, default ~/.cache/hotprefix."""
    return Path(os.environ.get("HOTPREFIX_CACHE", Path.home() / ".cache" / "hotprefix"))


def _graph_sizes(values: str | list | tuple) -> tuple[int, ...]:
    """--cuda-graph-sizes as batch sizes (space-, comma-separated or a JSON list). Raises ConfigError."""
    if not isinstance(values, (str, list)) or not all(isinstance(v, str) for v in values):
        return tuple(values)
    text = " ".join([values] if isinstance(values, str) else values).replace(",", " ").strip()
    try:
        return tuple(int(x) for x in text.removeprefix("[").removesuffix("]").split())
    except ValueError:
        raise ConfigError(f"--cuda-graph-sizes must be batch sizes such as 1 2 4 8, got {text!r}") from None


def _tenant_weight(item: str) -> tuple[str, float]:
    """TENANT=WEIGHT as a pair. Raises ConfigError."""
    name, _, weight = item.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = None
    if not name or value is None:
        raise ConfigError(f"--tenant-weight takes TENANT=WEIGHT, got {item!r}")
    return name, value


def _tenant_weights(values: str | list | tuple | dict) -> tuple[tuple[str, float], ...]:
    """--tenant-weight TENANT=WEIGHT ... (space- or comma-separated; as an LLM keyword also
    a dict or (tenant, weight) pairs) as (tenant, weight) pairs. Raises ConfigError."""
    if isinstance(values, dict):
        values = list(values.items())
    out: list[tuple[str, float]] = []
    for v in [values] if isinstance(values, str) else values:
        if isinstance(v, str):
            out += [_tenant_weight(x) for x in v.replace(",", " ").split()]
        else:
            out.append((str(v[0]), float(v[1])))
    return tuple(out)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load, in what precision, and which path its steps take."""

    model: str | None = flag(None, "HF model folder, .gguf file or hub id", group=G.MODEL,
                             shown="the bundled SmolLM2-135M-Instruct GGUF")
    tokenizer: str | None = flag(None, "tokenizer folder or hub id", group=G.MODEL, shown="the model's")
    dtype: str = flag("auto", "compute dtype; auto = float32 on CPU, half precision on CUDA (half = float16, "
                      "float = float32)", group=G.MODEL,
                      choices=MODEL_DTYPES + tuple(DTYPE_ALIASES), unit=Unit(lambda v: DTYPE_ALIASES.get(v, v)))
    device: str = flag("auto", "auto, cpu or cuda[:N]", group=G.MODEL)
    max_model_len: int | None = flag(None, "longest prompt + output in tokens, e.g. 4096, 4k (4,000) or 4K (4,096)",
                                     group=G.MODEL, type=human_int, shown="the model's context length")
    revision: str | None = flag(None, "hub revision to download", group=G.MODEL)
    download_dir: str | None = flag(None, "where a hub model is downloaded", group=G.MODEL, shown="the HF cache")
    seed: int = flag(0, "seed of the shared sampler generator", group=G.MODEL)
    quantized_matmul: QuantizedMatmul = flag(
        QuantizedMatmul.AUTO, "GGUF block weights on the CPU (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): int8 = "
        "int8 activations (llama.cpp's method, fastest), float32 = exact float32 activations (also widens Q2_K/Q3_K "
        "to float32); auto = int8 where the CPU has AVX2 or AVX-512 VNNI", group=G.MODEL)
    generation_config: str = flag("auto", "default sampling parameters: auto (the model folder's "
                                  "generation_config.json), vllm (none: the API's defaults) or a folder holding a "
                                  "generation_config.json", group=G.MODEL)
    load_format: LoadFormat = flag(LoadFormat.AUTO, "dummy: random weights of the model's shape, no weight files (a "
                                   "config.json folder, a GGUF's header, or a named shape as `hotprefix size` takes, "
                                   "e.g. llama-3.1-8b)", group=G.MODEL)
    attention_backend: AttentionBackend = flag(
        AttentionBackend.AUTO, "how attention reads the paged KV: triton (kernels, CUDA), torch (gather + SDPA), cpu "
        "(C kernels); auto = triton on CUDA when installed, cpu on the CPU", group=G.MODEL)
    enforce_eager: bool = flag(False, "run decode steps eagerly instead of replaying CUDA graphs (triton backend on "
                               "CUDA)", group=G.MODEL, negatable=True, rule=Inert(NO_GRAPHS, on_cpu))
    cuda_graph_sizes: tuple[int, ...] = flag(
        (), "decode batch sizes captured as CUDA graphs (a step pads up to the next one): 1 2 4 8, 1,2,4,8 or "
        "[1, 2, 4]", group=G.MODEL, nargs="+", metavar="N", unit=Unit(_graph_sizes),
        shown="1, 2, 4 and every multiple of 8 up to --max-num-seqs",
        names=("--cuda-graph-sizes", "--cudagraph-capture-sizes"), rule=Inert(NO_GRAPHS, on_cpu))
    tensor_parallel_size: int = flag(
        1, "ranks the model is split over (tensor parallelism: one process per rank, spawned here, or started by "
        "torchrun; gloo on the CPU, NCCL on CUDA; the model's KV heads must divide by it: docs/parallel.md)",
        group=G.MODEL, names=("-tp", "--tensor-parallel-size"))

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
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")

    def context_length(self, model_context: int) -> int:
        """The longest prompt + output served: --max-model-len, else the model's own context."""
        return self.max_model_len or model_context


DISK_STAGING_BYTES = 512 << 20


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the tiers below it. Sizes are bytes here; the flags and LLM
    keywords of swap_space, kv_offloading_size and kv_disk_size take GiB (or "512MiB")."""

    block_size: int = flag(16, "tokens per KV block", group=G.MODEL)
    kv_cache_dtype: str = flag("auto", "KV storage dtype; fp8 halves the memory of fp16", group=G.MODEL,
                               choices=KV_CACHE_DTYPES)
    kv_cache_memory: int | None = flag(None, "bytes of KV cache on CPU, e.g. 2GiB or 2147483648", group=G.MODEL,
                                       names=("--kv-cache-memory", "--kv-cache-memory-bytes"), unit=SIZE,
                                       shown="1GiB")
    gpu_memory_utilization: float = flag(0.9, "share of GPU memory for weights, activations and KV (CUDA only)",
                                         group=G.MODEL,
                                         names=("--gpu-memory-utilization", "--device-memory-utilization"),
                                         rule=Inert("on a CPU the KV pool takes --kv-cache-memory (or what the host's "
                                                    "free memory allows), the weights what they are", on_cpu))
    num_blocks_override: int | None = flag(None, "fix the number of KV blocks (for testing)", group=G.MODEL,
                                           names=("--num-gpu-blocks-override",))
    enable_prefix_caching: bool = flag(True, "share the KV blocks of common prompt prefixes between requests",
                                       group=G.MODEL, negatable=True, inverse=True)
    prefix_caching_hash_algo: str = flag("sha256", "block hash: sha256 (same on every server) or xxhash (faster, "
                                         "seeded per process)", group=G.MODEL, choices=("sha256", "xxhash"))
    max_pinned_fraction: float = flag(0.2, "the most of the KV pool that pinned prefixes may hold", group=G.MODEL)
    kv_cache_groups: bool = flag(
        True, "sliding-window models: split the KV pool into groups by attention kind, the window layers keeping "
        "only their window's blocks (docs/engine.md); --no-kv-cache-groups keeps every block in every layer (at the "
        "all-full layout's bytes)", group=G.MODEL, negatable=True)
    kv_window_retain_interval: int = flag(
        4096, "sliding-window models: keep the window layers' blocks a prefix hit needs every this many tokens "
        "(rounded down to a block; 0: none) besides the end of every prompt and every shared prefix; other "
        "blocks out of the window are reused first (docs/engine.md)", group=G.MODEL)
    swap_space: int = flag(4 << 30, "GiB of host memory for --preemption-mode swap (allocated only in that mode)",
                           group=G.MODEL, unit=GIB,
                           rule=Inert("host memory for --preemption-mode swap only: the default, recompute, "
                                      "allocates none", lambda cfg, _cpu: cfg.scheduler.preemption_mode
                                      is PreemptionMode.RECOMPUTE))
    kv_offloading_size: int = flag(0, "GiB of host memory for a KV tier below the pool: evicted blocks go there; "
                                   "0 = off", group=G.MODEL, unit=GIB)
    kv_disk_dir: str | None = flag(None, "a directory for a disk KV tier: computed blocks are written behind, and a "
                                   "restarted server finds them", group=G.MODEL, shown="off")
    kv_disk_size: int = flag(16 << 30, "GiB the disk KV tier may take", group=G.MODEL, unit=GIB)
    kv_disk_write: DiskWritePolicy = flag(DiskWritePolicy.ALL, "which blocks the disk KV tier writes: all computed "
                                          "ones (a prefix seen once survives a restart), or only those hit again "
                                          "(no cost on traffic that shares nothing)", group=G.MODEL)
    kv_disk_insecure: bool = flag(False, "use a --kv-disk-dir that other users may write or own (refused otherwise: "
                                  "its files become other requests' KV)", group=G.MODEL)
    kv_events: KVEventsConfig = flag(
        KVEventsConfig(), "publish what enters and leaves the KV cache as vLLM does, for KV-aware routers (llm-d, "
        "Dynamo): a JSON object with vLLM's keys, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv@POD@MODEL\"}' (docs/deploy.md)",
        group=G.MODEL, names=("--kv-events-config",), unit=Unit(KVEventsConfig.parse), metavar="JSON", shown="off")

    @property
    def host_tier_bytes(self) -> int:
        """The host tier's size: --kv-offloading-size, or DISK_STAGING_BYTES when only
        the disk tier is on (disk reads land in host memory before the pool)."""
        return self.kv_offloading_size or (DISK_STAGING_BYTES if self.kv_disk_dir else 0)

    def __post_init__(self) -> None:
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.kv_window_retain_interval < 0:
            raise ConfigError(f"--kv-window-retain-interval must be >= 0, got {self.kv_window_retain_interval}")
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
    """How many requests and tokens one engine step may take, in what order, and what
    happens when KV blocks run out. Without chunked prefill a prompt (or a preempted
    prompt with its output) must fit one step whole (see `resolved`). How many requests
    may wait is the server's admission limit (AdmissionConfig), not the scheduler's."""

    max_num_seqs: int = flag(64, "most requests running in one step", group=G.SCHEDULER)
    max_num_batched_tokens: int | None = flag(
        None, "token budget of one step", group=G.SCHEDULER,
        shown=f"{DEFAULT_BATCHED_TOKENS}; without chunked prefill max({DEFAULT_BATCHED_TOKENS}, --max-model-len)")
    enable_chunked_prefill: bool = flag(True, "split long prompts over several steps within the token budget",
                                        group=G.SCHEDULER, negatable=True, inverse=True)
    scheduling_policy: SchedulingPolicy = flag(SchedulingPolicy.FCFS, "fcfs: arrival order; priority: lowest request "
                                               "`priority` first, ties by arrival", group=G.SCHEDULER)
    long_prefill_token_threshold: int = flag(0, "if > 0, the most tokens one request computes in a step (long "
                                             "prompts cannot crowd out decodes; needs chunked prefill)",
                                             group=G.SCHEDULER)
    preemption_mode: PreemptionMode = flag(PreemptionMode.RECOMPUTE, "when KV runs out: free a request and "
                                           "recompute it later, or swap its KV to host memory", group=G.SCHEDULER)
    tenant_weights: tuple[tuple[str, float], ...] = flag(
        (), "a tenant's weight in each step's fair share of tokens and seats (others weigh 1): TENANT=WEIGHT, "
        "TENANT being a gateway tenant's cache salt or a direct client's ip:ADDRESS", group=G.SCHEDULER,
        names=("--tenant-weight",), nargs="+", metavar="TENANT=WEIGHT", unit=Unit(_tenant_weights), shown="1 each")
    speculative_config: SpeculativeConfig | None = flag(
        None, "speculative decoding without a draft model, as vLLM's JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}: drafts from the "
        "request's own tokens (method suffix: also earlier requests' of the same cache scope), verified in one "
        "pass; the same tokens as without", group=G.SCHEDULER, names=("--speculative-config", "-sc"),
        unit=SPECULATIVE, shown="off")

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
        object.__setattr__(self, "tenant_weights", tuple(self.tenant_weights))
        bad = next((w for _, w in self.tenant_weights if not 0.01 <= w <= 100), None)
        if bad is not None:
            raise ConfigError(f"--tenant-weight: a weight must be in [0.01, 100], got {bad}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

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
    """Output constraints (JSON schema, regex, choice, grammars; tools' calls): the size a
    request's may have (grammar_limits.GrammarLimits), each refused with a 400 naming it;
    and the CPU seconds compiling one may take (grammar_sandbox.py)."""

    max_grammar_bytes: int = flag(128 << 10, "a constraint's size in bytes", group=G.STRUCTURED)
    max_grammar_properties: int = flag(5_000, "object properties in a JSON schema", group=G.STRUCTURED)
    max_grammar_enum_values: int = flag(1_000, "enum and const values in a JSON schema", group=G.STRUCTURED)
    max_grammar_depth: int = flag(32, "nesting of a JSON schema", group=G.STRUCTURED)
    max_grammar_repeat: int = flag(10_000, "the product of nested counted repetitions ({n}) in a regex or schema "
                                   "pattern", group=G.STRUCTURED)
    max_grammar_compile_seconds: float = flag(5.0, "CPU seconds compiling one constraint may take, in a worker "
                                              "process that is killed when it runs over (0: compile in the server's "
                                              "process, where nothing can stop it)", group=G.STRUCTURED)

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
