"""OpenAI's Responses API on the default model, with the official openai client: text,
instructions, streaming events, function tools and previous_response_id, each checked
against the chat completion it stands for (greedy: the same tokens)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from hotprefix.model.loader import default_model_path
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv():
    s = start_server(default_model_path(), num_blocks_override=512, max_model_len=1024,
                     quantized_matmul="float32")  # token-identical with and without cached prefixes
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0)


def test_text_and_instructions_are_the_chat_completion(client, srv):
    r = client.responses.create(model="tiny", input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.object == "response" and r.id.startswith("resp_") and r.output[0].type == "message"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text
    srv.check_drained()


def test_a_stream_of_events_gives_the_same_text(client, srv):
    ask = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
           "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    srv.check_drained()


def test_function_calls_and_their_outputs_continue_a_stored_conversation(client, srv):
    r = client.responses.create(model="tiny", input="What is the weather in Oslo?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=60)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    nxt = client.responses.create(model="tiny", previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                  max_output_tokens=8, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                               "output": "12 C and sunny"}])
    assert nxt.previous_response_id == r.id and nxt.output_text
    # the same conversation written out as chat messages gives the same answer
    chat = client.chat.completions.create(model="tiny", temperature=0, max_completion_tokens=8, tools=[
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}], messages=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12 C and sunny"}])
    assert nxt.output_text == chat.choices[0].message.content
    srv.check_drained()


def test_what_is_not_kept_or_not_supported_is_named(client, srv):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    for rid in (r.id, "resp_unknown"):  # (404, as OpenAI answers: the same for another tenant's, see the gateway)
        with pytest.raises(openai.NotFoundError, match="not kept"):
            client.responses.create(model="tiny", input="again", previous_response_id=rid, max_output_tokens=2)
    kept = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert httpx.delete(f"{srv.v1}/responses/{kept.id}").json()["deleted"] is True
    assert httpx.get(f"{srv.v1}/responses/{kept.id}").status_code == 404
    for body, param in (({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                        ({"input": "x", "frobnicate": 1}, "frobnicate"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools")):
        bad = httpx.post(srv.v1 + "/responses", json={"model": "tiny", **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    srv.check_drained()


def test_a_response_is_kept_for_the_cache_salt_that_made_it(client, srv):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body={"cache_salt": "tenant-a"})
    assert httpx.get(f"{srv.v1}/responses/{r.id}", params={"cache_salt": "tenant-a"}).json()["id"] == r.id
    for other in ({"cache_salt": "tenant-b"}, {}):  # another salt, or none, does not reach it
        assert httpx.get(f"{srv.v1}/responses/{r.id}", params=other).status_code == 404
        assert httpx.delete(f"{srv.v1}/responses/{r.id}", params=other).status_code == 404
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="tiny", input="again", previous_response_id=r.id, max_output_tokens=2,
                                    extra_body=other)
    nxt = client.responses.create(model="tiny", input="again", previous_response_id=r.id, max_output_tokens=2,
                                  extra_body={"cache_salt": "tenant-a"})
    assert nxt.previous_response_id == r.id
    srv.check_drained()


def test_a_forced_call_cut_by_length_is_never_a_message_of_markup(client, srv):
    """tool_choice required with too few tokens for the call: no message item (no raw
    markup), no call, status incomplete; with enough, one call (parallel_tool_calls false)."""
    for seed in range(3):
        cut = client.responses.create(model="tiny", input="What is the weather in Oslo?", tools=[WEATHER],
                                      tool_choice="required", temperature=1.0, extra_body={"seed": seed},
                                      max_output_tokens=8)
        assert (cut.status, cut.incomplete_details.reason, cut.output) == ("incomplete", "max_output_tokens", [])
        one = client.responses.create(model="tiny", input="What is the weather in Oslo?", tools=[WEATHER],
                                      tool_choice="required", temperature=1.0, extra_body={"seed": seed},
                                      max_output_tokens=60, parallel_tool_calls=False)
        assert [o.type for o in one.output] == ["function_call"] and one.status == "completed"
    srv.check_drained()


def test_the_store_keeps_the_newest_within_its_count_and_bytes():
    from hotprefix.errors import InvalidRequestError
    from hotprefix.server.responses_api import ResponseStore

    store = ResponseStore(capacity=3, max_bytes=2500)
    msg = [{"role": "user", "content": "x" * 300}]
    for i in range(4):
        store.keep(f"r{i}", None, msg, {"id": f"r{i}"})
    assert [store.response(f"r{i}", None) is not None for i in range(4)] == [False, True, True, True]  # the count
    store.keep("big", None, [{"role": "user", "content": "y" * 1500}], {"id": "big"})  # the bytes: two more go
    assert [store.response(r, None) is not None for r in ("r1", "r2", "r3", "big")] == [False, False, True, True]
    # larger than the budget: not kept, and it evicts nothing
    assert store.keep("huge", None, [{"role": "user", "content": "z" * 5000}], {}) is False
    assert store.response("huge", None) is None and store.history("r3", None) == msg
    assert store.response("r3", "another-salt") is None  # kept under its salt only
    assert store.delete("r3", None) and store.delete("big", None) and store.bytes == 0
    with pytest.raises(InvalidRequestError, match="not kept"):
        store.history("r3", None)
    assert store.delete("huge", None) is False


def test_one_tenant_storing_many_responses_evicts_its_own():
    """The store is shared by a gateway's tenants (one salt each): when it is full, the
    scope holding the most loses its oldest, so a tenant storing 1,000 cheap responses
    never pushes out another tenant's conversation (it did: one LRU for all)."""
    from hotprefix.server.responses_api import ResponseStore

    store = ResponseStore(capacity=4, max_bytes=4000)
    msg = [{"role": "user", "content": "x" * 100}]
    store.keep("a1", "alice", msg, {})
    store.keep("a2", "alice", msg, {})
    for i in range(1000):
        store.keep(f"m{i}", "mallory", msg, {})
    assert store.response("a1", "alice") is not None and store.response("a2", "alice") is not None
    assert [i for i in range(1000) if store.response(f"m{i}", "mallory") is not None] == [998, 999]
    store.keep("big", "mallory", [{"role": "user", "content": "y" * 2500}], {})  # over the bytes: mallory's go first
    assert store.response("a1", "alice") is not None and store.response("a2", "alice") is not None
    assert [store.response(r, "mallory") is not None for r in ("m998", "m999", "big")] == [False, True, True]
    assert store.bytes == sum(len(v) + 256 for v in store._items.values())


def _aborted(srv) -> float:
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines
               if x.startswith("hotprefix:request_success_total{") and 'finished_reason="abort"' in x)


def test_a_client_leaving_a_stream_frees_everything(srv):
    """The client goes after the first delta while the engine thread is held between
    steps (so the answer cannot end first, however short it is): the request is aborted
    and nothing is left held."""
    before = _aborted(srv)
    gate, held = threading.Event(), threading.Event()

    def hold(_engine):
        held.set()
        gate.wait(30)

    holder = threading.Thread(target=srv.on_engine, args=(hold, 60))
    try:
        with httpx.stream("POST", srv.v1 + "/responses", timeout=60, json={
                "model": "tiny", "input": "Count to fifty.", "max_output_tokens": 200, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("event: response.output_text.delta"):
                    holder.start()
                    assert held.wait(30)
                    break  # the client goes
        deadline = time.monotonic() + 30
        while _aborted(srv) != before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _aborted(srv) == before + 1  # aborted when the client went, while it could not have ended
    finally:
        gate.set()
        if holder.is_alive() or held.is_set():
            holder.join(60)
    srv.check_drained()
