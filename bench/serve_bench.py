"""pi-serve throughput and time to first token with concurrent streaming clients.

    python -m bench.serve_bench
        # runs/demo (SmolLM2-135M), hybrid and dense, 1 and 4 clients
    python -m bench.serve_bench --run RUN --modes dense --clients 1,2,8 --requests 16 --max-tokens 64

The script starts one real `pi-serve` per mode and --parallel value in a subprocess on a free loopback port, one at
a time (an idle one beside would hold memory and threads that the measured one could want), waits for /health and
sends --parallel warm-up requests at once. Then, --rounds times, for each client count C, C threads together send
--requests streaming chat completions (greedy, --max-tokens each, a fixed list of questions in turn) with raw HTTP.
Per request it records the time to the first content token (TTFT: from sending the request, queue wait included),
the total latency and the completion tokens (from the stream's usage chunk). Figures pool all rounds; requests/s per
round shows the spread, and the gaps between a stream's content events its inter-token latency (ITL). With
--parallel 1 the runtime is batch-1, so requests/s stays flat as clients grow and TTFT grows with the queue; with
--parallel N up to N requests decode together (continuous batching). --turns K makes each request a conversation of
K (a later turn resends the earlier ones and their answers: the prompt cache's case; TTFT per turn). Writes a JSON
results file with the machine, its load and the command, after each server (a run cut short, by a timeout's SIGTERM
too, keeps what it measured: "complete" says which).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import click
from hotneurons.common.hardware import machine_info

from bench import record

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Give me a short tip for learning Python.", "What does a CPU do?", "Write a haiku about rain.",
             "How many legs does a spider have?", "What is photosynthesis?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise click.ClickException(f"pi-serve exited with {proc.returncode} before it was ready")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.5)
    raise click.ClickException(f"pi-serve was not ready after {timeout:.0f} s")


FOLLOW_UP = "Tell me more."  # each later turn of a conversation (--turns)


def stream_chat(port: int, question: str, max_tokens: int, endpoint: str = "chat",
                history: list[tuple[str, str]] = ()) -> dict:
    """One streaming chat completion (endpoint "completions": the question as a plain prompt, for a model without a
    chat template, e.g. a benchmark's synthetic file), after the (question, answer) turns of `history`; the times are
    from just before the request is sent."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        turns = [m for q, a in history for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        body["messages"] = [*turns, {"role": "user", "content": question}]
    else:
        body["prompt"] = "".join(f"{q}{a}\n" for q, a in history) + question
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions" if endpoint == "chat" else "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"status": r.status, "error": json.loads(r.read())["error"]["message"]}
    ttft = usage = None
    text: list[str] = []
    seen: list[float] = []  # when each content event arrived
    for line in r:  # http.client undoes the chunking; SSE events are "data: ..." lines
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        choice = event["choices"][0] if event["choices"] else {}
        piece = choice.get("delta", {}).get("content") or choice.get("text")
        if piece:
            seen.append(time.perf_counter() - t0)
            ttft = seen[0]
            text.append(piece)
    conn.close()
    return {"status": 200, "ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": "".join(text),
            "turn": len(history) + 1,
            "itl_s": [b - a for a, b in zip(seen, seen[1:])],
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


def _health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def run_clients(port: int, clients: int, requests: int, max_tokens: int, endpoint: str = "chat", turns: int = 1
                ) -> tuple[list[dict], float]:
    """`requests` conversations of `turns` requests each (a later turn sends the earlier ones and their answers,
    then FOLLOW_UP) from `clients` threads; returns each request's record and the wall time."""
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            history: list[tuple[str, str]] = []
            for t in range(turns):
                q = QUESTIONS[i % len(QUESTIONS)] if t == 0 else FOLLOW_UP
                r = stream_chat(port, q, max_tokens, endpoint, history)
                with lock:
                    results.append(r)
                if r["status"] != 200:
                    break
                history.append((q, r["text"]))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def summary(mode: str, parallel: int, clients: int, results: list[dict], walls: list[float], oks: list[int]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    itl = sorted(g for r in ok for g in r["itl_s"])  # inter-token latency: gaps between a stream's content events
    tokens = sum(r["completion_tokens"] for r in ok)
    wall = sum(walls)
    return {"mode": mode, "parallel": parallel, "clients": clients, "requests": len(results), "ok": len(ok),
            "wall_s": wall, "itl_median_s": _pct(itl, 0.5), "itl_p95_s": _pct(itl, 0.95),
            "ttft_p95_s": _pct(ttft, 0.95),
            "requests_per_s": len(ok) / wall, "requests_per_s_per_round": [n / w for n, w in zip(oks, walls)],
            "completion_tokens_per_s": tokens / wall,
            "mean_completion_tokens": tokens / len(ok) if ok else None,
            "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in ok) if ok else None,
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
            "ttft_max_s": ttft[-1] if ttft else None,
            "latency_median_s": statistics.median(r["latency_s"] for r in ok) if ok else None,
            # per turn of a conversation (--turns): the prompt cache computes a later turn's new tokens only
            "ttft_median_s_by_turn": {str(t): statistics.median(r["ttft_s"] for r in ok if r["turn"] == t)
                                      for t in sorted({r["turn"] for r in ok if r["ttft_s"] is not None})},
            "errors": [r["error"] for r in results if r["status"] != 200]}


def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    # uncommitted changes to the runtime or the model loading would make the commit a wrong label
    return {"commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "runtime/", "common/").splitlines()}


@click.command()
@click.option("--run", "run_dir", default="runs/demo", show_default=True, help="Run directory (make demo).")
@click.option("--modes", default="hybrid,dense", show_default=True, help="Runtime modes, one server each.")
@click.option("--clients", default="1,4", show_default=True, help="Concurrent client counts.")
@click.option("--requests", default=8, show_default=True, help="Requests per (mode, clients) cell and round.")
@click.option("--rounds", default=3, show_default=True, help="Rounds over all cells.")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--threads", type=int, default=None, help="pi-serve --threads (Numba).")
@click.option("--parallel", default="1", show_default=True,
              help="pi-serve --parallel values, one server each (1: batch 1; N: continuous batching of N requests).")
@click.option("--serve-args", default="", help="More pi-serve flags, e.g. '--vram 24GiB --device cuda'.")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
              help="chat: /v1/chat/completions; completions: /v1/completions with the question as the prompt (a "
              "model without a chat template, e.g. bench_70b's synthetic file).")
@click.option("--turns", default=1, show_default=True, help="Requests per conversation: each later turn sends the "
              "earlier questions and answers, then a follow-up (what a chat front end sends; the prompt cache's "
              "case). --requests counts conversations.")
@click.option("--out", default="bench/results/serve_smollm2.json", show_default=True)
def main(run_dir, modes, clients, requests, rounds, max_tokens, threads, parallel, serve_args, endpoint, turns, out):
    modes, counts = modes.split(","), [int(c) for c in clients.split(",")]
    pars = [int(p) for p in parallel.split(",")]
    modes = [(m, p) for m in modes for p in pars]  # one server each
    load_before = os.getloadavg()  # other jobs on the machine skew every figure: recorded with them
    # a timeout's SIGTERM as an exception: the finally below stops the server, and the cells measured are on disk
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cells: dict[tuple[tuple[str, int], int], tuple[list, list, list]] = {}
    healths: dict[str, dict] = {}
    for mode, par in modes:  # one server up at a time: an idle one's memory and threads sit beside none measured
        port = free_port()
        cmd = [sys.executable, "-m", "hotneurons.server.cli", "--run", run_dir, "--mode", mode,
               "--port", str(port), "--max-queue", "64", "--parallel", str(par), "--quiet", *serve_args.split()]
        proc = subprocess.Popen(cmd + (["--threads", str(threads)] if threads is not None else []))
        try:
            wait_ready(port, proc)
            # compiles and warms caches, the batched step's too (par requests at once); not counted
            run_clients(port, par, par, max_tokens, endpoint)
            for r in range(rounds):
                for c in counts:
                    results, wall = run_clients(port, c, requests, max_tokens, endpoint, turns)
                    records, walls, oks = cells.setdefault(((mode, par), c), ([], [], []))
                    records += results
                    walls.append(wall)
                    oks.append(sum(x["status"] == 200 for x in results))
                    click.echo(f"round {r + 1}: {mode:7s} x{par} {c} clients: {oks[-1] / wall:.3f} req/s", err=True)
            healths[f"{mode}-x{par}"] = _health(port)  # the cold rows' union
        finally:
            proc.terminate()
            proc.wait(30)
        write(out, cells, healths, load_before, run_dir, max_tokens, rounds, endpoint, turns,
              complete=(mode, par) == modes[-1])


def write(out: str, cells: dict, healths: dict, load_before: tuple, run_dir: str, max_tokens: int, rounds: int,
          endpoint: str, turns: int, complete: bool) -> None:
    """The cells measured so far into `out` (after each server: a run cut short keeps what it measured)."""
    table = [summary(*m, c, *cells[m, c]) for (m, c) in cells]

    def sec(v: float | None) -> str:  # None: no request of the cell answered
        return "-" if v is None else f"{v:.3f} s"

    for t in table if complete else []:  # the whole table once, at the end
        click.echo(f"{t['mode']:7s} x{t['parallel']} {t['clients']} clients: {t['requests_per_s']:.3f} req/s, "
                   f"{t['completion_tokens_per_s']:.1f} tok/s, TTFT median {sec(t['ttft_median_s'])}, "
                   f"p90 {sec(t['ttft_p90_s'])}, ITL median {sec(t['itl_median_s'])}"
                   + (f", errors: {t['errors'][0]}" if t["errors"] else ""), err=True)
    result = {
        "benchmark": "serve",
        "what": "pi-serve: requests/s, time to first token and inter-token latency of streaming chat completions "
                "from concurrent clients, batch 1 or --parallel N, one server up at a time; TTFT includes the queue "
                "wait",
        "command": " ".join(["python", *sys.argv]), "complete": complete,
        "run": run_dir, "max_tokens": max_tokens, "rounds": rounds, "sampling": "greedy", "endpoint": endpoint,
        "turns": turns,
        "client": "raw HTTP from the same machine", "results": table, "health": healths,
        "loadavg_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "git": git_state(), "machine": machine_info("numba", "transformers"),
    }
    record.write_flat(out, result, commit=record.git_commit())

if __name__ == "__main__":
    main()
