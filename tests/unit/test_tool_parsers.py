"""The Hermes tool-call parser, its streaming form, and the grammar behind
tool_choice "required"/named: exact events and exact accept/reject decisions."""

from __future__ import annotations

import json

import pytest

from hotprefix.server.tool_parsers import HermesParser, ParsedCall, call_grammar

P = HermesParser()
W_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
C_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
W = ParsedCall("get_weather", '{"city": "Paris"}')
C = ParsedCall("get_time", '{"zone": "CET"}')


@pytest.mark.parametrize("text,content,calls", [
    (W_CALL, None, [W]),
    ("Let me look.\n" + W_CALL, "Let me look.", [W]),
    (W_CALL + "\nDone.", "Done.", [W]),
    ("A\n" + W_CALL + "\nB\n", "A\nB", [W]),
    (W_CALL + "\n" + C_CALL, None, [W, C]),
    ("plain answer", "plain answer", []),
    ("", None, []),
    # arguments written as JSON text, or under "parameters", are read as objects
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', None, [C]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>', None, [C]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [ParsedCall("f", "{}")]),
    # not calls: they stay content, byte for byte
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     []),
    ('<tool_call>\n{"name": "f", "arguments": {}}', '<tool_call>\n{"name": "f", "arguments": {}}', []),  # unclosed
    ("a <tool_response>x</tool_response>", "a <tool_response>x</tool_response>", []),
])
def test_parse(text, content, calls):
    assert P.parse(text) == (content, calls)


def test_arguments_keep_non_ascii_text():
    _, calls = P.parse('<tool_call>{"name": "w", "arguments": {"city": "Zürich 東京"}}</tool_call>')
    assert calls == [ParsedCall("w", '{"city": "Zürich 東京"}')]
    assert json.loads(calls[0].arguments) == {"city": "Zürich 東京"}


