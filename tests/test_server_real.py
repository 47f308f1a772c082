"""`omnidraft serve` on real models (SmolLM2-135M drafting for Qwen2.5-Coder-0.5B, and for the
1.5B), over real HTTP: a tool-call round trip with the `openai` client, and openai-agents agents
that use a tool.

Qwen2.5-Coder-0.5B, asked with tool_choice "auto" (what agents send), writes its call as bare
JSON, no <tool_call> tags: the server reads a reply of only such JSON as the call. After the
tool's result it writes the call again rather than an answer, so the agent's whole task (call,
result, answer) runs on Qwen2.5-Coder-1.5B (pulled on first use, like the others).
"""

import asyncio
import json

import pytest
from openai import AsyncOpenAI, OpenAI
from test_server_tools import WEATHER

from omnidraft_mlx.bench.load_test import ServerProcess

pytestmark = pytest.mark.real
DRAFT, TARGET = "smollm2-135m", "qwen2.5-coder-0.5b"
QUESTION = {"role": "user", "content": "What is the weather in Paris? Use the tool."}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-real")
    srv = ServerProcess(DRAFT, TARGET, root / "server.log", "--no-profile", "--no-adapt", "--max-tokens", "48")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def test_openai_tool_call_round_trip(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    auto = client.chat.completions.create(
        model=TARGET, messages=[QUESTION], tools=[WEATHER], temperature=0, max_tokens=32
    )  # tool_choice "auto": the model's bare JSON is the call
    (call,) = auto.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.content is None
    chunks = list(
        client.chat.completions.create(
            model=TARGET,
            messages=[QUESTION],
            tools=[WEATHER],
            tool_choice="auto",
            temperature=0,
            max_tokens=32,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Paris"})]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    reply = client.chat.completions.create(
        model=TARGET, messages=[QUESTION], tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=32
    )
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.finish_reason == "tool_calls" and choice.message.content is None

    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        client.chat.completions.create(
            model=TARGET,
            messages=[QUESTION],
            tools=[WEATHER],
            tool_choice=named,
            temperature=0,
            max_tokens=32,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert deltas[0].id.startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"

    said = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}
    answer = client.chat.completions.create(
        model=TARGET, messages=[QUESTION, said, result], tools=[WEATHER], temperature=0, max_tokens=32
    )
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_responses_and_messages_tool_call_round_trips(server):
    """The call comes back as a function_call item (Responses) and a tool_use block (Messages),
    streamed and not; its result sent back gets an answer."""
    import anthropic

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    tool = {"type": "function", **WEATHER["function"]}
    reply = client.responses.create(model=TARGET, input=[QUESTION], tools=[tool], max_output_tokens=32)
    (call,) = reply.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    events = list(
        client.responses.create(model=TARGET, input=[QUESTION], tools=[tool], max_output_tokens=32, stream=True)
    )
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}] and events[-1].type == "response.completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, cloudy"}
    said = [QUESTION, call.model_dump(), result]
    answer = client.responses.create(model=TARGET, input=said, tools=[tool], max_output_tokens=32)
    assert answer.output and answer.usage.input_tokens > reply.usage.input_tokens

    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    claude_tool = {"name": "get_weather", "description": "The weather in a city"}
    claude_tool["input_schema"] = WEATHER["function"]["parameters"]
    said = claude.messages.create(model=TARGET, max_tokens=32, messages=[QUESTION], tools=[claude_tool])
    (use,) = said.content
    assert (use.type, use.name, use.input, said.stop_reason) == (
        "tool_use",
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )
    with claude.messages.stream(model=TARGET, max_tokens=32, messages=[QUESTION], tools=[claude_tool]) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", {"city": "Paris"})]
    back = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees, cloudy"}
    messages = [QUESTION, {"role": "assistant", "content": said.content}, {"role": "user", "content": [back]}]
    assert claude.messages.create(model=TARGET, max_tokens=32, messages=messages, tools=[claude_tool]).content


def weather_agent(server, target: str, responses: bool = False, **kw):
    """An openai-agents agent on the server's model, in its default tool_choice ("auto"), with a
    get_weather tool, through /v1/chat/completions or (responses) through /v1/responses, as the
    framework's default model class speaks; (the agent, the cities the tool was asked about)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing leaves the machine
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"{city}: 18 degrees Celsius, cloudy"

    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    model = kind(model=target, openai_client=AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0))
    settings = ModelSettings(temperature=0, max_tokens=48)
    return Agent(
        name="weather",
        instructions="Use the get_weather tool, then answer the question in one sentence.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
        **kw,
    ), asked


@pytest.mark.parametrize("responses", [False, True], ids=["chat-completions", "responses"])
def test_an_openai_agents_agent_uses_a_tool_through_the_server(server, responses):
    """The agent picks the tool and its argument through the server, streamed and not, on the chat
    completions model class and on the framework's default one (the Responses API); the tool's
    result is its answer (stop_on_first_tool: after a tool result, with the tools still offered,
    this small model writes the same call again, as JSON, rather than an answer)."""
    from agents import Runner

    agent, asked = weather_agent(server, TARGET, responses, tool_use_behavior="stop_on_first_tool")

    async def ask() -> tuple[str, str]:  # one event loop: the client's connections belong to it
        done = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        streamed = Runner.run_streamed(agent, "What is the weather in Lyon?", max_turns=2)
        async for _ in streamed.stream_events():
            pass
        return done.final_output, streamed.final_output

    assert asyncio.run(ask()) == ("Paris: 18 degrees Celsius, cloudy", "Lyon: 18 degrees Celsius, cloudy")
    assert asked == ["Paris", "Lyon"]


def test_an_agent_on_qwen_1_5b_answers_from_the_tools_result(tmp_path):
    """The whole task, as agents run it: the call, the tool's result sent back, then the model's
    own answer, all in auto mode (Qwen2.5-Coder-1.5B, which writes an answer after a result)."""
    from agents import Runner

    srv = ServerProcess(
        DRAFT, "qwen2.5-coder-1.5b", tmp_path / "server.log", "--no-profile", "--no-adapt", "--max-tokens", "48"
    )
    try:
        agent, asked = weather_agent(srv, "qwen2.5-coder-1.5b")
        done = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    assert asked == ["Paris"] and [type(item).__name__ for item in done.new_items] == [
        "ToolCallItem",
        "ToolCallOutputItem",
        "MessageOutputItem",
    ]
    assert "18 degrees" in done.final_output and "Paris" in done.final_output
