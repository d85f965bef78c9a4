"""Every field of OpenAI's Responses request (the `openai` package's
response_create_params) is taken by /v1/responses: honoured, accepted and ignored with
the chat path's log line (it cannot change the tokens), or refused with a 400 naming it
(ignoring it would change the answer). The table below is the whole list: a field the
`openai` package adds fails the first test until it is placed."""

from __future__ import annotations

import logging
import typing

import httpx
import pytest
from openai.types.responses import response_create_params

from hotprefix.server.responses_request import ResponsesRequest
from tests.server.conftest import start_server

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}

# field: (what it does here, a value to send)
FIELDS: dict[str, tuple[str, typing.Any]] = {
    "input": (HONOURED, "hi"),
    "model": (HONOURED, "tiny"),
    "instructions": (HONOURED, "Answer briefly."),
    "max_output_tokens": (HONOURED, 3),
    "temperature": (HONOURED, 0.0),
    "top_p": (HONOURED, 0.5),
    "stream": (HONOURED, False),
    "tools": (HONOURED, [TOOL]),
    "tool_choice": (HONOURED, "none"),
    "parallel_tool_calls": (HONOURED, False),
    "previous_response_id": (HONOURED, None),  # (a continuation: its own test)
    "store": (HONOURED, False),
    "text": (HONOURED, {"format": {"type": "text"}}),
    "metadata": (HONOURED, {"k": "v"}),
    "user": (HONOURED, "u1"),
    "top_logprobs": (HONOURED, 2),
    "include": (HONOURED, ["message.output_text.logprobs"]),
    "truncation": (IGNORED, "auto"),
    "reasoning": (IGNORED, {"effort": "low"}),
    "service_tier": (IGNORED, "auto"),
    "prompt_cache_key": (IGNORED, "k1"),
    "prompt_cache_retention": (IGNORED, "24h"),
    "prompt_cache_options": (IGNORED, {"mode": "implicit"}),
    "safety_identifier": (IGNORED, "user-1"),
    "stream_options": (IGNORED, {"include_obfuscation": False}),
    "max_tool_calls": (IGNORED, 2),
    "access_programs": (IGNORED, {"cyber": "standard"}),
    "image": (IGNORED, {"context_compression": "auto"}),
    "background_options": (IGNORED, {"completion_window": "soonest"}),
    "background": (REFUSED, True),
    "conversation": (REFUSED, "conv_1"),
    "prompt": (REFUSED, {"id": "pmpt_1"}),
    "context_management": (REFUSED, [{"type": "compaction", "compact_threshold": 1000}]),
    "moderation": (REFUSED, {"model": "omni-moderation-latest"}),
}


def test_the_table_is_every_field_of_the_openai_request():
    names = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert set(FIELDS) == names
    assert names <= set(ResponsesRequest.model_fields)


@pytest.fixture(scope="module")
def srv(tiny_llama):
    s = start_server(tiny_llama[0], max_model_len=1024)  # its own: what it has logged is this module's
    yield s
    s.stop()


def _post(srv, **fields) -> httpx.Response:
    return httpx.post(srv.v1 + "/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3,
                                                   **fields}, timeout=60)


def _ignored(caplog) -> list[str]:
    """The fields the server said it ignored (the chat path's line)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "hotprefix.requests"]
    return [line.split(" ")[2] for line in lines if line.endswith(
        "accepted and ignored: it cannot change a result on this server (logged once)")]


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_field_is_honoured_ignored_or_refused_by_name(srv, caplog, name):
    kind, value = FIELDS[name]
    caplog.set_level(logging.INFO, logger="hotprefix.requests")
    r = _post(srv, **({name: value} if value is not None else {}))
    if kind == REFUSED:
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    else:
        assert r.status_code == 200, r.text
        assert name not in _ignored(caplog) or kind == IGNORED


def test_ignored_fields_are_named_once_each_and_harmless_values_are_not_refused(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="hotprefix.requests")
    s = start_server(tiny_llama[0], max_model_len=1024)
    try:
        for harmless in ({"background": False}, {"context_management": []}, {"include": []},
                         {"truncation": "disabled"}, {"include": ["message.output_text.logprobs"]}):
            assert _post(s, **harmless).status_code == 200, harmless
        assert _ignored(caplog) == []
        every = {name: value for name, (kind, value) in FIELDS.items() if kind == IGNORED}
        for _ in range(2):
            r = _post(s, **every, text={"format": {"type": "text"}, "verbosity": "low"},
                      include=["reasoning.encrypted_content"])
            assert r.status_code == 200, r.text
    finally:
        s.stop()
    assert sorted(_ignored(caplog)) == sorted([*every, "text.verbosity", "include"])  # once each


def test_output_logprobs_come_with_include_and_hosted_tools_are_refused(srv):
    body = _post(srv, include=["message.output_text.logprobs"], top_logprobs=2, temperature=0).json()
    (part,) = body["output"][0]["content"]
    assert len(part["logprobs"]) == body["usage"]["output_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and set(e) == {"token", "logprob", "bytes", "top_logprobs"}
               for e in part["logprobs"])
    assert "logprobs" not in _post(srv, top_logprobs=2).json()["output"][0]["content"][0]
    for choice in ({"type": "web_search"}, {"type": "mcp", "server_label": "x"}):
        bad = _post(srv, tools=[TOOL], tool_choice=choice)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    for tool in ({**TOOL, "defer_loading": True}, {**TOOL, "allowed_callers": ["programmatic"]}):
        bad = _post(srv, tools=[tool])
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(("fields", "param"), [
    ({"text": {"format": "json_object"}}, "text"),
    ({"text": {"format": ["json_object"]}}, "text"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 5}}, "tool_choice"),
    ({"tools": [{**TOOL, "allowed_callers": 5}]}, "tools"),
])
def test_a_field_of_the_wrong_shape_is_a_400_naming_it(srv, fields, param):
    """Objects whose parts the request's model leaves open (text, tool_choice, tools) read
    with the shapes OpenAI gives them: another shape is a 400 naming the field (it was a 500
    from an AttributeError or a TypeError), and nothing is left running."""
    r = _post(srv, **fields)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("BadRequestError", param), r.text
    srv.check_drained()


def test_a_tool_whose_allowed_callers_is_null_is_called_directly(srv):
    """null is the field left out (as the SDKs send unset fields): a function called
    directly (it was a 500: `"direct" in None`)."""
    r = _post(srv, tools=[{**TOOL, "allowed_callers": None}])
    assert r.status_code == 200, r.text
