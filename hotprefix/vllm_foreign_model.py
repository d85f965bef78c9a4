"""vLLM's `serve` flags about the model, its loading, its KV cache, its kernels and its
scheduler that have no counterpart here (see vllm_foreign.py for the rules)."""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.vllm_foreign import (
    EMPTY,
    GENERATES,
    KERNELS,
    LOADING,
    NO_OFFLOAD,
    NO_SLEEP,
    NO_SSM,
    OFF,
    ONE_PROCESS,
    SCHEDULER,
    TEXT_ONLY,
    check_given,
    no_effect,
    one_of,
    refused,
    value,
)

OWN_CONFIG = "the model's own config is read as it is (its config.json, or a GGUF's header)"


@dataclass(frozen=True)
class ModelFlags:
    """What model runs, and how its answers are made."""

    trust_remote_code: bool | None = no_effect("hotprefix runs no code from a model repository: it implements the "
                                               "architectures it loads (Llama-family) itself")
    code_revision: str | None = value("hotprefix runs no code from a model repository")
    tokenizer_mode: str | None = refused("mistral's own tokenizer format (tekken) is not supported; its tokens would "
                                         "differ", harmless=one_of("auto", "hf", "slow"),
                                         reason="the model's fast tokenizer is used (the same tokens as the slow one)")
    tokenizer_revision: str | None = refused("the tokenizer is read with the model (at --revision), or from "
                                             "--tokenizer", harmless=EMPTY)
    skip_tokenizer_init: bool | None = refused("the server detokenizes: its answers are text", takes_value=False,
                                               harmless=OFF)
    quantization: str | None = refused("only GGUF block weights and unquantized safetensors are loaded; another "
                                       "method would serve other weights than the ones asked for", "-q",
                                       "--quantization", harmless=one_of("gguf", "none"),
                                       reason="the weights' format is read from the file (a GGUF's block types)")
    quantization_config: str | None = refused("the weights' format is read from the file", harmless=EMPTY)
    allow_deprecated_quantization: bool | None = no_effect("the weights' format is read from the file")
    config_format: str | None = refused(OWN_CONFIG, harmless=one_of("auto", "hf"))
    hf_config_path: str | None = refused(OWN_CONFIG, harmless=EMPTY)
    hf_overrides: str | None = refused(OWN_CONFIG + ": overrides would change the model", harmless=EMPTY)
    hf_token: str | None = value("a hub download reads HF_TOKEN from the environment")
    model_impl: str | None = value("hotprefix runs its own implementation of each architecture")
    model_class_overrides: str | None = refused("each architecture's implementation is hotprefix's own",
                                                harmless=EMPTY)
    convert: str | None = refused(GENERATES, harmless=one_of("auto", "none"))
    runner: str | None = refused(GENERATES, harmless=one_of("auto", "generate"))
    pooler_config: str | None = refused(GENERATES, harmless=EMPTY)
    diffusion_config: str | None = refused(GENERATES, "-dc", "--diffusion-config", harmless=EMPTY)
    io_processor_plugin: str | None = refused("no plugin is loaded: requests and answers are OpenAI's",
                                              harmless=EMPTY)
    logits_processors: str | None = refused("custom logits processors are not loaded: they would change the tokens",
                                            harmless=EMPTY)
    logprobs_mode: str | None = refused("logprobs are the model's raw log-probabilities",
                                        harmless=one_of("raw_logprobs"))
    override_generation_config: str | None = refused("default sampling parameters come from --generation-config "
                                                     "(auto, vllm or a folder)", harmless=EMPTY)
    watermark_config: str | None = refused("no watermark is put into the outputs", harmless=EMPTY)
    disable_sliding_window: bool | None = refused("sliding-window layers attend within their window here",
                                                  takes_value=False, harmless=OFF)
    disable_cascade_attn: bool | None = no_effect("shared-prefix cascades are used where they give the same bits")
    return_sampling_mask: bool | None = no_effect("no sampling masks are returned")
    use_fp64_gumbel: bool | None = no_effect("the sampler draws in its own way (its seeds are hotprefix's)")
    enable_sleep_mode: bool | None = no_effect(NO_SLEEP)
    sleep_mode_backend: str | None = value(NO_SLEEP)
    sleep_mode_offload_cudagraph: bool | None = no_effect(NO_SLEEP)
    sleep_preserve_parameter_names: str | None = value(NO_SLEEP)
    weight_transfer_config: str | None = value("the weights are loaded once, from the model's files")
    renderer_num_workers: str | None = value("chat templates are rendered by the preprocessing worker threads")
    reasoning_config: str | None = value("no model served here reasons before answering")
    engram_config: str | None = value("a model feature of architectures not served here")
    additional_config: str | None = value("vLLM platform settings (hotprefix has no platform plugins)")
    aux_output_config: str | None = value("no auxiliary outputs are returned")
    enable_trace_replay: bool | None = no_effect("no trace replay")
    watchdog_config: str | None = value("the engine thread's health is /health (503 once it stopped)")
    fail_on_environ_validation: bool | None = no_effect("there is no vLLM environment to validate")

    def __post_init__(self) -> None:
        check_given(self)


