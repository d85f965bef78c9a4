"""`hotprefix size` against numbers worked out by hand from published configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hotprefix.model.arch import arch_from_hf_config
from hotprefix.model.presets import PRESETS
from hotprefix.sizing import size_report
from hotprefix.tools.size import load_shape

# The published config.json contents (the fields that decide the KV size, verbatim).
CONFIGS = {
    "Llama-3.1-8B": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                     "vocab_size": 128256, "max_position_embeddings": 131072},
    "Llama-3.1-70B": {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
                      "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
                      "vocab_size": 128256, "max_position_embeddings": 131072},
    "Mistral-7B-v0.3": {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                        "vocab_size": 32768, "max_position_embeddings": 32768, "head_dim": None},
    "Qwen2.5-7B": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                   "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "max_position_embeddings": 131072},
    "Qwen3-32B": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
                  "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 151936, "max_position_embeddings": 40960},
}
# By hand: 2 (K and V) x layers x KV heads x head_dim x bytes per element.
FP16_BYTES_PER_TOKEN = {
    "Llama-3.1-8B": 2 * 32 * 8 * 128 * 2,     # 131,072
    "Llama-3.1-70B": 2 * 80 * 8 * 128 * 2,    # 327,680
    "Mistral-7B-v0.3": 2 * 32 * 8 * 128 * 2,  # 131,072
    "Qwen2.5-7B": 2 * 28 * 4 * 128 * 2,       # 57,344 (head_dim = 3584 / 28 = 128)
    "Qwen3-32B": 2 * 64 * 8 * 128 * 2,        # 262,144 (head_dim 128 from the config, not 5120 / 64 = 80)
}
WRITTEN_OUT = {"Llama-3.1-8B": 131_072, "Llama-3.1-70B": 327_680, "Mistral-7B-v0.3": 131_072,
               "Qwen2.5-7B": 57_344, "Qwen3-32B": 262_144}
DTYPE_FACTOR = {"fp32": 2.0, "fp16": 1.0, "bf16": 1.0, "fp8": 0.5}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", sorted(DTYPE_FACTOR))
def test_bytes_per_token_block_and_prompt(name, dtype):
    assert FP16_BYTES_PER_TOKEN[name] == WRITTEN_OUT[name]
    shape = arch_from_hf_config(CONFIGS[name]).shape
    r = size_report(shape, dtype, block_size=16, prompt_tokens=1000, num_prompts=20)
    expect = int(WRITTEN_OUT[name] * DTYPE_FACTOR[dtype])
    assert r.bytes_per_token == expect
    assert r.bytes_per_block == 16 * expect
    assert r.blocks_per_prompt == 63  # ceil(1000 / 16)
    assert r.bytes_per_prompt == 63 * 16 * expect
    assert r.pool_bytes == 20 * 63 * 16 * expect


def test_budget_fit_and_concurrency_llama_8b_fp16_on_80gib():
    shape = arch_from_hf_config(CONFIGS["Llama-3.1-8B"]).shape
    weights = 16_060_522_496  # 8,030,261,248 params x 2 bytes
    assert shape.num_params() * 2 == weights
    budget = int(80 * 2**30 * 0.9) - weights  # 77,309,411,328 - 16,060,522,496 = 61,248,888,832
    assert budget == 61_248_888_832
    r = size_report(shape, "fp16", 16, prompt_tokens=2000, num_prompts=20, concurrency=32, max_model_len=8192,
                    budget_bytes=budget)
    assert r.blocks_in_budget == 29_205  # 61,248,888,832 // 2,097,152
    assert r.pool_blocks == 20 * 125 == 2500
    assert r.private_blocks_per_request == 512 - 125  # 8192 / 16 blocks, 125 of them shared
    assert r.blocks_needed == 2500 + 32 * 387 == 14_884
    assert r.fits_without_eviction is True
    assert r.max_concurrency == 69  # (29,205 - 2,500) // 387
    assert r.max_concurrency_unshared == 57  # 29,205 // 512
    tight = size_report(shape, "fp16", 16, 2000, 20, 80, 8192, budget)
    assert tight.fits_without_eviction is False


def test_sources_preset_config_folder_and_gguf(tmp_path):
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(CONFIGS["Qwen3-32B"]))
    assert load_shape(str(cfg))[1] == load_shape(str(cfg.parent))[1] == load_shape("qwen3-32b")[1]
    from hotprefix.model.loader import default_model_path

    name, gguf_shape = load_shape(str(default_model_path()))
    assert gguf_shape.kv == load_shape(None)[1].kv  # the GGUF metadata agrees with the preset
    assert gguf_shape.kv.bytes_per_token("fp16") == 23_040


def test_cli_table_json_and_errors():
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "llama-3.1-70b", "--dtype", "fp8", "--json",
                        "--memory", "160GiB", "--concurrency", "4", "--max-model-len", "32768"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)["reports"][0]
    assert rep["bytes_per_token"] == 327_680 // 2 and rep["dtype"] == "fp8"
    t = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "mistral-7b"], capture_output=True, text=True)
    assert "bytes per token" in t.stdout and "131,072" in t.stdout
    bad = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "no-such-model"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("hotprefix: error: not a preset")


def test_serve_spelling_of_the_flags_and_the_same_parser_as_serve(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "llama-3.1-8b", "--kv-cache-dtype", "bfloat16",
                        "--kv-cache-dtype", "fp8", "--kv-cache-memory", "80GiB", "--gpu-memory-utilization", "0.5",
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    reps = json.loads(r.stdout)["reports"]
    assert [x["dtype"] for x in reps] == ["bfloat16", "fp8"] and reps[0]["bytes_per_token"] == 131_072
    cfg = tmp_path / "config.json"  # serve refuses this architecture: so does size
    cfg.write_text(json.dumps({**CONFIGS["Llama-3.1-8B"], "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    bad = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", str(cfg)], capture_output=True, text=True)
    assert bad.returncode == 2 and "unsupported architecture" in bad.stderr


def test_gemma3_kv_groups_and_a_32k_sequence_by_hand():
    """Gemma 3 4B's layers in KV groups (vLLM's uniform pages): 5 global layers, 29 local in
    six groups of 5 (the last padded); a 32,768-token sequence holds, in bfloat16 (2 x 5
    layers x 4 KV heads x 256 x 2 bytes = 20,480 bytes a page-token, 16 tokens a block):
    2,048 blocks of the full group, and per window group the 65 blocks that meet its last
    1,024 tokens plus 65 for each of the 3 tails kept every 8,192 tokens before it."""
    shape = arch_from_hf_config(PRESETS["gemma-3-4b"]).shape
    g = shape.kv_groups
    assert g.windows == (None,) + (1024,) * 6 and g.page_layers == 5
    assert g.layers[0] == (5, 11, 17, 23, 29) and g.layers[-1] == (30, 31, 32, 33)
    r = size_report(shape, "bfloat16", block_size=16, max_model_len=32768, retain_every=8192)
    page = 20_480 * 16
    assert r.retained_tails == 3 and r.sequence_bytes == page * (2048 + 6 * 65 * 4)
    assert r.sequence_bytes_full == 2 * 34 * 4 * 256 * 2 * 32768
    assert r.sequence_bytes / r.sequence_bytes_full <= 0.30  # the goal (0.26)
    llama = arch_from_hf_config(CONFIGS["Llama-3.1-8B"]).shape
    assert llama.kv_groups.windows == (None,) and llama.kv_groups.page_layers == 32
    assert size_report(llama, "fp16", max_model_len=32768).sequence_bytes == 131_072 * 32768


def test_tensor_parallel_sizes_are_per_device():
    """-tp 2: each device holds half the KV heads (half the bytes per token), half the
    query heads, MLP columns and vocabulary rows (about half the weights); a shape whose
    heads do not split is refused with its numbers."""
    from hotprefix.tools.size import per_device

    name, shape = load_shape("llama-3.1-70b")
    one = size_report(shape, "float16")
    part_name, part = per_device(name, shape, 2)
    two = size_report(part, "float16")
    assert two.bytes_per_token == one.bytes_per_token // 2 == 2 * 80 * 4 * 128 * 2
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size, part.vocab_size) == (32, 4, 14336, 64128)
    assert part_name == "llama-3.1-70b (one device of 2)"
    # per device: everything but the 2 x 80 + 1 RMSNorms of 8192 is halved
    assert part.num_params() == (shape.num_params() - 161 * 8192) // 2 + 161 * 8192
    bad = subprocess.run([sys.executable, "-m", "hotprefix.cli", "size", "llama-3.1-70b", "-tp", "3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "hotprefix: error: --tensor-parallel-size 3: the model's 8 KV heads and 64 query heads do not split over 3 "
        "ranks (the size must divide both: 1, 2, 4, 8)")


def _tiny_gemma3_shape():
    """The tests' tiny Gemma 3 (tests/conftest.py): seven layers of 2 KV heads x 32, six local
    of a window of 8 and one global: seven groups of one layer (float32: 512 bytes a token
    a group, 2,048 a page of 4 tokens)."""
    import transformers

    from tests.conftest import TINY, TINY_GEMMA3

    cfg = transformers.Gemma3TextConfig(**{**TINY, **TINY_GEMMA3}).to_dict()
    return arch_from_hf_config({**cfg, "architectures": ["Gemma3ForCausalLM"]}).shape


def test_a_window_models_pool_rows_count_the_grouped_pools_pages():
    """Per group, as the engine allocates: a 30-token prompt keeps its 8 full-group blocks and,
    per window group, the window tail at its end and one kept every 16 tokens (3 blocks each:
    a window of 8 meets at most 3 blocks of 4); a 40-token request holds 10 full-group blocks
    and its window's 3 per window group (28), of which the prompt's 7 full blocks are shared;
    the budget loses the pool's null block."""
    shape = _tiny_gemma3_shape()
    assert shape.pool_groups.windows == (None,) + (8,) * 6 and shape.pool_groups.page_layers == 1
    r = size_report(shape, "float32", block_size=4, prompt_tokens=30, num_prompts=2, concurrency=3, max_model_len=40,
                    budget_bytes=2048 * 101, host_tier_bytes=2048 * 50, retain_every=16)
    assert (r.bytes_per_token, r.bytes_per_block) == (7 * 512, 2048)
    assert r.blocks_per_prompt == 8 + 6 * 6 and r.bytes_per_prompt == 44 * 2048 and r.pool_blocks == 88
    assert r.private_blocks_per_request == 28 - 7 and r.blocks_needed == 88 + 3 * 21
    assert r.blocks_in_budget == 100 and r.fits_without_eviction is False
    assert (r.max_concurrency, r.max_concurrency_unshared) == ((100 - 88) // 21, 100 // 28)
    assert (r.host_tier_blocks, r.host_tier_prompts) == (50, 50 // (7 + 6 * 6))  # a prompt's 7 full blocks' pages
    assert r.retained_tails == 2 and r.sequence_bytes == 2048 * (10 + 6 * 9)


def test_a_window_models_sequence_blocks_are_the_engines_peak():
    """The engine's own pool, one token a step: a 40-token sequence of the tiny Gemma holds at
    most the 28 blocks size counts for it."""
    from hotprefix.config import SchedulerConfig
    from hotprefix.core.kv_cache_manager import KVCacheManager
    from hotprefix.core.outputs import ModelRunnerOutput
    from hotprefix.core.scheduler import Scheduler
    from tests.unit.builders import make_request

    shape = _tiny_gemma3_shape()
    kv = KVCacheManager(100, 4, group_windows=shape.pool_groups.windows)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1), kv)
    s.add_request(make_request("a", 30, max_tokens=10))
    peak = 0
    while s.has_unfinished():
        out = s.schedule()
        peak = max(peak, 100 - kv.pool.num_free_blocks)
        s.update(out, ModelRunnerOutput({r.request_id: 7 for r in out.requests if r.sample}))
    r = size_report(shape, "float32", block_size=4, max_model_len=40, budget_bytes=2048 * 57)
    assert peak == shape.pool_groups.sequence_blocks(40, 4) == 28 and r.max_concurrency_unshared == 56 // 28
