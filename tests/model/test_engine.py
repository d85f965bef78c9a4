"""The engine on a tiny random model: batching, chunking, preemption, stop
conditions, seeds, n > 1, logprobs, errors, fp8 KV, and no leaked blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.errors import InvalidRequestError, PromptTooLongError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks_override", 128)
    kw.setdefault("device", "cpu")  # CPU reference tests; the CUDA path is in test_gpu.py
    return LLM(model=str(folder), **kw)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def assert_pool_empty(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.requests


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module")
def alone(folder):
    """Greedy outputs of each prompt run by itself, the reference for batching."""
    llm = make_llm(folder)
    return {tuple(p): llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts_of([3, 17, 9, 30, 1])}


@pytest.mark.parametrize("kw", [
    {},                                                   # one batch
    {"max_num_batched_tokens": 7},                        # chunked prefill, small chunks
    {"max_num_batched_tokens": 16, "max_num_seqs": 2},    # chunks + queueing
    {"num_blocks_override": 14, "max_num_batched_tokens": 32},  # few blocks: preemption (recompute)
    {"num_blocks_override": 14, "max_num_batched_tokens": 32, "preemption_mode": "swap", "swap_space": "1MiB"},
    {"num_blocks_override": 14, "max_num_batched_tokens": 32, "preemption_mode": "swap", "swap_space": "1MiB",
     "scheduling_policy": "priority", "enable_prefix_caching": False},
    {"num_blocks_override": 14, "max_num_batched_tokens": 32, "preemption_mode": "swap", "swap_space": "4KiB"},
    {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 3},
])
def test_batched_outputs_equal_running_alone(folder, alone, kw):
    llm = make_llm(folder, **kw)
    prompts = [list(p) for p in alone]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == alone[tuple(p)]
        assert o.outputs[0].finish_reason == "length"
    if "num_blocks_override" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    if kw.get("preemption_mode") == "swap":
        swap_bytes = {"1MiB": 1 << 20, "4KiB": 4096}[kw["swap_space"]]  # (a number would be GiB, as in vLLM)
        assert llm.engine.runner.num_host_blocks == swap_bytes // llm.engine.runner.plan.bytes_per_block
        assert llm.engine.runner.num_swapped_blocks_total > 0
    assert_pool_empty(llm)


def test_stop_string_ends_text_exactly(folder):
    llm = make_llm(folder)
    prompt = prompts_of([6], seed=3)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    k = text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == text[:k]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    inc = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert inc.outputs[0].text == text[:k + len(stop)]
    assert_pool_empty(llm)


def test_streamed_deltas_add_up_and_never_show_the_stop_string(folder):
    llm = make_llm(folder)
    prompt = prompts_of([5], seed=4)[0]
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = text[10:14]
    eng = llm.engine
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    deltas = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.deltas[0])
            final = o
    assert "".join(deltas) == final.outputs[0].text == text[:text.find(stop)]
    assert all(stop not in d for d in deltas)


def test_stop_token_ids_and_max_tokens(folder):
    llm = make_llm(folder)
    prompt = prompts_of([7], seed=5)[0]
    ref = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored_and_min_tokens_defers_it(folder):
    llm = make_llm(folder)
    eos = llm.engine.tokenizer.eos_token_id
    prompt = prompts_of([4], seed=6)[0]
    ref = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # Make the model's 3rd greedy token the EOS by treating it as one.
    llm.engine.preparer = replace(llm.engine.preparer, eos_token_ids=frozenset({ref[2], eos}))
    llm.engine.runner.eos_token_ids = (ref[2], eos)
    first = ref.index(ref[2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 3))[0].outputs[0]
    assert len(out.token_ids) >= first + 3
    assert ref[2] not in out.token_ids[:first + 2]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(folder):
    llm = make_llm(folder)
    p = prompts_of([8], seed=7)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=42, ignore_eos=True)
    a = llm.generate([p], sp)[0].outputs[0].token_ids
    b = llm.generate([prompts_of([5], 1)[0], p, prompts_of([9], 2)[0]],
                     [SamplingParams(temperature=1.0, max_tokens=4), sp, SamplingParams(temperature=0.7)])
    assert b[1].outputs[0].token_ids == a
    c = llm.generate([p], SamplingParams(temperature=1.0, max_tokens=10, seed=43, ignore_eos=True))
    assert c[0].outputs[0].token_ids != a


def test_n_samples_are_distinct_and_reproducible(folder):
    llm = make_llm(folder)
    p = prompts_of([8], seed=8)[0]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1, ignore_eos=True)
    out = llm.generate([p], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3 and all(len(s) == 10 for s in seqs)
    assert [tuple(c.token_ids) for c in llm.generate([p], sp)[0].outputs] == seqs
    assert_pool_empty(llm)


def test_logprobs_per_token(folder, tiny_llama):
    llm = make_llm(folder)
    p = prompts_of([6], seed=9)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    hf = tiny_llama[1]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), 0)
    first = out.logprobs[0]
    assert first.sampled.token_id == out.token_ids[0] == int(ref.argmax())
    assert abs(first.sampled.logprob - float(ref.max())) < 1e-4
    assert [t.token_id for t in first.top] == ref.topk(2).indices.tolist()


def test_prompt_errors_are_clear_and_leave_nothing_behind(folder):
    llm = make_llm(folder, max_model_len=32)
    with pytest.raises(PromptTooLongError, match="maximum context length is 32 tokens. However, your request "
                                                 "has 40 input tokens"):
        llm.generate([prompts_of([40])[0]], GREEDY)
    with pytest.raises(PromptTooLongError, match=r"you requested 42 tokens \(30 in the messages, 12 in the"):
        llm.generate([prompts_of([30])[0]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([[5, 999999]], GREEDY)
    # A bad prompt in a batch rejects the whole batch before anything runs.
    with pytest.raises(PromptTooLongError):
        llm.generate([prompts_of([3])[0], prompts_of([40])[0]], GREEDY)
    assert_pool_empty(llm)


def test_request_larger_than_the_pool_is_refused(folder):
    llm = make_llm(folder, num_blocks_override=4)  # 16 tokens of KV
    with pytest.raises(InvalidRequestError, match="pool holds 16"):
        llm.generate([prompts_of([10])[0]], GREEDY)


def test_abort_returns_every_block(folder):
    llm = make_llm(folder)
    eng = llm.engine
    for i, p in enumerate(prompts_of([5, 20, 9])):
        eng.add_request(f"r{i}", p, GREEDY)
    eng.step()
    eng.step()
    assert eng.kv.pool.num_free_blocks < eng.kv.num_blocks
    for i in range(3):
        eng.abort_request(f"r{i}")
    assert not eng.has_unfinished_requests()
    eng.step()  # the runner drops the aborted requests' state
    assert_pool_empty(llm)


def test_incremental_text_matches_full_decode_with_multibyte_characters(folder):
    llm = make_llm(folder)
    tok = llm.tokenizer
    prompt = tok("café 東京 😀")["input_ids"]
    for seed in range(4):
        out = llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=25, seed=seed,
                                                    ignore_eos=True))[0].outputs[0]
        full = tok.decode(out.token_ids, skip_special_tokens=True)
        # Incremental text holds back an incomplete trailing character only.
        assert full.startswith(out.text) and len(full.rstrip("\ufffd")) == len(out.text)


def test_chat_uses_the_template(folder):
    llm = make_llm(folder)
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_fp8_kv_is_close_to_fp32_and_half_the_bytes_of_fp16(folder, tiny_llama):
    from hotprefix.core.outputs import ScheduledRequest, SchedulerOutput

    p = prompts_of([37], seed=11)[0]
    so = SchedulerOutput([ScheduledRequest("x", p, 0, list(range(10)), True, GREEDY, p, [])])
    logits = {}
    sizes = {}
    for dt in ("float32", "float16", "fp8", "fp8_e5m2"):
        llm = make_llm(folder, kv_cache_dtype=dt, num_blocks_override=16)
        logits[dt] = llm.engine.runner.all_logits(so)
        sizes[dt] = llm.engine.runner.kv_cache.bytes_per_block()
    assert sizes["fp8"] * 2 == sizes["float16"] and sizes["fp8_e5m2"] == sizes["fp8"]
    assert sizes["float32"] == 2 * sizes["float16"]
    ref = logits["float32"]

    def mean_rel(dt: str) -> float:
        return float((logits[dt] - ref).abs().mean() / ref.abs().mean())

    # Stated tolerances (mean |error| / mean |logit|) on this random model, which
    # amplifies KV noise more than a trained one: e4m3 keeps 3 mantissa bits, e5m2 2.
    assert mean_rel("float16") < 2e-3
    assert mean_rel("fp8") < 0.10
    assert mean_rel("fp8_e5m2") < 0.25
    assert mean_rel("fp8") < mean_rel("fp8_e5m2")
    assert not torch.equal(logits["fp8"], logits["float32"])  # the fp8 path really quantises

