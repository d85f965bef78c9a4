"""Test builders: tiny random Llama-family models saved as HF folders, with a
small byte-level BPE tokenizer, so that model tests run in seconds and need no
network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton's kernels run in its interpreter where there is no GPU; it must be set before
# anything imports triton (it decorates its own library then), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Caching keys and values saves compute. "
    "Prefix caching reuses the blocks of a shared system prompt. Ünïcödé text: café, naïve, 東京, 😀. "
    "def f(x): return x * 2\n" * 3
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(folder: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on CORPUS, saved into folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, bos_token_id=1, eos_token_id=0)


# A tiny Gemma 3: seven layers (five local, one global, one local), a window of 8, a head
# dim and query scale of their own, the 4B's linear RoPE scaling on the global layer.
TINY_GEMMA3 = dict(num_hidden_layers=7, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                   tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def build_tiny_model(folder: Path, family: str = "llama", seed: int = 0, dtype=None, **overrides):
    """Save a tiny random model of `family` (llama, mistral, qwen2, qwen3, gemma3, qwen3moe) with
    its tokenizer into folder; return the transformers model (fp32, eager). dtype (a torch
    dtype): the model made and saved in it instead, never as a float32 copy (a large shape's
    bfloat16 folder where float32 would not fit in memory)."""
    import torch
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    kw = dict(TINY)
    if family in ("qwen3", "qwen3moe"):
        kw["head_dim"] = 32  # differs from hidden / heads, as in real Qwen3 models
    if family == "gemma3":
        kw.update(TINY_GEMMA3)
    if family == "qwen3moe":  # 8 experts of FFN 32, 2 a token, weights renormalised (Qwen3-30B-A3B's choice)
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    kw.update(overrides)
    shard = kw.pop("max_shard_size", None)
    cfg = cls_cfg(**kw)
    torch.manual_seed(seed)
    if dtype is None:
        model = cls_model(cfg).float().eval()
    else:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls_model(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
    if family in ("qwen2",):  # give the qkv biases non-zero values
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if family == "gemma3":  # Gemma's norms start at 0 (used as 1 + w): give them values
        with torch.no_grad():
            for name, w in model.named_parameters():
                if name.endswith("norm.weight"):
                    w.normal_(0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))
    build_tokenizer(folder)
    model.config._attn_implementation = "eager"
    return model


def pytest_terminal_summary(terminalreporter) -> None:
    """Which kernel paths this machine ran natively (the tests also build and compare the
    simulated AVX-512, AVX2 and plain C builds wherever the CPU can host them): CI says it."""
    from hotprefix.model.kernels.build import cpu_vector_flags, library, vector_paths

    if library() is None:
        terminalreporter.write_line("hotprefix kernels: no C library (torch only)")
        return
    terminalreporter.write_line(f"hotprefix kernels: CPU flags {' '.join(cpu_vector_flags()) or 'none'}; the "
                                f"native build runs {', '.join(vector_paths())}")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The files derived from the tests' own models (regrouped int8 weights, converted
    tokenizers) go to a folder of this session, not to the developer's ~/.cache/hotprefix;
    the built kernels are shared with it (keyed by sources and flags), so none is rebuilt.
    Servers the tests start inherit it."""
    from hotprefix.config import cache_root

    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("hotprefix-cache")
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    before = os.environ.get("HOTPREFIX_CACHE")
    os.environ["HOTPREFIX_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("HOTPREFIX_CACHE", None)
    else:
        os.environ["HOTPREFIX_CACHE"] = before


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, HF model) of a tiny random Llama."""
    d = tmp_path_factory.mktemp("tiny-llama")
    return d, build_tiny_model(d, "llama")


def read_json(p: Path) -> dict:
    return json.loads(p.read_text())


@pytest.fixture(scope="module")
def logged_server(tiny_llama, tmp_path_factory):
    """A live server on the tiny model that writes its request log: (LiveServer, log path)."""
    from tests.server.conftest import start_server

    path = tmp_path_factory.mktemp("log") / "requests.jsonl"
    s = start_server(tiny_llama[0], server_kw={"request_log": str(path)})
    yield s, path
    s.stop()