def _stream(pieces: list[str]) -> list:
    s = P.streamer()
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    merged: list = []  # adjacent content events join: how they split depends on the deltas
    for kind, value in events:
        if kind == "content" and merged and merged[-1][0] == "content":
            merged[-1] = ("content", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


@pytest.mark.parametrize("text", [
    "Let me look.\n" + W_CALL + "\n" + C_CALL + "\nDone.",
    "a <tool_response>x</tool_response> b",
    "<tool_call>{not json}</tool_call> tail",
    "open <tool_call>\n{\"name\": \"f\"",
    "ends with <tool_c",
])
def test_streaming_at_every_split_gives_the_same_events(text):
    whole = _stream([text])
    for i in range(len(text) + 1):
        assert _stream([text[:i], text[i:]]) == whole, i
    assert _stream(list(text)) == whole  # one character a delta


def test_streamed_events_match_the_parser():
    text = "Let me look.\n" + W_CALL + "\n" + C_CALL + "\nDone."
    assert _stream(list(text)) == [("content", "Let me look."), ("call", W), ("call", C), ("content", "\nDone.")]
    assert P.parse(text) == ("Let me look.\nDone.", [W, C])
    assert _stream(["Hi  \n", W_CALL, "\n\n"]) == [("content", "Hi"), ("call", W)]


def test_a_possible_call_start_is_held_until_it_is_not_one():
    s = P.streamer()
    assert s.feed("Hi <tool_") == [("content", "Hi")]  # the space waits for what follows it
    assert s.feed("resp") == [("content", " <tool_resp")]
    assert s.feed("<tool_call>") == []
    assert s.feed('{"name": "f", "arguments": {}}</tool_call>') == [("call", ParsedCall("f", "{}"))]
    assert s.finish() == []


def test_unfinished_text_is_released_at_the_end():
    s = P.streamer()
    assert s.feed("x <tool_call") == [("content", "x")]
    assert s.finish() == [("content", " <tool_call")]
    s = P.streamer()
    assert s.feed('<tool_call>{"name"') == []
    assert s.finish() == [("content", '<tool_call>{"name"')]


# --- the grammar for tool_choice "required" / a named function -------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def accepts():
    import llguidance

    from hotprefix.grammar import tokenizer_json
    from hotprefix.model.loader import default_model_path, gguf_tokenizer

    hf = gguf_tokenizer(default_model_path())
    tok = llguidance.LLTokenizer(tokenizer_json(hf), eos_token=hf.eos_token_id)  # as GrammarCompiler makes it

    def check(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        ids = tok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    return check


@pytest.mark.parametrize("only,parallel,text,ok", [
    (None, False, W_CALL, True),
    (None, False, C_CALL, True),
    (None, False, W_CALL + "\n" + C_CALL, False),  # one call only
    (None, True, W_CALL + "\n" + C_CALL, True),
    (None, True, W_CALL + "\n" + W_CALL + "\n" + C_CALL, True),
    (None, False, '<tool_call>\n{"name": "get_weather", "arguments": {"zone": "CET"}}\n</tool_call>', False),
    (None, False, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', False),
    (None, False, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>', False),  # compact
    (None, False, "Sure. " + W_CALL, False),
    (None, False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', False),  # unclosed
    ("get_time", False, C_CALL, True),
    ("get_time", False, W_CALL, False),
    ("get_time", True, C_CALL + "\n" + C_CALL, True),
    ("get_time", True, C_CALL + "\n" + W_CALL, False),
])
def test_call_grammar(accepts, only, parallel, text, ok):
    assert accepts(call_grammar([WEATHER, CLOCK], only, parallel), text) is ok


def test_call_grammar_of_a_function_without_parameters_takes_any_object(accepts):
    g = call_grammar([NO_PARAMS], None, False)
    assert accepts(g, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert accepts(g, '<tool_call>\n{"name": "ping", "arguments": {"a": [1, 2]}}\n</tool_call>')
    assert not accepts(g, '<tool_call>\n{"name": "ping", "arguments": []}\n</tool_call>')


def test_every_call_the_grammar_accepts_parses_back(accepts):
    text = W_CALL + "\n" + C_CALL
    assert accepts(call_grammar([WEATHER, CLOCK], None, True), text)
    assert P.parse(text) == (None, [W, C])


def test_a_forced_call_fills_its_required_strings(accepts):
    """{"city": ""} satisfies the schema but is no call: required strings need a character
    (in every format's grammar); optional ones, enums and a schema's own minLength are kept."""
    from hotprefix.server.tool_parsers import PARSERS

    g = call_grammar([WEATHER], None, False)
    assert accepts(g, W_CALL)
    assert not accepts(g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": ""}}\n</tool_call>')
    for name in ("llama3_json", "mistral"):
        wrapped = PARSERS[name].grammar([WEATHER], None, False)
        assert '"minLength": 1' in wrapped
    opt = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "minLength": 0},
                                         "c": {"type": "object", "properties": {"d": {"type": "string"}},
                                               "required": ["d"]}},
        "required": ["b", "c"]}}}
    g = call_grammar([opt], None, False)
    call = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'.format
    assert accepts(g, call('{"a": "", "b": "", "c": {"d": "x"}}'))  # a optional, b's own minLength 0
    assert not accepts(g, call('{"b": "", "c": {"d": ""}}'))  # nested required d
    assert opt["function"]["parameters"]["properties"]["c"]["properties"]["d"] == {"type": "string"}  # not mutated


@pytest.mark.parametrize("text,content,calls", [
    (W_CALL + "\n<tool_call>\n{\"name\":", None, [W]),  # the cut second call is dropped
    ('<tool_call>\n{"name": "get_we', None, []),
    ("Let me look.\n<tool_c", "Let me look.", []),  # a cut marker too
    ("Let me look.\n" + W_CALL, "Let me look.", [W]),  # nothing cut: as without cut
    ("a plain answer, cut", "a plain answer, cut", []),
])
def test_a_call_cut_by_length_is_never_content(text, content, calls):
    assert P.parse(text, cut=True) == (content, calls)
    s = P.streamer()
    events = [e for ch in text for e in s.feed(ch)] + s.finish(cut=True)
    assert "".join(v for k, v in events if k == "content").strip() == (content or "")
    assert [v for k, v in events if k == "call"] == calls
