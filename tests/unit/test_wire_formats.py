"""One typed result, several wire formats: a chat answer with a tool call, made into typed
choices once (results.Choices), then written as OpenAI chat chunks and as Responses events;
neither format reads the other's text, and both name the call by the same id."""

from __future__ import annotations

import json

from hotprefix.engine.outputs import CompletionOutput, RequestOutput
from hotprefix.server.openai_format import ChatFormat, OpenAIStream
from hotprefix.server.responses_api import ResponsesRequest, ResponsesStream
from hotprefix.server.results import Choices, Done, Failed, Step, Usage
from hotprefix.server.tool_parsers import HermesParser

PIECES = ["Sure.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']


def events() -> list:
    """The engine's outputs for PIECES (one token each), as the typed events Serving makes."""
    choices, out = Choices(HermesParser(), logprobs=False), []
    for k, piece in enumerate(PIECES):
        last = k == len(PIECES) - 1
        o = CompletionOutput(0, "".join(PIECES[:k + 1]), list(range(k + 1)), "stop" if last else None)
        step = choices.step(0, RequestOutput("r", None, [7, 8, 9], [o], [piece], last, [[k]]), 1)
        if step:
            out.append(Step(0, step, Usage(3, k + 1, 0)))
    return out + [Done(Usage(3, len(PIECES), 0))]


def payloads(texts: list[str]) -> list:
    return [t.split("data: ", 1)[1].strip() for t in texts]


def test_a_tool_call_is_typed_once_and_written_as_chat_chunks_and_as_responses_events():
    evs = events()
    assert [len(e.choices) for e in evs[:-1]] == [1, 1]  # the pieces that held back text add nothing
    (text,), (call,) = evs[0].choices, evs[1].choices
    assert (text.text, call.text, call.finish_reason) == ("Sure.", "", "tool_calls")
    (fn,) = call.calls
    assert (fn.name, fn.arguments) == ("get_weather", '{"city": "Oslo"}')

    chat = OpenAIStream(ChatFormat(str, 0), "chatcmpl-1", "tiny", 1, None)
    chunks = payloads(chat.start() + [t for ev in evs for t in chat.write(ev)])
    assert chunks[-1] == "[DONE]"
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in map(json.loads, chunks[:-1])]
    assert deltas == [({"role": "assistant", "content": ""}, None), ({"content": "Sure."}, None),
                      ({"tool_calls": [{"index": 0, **fn.openai()}]}, "tool_calls")]

    kept = []
    responses = ResponsesStream("resp_1", ResponsesRequest(input="x"), "tiny", lambda c, r: kept.append((c, r)))
    sent = [json.loads(p) for p in payloads(responses.start() + [t for ev in evs for t in responses.write(ev)])]
    assert [e["sequence_number"] for e in sent] == list(range(1, 13))
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = sent[-1]["response"]
    assert [(o["type"], o.get("call_id")) for o in final["output"]] == [("message", None), ("function_call", fn.id)]
    assert final["output"][0]["content"][0]["text"] == "Sure." and final["status"] == "completed"
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (3, 4)
    ((choice, response),) = kept
    assert choice.calls == (fn,) and response == final


def test_a_failure_is_one_error_in_each_format():
    chat = OpenAIStream(ChatFormat(str, 0), "chatcmpl-1", "tiny", 1, None)
    assert payloads(chat.write(Failed("bad grammar", own=True))) == [
        json.dumps({"error": {"message": "bad grammar", "type": "BadRequestError", "param": None, "code": 400}}),
        "[DONE]"]
    responses = ResponsesStream("resp_1", ResponsesRequest(input="x"), "tiny", lambda c, r: None)
    (err,) = responses.write(Failed("engine died", own=False))
    assert err.startswith("event: error\n") and json.loads(payloads([err])[0]) == {
        "type": "error", "sequence_number": 1, "code": "500", "message": "engine died", "param": None}
