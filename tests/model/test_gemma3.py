"""Gemma 3 against transformers' Gemma3ForCausalLM on a tiny random model written by the
test (tests/conftest.py: seven layers, five local with a window of 8, one global with the
4B's linear RoPE scaling, one local; random norms), from its HF folder and as a GGUF.

Tolerance: relative error max |ours - ref| / max |ref| <= 1e-4 over the logits compared
(float32, the bound of test_reference_logits.py); greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config import CacheConfig, ModelConfig, SchedulerConfig
from hotprefix.model.arch import FULL, SLIDING, arch_from_hf_config
from hotprefix.model.loader import gguf_tokenizer, load_model
from hotprefix.model.runner import ModelRunner
from hotprefix.tokenizers.fast_tokenizer import FastTokenizer
from tests.conftest import build_tiny_model
from tests.gguf_util import SpmVocab, write_gguf
from tests.model.test_reference_logits import hf_logits, rel_err, run_chunks

WINDOW, BLOCK = 8, 4
KINDS = (SLIDING,) * 5 + (FULL, SLIDING)
# The published text configs as the Hub has them (transformers 4 names: rope_scaling,
# rope_local_base_freq, sliding_window_pattern), the fields that shape the model.
HUB_270M = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256, hidden_size=640,
                intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                query_pre_attn_scalar=256, rope_local_base_freq=10000.0, rope_scaling=None, rope_theta=1000000.0,
                sliding_window=512, _sliding_window_pattern=6, vocab_size=262144, max_position_embeddings=32768,
                hidden_activation="gelu_pytorch_tanh", layer_types=None)
HUB_4B_TEXT = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=2560,
                   intermediate_size=10240, num_hidden_layers=34, num_key_value_heads=4, num_attention_heads=8,
                   rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024,
                   sliding_window_pattern=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    return d, build_tiny_model(d, "gemma3", seed=3)


def test_hub_configs_parse_as_transformers_reads_them():
    a = arch_from_hf_config(HUB_270M)
    assert a.layer_types == tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18))
    assert [a.window_of(i) for i in (0, 4, 5, 11, 17)] == [512, 512, None, None, None]
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling, a.query_pre_attn_scalar) == (1e6, 1e4, {}, 256)
    assert a.tie_word_embeddings and a.norm_adds_one and a.hidden_act == "gelu_pytorch_tanh"
    b = arch_from_hf_config(HUB_4B_TEXT)  # the rest from Gemma3TextConfig's defaults
    assert (b.head_dim, b.num_layers, b.sliding_window, b.rope_type, b.rope_scaling["factor"]) == \
        (256, 34, 1024, "linear", 8.0)
    assert (b.rope_theta, b.rope_local_theta, b.layer_types.count(FULL)) == (1e6, 1e4, 5)


def test_chunked_batches_across_windows_and_blocks_match_transformers(tiny):
    """Prompts shorter than, equal to and longer than the window, in chunks that cross
    window and block boundaries, in steps shared with other sequences; int8 and float32."""
    folder, hf = tiny
    loaded = load_model(str(folder))
    assert loaded.arch.layer_types == KINDS and loaded.arch.sliding_window == WINDOW
    g = torch.Generator().manual_seed(7)
    seqs = {name: torch.randint(3, 320, (n,), generator=g).tolist() for name, n in
            (("short", 5), ("equal", 8), ("long", 30), ("mid", 19))}
    perm = torch.randperm(64, generator=g).tolist()
    blocks = {"short": perm[0:2], "equal": perm[2:4], "long": perm[4:12], "mid": perm[12:17]}
    steps = [{"short": 3, "equal": 8, "long": 6, "mid": 1},  # a whole window; a chunk inside one
             {"short": 2, "long": 5, "mid": 9},  # crossing the window (8) and block boundaries
             {"long": 13, "mid": 9},  # a chunk longer than the window
             {"long": 1}, {"long": 5}]
    for mode in ("float32", "int8"):
        runner = ModelRunner(loaded, ModelConfig(device="cpu", quantized_matmul=mode),
                             CacheConfig(block_size=BLOCK, num_blocks_override=128), SchedulerConfig())
        ours = run_chunks(runner, seqs, steps, blocks)  # (17 blocks in each of the 7 KV-cache groups)
        for name, ids in seqs.items():
            err = rel_err(ours[name], hf_logits(hf, ids))
            assert err <= 1e-4, f"{mode}/{name}: relative error {err:.2e}"


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_and_prefix_hits_inside_and_outside_the_window(tiny):
    """Greedy tokens equal transformers', alone and after prefix hits that end inside the
    window (4 tokens cached) and past it (24 cached: the local layers read only the last
    window of them)."""
    folder, hf = tiny
    llm = LLM(model=str(folder), block_size=BLOCK, num_blocks_override=7 * 64)  # (blocks of one layer: 7 groups)
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 320, (30,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate([base], params)[0]
    assert first.outputs[0].token_ids == hf_greedy(hf, base, 12) and first.num_cached_tokens == 0
    for keep, cached in ((6, 4), (26, 24)):
        prompt = base[:keep] + torch.randint(3, 320, (5,), generator=g).tolist()
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12), (keep, cached)
    llm.engine.kv.check_integrity()


def test_gguf_is_read_as_llama_cpp_writes_it(tmp_path):
    """The converter's names, keys and w + 1 norms: an F32 GGUF gives transformers' logits;
    a Q8_0 file loads in int8 mode with every product on the blocks. (GGUF has no query
    scale: llama.cpp takes head_dim's, as every Gemma 3 but the 27B has, so this model does.)"""
    from transformers import AutoTokenizer

    hf = build_tiny_model(tmp_path / "hf", "gemma3", seed=4, query_pre_attn_scalar=32)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(3, 320, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = hf_logits(hf, ids)
    for qtype, mode, bound in (("F32", "float32", 1e-4), ("Q8_0", "int8", 0.05)):
        loaded = load_model(str(write_gguf(tmp_path / f"g-{qtype}.gguf", hf, tok, qtype, arch="gemma3")))
        a = loaded.arch
        assert (a.family, a.layer_types, a.sliding_window, a.rope_local_theta, a.norm_adds_one) == \
            ("gemma3", KINDS, WINDOW, 1e4, False)
        assert a.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        runner = ModelRunner(loaded, ModelConfig(device="cpu", quantized_matmul=mode),
                             CacheConfig(block_size=BLOCK, num_blocks_override=48), SchedulerConfig())
        got = run_chunks(runner, {"a": ids}, [{"a": 13}, {"a": 8}], {"a": list(range(6))})["a"]
        assert rel_err(got, ref) <= bound, qtype


def test_a_gguf_window_period_of_zero_is_a_load_error(tmp_path, monkeypatch):
    """`sliding_window_pattern` as a period (layer i global when (i + 1) % period == 0): a
    file whose period is 0 is refused with ModelLoadError naming the key (it raised
    ZeroDivisionError out of the loader)."""
    from transformers import AutoTokenizer

    import tests.gguf_util as util
    from hotprefix.model.arch import ModelLoadError

    hf = build_tiny_model(tmp_path / "hf", "gemma3", seed=4)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    base = util._gemma3_metadata

    def period_zero(w, cfg) -> None:
        base(w, cfg)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 0)

    monkeypatch.setattr(util, "_gemma3_metadata", period_zero)
    path = write_gguf(tmp_path / "period0.gguf", hf, tok, "F32", arch="gemma3")
    with pytest.raises(ModelLoadError, match="sliding_window_pattern must be at least 1, got 0"):
        load_model(str(path))


# merges in the order Gemma's files list them: a piece's two halves come before it
PIECES = ("▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "or", "ld", "▁w", "hell", "hello", "▁wor", "▁world")


def test_gguf_sentencepiece_vocabulary_adds_bos_and_falls_back_to_bytes(tiny, tmp_path):
    """Gemma 3's GGUFs carry a SentencePiece vocabulary (scores, no merges, no space prefix,
    BOS added): a text prompt encodes to BOS, the longest pieces the merges reach, spaces as
    ▁, and byte tokens for what no piece spells; decoding gives the text back."""
    _, hf = tiny
    vocab = SpmVocab(PIECES)
    path = write_gguf(tmp_path / "spm-gemma3.gguf", hf, vocab, "F32", arch="gemma3")
    llm = LLM(model=str(path), block_size=BLOCK, num_blocks_override=16)
    text = "hello world!hell"
    want = [SpmVocab.BOS, vocab.id("hello"), vocab.id("▁world"), 4 + ord("!"), vocab.id("hell")]
    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out.prompt_token_ids == want
    assert llm.tokenizer.decode(want, skip_special_tokens=True) == text
    # the conversion is cached and read back as it is at every later start (transformers
    # saves it as a GemmaTokenizer, which the cache must not take for a tokenizer of its own)
    assert isinstance(llm.tokenizer, FastTokenizer)
    again = gguf_tokenizer(path)
    assert isinstance(again, FastTokenizer) and again(text)["input_ids"] == want


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends_give_each_layer_its_window(tiny, backend):
    """The torch reference and the Triton kernels (interpreted on the CPU) agree with the
    cpu backend on a prefill past the window and decodes after it."""
    folder, _ = tiny
    loaded = load_model(str(folder))
    ids = torch.randint(3, 320, (14,), generator=torch.Generator().manual_seed(9)).tolist()
    steps = [{"a": 11}, {"a": 1}, {"a": 1}, {"a": 1}]
    out = {}
    for b in ("cpu", backend):
        runner = ModelRunner(loaded, ModelConfig(device="cpu", attention_backend=b),
                             CacheConfig(block_size=BLOCK, num_blocks_override=48), SchedulerConfig())
        out[b] = run_chunks(runner, {"a": ids}, steps, {"a": [3, 1, 4, 0]})["a"]
    assert rel_err(out[backend], out["cpu"]) <= 1e-5
