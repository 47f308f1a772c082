"""`omnidraft serve`: an OpenAI-compatible HTTP API over a drafter/target pair.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
Streaming replies are server-sent events ending with `data: [DONE]`; `usage` has
prompt, completion and cached prompt tokens, and `usage.speculative` what the
drafter did (proposed and accepted target tokens, tokens per target forward).

Requests are queued, not batched: the decode loop speculates on one sequence
(one drafter cache and one target cache, rolled back per round), so one engine
owns the pair and serves requests in the order they arrive. It runs in the main
thread (MLX does all its work there: a process whose other threads ran a model
aborts at exit) and the HTTP server (uvicorn) in another. A client that disconnects leaves the queue, or stops its
generation at the next round. Prompt caches are kept between requests
(promptcache.PromptCache), so a resent system prompt or conversation is not
prefilled again. The pair learns from what it serves as `omnidraft chat` does:
the n-gram cache and the acceptance head as it decodes, the drafter between
requests when the queue is empty (a request that arrives meanwhile waits for
that update); what it learned is saved into the pair's profile when idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from omnidraft_mlx.drafts import SOURCES, check_sources
from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.policy import DraftPolicy, PolicyConfig
from omnidraft_mlx.promptcache import DEFAULT_CACHE_BYTES, CacheUse, PromptCache
from omnidraft_mlx.prompts import encode_prompt
from omnidraft_mlx.scheduler import Scheduler
from omnidraft_mlx.settings import check_range

log = logging.getLogger("omnidraft.serve")
IDLE_S = 0.5  # queue empty this long: save what was learned, run a due drafter update
WAITING_S = 5.0  # a queued streaming request gets an SSE comment this often (and notices a disconnect)


@dataclass
class ServeConfig:
    draft: str
    target: str
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # draft length; its k is the draft block
    max_tokens: int = 512  # a request's default reply length
    cache_bytes: int = DEFAULT_CACHE_BYTES
    adapt: bool = True  # drafter updates between requests
    adapt_every: int = 4  # replies gathered per drafter update
    profile: bool = True  # load and save the pair's profile
    api_key: str | None = None
    sources: tuple[str, ...] = SOURCES  # draft sources to choose from each round
    guard: bool = True  # decode plainly while no source is expected to pay

    def __post_init__(self):
        self.sources = check_sources(self.sources)
        check_range("--max-tokens", self.max_tokens, 1)
        check_range("--cache-bytes", self.cache_bytes, 0)
        check_range("--adapt-every", self.adapt_every, 1)


class ApiError(Exception):
    """An error the client gets as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- requests ----------------------------------------------------------------------------------

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


class StopText:
    """Streamed text cut at the first stop string; text that may begin one is held back."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def add(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was reached)."""
        self.pending += text
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        held = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---- the engine --------------------------------------------------------------------------------

@dataclass
class Job:
    """One request's generation: its prompts and settings; events flow back to the request's loop."""

    draft_ids: list[int]
    target_ids: list[int]
    spec: object  # SpecConfig
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the server's loop has closed: nobody is listening
            self.cancelled.set()


@dataclass
class Result:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    speculative: dict


