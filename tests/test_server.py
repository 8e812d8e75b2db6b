"""The OpenAI-compatible server end to end: a real `python -m ferry serve` process on a loopback port,
driven by the official `openai` client (max_retries=0) and by raw httpx where the framing matters.

The model is tiny and random (so texts are gibberish), with a tiny byte-level tokenizer and a
ChatML template; what is checked is the protocol, not the prose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
transformers = pytest.importorskip("transformers")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tiny_models import randomize_weights, tiny_hf_config  # noqa: E402
from tiny_tokenizers import save_tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-ferry-test"
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings
MAX_PENDING = 64
MAX_BODY_BYTES = 1 << 20
JSON = {"Content-Type": "application/json"}


# ---- the model and the servers ----


def make_tiny_served_model(path: Path) -> Path:
    """A tiny random Qwen2 whose vocabulary covers the tiny byte-level tokenizer (ChatML template)."""
    save_tiny_tokenizer(path, "bytelevel")
    from ferry.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(path)
    config = tiny_hf_config("qwen2")
    config.vocab_size = -(-tokenizer.vocab_size // 64) * 64  # >= every id the tokenizer makes
    config.bos_token_id, config.eos_token_id = None, tokenizer.eos_token_id
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_weights(model, seed=0)
    model.save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m ferry serve` on a free loopback port, its output in a log file."""

    def __init__(self, model: Path, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "ferry", "serve", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), "--no-access-log", "--engine-threads", "1", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not start in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        # The server's children are the engine and multiprocessing's resource tracker.
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, children
        return int(engines[0])

    def stop(self, clean: bool = True) -> None:
        """Stop the server; with `clean`, its log must show no internal error (a 500 of any kind:
        no test of the suite may meet one)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        log = self.log_path.read_text()
        assert not clean or ("internal error" not in log and "Traceback" not in log), log[-4000:]


@contextlib.contextmanager
def serving(model: Path, log_path: Path, *args: str):
    """A ready `ferry serve` of `model`, stopped (its log checked clean) on leaving."""
    proc = ServerProcess(model, log_path, *args)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_served_model(tmp_path_factory.mktemp("tiny-served-model"))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    # max-num-seqs 8: of the 20 requests of the disconnect test, some wait in the queue.
    with serving(
        tiny_model, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", API_KEY,
        "--served-model-name", "tiny", "--max-num-seqs", "8", "--max-pending-requests", str(MAX_PENDING),
        "--max-body-bytes", str(MAX_BODY_BYTES),
    ) as proc:
        yield proc


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def sse_events(response) -> list[str]:
    """The data lines of an event stream, checking the framing: every event is `data: ...\\n\\n`."""
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body
    return [e[len("data: "):] for e in events]


def metric_values(http) -> dict[str, float]:
    return metric_values_of(http.get("/metrics"))


def metric_values_of(response) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples}


# ---- bar 1: the API through the official client ----


def test_completion(client):
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny"
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_prompt_forms_and_n(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    out = client.completions.create(model="tiny", prompt=["Hello world", "Once upon"], n=2, max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    by_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    # Greedy: a prompt's text and its token ids give the same completion, and n copies agree.
    assert by_ids.choices[0].text == by_ids.choices[1].text == out.choices[0].text == out.choices[1].text
    single = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == out.choices[0].text


def test_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6, n=2,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in out.choices)
    assert out.choices[0].message.content == out.choices[1].message.content
    assert out.usage.completion_tokens == 12


def test_chat_stream_is_the_reply_in_pieces(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=20,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == "length" and not any(finishes[:-1])


def test_completion_stream_framing(http):
    body = {"model": "tiny", "prompt": ["Hello", "The quick"], "n": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": usage["usage"]["prompt_tokens"],
                                                         "completion_tokens": 20, "total_tokens": usage["usage"]["total_tokens"],
                                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in content)
    for index in range(4):
        mine = [c["choices"][0] for c in content if c["choices"][0]["index"] == index]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]
    # Without include_usage there is no usage key at all, and no usage chunk.
    del body["stream_options"]
    chunks = [json.loads(e) for e in sse_events(http.post("/v1/completions", json=body))[:-1]]
    assert all("usage" not in c and c["choices"] for c in chunks)


def test_completion_stream_equals_reply(http):
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [json.loads(e) for e in sse_events(http.post("/v1/completions", json={**body, "stream": True}))[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [t for c in chunks for t in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def test_stop_strings(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    clean = [i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[len(clean) // 2] : clean[len(clean) // 2] + 2]
    out = client.completions.create(**kwargs, stop=[stop, "never-appears"]).choices[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert out.model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          stop="never-appears", temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")


def greedy_continuation(client, http) -> tuple[list[int], list[int], float]:
    """A context, the id of the token greedy decoding adds to it, and that token's logprob. (The
    API returns tokens as text; a context whose next token reads back as one token is looked for.)"""
    for word in ("The capital of France is", "Hello, world", "def add(a, b):", "Once upon a", "for i in"):
        context = http.post("/tokenize", json={"prompt": word}).json()["tokens"]
        first = client.completions.create(model="tiny", prompt=context, max_tokens=1, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True}).choices[0]
        ids = http.post("/tokenize", json={"prompt": first.text, "add_special_tokens": False}).json()["tokens"]
        if len(ids) == 1 and "\ufffd" not in first.text:
            return context, ids, first.logprobs.token_logprobs[0]
    raise AssertionError("no context with a clean next token")


def test_echo_logprobs_as_lm_eval_sends_them(client, http):
    """lm-eval's local-completions loglikelihood: token-id prompts, echo, logprobs=1, max_tokens=1;
    it reads token_logprobs[ctxlen:-1] and compares each to max(top_logprobs)."""
    context, next_id, next_logprob = greedy_continuation(client, http)
    out = client.completions.create(model="tiny", prompt=[context + next_id], max_tokens=1, temperature=0,
                                    logprobs=1, echo=True, seed=1234).choices[0]
    lp = out.logprobs
    n = len(context) + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    # Scoring agrees with generation: the token greedy decoding chose scores the logprob it was
    # generated with, and it is the top-1 (what lm-eval's is_greedy checks).
    assert lp.token_logprobs[len(context)] == pytest.approx(next_logprob, abs=1e-4)
    assert lp.token_logprobs[len(context)] == pytest.approx(max(lp.top_logprobs[len(context)].values()), abs=1e-6)
    # max_tokens=0 with echo scores the prompt alone.
    scored = client.completions.create(model="tiny", prompt=context, max_tokens=0, echo=True, logprobs=0).choices[0]
    assert len(scored.logprobs.tokens) == len(context)
    assert scored.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(context)], abs=1e-4)
    assert scored.text == http.post("/detokenize", json={"tokens": context}).json()["prompt"]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top token


def test_seeds(client):
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs, seed=7, n=2)
    b = client.completions.create(**kwargs, seed=7, n=2)
    c = client.completions.create(**kwargs, seed=8, n=2)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert a.choices[0].text != a.choices[1].text  # the n completions sample on streams of their own
    assert [x.text for x in a.choices] != [x.text for x in c.choices]


def test_small_routes(client, http, server):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-served")
    assert httpx.get(server.url + "/ping").status_code == 200  # vLLM's /health, public like it
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokens["count"]
    values = metric_values(http)
    for name in ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc",
                 "ferry:prompt_tokens_total", "ferry:generation_tokens_total"):
        assert name in values
    assert values["ferry:generation_tokens_total"] > 0
    samples = [s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples]
    assert all(s.labels["model_name"] == "tiny" for s in samples if s.name.startswith("ferry:"))


def test_unknown_fields_are_ignored(http):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "some_future_field": {"x": 1}, "user": "u1",
            "cache_salt": "tenant-a"}
    assert http.post("/v1/completions", json=body).status_code == 200
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi", "extra": 1}], "max_tokens": 2,
            "response_format": {"type": "text"}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- bar 2: every bad input gets its 4xx, and the server keeps serving ----

LONG = "Once upon a time " * 12
CHAT = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    # (route, body, status, param)
    ("/v1/completions", {"prompt": LONG, "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[-1]]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": ["Hi"] * 200}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(20)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "Hi", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 600}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG * 6}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 500}, 400, "n"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [100000]}, 400, "tokens"),
]


def _check_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


def _still_serving(http) -> None:
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize("route,body,status,param", BAD_REQUESTS, ids=lambda x: None)
def test_bad_request_then_success(http, route, body, status, param):
    if route != "/tokenize" and route != "/detokenize":
        body = {"model": "tiny", **body} if "model" not in body else body
    _check_error(http.post(route, json=body), status, param)
    _still_serving(http)


def test_context_error_names_both_numbers(http):
    prompt_len = len(http.post("/tokenize", json={"prompt": LONG}).json()["tokens"])
    error = _check_error(http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 500}), 400, "max_tokens")
    assert str(MAX_MODEL_LEN) in error["message"] and str(prompt_len) in error["message"]
    assert str(prompt_len + 500) in error["message"] and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b'{"prompt": "Hi", ', b"[1, 2]", b'"Hi"', b"null", b"\xff\xfe", b""])
def test_malformed_or_non_object_json(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    _check_error(response, 400, None)
    _still_serving(http)


def test_oversized_body_gets_413(http):
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    _check_error(http.post("/v1/completions", content=body, headers=JSON), 413, None)

    def chunked():  # no Content-Length: counted while reading
        for _ in range(3):
            yield b" " * (MAX_BODY_BYTES // 2)
        yield b"{}"

    _check_error(http.post("/v1/completions", content=chunked(), headers=JSON), 413, None)
    _still_serving(http)


def test_client_errors_raise_typed_exceptions(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="Hi")


# ---- bar 3: the API key guards every route but /health, /version and the dashboard's static page ----


def registered_routes() -> list[tuple[str, str]]:
    from ferry.server.app import build_app
    from ferry.server.config import ServerConfig

    async def never():
        raise AssertionError("the sweep only reads the routes")

    app = build_app(ServerConfig(served_model_name="tiny", api_key="k"), never)
    assert all(hasattr(route, "path") and route.methods for route in app.routes), app.routes
    return sorted((route.path, method) for route in app.routes for method in route.methods)


def test_api_key_sweep(server):
    routes = registered_routes()
    assert ("/v1/completions", "POST") in routes and ("/metrics", "GET") in routes
    routes.append(("/no/such/route", "GET"))
    for path, method in routes:
        public = path in ("/health", "/ping", "/version", "/dashboard")  # (the dashboard's static page)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):
            response = httpx.request(method, server.url + path, headers=headers, json={}, timeout=30)
            if public:
                assert response.status_code == 200, (path, headers)
            else:
                assert response.status_code == 401, (path, method, headers, response.status_code)
                assert method == "HEAD" or response.json()["error"]["code"] == "invalid_api_key"
        # (Streamed: /dashboard/events never ends; only the status is wanted.)
        with httpx.stream(method, server.url + path, json={"prompt": "Hi", "max_tokens": 1, "tokens": [1],
                                                           "messages": CHAT},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as response:
            assert response.status_code != 401, path


# ---- bar 4: clients that go away take their requests with them ----


def test_disconnect_hygiene(server, http):
    """10 streaming and 10 plain requests, cancelled midway (some running, some still queued behind
    max-num-seqs 8): within 10 s nothing runs, nothing waits, and the KV cache is empty."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    streamed = []

    async def streaming():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        streamed.append(1)

    async def plain():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:
            await c.post("/v1/completions", json=body)
            raise AssertionError("finished before it was cancelled")

    async def gauges(c) -> dict[str, float]:
        text = (await c.get("/metrics")).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    async def run() -> dict[str, float]:
        # Interleaved, so that both kinds are among the 8 running and among the 12 waiting.
        tasks = [asyncio.create_task(f()) for _ in range(10) for f in (streaming, plain)]
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as c:
            while not (streamed and (busy := await gauges(c))["ferry:num_requests_waiting"] > 0):
                assert time.monotonic() < deadline, "the requests never got going"
                await asyncio.sleep(0.02)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), [repr(r) for r in results]
        return busy

    busy = asyncio.run(run())
    assert busy["ferry:num_requests_running"] == 8 and busy["ferry:kv_cache_usage_perc"] > 0
    deadline = time.monotonic() + 10
    while True:
        values = metric_values(http)
        idle = [values[f"ferry:{n}"] for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if idle == [0, 0, 0]:
            break
        assert time.monotonic() < deadline, f"still busy 10 s after the disconnects: {idle}"
        time.sleep(0.1)
    assert values["ferry:request_success_total"] >= 0  # exists
    _still_serving(http)


# ---- backpressure, draining, and a dead engine (servers of their own) ----


@pytest.fixture()
def spare_server(tiny_model, tmp_path):
    servers = []

    def start(*args: str) -> ServerProcess:
        servers.append(ServerProcess(tiny_model, tmp_path / f"server{len(servers)}.log", *args))
        return servers[-1].wait_ready()

    yield start
    for s in servers:
        s.stop()


def test_backpressure_and_sigterm_drain(spare_server):
    """Past --max-pending-requests: 429 with Retry-After. After SIGTERM: new requests get 503 with
    Retry-After and /health 503, while the requests in flight finish normally; then it exits 0."""
    srv = spare_server("--max-pending-requests", "2", "--drain-timeout", "60", "--max-num-seqs", "2")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            async def stream_all() -> list[dict]:
                async with c.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
                return [json.loads(line[6:]) for line in lines]

            inflight = [asyncio.create_task(stream_all()) for _ in range(2)]
            while metric_values_of(await c.get("/metrics"))["ferry:num_requests_running"] != 2:
                await asyncio.sleep(0.02)
            full = await c.post("/v1/completions", json={"prompt": "Hi"})
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            late = await c.post("/v1/completions", json={"prompt": "Hi"})
            assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
            assert (await c.get("/health")).status_code == 503
            return await asyncio.gather(*inflight)

    for chunks in asyncio.run(run()):
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    assert srv.proc.wait(30) == 0
    # The engine process stopped cleanly too (its C++ teardown once aborted it: exit code -6).
    assert "the engine process exited with code" not in srv.log() and "terminate called" not in srv.log()


def test_kill_9_fails_the_requests_in_flight_at_once_and_a_new_engine_serves(spare_server):
    """kill -9 of the engine with 20 requests in flight (10 streamed, 10 not): each ends with an
    error within 1 s, /health is 503 until a new engine is up, and a new request succeeds within
    30 s, from the same server; ferry:engine_restarts_total counts it."""
    srv = spare_server("--max-num-seqs", "8")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    ended: list[tuple[float, str]] = []

    async def streaming(c):
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        ended.append((time.monotonic(), json.loads(events[-2][6:])["error"]["code"]))
        assert events[-1] == "data: [DONE]"

    async def plain(c):
        response = await c.post("/v1/completions", json=body)
        ended.append((time.monotonic(), response.json()["error"]["code"]))
        assert response.status_code == 503

    async def run() -> float:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            tasks = [asyncio.create_task(f(c)) for _ in range(10) for f in (streaming, plain)]
            deadline = time.monotonic() + 20
            while metric_values_of(await c.get("/metrics"))["ferry:num_requests_waiting"] < 12:
                assert time.monotonic() < deadline, "the requests never got going"
                await asyncio.sleep(0.02)
            killed = time.monotonic()
            os.kill(srv.engine_pid(), signal.SIGKILL)
            await asyncio.gather(*tasks)
            return killed

    killed = asyncio.run(run())
    assert len(ended) == 20 and {code for _, code in ended} == {"engine_dead"}
    assert max(t for t, _ in ended) - killed < 1.0
    assert httpx.get(srv.url + "/health").status_code == 503
    while (response := httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})).status_code != 200:
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_restarting"
        assert time.monotonic() - killed < 30, "no new engine within 30 s"
        time.sleep(0.1)
    assert response.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(srv.url + "/health").status_code == 200
    assert metric_values_of(httpx.get(srv.url + "/metrics"))["ferry:engine_restarts_total"] == 1
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0


