"""Tool calling, log-probabilities and response_format on `omnidraft serve`: the tool-call
splitters on strings (mlx-lm's own parser for tagged calls, and the JSON replies of tool_choice
"auto"; a tiny random model never writes a call), and the real server process on the tiny pair
with the `openai` client (raw httpx for bad requests)."""

import json

import httpx
import mlx.core as mx
import pytest
from mlx_lm.tool_parsers import json_tools
from openai import OpenAI
from test_server import KEY, error_of, start

from omnidraft_mlx.decode.plain import PlainStats, plain_generate
from omnidraft_mlx.serve.text import ToolSplit, splitter
from omnidraft_mlx.serve.tools import ToolFormat, ToolPlan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
QWEN = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, [WEATHER])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def split(text: str, pieces: list[int], opened: str | None = None, tools=None) -> list:
    """A splitter's events (ToolSplit's unless given) for `text` sent in pieces cut at these offsets, then finished."""
    tools, events, cuts = tools or ToolSplit(QWEN, opened), [], [0, *pieces, len(text)]
    for a, b in zip(cuts, cuts[1:]):
        events += tools.add(text[a:b])
    events += tools.finish()
    merged = []  # adjacent text events joined: where a piece ends is not the splitter's business
    for kind, payload in events:
        if merged and kind == merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + payload)
        else:
            merged.append((kind, payload))
    return merged


def all_cuts(text: str) -> list[list[int]]:
    """The ways split() is asked to cut a text: once at each offset, and into pieces a character each."""
    return [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]


def calls_of(events) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for kind, p in events
        if kind == "tool_calls"
        for c in p
    ]


def test_a_tool_call_is_split_from_the_text_wherever_the_pieces_break():
    text = "Let me look.\n" + CALL + "\nDone."
    for cut in range(1, len(text)):
        events = split(text, [cut])
        assert [k for k, _ in events] == ["text", "tool_calls", "text"], cut
        assert events[0][1] == "Let me look.\n" and events[2][1] == "\nDone."
        assert calls_of(events) == [("get_weather", {"city": "Paris"})]
        (call,) = events[1][1]
        assert call["type"] == "function" and call["id"].startswith("call_")


def test_two_calls_and_a_call_the_reply_ended_inside():
    events = split(CALL + CALL.replace("Paris", "Lyon"), [5, 40, 90])
    assert calls_of(events) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    unclosed = split(CALL.removesuffix("\n</tool_call>"), [11])
    assert calls_of(unclosed) == [("get_weather", {"city": "Paris"})]
    ran_on = split(CALL.removesuffix("\n</tool_call>") + '\n{"name": "get_weather_args"}', [20])
    assert calls_of(ran_on) == [("get_weather", {"city": "Paris"})]
    assert ran_on[-1] == ("text", '\n{"name": "get_weather_args"}')  # written past the call: text
    opened = split('get_weather", "arguments": {"city": "Paris"}}', [3], opened='\n{"name": "')
    assert calls_of(opened) == [("get_weather", {"city": "Paris"})]


def test_malformed_tool_calls_come_back_as_text():
    for bad in [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
        '<tool_call>\n["get_weather"]\n</tool_call>',  # JSON, not a call
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>',  # no JSON reply holds NaN
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": 1e400}"}\n</tool_call>',  # inf
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',  # cut short (max_tokens)
    ]:
        assert split("ok " + bad, [4, 12]) == [("text", "ok " + bad)]
    assert split("a <tool_ca", [3]) == [("text", "a <tool_ca")]  # held back, then let go at the end


def auto() -> object:
    """The splitter of a tool_choice "auto" reply, get_weather and get_time offered, in Qwen's format."""
    return splitter(ToolPlan([WEATHER, TIME], QWEN, bare=True))


