"""The llama3_json and mistral tool-call parsers (vLLM's names), their streaming form
and their grammars for tool_choice "required"/named: exact events, exact decisions."""

from __future__ import annotations

import pytest

from hotprefix.cli import TOOL_CALL_PARSERS
from hotprefix.server.tool_parsers import PARSERS, Llama3JsonParser, MistralParser, ParsedCall
from tests.unit.test_tool_parsers import CLOCK, WEATHER, accepts  # noqa: F401 - the fixture

L, M = Llama3JsonParser(), MistralParser()
W = ParsedCall("get_weather", '{"city": "Paris"}')
C = ParsedCall("get_time", '{"zone": "CET"}')
L_W = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
L_C = '{"name": "get_time", "parameters": {"zone": "CET"}}'
M_BOTH = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
         '{"name": "get_time", "arguments": {"zone": "CET"}}]'


def test_the_cli_names_every_parser():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


@pytest.mark.parametrize("text,content,calls", [
    (L_W, None, [W]),
    ("<|python_tag|>" + L_W, None, [W]),
    (L_W + "; " + L_C, None, [W, C]),
    ("  " + L_W + " ;" + L_C + "\n", None, [W, C]),
    ('{"name": "get_time", "arguments": {"zone": "CET"}}', None, [C]),  # "arguments" is read too
    ("The weather is fine.", "The weather is fine.", []),
    ("Call " + L_W, "Call " + L_W, []),  # calls open the reply, or it is content
    (L_W + " and more", L_W + " and more", []),  # not calls alone: content, byte for byte
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ("", None, []),
])
def test_llama3_json_parse(text, content, calls):
    assert L.parse(text) == (content, calls)


@pytest.mark.parametrize("text,content,calls", [
    (M_BOTH, None, [W, C]),
    ("Let me check. " + M_BOTH, "Let me check.", [W, C]),
    ('[TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "CET"}}', None, [C]),  # one object, no list
    ("no calls here", "no calls here", []),
    ("[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', []),
])
def test_mistral_parse(text, content, calls):
    assert M.parse(text) == (content, calls)


def _stream(parser, pieces: list[str]) -> list:
    s = parser.streamer()
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    merged: list = []
    for kind, v in events:  # adjacent content pieces are one piece of text
        if merged and kind == "content" and merged[-1][0] == "content":
            merged[-1] = ("content", merged[-1][1] + v)
        else:
            merged.append((kind, v))
    return merged


@pytest.mark.parametrize("parser,text,events", [
    (L, L_W + "; " + L_C, [("call", W), ("call", C)]),
    (L, "<|python_tag|>" + L_W, [("call", W)]),
    (L, "Sunny, 21 C. {not a call}", [("content", "Sunny, 21 C. {not a call}")]),
    (L, L_W + " trailing", [("content", L_W + " trailing")]),
    (L, "<|python", [("content", "<|python")]),
    (M, "Let me check. " + M_BOTH, [("content", "Let me check. "), ("call", W), ("call", C)]),
    (M, "text [TOOL_CA", [("content", "text [TOOL_CA")]),
    (M, "[TOOL_CALLS][{broken", [("content", "[TOOL_CALLS][{broken")]),
])
def test_streaming_at_every_split_gives_the_same_events(parser, text, events):
    assert _stream(parser, [text]) == events
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]]) == events, i
    assert _stream(parser, list(text)) == events


def test_text_that_may_open_a_call_is_held_until_it_cannot():
    s = L.streamer()
    assert s.feed("  ") == [] and s.feed("<|py") == []  # undecided: could be a call
    assert s.feed("thon") == [] and s.feed("x") == [("content", "  <|pythonx")]
    assert s.feed(" {") == [("content", " {")]  # calls open the reply only
    s = M.streamer()
    assert s.feed("Hi [TOOL") == [("content", "Hi ")] and s.feed("S]") == [("content", "[TOOLS]")]


@pytest.mark.parametrize("parser,only,parallel,text,ok", [
    (L, None, False, L_W, True),
    (L, None, False, L_C, True),
    (L, None, False, L_W + "; " + L_C, False),  # one call only
    (L, None, True, L_W + "; " + L_C, True),
    (L, "get_time", False, L_W, False),
    (L, None, False, '{"name": "get_weather", "parameters": {"zone": "CET"}}', False),
    (L, None, False, '{"name":"get_weather","parameters":{"city":"Paris"}}', False),  # compact JSON: not ours
    (M, None, True, M_BOTH, True),
    (M, None, False, M_BOTH, False),
    (M, None, False, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', True),
    (M, "get_weather", False, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', False),
    (M, None, False, '[{"name": "get_time", "arguments": {"zone": "CET"}}]', False),  # no marker
])
def test_the_grammars_accept_exactly_calls_in_their_format(accepts, parser, only, parallel, text, ok):  # noqa: F811
    grammar = parser.grammar([WEATHER, CLOCK], only, parallel)
    assert accepts(grammar, text) is ok
    if ok:  # and what the grammar lets through parses back into those calls
        assert parser.parse(text)[1]


@pytest.mark.parametrize("parser,text,content,calls", [
    (L, L_W + '; {"name": "get_ti', None, [W]),  # the cut second call is dropped, the first kept
    (L, '{"name": "get_weather", "param', None, []),
    (L, L_W + "; " + L_C, None, [W, C]),
    (L, "The weather is", "The weather is", []),
    (M, M_BOTH[:-30], None, [W]),
    (M, 'Let me check. [TOOL_CALLS][{"name": "get_w', "Let me check.", []),
    (M, M_BOTH, None, [W, C]),
])
def test_a_call_cut_by_length_is_never_content(parser, text, content, calls):
    assert parser.parse(text, cut=True) == (content, calls)
    s = parser.streamer()
    events = [e for ch in text for e in s.feed(ch)] + s.finish(cut=True)
    assert "".join(v for k, v in events if k == "content").strip() == (content or "")
    assert [v for k, v in events if k == "call"] == calls
