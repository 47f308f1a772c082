"""The Responses API, POST /v1/responses, as Codex CLI and openai-agents' default model class speak it.

A thin translation: the request becomes the chat route's request (ChatRequest:
the same messages, tools, tool_choice and sampling), goes into the engine the
one way every route does (replies.submit), and the job's events come back as a
response: a `message` output item for the text, a `function_call` item per
tool call, `usage` with the drafter's figures; streamed as the named events
clients expect (response.created ... response.completed). Replies are kept in
memory for `previous_response_id`, apart per API key (the last STORED of each key,
least recently used first out; an evicted or unknown id, or another key's, is a 404
naming it).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnidraft_mlx.serve.config import Limits
from omnidraft_mlx.serve.jobs import Result
from omnidraft_mlx.serve.keys import key_name
from omnidraft_mlx.serve.replies import gather, gone, message, reply_events, sse, submit
from omnidraft_mlx.serve.schema import ApiError, ChatRequest, chat_messages, parse, validate

STORED = 256  # responses kept for previous_response_id, per API key
# Fields that would change the answer, which this server cannot honour: a 400 names them if set.
UNSUPPORTED = {
    "background": "replies are not run in the background",
    "conversation": "conversations are not kept: send previous_response_id or the whole input",
    "prompt": "prompt templates are not kept here",
    "top_logprobs": "log-probabilities come from /v1/chat/completions",
    "max_tool_calls": "the number of tool calls is not limited",
}


# Tools the client runs but the model calls otherwise than by a function's JSON arguments.
CLIENT_TOOLS = ("custom", "local_shell", "shell", "apply_patch", "computer_use_preview", "computer")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Fields that do not change the answer (store's others,
    metadata, user, parallel_tool_calls, reasoning, include, truncation, service_tier,
    prompt_cache_key, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    text: TextOptions | None = None

    def check(self, limits: Limits) -> None:
        for name, why in UNSUPPORTED.items():
            if (self.model_extra or {}).get(name):
                raise ApiError(400, f"{name}: not supported ({why}); leave it out", name)
        kind = self.text.format.type if self.text and self.text.format else "text"
        if kind != "text":
            raise ApiError(
                400,
                f"text.format: '{kind}' is not supported (this server does not constrain replies to JSON): "
                "leave it out or give {'type': 'text'}",
                "text.format",
            )


def text_of(content, where: str) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: give a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise ApiError(
                400, f"{where}.{j}.type: '{kind}' parts are not supported: only text (input_text, output_text)", where
            )
        if not isinstance(text := part.get("refusal" if kind == "refusal" else "text") or "", str):
            raise ApiError(400, f"{where}.{j}: its text, a string", f"{where}.{j}")
        texts.append(text)
    return "".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """The input as chat messages: messages, function calls (an assistant's tool_calls, consecutive
    calls in one message) and their outputs (tool messages); reasoning items carry nothing here."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: user, assistant, system or developer", f"{where}.role")
            out.append({"role": item["role"], "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call needs its name and call_id", where)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
            call["function"]["arguments"] = item.get("arguments") or "{}"
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}.call_id: the call this output answers", f"{where}.call_id")
            content = text_of(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind != "reasoning":
            raise ApiError(
                400,
                f"{where}.type: '{kind}' items are not supported (message, function_call, function_call_output)",
                f"{where}.type",
            )
    return out


def function_tools(tools: list[dict], where: str = "tools") -> tuple[list[dict], dict[str, str]]:
    """The function tools as the chat route takes them, those in namespaces too (with the
    namespace of each such name). Hosted tools (web_search, file_search, code_interpreter, mcp, ...)
    are tools the server would run itself; none runs here, so they are not offered to the model.
    Client tools that are called otherwise than with JSON arguments (custom, local_shell, ...) get a 400."""
    out, namespaces = [], {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where}.{i}: a tool, an object", f"{where}.{i}")
        kind = tool.get("type")
        if kind == "function":
            if not isinstance(tool.get("name"), str):
                raise ApiError(400, f"{where}.{i}.name: the function's name, a string", f"{where}.{i}.name")
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k not in ("type", "strict")}})
        elif kind == "namespace":
            if not isinstance(inner := tool.get("tools") or [], list):
                raise ApiError(400, f"{where}.{i}.tools: the namespace's tools, a list", f"{where}.{i}.tools")
            inner, _ = function_tools(inner, f"{where}.{i}.tools")
            out += inner
            namespaces.update((t["function"]["name"], tool.get("name")) for t in inner)
        elif kind in CLIENT_TOOLS:
            raise ApiError(
                400, f"{where}.{i}.type: '{kind}' tools are not supported: only function tools", f"{where}.{i}.type"
            )
    return out, namespaces


def chat_tools(req: ResponsesRequest) -> dict:
    """tools and tool_choice as the chat route takes them."""
    tools, _ = function_tools(req.tools or [])
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, "tool_choice: 'auto', 'none', 'required' or a function by name", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return {"tools": tools or None, "tool_choice": choice}


def chat_request(req: ResponsesRequest, conversation: list[dict], limits: Limits) -> ChatRequest:
    """The chat route's request for this one: instructions as the system message, then the conversation."""
    if not conversation:
        raise ApiError(400, "input: give at least one message", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {
        "model": req.model,
        "messages": system + conversation,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        **chat_tools(req),
    }
    return validate(ChatRequest, {k: v for k, v in body.items() if v is not None}, limits)


def usage(result: Result) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "speculative": result.speculative,
    }


