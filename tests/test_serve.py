"""pi-serve: the real server on a loopback port, a tiny random model, the official `openai` client and raw HTTP.

The endpoints' answers (equal to the runtime's own generate) and refusals (4xx in OpenAI's error shape), and the
helpers that test_serve_streaming.py and test_serve_queue.py import (a server, raw requests, the error shape).
"""

from __future__ import annotations

import http.client
import json
from contextlib import contextmanager

import pytest
from click.testing import CliRunner
from hotneurons.runtime.generate import RuntimeConfig, Sampling, generate, prompt_ids
from hotneurons.runtime.load import load_runtime

pytest.importorskip("fastapi")  # a GPU image may lack the server's packages: its GPU tests still collect
pytest.importorskip("uvicorn")
from hotneurons.server.serve import ServeConfig, Server

openai = pytest.importorskip("openai")

FAMILY = "llama-reglu"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
SAMPLED = dict(temperature=0.9, top_p=0.9, seed=7)  # + the extensions top_k and repetition_penalty
EXTRA = dict(top_k=20, repetition_penalty=1.3)


def load(folder):
    return load_runtime(None, RuntimeConfig(mode="dense", device="cpu"), model=str(folder))


@contextmanager
def running(folder, generate_fn=generate, **cfg):
    with Server(load(folder), ServeConfig(port=0, **cfg), generate_fn) as s:
        yield s


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """What the runtime itself generates, computed before any server owns a runtime."""
    rt = load(tiny_model_dir(FAMILY))
    ids, chat_ids = prompt_ids(rt, PROMPT), prompt_ids(rt, MESSAGES, chat=True)
    return {"ids": ids, "chat_ids": chat_ids, "greedy": generate(rt, ids, 8).text, "long": generate(rt, ids, 24).text,
            "chat": generate(rt, chat_ids, 8).text,
            "sampled": generate(rt, ids, 8, Sampling(**SAMPLED, **EXTRA)).text}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running(tiny_model_dir(FAMILY), max_queue=4) as s:
        yield s


def client(s: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=20)


def request(s: Server, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def health(s: Server) -> dict:
    return request(s, "GET", "/health")[1]


def assert_error(status_body, status: int, param: str | None = None, code: str | None = None) -> str:
    got, body = status_body
    assert got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param and param.split("[")[0] in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


# ---------------------------------------------------------------------------------------------------------------
# The API through the official client


def test_models_and_health(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [server.model_id] == [FAMILY]
    assert c.models.retrieve(server.model_id).id == server.model_id
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    h = health(server)
    assert h["status"] == "ok" and h["running"] == 0 and h["queued"] == 0 and h["max_queue"] == 4


def test_completion_equals_the_runtime(server, ref):
    c = client(server)
    r = c.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == ref["greedy"] and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref["ids"]) and r.usage.completion_tokens == 8 and r.usage.total_tokens == \
        len(ref["ids"]) + 8
    chunks = list(c.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    # a prompt as token ids, alone or in OpenAI's one-element list
    for prompt in (ref["ids"], [ref["ids"]]):
        assert c.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0).choices[0].text == \
            r.choices[0].text


def test_chat_equals_the_runtime(server, ref):
    c = client(server)
    r = c.chat.completions.create(model="any", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref["chat"]
    assert r.usage.prompt_tokens == len(ref["chat_ids"]) and r.id.startswith("chatcmpl-")
    chunks = list(c.chat.completions.create(model="any", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref["chat"]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             MESSAGES[1]]  # content as a list of text parts
    assert c.chat.completions.create(model="any", messages=parts, max_tokens=8, temperature=0).choices[0] \
        .message.content == ref["chat"]


def test_sampling_parameters_reach_the_sampler(server, ref):
    c = client(server)
    texts = [c.completions.create(model="any", prompt=PROMPT, max_tokens=8, **SAMPLED, extra_body=EXTRA)
             .choices[0].text for _ in range(2)]
    assert texts == [ref["sampled"]] * 2
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        c.completions.create(model="any", prompt=PROMPT, max_tokens=4, frequency_penalty=0.5)


def test_stop_strings(server, ref):
    text = ref["long"]
    i = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop, want = text[i:i + 2], text[:text.find(text[i:i + 2])]
    c = client(server)
    r = c.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never seen"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(c.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_openapi_document_no_cdn_pages(server):
    """/openapi.json is served; /docs and /redoc (Swagger UI and ReDoc from a CDN: blank offline) are not, and
    the 404 names the document."""
    for page in ("/docs", "/redoc"):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request("GET", page)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 404 and b"/openapi.json" in body and b"cdn" not in body.lower(), body
        conn.close()
    status, spec = request(server, "GET", "/openapi.json")
    assert status == 200 and spec["info"]["title"] == "pi-serve"
    assert set(spec["paths"]) == {"/health", "/v1/models", "/v1/models/{model_id}", "/v1/completions",
                                  "/v1/chat/completions"}
    schemas = spec["components"]["schemas"]
    common = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "stream",
              "stream_options", "user"}  # the fields server/api.py reads (user: ignored), as docs/serve.md lists
    for path, name, own in (("/v1/completions", "CompletionRequest", ["prompt"]),
                            ("/v1/chat/completions", "ChatRequest", ["messages", "max_completion_tokens"])):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + name)
        assert set(schemas[name]["properties"]) == common | set(own) and schemas[name]["required"] == own[:1]
        assert {"200", "400", "401", "503"} <= set(post["responses"]) and "422" not in post["responses"]
        assert post["security"] == [{"HTTPBearer": []}]


# ---------------------------------------------------------------------------------------------------------------
# Bad requests: 4xx in OpenAI's error shape, the server unharmed


CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
OK = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}  # greedy: no chance of an early EOS


