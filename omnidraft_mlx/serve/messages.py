"""Anthropic's Messages API, POST /v1/messages (and /v1/messages/count_tokens), as Claude Code speaks it.

A thin translation: the request becomes the chat route's request (ChatRequest:
`system` as the system message, text blocks as content, tool_use blocks as an
assistant's tool_calls, tool_result blocks as tool messages, tools and
tool_choice, stop_sequences as stop strings), goes into the engine the one way
every route does (replies.submit), and the job's events come back as a message
of text and tool_use blocks, streamed as Anthropic's named events
(message_start, content_block_start/delta/stop, message_delta, message_stop,
ping while queued). Errors take Anthropic's shape ({"type": "error", "error":
{type, message}}). Temperature defaults to 0 here too: greedy, the target's own
reply (Anthropic's own default is 1).
"""

from __future__ import annotations

import asyncio
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from omnidraft_mlx.serve.config import Limits
from omnidraft_mlx.serve.jobs import Result
from omnidraft_mlx.serve.replies import gather, gone, reply_events, sse, submit
from omnidraft_mlx.serve.schema import ApiError, ChatRequest, chat_messages, check_stops, parse, validate

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
SERVER_TOOLS = ("web_search", "web_fetch", "code_execution", "tool_search")  # type prefixes
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


class MessagesRequest(BaseModel):
    """The body of POST /v1/messages (count_tokens: the same, max_tokens left out). Fields that do not
    change the answer (metadata, service_tier, cache_control on blocks, context_management,
    output_config's effort, ...) are accepted and ignored; so is `thinking`: the target does not
    think aloud, its replies have no thinking blocks (as a model without extended thinking)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False

    def check(self, limits: Limits) -> None:
        check_stops(self.stop_sequences or [], limits, "stop_sequences")
        if self.top_k is not None:
            raise ApiError(
                400, "top_k: not supported (the reply is the target's own distribution); leave it out", "top_k"
            )
        extra = self.model_extra or {}
        for name in ("mcp_servers", "container"):
            if extra.get(name):
                raise ApiError(400, f"{name}: not supported by this server; leave it out", name)
        if isinstance(extra.get("output_config"), dict) and extra["output_config"].get("format"):
            raise ApiError(
                400,
                "output_config.format: not supported (this server does not constrain replies to JSON); leave it out",
                "output_config.format",
            )


def text_of(content, where: str) -> str:
    """A system prompt's or a tool result's text: a string, or its text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content if isinstance(content, list) else [None]):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ApiError(400, f"{where}.{j}: only text blocks are supported here", f"{where}.{j}")
        texts.append(block_text(block, f"{where}.{j}"))
    return "\n".join(texts)


def block_text(block: dict, where: str) -> str:
    if not isinstance(text := block.get("text") or "", str):
        raise ApiError(400, f"{where}.text: a string", f"{where}.text")
    return text