class Reply:
    """One response built from its job's events as they come: the output items, and the stream's
    events on the way (each numbered, as the API numbers them)."""

    def __init__(self, req: ResponsesRequest, model: str, keep: Callable[[Reply], None]):
        self.keep = keep  # given the reply once it is complete (kept for previous_response_id)
        self.namespaces = function_tools(req.tools or [])[1]  # a call to a namespaced function names it
        self.head = {
            "id": "resp_" + secrets.token_hex(12),
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature if req.temperature is not None else 0.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": True,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": req.store,
            "metadata": (req.model_extra or {}).get("metadata") or {},
        }
        self.output, self.text, self.calls, self.seq = [], None, [], 0

    def response(self, status: str, **fields) -> dict:
        body = {"status": status, "error": None, "incomplete_details": None, "output": self.output, "usage": None}
        return {**self.head, **body, **fields}

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")), *self.progress()]

    def progress(self) -> list[dict]:
        """response.in_progress: also every few seconds while the reply waits in the queue or its long
        prompt prefills (Codex CLI gives up on a stream that sends no event for a while)."""
        return [self.event("response.in_progress", response=self.response("in_progress"))]

    def add_text(self, piece: str) -> list[dict]:
        """Text: into the open message item (opened first if there is none)."""
        events = []
        if self.text is None:
            item = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress"}
            self.text = {**item, "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"item_id": self.text["id"], "output_index": len(self.output), "content_index": 0}
            events += [
                self.event("response.output_item.added", output_index=len(self.output), item=self.text),
                self.event("response.content_part.added", **where, part=part),
            ]
            self.text = {**self.text, "content": [part]}
        self.text["content"][0] = {**self.text["content"][0], "text": self.text["content"][0]["text"] + piece}
        where = {"item_id": self.text["id"], "output_index": len(self.output), "content_index": 0}
        return events + [self.event("response.output_text.delta", **where, delta=piece, logprobs=[])]

    def close_text(self) -> list[dict]:
        """The open message item, done (it goes into the output)."""
        if self.text is None:
            return []
        item, self.text = {**self.text, "status": "completed"}, None
        part, index = item["content"][0], len(self.output)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        self.output.append(item)
        return [
            self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def add_calls(self, calls: list[dict]) -> list[dict]:
        """Tool calls (OpenAI chat form): a function_call item each, its arguments in one delta."""
        events = self.close_text()
        for call in calls:
            item = {
                "type": "function_call",
                "id": "fc_" + secrets.token_hex(12),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            if item["name"] in self.namespaces:
                item["namespace"] = self.namespaces[item["name"]]
            index, where = len(self.output), {"item_id": item["id"], "output_index": len(self.output)}
            events += [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
            self.output.append(item)
            self.calls.append(call)
        return events

    def done(self, result: Result) -> list[dict]:
        """The reply is over: response.completed, or response.incomplete where it ran out of tokens."""
        events = self.close_text()
        self.keep(self)
        if result.finish_reason == "length":
            final = self.response("incomplete", incomplete_details={"reason": "max_output_tokens"}, usage=usage(result))
            return events + [self.event("response.incomplete", response=final)]
        return events + [self.event("response.completed", response=self.response("completed", usage=usage(result)))]

    def failed(self, e: ApiError) -> list[dict]:
        error = {"code": e.code or e.kind, "message": e.message}
        return [self.event("response.failed", response=self.response("failed", error=error))]

    def said(self) -> dict:
        """The reply as the assistant's chat message (kept for previous_response_id)."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        return message(text, self.calls)


class Kept:
    """The last `size` conversations of each API key by response id, for previous_response_id: a
    key sees its own only (another's id is unknown to it), and cannot push another's out."""

    def __init__(self, size: int = STORED):
        self.size, self.keys = size, defaultdict(OrderedDict)

    def get(self, key: str, rid: str) -> list[dict]:
        items = self.keys[key]
        if rid not in items:
            raise ApiError(
                404,
                f"previous_response_id: no response '{rid}' here (this server keeps the last {self.size} "
                "responses stored in memory for each API key, and none from before it started): send the whole "
                "input instead",
                "previous_response_id",
                "previous_response_not_found",
            )
        items.move_to_end(rid)
        return items[rid]

    def put(self, key: str, rid: str, conversation: list[dict]) -> None:
        items = self.keys[key]
        items[rid] = conversation
        while len(items) > self.size:
            items.popitem(last=False)


async def streamed(job, reply: Reply):
    """The response as named server-sent events."""
    async for event in reply_events(job, reply):
        yield sse(event, event["type"])


def add_routes(app: FastAPI, engine) -> None:
    kept = Kept()

    @app.post("/v1/responses")
    async def create(request: Request):
        req, key = await parse(request, ResponsesRequest, engine.cfg.limits), key_name(request)
        conversation = (kept.get(key, req.previous_response_id) if req.previous_response_id else []) + input_messages(
            req.input
        )
        chat = chat_request(req, conversation, engine.cfg.limits)
        job = await submit(engine, chat, chat_messages(chat), raw=False, request=request)

        def keep(reply: Reply) -> None:
            if req.store:
                kept.put(key, reply.head["id"], conversation + [reply.said()])

        reply = Reply(req, engine.cfg.target, keep)
        if req.stream:
            return StreamingResponse(streamed(job, reply), media_type="text/event-stream")
        if (done := await gather(request, job)) is None:
            return gone()
        got, result = done
        if got["text"]:
            reply.add_text("".join(got["text"]))
        reply.add_calls(got["tool_calls"])
        return reply.done(result)[-1]["response"]