class Engine:
    """The pair, its prompt cache and its learners; serves the queued jobs in order (run())."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.current: Job | None = None
        self.served = self.cancelled = self.failed = self.saves = 0
        self.dirty = False  # learned something not yet saved

    # Set by load().
    pair = profile = policy = learner = prompt_cache = limit = history = scheduler = None

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    @property
    def generating(self) -> bool:
        return self.current is not None

    def load(self) -> None:
        from omnidraft_mlx.chat import make_learner
        from omnidraft_mlx.loading import load_model
        from omnidraft_mlx.pair import context_length, make_pair
        from omnidraft_mlx.profile import load_profile

        cfg = self.cfg
        draft_model, draft_tok = load_model(cfg.draft)
        target_model, target_tok = load_model(cfg.target)
        self.profile = load_profile(cfg.draft, cfg.target, draft_model, trainable=cfg.adapt) if cfg.profile else None
        self.pair = make_pair(draft_model, draft_tok, target_model, target_tok,
                              self.profile.ngrams if self.profile else None)
        self.learner = make_learner(self.pair, self.profile, cfg.adapt_every) if cfg.adapt else None
        self.policy = DraftPolicy(cfg.policy)
        if self.profile:  # the policy's head and the history index are saved with every profile save from now on
            self.profile.attach_policy(self.policy)
            self.history = self.profile.attach_history()
        self.scheduler = Scheduler()  # which draft source pays, measured across requests
        self.prompt_cache = PromptCache(cfg.cache_bytes)
        limits = [x for x in (context_length(draft_model), context_length(target_model)) if x]
        self.limit = min(limits) if limits else None

    def run(self, running: Callable[[], bool]) -> None:
        """Serve jobs while running(); between them, when idle, learn and save."""
        while running():
            try:
                job = self.jobs.get(timeout=IDLE_S if self.dirty or self._update_due else 1.0)
            except queue.Empty:
                if self.dirty or self._update_due:
                    self._idle()
                continue
            self._serve(job)

    def shutdown(self) -> None:
        """The running and the queued requests get an error, not silence; then save what was learned."""
        stopping = ApiError(503, "the server is shutting down", kind="server_error")
        if self.current is not None:
            self.current.emit("error", stopping)
            self.current = None
        while True:
            try:
                self.jobs.get_nowait().emit("error", stopping)
            except queue.Empty:
                break
        self._save()

    @property
    def _update_due(self) -> bool:
        return self.learner is not None and len(self.learner.buffer) >= self.learner.interval

    def _idle(self) -> None:
        """Between requests: a due drafter update, then save the n-grams and the acceptance head."""
        if self._update_due:
            try:
                report = self.learner.update()  # saves the adapter into the profile
                log.info("drafter update %d: loss %.3f, %.1fs", report.update, report.loss, report.seconds)
            except Exception:
                log.error("the drafter update failed; drafter learning stops:\n%s", traceback.format_exc())
                self.learner = None
            finally:
                self.prompt_cache.drafter_changed()  # new drafter weights: its cached prefixes are stale
        self._save()

    def _save(self) -> None:
        """The n-grams and the acceptance head into the profile (under its lock, merged
        with what other processes saved meanwhile; atomically)."""
        if self.profile is None or not self.dirty:
            return
        try:
            self.profile.save()
            self.saves += 1
        except (OSError, OmniDraftError) as e:
            log.error("could not save the profile: %s", e)
        self.dirty = False

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.cancelled += 1
            return
        self.current = job
        try:
            result, ids = self._generate(job)
            job.emit("done", result)
            self.served += 1
            self.cancelled += result.finish_reason == "cancelled"
            self.dirty = True
            if ids and self.learner is not None:
                self._observe(job, ids)
        except OmniDraftError as e:
            self.failed += 1
            job.emit("error", ApiError(400, str(e)))
        except Exception as e:  # one bad request must not stop the server
            self.failed += 1
            log.error("generation failed:\n%s", traceback.format_exc())
            job.emit("error", ApiError(500, f"internal error ({type(e).__name__}): see the server's log",
                                       kind="server_error"))
        self.current = None  # not when interrupted (Ctrl-C): shutdown() tells the job's client

    def _generate(self, job: Job) -> tuple[Result, list[int]]:
        from omnidraft_mlx.speculative import SpecStats
        from omnidraft_mlx.textstream import TextStream

        stats, use = SpecStats(), CacheUse()
        text, stop = TextStream(self.pair.vmap.target_bytes), StopText(job.stops)
        ids, finish, ttft = [], None, None
        start = time.perf_counter()
        for new, _ in self.prompt_cache.generate(self.pair, job.draft_ids, job.target_ids, job.spec, stats,
                                                 self.policy, use, history=self.history,
                                                 scheduler=self.scheduler):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            ids += new
            piece, stopped = stop.add("".join(text.add(t) for t in new))
            if piece:
                job.emit("text", piece)
            if stopped:
                finish = "stop"
                break
            if job.cancelled.is_set():
                finish = "cancelled"
                break
        if finish is None:
            finish = "length" if len(ids) >= job.spec.max_tokens else "stop"
            piece, stopped = stop.add(text.finish())
            piece += "" if stopped else stop.flush()
            if piece:
                job.emit("text", piece)
        speculative = {
            "draft_model": self.cfg.draft,
            "proposed": stats.proposed,
            "accepted": stats.accepted,
            "acceptance": round(stats.acceptance, 4),
            "target_forwards": stats.rounds,
            "tokens_per_target_forward": round(stats.tokens_per_forward, 3),
            "draft_cached_tokens": use.draft_tokens,
            "time_to_first_token_s": round(ttft or 0.0, 4),
            "tokens_per_s": round(stats.tokens_per_s, 2),
        }
        return Result(finish, len(job.target_ids), len(ids), use.target_tokens, speculative), ids

    def _observe(self, job: Job, ids: list[int]) -> None:
        """Queue the reply for the drafter's next update, after the tail of each prompt
        (a training sequence must keep the reply within the learner's max_len)."""
        from omnidraft_mlx.distill import make_example

        tail = self.learner.cfg.max_len // 4
        self.learner.add(make_example(self.pair, job.draft_ids[-tail:], job.target_ids[-tail:], ids,
                                      self.learner.cfg.max_len))

    def prepare(self, messages: list[dict], raw: bool, req: Sampling, loop) -> Job:
        """Encode a request for both models and check it against the context (any thread)."""
        from omnidraft_mlx.speculative import SpecConfig

        draft_ids = encode_prompt(self.pair.draft_tok, messages, raw)
        target_ids = encode_prompt(self.pair.target_tok, messages, raw)
        longest = max(len(draft_ids), len(target_ids))
        room = self.limit - longest - self.cfg.policy.k - 1 if self.limit else None
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt is {longest} tokens and this model's context is {self.limit} tokens: "
                                "shorten the prompt", "messages" if not raw else "prompt", "context_length_exceeded")
        max_tokens = req.max_completion_tokens or req.max_tokens or self.cfg.max_tokens
        seed = req.seed if req.seed is not None else (secrets.randbits(31) if req.temperature > 0 else 0)
        spec = SpecConfig(k=self.cfg.policy.k, temp=req.temperature, top_p=req.top_p, seed=seed,
                          max_tokens=min(max_tokens, room) if room is not None else max_tokens,
                          sources=self.cfg.sources, guard=self.cfg.guard)
        return Job(draft_ids, target_ids, spec, stop_strings(req), loop, asyncio.Queue())


