"""`pi-serve`: an OpenAI-compatible HTTP server over the batch-1 runtime (standard library HTTP only).

One worker thread owns the runtime and runs one generation at a time; requests wait in a FIFO queue bounded by
`max_queue` (503 beyond it). Each connection has its own handler thread (ThreadingHTTPServer): it checks and
tokenises the request, queues a `Job`, then relays the worker's events to its client. A client that leaves is
noticed by that thread (a failed write, or the socket reading EOF while it waits): a queued job is dropped and
its slot freed at once, a running one stops at the next token through `generate`'s `should_stop`. The same
hook ends generations at a stop string or at the per-request time limit.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from hotneurons.runtime import api
from hotneurons.runtime.api import ApiError, Reply, Result, StopMatcher
from hotneurons.runtime.generate import Runtime, context_length, eos_ids, generate, prompt_ids
from hotneurons.runtime.sampling import Sampling

log = logging.getLogger("hotneurons.serve")

MAX_BODY = 8 * 2 ** 20  # bytes; a prompt over any context this runtime serves is far smaller
SHUTTING_DOWN = "the server is shutting down: retry on another one"
POLL_S = 0.05  # how often a waiting handler looks at its socket and the clock
IDLE_S = 60.0  # a connection silent this long (request not sent, or not read) is closed


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (tests)
    api_key: str | None = None  # set: every /v1 request needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests waiting behind the running one; more are answered 503
    timeout: float | None = 600.0  # seconds from arrival to the last token (queue wait included); None: no limit
    max_tokens: int = 256  # for requests that name none (OpenAI's own default for completions is 16)
    model_id: str | None = None  # the name /v1/models lists and responses carry (default: the model's name)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is out of range: use 0-65535")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue {self.max_queue} is negative: use 0 (only the running request) or more")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout {self.timeout} must be positive (seconds); 0 on the command line: no limit")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens {self.max_tokens} must be at least 1")


@dataclass(eq=False)
class Job:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    deadline: float | None  # time.monotonic() after which the job ends
    events: queue.Queue = field(default_factory=queue.Queue)  # ("start",) ("text", s) ("done", Result) ("error", e)
    state: str = "queued"  # queued -> running -> done, or queued -> dropped (client left or timed out)
    gone: bool = False  # the client left: the worker stops at the next token
    timed_out: bool = False

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def _model_id(info: dict[str, Any]) -> str:
    """A hub id as it is; a local model by its file or folder name (as llama.cpp's server names a GGUF), never
    by a path of this machine."""
    src = info.get("source") or {}
    if src.get("gguf_file"):
        return Path(src["gguf_file"]).stem
    name = str(info.get("name") or "model")
    return Path(name).name if src.get("kind") == "folder" or Path(name).is_absolute() else name


GenerateFn = Callable[..., Any]  # generate()'s signature; tests pass a wrapper that slows or blocks it


class Server:
    """The HTTP server, its queue and the runtime's worker. `start()` serves in background threads (tests);
    `serve_forever()` blocks (the CLI)."""

    def __init__(self, rt: Runtime, cfg: ServeConfig = ServeConfig(), generate_fn: GenerateFn = generate):
        self.rt, self.cfg, self._generate = rt, cfg, generate_fn
        self.model_id = cfg.model_id or _model_id(rt.lm.info)
        self.context = context_length(rt.lm)
        self.vocab = int(rt.lm.model.get_input_embeddings().num_embeddings)
        self._eos = eos_ids(rt.lm)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()  # guards job states and the counters below
        self._tok_lock = threading.Lock()  # handler threads share one tokenizer
        self.waiting = self.running = 0
        self._current: Job | None = None  # the running job
        self._closing = False
        self.counts = dict.fromkeys(("served", "dropped", "rejected", "timed_out", "errors"), 0)
        self.started = int(time.time())
        self._http = _HTTPServer((cfg.host, cfg.port), _Handler)
        self._http.app = self  # type: ignore[attr-defined]
        self._worker = threading.Thread(target=self._work, name="pi-serve-worker", daemon=True)
        self._worker.start()
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self) -> Server:
        t = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1}, name="pi-serve-http",
                             daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        self._http.serve_forever()

    def close(self) -> None:
        """Stop accepting, end the running generation, answer queued requests 503, stop the worker."""
        if self._threads:
            self._http.shutdown()
        self._http.server_close()
        with self._lock:
            self._closing = True  # open keep-alive connections may still send requests: submit() refuses them
            if self._current is not None:
                self._current.gone = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and self._drop(job):
                job.events.put(("error", ApiError(503, SHUTTING_DOWN, code="shutting_down")))
        self._jobs.put(None)
        self._worker.join(timeout=10)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- queue ----------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"status": "ok", "model": self.model_id, "running": self.running, "queued": self.waiting,
                    "max_queue": self.cfg.max_queue, **self.counts}

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 503 when the queue is full."""
        with self._lock:
            if self._closing:
                raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
            if self.waiting + self.running > self.cfg.max_queue:
                self.counts["rejected"] += 1
                raise ApiError(503, f"the server is busy: {self.cfg.max_queue} requests are already waiting; "
                                    f"retry later", code="queue_full")
            self.waiting += 1
        self._jobs.put(job)

    def _drop(self, job: Job, reason: str = "dropped") -> bool:
        """Take a job that has not started off the queue (its slot frees now; the worker skips it). False: it
        has started."""
        with self._lock:
            if job.state != "queued":
                return False
            job.state, self.waiting = "dropped", self.waiting - 1
            self.counts[reason] += 1
            return True

    def leave(self, job: Job) -> None:
        """The client of `job` left."""
        job.gone = True
        self._drop(job)

    def expire(self, job: Job) -> bool:
        """The job's time ran out while it was queued: drop it (False: it has started after all)."""
        return self._drop(job, "timed_out")

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if job.state != "queued":
                    continue
                job.state, self.waiting, self.running, self._current = "running", self.waiting - 1, 1, job
            try:
                job.events.put(("done", self._run(job)))
            except Exception as e:  # a failing generation fails its request, never the server
                log.exception("generation failed")
                job.events.put(("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}")))
                with self._lock:
                    self.counts["errors"] += 1
            finally:
                with self._lock:
                    job.state, self.running, self._current = "done", 0, None

    def _run(self, job: Job) -> Result:
        job.events.put(("start",))
        stops = StopMatcher(job.stop)

        def on_text(piece: str) -> None:
            out = stops.feed(piece)
            if out and job.stream:
                job.events.put(("text", out))

        def should_stop() -> bool:
            if job.expired():
                job.timed_out = True
            return job.gone or job.timed_out or stops.hit

        g = self._generate(self.rt, job.ids, job.max_tokens, job.sampling, on_text=on_text, should_stop=should_stop)
        rest = stops.flush()
        if rest and job.stream:
            job.events.put(("text", rest))
        eos = bool(g.token_ids) and g.token_ids[-1] in self._eos
        with self._lock:
            self.counts["timed_out" if job.timed_out else "dropped" if job.gone else "served"] += 1
        # a generation cut by the time limit ends as "length", as llama.cpp's server reports its time limit
        return Result(stops.text, "stop" if stops.hit or eos else "length", len(job.ids), len(g.token_ids))

    # -- requests -------------------------------------------------------------------------------------------

    def job_for(self, body: Any, chat: bool, arrived: float) -> tuple[api.Request, Job]:
        """Check and tokenise a request body; raises ApiError (4xx)."""
        req = api.parse(body, chat, self.vocab, self.context)
        ids, param = self._tokenize(req), "messages" if chat else "prompt"
        if not ids:
            raise ApiError(400, "the prompt is empty: send some text", param, "invalid_value")
        room = self.context - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {self.context}: "
                                f"shorten it", param, "context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(400, f"max_tokens {req.max_tokens} + the prompt's {len(ids)} tokens exceed the model's "
                                f"context of {self.context}: ask for at most {room}", "max_tokens",
                           "context_length_exceeded")
        deadline = None if self.cfg.timeout is None else arrived + self.cfg.timeout
        return req, Job(ids, min(req.max_tokens or self.cfg.max_tokens, room), req.sampling, req.stop, req.stream,
                        deadline)

    def _tokenize(self, req: api.Request) -> list[int]:
        tok = self.rt.lm.tokenizer
        with self._tok_lock:
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
                return list(req.prompt)  # token ids
            if not req.chat:
                return prompt_ids(self.rt, req.prompt)
            if getattr(tok, "chat_template", None) is None:
                raise ApiError(400, "this model's tokenizer has no chat template to format 'messages': send a "
                                    "'prompt' to /v1/completions", "messages", "no_chat_template")
            try:
                return prompt_ids(self.rt, req.prompt, chat=True)
            except Exception as e:  # the template's own checks (roles, order) raise from Jinja
                raise ApiError(400, f"the chat template refused the messages: {e}", "messages", "invalid_value")

    def authorized(self, header: str | None) -> bool:
        if self.cfg.api_key is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.cfg.api_key.encode())


