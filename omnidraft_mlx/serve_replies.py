"""A job's events as an OpenAI reply: one JSON body, or server-sent events ending `data: [DONE]`.

`usage` has prompt, completion and cached prompt tokens, and `usage.speculative`
what the drafter did. A client that goes away cancels its job: a waiting
request notices within half a second, a stream when its next event is sent
(a queued stream gets an SSE comment every few seconds, so it notices too).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse

from omnidraft_mlx.serve_decode import Job, Result
from omnidraft_mlx.serve_schema import ApiError

WAITING_S = 5.0  # a queued streaming request gets an SSE comment this often (and notices a disconnect)


def usage(result: Result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        "speculative": result.speculative,
    }


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def finish_reason(result: Result) -> str:
    return "stop" if result.finish_reason == "cancelled" else result.finish_reason


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def complete(request: Request, job: Job, head: dict, chat: bool):
    """The whole reply as one body, once the job is done."""
    text = []
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return JSONResponse({}, status_code=499)  # nobody reads it
            continue
        if kind == "text":
            text.append(payload)
        elif kind == "error":
            return error_response(payload)
        else:
            reply = "".join(text)
            choice = ({"index": 0, "message": {"role": "assistant", "content": reply}} if chat
                      else {"index": 0, "text": reply})
            choice.update(finish_reason=finish_reason(payload), logprobs=None)
            obj = "chat.completion" if chat else "text_completion"
            return {**head, "object": obj, "choices": [choice], "usage": usage(payload)}


async def stream(job: Job, head: dict, chat: bool, include_usage: bool):
    """The reply as server-sent events, a chunk per piece of text."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d}
        else:
            choice = {"index": 0, "text": delta or ""}
        choice.update(finish_reason=finish, logprobs=None)
        return sse({**head, "object": obj, "choices": [choice]})

    try:
        if chat:
            yield chunk(None, role=True)
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=WAITING_S)
            except asyncio.TimeoutError:
                yield ": waiting\n\n"  # keeps the connection alive while queued
                continue
            if kind == "text":
                yield chunk(payload)
            elif kind == "error":
                yield sse(payload.body())
                break
            else:
                yield chunk(None, finish_reason(payload))
                if include_usage:
                    yield sse({**head, "object": obj, "choices": [], "usage": usage(payload)})
                break
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: stop the generation
        job.cancelled.set()
