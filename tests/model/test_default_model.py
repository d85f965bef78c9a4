"""The bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1): greedy
continuations token-for-token identical to transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.loader import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
]


TEXT = ("The history of caching in computer systems begins with early mainframes, where a small fast memory "
        "held copies of frequently used data. Today, large language model servers cache attention keys and "
        "values so that repeated prompts are cheaper. A chatbot with a long system prompt, a search engine that "
        "answers many questions about the same documents, and an agent that calls tools in a loop all send the "
        "same opening tokens again and again. Computing those tokens once and keeping their keys and values in "
        "a pool of fixed-size blocks lets the server answer the next request at once. The blocks are found by "
        "hashing each block of tokens together with the hash of the block before it, so that two prompts share "
        "exactly the blocks of their common prefix and nothing more.")


@pytest.fixture(scope="module")
def llm():
    # float32 activations: the products equal transformers' up to the order of additions
    return LLM(block_size=16, kv_cache_memory=256 << 20, quantized_matmul="float32")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Plain greedy decoding with transformers' KV cache and no EOS handling
    (ignore_eos keeps going past EOS; it does not suppress it as HF's min_new_tokens does)."""
    out = model(ids, use_cache=True)
    past, toks = out.past_key_values, []
    for _ in range(n):
        nxt = out.logits[0, -1].argmax()
        toks.append(int(nxt))
        out = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return torch.tensor(toks)


def test_greedy_32_tokens_identical_to_transformers(llm, hf_model):
    from hotprefix.model.kernels.build import library

    model = llm.engine.runner.model
    if library() is not None:  # decoding reads the Q4_1 / Q8_0 blocks, not the float32 copies
        layer = model.model.layers[0]
        assert model.logits_blocks is not None and layer.self_attn.o_proj.blocks is not None
        assert layer.self_attn.qkv_blocks.n == 576 + 2 * 192 and layer.mlp.gate_up_blocks.n == 2 * 1536
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # all three in one batch
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_greedy(hf_model, ids, 32)
        assert out.outputs[0].token_ids == ref.tolist(), prompt


