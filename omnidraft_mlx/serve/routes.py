"""The HTTP side of `omnidraft serve`: the FastAPI app, its routes, errors and API keys.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health; the Responses
API (responses.py) and Anthropic's Messages API (messages.py) translate to the chat route's request.
A request is parsed and encoded here (in a worker thread), queued on the
engine, and answered from its job's events (replies.py). Every error
reaches the client as an OpenAI error body; nothing here stops the server.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import time
import traceback
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from omnidraft_mlx.errors import OmniDraftError
from omnidraft_mlx.serve import messages, responses
from omnidraft_mlx.serve.admission import ClientShare
from omnidraft_mlx.serve.keys import SCOPE_NAME, Keys
from omnidraft_mlx.serve.replies import complete, error_response, stream, submit
from omnidraft_mlx.serve.schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_messages,
    completion_prompt,
    parse,
)

log = logging.getLogger("omnidraft.serve")


def error_reply(path: str, e: ApiError):
    """The error in the shape of the API the path belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    return messages.error_response(e) if path.startswith("/v1/messages") else error_response(e)


class RequireKey:
    """ASGI middleware: every request but `/` (which says only that the server is up) needs one of
    the server's keys, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Anthropic's clients);
    the key's name goes into the request's scope (keys.key_name)."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/":
            headers = Headers(scope=scope)
            bearer = headers.get("authorization", "")
            sent = (bearer[len("Bearer ") :] if bearer.startswith("Bearer ") else "", headers.get("x-api-key", ""))
            name = next((name for key in sent if key and (name := self.keys.name_of(key)) is not None), None)
            if name is None:
                response = error_reply(
                    scope["path"],
                    ApiError(
                        401,
                        "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                        "(or 'x-api-key: KEY') with a key the server was given (--api-key, --api-keys-file)",
                        code="invalid_api_key",
                    ),
                )
                return await response(scope, receive, send)
            scope[SCOPE_NAME] = name
        await self.app(scope, receive, send)


class WebGuard:
    """ASGI middleware against web pages, for a server on the user's own machine: a page's requests
    carry its Origin, refused (403) unless --cors names it; a DNS-rebinding page (its own name
    resolving to this machine) sends its name as Host, refused unless it is an IP address, localhost
    or a name --allowed-hosts gives."""

    def __init__(self, app, hosts: list[str], origins: list[str]):
        self.app, self.hosts, self.origins = app, {h.lower() for h in hosts}, set(origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            host, origin = host_name(headers.get("host", "")), headers.get("origin")
            refused = None
            if host and not self.host_allowed(host):
                refused = ApiError(
                    403,
                    f"Host '{host}' is not a name this server answers to (a page on another site could be "
                    f"using it): start the server with --allowed-hosts {host} if it is yours",
                    code="host_not_allowed",
                )
            elif origin is not None and not ({"*", origin} & self.origins):
                refused = ApiError(
                    403,
                    f"requests from web pages ({origin}) are refused: start the server with --cors {origin} "
                    "to let that site's pages call it",
                    code="origin_not_allowed",
                )
            if refused:
                return await error_reply(scope["path"], refused)(scope, receive, send)
        await self.app(scope, receive, send)

    def host_allowed(self, host: str) -> bool:
        if "*" in self.hosts or host in self.hosts or host == "localhost" or host.endswith(".localhost"):
            return True
        try:  # an address: no page on another site reaches the server through one of its names
            ipaddress.ip_address(host.strip("[]"))
            return True
        except ValueError:
            return False


def host_name(host: str) -> str:
    """The Host header's name or address, without its port."""
    host = host.lower()
    return host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.split(":")[0]


def shown(model: str) -> str:
    """A model as /health shows it: a local directory by its name alone (where it lies on this
    machine is nobody's business but the operator's)."""
    return Path(model).name if Path(model).expanduser().exists() else model


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI error body: ours, bad values, HTTP (404, 405) and bugs (500)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_reply(request.url.path, e)

    @app.exception_handler(OmniDraftError)
    async def _bad_value(request, e: OmniDraftError):
        return error_reply(request.url.path, ApiError(400, str(e)))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return error_reply(request.url.path, ApiError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        return error_reply(
            request.url.path,
            ApiError(500, f"internal error ({type(e).__name__}): see the server's log", kind="server_error"),
        )


async def respond(engine, request: Request, req: Sampling, messages: list[dict], raw: bool, chat: bool):
    """Queue the request's job; its reply, streamed or whole."""
    job = await submit(engine, req, messages, raw, request)
    head = {
        "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": engine.cfg.target,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream(job, head, chat, include_usage), media_type="text/event-stream")
    return await complete(request, job, head, chat)


def make_app(engine, keys: Keys | None = None) -> FastAPI:
    """The app; with `keys`, every request but `/` needs one of them (RequireKey)."""
    cfg = engine.cfg
    app = FastAPI(title="omnidraft", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.add_middleware(ClientShare, most=cfg.max_per_client, refuse=error_reply)  # inside the key check
    if keys is not None:
        app.add_middleware(RequireKey, keys=keys)
    if cfg.cors:  # outside RequireKey: a browser's preflight brings no key
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors, allow_methods=["GET", "POST"], allow_headers=["*"])
    app.add_middleware(WebGuard, hosts=cfg.allowed_hosts, origins=cfg.cors)  # outermost: before anything else

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": shown(cfg.target),
            "draft": shown(cfg.draft),
            "generating": engine.generating,
            "most_active": engine.most_active,
            "batch": cfg.batch,
            "queued": engine.queued,
            "served": engine.served,
            "cancelled": engine.cancelled,
            "failed": engine.failed,
            "profile_saves": engine.learning.saves,
            "drafter_updates": engine.learning.learner.updates if engine.learning.learner else None,
            "longest_round_pause_s": round(engine.longest_round_pause_s, 3),
            "longest_learning_wait_s": round(engine.longest_learning_wait_s, 3),
            "ngrams": len(engine.pair.ngrams),
            "prompt_cache_bytes": engine.jobs.prompt_cache.nbytes,
        }

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():  # clients check that the server answers (Claude Code sends HEAD /)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": cfg.target, "object": "model", "created": 0, "owned_by": "omnidraft", "draft": cfg.draft}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest, cfg.limits)
        return await respond(engine, request, req, chat_messages(req), raw=False, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest, cfg.limits)
        return await respond(
            engine, request, req, [{"role": "user", "content": completion_prompt(req)}], raw=True, chat=False
        )

    responses.add_routes(app, engine)
    messages.add_routes(app, engine)

    return app
