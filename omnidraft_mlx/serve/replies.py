"""A job's events as an OpenAI reply: one JSON body, or server-sent events ending `data: [DONE]`.

Content, tool calls (message.tool_calls, or delta.tool_calls once a call parses)
and the target's log-probabilities (choices[0].logprobs.content) come from the
job's events (serve_decode.py). `usage` has prompt, completion and cached
prompt tokens, and `usage.speculative` what the drafter did. A client that goes away cancels its job: a waiting
request notices within half a second, a stream when its next event is sent
(a queued stream gets an SSE comment every few seconds, so it notices too).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse

from omnidraft_mlx.serve.request import Job, Result
from omnidraft_mlx.serve.schema import ApiError

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


def message(text: str, calls: list[dict]) -> dict:
    """A chat reply's message: its content (None when it is only tool calls) and its tool calls."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text if text.strip() else None, "tool_calls": calls}


async def complete(request: Request, job: Job, head: dict, chat: bool):
    """The whole reply as one body, once the job is done."""
    got = {"text": [], "tool_calls": [], "logprobs": []}
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return JSONResponse({}, status_code=499)  # nobody reads it
            continue
        if kind == "error":
            return error_response(payload)
        if kind != "done":
            got[kind] += [payload] if kind == "text" else payload
            continue
        reply = "".join(got["text"])
        choice = {"index": 0, "message": message(reply, got["tool_calls"])} if chat else {"index": 0, "text": reply}
        choice.update(
            finish_reason=finish_reason(payload),
            logprobs={"content": got["logprobs"]} if job.logprobs is not None else None,
        )
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": [choice], "usage": usage(payload)}


def chunk_choice(kind: str, payload, chat: bool, calls_sent: int) -> dict:
    """A streamed choice for one event: content, tool calls (numbered on from calls_sent) or logprobs."""
    if not chat:
        return {"index": 0, "text": payload, "finish_reason": None, "logprobs": None}
    delta, logprobs = {}, None
    if kind == "text":
        delta = {"content": payload}
    elif kind == "tool_calls":
        delta = {"tool_calls": [{"index": calls_sent + i, **call} for i, call in enumerate(payload)]}
    else:
        logprobs = {"content": payload}
    return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs}


async def stream(job: Job, head: dict, chat: bool, include_usage: bool):
    """The reply as server-sent events, a chunk per event."""
    obj, calls_sent = "chat.completion.chunk" if chat else "text_completion", 0

    def chunk(choice: dict) -> str:
        return sse({**head, "object": obj, "choices": [choice]})

    try:
        if chat:
            yield chunk(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
            )
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=WAITING_S)
            except asyncio.TimeoutError:
                yield ": waiting\n\n"  # keeps the connection alive while queued
                continue
            if kind == "error":
                yield sse(payload.body())
                break
            if kind != "done":
                yield chunk(chunk_choice(kind, payload, chat, calls_sent))
                calls_sent += len(payload) if kind == "tool_calls" else 0
                continue
            last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            yield chunk({**last, "finish_reason": finish_reason(payload), "logprobs": None})
            if include_usage:
                yield sse({**head, "object": obj, "choices": [], "usage": usage(payload)})
            break
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: stop the generation
        job.cancelled.set()