def test_chat_applies_the_gguf_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=12))[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "4" in out.outputs[0].text


def test_fp8_kv_on_the_default_model(llm):
    """Stated tolerance for fp8 (e4m3, scale 1) KV on a trained model: mean
    |error| <= 5% of mean |logit| and >= 80% of next-token argmaxes unchanged
    (measured: 3.4% and 88%; fp16 KV: 0.02% and 100%)."""
    from hotprefix.config import CacheConfig, EngineConfig
    from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
    from hotprefix.engine.llm_engine import LLMEngine
    from hotprefix.model.loader import load_model

    loaded = load_model(None)
    ids = loaded.tokenizer(TEXT[:TEXT.index(" A chatbot")])["input_ids"]
    logits = {}
    for dt in ("auto", "fp8"):
        eng = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_dtype=dt, num_blocks_override=8)), loaded=loaded)
        so = SchedulerOutput([ScheduledRequest("x", ids, 0, list(range(8)), True, SamplingParams(), ids, [])])
        logits[dt] = eng.runner.all_logits(so)
    ref, fp8 = logits["auto"], logits["fp8"]
    assert float((fp8 - ref).abs().mean() / ref.abs().mean()) <= 0.05
    assert float((fp8.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.8


def test_stop_string_spanning_two_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["The capital of France is"], params)[0].outputs[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    assert "".join(pieces) == full.text


    def spans(i: int) -> bool:  # the stop's first occurrence straddles the end of token i
        stop = pieces[i][-1] + pieces[i + 1][0]
        return full.text.find(stop) == len("".join(pieces[:i + 1])) - 1

    i = next(i for i in range(len(pieces) - 1) if pieces[i] and pieces[i + 1] and spans(i))
    stop = pieces[i][-1] + pieces[i + 1][0]  # last character of token i + first of token i + 1
    k = full.text.find(stop)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24,
                                                                    ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:k] and (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_int8_matmul_stays_close_to_float32():
    """Stated tolerance for --quantized-matmul int8 (activations quantized per 32 values,
    llama.cpp's method) against float32 activations on the same GGUF weights: mean
    KL(float32 || int8) of the next-token distributions <= 0.015 and >= 90% of argmaxes
    unchanged. Measured: KL 0.0036 and 98% on this text, 0.0044 and 95% on 256 tokens of
    the README, where llama.cpp against our float32 gives KL 0.0042. (Taking Q4_1's m term
    from the unquantized activations instead measured KL 0.019 and 89%: this test fails it.)"""
    from hotprefix.config import CacheConfig, EngineConfig, ModelConfig
    from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
    from hotprefix.engine.llm_engine import LLMEngine
    from hotprefix.model.loader import load_model

    loaded = load_model(None)
    ids = loaded.tokenizer(TEXT)["input_ids"]
    logp = {}
    for mode in ("float32", "int8"):
        eng = LLMEngine(EngineConfig(ModelConfig(quantized_matmul=mode), CacheConfig(num_blocks_override=16)),
                        loaded=loaded)
        assert eng.runner.quantized_matmul == mode
        so = SchedulerOutput([ScheduledRequest("x", ids, 0, list(range(16)), True, SamplingParams(), ids, [])])
        logp[mode] = torch.log_softmax(eng.runner.all_logits(so), -1)
    ref, q = logp["float32"], logp["int8"]
    kl = (ref.exp() * (ref - q)).sum(-1)
    agree = (ref.argmax(-1) == q.argmax(-1)).float().mean()
    assert float(kl.mean()) <= 0.015 and float(agree) >= 0.9, (float(kl.mean()), float(agree))


def test_no_mode_keeps_a_float32_copy_of_the_weights_its_blocks_serve():
    """The loader dequantizes no weight it keeps as GGUF blocks (meta until a mode needs
    it), and on the CPU no mode does: int8 and float32 mode build models that hold norms
    alone in float32 (every product reads blocks: a model cannot use what it does not
    have); the two modes' next-token distributions stay close; embedding rows come from
    the blocks exactly as gguf dequantizes them."""
    from gguf import GGMLQuantizationType, dequantize

    from hotprefix.config import CacheConfig, EngineConfig, ModelConfig
    from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput
    from hotprefix.engine.llm_engine import LLMEngine
    from hotprefix.model.loader import load_model
    loaded = load_model(None)
    assert set(loaded.packed) == {n for n, w in loaded.weights.items() if w.is_meta}
    assert "model.embed_tokens.weight" in loaded.packed and len(loaded.packed) == 30 * 7 + 1
    ids = loaded.tokenizer(TEXT)["input_ids"][:100]
    so = SchedulerOutput([ScheduledRequest("x", ids, 0, list(range(8)), True, SamplingParams(), ids, [])])
    engines = {mode: LLMEngine(EngineConfig(ModelConfig(quantized_matmul=mode), CacheConfig(num_blocks_override=8)),
                               loaded=loaded) for mode in ("float32", "int8")}
    for eng in engines.values():
        model = eng.runner.model
        assert {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters()} == {
            "input_layernorm", "post_attention_layernorm", "norm"}  # norms only
        assert sum(p.numel() * p.element_size() for p in model.parameters()) < 1e6
        assert eng.runner.served_weight_bytes > 530e6  # ~425 MB of float32 projections and the 113 MB table
    logp = [torch.log_softmax(e.runner.all_logits(so), -1) for e in engines.values()]
    assert float((logp[0].exp() * (logp[0] - logp[1])).sum(-1).mean()) < 0.05
    table = loaded.packed["model.embed_tokens.weight"]
    want = torch.from_numpy(dequantize(table.raw.numpy(), GGMLQuantizationType(table.qtype))).reshape(table.n, -1)
    every = torch.tensor([[0, 1, 2], [49151, 7, 7]])
    embed = engines["int8"].runner.model.model.embed_tokens
    assert torch.equal(embed(every), want[every])
    assert torch.equal(embed(torch.arange(49152)), want)