PARIS, ZONE = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})
JSON_REPLIES = {  # what Qwen2.5-Coder 0.5B and 1.5B write in auto mode (the first four), and the like
    '{"name": "get_weather", "arguments": {"city": "Paris"}}': [PARIS],
    '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "zone": "Europe/Paris"\n  }\n}\n```': [ZONE],
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```': [PARIS],
    '{{"name": "get_weather", "arguments": {"city": "Paris"}}}': [PARIS],  # the 1.5B template's doubled braces
    '\n ```\n[{"name": "get_weather", "parameters": {"city": "Paris"}},\n {"name": "get_time", "arguments": '
    '{"zone": "Europe/Paris"}}]\n```\n': [PARIS, ZONE],
    '  {"name": "get_weather", "arguments": {"city": "Paris \\"}{[ "}}\n\n': [("get_weather", {"city": 'Paris "}{[ '})],
}


def test_a_reply_of_only_json_calls_is_tool_calls_wherever_the_pieces_break():
    for text, expected in JSON_REPLIES.items():
        for cuts in all_cuts(text):
            events = split(text, cuts, tools=auto())
            assert [k for k, _ in events] == ["tool_calls"] and calls_of(events) == expected, (text, cuts)
    assert calls_of(split(CALL, [7], tools=auto())) == [PARIS]  # Qwen's own tags still work


def test_other_replies_to_auto_stay_text_wherever_the_pieces_break():
    for text in [
        '```json\n{\n  "name": "add_numbers",\n  "arguments": {\n    "a": 5\n  }\n}\n```',  # not offered
        'Call it so: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # prose around the call
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\nThat gets the weather.',
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\nThat gets it.',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}',  # two calls, not in a list (the 0.5B after a tool's result)
        '{"name": "get_weather", "description": "w", "parameters": {"type": "object"}}',  # a definition
        '{"name": "get_weather", "arguments": "Paris"}',
        '{"name": "get_weather", "arguments": {"city": Infinity}}',
        '{"name": "get_weather"}',
        "[]",
        "{}",
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
        '{"name": get_weather}',
        "[1, 2]",
        "```python\ndef f(): pass\n```",
        "The weather is fine.",
        "",
    ]:
        for cuts in all_cuts(text):
            assert split(text, cuts, tools=auto()) == ([("text", text)] if text else []), (text, cuts)


WRITE_STDIN = {  # one of Codex CLI 0.171's tools, as it offers it
    "type": "function",
    "function": {
        "name": "write_stdin",
        "description": "Writes characters to an existing unified exec session and returns recent output.",
        "parameters": {
            "type": "object",
            "properties": {
                "chars": {
                    "type": "string",
                    "description": "Bytes to write to stdin. Defaults to empty, which polls without writing.",
                },
                "max_output_tokens": {
                    "type": "number",
                    "description": "Output token budget. Defaults to 10000 tokens; larger requests may be "
                    "capped by policy.",
                },
                "session_id": {"type": "number", "description": "Identifier of the running unified exec session."},
                "yield_time_ms": {
                    "type": "number",
                    "description": "Wait before yielding output. Non-empty writes default to 250 ms and cap at "
                    "30000 ms; empty polls wait 5000-300000 ms by default.",
                },
            },
            "required": ["session_id"],
            "additionalProperties": False,
        },
    },
}
WRITE_CALL = (
    '```json\n{\n  "name": "write_stdin",\n  "arguments": {\n    "chars": "print(\'hello, world\')\\n",\n'
    '    "max_output_tokens": 10000,\n    "session_id": 1\n  }\n}\n```\n'
)


def test_a_json_call_block_that_ends_a_reply_after_text_is_a_tool_call():
    """The 1.5B's replies to Codex CLI in the agents-cli run of record: its tool's definition
    written back, then the call in a ```json block."""
    echo = "<tools>\n" + json.dumps(WRITE_STDIN) + "\n</tools>\n"
    wrote = ("write_stdin", {"chars": "print('hello, world')\n", "max_output_tokens": 10000, "session_id": 1})
    for text, before in [
        (echo + "\n" + WRITE_CALL, echo.removesuffix("\n")),  # the line breaks before the block go with it
        (echo + WRITE_CALL, echo.removesuffix("\n")),
        ("I will call it.\n```json\n" + CALL[12:-13] + "\n```", "I will call it."),
    ]:
        for cuts in all_cuts(text):
            events = split(text, cuts, tools=splitter(ToolPlan([WEATHER, WRITE_STDIN], QWEN, bare=True)))
            assert [k for k, _ in events] == ["text", "tool_calls"] and events[0][1] == before, (text, cuts)
            assert calls_of(events) == [wrote if "write" in text else PARIS]
    for text in [
        "See:\n```json\n" + CALL[12:-13] + "\n```\nThat gets it.",  # text after the block
        "See:\n" + CALL[12:-13],  # a bare call after text
        "See: ```json\n" + CALL[12:-13] + "\n```",  # a block that opens inside a line
        "See:\n```python\nget_weather('Paris')\n```",
        'See:\n```json\n{"name": "add", "arguments": {}}\n```',  # not offered
    ]:
        for cuts in all_cuts(text):
            assert split(text, cuts, tools=auto()) == [("text", text)], (text, cuts)


def test_a_reply_that_cannot_be_json_calls_streams_as_soon_as_it_shows():
    for opening, held in [
        ("It is", False),
        ("\n{", True),
        ("```", True),
        ("```JSON\n  {", True),
        ("```py", False),
        ("[{", True),
        ("[1", False),
        ('{"a', True),
        ("{'a'", False),
        ('{"name": "f", "arguments": {}}', False),
        ('{"name": "get_time", "arguments": {}}\n', True),
        ('{"name": "get_time", "arguments": {}} x', False),
    ]:
        assert auto().add(opening) == ([] if held else [("text", opening)]), opening
    tools = auto()
    assert tools.add('{"name": "get_weather", "arguments": {') == [] and tools.add("}} ok") == [
        ("text", '{"name": "get_weather", "arguments": {}} ok')
    ]
    assert tools.add(" more") == [("text", " more")] and tools.finish() == []


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-tools")
    srv = start(tiny_dirs, root / "home", root / "server.log", "--api-key", KEY, "--max-tokens", "16")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def template_greedy(tiny, messages, tools, max_tokens):
    """The target's greedy reply to the conversation as its chat template renders it: (prompt ids, reply)."""
    model, tok = tiny["target"]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = list(tok.encode(text, add_special_tokens=False))
    return ids, tok.decode(list(plain_generate(model, tok, ids, PlainStats(), max_tokens=max_tokens)))


def test_a_conversation_with_a_tool_call_and_its_result_is_served(client, tiny, tiny_dirs):
    messages = [
        {"role": "user", "content": "def weather(city):"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "print(add_3(18))"},
    ]
    rendered = [
        messages[0],
        {
            **messages[1],
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        messages[2],
    ]
    ids, text = template_greedy(tiny, rendered, [WEATHER], 12)
    target = str(tiny_dirs["target"])

    reply = client.chat.completions.create(model=target, messages=messages, tools=[WEATHER], max_tokens=12)
    assert reply.choices[0].message.content == text and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.tool_calls is None  # this model has no tool-call format: all text
    streamed = client.chat.completions.create(
        model=target, messages=messages, tools=[WEATHER], max_tokens=12, tool_choice="auto", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_logprobs_are_the_targets_own(client, tiny, tiny_dirs):
    model, tok = tiny["target"]
    messages = [{"role": "user", "content": "def add_3(x):"}]
    reply = client.chat.completions.create(
        model=str(tiny_dirs["target"]), messages=messages, max_tokens=10, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    assert b"".join(bytes(e.bytes) for e in content).decode() == reply.choices[0].message.content

    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    ids = list(plain_generate(model, tok, prompt, PlainStats(), max_tokens=10))  # the same greedy reply
    assert tok.decode(ids) == reply.choices[0].message.content
    logits = model(mx.array(prompt + ids)[None])[0, len(prompt) - 1 : -1].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for e, t, row in zip(content, ids, expected):
        assert e.logprob == pytest.approx(row[t], abs=2e-3)
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(sorted(row, reverse=True)[:3], abs=2e-3)

    streamed = client.chat.completions.create(
        model=str(tiny_dirs["target"]), messages=messages, max_tokens=10, logprobs=True, stream=True
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content] and all(not e.top_logprobs for e in entries)
    plain = client.chat.completions.create(model=str(tiny_dirs["target"]), messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_what_the_server_cannot_honour_gets_a_400_and_it_keeps_serving(server, client, tiny_dirs):
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"messages": [{"role": "user", "content": "def add_3(x):"}], "max_tokens": 4}

    def post(body, path="/v1/chat/completions"):
        return httpx.post(server.url + path, headers=auth, json=body, timeout=60)

    for kind in ("json_object", "json_schema"):
        err = error_of(post({**ok, "response_format": {"type": kind}}), 400)
        assert err["param"] == "response_format" and "not supported" in err["message"]
    assert post({**ok, "response_format": {"type": "text"}}).status_code == 200
    err = error_of(post({**ok, "tools": [WEATHER], "tool_choice": "required"}), 400)
    assert err["param"] == "tool_choice" and "no tool-call format" in err["message"]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert "no function 'get_time'" in error_of(post({**ok, "tools": [WEATHER], "tool_choice": named}), 400)["message"]
    assert error_of(post({**ok, "tool_choice": "required"}), 400)["param"] == "tool_choice"
    assert error_of(post({**ok, "tools": [{"type": "function", "function": {}}]}), 400)["param"].startswith("tools.0")
    bad_call = {
        "role": "assistant",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}],
    }
    err = error_of(post({**ok, "messages": ok["messages"] + [bad_call]}), 400)
    assert err["param"] == "messages.1.tool_calls.0.function.arguments"
    assert error_of(post({**ok, "top_logprobs": 2}), 400)["param"] == "top_logprobs"
    assert error_of(post({**ok, "logprobs": True, "top_logprobs": 21}), 400)["param"] == "top_logprobs"
    completion = {"prompt": "def add_3(x):", "max_tokens": 4, "logprobs": 2}
    assert error_of(post(completion, "/v1/completions"), 400)["param"] == "logprobs"
    for field, value in (("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("logit_bias", {"15": 5})):
        assert error_of(post({**ok, field: value}), 400)["param"] == field
        assert error_of(post({"prompt": "x", field: value}, "/v1/completions"), 400)["param"] == field
    assert post({**ok, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}).status_code == 200

    assert post(ok).json()["usage"]["completion_tokens"] == 4
    assert server.health()["failed"] == 0
