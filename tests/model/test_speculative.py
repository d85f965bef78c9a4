"""Speculative decoding gives the tokens and logprobs of decoding one token at a time,
bit for bit (the CPU kernels are batch-invariant: a verify chunk's logits are the single
steps' logits). Drafts here come from an oracle (the reference's own output, with one
token changed at a position that varies), so that drafts kept whole, kept in part and
rejected at once all occur on a tiny random model; the n-gram proposer's own drafts on
real text are tested over HTTP (tests/server/test_speculative_http.py). The pool is small
and the budget tight: preemption, chunking and drafts cut to the budget occur; the
KV-cache manager's integrity is checked after every step."""

from __future__ import annotations

import json

import pytest

from hotprefix.core import speculation
from hotprefix.core.suffix_table import decode
from hotprefix.model.steps.fused_decode import FusedDecode
from hotprefix.sampling_params import SamplingParams, StructuredKind, StructuredOutput
from tests.model.test_batch_invariance import loaded, make_engine  # noqa: F401 (a fixture)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _sp(**kw) -> SamplingParams:
    return SamplingParams(**{"ignore_eos": True, "logprobs": 20, **kw})


REQUESTS = [
    ([11, 12, 13, 14] * 5, _sp(temperature=0.0, max_tokens=40)),
    (list(range(40, 63)), _sp(temperature=0.9, seed=3, max_tokens=33)),
    ([7, 8, 9] * 6, _sp(temperature=0.8, seed=5, top_p=0.9, top_k=50, max_tokens=30, repetition_penalty=1.2,
                        frequency_penalty=0.3, presence_penalty=0.2)),
    (list(range(90, 110)), _sp(temperature=1.0, seed=11, n=2, max_tokens=25, logit_bias={5: 3.0})),
    (list(range(200, 215)), _sp(temperature=0.0, max_tokens=37, min_tokens=20, ignore_eos=False)),
]


