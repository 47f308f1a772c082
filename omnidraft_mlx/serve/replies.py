"""A job's events as an OpenAI reply: one JSON body, or server-sent events ending `data: [DONE]`.

Content, tool calls (message.tool_calls, or delta.tool_calls once a call parses)
and the target's log-probabilities (choices[0].logprobs.content) come from the
job's events (request.py). `usage` has prompt, completion and cached
prompt tokens, and `usage.speculative` what the drafter did. A client that goes away cancels its
job at once, so the engine drops it before its next round: a whole reply's request watches for the
disconnect while it waits (hung_up), a stream's is heard by Starlette's StreamingResponse, which
then closes the stream (events()).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from omnidraft_mlx.serve.admission import client_of
from omnidraft_mlx.serve.jobs import Job, Result
from omnidraft_mlx.serve.keys import key_name
from omnidraft_mlx.serve.schema import ApiError, Sampling

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
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def finish_reason(result: Result) -> str:
    return "stop" if result.finish_reason == "cancelled" else result.finish_reason


def sse(obj: dict, event: str | None = None) -> str:
    """A server-sent event; named (`event:`) as the Responses and Messages APIs name theirs."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def message(text: str, calls: list[dict]) -> dict:
    """A chat reply's message: its content (None when it is only tool calls) and its tool calls."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text if text.strip() else None, "tool_calls": calls}


async def submit(engine, req: Sampling, messages: list[dict], raw: bool, request: Request) -> Job:
    """The one way into the engine, whatever the API: the model checked, the request encoded (in a
    worker thread) and its job queued, under the name of the API key it came with and its client's."""
    target = engine.cfg.target
    if req.model is not None and req.model != target:
        raise ApiError(
            404,
            f"the model '{req.model}' does not exist here: this server serves '{target}' (GET /v1/models)",
            "model",
            "model_not_found",
        )
    loop, name = asyncio.get_running_loop(), key_name(request)
    job = await run_in_threadpool(engine.jobs.prepare, messages, raw, req, loop, name)
    job.client = client_of(request.scope)
    engine.submit(job)
    return job


async def gather(request: Request, job: Job) -> tuple[dict, Result] | None:
    """The job's events once it is done: ({"text", "tool_calls", "logprobs": [...]}, its Result); an
    error event raises its ApiError; None when the client went away (its job cancelled)."""
    got = {"text": [], "tool_calls": [], "logprobs": []}
    watch = asyncio.create_task(hung_up(request, job))
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "gone":
                return None
            if kind == "error":
                raise payload
            if kind == "done":
                return got, payload
            got[kind] += [payload] if kind == "text" else payload
    finally:
        watch.cancel()


async def hung_up(request: Request, job: Job) -> None:
    """Wait for the client to go away (the ASGI 'http.disconnect'; its body was read, so nothing else
    comes), then cancel its job and wake its waiter with a ("gone", None) event."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
    job.events.put_nowait(("gone", None))


def gone() -> JSONResponse:
    """The reply of a client that went away: nobody reads it."""
    return JSONResponse({}, status_code=499)


async def complete(request: Request, job: Job, head: dict, chat: bool):
    """The whole reply as one body, once the job is done."""
    if (done := await gather(request, job)) is None:
        return gone()
    got, result = done
    reply = "".join(got["text"])
    choice = {"index": 0, "message": message(reply, got["tool_calls"])} if chat else {"index": 0, "text": reply}
    choice.update(
        finish_reason=finish_reason(result),
        logprobs={"content": got["logprobs"]} if job.logprobs is not None else None,
    )
    obj = "chat.completion" if chat else "text_completion"
    return {**head, "object": obj, "choices": [choice], "usage": usage(result)}


async def events(job: Job):
    """A streamed reply's job events, (kind, payload): ("start", None) for its opening, then the job's
    up to its "done" or "error", and ("waiting", None) every few seconds while there is none (a
    queued request), for a keep-alive. The job is cancelled when the stream ends, also when the
    client went away."""
    try:
        yield "start", None
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=WAITING_S)
            except asyncio.TimeoutError:
                yield "waiting", None
                continue
            yield kind, payload
            if kind in ("done", "error"):
                return
    finally:
        job.cancelled.set()


async def reply_events(job: Job, reply):
    """A streamed reply's job events (events()) as the events of its API: its Reply (messages.py,
    responses.py) turns the opening, each keep-alive, an error, text, tool calls and the end into
    that API's events."""
    async for kind, payload in events(job):
        if kind == "start":
            out = reply.start()
        elif kind == "waiting":
            out = reply.progress()
        elif kind == "error":
            out = reply.failed(payload)
        elif kind == "text":
            out = reply.add_text(payload)
        elif kind == "tool_calls":
            out = reply.add_calls(payload)
        else:
            out = reply.done(payload)
        for event in out:
            yield event


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

    async for kind, payload in events(job):
        if kind == "start":
            if chat:
                yield chunk(
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                )
        elif kind == "waiting":
            yield ": waiting\n\n"  # keeps the connection alive while queued
        elif kind == "error":
            yield sse(payload.body())
        elif kind != "done":
            yield chunk(chunk_choice(kind, payload, chat, calls_sent))
            calls_sent += len(payload) if kind == "tool_calls" else 0
        else:
            last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            yield chunk({**last, "finish_reason": finish_reason(payload), "logprobs": None})
            if include_usage:
                yield sse({**head, "object": obj, "choices": [], "usage": usage(payload)})
    yield "data: [DONE]\n\n"
