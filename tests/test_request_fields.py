"""No request field is silently ignored: each one ferry accepts does what OpenAI's or vLLM's
documentation says, a known one it does not implement is a 400 naming it, and no field is coerced
from another type.

Most tests run the real app in-process (starlette's TestClient) on a scripted engine: the tiny
Llama-3-like tokenizer (it adds a BOS) and a fixed reply per completion, so that what the server
sends the engine and how it writes what comes back are checked exactly. The sampler's side is
checked on the bundled model, offline (`LLM`) and through `ferry serve`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry import LLM, SamplingParams
from ferry.engine.messages import EngineInfo, EngineStats
from ferry.outputs import CompletionOutput, Logprob, RequestOutput
from tiny_tokenizers import save_tiny_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

VOCAB = 512
REPLY = " ok!"  # what every scripted completion says


class ScriptedEngine:
    """An AsyncEngine stand-in: every completion answers REPLY one token per output, with the
    logprobs and prompt logprobs asked for. It keeps the params each request brought."""

    is_alive, is_restarting, num_restarts, trace_sink = True, False, 0, None

    def __init__(self, tokenizer, reply: str = REPLY, tokens_per_output: int = 1) -> None:
        self.tokenizer = tokenizer
        self.info = EngineInfo(max_model_len=256, vocab_size=VOCAB, kv_cache_tokens=4096)
        self.stats = EngineStats()
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.tokens_per_output = tokens_per_output  # more: as the server merges deltas that waited

    async def generate(self, request_id, token_ids, params, prompt=None, cache_salt=None):
        self.params.append(params)
        self.prompts.append(list(token_ids))
        step, sent = self.tokens_per_output, ""
        for start in range(0, len(self.reply_ids), step):
            ids = self.reply_ids[start:start + step]
            last = start + step >= len(self.reply_ids)
            # As the detokenizer does: text that ends in part of a character waits for the rest.
            text = self.tokenizer.decode(self.reply_ids[:start + step])
            delta = "" if text.endswith("\ufffd") and not last else text[len(sent):]
            sent += delta
            positions = [{t: Logprob(-0.5, 1, None), 3: Logprob(-2.0, 2, None)} for t in ids]
            completions = [
                CompletionOutput(j, delta, ids, logprobs=positions if params.logprobs is not None else None,
                                 finish_reason="length" if last else None)
                for j in range(params.n)
            ]
            prompt_logprobs = None
            if start == 0 and params.prompt_logprobs is not None:
                prompt_logprobs = [None] + [{t: Logprob(-1.0, 1, None)} for t in token_ids[1:]]
            yield RequestOutput(request_id, prompt, list(token_ids), completions, last, prompt_logprobs)

    def abort_all(self, reason: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from ferry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "bytelevel_bos"))


def make_app(engine, served_model_name="tiny"):
    from ferry.server.app import build_app
    from ferry.server.config import ServerConfig

    async def never():
        raise AssertionError("the engine is attached by hand")

    app = build_app(ServerConfig(served_model_name=served_model_name), never)
    if engine is not None:
        app.state.ferry.attach(engine)
    return app


@pytest.fixture()
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture()
def http(engine):
    return TestClient(make_app(engine))


COMPLETION = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ENDPOINTS = {"completions": ("/v1/completions", COMPLETION), "chat": ("/v1/chat/completions", CHAT)}


def post(http, endpoint: str, **fields):
    path, body = ENDPOINTS[endpoint]
    return http.post(path, json={**body, **fields})


def assert_refused(response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


def sse(response) -> list[dict]:
    events = [e[len("data: "):] for e in response.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- strict types: nothing is coerced ----


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("stream", 1), ("temperature", "0.5"), ("top_p", True), ("n", "2"), ("seed", 1.0),
    ("ignore_eos", "true"), ("skip_special_tokens", 0), ("presence_penalty", "1"), ("logit_bias", {"5": "1"}),
    ("stream_options", {"include_usage": "yes"}), ("return_tokens_as_token_ids", "false"),
])
def test_strings_and_numbers_are_not_coerced(http, endpoint, field, value):
    response = post(http, endpoint, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_integers_are_still_floats(http):
    assert post(http, "completions", temperature=1, top_p=1, presence_penalty=0).status_code == 200


# ---- logit_bias, allowed_token_ids, bad_words reach the sampler, checked against the vocabulary ----


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_token_fields_reach_the_engine(http, engine, tokenizer, endpoint):
    response = post(http, endpoint, logit_bias={"17": 100, "3": -100.0}, allowed_token_ids=[3, 17, 17, 40],
                    bad_words=["world"])
    assert response.status_code == 200, response.text
    params = engine.params[-1]
    assert params.logit_bias == {17: 100, 3: -100.0} and params.allowed_token_ids == [3, 17, 40]
    spellings = [tokenizer.encode(w, add_special_tokens=False) for w in ("world", " world")]
    assert params.bad_words == ["world"] and params.bad_words_token_ids == spellings


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("param, value, words", [
    ("logit_bias", {str(VOCAB): 1}, (f"token id {VOCAB}", "out of vocabulary")),
    ("logit_bias", {"x": 1}, ("keys must be token ids", "'x'")),
    ("logit_bias.5", {"5": 100.5}, ("less than or equal to 100",)),
    ("logit_bias.5", {"5": -101}, ("greater than or equal to -100",)),
    ("allowed_token_ids", [1, VOCAB + 3], (f"token id {VOCAB + 3}", "out of vocabulary")),
    ("allowed_token_ids", [], ("non-empty",)),
    ("allowed_token_ids.0", [-1], ("greater than or equal to 0",)),
    ("bad_words", [""], ("non-empty strings",)),
    ("bad_words", ["w"] * 129, ("at most 128",)),
])
def test_bad_token_fields_are_400s_naming_them(http, endpoint, param, value, words):
    assert_refused(post(http, endpoint, **{param.split(".")[0]: value}), param, *words)


# ---- known fields ferry does not implement: 400 naming them; their defaults pass ----


_REFUSED_CASES = [
    ("completions", "suffix", "def f():"), ("completions", "prompt_embeds", "AAAA"),
    ("completions", "use_beam_search", True), ("chat", "use_beam_search", True), ("chat", "length_penalty", 0.5),
    ("completions", "truncate_prompt_tokens", 3), ("chat", "priority", 1), ("completions", "request_id", "mine"),
    ("chat", "logits_processors", ["my.Processor"]), ("completions", "spaces_between_special_tokens", False),
    ("chat", "vllm_xargs", {"k": 1}), ("chat", "kv_transfer_params", {"k": 1}), ("chat", "echo", True),
    ("chat", "continue_final_message", True), ("chat", "add_special_tokens", True), ("chat", "chat_template", "{{x}}"),
    ("chat", "documents", [{"title": "t", "text": "x"}]), ("chat", "reasoning_effort", "low"),
    ("chat", "include_reasoning", False), ("chat", "store", True), ("chat", "audio", {"voice": "alloy"}),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {"search_context_size": "low"}), ("chat", "verbosity", "low"),
    ("chat", "mm_processor_kwargs", {"k": 1}),
]


@pytest.mark.parametrize("endpoint, field, value", _REFUSED_CASES)
def test_known_unsupported_fields_are_refused(http, endpoint, field, value):
    response = post(http, endpoint, **{field: value})
    assert_refused(response, field, f"{field} is not supported")
    assert response.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("endpoint, fields", [
    ("completions", {"suffix": None, "use_beam_search": False, "length_penalty": 1.0, "priority": 0,
                     "logits_processors": [], "spaces_between_special_tokens": True, "user": "u-1",
                     "best_of": 1, "prompt_cache_key": "k", "safety_identifier": "s"}),
    ("chat", {"echo": False, "store": False, "include_reasoning": True, "add_special_tokens": False,
              "metadata": {"a": "b"}, "service_tier": "auto", "modalities": ["text"], "user": "u-1",
              "web_search_options": {}, "documents": [], "audio": None}),  # empty asks for nothing
])
def test_their_neutral_values_pass(http, endpoint, fields):
    assert post(http, endpoint, **fields).status_code == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unknown_fields_stay_ignored(http, endpoint):
    assert post(http, endpoint, some_future_field={"x": 1}).status_code == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_best_of_is_n_or_a_400(http, endpoint):
    assert post(http, endpoint, n=2, best_of=2).status_code == 200
    assert_refused(post(http, endpoint, n=1, best_of=3), "best_of", "not supported")
    assert_refused(post(http, endpoint, n=3, best_of=2), "best_of", "must be >= n")


def test_only_known_service_tiers_and_modalities(http):
    assert_refused(post(http, "chat", service_tier="flex"), "service_tier")
    assert_refused(post(http, "chat", modalities=["text", "audio"]), "modalities.1")


# ---- prompt_logprobs, return_tokens_as_token_ids, continuous usage ----


def test_completion_prompt_logprobs(http, engine, tokenizer):
    reply = post(http, "completions", prompt_logprobs=2).json()
    prompt_ids = engine.prompts[-1]
    assert engine.params[-1].prompt_logprobs == 2
    lps = reply["choices"][0]["prompt_logprobs"]
    assert len(lps) == len(prompt_ids) and lps[0] is None
    assert [list(p) for p in lps[1:]] == [[str(t)] for t in prompt_ids[1:]]
    assert lps[1][str(prompt_ids[1])] == {"logprob": -1.0, "rank": 1,
                                          "decoded_token": tokenizer.decode([prompt_ids[1]], skip_special_tokens=False)}
    assert "prompt_logprobs" not in post(http, "completions").json()["choices"][0]  # only when asked
    streamed = sse(post(http, "completions", prompt_logprobs=0, stream=True))
    assert [c["choices"][0].get("prompt_logprobs") is not None for c in streamed] == [True, False, False]


def test_chat_prompt_logprobs(http, engine):
    reply = post(http, "chat", prompt_logprobs=1).json()
    assert len(reply["prompt_logprobs"]) == len(engine.prompts[-1]) and reply["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in post(http, "chat").json()
    streamed = sse(post(http, "chat", prompt_logprobs=1, stream=True))
    carrying = [c for c in streamed if "prompt_logprobs" in c]
    assert len(carrying) == 1 and carrying[0]["choices"] == []


def test_tokens_as_token_ids(http, engine):
    ids = engine.reply_ids
    reply = post(http, "completions", logprobs=1, return_tokens_as_token_ids=True).json()
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[f"token_id:{t}", "token_id:3"] for t in ids]
    texts = [engine.tokenizer.decode([t]) for t in ids]
    assert logprobs["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(ids))]  # the text's, not the names'
    chat = post(http, "chat", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    assert content[0]["bytes"] == list(f"token_id:{ids[0]}".encode())
    assert content[0]["top_logprobs"][0]["token"] == f"token_id:{ids[0]}"
    plain = post(http, "completions", logprobs=1).json()["choices"][0]["logprobs"]
    assert "".join(plain["tokens"]) == REPLY


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_continuous_usage_stats(http, engine, endpoint):
    chunks = sse(post(http, endpoint, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c["usage"] is not None for c in chunks)
    token_chunks = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                          c["choices"][0].get("delta", {}).get("content"))]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, len(engine.reply_ids) + 1))
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(engine.reply_ids)
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + len(engine.reply_ids)
    plain = sse(post(http, endpoint, stream=True, stream_options={"include_usage": True}))
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] is not None
    assert_refused(post(http, endpoint, stream=True,
                        stream_options={"include_usage": False, "continuous_usage_stats": True}), "stream_options")


# ---- echo: text offsets index into the returned text ----


def test_echo_offsets_skip_the_bos_that_the_text_leaves_out(http, engine, tokenizer):
    prompt = "Hello world, café 😀"
    reply = post(http, "completions", prompt=prompt, echo=True, logprobs=0, max_tokens=3).json()
    choice = choice_of(reply)
    ids = engine.prompts[-1]
    assert ids[0] == tokenizer.bos_token_id and choice["text"] == prompt + REPLY
    lp = choice["logprobs"]
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert len(offsets) == len(tokens) == len(ids) + len(engine.reply_ids)
    assert offsets == sorted(offsets) and offsets[0] == offsets[1] == 0  # the BOS has no text, the prompt's begins
    for offset, token in zip(offsets[1:], tokens[1:]):
        if "\ufffd" not in token:  # a token of part of a character has no text of its own
            assert choice["text"][offset:offset + len(token)] == token, (offset, token)
    assert offsets[len(ids)] == len(prompt)  # the generated text follows the prompt's
    scored = choice_of(post(http, "completions", prompt=prompt, echo=True, logprobs=0, max_tokens=0).json())
    assert scored["text"] == prompt and scored["logprobs"]["text_offset"] == offsets[:len(ids)]


def test_offsets_do_not_depend_on_how_the_tokens_were_chunked(tokenizer):
    """A character split over tokens (the emoji's bytes) is where the text and its tokens' texts
    part; still, a stream and its fold, one token a chunk or several, give the same offsets."""
    body = {**COMPLETION, "prompt": "Hi", "echo": True, "logprobs": 0}
    replies = []
    for tokens_per_output in (1, 3):
        http = TestClient(make_app(ScriptedEngine(tokenizer, " a😀b c", tokens_per_output)))
        streamed = sse(http.post("/v1/completions", json={**body, "stream": True}))
        offsets = [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]]
        whole = choice_of(http.post("/v1/completions", json=body).json())
        assert offsets == whole["logprobs"]["text_offset"] and whole["text"] == "Hi a😀b c"
        replies.append(whole["logprobs"])
    assert replies[0] == replies[1]


def test_add_special_tokens(http, engine, tokenizer):
    post(http, "completions", add_special_tokens=False)
    assert engine.prompts[-1] == tokenizer.encode("Hello world", add_special_tokens=False)
    post(http, "completions")
    assert engine.prompts[-1][0] == tokenizer.bos_token_id


def choice_of(reply: dict) -> dict:
    assert len(reply["choices"]) == 1, reply
    return reply["choices"][0]


# ---- /v1/models/{model}, /ping, the model_name label ----


def test_model_by_name(engine):
    http = TestClient(make_app(engine, "org/tiny-1"))
    card = http.get("/v1/models/org/tiny-1").json()
    assert card["id"] == "org/tiny-1" and card["object"] == "model" and card["max_model_len"] == 256
    assert card == http.get("/v1/models").json()["data"][0]
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["type"] == "invalid_request_error"


def test_ping_is_health(engine):
    assert TestClient(make_app(engine)).get("/ping").status_code == 200
    assert TestClient(make_app(engine)).post("/ping").status_code == 200
    starting = TestClient(make_app(None)).get("/ping")
    assert starting.status_code == 503 and starting.json()["error"]["code"] == "engine_starting"


def test_every_metric_names_the_model(http):
    from prometheus_client.parser import text_string_to_metric_families

    post(http, "completions")
    post(http, "completions", temperature="hot")  # a 400: counted as rejected
    samples = [s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
               if s.name.startswith("ferry:")]
    assert {s.name for s in samples} >= {"ferry:request_success_total", "ferry:requests_rejected_total",
                                         "ferry:time_to_first_token_seconds_count", "ferry:num_requests_running"}
    unlabelled = [s for s in samples if s.labels.get("model_name") != "tiny"]
    assert not unlabelled, unlabelled


# ---- the sampler's side, on the bundled model ----


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256)


PROMPT = "def fibonacci(n):"


def greedy(llm, prompt=PROMPT, **fields):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **fields)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_logit_bias_offline(llm):
    plain = greedy(llm)
    forced = greedy(llm, logit_bias={321: 100})
    assert forced == [321] * 12
    banned = greedy(llm, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0] and plain[0] not in banned
    with pytest.raises(ValueError, match="logit_bias has token id 4096, out of vocabulary"):
        greedy(llm, logit_bias={4096: 1})


def test_allowed_token_ids_offline(llm):
    allowed = [300, 301, 302]
    assert set(greedy(llm, allowed_token_ids=allowed)) <= set(allowed)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_offline(async_scheduling):
    """A word the model writes unprompted is not written once banned, with every spelling of it;
    with asynchronous scheduling too (its steps then wait for each token: the ban reads them)."""
    llm = LLM(dtype="float32", num_kv_blocks=256, async_scheduling=async_scheduling)
    text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    word = next(w for w in text.split() if len(llm.tokenizer.encode(" " + w, add_special_tokens=False)) > 1)
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0]
    assert word not in banned.text.split(), (word, text, banned.text)
    for spelling in (word, " " + word):
        ids = llm.tokenizer.encode(spelling, add_special_tokens=False)
        assert not any(banned.token_ids[i:i + len(ids)] == ids for i in range(len(banned.token_ids))), spelling


def test_sampling_params_cross_the_process_boundary():
    from ferry.engine.messages import HEADER_BYTES, AddRequest, decode, encode

    params = SamplingParams(logit_bias={5: 1.5, 7: -100}, allowed_token_ids=[5, 7], bad_words=["x"],
                            bad_words_token_ids=[[3, 4], [9]])
    assert decode(encode(AddRequest("r", [1], params))[HEADER_BYTES:]).params == params


def test_the_bundled_server_honours_the_token_fields(bundled_server):
    """The same through `ferry serve`: +100 decides greedy decoding, -100 and bad_words ban,
    allowed_token_ids is the whole vocabulary, and echo's offsets index into the text."""
    def complete(**fields):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
        response = httpx.post(bundled_server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    forced = complete(logit_bias={"321": 100}, logprobs=0, return_tokens_as_token_ids=True)
    assert forced["logprobs"]["tokens"] == ["token_id:321"] * 8
    plain = complete(logprobs=0, return_tokens_as_token_ids=True)["logprobs"]["tokens"]
    first = plain[0]
    banned = complete(logit_bias={first.split(":")[1]: -100}, logprobs=0, return_tokens_as_token_ids=True)
    assert first not in banned["logprobs"]["tokens"]
    allowed = complete(allowed_token_ids=[300, 301], logprobs=0, return_tokens_as_token_ids=True)
    assert set(allowed["logprobs"]["tokens"]) <= {"token_id:300", "token_id:301"}
    word = complete(max_tokens=24)["text"].split()[0]
    assert word not in complete(max_tokens=24, bad_words=[word])["text"].split()
    echoed = complete(echo=True, logprobs=0, max_tokens=2)
    offsets, tokens = echoed["logprobs"]["text_offset"], echoed["logprobs"]["tokens"]
    assert offsets[:2] == [0, 0] and all(echoed["text"][o:o + len(t)] == t for o, t in zip(offsets[1:], tokens[1:]))


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    from ferry.assets import default_model_path
    from test_server import ServerProcess

    proc = ServerProcess(Path(default_model_path()), tmp_path_factory.mktemp("logs") / "server.log",
                         "--served-model-name", "ferry-default")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


# ---- every field of vLLM's request models: honoured, or refused with a 400 naming it ----

# The fields of vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai, the
# request models of its recent releases, older spellings such as guided_* included).
VLLM_FIELDS = {
    "chat": """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
        presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
        reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p
        repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
        skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids
        bad_words echo add_generation_prompt continue_final_message add_special_tokens documents chat_template
        chat_template_kwargs mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar
        structural_tag guided_decoding_backend guided_whitespace_pattern priority request_id logits_processors
        return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs structured_outputs truncation_side
        logprob_token_ids return_token_ids ec_transfer_params repetition_detection thinking_token_budget""".split(),
    "completions": """model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
        stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty
        length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
        spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
        logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority
        request_id return_tokens_as_token_ids return_token_ids return_token_offsets cache_salt kv_transfer_params
        ec_transfer_params vllm_xargs repetition_detection thinking_token_budget best_of guided_json guided_regex
        guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern""".split(),
}
# A value that asks for something, for each refused field this walk has no value for above.
_ASKING = {"ec_transfer_params": {"k": 1}, "guided_whitespace_pattern": " ", "truncation_side": "left",
           "logprob_token_ids": [1], "return_token_ids": True, "return_token_offsets": True,
           "repetition_detection": {"n": 3}, "thinking_token_budget": 10, "structural_tag": {"structures": []}}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_vllm_field_is_declared_and_every_refused_one_is_a_400(http, endpoint):
    """No field of vLLM's request models is silently ignored: ferry's model declares each one, so it
    is either honoured (the tests of this file and of the server, sampler, structured output and
    tool calling show each effect) or listed in UNSUPPORTED, and then asking for it is a 400
    naming it."""
    from ferry.server.protocol import ChatCompletionRequest, CompletionRequest

    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    undeclared = [name for name in VLLM_FIELDS[endpoint] if name not in model.model_fields]
    assert not undeclared, f"ignored without a word: {undeclared}"
    asking = {field: value for e, field, value in _REFUSED_CASES if e == endpoint} | _ASKING
    for name in VLLM_FIELDS[endpoint]:
        if name not in model.UNSUPPORTED:
            continue
        response = post(http, endpoint, **{name: asking.get(name, {"k": 1})})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name, response.text


# Where the effect of each field ferry honours is tested (file::test), and the fields it accepts
# and documents as doing nothing.
EFFECT_TESTS = {
    "messages": "test_server::test_chat", "model": "test_request_fields::test_model_by_name",
    "prompt": "test_server::test_completion_prompt_forms_and_n", "n": "test_server::test_completion_prompt_forms_and_n",
    "echo": "test_server::test_echo_logprobs_as_lm_eval_sends_them",
    "frequency_penalty": "test_sampler::test_frequency_penalty_changes_the_greedy_choice",
    "presence_penalty": "test_sampler::test_penalties_match_hand_computation",
    "repetition_penalty": "test_sampler::test_repetition_penalty_matches_hugging_face",
    "logit_bias": "test_request_fields::test_logit_bias_offline",
    "logprobs": "test_server::test_chat_logprobs", "top_logprobs": "test_server::test_chat_logprobs",
    "max_tokens": "test_async_scheduling::test_max_tokens_costs_no_extra_step",
    "max_completion_tokens": "test_server::test_chat",
    "response_format": "test_structured_server::test_json_schema_replies_validate",
    "structured_outputs": "test_structured_server::test_vllm_and_sglang_forms",
    "guided_json": "test_structured_server::test_vllm_and_sglang_forms",
    "guided_regex": "test_structured_server::test_vllm_and_sglang_forms",
    "guided_choice": "test_structured_server::test_vllm_and_sglang_forms",
    "guided_grammar": "test_structured_server::test_vllm_and_sglang_forms",
    "seed": "test_server::test_seeds", "stop": "test_server::test_stop_strings",
    "stream": "test_server::test_chat_stream_is_the_reply_in_pieces",
    "stream_options": "test_request_fields::test_continuous_usage_stats",
    "temperature": "test_sampler::test_temperature_sharpens_and_flattens",
    "top_p": "test_sampler::test_top_p_keeps_the_smallest_set_reaching_p",
    "top_k": "test_sampler::test_top_k_support_and_frequencies",
    "min_p": "test_sampler::test_min_p_drops_tokens_below_a_fraction_of_the_top",
    "tools": "test_tool_calling::test_auto_parses_the_reply",
    "tool_choice": "test_tool_calling::test_constrained_calls_validate",
    "parallel_tool_calls": "test_tool_calling::test_parallel_tool_calls_false_gives_one_call",
    "best_of": "test_request_fields::test_best_of_is_n_or_a_400",
    "stop_token_ids": "test_engine_text::test_a_stop_token_leaves_its_text_out",
    "include_stop_str_in_output": "test_engine_text::test_stop_strings_cut_the_text",
    "ignore_eos": "test_request_fields::test_ignore_eos_runs_past_eos",
    "min_tokens": "test_scheduler::test_min_tokens_suppresses_eos",
    "skip_special_tokens": "test_tokenizer::test_decode_matches_transformers",
    "prompt_logprobs": "test_request_fields::test_completion_prompt_logprobs",
    "allowed_token_ids": "test_request_fields::test_allowed_token_ids_offline",
    "bad_words": "test_request_fields::test_bad_words_offline",
    "add_generation_prompt": "test_tokenizer::test_chat_template_matches_transformers",
    "chat_template_kwargs": "test_tokenizer::test_chat_template_extra_variables",
    "return_tokens_as_token_ids": "test_request_fields::test_tokens_as_token_ids",
    "cache_salt": "test_prefix_cache::test_cached_token_counts_and_salt",
    "add_special_tokens": "test_request_fields::test_add_special_tokens",
}
ACCEPTED_NO_OP = {"user", "guided_decoding_backend"}  # protocol.py says why each changes nothing


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_honoured_vllm_field_has_a_test_of_its_effect(endpoint):
    import ast
    from pathlib import Path

    from ferry.server.protocol import ChatCompletionRequest, CompletionRequest

    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    honoured = [n for n in VLLM_FIELDS[endpoint] if n in model.model_fields and n not in model.UNSUPPORTED]
    missing = [n for n in honoured if n not in EFFECT_TESTS and n not in ACCEPTED_NO_OP]
    assert not missing, f"honoured without a test of their effect: {missing}"
    here = Path(__file__).parent
    for name in honoured:
        if name in ACCEPTED_NO_OP:
            continue
        file, test = EFFECT_TESTS[name].split("::")
        tree = ast.parse((here / f"{file}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == test for n in tree.body), EFFECT_TESTS[name]


def test_ignore_eos_runs_past_eos():
    from fake_model import fake_engine, reference_tokens
    from test_scheduler import run

    prompt = [5, 6, 7]
    eos = (reference_tokens(prompt, 12)[3],)
    stopped = run(fake_engine(eos_token_ids=eos), [prompt], SamplingParams(max_tokens=12))["0"].outputs[0]
    ignored = run(fake_engine(eos_token_ids=eos), [prompt],
                  SamplingParams(max_tokens=12, ignore_eos=True))["0"].outputs[0]
    assert stopped.token_ids == reference_tokens(prompt, 12, eos) and stopped.finish_reason == "stop"
    assert ignored.token_ids == reference_tokens(prompt, 12) and ignored.finish_reason == "length"