def test_without_restarts_a_dead_engine_stays_dead(spare_server):
    srv = spare_server("--engine-restarts", "0")
    os.kill(srv.engine_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    response = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0


def test_a_server_whose_engine_will_not_start_again_exits_non_zero(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    srv = ServerProcess(model, tmp_path / "server.log", "--engine-restarts", "2").wait_ready()
    try:
        (model / "config.json").unlink()  # every new engine process now fails to load the model
        os.kill(srv.engine_pid(), signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert "no engine process would start after 2 attempts" in srv.log()
    finally:
        srv.stop(clean=False)  # the failed starts print their tracebacks


def test_a_busy_port_fails_before_the_model_loads(server, tiny_model, tmp_path):
    command = [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_model), "--port", str(server.port)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "address already in use" in result.stderr.lower()
    assert "engine" not in result.stderr.lower() and time.monotonic() - started < 20


def test_drain_timeout_aborts_what_is_left(spare_server):
    """Requests still running when --drain-timeout runs out end with an error event (streaming) or a
    503 (plain), and the server exits anyway."""
    srv = spare_server("--drain-timeout", "0.5", "--max-num-seqs", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            async def streamed() -> list[str]:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    return [line async for line in response.aiter_lines() if line.startswith("data: ")]

            tasks = [asyncio.create_task(streamed()) for _ in range(3)]
            tasks.append(asyncio.create_task(c.post("/v1/completions", json=body)))
            await asyncio.sleep(0.3)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    started = time.monotonic()
    *streams, plain = asyncio.run(run())
    # One at a time (max-num-seqs 1): the first may finish in time, the ones behind it cannot.
    outcomes = []
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        outcomes.append(last["error"]["code"] if "error" in last else last["choices"][0]["finish_reason"])
    assert plain.status_code in (200, 503)
    outcomes.append(plain.json()["error"]["code"] if plain.status_code == 503 else "length")
    assert set(outcomes) <= {"aborted", "length"} and outcomes.count("aborted") >= 2, outcomes
    assert srv.proc.wait(30) == 0 and time.monotonic() - started < 15


def test_prefix_cache_hits_are_reported(client, http):
    prompt = "def cached_prefix_check(a, b):\n    return a + b\n" * 4  # several full blocks
    before = metric_values(http)
    first = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    after = metric_values(http)
    assert after["ferry:prefix_cache_queries_total"] - before["ferry:prefix_cache_queries_total"] >= 2 * first.usage.prompt_tokens
    assert after["ferry:prefix_cache_hits_total"] - before["ferry:prefix_cache_hits_total"] == cached


# ---- HTTP hygiene: what a browser, a slow client or a careless proxy can send ----


def test_bodies_must_be_declared_json(http):
    """A page can POST text/plain (or a form) cross-site without a preflight; the server takes none."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = http.post("/v1/completions", content=body, headers=headers)
        assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    assert http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"}) \
        .status_code == 200


def test_foreign_web_origins_are_refused(http, server):
    evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    response = http.post("/v1/completions", content=json.dumps({"prompt": "Hi"}), headers=evil)
    assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
    assert http.get("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 403
    assert "access-control-allow-origin" not in response.headers
    own = {"Origin": f"http://127.0.0.1:{server.port}"}
    assert http.get("/v1/models", headers=own).status_code == 200


def test_allowed_origins_get_cors(spare_server):
    srv = spare_server("--allowed-origins", "https://app.example")
    preflight = httpx.options(srv.url + "/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    response = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                          headers={"Origin": "https://app.example"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "https://app.example"
    assert httpx.get(srv.url + "/health", headers={"Origin": "https://other.example"}).status_code == 403


def test_a_body_that_never_arrives_gets_408(spare_server):
    srv = spare_server("--body-timeout", "1")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        started = time.monotonic()
        reply = b""
        while b"request_timeout" not in reply and (chunk := sock.recv(4096)):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
        assert time.monotonic() - started < 5


def test_no_redirects_head_and_protocol_errors(http, server):
    response = http.get("/v1/models/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers
    assert response.json()["error"]["message"]
    assert httpx.head(server.url + "/health").status_code == 200
    assert http.head("/v1/models").status_code == 200
    response = http.delete("/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"


def test_openapi_has_the_real_schemas_behind_the_key(http, server):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    document = http.get("/openapi.json").json()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens", "temperature", "top_p", "n", "seed"} <= set(schema["properties"])
    assert schema["required"] == ["prompt"]
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "413", "415", "429", "503"} <= set(responses)


def test_retry_after_follows_the_queue(spare_server):
    """With a tight queue bound, requests past it get 429 and a Retry-After from the measured drain
    rate: an integer number of seconds, at least 1."""
    srv = spare_server("--max-queue-wait", "1", "--max-num-seqs", "2")
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            for _ in range(3):  # enough finished requests for the server to know its rate
                await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(40)))

    responses = asyncio.run(run())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in responses)
    assert all(r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1 for r in refused)


def test_malformed_http_gets_a_json_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "malformed_http"


def test_a_hostile_chat_template_fails_its_request_and_nothing_else(tiny_model, tmp_path):
    """A template that would loop for hours is cut at the render's deadline: its request gets a 400,
    and /health and plain completions are served meanwhile."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    srv = ServerProcess(model, tmp_path / "server.log").wait_ready()
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                chat = asyncio.create_task(c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}))
                health = []
                while not chat.done():
                    start = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    health.append(time.monotonic() - start)
                    await asyncio.sleep(0.01)
                completion = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                return chat.result(), health, completion

        started = time.monotonic()
        chat, health, completion = asyncio.run(run())
        assert chat.status_code == 400 and "took longer than" in chat.json()["error"]["message"]
        assert time.monotonic() - started < 10 and completion.status_code == 200
        assert health and max(health) < 1.0
    finally:
        srv.stop()