# ---- HTTP --------------------------------------------------------------------------------------

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


class RequireKey:
    """ASGI middleware: /v1/ requests need 'Authorization: Bearer KEY' (/health stays open)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(sent, self.expected):
                response = error_response(ApiError(401, "missing or wrong API key: send the header "
                                                        "'Authorization: Bearer KEY' with the server's --api-key",
                                                   code="invalid_api_key"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def make_app(engine: Engine) -> FastAPI:
    cfg = engine.cfg
    app = FastAPI(title="omnidraft", docs_url=None, redoc_url=None, openapi_url=None)
    model_ids = {cfg.target}

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(OmniDraftError)
    async def _bad_value(request, e: OmniDraftError):
        return error_response(ApiError(400, str(e)))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return error_response(ApiError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        return error_response(ApiError(500, f"internal error ({type(e).__name__}): see the server's log",
                                       kind="server_error"))

    if cfg.api_key:
        app.add_middleware(RequireKey, key=cfg.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.target, "draft": cfg.draft, "generating": engine.generating,
                "queued": engine.queued, "served": engine.served, "cancelled": engine.cancelled,
                "failed": engine.failed, "profile_saves": engine.saves, "ngrams": len(engine.pair.ngrams),
                "prompt_cache_bytes": engine.prompt_cache.nbytes}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.target, "object": "model", "created": 0,
                                            "owned_by": "omnidraft", "draft": cfg.draft}]}

    def check_model(req: Sampling) -> None:
        if req.model is not None and req.model not in model_ids:
            raise ApiError(404, f"the model '{req.model}' does not exist here: this server serves "
                                f"'{cfg.target}' (GET /v1/models)", "model", "model_not_found")

    async def run(request: Request, req: Sampling, messages: list[dict], raw: bool, chat: bool):
        check_model(req)
        job = await run_in_threadpool(engine.prepare, messages, raw, req, asyncio.get_running_loop())
        engine.submit(job)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "created": int(time.time()),
                "model": cfg.target}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, head, chat, include_usage), media_type="text/event-stream")
        return await complete(request, job, head, chat)

    async def complete(request: Request, job: Job, head: dict, chat: bool):
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest)
        return await run(request, req, chat_messages(req), raw=False, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        return await run(request, req, [{"role": "user", "content": completion_prompt(req)}], raw=True, chat=False)

    return app


def finish_reason(result: Result) -> str:
    return "stop" if result.finish_reason == "cancelled" else result.finish_reason


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8080, on_ready=lambda engine: None) -> None:
    """Load the pair, serve until interrupted (Ctrl-C, SIGTERM), then save what was learned."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    engine = Engine(cfg)
    engine.load()
    http = uvicorn.Server(uvicorn.Config(make_app(engine), host=host, port=port, log_level="warning",
                                         timeout_graceful_shutdown=5))
    web = threading.Thread(target=http.run, name="omnidraft-http", daemon=True)
    web.start()
    while not http.started:  # uvicorn says why when it cannot listen, and its thread ends
        if not web.is_alive():
            raise OmniDraftError(f"could not listen on {host}:{port}: is another server using that port?")
        time.sleep(0.05)
    on_ready(engine)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    try:
        engine.run(web.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True  # lets the open requests end (they get the shutdown error), then stops
        engine.shutdown()
        web.join()