@pytest.mark.parametrize("path,body,param,code", [
    (DONE, {"max_tokens": 2}, "prompt", "missing_required_parameter"),
    (CHAT, {"max_tokens": 2}, "messages", "missing_required_parameter"),
    (CHAT, {"messages": []}, "messages", "invalid_type"),
    (CHAT, {"messages": "hi"}, "messages", "invalid_type"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", "invalid_type"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0]", "invalid_type"),
    (DONE, {**OK, "prompt": 5}, "prompt", "invalid_type"),
    (DONE, {**OK, "prompt": ["a", "b"]}, "prompt", "invalid_value"),
    (DONE, {**OK, "prompt": [1, 100000]}, "prompt", "invalid_value"),
    (DONE, {**OK, "prompt": ""}, "prompt", "invalid_value"),
    (DONE, {**OK, "prompt": "x" * 300}, "prompt", "context_length_exceeded"),
    (DONE, {**OK, "max_tokens": 0}, "max_tokens", "invalid_value"),
    (DONE, {**OK, "max_tokens": -3}, "max_tokens", "invalid_value"),
    (DONE, {**OK, "max_tokens": "ten"}, "max_tokens", "invalid_type"),
    (DONE, {**OK, "max_tokens": True}, "max_tokens", "invalid_type"),
    (DONE, {**OK, "max_tokens": 10 ** 6}, "max_tokens", "context_length_exceeded"),
    (DONE, {**OK, "max_tokens": 250}, "max_tokens", "context_length_exceeded"),  # 19 prompt tokens + 250 > 256
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    (DONE, {**OK, "temperature": "hot"}, "temperature", "invalid_type"),
    (DONE, {**OK, "temperature": -1}, "temperature", "invalid_value"),
    (DONE, {**OK, "top_p": 1.5}, "top_p", "invalid_value"),
    (DONE, {**OK, "top_k": 2.5}, "top_k", "invalid_type"),
    (DONE, {**OK, "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    (DONE, {**OK, "seed": "x"}, "seed", "invalid_type"),
    (DONE, {**OK, "stream": "yes"}, "stream", "invalid_type"),
    (DONE, {**OK, "stream": True, "stream_options": 3}, "stream_options", "invalid_type"),
    (DONE, {**OK, "stop": 7}, "stop", "invalid_type"),
    (DONE, {**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    (DONE, {**OK, "stop": [""]}, "stop", "invalid_value"),
    (DONE, {**OK, "model": 3}, "model", "invalid_type"),
    (DONE, {**OK, "n": 2}, "n", "unsupported_parameter"),
    (DONE, {**OK, "logprobs": 3}, "logprobs", "unsupported_parameter"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": 1.0}, "presence_penalty", "unsupported_parameter"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
])
def test_bad_request_is_a_400_that_names_the_parameter(server, path, body, param, code):
    assert_error(request(server, "POST", path, body), 400, param, code)


def test_malformed_and_misrouted_requests(server):
    assert "not valid JSON" in assert_error(request(server, "POST", DONE, b"{not json"), 400, code="invalid_json")
    assert_error(request(server, "POST", DONE, b"\xff\xfe"), 400, code="invalid_json")
    assert "JSON object" in assert_error(request(server, "POST", DONE, [1, 2]), 400, code="invalid_json")
    assert_error(request(server, "POST", DONE, b""), 400, code="invalid_json")
    assert_error(request(server, "GET", "/v1/nothing"), 404, code="not_found")
    assert_error(request(server, "POST", "/elsewhere", OK), 404, code="not_found")
    assert_error(request(server, "GET", DONE), 405, code="method_not_allowed")
    assert_error(request(server, "POST", "/v1/models", OK), 405, code="method_not_allowed")
    assert_error(request(server, "DELETE", CHAT), 405, code="method_not_allowed")
    assert "use POST" in assert_error(request(server, "GET", CHAT), 405)
    assert request(server, "GET", "/v1/models/")[0] == 200  # a trailing slash is the same path
    assert_error(request(server, "POST", DONE, b"[" * 100_000), 400, code="invalid_json")
    assert_error(request(server, "POST", DONE, OK, {"Content-Length": str(10 ** 9)}), 413)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    for body, status in (([b'{"prompt": "The quick', b' brown fox", "max_tokens": 2}'], 200), ([b"x" * 100], 400)):
        conn.request("POST", DONE, iter(body), {"Transfer-Encoding": "chunked"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == status and ("usage" in json.loads(r.read())) == (status == 200)
    conn.close()
    # a keep-alive connection survives a refused request
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    for body, status in ((b"{", 400), (json.dumps(OK).encode(), 200)):
        conn.request("POST", DONE, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == status and ("error" in json.loads(r.read())) == (status == 400)
    conn.close()
    assert health(server)["status"] == "ok"


def test_chat_without_a_template_is_refused(tiny_model_dir):
    rt = load(tiny_model_dir(FAMILY))
    rt.lm.tokenizer.chat_template = None
    with Server(rt, ServeConfig(port=0)) as s:
        assert "/v1/completions" in assert_error(request(s, "POST", CHAT, {"messages": MESSAGES}), 400, "messages",
                                                 "no_chat_template")


def test_api_key(tiny_model_dir):
    with running(tiny_model_dir(FAMILY), api_key="s3cret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cretx"}):
            assert "--api-key" in assert_error(request(s, "POST", DONE, OK, headers), 401, code="invalid_api_key")
        assert_error(request(s, "GET", "/v1/models"), 401)
        assert_error(request(s, "GET", "/v1/nothing"), 401)  # the key is checked before the route
        assert_error(request(s, "GET", DONE), 401)
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").completions.create(model="any", prompt=PROMPT, max_tokens=2)
        assert client(s, "s3cret").completions.create(model="any", prompt=PROMPT, max_tokens=2).usage
        assert request(s, "GET", "/health")[0] == 200  # health checks need no key, nor the OpenAPI page
        assert request(s, "GET", "/openapi.json")[0] == 200


def test_cli_refuses_bad_settings():
    from hotneurons.server.cli import main

    r = CliRunner().invoke(main, ["--model", "x", "--port", "70000"])
    assert r.exit_code != 0 and "--port 70000" in r.output
    r = CliRunner().invoke(main, ["--port", "0"])
    assert r.exit_code != 0 and "--run" in r.output
