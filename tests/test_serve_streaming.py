"""pi-serve streaming: a streamed response that reaches the client while the generation still runs, and the stop
strings' matcher (server/api.py) that never sends part of a stop string. Helpers from test_serve.py."""

from __future__ import annotations

import http.client
import json
import threading

from hotneurons.runtime.generate import generate
from hotneurons.server.api import StopMatcher
from test_serve import DONE, FAMILY, PROMPT, client, health, running


class HoldAfterFirstText:
    """generate() that stops after its first piece of text until `release()`: a generation still running while
    the test reads what has arrived."""

    def __init__(self):
        self.event, self.held, self.waited = threading.Event(), False, False

    def __call__(self, rt, ids, n, sampling, on_text=None, should_stop=None, reuse=False):
        def text(piece: str) -> None:
            self.held = True  # before the piece goes out: should_stop(), next, waits
            on_text(piece)

        def stop() -> bool:
            if self.held and not self.waited:
                self.waited = True
                assert self.event.wait(20)
            return should_stop()

        return generate(rt, ids, n, sampling, on_text=text, stop_at_eos=False, should_stop=stop)

    def release(self):
        self.event.set()


def test_a_streamed_response_arrives_incrementally(tiny_model_dir):
    """The first piece of text reaches the client while the generation is still running (held after that piece
    until the test has read it), over plain HTTP/1.1 chunks read as they come."""
    hold = HoldAfterFirstText()
    with running(tiny_model_dir(FAMILY), hold) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
        conn.request("POST", DONE, json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
        assert r.getheader("Transfer-Encoding") == "chunked"
        events = []
        while not any(e["choices"][0]["text"] for e in events):
            line = r.readline()
            assert line, "the stream ended before any text"
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        assert hold.held and not hold.event.is_set() and health(s)["running"] == 1  # the generation waits
        assert all(e["choices"][0]["finish_reason"] is None for e in events)
        hold.release()
        rest = [line for line in r.read().split(b"\n") if line.startswith(b"data: ")]
        conn.close()
        assert rest[-1] == b"data: [DONE]"
        events += [json.loads(line[6:]) for line in rest[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events) == \
            client(s).completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        assert events[-1]["choices"][0]["finish_reason"] == "length" and health(s)["served"] == 2


def test_stop_matcher_never_sends_part_of_a_stop_string():
    m = StopMatcher(("END", "\n\n"))
    sent = [m.feed(p) for p in ["ab", "cE", "N", "x E", "N", "D tail"]]
    assert sent == ["ab", "c", "", "ENx ", "", ""] and m.hit and m.text == "abcENx "
    m = StopMatcher(("END",))
    assert [m.feed("aE"), m.feed("N"), m.flush()] == ["a", "", "EN"] and not m.hit and m.text == "aEN"
    assert StopMatcher(()).feed("anything") == "anything"
