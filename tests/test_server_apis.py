"""The Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages) on `omnidraft serve`:
the real server process on the tiny pair, with the official `openai` and `anthropic` clients (raw
httpx for bodies a client would not send). Greedy replies equal the target's plain decoding of
the same prompt, as through /v1/chat/completions."""

import anthropic
import httpx
import pytest
from openai import NotFoundError
from test_server import KEY, chat_greedy, error_of
from test_server_tools import WEATHER, client, server, template_greedy  # noqa: F401 (client, server: fixtures)

from omnidraft_mlx.prompts import encode_prompt

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
CLAUDE_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def test_responses_whole_and_streamed_are_the_targets_greedy_reply(client, tiny, tiny_dirs):
    model = str(tiny_dirs["target"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add_3(x):"}]
    ids, text = chat_greedy(tiny, messages, 12)

    reply = client.responses.create(model=model, instructions="Be brief.", input="def add_3(x):", max_output_tokens=12)
    assert reply.output_text == text and reply.model == model
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == len(ids) == 12
    assert reply.usage.input_tokens == len(encode_prompt(tiny["target"][1], messages))
    spec = reply.usage.speculative  # what the drafter did, as on the chat route
    assert spec["proposed"] >= spec["accepted"] >= 0 and spec["rounds"] >= 1

    events = list(
        client.responses.create(
            model=model,
            instructions="Be brief.",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "def add_3(x):"}]}],
            max_output_tokens=12,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and "".join(deltas) == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    assert events[-4].text == text

    done = client.responses.create(model=model, input="print(add_", max_output_tokens=16, temperature=0, top_p=1)
    assert done.output_text == chat_greedy(tiny, [{"role": "user", "content": "print(add_"}], 16)[1]


def test_previous_response_id_continues_the_conversation(server, client, tiny):
    first = client.responses.create(input="def add_3(x):", max_output_tokens=8, store=True)
    second = client.responses.create(previous_response_id=first.id, input="print(add_", max_output_tokens=8)
    messages = [
        {"role": "user", "content": "def add_3(x):"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "print(add_"},
    ]
    assert second.output_text == chat_greedy(tiny, messages, 8)[1] and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt was not prefilled again
    third = client.responses.create(previous_response_id=second.id, input="def add_7(x):", max_output_tokens=8)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "def add_7(x):"}]
    assert third.output_text == chat_greedy(tiny, messages, 8)[1]

    with pytest.raises(NotFoundError) as e:
        client.responses.create(previous_response_id="resp_gone", input="x")
    assert e.value.body["param"] == "previous_response_id" and "resp_gone" in e.value.body["message"]
    unkept = client.responses.create(input="def add_3(x):", max_output_tokens=4, store=False)
    with pytest.raises(NotFoundError):
        client.responses.create(previous_response_id=unkept.id, input="x")


def test_responses_with_a_function_tool_and_its_output(client, tiny):
    """The call and its output as input items render as the chat route's tool_calls and tool message."""
    items = [
        {"role": "user", "content": "def weather(city):"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "print(add_3(18))"},
    ]
    rendered = [
        items[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "print(add_3(18))"},
    ]
    ids, text = template_greedy(tiny, rendered, [WEATHER], 12)
    reply = client.responses.create(input=items, tools=[TOOL], max_output_tokens=12)
    assert reply.output_text == text and reply.usage.input_tokens == len(ids)
    assert [o.type for o in reply.output] == ["message"]  # this tiny model has no tool-call format: all text
    streamed = client.responses.create(input=items, tools=[TOOL], tool_choice="auto", max_output_tokens=12, stream=True)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text


