"""The OpenAI Agents SDK, unchanged, against `hotprefix serve`: its default model class
(OpenAIResponsesModel, over /v1/responses) runs a one-tool agent, streamed and not.

Greedy (temperature 0) and one call forced (tool_choice "required", parallel_tool_calls
false), so each run is a function of its input: the tool is called once with schema-valid arguments, the run
stops on it, and a second agent continuing the conversation (the function_call and its
output as input items) answers exactly what the same conversation gives as a chat
completion."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

from tests.server.test_responses_api import srv  # noqa: F401 - the default model's server (a fixture)

pytestmark = pytest.mark.slow
QUESTION = "What is the weather in Oslo?"


def weather_agent(calls: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"12 C and sunny in {city}"

    return Agent(name="forecaster", instructions="You answer questions about the weather.", tools=[get_weather],
                 model="tiny", tool_use_behavior="stop_on_first_tool",
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                              max_tokens=60))


def run_config(url: str) -> RunConfig:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    return RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


async def _run(url: str, stream: bool) -> tuple[list[str], object, list[str]]:
    """(the tool's calls, the run's result, the kinds of the streamed events)."""
    calls: list[str] = []
    agent = weather_agent(calls)
    if not stream:
        return calls, await Runner.run(agent, QUESTION, run_config=run_config(url)), []
    result = Runner.run_streamed(agent, QUESTION, run_config=run_config(url))
    kinds = [ev.type async for ev in result.stream_events()]
    return calls, result, kinds


def test_a_one_tool_agent_runs_streamed_and_not(srv):  # noqa: F811
    calls, result, _ = asyncio.run(_run(srv.v1, stream=False))
    (city,) = calls
    assert city and result.final_output == f"12 C and sunny in {city}"
    streamed_calls, streamed, kinds = asyncio.run(_run(srv.v1, stream=True))
    assert streamed_calls == calls and streamed.final_output == result.final_output
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    srv.check_drained()


def test_a_second_agent_continues_from_the_tool_output_as_chat_would(srv):  # noqa: F811
    calls, result, _ = asyncio.run(_run(srv.v1, stream=False))
    writer = Agent(name="writer", instructions="Tell the user the weather in one sentence.", model="tiny",
                   model_settings=ModelSettings(temperature=0, max_tokens=16))
    items = result.to_input_list()
    answer = asyncio.run(Runner.run(writer, items, run_config=run_config(srv.v1))).final_output
    call = next(i for i in items if i.get("type") == "function_call")
    output = next(i for i in items if i.get("type") == "function_call_output")
    chat = openai.OpenAI(base_url=srv.v1, api_key="unused").chat.completions.create(
        model="tiny", temperature=0, max_completion_tokens=16, messages=[
            {"role": "system", "content": "Tell the user the weather in one sentence."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call["call_id"], "type": "function",
                                                                    "function": {"name": call["name"],
                                                                                 "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": output["call_id"], "content": output["output"]}])
    assert json.loads(call["arguments"]) == {"city": calls[0]}
    assert answer == chat.choices[0].message.content and answer
    srv.check_drained()
