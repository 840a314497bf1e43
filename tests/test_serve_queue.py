"""pi-serve under load and trouble: the queue, clients that leave, time limits, failures, shutdown, many clients.

The worker's generate() can be wrapped (`Server(..., generate_fn)`): `Gate` holds it until the test releases it
(a busy worker, deterministically), `slowed` adds a delay per token (a generation long enough to interrupt).
Helpers from test_serve.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hotneurons.runtime.generate import generate
from test_serve import (
    DONE,
    FAMILY,
    MESSAGES,
    OK,
    PROMPT,
    ServeConfig,
    Server,
    assert_error,
    client,
    health,
    load,
    request,
    running,
)

openai = pytest.importorskip("openai")


def wait_until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


class Gate:
    """generate() that waits for `release()`: the worker stays busy until the test says."""

    def __init__(self):
        self.event = threading.Event()

    def __call__(self, *args, **kwargs):
        assert self.event.wait(20)
        return generate(*args, **kwargs)

    def release(self):
        self.event.set()


def slowed(delay: float):
    """A generation that takes `delay` s per token and never meets EOS (a sampled random model may, early)."""
    def slow(rt, ids, n, sampling, on_text=None, should_stop=None, reuse=False):
        return generate(rt, ids, n, sampling, on_text=on_text, stop_at_eos=False, reuse=reuse,
                        should_stop=lambda: time.sleep(delay) or should_stop())

    return slow


def post_in_background(s: Server, body: dict) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(request(s, "POST", "/v1/completions", body)), daemon=True)
    t.start()
    return t, out


def open_raw(s: Server, body: dict) -> socket.socket:
    """A request sent on a bare socket, so the test can close it whenever it likes."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=20)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


# ---------------------------------------------------------------------------------------------------------------
# The queue, clients that leave, time limits, failures


def test_full_queue_is_a_503(tiny_model_dir):
    gate = Gate()
    with running(tiny_model_dir(FAMILY), gate, max_queue=2) as s:
        first = post_in_background(s, OK)
        wait_until(lambda: health(s)["running"] == 1)
        queued = [post_in_background(s, OK) for _ in range(2)]
        wait_until(lambda: health(s)["queued"] == 2)
        assert "busy" in assert_error(request(s, "POST", DONE, OK), 503, code="queue_full")
        with pytest.raises(openai.InternalServerError):  # the client sees the 503 too (no retries here)
            client(s).completions.create(model="any", prompt=PROMPT, max_tokens=2)
        gate.release()
        for t, out in [first, *queued]:
            t.join(20)
            assert out[0][0] == 200 and out[0][1]["usage"]["completion_tokens"] == 2
        h = health(s)
        assert (h["served"], h["rejected"], h["running"], h["queued"]) == (3, 2, 0, 0)


def test_queued_client_that_leaves_frees_its_slot(tiny_model_dir):
    gate = Gate()
    with running(tiny_model_dir(FAMILY), gate, max_queue=1) as s:
        first = post_in_background(s, OK)
        wait_until(lambda: health(s)["running"] == 1)
        sock = open_raw(s, OK)
        wait_until(lambda: health(s)["queued"] == 1)
        sock.close()
        wait_until(lambda: health(s)["queued"] == 0)
        assert health(s)["dropped"] == 1
        second = post_in_background(s, OK)  # takes the freed slot
        wait_until(lambda: health(s)["queued"] == 1)
        gate.release()
        for t, out in (first, second):
            t.join(20)
            assert out[0][0] == 200
        assert health(s)["served"] == 2  # the dropped request never ran


def test_streaming_client_that_leaves_stops_the_generation(tiny_model_dir):
    with running(tiny_model_dir(FAMILY), slowed(0.01)) as s:
        sock = open_raw(s, {"prompt": PROMPT, "max_tokens": 200, "stream": True})
        seen = b""
        while b"data: " not in seen:
            seen += sock.recv(4096)
        sock.close()
        wait_until(lambda: health(s)["running"] == 0)
        assert health(s)["dropped"] == 1 and health(s)["served"] == 0  # stopped, not run to its 200 tokens
        assert client(s).completions.create(model="any", prompt=PROMPT, max_tokens=2,
                                            temperature=0).usage.completion_tokens == 2


def test_timeout(tiny_model_dir):
    gate = Gate()
    rt = load(tiny_model_dir(FAMILY))
    rt.lm.eos = set()  # a sampled random model may draw its end token where the time limit cuts it: "stop" then
    with Server(rt, ServeConfig(port=0, timeout=0.5), slowed(0.02)) as s:
        t0 = time.monotonic()
        r = client(s).completions.create(model="any", prompt=PROMPT, max_tokens=200)
        assert time.monotonic() - t0 < 3.0 and r.choices[0].finish_reason == "length"
        assert 0 < r.usage.completion_tokens < 200 and health(s)["timed_out"] == 1
    with running(tiny_model_dir(FAMILY), gate, timeout=0.5) as s:
        first = post_in_background(s, OK)
        wait_until(lambda: health(s)["running"] == 1)
        assert_error(request(s, "POST", DONE, OK), 503, code="timeout")  # waited in the queue too long
        gate.release()
        first[0].join(20)
        assert health(s)["timed_out"] == 2  # the first timed out behind the gate as well


def test_a_failing_generation_is_a_500_and_the_server_goes_on(tiny_model_dir):
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return generate(*args, **kwargs)

    with running(tiny_model_dir(FAMILY), flaky) as s:
        assert "boom" in assert_error(request(s, "POST", DONE, OK), 500)
        assert request(s, "POST", DONE, OK)[0] == 200 and health(s)["errors"] == 1


def test_close_ends_the_running_generation_and_refuses_the_queue(tiny_model_dir):
    s = Server(load(tiny_model_dir(FAMILY)), ServeConfig(port=0), slowed(0.01)).start()
    first = post_in_background(s, {"prompt": PROMPT, "max_tokens": 200})
    wait_until(lambda: health(s)["running"] == 1)
    second = post_in_background(s, OK)
    wait_until(lambda: health(s)["queued"] == 1)
    s.close()
    for t, _ in (first, second):
        t.join(20)
    assert first[1][0][0] == 200 and first[1][0][1]["usage"]["completion_tokens"] < 200
    assert_error(second[1][0], 503, code="shutting_down")


def test_load_every_request_answered_or_refused(tiny_model_dir):
    """50 requests from 8 concurrent clients (streaming and not, completions and chat) on a queue of 3."""
    with running(tiny_model_dir(FAMILY), max_queue=3) as s:
        def one(i: int) -> str:
            c, kind = client(s), i % 4
            try:
                if kind == 0:
                    return "ok" if c.completions.create(model="m", prompt=PROMPT, max_tokens=4).usage else "bad"
                if kind == 1:
                    return "ok" if c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4).usage else \
                        "bad"
                stream = (c.completions.create(model="m", prompt=PROMPT, max_tokens=4, stream=True) if kind == 2 else
                          c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, stream=True))
                return "ok" if [ch for ch in stream][-1].choices[0].finish_reason else "bad"
            except openai.InternalServerError as e:
                return "busy" if e.status_code == 503 and e.body["code"] == "queue_full" else "bad"

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(50)))
        h = health(s)
        assert results.count("ok") + results.count("busy") == 50 and results.count("ok") >= 4
        assert (h["served"], h["rejected"], h["errors"], h["running"], h["queued"]) == \
            (results.count("ok"), results.count("busy"), 0, 0, 0)
        assert request(s, "POST", DONE, OK)[0] == 200