# ---------------------------------------------------------------------------------------------------------------
# HTTP


class _ClientGone(Exception):
    pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a handler waiting on a client never blocks shutdown
    request_queue_size = 128  # the listen backlog: bursts of clients are accepted, not reset
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client that hangs up or goes silent between requests is routine, not an error
        log.exception("error on the connection from %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connections
    server_version = "pi-serve"
    timeout = IDLE_S

    @property
    def app(self) -> Server:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch(self.command)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET  # the others are answered 405 in the API's shape

    def _dispatch(self, method: str) -> None:
        self._sent_headers = self._read = False
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path == "/health":
                return self._json(200, self.app.health()) if method == "GET" else self._not_allowed("GET")
            if not path.startswith("/v1/"):
                raise ApiError(404, f"no route {method} {path}: see /v1/models, /v1/completions, "
                                    f"/v1/chat/completions, /health", code="not_found")
            if not self.app.authorized(self.headers.get("Authorization")):
                raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with "
                                    "the key pi-serve was started with (--api-key)", code="invalid_api_key")
            if path == "/v1/models":
                return self._json(200, {"object": "list", "data": [self._model()]}) if method == "GET" else \
                    self._not_allowed("GET")
            if path.startswith("/v1/models/"):
                if path.removeprefix("/v1/models/") != self.app.model_id:
                    raise ApiError(404, f"model '{path.removeprefix('/v1/models/')}' is not served here: this "
                                        f"server has '{self.app.model_id}'", "model", "model_not_found")
                return self._json(200, self._model())
            if path in ("/v1/completions", "/v1/chat/completions"):
                return self._complete(path.endswith("chat/completions")) if method == "POST" else \
                    self._not_allowed("POST")
            raise ApiError(404, f"no route {method} {path}: see /v1/models, /v1/completions, /v1/chat/completions, "
                                f"/health", code="not_found")
        except ApiError as e:
            self._error(e)
        except _ClientGone:
            self.close_connection = True
        except Exception as e:  # a request never takes the server down
            log.exception("request failed")
            self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def _model(self) -> dict[str, Any]:
        return {"id": self.app.model_id, "object": "model", "created": self.app.started, "owned_by": "hotneurons"}

    def _not_allowed(self, allowed: str) -> None:
        raise ApiError(405, f"{self.command} is not allowed on {self.path}: use {allowed}", code="method_not_allowed")

    # -- responses ------------------------------------------------------------------------------------------

    def _send_headers(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self._sent_headers = True

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        try:
            self._send_headers(status, {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                        **(headers or {})})
            self.wfile.write(data)
        except OSError:
            raise _ClientGone from None

    def _error(self, e: ApiError) -> None:
        unread = self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers
        if unread and not self._read:
            self.close_connection = True  # the unread body would be taken for the next request
        elif e.status >= 500 and e.status != 503:
            self.close_connection = True
        try:
            if self._sent_headers:  # mid-stream: the error goes as an event, as OpenAI's API sends it
                self._event(e.body(), done=True)
            else:
                self._json(e.status, e.body(), {"Retry-After": "1"} if e.status == 503 else None)
        except _ClientGone:
            self.close_connection = True
        if unread and not self._read:
            self._discard_input()

    def _write_chunk(self, data: bytes) -> None:
        """One piece of a chunked body (an empty one ends it)."""
        try:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
        except OSError:
            raise _ClientGone from None

    def _event(self, obj: Any, done: bool = False) -> None:
        data = b"data: " + json.dumps(obj).encode() + b"\n\n"
        self._write_chunk(data + (b"data: [DONE]\n\n" if done else b""))
        if done:
            self._write_chunk(b"")

    def _client_gone(self) -> bool:
        """The client closed its end: the socket reads EOF (the request was read whole, so nothing else is due)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- completions ----------------------------------------------------------------------------------------

    def _body(self) -> Any:
        raw = self._read_chunked() if "chunked" in self.headers.get("Transfer-Encoding", "").lower() else None
        if raw is None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                raise ApiError(413 if length > MAX_BODY else 400, f"Content-Length "
                               f"{self.headers.get('Content-Length')} is not a size from 0 to {MAX_BODY} bytes",
                               code="invalid_body")
            raw = self.rfile.read(length)
        self._read = True
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise ApiError(400, f"the body is not valid JSON ({e}): send a JSON object such as "
                                f'{{"prompt": "Hi", "max_tokens": 16}}', code="invalid_json") from None

    def _read_chunked(self) -> bytes:
        """A body sent with Transfer-Encoding: chunked (hex size line, data, CRLF; size 0 ends, then trailers)."""
        parts, size = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                n = int(line.split(b";")[0], 16)
            except ValueError:
                raise ApiError(400, f"bad chunk size line {line[:40]!r} in a chunked body: send a Content-Length "
                                    f"instead", code="invalid_body") from None
            if n == 0:
                break
            size += n
            if size > MAX_BODY:
                raise ApiError(413, f"the chunked body is over {MAX_BODY} bytes", code="invalid_body")
            parts.append(self.rfile.read(n))
            self.rfile.readline(1024)
        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
            pass
        return b"".join(parts)

    def _discard_input(self) -> None:
        """Read what the client has sent of a refused body before the connection closes: closing on unread data
        resets the connection, and the reset can destroy the error response before the client reads it."""
        try:
            self.connection.settimeout(0.2)
            for _ in range(64):  # at most 4 MiB; a larger upload is cut off
                if not self.connection.recv(65536):
                    break
        except OSError:
            pass

    def _complete(self, chat: bool) -> None:
        arrived = time.monotonic()
        req, job = self.app.job_for(self._body(), chat, arrived)
        self.app.submit(job)
        reply = Reply(chat, self.app.model_id)
        try:
            self._relay(job, req, reply)
        except _ClientGone:
            self.app.leave(job)
            self.close_connection = True
            log.info("%s left; its request was %s", self.address_string(),
                     "dropped" if job.state == "dropped" else "stopped")

    def _relay(self, job: Job, req: api.Request, reply: Reply) -> None:
        """Wait for the worker's events and pass them on; raises _ClientGone when the client has left."""
        while True:
            try:
                kind, *rest = job.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    raise _ClientGone from None
                if job.state == "queued" and job.expired() and self.app.expire(job):
                    raise ApiError(503, f"the request waited in the queue past the --timeout of "
                                        f"{self.app.cfg.timeout:g} s: retry later", code="timeout") from None
                continue
            if kind == "error":
                raise rest[0]
            if req.stream:
                if kind == "start":  # headers only now: a request that never starts can still get a JSON error
                    self._send_headers(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             "Transfer-Encoding": "chunked"})
                    if req.chat:
                        self._event(reply.chunk(None, first=True))
                elif kind == "text":
                    self._event(reply.chunk(rest[0]))
                elif kind == "done":
                    result: Result = rest[0]
                    self._event(reply.chunk(None, result.finish_reason), done=not req.include_usage)
                    if req.include_usage:
                        self._event(reply.usage_chunk(result), done=True)
                    return
            elif kind == "done":
                return self._json(200, reply.full(rest[0]))


def serve(rt: Runtime, cfg: ServeConfig = ServeConfig(), ready: Callable[[Server], None] | None = None) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); `ready` is called once the port is bound."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop shuts down as Ctrl-C does
    server = Server(rt, cfg)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
