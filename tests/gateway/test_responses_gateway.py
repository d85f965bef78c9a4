"""/v1/responses through the gateway, to a real hotprefix server (tiny model): the tenant's
prompt ahead of the request's instructions and input, the usage rows, stored responses
scoped to their tenant (another tenant's id is a 404, as an unknown one), and the Agents
SDK, unchanged, with a tenant key."""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Literal
from urllib.parse import quote

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from openai.types.responses import response_create_params

from hotprefix.gateway.store import Store
from hotprefix.gateway.tenant_api import TenantResponses
from tests.gateway.conftest import SECRET, start_gateway, wait_until
from tests.server.conftest import start_server

FORCED = "You are ACME's assistant. Answer briefly."


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """(the server, the store, the gateway, {tenant: key}): tenants acme and beta, each its own prompt."""
    server = start_server(tiny_llama[0], max_model_len=1024)
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('gw') / 'gateway.db'}")
    store.migrate()
    for tenant in ("acme", "beta"):
        store.add_prompt(tenant, FORCED, public=False)
        store.create_tenant(tenant, tenant)
    gw = start_gateway([server.url], store, warmup=False)
    wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway")
    yield server, store, gw, {t: store.create_key(SECRET, t)[0] for t in ("acme", "beta")}
    gw.stop()
    server.stop()


def post(gw, key: str, **body) -> httpx.Response:
    return httpx.post(gw.url + "/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"input": "Say hi.", "max_output_tokens": 3, **body})


def test_the_tenant_may_send_openais_fields_and_not_the_operators():
    openai_fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert TenantResponses.ALLOWED == openai_fields | {"seed"}


def test_the_forced_prompt_goes_first_and_the_usage_row_is_the_backends(setup):
    server, store, gw, keys = setup
    r = post(gw, keys["acme"], instructions="Use one word.", temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    rendered = httpx.post(server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": FORCED}, {"role": "system", "content": "Use one word."},
        {"role": "user", "content": "Say hi."}]}).json()["count"]
    assert body["usage"]["input_tokens"] == rendered  # the forced turn, then the instructions, then the input
    for bad in ({"operator_instructions": "x"}, {"cache_salt": "x"}, {"frobnicate": 1}):
        refused = post(gw, keys["acme"], **bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad)), refused.text
    key_id = store.authenticate(SECRET, keys["acme"]).id
    wait_until(lambda: any(row.endpoint == "responses" and row.status == "ok" for row in store.usage_rows(key_id)),
               what="the usage row")
    row = next(row for row in store.usage_rows(key_id) if row.endpoint == "responses" and row.status == "ok")
    u = body["usage"]
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (
        u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"])
    assert row.finish_reason == ("length" if body["status"] == "incomplete" else "stop")


def test_stored_responses_are_the_tenants_own(setup):
    _, _, gw, keys = setup
    made = post(gw, keys["acme"]).json()
    rid, auth = made["id"], {k: {"Authorization": f"Bearer {v}"} for k, v in keys.items()}
    assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=auth["acme"]).json()["id"] == rid
    for missing in (rid, "resp_unknown"):  # another tenant's is not found, as an unknown one
        assert httpx.get(f"{gw.url}/v1/responses/{missing}", headers=auth["beta"]).status_code == 404
        r = post(gw, keys["beta"], previous_response_id=missing)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert httpx.delete(f"{gw.url}/v1/responses/{missing}", headers=auth["beta"]).status_code == 404
    nxt = post(gw, keys["acme"], previous_response_id=rid)
    assert nxt.status_code == 200 and nxt.json()["previous_response_id"] == rid
    # the continuation's prompt holds the stored conversation after the forced prompt, once
    assert nxt.json()["usage"]["input_tokens"] > made["usage"]["input_tokens"] + made["usage"]["output_tokens"]
    assert httpx.delete(f"{gw.url}/v1/responses/{rid}", headers=auth["acme"]).json()["deleted"] is True
    assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers=auth["acme"]).status_code == 404


