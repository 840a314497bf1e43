"""pi-serve's continuous batching (`--parallel N`, N > 1): the worker keeps up to N requests running together, each
in its own KV cache slot, and decodes them a token each per step: in one batched step (runtime/batch.step_batch) or
by the batch-1 step for each in turn (step_each, where the runtime replays CUDA graphs: --batch-step). Requests join and
leave the running batch at token boundaries: a new one's prompt is prefilled PREFILL_CHUNK tokens at a time between
the running ones' steps (so a long prompt holds the others up for one chunk at a time), a finished, stopped,
cancelled or timed-out one frees its slot at once, whose cache keeps its tokens for a request that continues them (the
prompt cache: `_pick`). Streaming, stop strings, time limits and cancellation behave per request as with one request
at a time (server/serve.py's `_run`): each request samples with its own generator from its own seed, so its tokens
are those it gets alone (greedy: the same ids; tests/test_serve_batch.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from hotneurons.runtime.generate import common_prefix
from hotneurons.runtime.sampling import sample
from hotneurons.server.api import ApiError, Result, StopMatcher
from hotneurons.server.jobs import Job

log = logging.getLogger("hotneurons.serve")

PREFILL_CHUNK = 256  # prompt tokens prefilled between two decode steps of the running requests


@dataclass(eq=False)
class Slot:
    """One running request: its cache slot, prompt tokens fed so far, tokens made, text sent."""

    job: Job
    slot: int
    stops: StopMatcher
    gen: torch.Generator
    fed: int = 0  # prompt tokens in the cache
    ids: list[int] = field(default_factory=list)
    shown: str = ""
    logits: torch.Tensor | None = None  # (vocab,) for the next token, once the prompt is in

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.ids)


class Batcher:
    """The worker loop of a Server with cfg.parallel > 1 (server/serve.py hands over its queue and counters)."""

    def __init__(self, server: Any):
        self.server, self.rt = server, server.rt
        from hotneurons.common.units import format_bytes
        from hotneurons.runtime.batch import batch_decoder, slot_bytes

        self.n = server.cfg.parallel
        try:
            self.dec = batch_decoder(self.rt)
        except ValueError as e:
            raise ValueError(f"--parallel {self.n}: {e}; serve it with --parallel 1") from None

        extra = slot_bytes(self.dec) * max(0, self.n - self.dec.n_slots)  # bytes: the other requests' KV caches
        vram = self.rt.cfg.vram
        if vram is not None and self.rt.device.type != "cpu" and self.rt.bytes_gpu + extra > vram:
            raise ValueError(f"--parallel {self.n} needs {format_bytes(extra)} more for its KV cache slots, past "
                             f"--vram {format_bytes(vram)}: solve the placement for it (pi-solve --parallel "
                             f"{self.n}), lower --ctx, or serve fewer at once")
        self.dec.add_slots(max(self.dec.n_slots, self.n))
        from hotneurons.runtime.batch import batch_step, step_kind

        self.kind = step_kind(self.rt, server.cfg.batch_step)  # /health names it
        self.step = batch_step(self.rt, self.kind)
        self.rt.bytes_gpu += extra
        self.eos = set(self.rt.lm.eos)
        self.active: list[Slot] = []
        # per slot, the tokens its cache holds from the request that ran there last (--no-prompt-cache: none kept);
        # a new request computes what follows those of the slot it takes (_pick)
        self.held: list[list[int]] = [[] for _ in range(self.n)]
        from hotneurons.runtime.batch import UnionStats

        self.union = UnionStats()  # the cold rows' union per batch size, /health's "union"

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        srv = self.server
        while True:
            if not self._admit(block=not self.active):
                for s in self.active:  # shutting down: end the running requests at this token
                    s.job.gone = True
                self._finish_ended()
                return
            try:
                self._prefill_one()
                self._emit()
                self._finish_ended()
                self._decode()
            except Exception as e:  # a failing step fails the running requests, never the server
                log.exception("batched step failed")
                for s in list(self.active):
                    self._end(s, ("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}")), "errors")
            with srv._lock:
                srv.running = len(self.active)

    def _admit(self, block: bool) -> bool:
        """Take queued jobs into free slots; False once the server's queue says stop."""
        srv = self.server
        while len(self.active) < self.n:
            job = srv.next_job(block and not self.active)
            if job is None:  # the server stops
                return False
            if job is False:  # nothing queued
                return True
            used = {s.slot for s in self.active}
            slot, reuse = self._pick([i for i in range(self.n) if i not in used], job.ids)
            job.events.put(("start",))
            self.active.append(Slot(job, slot, StopMatcher(job.stop),
                                    torch.Generator().manual_seed(job.sampling.seed), fed=reuse))
            self.held[slot] = []  # rewritten from here on; what it holds is known again when the request ends
        return True

    def _pick(self, free: list[int], ids: list[int]) -> tuple[int, int]:
        """(slot, prompt tokens its cache holds already) for a new request: the free slot whose tokens are mostly the
        prompt's start (a conversation going on: the longest such), else the one that holds the fewest (a new
        conversation evicts the least), ties to the lowest slot."""
        reuse = {i: common_prefix(self.held[i], ids) for i in free}  # at most all but the prompt's last token
        going = [i for i in free if reuse[i] and 2 * reuse[i] >= len(self.held[i])]
        slot = (max(going, key=lambda i: (reuse[i], -i)) if going
                else min(free, key=lambda i: (len(self.held[i]), i)))
        return slot, reuse[slot]

    @torch.inference_mode()
    def _prefill_one(self) -> None:
        """The next PREFILL_CHUNK tokens of the first request whose prompt is not in its slot yet."""
        from hotneurons.common.kinds import BatchStep
        from hotneurons.runtime.engine import forward
        from hotneurons.runtime.generate import step_prefill

        s = next((s for s in self.active if s.prefilling and not s.job.gone), None)
        if s is None:
            return
        ids = s.job.ids
        # a short prompt (or the rest of one whose start its slot holds) through the decode step: the graphs'
        # (interleaved), or any where asked (an eager batched step of a mixture of experts costs as much as a pass)
        if len(ids) - s.fed <= step_prefill(self.rt) and (self.kind == BatchStep.INTERLEAVED
                                                          or self.rt.cfg.step_prefill is not None):
            for pos, t in enumerate(ids[s.fed:], start=s.fed):
                logits = self.step([t], [pos], [s.slot])[0]  # (vocab,)
            chunk = ids[s.fed:]
        else:
            chunk = ids[s.fed:s.fed + PREFILL_CHUNK]
            with self.dec.slot(s.slot):
                logits = forward(self.rt, chunk, s.fed)  # (vocab,) of the chunk's last token
        s.fed += len(chunk)
        if not s.prefilling:
            s.logits = logits

    def _emit(self) -> None:
        """Each request with logits: its next token sampled, its text streamed, its end decided."""
        tok = self.rt.lm.tokenizer
        for s in self.active:
            if s.logits is None:
                continue
            job = s.job
            nxt = sample(s.logits, job.ids + s.ids, job.sampling, s.gen)
            s.ids.append(nxt)
            s.logits = None
            text = tok.decode(s.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(s.shown):  # a whole UTF-8 character
                out = s.stops.feed(text[len(s.shown):])
                s.shown = text
                if out and job.stream:
                    job.events.put(("text", out))

    def _ended(self, s: Slot) -> bool:
        job = s.job
        if job.expired():
            job.timed_out = True
        made = len(s.ids) >= job.max_tokens or bool(s.ids) and s.ids[-1] in self.eos
        return job.gone or job.timed_out or s.stops.hit or made

    def _finish_ended(self) -> None:
        for s in [s for s in self.active if self._ended(s)]:
            job = s.job
            text = self.rt.lm.tokenizer.decode(s.ids, skip_special_tokens=True)
            if len(text) > len(s.shown) and not s.stops.hit:  # a last piece held back as half a character
                out = s.stops.feed(text[len(s.shown):])
                if out and job.stream:
                    job.events.put(("text", out))
            rest = s.stops.flush()
            if rest and job.stream:
                job.events.put(("text", rest))
            eos = bool(s.ids) and s.ids[-1] in self.eos
            result = Result(s.stops.text, "stop" if s.stops.hit or eos else "length", len(job.ids), len(s.ids))
            self._end(s, ("done", result), "timed_out" if job.timed_out else "dropped" if job.gone else "served")

    def _end(self, s: Slot, event: tuple, count: str) -> None:
        srv = self.server
        with srv._lock:
            srv.counts[count] += 1
            s.job.state = "done"
            srv.active_jobs.discard(s.job)
            self.active.remove(s)
            srv.running = len(self.active)
        if self.server.cfg.prompt_cache:  # the prompt fed, and each token made but the last (sampled, never fed)
            self.held[s.slot] = s.job.ids[:s.fed] + (s.ids[:-1] if not s.prefilling else [])
        else:
            self.dec.free_slot(s.slot)  # its cache need not move with the next exchange (interleaved steps)
        s.job.events.put(event)

    @torch.inference_mode()
    def _decode(self) -> None:
        """One batched step for the requests whose last token is sampled and not their last."""
        live = [s for s in self.active if not s.prefilling and s.ids and s.logits is None]
        if not live:
            return
        logits = self.step([s.ids[-1] for s in live], [len(s.job.ids) + len(s.ids) - 1 for s in live],
                           [s.slot for s in live], self.union)  # (B, vocab)
        for s, lg in zip(live, logits):
            s.logits = lg

    def slots(self) -> list[dict]:
        """/health's view of the slots (read without the worker's lock: a snapshot that may be one token old)."""
        busy = {s.slot: s for s in list(self.active)}
        return [{"slot": i, "state": "free" if i not in busy else "prefill" if busy[i].prefilling else "decode",
                 **({"prompt_tokens": len(busy[i].job.ids), "tokens": len(busy[i].ids)} if i in busy
                    else {"cached_tokens": len(self.held[i])})}
                for i in range(self.n)]
