"""What `omnidraft serve` accepts: the OpenAI request bodies, checked, and the errors clients get.

A request is validated here before it reaches the engine, so that a bad one gets
a 4xx OpenAI-style error ({"error": {message, type, param, code}}) and never
costs a decode. What a client controls is bounded (config.Limits): the body's
size is checked as it is read, its nesting before it is validated, and the
counts and sizes that the prompt and the reply's stop-string matching grow with
before the request is encoded; each refusal names the serve flag that raises it.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnidraft_mlx.serve.config import Limits
from omnidraft_mlx.settings import flag_of


def strict_json(text: str | bytes):
    """JSON as RFC 8259 writes it: Python's reader also takes NaN, Infinity and numbers past a double
    (1e400 reads as inf), which no JSON reply can carry back. ValueError names what it met."""

    def finite(number: str) -> float:
        if not math.isfinite(value := float(number)):
            raise ValueError(f"{number} is not a finite number")
        return value

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON (numbers must be finite)")

    return json.loads(text, parse_float=finite, parse_constant=refuse)


class ApiError(Exception):
    """An error the client gets as {"error": {...}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,  # sent with it (a 429's Retry-After)
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def within(limits: Limits, name: str, where: str, got: int, unit: str, status: int = 400) -> None:
    """A 4xx for `got` past the limit `name`, naming the flag that raises it. A 413 closes the
    connection: the rest of the body is not read."""
    if got > (limit := getattr(limits, name)):
        raise ApiError(
            status,
            f"{where}: {got:,} {unit}, over this server's limit of {limit:,} (serve's {flag_of(limits, name)} sets it)",
            where,
            "limit_exceeded",
            headers={"Connection": "close"} if status == 413 else None,
        )


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"  # a JSON string, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints take. Other OpenAI fields are accepted and ignored, but for those that
    would change the answer: asked for at other than their defaults, they get a 400 (check())."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Not given: the server's --temp / --top-p (greedy by default: lossless and reproducible).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)  # best effort: a sample also depends on the drafts (the policy learns)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def check(self, limits: Limits) -> None:
        """What a valid body may still ask that this server cannot give, or past its limits; a 400 for
        a field that would change the answer and is not at its default (never ignored)."""
        for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
            if getattr(self, name):
                raise ApiError(
                    400, f"{name}: not supported (the reply is the target's own distribution); leave it out", name
                )
        check_stops(stop_strings(self), limits, "stop")


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def check(self, limits: Limits) -> None:
        super().check(limits)
        within(limits, "messages", "messages", len(self.messages), "messages")
        within(limits, "tools", "tools", len(self.tools or []), "tools")
        for i, t in enumerate(self.tools or []):
            schema = len(json.dumps(t.function.parameters))
            within(limits, "schema_bytes", f"tools.{i}.function.parameters", schema, "bytes")
        if self.response_format and self.response_format.type != "text":
            raise ApiError(
                400,
                f"response_format: '{self.response_format.type}' is not supported (this server "
                "does not constrain replies to JSON): leave it out or give {'type': 'text'}",
                "response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")


class CompletionRequest(Sampling):
    prompt: str | list[str]
    logprobs: int | None = None

    def check(self, limits: Limits) -> None:
        super().check(limits)
        if self.logprobs is not None:
            raise ApiError(
                400, "logprobs: not supported on /v1/completions; /v1/chat/completions gives them", "logprobs"
            )


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as chat templates take them (tool-call arguments as objects, as templates write them)."""
    out = []
    for i, m in enumerate(req.messages):
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        msg = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}"),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
        out.append(msg)
    return out


def arguments(args: str | dict, where: str) -> dict:
    """A call's arguments as an object (templates write them as one)."""
    try:
        args = args if isinstance(args, dict) else strict_json(args or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments: a JSON object", f"{where}.function.arguments")
    return args


def completion_prompt(req: CompletionRequest) -> str:
    if isinstance(req.prompt, str):
        return req.prompt
    if len(req.prompt) != 1:
        raise ApiError(400, "prompt: give one prompt per request (a string, or a list of one string)", "prompt")
    return req.prompt[0]


def stop_strings(req: Sampling) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def check_stops(stops: list[str], limits: Limits, where: str) -> None:
    """Stop strings are matched against every round of the reply, held back while they may begin."""
    if not all(stops):
        raise ApiError(400, f"{where}: stop strings must not be empty", where)
    within(limits, "stops", where, len(stops), "stop strings")
    for i, s in enumerate(stops):
        within(limits, "stop_chars", f"{where}.{i}", len(s), "characters")


async def parse(request: Request, kind: type[BaseModel], limits: Limits):
    """The JSON body as `kind`, within the limits: a JSON content type (a web page cannot send one
    without asking first, CORS's preflight), its size while it is read, its nesting before validation."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415,
            f"the request body must be JSON sent as 'Content-Type: application/json' (got '{media or 'none'}')",
            code="unsupported_media_type",
        )
    try:
        data = strict_json(await read_body(request, limits))
    except ValueError as e:  # also bad UTF-8
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # nested far past any limit: the parser gave up
        raise ApiError(400, f"the request body: nested deeper than the parser allows, {depth_limit(limits)}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if depth(data, limits.json_depth) > limits.json_depth:
        raise ApiError(400, f"the request body: {depth_limit(limits)}", code="limit_exceeded")
    return validate(kind, data, limits)


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused (413) as soon as it is known to be too big: by its Content-Length, or while it
    is read (a chunked body has none)."""
    size = request.headers.get("content-length", "")
    within(limits, "body_bytes", "the request body", int(size) if size.isdigit() else 0, "bytes", 413)
    chunks, read = [], 0
    async for chunk in request.stream():
        read += len(chunk)
        within(limits, "body_bytes", "the request body", read, "bytes (so far)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def depth(data, most: int) -> int:
    """How deeply `data`'s objects and arrays nest (counted to one past `most`), a level at a time."""
    level, n = [data], 0
    while level and n <= most:
        n += 1
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
    return n


def depth_limit(limits: Limits) -> str:
    return f"objects and arrays nest at most {limits.json_depth} deep here (serve's {flag_of(limits, 'json_depth')})"


def validate(kind: type[BaseModel], data: dict, limits: Limits):
    """`data` as `kind`, checked (its check()); a 400 naming the first field that is wrong."""
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", where) from None
    req.check(limits)
    return req
