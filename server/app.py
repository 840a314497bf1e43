"""pi-serve's HTTP side: the FastAPI application over a `Server` (server/serve.py).

Request bodies are read raw and checked by server/api.py alone (its messages and codes are the API's), not by
FastAPI: the pydantic models of server/schemas.py only describe them in the OpenAPI document (/openapi.json). No
/docs or /redoc page: their scripts come from a CDN, and the server runs offline. Every error
is answered in OpenAI's shape, 404 and 405 included. A streamed response sends its headers when the generation
starts, so that a request refused while it waits still gets a plain JSON error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Protocol

from fastapi import Depends, FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer
from hotneurons.server import api, schemas
from hotneurons.server.api import ApiError, Reply, Result
from hotneurons.server.config import ServeConfig
from hotneurons.server.jobs import Events, Job
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("hotneurons.serve")

MAX_BODY = 8 * 2 ** 20  # bytes; a prompt over any context this runtime serves is far smaller
ROUTES = "see /v1/models, /v1/completions, /v1/chat/completions, /health, /openapi.json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    pass


class Server(Protocol):
    """What the app asks of the server it fronts (server/serve.Server, which builds the app over itself): its queue,
    its key check and its figures."""

    cfg: ServeConfig
    model_id: str
    started: int  # unix time

    def job_for(self, raw: bytes, chat: bool, arrived: float, events: Events) -> tuple[api.Request, Job]: ...

    def submit(self, job: Job) -> None: ...

    def leave(self, job: Job) -> None: ...

    def expire(self, job: Job) -> bool: ...

    def authorized(self, header: str | None) -> bool: ...

    def health(self) -> dict[str, Any]: ...


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, {"Retry-After": "1"} if e.status == 503 else None)


def sse(obj: Any, done: bool = False) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n" + (b"data: [DONE]\n\n" if done else b"")


async def read_body(request: Request) -> bytes:
    """The body, at most MAX_BODY bytes (Content-Length or chunked; uvicorn undoes the chunking)."""
    length = request.headers.get("content-length", "0")  # uvicorn has refused one that is not a number
    if length.isdigit() and int(length) > MAX_BODY:
        raise ApiError(413, f"Content-Length {length} is over the limit of {MAX_BODY} bytes", code="invalid_body")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes", code="invalid_body")
        parts.append(part)
    return b"".join(parts)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (after the body has been read, uvicorn's receive() waits for that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def next_event(server: Server, job: Job, gone: asyncio.Future) -> tuple:
    """The worker's next event for `job`. Raises _ClientGone when the client has left, and a 503 when the job's
    time ran out while it was still queued (a running one is ended by the worker)."""
    while True:
        get = asyncio.ensure_future(job.events.get())
        left = None if job.deadline is None or job.state != "queued" else max(job.deadline - time.monotonic(), 0)
        try:
            done, _ = await asyncio.wait({get, gone}, timeout=None if left is None else left + 0.01,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()  # nothing was taken off the queue
        if get in done:
            return get.result()
        if gone in done:
            raise _ClientGone
        if job.state == "queued" and job.expired() and server.expire(job):
            raise ApiError(503, f"the request waited in the queue past the --timeout of {server.cfg.timeout:g} s: "
                                f"retry later", code="timeout")


class EventStream(StreamingResponse):
    """A streamed completion; `on_close` runs however the response ends (the client may leave mid-stream)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close):
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def stream_chunks(server: Server, job: Job, req: api.Request, reply: Reply, gone: asyncio.Future,
                        finished: list) -> AsyncIterator[bytes]:
    if req.chat:
        yield sse(reply.chunk(None, first=True))
    while True:
        try:
            kind, *rest = await next_event(server, job, gone)
        except _ClientGone:
            return
        if kind == "text":
            yield sse(reply.chunk(rest[0]))
        elif kind == "error":  # mid-stream: the error goes as an event, as OpenAI's API sends it
            finished.append(True)
            yield sse(rest[0].body(), done=True)
            return
        elif kind == "done":
            result: Result = rest[0]
            finished.append(True)
            yield sse(reply.chunk(None, result.finish_reason), done=not req.include_usage)
            if req.include_usage:
                yield sse(reply.usage_chunk(result), done=True)
            return


