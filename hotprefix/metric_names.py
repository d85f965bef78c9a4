"""Prometheus metric names, shared by the exporter (server/metrics.py) and `hotprefix watch`.

Names follow vLLM V1's; hotprefix exports them under `hotprefix:`, vLLM under `vllm:`.
"""

PREFIX = "hotprefix:"
PEER_PREFIXES = ("hotprefix:", "vllm:")

RUNNING = "num_requests_running"
WAITING = "num_requests_waiting"
SWAPPED = "num_requests_swapped"
KV_USAGE = "kv_cache_usage_perc"
KV_USAGE_LEGACY = "gpu_cache_usage_perc"  # vLLM before V1
PREEMPTIONS = "num_preemptions"
PREFIX_QUERIES = "prefix_cache_queries"
PREFIX_HITS = "prefix_cache_hits"
PREFIX_EVICTED = "prefix_cache_evicted_blocks"
PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
CACHED_PROMPT_TOKENS = "prompt_tokens_cached"
CACHED_BY_SOURCE = "prompt_tokens_cached_by_source"  # vLLM's name; label source = device | host | disk
KV_TIER_BLOCKS = "kv_tier_blocks"  # hotprefix: blocks a tier holds now (label tier = host | disk)
KV_TIER_CAPACITY = "kv_tier_capacity_blocks"
KV_TIER_MOVED_BLOCKS = "kv_tier_moved_blocks"  # counter, label direction
KV_TIER_MOVED_BYTES = "kv_tier_moved_bytes"
KV_TIER_BAD_FILES = "kv_tier_bad_files"
REQUEST_SUCCESS = "request_success"
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
E2E = "e2e_request_latency_seconds"
QUEUE_TIME = "request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "request_generation_tokens"
CACHE_CONFIG_INFO = "cache_config_info"
REQUEST_REJECTIONS = "request_rejections"  # hotprefix only: refused before the engine, by reason
PREFIX_HIT_RATE_LEGACY = "gpu_prefix_cache_hit_rate"  # vLLM before V1: hits / queries, in tokens
TPOT_LEGACY = "time_per_output_token_seconds"  # vLLM's older name of ITL (the same observations)
ITERATION_TOKENS = "iteration_tokens_total"  # histogram: tokens run through the model in one step
PREFILL_TIME = "request_prefill_time_seconds"  # first scheduled -> first token
DECODE_TIME = "request_decode_time_seconds"  # first token -> finished
INFERENCE_TIME = "request_inference_time_seconds"  # first scheduled -> finished
SPEC_DRAFTS = "spec_decode_num_drafts"  # vLLM's speculative decoding counters (only with --speculative-config)
SPEC_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # label position = 0 .. k - 1
PARAMS_N = "request_params_n"
PARAMS_MAX_TOKENS = "request_params_max_tokens"
