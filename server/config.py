"""`ServeConfig`: how pi-serve listens and answers; free of the server's and the engine's imports, so that
`pi-serve --help` answers at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (tests)
    api_key: str | None = None  # set: every /v1 request needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests waiting behind the running one; more are answered 503
    timeout: float | None = 600.0  # seconds from arrival to the last token (queue wait included); None: no limit
    max_tokens: int = 256  # for requests that name none (OpenAI's own default for completions is 16)
    model_id: str | None = None  # the name /v1/models lists and responses carry (default: the model's name)
    parallel: int = 1  # requests decoded together (server/batcher.py), each in its own KV cache slot
    batch_step: str = "auto"  # common.kinds.BatchStep: how the running requests decode a token each
    # a request whose prompt starts with tokens a KV cache still holds from an earlier one (a chat's history) computes
    # only the rest (--parallel 1: generate's `reuse`; N: the batcher's slots, Batcher._pick); False: every prompt whole
    prompt_cache: bool = True

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is out of range: use 0-65535")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue {self.max_queue} is negative: use 0 (only the running request) or more")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout {self.timeout} must be positive (seconds); 0 on the command line: no limit")
        if not 1 <= self.parallel <= 64:
            raise ValueError(f"--parallel {self.parallel} must be 1 to 64 (requests decoded together)")
        from hotneurons.common.kinds import BatchStep

        if self.batch_step not in BatchStep.values():
            raise ValueError(f"--batch-step {self.batch_step!r} is not one of {', '.join(BatchStep.values())}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens {self.max_tokens} must be at least 1")
