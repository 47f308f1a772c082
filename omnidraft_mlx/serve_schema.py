"""What `omnidraft serve` accepts: the OpenAI request bodies, checked, and the errors clients get.

A request is validated here before it reaches the engine, so that a bad one gets
a 4xx OpenAI-style error ({"error": {message, type, param, code}}) and never
costs a decode.
"""

from __future__ import annotations

import json
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An error the client gets as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints take; other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy unless asked: lossless and reproducible
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)  # best effort: a sample also depends on the drafts (the policy learns)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str | list[str]


def chat_messages(req: ChatRequest) -> list[dict]:
    out = []
    for m in req.messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def completion_prompt(req: CompletionRequest) -> str:
    if isinstance(req.prompt, str):
        return req.prompt
    if len(req.prompt) != 1:
        raise ApiError(400, "prompt: give one prompt per request (a string, or a list of one string)", "prompt")
    return req.prompt[0]


def stop_strings(req: Sampling) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or not all(stops):
        raise ApiError(400, "stop: up to 4 non-empty strings", "stop")
    return stops


async def parse(request: Request, kind: type[BaseModel]):
    """The JSON body as `kind` (whatever the content type says, as mlx-lm's and llama.cpp's servers do)."""
    try:
        data = json.loads(await request.body())
    except ValueError as e:  # also bad UTF-8
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", where) from None
