"""`pi-serve`: an OpenAI-compatible HTTP server over the runtime, on FastAPI and uvicorn.

One worker thread owns the runtime and runs one generation at a time, or with `parallel` > 1 up to that many together
in one batched step a token (server/batcher.py: continuous batching); requests wait in a FIFO queue bounded by
`max_queue` (503 beyond it). The HTTP side (server/app.py) runs on uvicorn's event loop: each request is read,
checked and tokenised (in a thread of the loop's pool), queued as a `Job`, and the worker's events for it come
back to the loop through `Events`. A client that leaves is noticed by its request (the ASGI disconnect message):
a queued job is dropped and its slot freed at once, a running one stops at the next token through `generate`'s
`should_stop`. The same hook ends generations at a stop string or at the per-request time limit.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import uvicorn
from hotneurons.runtime.generate import Runtime, generate, prompt_ids
from hotneurons.server import api
from hotneurons.server.api import ApiError, Result, StopMatcher
from hotneurons.server.app import make_app
from hotneurons.server.config import ServeConfig
from hotneurons.server.jobs import Events, Job

log = logging.getLogger("hotneurons.serve")

SHUTTING_DOWN = "the server is shutting down: retry on another one"
IDLE_S = 60.0  # an idle keep-alive connection is closed after this long
GRACE_S = 10.0  # on shutdown, how long responses still being sent may take before they are cut


def _model_id(info: dict[str, Any]) -> str:
    """A hub id as it is; a local model by its file or folder name (as llama.cpp's server names a GGUF), never
    by a path of this machine."""
    src = info.get("source") or {}
    if src.get("gguf_file"):
        return Path(src["gguf_file"]).stem
    name = str(info.get("name") or "model")
    return Path(name).name if src.get("kind") == "folder" or Path(name).is_absolute() else name


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound and listening before uvicorn starts (so `port` is known at once, and clients
    that come early wait in the backlog)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)  # bursts of clients are accepted, not reset
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which ends the generations before it waits for their responses: a shutdown (Ctrl-C,
    SIGTERM, `close()`) stops the running one at its next token and refuses the queue."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


GenerateFn = Callable[..., Any]  # generate()'s signature; tests pass a wrapper that slows or blocks it


class Server:
    """The HTTP server, its queue and the runtime's worker. `start()` serves in a background thread (tests);
    `serve_forever()` blocks (the CLI)."""

    def __init__(self, rt: Runtime, cfg: ServeConfig = ServeConfig(), generate_fn: GenerateFn = generate):
        self.rt, self.cfg, self._generate = rt, cfg, generate_fn
        self.model_id = cfg.model_id or _model_id(rt.lm.info)
        self.context = rt.lm.ctx
        self.vocab = rt.lm.vocab
        self._eos = set(rt.lm.eos)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()  # guards job states and the counters below
        self._tok_lock = threading.Lock()  # request threads share one tokenizer
        self.waiting = self.running = 0
        self.active_jobs: set[Job] = set()  # the running jobs
        self._closing = False
        self.counts = dict.fromkeys(("served", "dropped", "rejected", "timed_out", "errors"), 0)
        self.started = int(time.time())
        self.app = make_app(self)
        self._sock = _bind(cfg.host, cfg.port)
        # h11 even where httptools is installed: the HTTP layer the tests run on; log_config=None: the CLI's logging
        self._uv = _Uvicorn(uvicorn.Config(self.app, http="h11", log_config=None, lifespan="off",
                                           timeout_keep_alive=int(IDLE_S), timeout_graceful_shutdown=int(GRACE_S)),
                            self._stop_jobs)
        self._thread: threading.Thread | None = None
        self._batcher = None
        if cfg.parallel > 1:  # continuous batching (server/batcher.py); checks the runtime decodes batches
            from hotneurons.server.batcher import Batcher

            self._batcher = Batcher(self)
        work = self._batcher.run if self._batcher is not None else self._work
        self._worker = threading.Thread(target=work, name="pi-serve-worker", daemon=True)
        self._worker.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}"

    def start(self) -> Server:
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [self._sock]}, name="pi-serve-http",
                                        daemon=True)
        self._thread.start()
        end = time.monotonic() + 30
        while not self._uv.started and self._thread.is_alive() and time.monotonic() < end:
            time.sleep(0.01)
        if not self._uv.started:
            raise RuntimeError("pi-serve's HTTP server did not start")
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl-C or SIGTERM (uvicorn's signal handling), then stop the worker."""
        try:
            self._uv.run(sockets=[self._sock])
        finally:
            self._stop_worker()

    def close(self) -> None:
        """Stop accepting, end the running generation, answer queued requests 503, stop the worker."""
        if self._thread is not None:
            self._uv.should_exit = True  # uvicorn's shutdown calls _stop_jobs, then waits for the responses
            self._thread.join(timeout=GRACE_S + 5)
        else:
            self._stop_jobs()
            self._sock.close()
        self._stop_worker()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _stop_jobs(self) -> None:
        with self._lock:
            self._closing = True  # open keep-alive connections may still send requests: submit() refuses them
            for job in self.active_jobs:
                job.gone = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and self._drop(job):
                job.events.put(("error", ApiError(503, SHUTTING_DOWN, code="shutting_down")))

    def _stop_worker(self) -> None:
        self._stop_jobs()
        self._jobs.put(None)
        self._worker.join(timeout=10)

    # -- queue ----------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"status": "ok", "model": self.model_id, "running": self.running, "queued": self.waiting,
                    "max_queue": self.cfg.max_queue, "parallel": self.cfg.parallel, **self.counts,
                    "batch_step": str(self._batcher.kind) if self._batcher is not None else None,
                    "slots": self._batcher.slots() if self._batcher is not None else None,
                    "union": self._batcher.union.summary() if self._batcher is not None else None}

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 503 when the queue is full."""
        with self._lock:
            if self._closing:
                raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
            if self.waiting + self.running > self.cfg.max_queue + self.cfg.parallel - 1:
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

    def next_job(self, block: bool) -> Job | None | bool:
        """The next queued job, now running (state, counters); None: the worker is told to stop; False: none is
        queued (block=False). Jobs dropped while queued are skipped."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return False
            if job is None:
                return None
            with self._lock:
                if job.state != "queued":
                    continue
                job.state, self.waiting = "running", self.waiting - 1
                self.running += 1
                self.active_jobs.add(job)
                return job

    def _work(self) -> None:
        while (job := self.next_job(True)) is not None:
            try:
                event: tuple = ("done", self._run(job))
            except Exception as e:  # a failing generation fails its request, never the server
                log.exception("generation failed")
                event = ("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
                with self._lock:
                    self.counts["errors"] += 1
            with self._lock:  # before the answer goes: a client that has it sees the worker free in /health
                job.state, self.running = "done", 0
                self.active_jobs.discard(job)
            job.events.put(event)

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

        g = self._generate(self.rt, job.ids, job.max_tokens, job.sampling, on_text=on_text, should_stop=should_stop,
                           reuse=self.cfg.prompt_cache)
        rest = stops.flush()
        if rest and job.stream:
            job.events.put(("text", rest))
        eos = bool(g.token_ids) and g.token_ids[-1] in self._eos
        with self._lock:
            self.counts["timed_out" if job.timed_out else "dropped" if job.gone else "served"] += 1
        # a generation cut by the time limit ends as "length", as llama.cpp's server reports its time limit
        return Result(stops.text, "stop" if stops.hit or eos else "length", len(job.ids), len(g.token_ids))

    # -- requests -------------------------------------------------------------------------------------------

    def job_for(self, raw: bytes, chat: bool, arrived: float, events: Events) -> tuple[api.Request, Job]:
        """Decode, check and tokenise a request body; raises ApiError (4xx)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise ApiError(400, f"the body is not valid JSON ({e}): send a JSON object such as "
                                f'{{"prompt": "Hi", "max_tokens": 16}}', code="invalid_json") from None
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
                        deadline, events)

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


def serve(rt: Runtime, cfg: ServeConfig = ServeConfig(), ready: Callable[[Server], None] | None = None) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); `ready` is called once the port is bound."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises the signal it caught once it has shut down
    server = Server(rt, cfg)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