def outputs(finals: dict) -> dict:
    """Per request, per sample: its tokens, finish reason, and each position's logprobs (bits)."""
    return {i: [(tuple(o.token_ids), o.finish_reason,
                 tuple((lp.sampled.token_id, lp.sampled.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                       for lp in o.logprobs)) for o in out.outputs] for i, out in finals.items()}


def run(engine, requests) -> dict:
    """Every request added at once, stepped to the end; integrity checked after every step."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        engine.scheduler.check_integrity()
    return final


def oracle(reference: dict[tuple, list[tuple[int, ...]]], calls: list):
    """A find_draft that proposes what the reference went on to say (for a context whose
    prompt it knows: any of its samples whose output so far matches), with the token at
    call-number-dependent position changed (or none), so that every outcome occurs."""
    def find(words, min_n, max_n, k, table=b""):
        tokens = decode(words)
        for prompt, samples in reference.items():
            said = tokens[len(prompt):]
            for out in samples:
                if tokens[:len(prompt)] == list(prompt) and list(out[:len(said)]) == said:
                    draft = list(out[len(said):len(said) + k])
                    wrong = len(calls) % (k + 2)  # k + 1: keep it whole
                    calls.append(len(draft))
                    if wrong < len(draft):
                        draft[wrong] = (draft[wrong] + 1) % 300
                    return draft
        return []
    return find


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_oracle_drafts_give_the_tokens_and_logprobs_of_decoding_one_at_a_time(loaded, mode, monkeypatch):  # noqa: F811
    config = dict(max_num_batched_tokens=13, num_blocks_override=24, preemption_mode="recompute")
    want = outputs(run(make_engine(loaded, mode, caching=True, **config), REQUESTS))
    reference = {tuple(p): [o[0] for o in want[i]] for i, (p, _) in enumerate(REQUESTS)}
    calls: list[int] = []
    monkeypatch.setattr(speculation, "find_draft", oracle(reference, calls))
    engine = make_engine(loaded, mode, caching=True, speculative_config=NGRAM, **config)
    fused = engine.runner.strategy(FusedDecode)
    assert (fused is not None) == (mode == "int8")
    verified_fused = []
    if fused is not None:  # a step of decodes and drafts is still a decode step: the fused one takes it
        real = fused.forward
        monkeypatch.setattr(fused, "forward", lambda batch, meta: verified_fused.append(  # a request's rows share
            len({id(s.block_ids) for s in batch.seqs}) < len(batch.seqs)) or real(batch, meta))  # its block list
    got = outputs(run(engine, REQUESTS))
    assert got == want
    assert any(verified_fused) == (mode == "int8")
    stats = engine.scheduler.make_stats().spec
    assert stats.num_drafts > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[3] > 0  # some drafts were kept whole
    assert engine.scheduler.num_preemptions > 0  # the pool was tight enough to preempt
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def test_the_ngram_proposers_rejected_drafts_change_nothing(loaded):  # noqa: F811
    """The real proposer on a tiny random model: its drafts (from the repeating prompt) are
    rejected, and the answer is the same."""
    requests = [([21, 22, 23] * 4, _sp(temperature=0.0, max_tokens=60)),
                ([21, 22, 23] * 4, _sp(temperature=0.7, seed=1, max_tokens=60))]
    want = outputs(run(make_engine(loaded, "int8", caching=True), requests))
    engine = make_engine(loaded, "int8", caching=True, speculative_config=NGRAM)
    assert outputs(run(engine, requests)) == want
    assert engine.scheduler.make_stats().spec.num_drafts > 0


SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
    "required": ["name", "tags"]})


def _json(**kw) -> SamplingParams:
    return SamplingParams(**{"logprobs": 5, "structured": StructuredOutput(StructuredKind.JSON_SCHEMA, SCHEMA), **kw})


JSON_REQUESTS = [
    ([11, 12, 13, 14] * 5, _json(temperature=0.0, max_tokens=40)),
    (list(range(40, 63)), _json(temperature=0.9, seed=3, max_tokens=40)),
    ([7, 8, 9] * 6, _json(temperature=0.0, max_tokens=30, repetition_penalty=1.2)),
    (list(range(90, 110)), _json(temperature=1.0, seed=11, n=2, max_tokens=36)),
]


@pytest.mark.parametrize("cut_by", ["scheduler", "runner"])
def test_drafts_under_a_grammar_give_the_tokens_of_constrained_decoding(loaded, monkeypatch, cut_by):  # noqa: F811
    """Oracle drafts (the constrained answer with one token changed: one the grammar
    rejects, or one it takes that the model does not say) under a JSON schema: each drafted
    position is sampled under its grammar's mask, so greedy and seeded answers are the
    constrained ones token for token, logprobs included. The scheduler cuts a draft where
    the grammar stops taking it; with that cut off, the runner's masks cut it alike. (The
    grammar's forced tokens are left out here, so that every draft is the oracle's.)"""
    want = outputs(run(make_engine(loaded, "int8", caching=True), JSON_REQUESTS))
    reference = {tuple(p): [o[0] for o in want[i]] for i, (p, _) in enumerate(JSON_REQUESTS)}
    calls: list[int] = []
    monkeypatch.setattr(speculation, "find_draft", oracle(reference, calls))
    engine = make_engine(loaded, "int8", caching=True, speculative_config=NGRAM)
    monkeypatch.setattr(engine.runner.matchers, "forced_tokens", lambda rid: [])
    if cut_by == "runner":
        monkeypatch.setattr(engine.runner.matchers, "accepted_prefix", lambda rid, draft: len(draft))
    assert outputs(run(engine, JSON_REQUESTS)) == want
    stats = engine.scheduler.make_stats().spec
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[3] > 0  # some drafts were kept whole
    cut = sum(calls) - stats.num_draft_tokens  # draft tokens the grammar took off before the step
    assert cut > 0 if cut_by == "scheduler" else cut == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


FORCED_SCHEMA = json.dumps({"type": "object", "properties": {
    "lighthouse": {"type": "string", "maxLength": 8}, "built": {"type": "integer"}, "electrified": {"type": "boolean"},
    "fuels": {"type": "array", "items": {"enum": ["whale oil", "kerosene"]}, "maxItems": 2}},
    "required": ["lighthouse", "built", "electrified", "fuels"], "additionalProperties": False})


def _forced(**kw) -> SamplingParams:
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, FORCED_SCHEMA)
    return SamplingParams(**{"logprobs": 5, "structured": so, **kw})


FORCED_REQUESTS = [
    ([11, 12, 13, 14] * 5, _forced(temperature=0.0, max_tokens=60)),
    (list(range(40, 63)), _forced(temperature=0.9, seed=3, max_tokens=60)),
    (list(range(90, 110)), _forced(temperature=1.0, seed=11, n=2, top_p=0.9, max_tokens=50)),
]


def test_a_grammars_forced_tokens_as_drafts_give_the_tokens_of_constrained_decoding(loaded, monkeypatch):  # noqa: F811
    """The real proposer under a schema that fixes its keys and punctuation: the tokens the
    grammar forces are drafted first (then the n-gram's), each position sampled under its
    mask; greedy and seeded answers are the constrained ones token for token, logprobs
    included, and forced drafts were kept. (No ignore_eos: a structured output refuses it.)"""
    want = outputs(run(make_engine(loaded, "int8", caching=True), FORCED_REQUESTS))
    engine = make_engine(loaded, "int8", caching=True, speculative_config=NGRAM)
    forced: list[list[int]] = []
    real = engine.runner.matchers.forced_tokens
    monkeypatch.setattr(engine.runner.matchers, "forced_tokens", lambda rid: forced.append(real(rid)) or forced[-1])
    assert outputs(run(engine, FORCED_REQUESTS)) == want
    stats = engine.scheduler.make_stats().spec
    assert sum(len(f) > 1 for f in forced) > 8 and stats.num_accepted_tokens > 8
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks


def _held(kind: StructuredKind, spec: str, **kw) -> SamplingParams:
    return SamplingParams(**{"logprobs": 5, "structured": StructuredOutput(kind, spec), "max_tokens": 24, **kw})


YES_NO = json.dumps(["yes", "no"])
HELD_REQUESTS = [  # (min_tokens 10 is added below)
    ([11, 12, 13, 14] * 5, _held(StructuredKind.CHOICE, YES_NO, temperature=0.0)),
    (list(range(40, 63)), _held(StructuredKind.CHOICE, YES_NO, temperature=1.0, seed=3)),
    (list(range(90, 110)), _held(StructuredKind.REGEX, "[a-z]{1,30}", temperature=0.0)),
    ([7, 8, 9] * 6, _held(StructuredKind.REGEX, "[a-z]{1,30}", temperature=0.9, seed=5)),
]


def test_a_grammar_that_must_end_wins_over_min_tokens(loaded):  # noqa: F811
    """min_tokens 10 under a choice complete after a token or two: the grammar wins, the
    answer is the one without min_tokens token for token (its EOS, its logprobs), finished
    by "stop", greedy and seeded; under a regex that may go on, no EOS comes before token
    10. With drafts (the grammar's forced tokens, the n-gram's) the answers are the same."""
    from dataclasses import replace

    engine = make_engine(loaded, "int8", caching=True)
    free = outputs(run(engine, HELD_REQUESTS))
    held_requests = [(p, replace(sp, min_tokens=10)) for p, sp in HELD_REQUESTS]
    held = outputs(run(engine, held_requests))
    eos = engine.tokenizer.eos_token_id
    for i in (0, 1):  # the choices: "yes" or "no", then EOS, as without min_tokens
        [(tokens, reason, _)] = held[i]
        assert held[i] == free[i] and reason == "stop" and tokens[-1] == eos
        assert engine.tokenizer.decode(list(tokens[:-1])) in ("yes", "no")
    for i in (2, 3):  # the regexes: no EOS before token 10 (the greedy one ended at 4 without min_tokens)
        [(tokens, reason, _)] = held[i]
        assert reason == "stop" and tokens[-1] == eos and eos not in tokens[:10]
    assert len(free[2][0][0]) < 10 and held[2][0][0][:len(free[2][0][0]) - 1] == free[2][0][0][:-1]
    spec = make_engine(loaded, "int8", caching=True, speculative_config=NGRAM)
    assert outputs(run(spec, held_requests)) == held


def test_forced_tokens_beyond_k_give_the_tokens_of_constrained_decoding(loaded, monkeypatch):  # noqa: F811
    """With k = 2 the schema's forced runs are longer than k: a constrained draft is its first
    k forced tokens and then the n-gram's (up to 2k in all), each position sampled under its
    mask; greedy, seeded, n=2 and top_p answers are the constrained ones token for token,
    logprobs included, and draft tokens at positions past k were kept."""
    k = 2
    want = outputs(run(make_engine(loaded, "int8", caching=True), FORCED_REQUESTS))
    engine = make_engine(loaded, "int8", caching=True, speculative_config={**NGRAM, "num_speculative_tokens": k})
    forced: list[list[int]] = []
    real = engine.runner.matchers.forced_tokens
    monkeypatch.setattr(engine.runner.matchers, "forced_tokens", lambda rid: forced.append(real(rid)) or forced[-1])
    drafts: list[tuple[list[int], list[int]]] = []  # (the forced run, the draft) of each proposal under a grammar
    propose = engine.scheduler.spec.propose

    def spy(req):
        seen = len(forced)
        draft = propose(req)
        if len(forced) > seen:
            drafts.append((forced[-1], draft))
        return draft
    monkeypatch.setattr(engine.scheduler.spec, "propose", spy)
    assert outputs(run(engine, FORCED_REQUESTS)) == want
    stats = engine.scheduler.make_stats().spec
    assert any(len(f) > k for f, _ in drafts) and all(len(d) <= 2 * k for _, d in drafts)
    assert any(len(f) >= k and len(d) > k and d[:k] == f[:k] for f, d in drafts)  # k forced, then the n-gram's
    assert len(stats.accepted_per_pos) == 2 * k and stats.accepted_per_pos[k] > 0  # kept past position k
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
