"""No request body takes the server down: bodies drawn over the whole domain of every field of both
generation endpoints (subnormals, zeros, huge integers, wrong types, extreme combinations, n > 1)
get a 2xx or a 4xx with an OpenAI-style error, never a 5xx or an error inside a stream, and after
each one the engine is up and a normal request succeeds.

Hypothesis runs derandomized, so CI sees the same bodies every time; FERRY_FUZZ_EXAMPLES=N draws N
bodies per endpoint (more, and different ones with FERRY_FUZZ_RANDOM=1) for a longer hunt.
"""

from __future__ import annotations

import json
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_server import ServerProcess, make_tiny_served_model  # noqa: E402

EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "120"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("FERRY_FUZZ_RANDOM"),
                    suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module", params=["plain", "speculative"])
def url(request, tmp_path_factory):
    """The tiny model served plainly, and with itself as its draft (every field through the
    speculative path too: sampled guesses, rejection, proposals cut by max_tokens and stops)."""
    model = make_tiny_served_model(tmp_path_factory.mktemp("fuzz-model"))
    spec = [] if request.param == "plain" else [
        "--speculative-config", json.dumps({"model": str(model), "num_speculative_tokens": 3})]
    server = ServerProcess(model, tmp_path_factory.mktemp("fuzz-logs") / "server.log", "--max-num-seqs", "16", *spec)
    try:
        yield server.wait_ready().url
    finally:
        server.stop()  # and its log shows no internal error


# ---- the domain of each kind of field ----

EDGE_INTS = [0, -1, 1, 2, 3, 20, 21, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1,
             10**30, -(10**30)]
TINY = [5e-324, 1e-320, 1e-300, 1e-45, 1e-38, 1e-9, 1e-5, 2e-5]
HUGE = [1e10, 3.4e38, 3.5e38, 1e300, 1.7976931348623157e308]
WRONG = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.lists(st.integers(), max_size=2),
                  st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
any_number = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_INTS),
                       st.sampled_from([-x for x in TINY + HUGE] + TINY + HUGE), st.integers())


def in_range(low: float, high: float, *, open_low: bool = False) -> st.SearchStrategy[float]:
    """Floats of [low, high] (or (low, high]), weighted to its edges and to the tiny and huge values
    inside it: where rounding, overflow and empty distributions live."""
    edges = [x for x in [low, high, *TINY, *[low + t for t in TINY], *[high - t for t in TINY], *HUGE]
             if low <= x <= high and not (open_low and x == low)]
    return st.one_of(st.sampled_from(edges), st.floats(low, high, exclude_min=open_low))


def ints_in(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([x for x in EDGE_INTS + [low, high] if low <= x <= high]), st.integers(low, high))


text = st.text(max_size=40)
token_id = st.integers(min_value=0, max_value=500)  # the tiny model's vocabulary is 512
flag = st.booleans()

# JSON schemas, small and odd: any type, bounds at the extremes, and schemas that are not schemas.
SCHEMA = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "array", "boolean", "null"])}),
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": ints_in(0, 2**63)}),
    st.fixed_dictionaries({"type": st.just("array"), "minItems": ints_in(0, 10**6)}),
    st.fixed_dictionaries({"enum": st.lists(text, max_size=3)}),
    st.dictionaries(text, text, max_size=2),
)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]) | text}, optional={"parameters": SCHEMA, "description": text})})

# Each field over its valid domain (what a request may legally say, extremes included) ...
VALID_SAMPLING = {
    "model": st.just("tiny"),
    "n": ints_in(1, 4),
    "temperature": in_range(0, 2),
    "top_p": in_range(0, 1, open_low=True),
    "top_k": st.one_of(ints_in(-1, 2**63), st.sampled_from([-1, 0, 1, 2, 50])),
    "min_p": in_range(0, 1),
    "seed": ints_in(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=16)),
    "stream": flag,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": flag, "continuous_usage_stats": flag}),
    "presence_penalty": in_range(-2, 2),
    "frequency_penalty": in_range(-2, 2),
    "repetition_penalty": in_range(0, 1.7976931348623157e308, open_low=True),
    "ignore_eos": flag,
    "min_tokens": st.one_of(ints_in(0, 8), st.just(10**9)),
    "stop_token_ids": st.lists(token_id, max_size=5),
    "include_stop_str_in_output": flag,
    "skip_special_tokens": flag,
    "cache_salt": st.text(min_size=1, max_size=8),
    "logit_bias": st.dictionaries(token_id.map(str), in_range(-100, 100), max_size=4),
    "allowed_token_ids": st.lists(token_id, min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=3),
    "prompt_logprobs": st.one_of(st.none(), ints_in(0, 20)),
    "return_tokens_as_token_ids": flag,
    # Structured output: valid forms, and regexes / grammars / choices of any text (most do not
    # compile: a 400), alone or several at once (also a 400).
    "response_format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}),
        st.fixed_dictionaries({"type": st.just("json_schema"),
                               "json_schema": st.fixed_dictionaries({"name": text, "schema": SCHEMA})})),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": st.sampled_from(["[0-9]{1,3}", "(yes|no)", "", "a*"]) | text}),
        st.fixed_dictionaries({"choice": st.lists(text, max_size=4)}),
        st.fixed_dictionaries({"json": SCHEMA}), st.fixed_dictionaries({"grammar": text}),
        st.fixed_dictionaries({"json_object": flag})),
    "guided_choice": st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4),
    "guided_regex": text,
}
VALID_COMPLETION = {
    **VALID_SAMPLING,
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),
                        st.lists(token_id, min_size=1, max_size=12),
                        st.lists(st.lists(token_id, min_size=1, max_size=6), min_size=1, max_size=3)),
    "max_tokens": st.one_of(ints_in(0, 8), st.sampled_from([None, 10**9])),
    "echo": flag,
    "logprobs": st.one_of(st.none(), ints_in(0, 20)),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": st.one_of(text, st.none(),
                                   st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                   "text": st.one_of(text, st.none())}), max_size=2)),
              "name": text, "tool_call_id": text},
)
VALID_CHAT = {
    **VALID_SAMPLING,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.one_of(ints_in(1, 8), st.just(10**9)),
    "max_completion_tokens": st.one_of(ints_in(1, 8), st.none()),
    "logprobs": flag,
    "top_logprobs": st.one_of(st.none(), ints_in(0, 20)),
    "tools": st.one_of(st.none(), st.lists(TOOL, max_size=3), st.lists(st.dictionaries(text, text, max_size=2), max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | text})})),
    "parallel_tool_calls": flag,
    "add_generation_prompt": flag,
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(text, st.one_of(text, st.booleans()), max_size=2)),
}


