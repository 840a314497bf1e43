"""A request in pi-serve's queue (`Job`) and the channel its worker's events come back by (`Events`): what the
HTTP side (server/app.py) and the worker (server/serve.py) hand each other."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hotneurons.runtime.sampling import Sampling


class Events:
    """The worker's events for one request: ("start",) ("text", s) ("done", Result) ("error", ApiError). `put`
    from any thread; `get` on the event loop that made it."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()

    def put(self, event: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody waits for this request any more
            pass

    async def get(self) -> tuple:
        return await self._queue.get()


@dataclass(eq=False)
class Job:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    deadline: float | None  # time.monotonic() after which the job ends
    events: Events
    state: str = "queued"  # queued -> running -> done, or queued -> dropped (client left or timed out)
    gone: bool = False  # the client left: the worker stops at the next token
    timed_out: bool = False

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline
