"""pi-serve under concurrent clients that leave at random: no request lost or corrupted. `stress` runs `clients`
threads against a running server for `seconds`: each sends one of `cases` (a completion request and the text its
solo greedy run makes), streamed or not, and with probability `cancel` closes its connection after a few events.
Every completed response must equal its solo text; every request must end answered or cancelled; the server's counts
must add up. tests/test_serve_batch.py runs it for seconds; `python -m bench.serve_stress` for minutes on a tiny
random model (CPU), writing a results file.

    python -m bench.serve_stress --minutes 10 --parallel 4 --clients 8 --out results.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import threading
import time
from pathlib import Path


def _complete(port: int, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)["choices"][0]["text"]


def _stream(port: int, body: dict, leave_after: int | None) -> str | None:
    """The streamed text, or None where the client left after `leave_after` events."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    buf, text, events = b"", "", 0
    with sock:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                line = ev.split(b"data: ", 1)[-1]
                if line.strip() == b"[DONE]":
                    return text
                if b"{" not in line:
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {obj['error']}")
                text += "".join(c.get("text") or "" for c in obj.get("choices") or [])
                events += 1
                if leave_after is not None and events >= leave_after:
                    return None
    raise RuntimeError("the stream ended without [DONE]")


def stress(port: int, cases: list[tuple[dict, str]], seconds: float, clients: int = 8, cancel: float = 0.3,
           seed: int = 0) -> dict:
    """Figures: completed, cancelled, wrong (completed but not the solo text), failed (an error or lost request)."""
    stats = {"completed": 0, "cancelled": 0, "wrong": 0, "failed": 0, "errors": []}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < end:
            body, want = rng.choice(cases)
            leave = rng.randint(1, 3) if rng.random() < cancel else None
            try:
                if leave is None and rng.random() < 0.5:
                    got = _complete(port, body)
                else:
                    got = _stream(port, body, leave)
                key = "cancelled" if got is None else "completed" if got == want else "wrong"
            except Exception as e:  # every failure is a figure
                key = "failed"
                with lock:
                    stats["errors"].append(f"{type(e).__name__}: {e}"[:300])
            with lock:
                stats[key] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    stats["errors"] = stats["errors"][:10]
    return stats


def main(argv: list[str] | None = None) -> dict:
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_runtime
    from hotneurons.server.serve import ServeConfig, Server

    from bench.record import write_result
    from tests import tiny

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--cancel", type=float, default=0.3, help="share of requests whose client leaves mid-stream")
    p.add_argument("--work", type=Path, default=Path("/tmp/serve-stress"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    folder = tiny.build("llama-reglu", a.work / "llama-reglu")
    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu"), model=str(folder))
    prompts = ["The quick brown fox", "Once upon a time", "1 2 3 4", "Hello"]
    cases = [({"prompt": q, "max_tokens": n, "temperature": 0}, generate(rt, rt.lm.tokenizer(q)["input_ids"], n).text)
             for q in prompts for n in (4, 16, 40)]
    with Server(rt, ServeConfig(port=0, parallel=a.parallel, max_queue=64)) as s:
        figures = stress(s.port, cases, a.minutes * 60, a.clients, a.cancel)
        figures["health"] = json.loads(_get(s.port, "/health"))
    figures |= {"minutes": a.minutes, "parallel": a.parallel, "clients": a.clients, "cancel": a.cancel}
    print({k: v for k, v in figures.items() if k != "health"})
    write_result(a.out, figures)
    return figures


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("GET", path)
    data = conn.getresponse().read()
    conn.close()
    return data


if __name__ == "__main__":
    main()