def test_messages_whole_and_streamed_are_the_targets_greedy_reply(claude, tiny, tiny_dirs):
    model = str(tiny_dirs["target"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add_3(x):"}]
    ids, text = chat_greedy(tiny, messages, 12)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    user = [{"role": "user", "content": [{"type": "text", "text": "def add_3(x):"}]}]

    reply = claude.messages.create(model=model, max_tokens=12, system=system, messages=user)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == text
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 12
    prompt = len(encode_prompt(tiny["target"][1], messages))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt

    with claude.messages.stream(model=model, max_tokens=12, system="Be brief.", messages=user) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds

    _, longer = chat_greedy(tiny, messages, 16)
    stop = longer.strip()[3:6]  # somewhere inside the reply
    cut = claude.messages.create(model=model, max_tokens=16, system="Be brief.", messages=user, stop_sequences=[stop])
    assert cut.content[0].text == longer[: longer.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert claude.messages.count_tokens(model=model, system="Be brief.", messages=user).input_tokens == prompt


def test_messages_tool_round_trip(claude, tiny, tiny_dirs):
    """An assistant's tool_use and the user's tool_result render as the chat route's tool_calls and tool message."""
    messages = [
        {"role": "user", "content": "def weather(city):"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(add_3(18))"}]},
    ]
    rendered = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(add_3(18))"},
    ]
    _, text = template_greedy(tiny, rendered, [WEATHER], 12)
    model = str(tiny_dirs["target"])
    reply = claude.messages.create(
        model=model, max_tokens=12, messages=messages, tools=[CLAUDE_TOOL], tool_choice={"type": "auto"}
    )
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == text
    with claude.messages.stream(model=model, max_tokens=12, messages=messages, tools=[CLAUDE_TOOL]) as stream:
        assert stream.get_final_message().content[0].text == text


def anthropic_error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


def test_bad_bodies_get_each_apis_errors_and_the_server_keeps_serving(server):
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path, body, headers=auth):
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        return httpx.post(server.url + path, headers={"Content-Type": "application/json", **headers}, timeout=60, **kw)

    ok = {"input": "def add_3(x):", "max_output_tokens": 4}
    assert "not valid JSON" in error_of(post("/v1/responses", '{"input": '), 400)["message"]
    for field, value in [
        ("background", True),
        ("conversation", "conv_1"),
        ("top_logprobs", 2),
        ("text", {"format": {"type": "json_schema", "name": "x", "schema": {}}}),
        ("tools", [{"type": "custom", "name": "patch"}]),
        ("tool_choice", "required"),
        ("temperature", 5),
        ("max_output_tokens", 0),
        ("input", [{"type": "item_reference", "id": "x"}]),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        ("input", [{"role": "robot", "content": "hi"}]),
        ("input", []),
    ]:
        err = error_of(post("/v1/responses", {**ok, field: value}), 400)
        assert field in err["message"] or field in (err["param"] or "") or "messages" in (err["param"] or ""), err
    assert error_of(post("/v1/responses", {**ok, "model": "gpt-5"}), 404)["code"] == "model_not_found"
    assert error_of(post("/v1/responses", ok, headers={}), 401)["code"] == "invalid_api_key"
    fine = {"store": False, "metadata": {"a": "b"}, "user": "u", "parallel_tool_calls": False, "include": []}
    fine |= {"reasoning": {"effort": "low"}, "truncation": "auto", "text": {"format": {"type": "text"}}}
    hosted = {"tools": [{"type": "web_search"}, TOOL], "prompt_cache_key": "k", "service_tier": "auto"}
    assert post("/v1/responses", {**ok, **fine, **hosted}).json()["usage"]["output_tokens"] == 4

    good = {"max_tokens": 4, "messages": [{"role": "user", "content": "def add_3(x):"}]}
    assert "not valid JSON" in anthropic_error_of(post("/v1/messages", '{"max'), 400)["message"]
    for field, value in [
        ("top_k", 5),
        ("temperature", 1.5),
        ("messages", []),
        ("messages", [{"role": "robot", "content": "hi"}]),
        ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        ("tools", [{"type": "bash_20250124", "name": "bash"}]),
        ("tool_choice", {"type": "any"}),
        ("output_config", {"format": {"type": "json_schema", "schema": {}}}),
        ("stop_sequences", ["a", "b", "c", "d", "e"]),
    ]:
        err = anthropic_error_of(post("/v1/messages", {**good, field: value}), 400)
        assert err["type"] == "invalid_request_error" and (field in err["message"] or "messages" in err["message"]), err
    assert anthropic_error_of(post("/v1/messages", {**good, "model": "claude-x"}), 404)["type"] == "not_found_error"
    assert anthropic_error_of(post("/v1/messages", good, headers={}), 401)["type"] == "authentication_error"
    wrong = {"x-api-key": "wrong", "anthropic-version": "2023-06-01"}
    assert anthropic_error_of(post("/v1/messages", good, headers=wrong), 401)["type"] == "authentication_error"
    claude_code = {"thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"}, "context_management": {"edits": []}}
    claude_code |= {
        "output_config": {"effort": "high"},
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    claude_code |= {"messages": good["messages"] + [{"role": "system", "content": "Be brief."}]}
    keyed = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    reply = post("/v1/messages?beta=true", {**good, **claude_code}, headers=keyed).json()
    assert reply["usage"]["output_tokens"] == 4 and reply["type"] == "message"
    assert httpx.head(server.url + "/").status_code == 200  # Claude Code's first request

    # Still serving, and nothing above reached the engine as a failure.
    assert post("/v1/responses", ok).json()["usage"]["output_tokens"] == 4
    assert server.health()["failed"] == 0


def test_a_prompt_past_the_context_gets_each_apis_400(server, client, claude, tiny_dirs):
    """Refused before it is decoded, streamed or not, with the chat route's reason."""
    long = "def add_3(x): " * 1500
    with pytest.raises(Exception) as e:
        client.responses.create(input=long, stream=True)
    assert getattr(e.value, "status_code", None) == 400 and "context" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=str(tiny_dirs["target"]), max_tokens=4, messages=[{"role": "user", "content": long}]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error" and "context" in e.value.body["error"]["message"]
    assert server.health()["failed"] == 0
