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


CUT = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "\n<tool_call>\n",
       '{"name":']


def _answer(pieces: list[str], reason: str, parallel: bool = True, stream: bool = True) -> tuple:
    """(content, call names, finish reason) of a chat answer made of `pieces`, streamed or whole."""
    choices = Choices(HermesParser(), logprobs=False, parallel=parallel)
    text, calls, finish = "", [], None
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        o = CompletionOutput(0, "".join(pieces[:k + 1]), list(range(k + 1)), reason if last else None)
        if not stream:
            if last:
                c = choices.whole(0, o)
                return c.text, [f.name for f in c.calls], c.finish_reason
            continue
        for c in choices.step(0, RequestOutput("r", None, [7], [o], [piece], last, [[k]]), 1):
            text, calls, finish = text + (c.text or ""), calls + [f.name for f in c.calls], c.finish_reason or finish
    return text or None, calls, finish


def test_a_call_cut_by_length_is_dropped_and_the_answer_says_what_it_holds():
    for stream in (True, False):
        assert _answer(CUT, "length", stream=stream) == (None, ["get_weather"], "tool_calls")  # complete calls
        assert _answer(CUT[1:], "length", stream=stream) == (None, [], "length")  # only a cut call: no text
        assert _answer(["Let me see.", *CUT[1:]], "length", stream=stream) == ("Let me see.", [], "length")
        assert _answer(["Let me see.\n", *CUT], "length", stream=stream) == ("Let me see.", ["get_weather"], "length")


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = [CUT[0], "\n" + CUT[0].replace("get_weather", "get_time")]
    for stream in (True, False):
        assert _answer(two, "stop", stream=stream) == (None, ["get_weather", "get_time"], "tool_calls")
        assert _answer(two, "stop", parallel=False, stream=stream) == (None, ["get_weather"], "tool_calls")
