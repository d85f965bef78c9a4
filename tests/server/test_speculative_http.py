"""Speculative decoding over HTTP on the bundled model (real weights, so the n-gram drafts
are accepted where the answer copies its prompt): with the official openai client, every
answer (text, logprobs, finish reason; greedy and seeded, streamed or not, n = 2, a stop
string) is the same as the server's without speculation, and /metrics shows vLLM's
spec_decode counters. Both servers end with no request and no KV block held."""

from __future__ import annotations

import openai
import pytest

from hotprefix.model.loader import default_model_path
from tests.server.conftest import start_server

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
DOCUMENT = ("The lighthouse at Carrow Point was built in 1871 from granite quarried on the island. Its lamp "
            "burned whale oil until 1904, then kerosene, and was electrified in 1952. The keeper's cottage, "
            "restored in 1998, now holds a small museum of charts, logbooks and a brass fog bell.")
QUOTE = [{"role": "user", "content": f"Here is a paragraph:\n\n{DOCUMENT}\n\nRepeat the paragraph exactly."}]


@pytest.fixture(scope="module")
def servers():
    common = dict(num_blocks_override=200, max_model_len=2048, block_size=16)
    plain = start_server(default_model_path(), **common)
    spec = start_server(default_model_path(), speculative_config=SPEC, **common)
    yield plain, spec
    plain.stop()
    spec.stop()


def chat(server, stream: bool = False, **kw) -> list:
    """Each choice's (text, finish reason, logprobs as (token, logprob, top (token, logprob)))."""
    client = openai.OpenAI(base_url=server.v1, api_key="unused")
    args = dict(model="tiny", messages=QUOTE, max_tokens=72, logprobs=True, top_logprobs=5, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return [(c.message.content, c.finish_reason, _lps(c.logprobs.content)) for c in r.choices]
    text, finish, lps = {}, {}, {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
            lps[c.index] = lps.get(c.index, ()) + (_lps(c.logprobs.content) if c.logprobs else ())
    return [(text[i], finish[i], lps[i]) for i in sorted(text)]


def _lps(content) -> tuple:
    return tuple((t.token, t.logprob, tuple((a.token, a.logprob) for a in t.top_logprobs)) for t in content)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=0.0, stream=True),
    dict(temperature=0.8, seed=7),
    dict(temperature=0.7, top_p=0.9, seed=3, n=2, stream=True),
    dict(temperature=0.0, stop=["kerosene"]),
], ids=["greedy", "greedy-streamed", "seeded", "seeded-n2-streamed", "stop-string"])
def test_answers_are_the_same_with_and_without_speculation(servers, kw):
    plain, spec = servers
    before = spec.metric("spec_decode_num_accepted_tokens_total")
    want = chat(plain, **kw)
    assert chat(spec, **kw) == want
    if kw["temperature"] == 0.0 and "stop" not in kw:
        assert DOCUMENT[:60] in want[0][0]  # the model does copy, so drafts are taken
        assert spec.metric("spec_decode_num_accepted_tokens_total") > before
    if "stop" in kw:
        assert want[0][1] == "stop" and "kerosene" not in want[0][0]


def test_the_spec_decode_metrics_and_no_block_held(servers):
    plain, spec = servers
    chat(spec, temperature=0.0)
    drafts = spec.metric("spec_decode_num_drafts_total")
    draft_tokens = spec.metric("spec_decode_num_draft_tokens_total")
    accepted = spec.metric("spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens and drafts <= draft_tokens <= 4 * drafts
    assert spec.metric("spec_decode_num_accepted_tokens_per_pos_total") == accepted
    with pytest.raises(AssertionError, match="no metric"):
        plain.metric("spec_decode_num_drafts_total")  # only with --speculative-config, as in vLLM
    for s in servers:
        s.check_drained()


SCHEMA = {"type": "object", "properties": {"lighthouse": {"type": "string"}, "built": {"type": "integer"},
                                           "fuels": {"type": "array", "items": {"type": "string"}}},
          "required": ["lighthouse", "built", "fuels"]}
EXTRACT = [{"role": "user", "content": f"{DOCUMENT}\n\nExtract the lighthouse's name, the year it was built and "
            "every fuel its lamp burned, as JSON."}]


def constrained(server, messages: list, schema: dict, max_tokens: int, **kw) -> list:
    """Each choice's (text, finish reason, logprobs) of an answer under a JSON schema."""
    client = openai.OpenAI(base_url=server.v1, api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, logprobs=True,
                                       top_logprobs=3, response_format=fmt, **kw)
    return [(c.message.content, c.finish_reason, _lps(c.logprobs.content)) for c in r.choices]


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, seed=5)], ids=["greedy", "seeded"])
def test_a_json_schema_answer_drafts_and_is_the_same_as_without_speculation(servers, kw):
    """Drafts under a grammar: cut where the grammar stops taking them, each position
    sampled under its mask; the answer is token for token the constrained one."""
    plain, spec = servers
    drafts, accepted = spec.metric("spec_decode_num_drafts_total"), spec.metric("spec_decode_num_accepted_tokens_total")
    want = constrained(plain, EXTRACT, SCHEMA, 60, **kw)
    assert constrained(spec, EXTRACT, SCHEMA, 60, **kw) == want
    assert spec.metric("spec_decode_num_drafts_total") > drafts
    if kw["temperature"] == 0.0:
        assert '"lighthouse": "Carrow Point"' in want[0][0]  # copied from the prompt: drafts are taken
        assert spec.metric("spec_decode_num_accepted_tokens_total") > accepted


ROWS_SCHEMA = {"type": "object", "properties": {"keepers": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"lighthouse": {"type": "string"}, "from_year": {"type": "integer"},
                                     "to_year": {"type": "integer"}},
    "required": ["lighthouse", "from_year", "to_year"], "additionalProperties": False}}},
    "required": ["keepers"], "additionalProperties": False}
KEEPERS = [{"role": "user", "content": "Keepers: Ann Reid kept Carrow Point from 1871 to 1890, Tom Hale kept "
            "Dunmore Head from 1889 to 1901, May Lund kept Skerry Rock from 1902 to 1930. List them as JSON."}]


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, seed=11, top_p=0.95)],
                         ids=["greedy", "seeded"])
def test_the_grammars_forced_tokens_drafted_give_the_answer_without_speculation(servers, kw):
    """A schema whose keys and punctuation the grammar fixes: those tokens are drafted
    first (llguidance's fast-forward tokens) and verified as any draft; the answer (text,
    logprobs, finish reason) is token for token the constrained one, and drafts are kept."""
    plain, spec = servers
    accepted = spec.metric("spec_decode_num_accepted_tokens_total")
    want = constrained(plain, KEEPERS, ROWS_SCHEMA, 80, **kw)
    assert constrained(spec, KEEPERS, ROWS_SCHEMA, 80, **kw) == want
    assert '"from_year": ' in want[0][0]  # the keys the grammar forces were said
    assert spec.metric("spec_decode_num_accepted_tokens_total") >= accepted + 10