async def complete(server: Server, request: Request, chat: bool) -> Response:
    arrived = time.monotonic()
    try:
        raw = await read_body(request)
    except ClientDisconnect:  # it left while sending its body
        return Response(status_code=499)
    req, job = await run_in_threadpool(server.job_for, raw, chat, arrived, Events())
    server.submit(job)
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    reply, streaming = Reply(chat, server.model_id), False
    try:
        while True:
            kind, *rest = await next_event(server, job, gone)
            if kind == "error":
                raise rest[0]
            if kind == "start" and req.stream:
                finished: list = []

                def close() -> None:
                    gone.cancel()
                    if not finished:
                        server.leave(job)
                        log.info("%s left; its request was stopped", _client(request))

                streaming = True
                return EventStream(stream_chunks(server, job, req, reply, gone, finished), close)
            if kind == "done":
                return JSONResponse(reply.full(rest[0]))
    except _ClientGone:
        server.leave(job)
        log.info("%s left; its request was %s", _client(request), "dropped" if job.state == "dropped" else "stopped")
        return Response(status_code=499)  # nobody reads it
    finally:
        if not streaming:
            gone.cancel()


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


class _StripSlash:
    """/v1/models/ is /v1/models, as before FastAPI (whose own rule would answer a redirect)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


def make_app(server: Server) -> FastAPI:
    from hotneurons import __version__

    app = FastAPI(title="pi-serve", version=__version__, docs_url=None, redoc_url=None, redirect_slashes=False,
                  description="An OpenAI-compatible API over the hotneurons runtime (batch 1, one request at a "
                              "time, a bounded FIFO queue). Errors come in OpenAI's shape. See docs/serve.md.")
    app.add_middleware(_StripSlash)
    bearer = HTTPBearer(auto_error=False, description="the --api-key pi-serve was started with (if any)")

    def key_error(request: Request) -> ApiError | None:
        if server.authorized(request.headers.get("Authorization")):
            return None
        return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key "
                             "pi-serve was started with (--api-key)", code="invalid_api_key")

    async def check_key(request: Request, _=Depends(bearer)) -> None:  # `bearer`: the key on the OpenAPI page
        if (e := key_error(request)) is not None:
            raise e

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        """FastAPI's own 404 and 405, in OpenAI's shape; an unknown /v1 path needs the key as a known one does."""
        method, path = request.method, request.url.path.rstrip("/") or "/"
        if path.startswith("/v1/") and (key := key_error(request)) is not None:
            return error_response(key)
        if e.status_code == 405:
            allowed = ", ".join(m for m in (e.headers or {}).get("Allow", "").split(", ") if m and m != "HEAD")
            return error_response(ApiError(405, f"{method} is not allowed on {path}: use {allowed}",
                                           code="method_not_allowed"))
        if e.status_code == 404:
            return error_response(ApiError(404, f"no route {method} {path}: {ROUTES}", code="not_found"))
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def on_exception(request: Request, e: Exception) -> JSONResponse:
        """A request never takes the server down (Starlette re-raises the error after this answer: uvicorn logs
        it with its traceback)."""
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health", response_model=schemas.Health, tags=["server"])
    async def health() -> dict[str, Any]:
        """The queue and the counts since start; needs no key."""
        return server.health()

    def model() -> dict[str, Any]:
        return {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "hotneurons"}

    v1 = {"dependencies": [Depends(check_key)], "tags": ["OpenAI API"]}

    @app.get("/v1/models", response_model=schemas.ModelList, responses=schemas.ERRORS, **v1)
    async def models() -> dict[str, Any]:
        """The one model served."""
        return {"object": "list", "data": [model()]}

    @app.get("/v1/models/{model_id:path}", response_model=schemas.Model, responses=schemas.ERRORS, **v1)
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_id:
            raise ApiError(404, f"model '{model_id}' is not served here: this server has '{server.model_id}'",
                           "model", "model_not_found")
        return model()

    @app.post("/v1/completions", response_class=JSONResponse, openapi_extra=schemas.body("CompletionRequest"),
              responses=schemas.answers("Completion"), **v1)
    async def completions(request: Request) -> Response:
        """Text completion of `prompt`; with `stream: true`, server-sent events."""
        return await complete(server, request, chat=False)

    @app.post("/v1/chat/completions", response_class=JSONResponse, openapi_extra=schemas.body("ChatRequest"),
              responses=schemas.answers("ChatCompletion"), **v1)
    async def chat_completions(request: Request) -> Response:
        """The chat template applied to `messages`, then the assistant's reply; with `stream: true`, server-sent
        events."""
        return await complete(server, request, chat=True)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(schemas.request_schemas())
            for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422: bodies are not its to check
                components.pop(name, None)
            for route in spec["paths"].values():
                for op in route.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