@dataclass(frozen=True)
class RuntimeFlags:
    """Loading, offloading, the KV cache's options, the kernels and the scheduler."""

    ignore_patterns: str | None = value(LOADING)
    model_loader_extra_config: str | None = value(LOADING)
    pt_load_map_location: str | None = value(LOADING)
    safetensors_load_strategy: str | None = value(LOADING)
    safetensors_prefetch_block_size: str | None = value(LOADING)
    safetensors_prefetch_num_threads: str | None = value(LOADING)
    use_tqdm_on_load: bool | None = no_effect(LOADING)
    cpu_offload_gb: str | None = value(NO_OFFLOAD)
    cpu_offload_params: str | None = value(NO_OFFLOAD)
    offload_backend: str | None = value(NO_OFFLOAD)
    offload_group_size: str | None = value(NO_OFFLOAD)
    offload_num_in_group: str | None = value(NO_OFFLOAD)
    offload_params: str | None = value(NO_OFFLOAD)
    offload_prefetch_step: str | None = value(NO_OFFLOAD)
    calculate_kv_scales: bool | None = no_effect("fp8 KV is stored with a fixed scale here (--kv-cache-dtype fp8); "
                                                 "there are no per-layer scales to calculate")
    kv_cache_dtype_skip_layers: str | None = refused("every layer's KV is stored as --kv-cache-dtype says",
                                                     harmless=EMPTY)
    kv_transfer_config: str | None = refused("KV transfer between servers (disaggregated prefill) is not supported: "
                                             "each server computes its own", harmless=EMPTY)
    kv_offloading_backend: str | None = value("the host tier below the pool is hotprefix's own (--kv-offloading-size)")
    kv_sharing_fast_prefill: bool | None = no_effect("no layer here reads another layer's KV")
    prefix_cache_retention_interval: str | None = value("cached blocks stay until the pool needs them, the least "
                                                        "recently used first (/pin keeps a prefix)")
    prefix_match_unit: str | None = value("prefixes are matched by whole blocks (--block-size)")
    enable_mamba_cache_stochastic_rounding: bool | None = no_effect(NO_SSM)
    enable_mamba_shared_prefix_checkpoint: bool | None = no_effect(NO_SSM)
    mamba_backend: str | None = value(NO_SSM)
    mamba_block_size: str | None = value(NO_SSM)
    mamba_cache_dtype: str | None = value(NO_SSM)
    mamba_cache_mode: str | None = value(NO_SSM)
    mamba_cache_philox_rounds: str | None = value(NO_SSM)
    mamba_ssm_cache_dtype: str | None = value(NO_SSM)
    mamba_ssu_algorithm: str | None = value(NO_SSM)
    use_replayssm: bool | None = no_effect(NO_SSM)
    replayssm_buffer_len: str | None = value(NO_SSM)
    swa_bounded_replay: bool | None = no_effect(NO_SSM)
    gdn_prefill_backend: str | None = value(NO_SSM)
    kda_decode_backend: str | None = value(NO_SSM)
    kda_prefill_backend: str | None = value(NO_SSM)
    compilation_config: str | None = value("hotprefix does not use torch.compile (its CPU kernels are compiled C, "
                                           "built once)", "-O", "-cc", "--compilation-config")
    optimization_level: str | None = value(KERNELS)
    performance_mode: str | None = value(KERNELS)
    kernel_config: str | None = value(KERNELS)
    ir_op_priority: str | None = value(KERNELS)
    linear_backend: str | None = value(KERNELS)
    sparse_indexer_topk_backend: str | None = value(KERNELS)
    attention_config: str | None = value(KERNELS + " (--attention-backend picks one)", "-ac", "--attention-config")
    enable_flashinfer_autotune: bool | None = no_effect(KERNELS)
    monokernel: bool | None = no_effect(KERNELS)
    enable_cumem_allocator: bool | None = no_effect(KERNELS)
    enable_nccl_comm_suspend: bool | None = no_effect(ONE_PROCESS)
    max_cudagraph_capture_size: str | None = value("the sizes captured are --cuda-graph-sizes' (on CUDA)")
    async_scheduling: bool | None = no_effect(SCHEDULER)
    max_num_active_seqs: str | None = value(SCHEDULER)
    max_num_scheduled_tokens: str | None = value(SCHEDULER)
    max_num_queued_tokens: str | None = value("the queue is bounded in sequences (--max-num-queued-requests)")
    long_prefill_token_threshold_adaptive: bool | None = no_effect(SCHEDULER)
    prefill_schedule_interval: str | None = value(SCHEDULER)
    scheduler_reserve_full_isl: bool | None = no_effect(SCHEDULER)
    watermark: str | None = value(SCHEDULER)
    scheduler_cls: str | None = refused("the scheduler is hotprefix's own", harmless=EMPTY)
    stream_interval: str | None = value("every step's new tokens are streamed as they come")
    disable_chunked_mm_input: bool | None = no_effect(TEXT_ONLY)
    disable_hybrid_kv_cache_manager: bool | None = no_effect("one KV cache manager serves every layer")

    def __post_init__(self) -> None:
        check_given(self)
