"""The OpenAI API's shapes for pi-serve: request checking, stop strings, response bodies and stream chunks.

No HTTP here (server/app.py speaks it), so every rule is testable on plain dicts. Requests follow the OpenAI
completions and chat completions APIs; `top_k` and `repetition_penalty` are extensions. Parameters the runtime
cannot honour are refused when set to anything but their neutral value (a client that asks for logprobs or a
frequency penalty is told, instead of silently getting something else); unknown fields are ignored, as most
OpenAI-compatible servers do.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from hotneurons.runtime.sampling import Sampling

MAX_STOPS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Request:
    """One checked request. `prompt`: text or token ids (completions) or a message list (chat)."""

    chat: bool
    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int | None  # None: the server's default, clipped to the context
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage counts


# Parameters the runtime cannot honour, with the values that mean "off" (compared with their type, so that
# `n: true` is not taken for 1). Anything else is refused.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
}
INSTEAD = {"frequency_penalty": "use repetition_penalty instead", "presence_penalty": "use repetition_penalty instead",
           "n": "send one request per completion", "best_of": "send one request per completion"}


def _describe(v: Any) -> str:
    text = repr(v)
    return (text[:40] + "...") if len(text) > 43 else text


def _bad_type(name: str, v: Any, want: str, example: str) -> ApiError:
    return ApiError(400, f"'{name}' must be {want}, got {_describe(v)} ({type(v).__name__}): pass e.g. {example}",
                    name, "invalid_type")


def _number(body: dict, name: str, default: float, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad_type(name, v, "a number", str(default))
    if v < lo or v > hi or (lo_open and v == lo):
        bounds = f"{'above' if lo_open else 'at least'} {lo:g}" + ("" if hi == math.inf else f" and at most {hi:g}")
        raise ApiError(400, f"'{name}' = {v!r} is out of range: it must be {bounds}", name, "invalid_value")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad_type(name, v, "an integer", "64")
    if v < lo:
        raise ApiError(400, f"'{name}' = {v} is out of range: it must be at least {lo}", name, "invalid_value")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad_type(name, v, "true or false", "true")
    return v


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad_type("stop", v, "a string or a list of strings", '["\\n\\n"]')
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"'stop' = {_describe(v)}: give at most {MAX_STOPS} non-empty strings", "stop",
                       "invalid_value")
    return tuple(stops)


def _prompt(v: Any, vocab: int) -> str | list[int]:
    """A string, or token ids; OpenAI's one-element lists of either are unwrapped. Batches are refused."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        bad = next((t for t in v if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' holds token id {bad}, outside the vocabulary [0, {vocab})", "prompt",
                           "invalid_value")
        return v
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise ApiError(400, f"'prompt' holds {len(v)} prompts: send one prompt per request", "prompt",
                       "invalid_value")
    raise _bad_type("prompt", v, "a string or a list of token ids", '"Once upon a time"')


def _messages(v: Any) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and text content (text parts of a content list joined)."""
    if not isinstance(v, list) or not v:
        raise _bad_type("messages", v, "a non-empty list of {role, content} objects",
                        '[{"role": "user", "content": "Hi"}]')
    out = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad_type(name, m, "an object with a string 'role'", '{"role": "user", "content": "Hi"}')
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad_type(f"{name}.content", content, "a string (or a list of text parts)", '"Hi"')
        out.append({"role": m["role"], "content": content})
    return out


def parse(body: Any, chat: bool, vocab: int, context: int) -> Request:
    """Check a decoded JSON body of /v1/completions (chat=False) or /v1/chat/completions (chat=True)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}: send {{\"prompt\": ...}}",
                       code="invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad_type("model", model, "a string", '"default"')
    for name, neutral in NEUTRAL.items():
        v = body.get(name)
        if not any(type(v) is type(n) and v == n for n in neutral):
            why = INSTEAD.get(name, "leave it out")
            raise ApiError(400, f"'{name}' = {_describe(v)} is not supported by this server: {why}", name,
                           "unsupported_parameter")
    key = "messages" if chat else "prompt"
    if key not in body:
        raise ApiError(400, f"'{key}' is missing: a {'chat ' if chat else ''}completion request needs it", key,
                       "missing_required_parameter")
    prompt = _messages(body[key]) if chat else _prompt(body[key], vocab)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, None, 1)
    if max_tokens is not None and max_tokens >= context:
        raise ApiError(400, f"'{name}' = {max_tokens} does not fit the model's context of {context} tokens "
                            f"(prompt included): lower it", name, "context_length_exceeded")
    # top_p = 0 is legal in OpenAI's API and means "the most likely token"; the sampler's rule keeps the smallest
    # prefix reaching top_p, which a tiny positive value turns into exactly that.
    top_p = max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-9)
    seed = _integer(body, "seed", None, -(2 ** 63))
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0.0),
                        top_k=_integer(body, "top_k", 0, 0), top_p=top_p,
                        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, lo_open=True),
                        # no seed: a fresh one, as OpenAI's API samples differently on every call
                        seed=secrets.randbits(63) if seed is None else seed % 2 ** 63)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad_type("stream_options", options, "an object", '{"include_usage": true}')
    include_usage = stream and _bool(options or {}, "include_usage")
    return Request(chat, prompt, max_tokens, sampling, _stops(body.get("stop")), stream, include_usage)


class StopMatcher:
    """Generated text cut before the first stop string. While streaming, `feed` holds back a tail that may be
    the start of a stop string, so that no part of one is ever sent."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent, self.hit = stops, "", 0, False

    def _take(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], end
        return out

    def feed(self, piece: str) -> str:
        """Add generated text; return what may be sent now."""
        if self.hit:
            return ""
        self.text += piece
        # an occurrence cannot begin before `sent`: that text was sent because no stop string began there
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.text = True, self.text[:min(found)]
            return self._take(len(self.text))
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._take(max(self.sent, len(self.text) - hold))

    def flush(self) -> str:
        """The generation ended: the held-back tail is not a stop string after all."""
        return self._take(len(self.text))


# ---------------------------------------------------------------------------------------------------------------
# Response bodies


@dataclass(frozen=True)
class Result:
    text: str
    finish_reason: str  # stop (end of sequence or a stop string), length (max_tokens, context or time limit)
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Reply:
    """Bodies of one response: whole (`full`) or as stream chunks, with one id and creation time."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)

    def _wrap(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": None, **extra}

    def full(self, r: Result) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": r.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        return self._wrap("chat.completion" if self.chat else "text_completion", [choice], usage=r.usage())

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """A stream chunk; `first` (chat) opens the assistant message, `finish_reason` closes the choice."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, r: Result) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk has no choices and the counts."""
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage=r.usage())
