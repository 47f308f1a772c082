"""Tool calling for `omnidraft serve`, the OpenAI way, in the target's own tool-call format.

A request's `tools` go to the target's chat template, which writes them into the
prompt in its own words; so do `tool` messages and assistant `tool_calls`. The
reply's calls are found in the format mlx-lm infers from that template: its
tokenizer carries the markers and a parser (mlx_lm/tool_parsers; Qwen2.5's
<tool_call>{json}</tool_call> is json_tools). tool_choice "none" leaves the
tools out; "required", or one function by name (only that one offered), opens
a call at the start of the reply, in the prompt, so the reply is a call: for
JSON calls up to the name, or to the arguments of the named function, since a
small model may end its reply right after a bare opening marker (as
Qwen2.5-Coder-0.5B does). With "auto", a reply that is nothing but JSON calls
of offered tools, bare or in one ```json block, is a call too (json_calls), and
so is such a block that ends the reply on a line of its own after text:
Qwen2.5-Coder 0.5B and 1.5B write their calls so rather than in tags (the 1.5B
under Codex CLI's long prompt writes text first, then the block).

The drafter of a tool conversation reads the target's prompt text in its own
tokens: its own template knows no tools, and it is the target's reply to that
text that it must guess.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from jinja2 import TemplateError

from omnidraft_mlx.prompts import encode_prompt, has_chat_template
from omnidraft_mlx.serve.schema import ApiError, ChatRequest, strict_json


@dataclass
class ToolFormat:
    """How the target writes a tool call: between `start` and `end`, read by `parse` (mlx-lm's)."""

    start: str
    end: str
    parse: Callable
    tools: list[dict]


@dataclass
class ToolPlan:
    """What a request asks of tools."""

    tools: list[dict] | None = None  # for the chat template
    fmt: ToolFormat | None = None  # None: no calls in the target's own format
    opened: str | None = None  # the call's text after its start marker, put in the prompt; None: no call opened
    bare: bool = False  # tool_choice "auto": a reply of only JSON calls (json_calls) is calls


def plan_tools(req: ChatRequest, tokenizer) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice or "auto"
    if not tools and choice not in ("auto", "none"):
        raise ApiError(400, "tool_choice: give `tools` to choose from", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    if not isinstance(choice, str):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise ApiError(400, f"tool_choice: no function '{choice.function.name}' in `tools`", "tool_choice")
    if choice == "auto":
        return auto_plan(tools, tokenizer)
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ApiError(
            400,
            "tool_choice: this model has no tool-call format known to mlx-lm, so a call "
            "cannot be required of it: leave tool_choice out",
            "tool_choice",
        )
    fmt = ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)
    return ToolPlan(tools, fmt, opening(fmt, None if choice == "required" else tools[0]))


def auto_plan(tools: list[dict], tokenizer) -> ToolPlan:
    """tool_choice "auto": calls in the target's own format (if mlx-lm knows it) or bare JSON calls."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return ToolPlan(tools, bare=True)  # the template may still show them; JSON calls are all it can find
    return ToolPlan(
        tools, ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools), bare=True
    )


def opening(fmt: ToolFormat, tool: dict | None) -> str:
    """How a required call begins after its start marker: for mlx-lm's JSON calls, up to the
    function's name, or up to the arguments of the one named; for other formats, nothing more."""
    if fmt.parse.__module__.rsplit(".", 1)[-1] != "json_tools":
        return ""
    if tool is None:
        return '\n{"name": "'
    return f'\n{{"name": {json.dumps(tool["function"]["name"])}, "arguments": '


def encode(pair, messages: list[dict], raw: bool, plan: ToolPlan) -> tuple[list[int], list[int]]:
    """(draft ids, target ids) of a request's prompt."""
    tok = pair.target_tok
    tooling = plan.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if raw or not tooling or not has_chat_template(tok):
        return encode_prompt(pair.draft_tok, messages, raw), encode_prompt(tok, messages, raw)
    try:
        text = tok.apply_chat_template(messages, tools=plan.tools, add_generation_prompt=True, tokenize=False)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template cannot render these messages: {e}", "messages") from None
    text += plan.fmt.start + plan.opened if plan.opened is not None else ""
    return list(pair.draft_tok.encode(text)), list(tok.encode(text, add_special_tokens=False))


def parse_calls(fmt: ToolFormat, text: str) -> list[dict] | None:
    """OpenAI tool calls from the text of one call (between the markers); None if it does not parse."""
    try:
        parsed = fmt.parse(text, fmt.tools)
    except Exception:  # a parser meeting malformed model output may raise anything
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        try:  # model output: arguments that no JSON reply can carry (NaN) make it text, not a call
            if isinstance(args, str):
                strict_json(args)
            else:
                args = json.dumps(args, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return None
        calls.append(openai_call(call["name"], args))
    return calls


def openai_call(name: str, arguments: str) -> dict:
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


FENCE = "```"


def json_end(s: str) -> int | None:
    """Where the JSON value that `s` starts with ends (its brackets close); None if they do not yet."""
    depth, quoted, escaped = 0, False, False
    for i, c in enumerate(s):
        if quoted:
            quoted, escaped = quoted and (escaped or c != '"'), not escaped and c == "\\"
        elif c == '"':
            quoted = True
        elif c in "{[]}":
            depth += 1 if c in "{[" else -1
            if depth == 0:
                return i + 1
    return None


def json_reply(text: str) -> tuple[bool, str | None, str] | None:
    """The start of a reply read as one JSON value, bare or after a ```json (or ```) line:
    (fenced, the value once its brackets close else None, the text after it); None if it cannot be."""
    s = text.lstrip()
    fenced = s.startswith("`")
    if fenced:
        if not s.startswith(FENCE):
            return (True, None, "") if FENCE.startswith(s) else None
        head, newline, s = s[len(FENCE) :].partition("\n")
        kind = head.strip().lower()
        if not (kind in ("", "json") if newline else "json".startswith(kind)):
            return None
    s = s.lstrip()
    if s and (s[0] not in "{[" or s[1:].lstrip()[:1] not in ('"{' if s[0] == "{" else "{")):
        return None  # an object's first key, or a list's first object, opens right away
    end = json_end(s) if s else None
    return (fenced, None, "") if end is None else (fenced, s[:end], s[end:])


def fence_opens(text: str) -> bool:
    """Whether `text`, spaces aside, opens a ``` block or may still open one."""
    s = text.lstrip()
    return s.startswith(FENCE) or FENCE.startswith(s)


def may_be_json_calls(text: str, tools: list[dict], fenced: bool = False) -> bool:
    """Whether a reply (or, `fenced`, a ``` block that ends it) that starts so may still be only
    JSON calls (json_calls)."""
    read = json_reply(text) if fence_opens(text) or not fenced else None
    if read is None or read[1] is None:
        return read is not None
    in_fence, value, rest = read
    return (FENCE.startswith(rest.strip()) if in_fence else not rest.strip()) and bool(calls_in(value, tools))


def json_calls(text: str, tools: list[dict], fenced: bool = False) -> list[dict] | None:
    """OpenAI tool calls from a whole reply that is one JSON call, or a list of them, bare or in one
    ```json block (only that, `fenced`): each exactly {"name": an offered tool, "arguments" (or
    "parameters"): {...}}."""
    read = json_reply(text)
    if read is None or read[1] is None or (fenced and not read[0]):
        return None
    in_fence, value, rest = read
    return calls_in(value, tools) if rest.strip() == (FENCE if in_fence else "") else None


def calls_in(value: str, tools: list[dict]) -> list[dict] | None:
    """The calls of json_calls in the text of its JSON value; None if it holds something else."""
    try:
        parsed = strict_json(value)
    except ValueError:  # {{...}}: Qwen2.5-Coder-1.5B copies its template's doubled braces
        return calls_in(value[1:-1], tools) if value.startswith("{{") and value.endswith("}}") else None
    names, calls = [t["function"]["name"] for t in tools], []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        keys = set(call) - {"name"}  # nothing else: a tool's definition written back is no call
        if keys not in ({"arguments"}, {"parameters"}) or not isinstance(args := call[keys.pop()], dict):
            return None
        calls.append(openai_call(call["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None