# ... and over the whole domain of its JSON type, and beyond: out of range, wrong types, null.
def anything(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, any_number, WRONG, st.text(max_size=8), st.lists(st.one_of(token_id, text), max_size=4))


def bodies(valid: dict, required: str) -> st.SearchStrategy[dict]:
    """Bodies whose every field is legal (most draws: they reach the engine), or whose fields come
    from anywhere; each field present or not, the required one mostly present."""
    wild = {name: anything(strategy) for name, strategy in valid.items()}
    return st.one_of(*(_dicts(fields, required) for fields in (valid, valid, valid, wild)))


def _dicts(fields: dict, required: str) -> st.SearchStrategy[dict]:
    optional = {name: strategy for name, strategy in fields.items() if name != required}
    return st.fixed_dictionaries({required: fields[required]}, optional=optional) | \
        st.fixed_dictionaries({}, optional=fields)


# ---- the checks ----


def check(url: str, path: str, body: dict) -> None:
    payload = json.dumps(body).encode()  # huge ints stay exact; floats are all finite here
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", path, content=payload, headers={"Content-Type": "application/json"}) as response:
            raw = response.read()
        assert response.status_code < 500, (response.status_code, raw[:500], body)
        if response.status_code >= 400:
            error = json.loads(raw)["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (error, body)
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]  # (SSE lines end at \n)
            assert events[-1] == "[DONE]", (events[-3:], body)
            for event in events[:-1]:
                assert "error" not in json.loads(event), (event, body)
        else:
            reply = json.loads(raw)
            finish_reasons = ("stop", "length", "tool_calls")
            assert reply["choices"] and all(c["finish_reason"] in finish_reasons for c in reply["choices"]), reply
        # The engine is up, and a plain request still gets its tokens.
        assert client.get("/health").status_code == 200
        normal = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
        assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 2, normal.text


# Bodies that once took the engine down (each one alone did), always tried before the random ones.
KNOWN_KILLERS = [
    {"top_p": 5e-324}, {"top_p": 1e-300, "temperature": 2}, {"repetition_penalty": 5e-324},
    {"repetition_penalty": 1e-300, "temperature": 0}, {"repetition_penalty": 1.7976931348623157e308},
    {"seed": 2**64 - 1, "n": 2}, {"seed": 2**64 - 1, "n": 4, "temperature": 0.5},
    {"min_tokens": 8, "stop_token_ids": list(range(500)), "max_tokens": 8},
    {"temperature": 2e-5, "top_p": 1e-45, "top_k": 1, "min_p": 1, "repetition_penalty": 3.5e38, "seed": 2**64 - 1, "n": 3},
    {"logprobs": 20, "echo": True, "max_tokens": 0, "n": 4},
]


def with_examples(prompt_field: str, prompt):
    def decorate(test):
        for extra in KNOWN_KILLERS:
            for stream in (False, True):
                test = hypothesis.example(body={prompt_field: prompt, "max_tokens": 3, **extra, "stream": stream})(test)
        return test
    return decorate


@SETTINGS
@given(body=bodies(VALID_COMPLETION, "prompt"))
@with_examples("prompt", "def f(x):")
def test_any_completion_body(url, body):
    check(url, "/v1/completions", body)


@SETTINGS
@given(body=bodies(VALID_CHAT, "messages"))
@with_examples("messages", [{"role": "user", "content": "Hi"}])
def test_any_chat_body(url, body):
    check(url, "/v1/chat/completions", body)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "Hi", "temperature": NaN}', b'{"prompt": "Hi", "top_p": Infinity}',
    b'{"prompt": "Hi", "presence_penalty": -Infinity}', b'{"prompt": "\\ud800"}', b'{"prompt": "a\\udfffb"}',
    b'{"prompt": "Hi", "stop": ["\\ud83d"]}', b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "Hi", "x": ' + b"[" * 65 + b"]" * 65 + b"}", b'{"prompt": "Hi", "x": ' + b'{"a":' * 70 + b"1" + b"}" * 70 + b"}",
])
def test_json_that_is_not_quite_json(url, raw):
    response = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text


def test_a_valid_surrogate_pair_is_text(url):
    raw = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    response = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("condition", [
    lambda b: b.get("top_p") == 5e-324 and b.get("temperature", 1) > 1e-5,
    lambda b: b.get("seed") == 2**64 - 1 and b.get("n", 1) > 1,
    lambda b: b.get("repetition_penalty", 1) > 3.4e38 and b.get("temperature", 1) > 1e-5,
])
def test_the_fuzzer_reaches_the_extremes(condition):
    """The valid bodies do draw the values the engine once died on (a guard on the test itself)."""
    hypothesis.find(bodies(VALID_COMPLETION, "prompt"), condition,
                    settings=settings(max_examples=5000, database=None, derandomize=True))
