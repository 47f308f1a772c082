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
Qwen2.5-Coder-0.5B does).

The drafter of a tool conversation reads the target's prompt text in its own
tokens: its own template knows no tools, and it is the target's reply to that
text that it must guess.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Callable

from jinja2 import TemplateError

from omnidraft_mlx.prompts import encode_prompt, has_chat_template
from omnidraft_mlx.serve_schema import ApiError, ChatRequest


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
    fmt: ToolFormat | None = None  # None: the reply is all text
    opened: str | None = None  # the call's text after its start marker, put in the prompt; None: no call opened


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
    if not getattr(tokenizer, "has_tool_calling", False):
        if choice != "auto":
            raise ApiError(400, "tool_choice: this model has no tool-call format known to mlx-lm, so a call "
                                "cannot be required of it: leave tool_choice out", "tool_choice")
        return ToolPlan(tools)  # the template may still show them; the reply is text
    fmt = ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)
    return ToolPlan(tools, fmt, None if choice == "auto" else opening(fmt, None if choice == "required" else tools[0]))


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
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return None
        else:
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": call["name"], "arguments": args}})
    return calls
