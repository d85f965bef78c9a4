"""vLLM's `serve` flags that have no counterpart here, declared once (as every flag is,
hotprefix/flags.py) in groups that vllm_flags.ForeignFlags composes.

Each is accepted (by `hotprefix serve` and `LLM()`) and named at start-up with why it
changes nothing on this engine; where ignoring a value would change the answers (a LoRA
adapter, a second engine, a reasoning parser, a custom logits processor), any value but
the harmless ones is refused with why. A switch takes vLLM's spellings of both states
(--X / --no-X, and 0.33's --enable-X / --disable-X). tests/e2e/vllm_serve_flags.txt is
vLLM's whole list; tests/e2e/test_vllm_flags.py walks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotprefix.flags import ConfigError, Declared, FlagGroup, declared, flag


@dataclass(frozen=True)
class NoEffect:
    """Why a vLLM flag changes nothing here (logged at start when given); harmless: the
    values that change nothing (None: every value; a switch's are "True" and "False");
    refuse: why any other value is refused."""

    reason: str
    harmless: Callable[[str], bool] | None = None
    refuse: str = ""


def no_effect(reason: str, names: tuple[str, ...] = (), takes_value: bool = False,
              harmless: Callable[[str], bool] | None = None, refuse: str = "") -> Any:
    """A foreign flag: a switch (None: not given; True / False: given on / off), or a flag
    that takes one value (None: not given)."""
    return flag(None, f"vLLM's; {reason or refuse}", group=FlagGroup.FOREIGN, names=names,
                metavar="VALUE" if takes_value else None, shown="", negatable=not takes_value,
                inverse=not takes_value, rule=NoEffect(reason, harmless, refuse))


def value(reason: str, *names: str) -> Any:
    """A foreign flag that takes a value, every value harmless."""
    return no_effect(reason, names, takes_value=True)


def refused(why: str, *names: str, takes_value: bool = True, harmless: Callable[[str], bool] = lambda v: False,
            reason: str = "") -> Any:
    """A foreign flag refused (with why) but for its harmless values (a switch: "False")."""
    return no_effect(reason, names, takes_value, harmless, why)


def one_of(*values: str) -> Callable[[str], bool]:
    return lambda v: v.strip().strip("'\"").lower() in values


EMPTY = one_of("", "{}", "[]", "none", "null")
OFF = one_of("false")
ONE = one_of("1")

ONE_ENGINE = ("hotprefix runs one engine per device; run one server per device behind `hotprefix gateway` "
              "instead")
NO_PROMPT_LOGS = ("hotprefix logs no prompt or output to its log; --request-log writes one line per finished "
                  "request (prompt text only with --request-log-prompts)")
ONE_PROCESS = ("the engine runs in this process on one device: no workers, executor, communicator, node or NUMA "
               "placement to set up")
NO_DP = "no data-parallel group: this server is one engine (put several behind `hotprefix gateway`)"
NO_MOE = "the models served here have no experts (no MoE layers to place, balance or overlap)"
NO_CP = "no context parallelism: one engine holds each sequence's whole context"
NO_LORA = "no LoRA adapter is loaded (--lora-modules is refused)"
TEXT_ONLY = ("the models served here take text only: no image, audio or video to process (requests with them "
             "are refused)")
NO_SPEC = "speculation is configured by --speculative-config's JSON here (ngram or suffix drafts, no draft model)"
KERNELS = ("vLLM's kernel, compilation and backend choices do not apply: hotprefix runs its own kernels (C on the "
           "CPU, Triton on CUDA)")
NO_SSM = "the models served here have no state-space (Mamba) or linear-attention (GDN, KDA) layers"
NO_SLEEP = "no sleep mode: the model stays loaded"
LOADING = ("the weights are read from the model's files as they are (a GGUF mapped, safetensors loaded): no "
           "loader options")
NO_OFFLOAD = "no weight offloading: the weights stay where the model runs (on a CPU, in host memory already)"
SCHEDULER = ("hotprefix's scheduler has no such setting (--max-num-seqs, --max-num-batched-tokens, "
             "--enable-chunked-prefill, --long-prefill-token-threshold set it)")
GENERATES = "this server generates text: pooling, embedding, classification and other runners are not served"


def check_given(group: Any) -> None:
    """Raise ConfigError for a given value of a group's flag that would change results."""
    for d, given, rule in given_flags(group):
        if rule.harmless is not None and not rule.harmless(str(given)):
            raise ConfigError(f"{d.names[-1]}{'' if given is True else f' {given}'}: {rule.refuse}")


def given_flags(group: Any) -> list[tuple[Declared, Any, NoEffect]]:
    """The flags of one group that were given: (declaration, value, why)."""
    return [(d, getattr(group, d.name), d.flag.rule) for d in declared(type(group))
            if getattr(group, d.name) is not None]


@dataclass(frozen=True)
class ParallelFlags:
    """Several engines, processes, nodes or devices: one engine runs here."""

    pipeline_parallel_size: str | None = refused(ONE_ENGINE, "-pp", "--pipeline-parallel-size", harmless=ONE,
                                                 reason="one pipeline stage: the whole model runs in one engine")
    data_parallel_size: str | None = refused(ONE_ENGINE, "-dp", "--data-parallel-size", harmless=ONE, reason=NO_DP)
    data_parallel_size_local: str | None = refused(ONE_ENGINE, "-dpl", "--data-parallel-size-local",
                                                   harmless=one_of("1", "none"), reason=NO_DP)
    data_parallel_rank: str | None = value(NO_DP, "-dpn", "--data-parallel-rank")
    data_parallel_start_rank: str | None = value(NO_DP, "-dpr", "--data-parallel-start-rank")
    data_parallel_address: str | None = value(NO_DP, "-dpa", "--data-parallel-address")
    data_parallel_rpc_port: str | None = value(NO_DP, "-dpp", "--data-parallel-rpc-port")
    data_parallel_backend: str | None = value(NO_DP, "-dpb", "--data-parallel-backend")
    data_parallel_external_lb: bool | None = no_effect(NO_DP, ("-dpe", "--data-parallel-external-lb"))
    data_parallel_hybrid_lb: bool | None = no_effect(NO_DP, ("-dph", "--data-parallel-hybrid-lb"))
    data_parallel_multi_port_external_lb: bool | None = no_effect(NO_DP, ("-dpm",
                                                                         "--data-parallel-multi-port-external-lb"))
    data_parallel_supervisor_port: str | None = value(NO_DP)
    dp_supervisor_probe_failure_threshold: str | None = value(NO_DP)
    dp_supervisor_probe_interval_s: str | None = value(NO_DP)
    dp_supervisor_probe_timeout_s: str | None = value(NO_DP)
    dp_sync_interval: str | None = value(NO_DP)
    disable_nccl_for_dp_synchronization: bool | None = no_effect(NO_DP)
    aggregate_engine_logging: bool | None = no_effect(NO_DP)
    headless: bool | None = refused("a headless engine serves no API; this server is one engine and its API",
                                    takes_value=False, harmless=OFF)
    api_server_count: str | None = value("one HTTP server process (tokenizing and chat templates run in worker "
                                         "threads)", "-asc", "--api-server-count")
    nnodes: str | None = refused(ONE_ENGINE, "-n", "--nnodes", harmless=ONE, reason=ONE_PROCESS)
    node_rank: str | None = refused(ONE_ENGINE, "-r", "--node-rank", harmless=one_of("0"), reason=ONE_PROCESS)
    master_addr: str | None = value(ONE_PROCESS)
    master_port: str | None = value(ONE_PROCESS)
    distributed_executor_backend: str | None = value(ONE_PROCESS)
    distributed_timeout_seconds: str | None = value(ONE_PROCESS)
    cpu_distributed_timeout_seconds: str | None = value(ONE_PROCESS)
    worker_cls: str | None = value(ONE_PROCESS)
    worker_extension_cls: str | None = value(ONE_PROCESS)
    ray_workers_use_nsight: bool | None = no_effect(ONE_PROCESS)
    device_ids: str | None = value(ONE_PROCESS + " (--device picks it)")
    numa_bind: bool | None = no_effect(ONE_PROCESS)
    numa_bind_cpus: str | None = value(ONE_PROCESS)
    numa_bind_nodes: str | None = value(ONE_PROCESS)
    max_parallel_loading_workers: str | None = value(ONE_PROCESS)
    enable_shm_tensor_arena: bool | None = no_effect(ONE_PROCESS)
    disable_custom_all_reduce: bool | None = no_effect(ONE_PROCESS)
    all2all_backend: str | None = value(ONE_PROCESS)
    enable_batch_sharded_sampling: bool | None = no_effect(ONE_PROCESS)
    enable_fault_tolerance: bool | None = no_effect(ONE_PROCESS)
    fault_tolerance_config: str | None = value(ONE_PROCESS)
    decode_context_parallel_size: str | None = refused(ONE_ENGINE, "-dcp", "--decode-context-parallel-size",
                                                       harmless=ONE, reason=NO_CP)
    prefill_context_parallel_size: str | None = refused(ONE_ENGINE, "-pcp", "--prefill-context-parallel-size",
                                                        harmless=ONE, reason=NO_CP)
    dcp_kv_cache_interleave_size: str | None = value(NO_CP)
    cp_kv_cache_interleave_size: str | None = value(NO_CP)
    dcp_comm_backend: str | None = value(NO_CP)
    dcp_q_replicate: bool | None = no_effect(NO_CP)

    def __post_init__(self) -> None:
        check_given(self)


@dataclass(frozen=True)
class ExpertFlags:
    """Mixture-of-experts placement and overlap."""

    enable_expert_parallel: bool | None = no_effect(NO_MOE, ("-ep", "--enable-expert-parallel"))
    enable_eplb: bool | None = no_effect(NO_MOE)
    eplb_config: str | None = value(NO_MOE)
    expert_placement_strategy: str | None = value(NO_MOE)
    enable_elastic_ep: bool | None = no_effect(NO_MOE)
    elastic_ep_max_dp_size: str | None = value(NO_MOE)
    enable_ep_weight_filter: bool | None = no_effect(NO_MOE)
    enable_dbo: bool | None = no_effect(NO_MOE)
    dbo_decode_token_threshold: str | None = value(NO_MOE)
    dbo_prefill_token_threshold: str | None = value(NO_MOE)
    ubatch_size: str | None = value(NO_MOE)
    enable_hc_sp: bool | None = no_effect(NO_MOE)
    moe_backend: str | None = value(NO_MOE)
    enable_return_routed_experts: bool | None = no_effect(NO_MOE)
    enable_moe_shared_loras: bool | None = no_effect(NO_MOE)
    enable_mixed_moe_lora_format: bool | None = no_effect(NO_MOE)

    def __post_init__(self) -> None:
        check_given(self)


@dataclass(frozen=True)
class AdapterFlags:
    """LoRA adapters, vLLM's other speculation flags, and inputs other than text."""

    enable_lora: bool | None = no_effect(NO_LORA)
    lora_modules: str | None = refused("LoRA adapters are not supported: answers would come from the base model "
                                       "alone")
    max_loras: str | None = value(NO_LORA)
    max_lora_rank: str | None = value(NO_LORA)
    max_cpu_loras: str | None = value(NO_LORA)
    lora_dtype: str | None = value(NO_LORA)
    lora_target_modules: str | None = value(NO_LORA)
    max_lora_cls_labels: str | None = value(NO_LORA)
    default_mm_loras: str | None = value(NO_LORA)
    fully_sharded_loras: bool | None = no_effect(NO_LORA)
    enable_tower_connector_lora: bool | None = no_effect(NO_LORA)
    specialize_active_lora: bool | None = no_effect(NO_LORA)
    spec_method: str | None = value(NO_SPEC)
    spec_model: str | None = value(NO_SPEC)
    spec_tokens: str | None = value(NO_SPEC)
    per_request_spec_decode_metrics: str | None = value(NO_SPEC)
    allowed_local_media_path: str | None = value(TEXT_ONLY)
    allowed_media_domains: str | None = value(TEXT_ONLY)
    limit_mm_per_prompt: str | None = value(TEXT_ONLY)
    media_io_kwargs: str | None = value(TEXT_ONLY)
    mm_processor_kwargs: str | None = value(TEXT_ONLY)
    mm_processor_cache_gb: str | None = value(TEXT_ONLY)
    mm_processor_cache_type: str | None = value(TEXT_ONLY)
    mm_processor_device: str | None = value(TEXT_ONLY)
    mm_shm_cache_max_object_size_mb: str | None = value(TEXT_ONLY)
    mm_tensor_ipc: str | None = value(TEXT_ONLY)
    mm_hasher_algorithm: str | None = value(TEXT_ONLY)
    mm_ipc_gpu_memory_gb: str | None = value(TEXT_ONLY)
    mm_encoder_only: bool | None = no_effect(TEXT_ONLY)
    mm_encoder_tp_mode: str | None = value(TEXT_ONLY)
    mm_encoder_attn_backend: str | None = value(TEXT_ONLY)
    mm_encoder_attn_dtype: str | None = value(TEXT_ONLY)
    mm_encoder_fp8_scale_path: str | None = value(TEXT_ONLY)
    mm_encoder_fp8_scale_save_path: str | None = value(TEXT_ONLY)
    mm_encoder_fp8_scale_save_margin: str | None = value(TEXT_ONLY)
    mm_device_do_normalize: bool | None = no_effect(TEXT_ONLY)
    interleave_mm_strings: bool | None = no_effect(TEXT_ONLY)
    language_model_only: bool | None = no_effect(TEXT_ONLY)
    skip_mm_profiling: bool | None = no_effect(TEXT_ONLY)
    enable_mm_embeds: bool | None = no_effect(TEXT_ONLY)
    trust_request_mm_kwargs: bool | None = no_effect(TEXT_ONLY)
    video_pruning_method: str | None = value(TEXT_ONLY)
    video_pruning_rate: str | None = value(TEXT_ONLY)
    ec_manager_config: str | None = value(TEXT_ONLY + " (no encoder cache)")
    ec_transfer_config: str | None = value(TEXT_ONLY + " (no encoder cache)")
    enable_prompt_embeds: bool | None = no_effect("prompts are text or token ids (embeddings are refused)")

    def __post_init__(self) -> None:
        check_given(self)
