"""Structured outputs and tool calls on the default model (SmolLM2-135M-Instruct), over
real HTTP with the official openai client: JSON schema, JSON mode, regex, choice and
grammars enforced by the token mask; tool calls constrained, parsed, streamed, sent
back; the tool block served from the prefix cache on the next agent step."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from hotprefix.grammar_build import MAX_CHOICES, grammar_of
from hotprefix.model.loader import default_model_path
from hotprefix.sampling_params import StructuredKind
from tests.server.conftest import LiveServer, start_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[LiveServer]:
    s = start_server(default_model_path(), num_blocks_override=1024, max_model_len=2048, block_size=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0)


def chat(client, **kw):
    """One chat completion; an error status fails the test with the server's own message."""
    try:
        return client.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 120, **kw})
    except openai.APIStatusError as e:
        raise AssertionError(f"HTTP {e.status_code}: {e.response.text[:500]}") from None


class City(BaseModel):
    name: str
    country: str
    population: int
    capital: bool


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model="tiny", response_format=City, max_tokens=200, temperature=0,
                                      messages=[{"role": "user", "content": "Describe Paris."}])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City) and msg.parsed == City.model_validate_json(msg.content)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 12},
                                                           "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_on_completions_validates(srv, seed):
    r = httpx.post(srv.v1 + "/completions", timeout=120, json={
        "model": "tiny", "prompt": "A user record in JSON:\n", "max_tokens": 160, "temperature": 1.0, "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), PERSON)


def _valid_json_prefix(srv, text: str) -> bool:
    """Whether `text` can still be completed to a JSON object (llguidance's matcher,
    fed the text's bytes as tokens)."""
    import llguidance

    g = srv.engine.grammars
    m = llguidance.LLMatcher(g.tokenizer, grammar_of(StructuredKind.JSON_OBJECT, ""))
    return m.consume_tokens(srv.engine.tokenizer.encode(text, add_special_tokens=False)) and not m.is_error()


def test_json_mode_output_always_parses(srv, client):
    """16 seeds at temperature 1, batched: every answer the model ends is a JSON object;
    one cut by max_tokens is the start of one. Unconstrained, the same requests give no
    JSON."""
    ask = [{"role": "user", "content": "Describe a fictional person."}]

    def both(seed: int) -> tuple[str, str, str]:
        r = chat(client, messages=ask, response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                 max_tokens=256)
        free = chat(client, messages=ask, temperature=1.0, seed=seed, max_tokens=256)
        return r.choices[0].message.content, r.choices[0].finish_reason, free.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(both, range(16)))
    ended = 0
    for text, reason, free in results:
        if reason == "stop":
            ended += 1
            assert isinstance(json.loads(text), dict), text
        else:
            assert reason == "length" and _valid_json_prefix(srv, text), text
        with pytest.raises(json.JSONDecodeError):
            json.loads(free)
    assert ended >= 4  # the check above ran on real answers (measured: 14 of 20 end within 200 tokens)


@pytest.mark.parametrize("field,value,check", [
    ("structured_outputs", {"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("guided_regex", "(cat|dog)s? [a-z]{2,5}", lambda t: re.fullmatch(r"(cat|dog)s? [a-z]{2,5}", t)),
    ("structured_outputs", {"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("structured_outputs", {"grammar": 'root ::= ("up" | "down") " " [0-9] [0-9]? "!"'},
     lambda t: re.fullmatch(r"(up|down) [0-9][0-9]?!", t)),
    ("guided_grammar", 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]{0,3}/', lambda t: re.fullmatch(r"x=[1-9][0-9]{0,3};", t)),
    ("structured_outputs", {"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     lambda t: [type(v) for v in json.loads(t)] == [bool, bool]),
])
def test_regex_choice_and_grammars_hold_at_temperature_1(client, field, value, check):
    for seed in range(3):
        r = chat(client, temperature=1.0, seed=seed, max_tokens=40, extra_body={field: value})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and check(text), (seed, text)


@pytest.mark.parametrize("extra,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "json_schema", "Invalid type: strnig"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "json_schema", "/nope"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "regex", "invalid regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "grammar", "invalid grammar"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "grammar", "missing_rule"),
    ({"structured_outputs": {"choice": []}}, "choice", "non-empty list"),
    ({"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "choice", f"at most {MAX_CHOICES}"),
    ({"structured_outputs": {"regex": "a{1000000}"}}, "regex", "--max-grammar-repeat"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "structured output"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "tool_choice", "cannot both"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
])
def test_bad_constraints_are_a_400_naming_the_problem(srv, extra, param, needle):
    r = httpx.post(srv.v1 + "/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 5, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"] == "BadRequestError", err
    srv.check_drained()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 4}])
def test_a_grammar_that_must_end_wins_over_min_tokens(client, sampling):
    """vLLM's rule: min_tokens holds back the stop tokens only while the grammar allows
    something else. A choice complete after a token or two ends there, "stop", the answer
    token for token the one without min_tokens; a regex that may go on gives min_tokens."""
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    free = chat(client, max_tokens=20, logprobs=True, extra_body=choice, **sampling)
    held = chat(client, max_tokens=20, logprobs=True, extra_body={**choice, "min_tokens": 10}, **sampling)
    tokens = [[t.token for t in r.choices[0].logprobs.content] for r in (free, held)]
    assert held.choices[0].message.content in ("yes", "no") and held.choices[0].finish_reason == "stop"
    assert tokens[1] == tokens[0] and held.usage.completion_tokens == free.usage.completion_tokens < 10
    digits = {"structured_outputs": {"regex": "[0-9]{1,12}"}}
    r = chat(client, max_tokens=20, extra_body={**digits, "min_tokens": 6}, **sampling)
    text = r.choices[0].message.content
    assert re.fullmatch("[0-9]{6,12}", text) and r.choices[0].finish_reason == "stop", text


def test_a_grammar_compiles_once_per_spec(srv, client):
    grammars = srv.engine.grammars
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 7, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}  # bounded: every answer ends within max_tokens
    before = (grammars.misses, grammars.hits)
    for seed in range(3):
        text = chat(client, seed=seed, temperature=1.0, extra_body={"guided_json": schema}).choices[0].message.content
        assert 7 <= json.loads(text)["n"] <= 999
    after = (grammars.misses, grammars.hits)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 5)  # compiled once; copied per sequence


def _call_args(call) -> dict:
    return json.loads(call.function.arguments)


def test_required_tool_calls_match_the_schema(client):
    for seed in range(6):
        r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        choice = choice0 = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice0
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
            jsonschema.validate(_call_args(call), fn["parameters"])
            props = fn["parameters"]["properties"]
            assert all(_call_args(call)[k] != "" for k in fn["parameters"]["required"]
                       if props[k]["type"] == "string")  # a forced call fills what its function requires
            assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_a_call_cut_by_length_never_leaks_as_content(client):
    """A forced call with a tight max_tokens: a call cut short is dropped, never content;
    the answer ends "tool_calls" with the calls it completed, else "length" with none.
    Too few tokens for one call: always the latter (the grammar writes a call at once)."""
    seen = set()
    for max_tokens, seeds in ((8, range(3)), (45, range(6))):
        for seed in seeds:
            r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=max_tokens)
            c = r.choices[0]
            assert c.message.content is None, c
            assert c.finish_reason == ("tool_calls" if c.message.tool_calls else "length"), c
            assert max_tokens > 8 or c.message.tool_calls is None
            for call in c.message.tool_calls or ():
                jsonschema.validate(_call_args(call), {t["function"]["name"]: t["function"] for t in TOOLS}[
                    call.function.name]["parameters"])
            seen.add((len(c.message.tool_calls or ()), r.usage.completion_tokens == max_tokens))
    assert (0, True) in seen  # (a cut that completed no call happened, at 8 tokens)


def test_streamed_a_cut_call_is_never_content(client):
    for chunk in chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1, max_tokens=8,
                      stream=True):
        if chunk.choices:
            assert not chunk.choices[0].delta.content and not chunk.choices[0].delta.tool_calls
            assert chunk.choices[0].finish_reason in (None, "length")