def message_list(req: MessagesRequest) -> list[dict]:
    """The conversation as chat messages: a user's tool_result blocks become tool messages (before
    its text), an assistant's tool_use blocks its tool_calls; thinking blocks carry nothing here."""
    out = [{"role": "system", "content": text_of(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        role, content, where = m.get("role"), m.get("content"), f"messages.{i}"
        if role not in ("user", "assistant", "system"):  # system: Claude Code's mid-conversation system messages
            raise ApiError(400, f"{where}.role: user, assistant or system", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content: a string or a list of content blocks", f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(block_text(block, f"{where}.content.{j}"))
            elif kind == "tool_use" and role == "assistant":
                call = {"name": block.get("name"), "arguments": block.get("input") or {}}
                calls.append({"id": block.get("id"), "type": "function", "function": call})
            elif kind == "tool_result" and role == "user":
                result = text_of(block.get("content"), f"{where}.content.{j}.content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            elif kind not in ("thinking", "redacted_thinking"):
                raise ApiError(
                    400,
                    f"{where}.content.{j}.type: '{kind}' blocks are not supported (text, tool_use, tool_result)",
                    f"{where}.content.{j}.type",
                )
        if texts or calls:
            out.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def chat_tools(req: MessagesRequest) -> dict:
    """tools and tool_choice as the chat route takes them: auto, any (required), tool (by name), none."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type", "custom")
        if not isinstance(kind, str):
            raise ApiError(400, f"tools.{i}.type: a string ('custom', or left out)", f"tools.{i}.type")
        if kind.startswith(SERVER_TOOLS):
            continue  # a tool Anthropic's servers run: none runs here, so it is not offered to the model
        if kind != "custom":
            raise ApiError(
                400,
                f"tools.{i}.type: '{kind}' tools are not supported: only custom tools (name, input_schema)",
                f"tools.{i}.type",
            )
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    choice = (req.tool_choice or {}).get("type")
    if choice == "tool":
        choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
    elif choice is not None and choice not in ("auto", "any", "none"):
        raise ApiError(400, "tool_choice.type: auto, any, tool or none", "tool_choice.type")
    return {"tools": tools or None, "tool_choice": "required" if choice == "any" else choice}


def chat_request(req: MessagesRequest, limits: Limits) -> ChatRequest:
    body = {
        "model": req.model,
        "messages": message_list(req),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop_sequences or None,
        "stream": req.stream,
        **chat_tools(req),
    }
    return validate(ChatRequest, {k: v for k, v in body.items() if v is not None}, limits)


def usage(result: Result) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": result.completion_tokens,
        "speculative": result.speculative,
    }


def stop_reason(result: Result) -> str:
    if result.finish_reason in STOP_REASONS:
        return STOP_REASONS[result.finish_reason]
    return "stop_sequence" if result.stop else "end_turn"


class Reply:
    """One message built from its job's events as they come: its content blocks, and the stream's
    events on the way ((name, data) pairs)."""

    def __init__(self, model: str, prompt_tokens: int):
        self.message = {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        self.open = False  # a text block is open

    @property
    def index(self) -> int:
        return len(self.message["content"]) - 1

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": self.message}), *self.progress()]

    def progress(self) -> list[tuple[str, dict]]:
        """A ping: keeps the connection alive while the reply waits in the queue."""
        return [("ping", {"type": "ping"})]

    def failed(self, e: ApiError) -> list[tuple[str, dict]]:
        return [("error", error_body(e))]

    def add_text(self, piece: str) -> list[tuple[str, dict]]:
        events = []
        if not self.open:
            self.message["content"].append({"type": "text", "text": ""})
            self.open = True
            block = {"type": "text", "text": ""}
            events.append(
                ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
            )
        self.message["content"][-1]["text"] += piece
        delta = {"type": "text_delta", "text": piece}
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def add_calls(self, calls: list[dict]) -> list[tuple[str, dict]]:
        """Tool calls (OpenAI chat form): a tool_use block each, its input in one input_json_delta."""
        events = self.close()
        for call in calls:
            args = call["function"]["arguments"]
            block = {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
            }
            self.message["content"].append({**block, "input": json.loads(args)})
            delta = {"type": "input_json_delta", "partial_json": args}
            events += [
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}},
                ),
                ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}),
                ("content_block_stop", {"type": "content_block_stop", "index": self.index}),
            ]
        return events

    def done(self, result: Result) -> list[tuple[str, dict]]:
        events = self.close()
        self.message.update(stop_reason=stop_reason(result), stop_sequence=result.stop, usage=usage(result))
        delta = {"stop_reason": self.message["stop_reason"], "stop_sequence": result.stop}
        return events + [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(result)}),
            ("message_stop", {"type": "message_stop"}),
        ]


async def streamed(job, reply: Reply):
    async for name, data in reply_events(job, reply):
        yield sse(data, name)


def add_routes(app: FastAPI, engine) -> None:
    limits = engine.cfg.limits

    @app.post("/v1/messages")
    async def create(request: Request):
        chat = chat_request(await parse(request, MessagesRequest, limits), limits)
        job = await submit(engine, chat, chat_messages(chat), raw=False, request=request)
        reply = Reply(engine.cfg.target, len(job.target_ids))
        if chat.stream:
            return StreamingResponse(streamed(job, reply), media_type="text/event-stream")
        if (done := await gather(request, job)) is None:
            return gone()
        got, result = done
        if got["text"]:
            reply.add_text("".join(got["text"]))
        reply.add_calls(got["tool_calls"])
        reply.done(result)
        return reply.message

    @app.post("/v1/messages/count_tokens")
    async def tokens(request: Request):
        # Encoded as it would be decoded, not queued.
        chat = chat_request(await parse(request, MessagesRequest, limits), limits)
        job = await run_in_threadpool(engine.jobs.prepare, chat_messages(chat), False, chat, asyncio.get_running_loop())
        return {"input_tokens": len(job.target_ids)}
