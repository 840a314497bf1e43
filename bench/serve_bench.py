"""pi-serve throughput and time to first token with concurrent streaming clients.

    python bench/serve_bench.py                                   # runs/demo (SmolLM2-135M), hybrid and dense, 1 and 4 clients
    python bench/serve_bench.py --run RUN --modes dense --clients 1,2,8 --requests 16 --max-tokens 64

For each mode the script starts the real `pi-serve` in a subprocess on a free loopback port, waits for /health,
sends one warm-up request, then for each client count C runs C threads that together send --requests streaming
chat completions (greedy, --max-tokens each, a fixed list of questions in turn) with raw HTTP. Per request it
records the time to the first content token (TTFT: from sending the request, queue wait included), the total
latency and the completion tokens (from the stream's usage chunk). The runtime is batch-1, so requests/s stays
flat as clients grow and TTFT grows with the queue. Writes a JSON results file with the machine and the command.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from powerinfer.hardware import machine_info

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
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise click.ClickException(f"pi-serve was not ready after {timeout:.0f} s")


def stream_chat(port: int, question: str, max_tokens: int) -> dict:
    """One streaming chat completion; the times are from just before the request is sent."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"status": r.status, "error": json.loads(r.read())["error"]["message"]}
    ttft = usage = None
    for line in r:  # http.client undoes the chunking; SSE events are "data: ..." lines
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - t0
    conn.close()
    return {"status": 200, "ttft_s": ttft, "latency_s": time.perf_counter() - t0,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


def run_clients(port: int, clients: int, requests: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = stream_chat(port, QUESTIONS[i % len(QUESTIONS)], max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    tokens = sum(r["completion_tokens"] for r in ok)
    return {"clients": clients, "requests": requests, "ok": len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "completion_tokens_per_s": tokens / wall,
            "mean_completion_tokens": tokens / len(ok) if ok else None,
            "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in ok) if ok else None,
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
            "ttft_max_s": ttft[-1] if ttft else None,
            "latency_median_s": statistics.median(r["latency_s"] for r in ok) if ok else None,
            "errors": [r["error"] for r in results if r["status"] != 200]}


def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "runtime_modified": git("status", "--porcelain", "runtime/") != ""}


@click.command()
@click.option("--run", "run_dir", default="runs/demo", show_default=True, help="Run directory (make demo).")
@click.option("--modes", default="hybrid,dense", show_default=True, help="Runtime modes to serve, in turn.")
@click.option("--clients", default="1,4", show_default=True, help="Concurrent client counts.")
@click.option("--requests", default=8, show_default=True, help="Requests per (mode, clients) cell.")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--threads", type=int, default=None, help="pi-serve --threads (Numba).")
@click.option("--out", default="bench/results/serve_smollm2.json", show_default=True)
def main(run_dir, modes, clients, requests, max_tokens, threads, out):
    cells = []
    load_before = os.getloadavg()  # other jobs on the machine skew every figure: recorded with them
    for mode in modes.split(","):
        port = free_port()
        cmd = [sys.executable, "-m", "powerinfer.runtime.serve_cli", "--run", run_dir, "--mode", mode,
               "--port", str(port), "--max-queue", "64", "--quiet"]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        proc = subprocess.Popen(cmd)
        try:
            t0 = time.perf_counter()
            wait_ready(port, proc)
            load_s = time.perf_counter() - t0
            warm = stream_chat(port, QUESTIONS[0], max_tokens)  # compiles and warms caches; not counted
            for c in map(int, clients.split(",")):
                cell = {"mode": mode, "load_s": load_s, "warmup_latency_s": warm.get("latency_s"),
                        **run_clients(port, c, requests, max_tokens)}
                click.echo(f"{mode:7s} {c} clients: {cell['requests_per_s']:.3f} req/s, "
                           f"{cell['completion_tokens_per_s']:.1f} tok/s, TTFT median {cell['ttft_median_s']:.3f} s, "
                           f"p90 {cell['ttft_p90_s']:.3f} s", err=True)
                cells.append(cell)
        finally:
            proc.terminate()
            proc.wait(30)
    result = {
        "benchmark": "serve",
        "what": "pi-serve: requests/s and time to first token of streaming chat completions from concurrent "
                "clients on one batch-1 runtime; TTFT includes the queue wait",
        "command": " ".join(["python", *sys.argv]),
        "run": run_dir, "max_tokens": max_tokens, "sampling": "greedy", "client": "raw HTTP, same machine",
        "results": cells, "loadavg_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "git": git_state(), "machine": machine_info("numba", "transformers"),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(cells, indent=2))


if __name__ == "__main__":
    main()