def test_a_named_tool_choice_and_no_parallel_calls_give_one_call_to_it(client):
    for seed in range(3):
        r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parallel_tool_calls=False, temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and set(_call_args(call)) == {"zone"}


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        r = chat(client, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=30)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_reassemble_to_the_same_calls(client):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0.8, seed=5)
    whole = chat(client, **kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # nothing of the call leaks as text
        for d in delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or d.id
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert [r for r in reasons if r] == ["tool_calls"] == [whole.finish_reason]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, _call_args(c)) for c in whole.message.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls.values())


def _tokens(srv, messages, tools=None) -> list[int]:
    body = {"model": "tiny", "messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(srv.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_next_agent_step_reads_the_tool_block_from_the_cache(srv, client):
    """Step 1 calls a tool; step 2 sends the call and its result back. Step 2's prompt
    starts with step 1's, and every full block of that (tools included) is a cache hit."""
    system = [{"role": "system", "content": "You are a weather assistant for travellers. " * 8}]
    step1 = system + [{"role": "user", "content": "What is the weather in Oslo?"}]
    r1 = chat(client, messages=step1, tools=TOOLS, tool_choice="required", temperature=0)
    (call,) = r1.choices[0].message.tool_calls[:1]
    step2 = step1 + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": -3, "sky": "snow"}'}]
    r2 = chat(client, messages=step2, tools=TOOLS, temperature=0, max_tokens=20)
    assert r2.choices[0].finish_reason in ("stop", "length")
    p1, p2 = _tokens(srv, step1, TOOLS), _tokens(srv, step2, TOOLS)
    assert _tokens(srv, step1, TOOLS) == p1 and r2.usage.prompt_tokens == len(p2)  # rendering is deterministic
    shared = _common(p1, p2)
    tool_block = _common(_tokens(srv, system + [{"role": "user", "content": "?"}], TOOLS), p1)
    assert shared > tool_block > len(_tokens(srv, system)) - 8  # the tools sit in the shared part
    assert r2.usage.prompt_tokens_details.cached_tokens >= shared // 16 * 16 > tool_block - 16
    # the tools were rendered: without them the prompt is shorter
    assert len(_tokens(srv, step1)) < len(p1) - 100


def test_a_tool_answer_turn_is_accepted_without_tools(client):
    msgs = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = chat(client, messages=msgs, temperature=0, max_tokens=10)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_a_grammar_too_slow_mid_answer_fails_alone(srv, client, monkeypatch):
    """A mask over the budget on the engine thread fails that request (its error says
    why; a 400: its own grammar's fault), and the request after it is served."""
    from hotprefix.model import structured

    monkeypatch.setattr(structured, "MASK_BUDGET_S", -1.0)  # every later mask is "too slow"
    r = httpx.post(srv.v1 + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": ASK, "max_tokens": 20, "response_format": {"type": "json_object"}})
    ok = chat(client, max_tokens=5)
    monkeypatch.undo()
    assert r.status_code == 400 and "too complex to enforce" in r.json()["error"]["message"], r.text
    assert ok.choices[0].message.content
    srv.check_drained()


def test_a_matcher_failing_mid_request_is_the_requests_own_400(srv, monkeypatch):
    """A grammar whose matcher fails at its third token (as a huge enum's did, inside
    llguidance) fails that request alone: a 400 (its own fault, not a retryable 500),
    in-band for a stream after its first tokens; nothing is left held."""
    from hotprefix.model.structured import GrammarMatchers

    real, seen = GrammarMatchers.compute, {}

    def failing(self, requests):
        masks = real(self, requests)
        for rid, *_ in requests:  # (request id, constraint, draft)
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] >= 3:
                masks.forbidden.pop(rid, None)
                masks.failed[rid] = "the grammar matcher failed: (injected) parser too complex"
        return masks

    monkeypatch.setattr(GrammarMatchers, "compute", failing)
    body = {"model": "tiny", "messages": ASK, "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_object"}}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError" and "(injected) parser too complex" in r.text
    with httpx.stream("POST", srv.v1 + "/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text and "error" in events[-1] and "error" not in events[-2]  # tokens first, then the error
    assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["type"] == "BadRequestError"
    monkeypatch.undo()
    srv.check_drained()