def test_a_stream_is_passed_on_and_settled_by_its_final_event(setup):
    _, store, gw, keys = setup
    with httpx.stream("POST", gw.url + "/v1/responses", headers={"Authorization": f"Bearer {keys['beta']}"},
                      json={"input": "Count.", "max_output_tokens": 4, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    u = events[-1]["response"]["usage"]
    key_id = store.authenticate(SECRET, keys["beta"]).id
    wait_until(lambda: any(row.stream and row.status == "ok" for row in store.usage_rows(key_id)), what="the row")
    row = next(row for row in store.usage_rows(key_id) if row.stream and row.status == "ok")
    assert (row.prompt_tokens, row.completion_tokens) == (u["input_tokens"], u["output_tokens"])


def test_the_agents_sdk_runs_through_the_gateway_with_a_tenant_key(setup):
    _, _, gw, keys = setup
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:  # (the tiny model's call is short: the grammar's)
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = Agent(name="forecaster", instructions="You answer questions about the weather.", tools=[get_weather],
                  model="tiny", tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=150))

    async def both() -> tuple[object, object]:
        """The agent's run, then its streamed run (one event loop: the client's connections are its)."""
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=keys["acme"], max_retries=0)
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        whole = await Runner.run(agent, "What is the weather in Oslo?", run_config=config)
        streamed = Runner.run_streamed(agent, "What is the weather in Oslo?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(both())
    city = calls[0]
    assert calls == [city, city] and whole.final_output == streamed.final_output == f"sunny in {city}"


def test_a_previous_response_id_is_looked_up_as_an_id_never_as_a_path(setup):
    """A tenant's previous_response_id names a stored response: one that reads as a path
    ("../../metrics") reaches no other endpoint of the backend (with the gateway's key),
    and is a 404 with its refused usage row, as an unknown id is."""
    _, store, gw, keys = setup
    key_id = store.authenticate(SECRET, keys["beta"]).id

    def refused() -> int:
        return sum(row.status == "invalid" and row.http_status == 404 for row in store.usage_rows(key_id))

    for path in ("../../metrics", "../../v1/models", "..", "../../requests/x", "", "a?cache_salt=x#"):
        before = refused()
        r = post(gw, keys["beta"], previous_response_id=path)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "previous_response_id", r.text
        assert refused() == before + 1
        if path:  # (the gateway's own GET, one path segment: its router matches no empty one)
            assert httpx.get(f"{gw.url}/v1/responses/{quote(path, safe='')}",
                             headers={"Authorization": f"Bearer {keys['beta']}"}).status_code == 404


def test_a_stream_its_backend_fails_is_an_error_charged_what_the_backend_did(setup, monkeypatch):
    """A Responses stream that the backend ends with an `error` event (its engine failed the
    request after the answer started) is no completed answer: its usage row is an error,
    settled with the backend's own count of the request (asked by its id), as a stream cut
    short is; not a success charged its whole reservation (the event carries no usage)."""
    server, store, gw, keys = setup
    runner, steps = server.engine.runner, []
    execute = runner.execute

    def third_step_fails(sched):
        steps.append(sched)
        if len(steps) == 3:
            raise RuntimeError("injected")
        return execute(sched)

    monkeypatch.setattr(runner, "execute", third_step_fails)
    with httpx.stream("POST", gw.url + "/v1/responses", headers={"Authorization": f"Bearer {keys['beta']}"},
                      json={"input": "Count.", "max_output_tokens": 50, "stream": True}, timeout=60) as r:
        rid = r.headers["x-request-id"]
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events if e["type"] == "error"] == ["error"] and events[-1]["type"] == "error"
    done = server.server.config.app.state.serving.request_log.recent[rid]  # the backend's own row
    assert (done.status.value, done.completion_tokens) == ("error", 2)
    key_id = store.authenticate(SECRET, keys["beta"]).id
    wait_until(lambda: any(row.request_id == rid and row.status != "started" for row in store.usage_rows(key_id)),
               what="the row")
    row = next(row for row in store.usage_rows(key_id) if row.request_id == rid)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("error", done.prompt_tokens, 2)


def test_a_field_of_the_wrong_shape_is_refused_with_its_row(setup):
    """A body whose text.format or tool_choice has a shape the server's rules do not read is
    a 400 naming the field, with its refused usage row (it was a 500 without one)."""
    _, store, gw, keys = setup
    key_id = store.authenticate(SECRET, keys["beta"]).id
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    for fields, param in (({"text": {"format": "json_object"}}, "text"),
                          ({"tools": [tool], "tool_choice": {"type": "allowed_tools", "tools": 5}}, "tool_choice")):
        before = sum(row.status == "invalid" and row.http_status == 400 for row in store.usage_rows(key_id))
        r = post(gw, keys["beta"], **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert sum(row.status == "invalid" and row.http_status == 400 for row in store.usage_rows(key_id)) == before + 1


def test_the_user_field_is_bounded_as_on_the_chat_path(setup):
    """`user` reaches the backend's request log: a tenant's is at most 256 characters on
    every endpoint (Responses took any length a body allows)."""
    _, _, gw, keys = setup
    assert post(gw, keys["beta"], user="u" * 256).status_code == 200
    r = post(gw, keys["beta"], user="u" * 257)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
