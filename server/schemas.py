"""pydantic models of pi-serve's requests and responses, for the OpenAPI document (/openapi.json) only.

The server checks requests with server/api.py, whose rules and error codes are the API's; these models describe
the same fields for people and tools (tests/test_serve.py checks that they name only fields api.py reads).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as most OpenAI-compatible servers do


class StreamOptions(_Open):
    include_usage: bool = Field(False, description="a last chunk with no choices and the usage counts")


class _Sampling(_Open):
    model: str | None = Field(None, description="ignored: the one model answers any name")
    max_tokens: int | None = Field(None, ge=1, description="prompt + max_tokens must fit the context; unset: "
                                   "pi-serve's --max-tokens, clipped to what is left of the context")
    temperature: float = Field(1.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, ge=0, le=1, description="0 keeps the most likely token only")
    top_k: int = Field(0, ge=0, description="extension; 0 = off")
    repetition_penalty: float = Field(1.0, gt=0, description="extension; 1 = off (HF rule)")
    seed: int | None = Field(None, description="the same request with the same seed gives the same text; unset: a "
                             "fresh seed per request")
    stop: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                          Field(max_length=4)] | None = Field(
        None, description="up to 4 strings; the text ends before the first one (never sent, also not in part while "
                          "streaming)")
    stream: bool = Field(False, description="server-sent events in OpenAI's chunk format, then data: [DONE]")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="ignored")


class CompletionRequest(_Sampling):
    """POST /v1/completions. Refused unless left out or neutral: n, best_of, echo, logprobs, suffix, logit_bias,
    frequency_penalty, presence_penalty (use repetition_penalty)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="a string, token ids, or a one-element list of either", examples=["Once upon a time"])


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: str = Field(..., examples=["user"])
    content: str | list[TextPart]


class ChatRequest(_Sampling):
    """POST /v1/chat/completions. Refused unless left out or neutral: n, logprobs, top_logprobs, logit_bias, tools,
    functions, tool_choice, response_format, frequency_penalty, presence_penalty."""

    messages: list[Message] = Field(..., min_length=1, description="rendered by the tokenizer's chat template",
                                    examples=[[{"role": "user", "content": "Hi!"}]])
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class TextChoice(_Choice):
    text: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class _Answer(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: None
    usage: Usage


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: list[TextChoice]


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: str
    model: str
    running: int
    queued: int
    max_queue: int
    served: int
    dropped: int
    rejected: int
    timed_out: int
    errors: int
    parallel: int  # requests decoded together
    batch_step: str | None  # parallel > 1: batched or interleaved (pi-serve --batch-step)
    slots: list[dict] | None  # with parallel > 1: each slot's state (free, prefill, decode) and its request's tokens
    union: dict[str, dict] | None  # parallel > 1, per batch size: the cold rows a step read per token (their union)


class ErrorDetail(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "a bad request; `param` names the field, `code` says why"},
    401: {"model": ErrorResponse, "description": "--api-key set and the Bearer token missing or wrong"},
    404: {"model": ErrorResponse, "description": "not_found, model_not_found"},
    413: {"model": ErrorResponse, "description": "a body over 8 MiB"},
    500: {"model": ErrorResponse, "description": "the generation failed"},
    503: {"model": ErrorResponse, "description": "queue_full, timeout (queued too long), shutting_down; with "
                                                 "Retry-After: 1"},
}


def answers(model: str) -> dict[int | str, dict[str, Any]]:
    """A completion route's responses: JSON, or (stream) server-sent events, and the errors."""
    return {200: {"model": globals()[model], "description": "the completion; with `stream: true`, server-sent "
                  "events (`data: {chunk}` ... `data: [DONE]`)", "content": {"text/event-stream": {}}}, **ERRORS}


def body(model: str) -> dict[str, Any]:
    """openapi_extra for a route that reads its body raw: the model's schema as its request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model}"}}}}}


def request_schemas() -> dict[str, Any]:
    """The request models' schemas (and those they refer to) for the OpenAPI document's components."""
    out: dict[str, Any] = {}
    for m in (CompletionRequest, ChatRequest):
        s = m.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(s.pop("$defs", {}))
        out[m.__name__] = s
    return out
