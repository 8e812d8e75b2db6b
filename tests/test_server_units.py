"""The server's parts without a server: the engine channel's codec, delta merging, admission, the
folds, request validation, and the API key check."""

from __future__ import annotations

import asyncio
import json

import pytest

from ferry.engine.async_engine import RequestRejected, _merge_deltas, _Stream
from ferry.engine.messages import (
    HEADER_BYTES, AbortRequest, AddRequest, EngineFailed, EngineInfo, EngineReady, EngineStats, RequestFailed,
    Shutdown, StepOutputs, decode, encode, frame_length,
)
from ferry.outputs import CompletionOutput, Logprob, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")


def roundtrip(message):
    frame = encode(message)
    assert frame_length(frame[:HEADER_BYTES]) == len(frame) - HEADER_BYTES
    return decode(frame[HEADER_BYTES:])


def delta(request_id="r", texts=("a",), token_ids=((1,),), finished=False, logprobs=None, prompt_logprobs=None):
    completions = [
        CompletionOutput(i, text, list(ids), None, logprobs, "length" if finished else None)
        for i, (text, ids) in enumerate(zip(texts, token_ids))
    ]
    return RequestOutput(request_id, None, [], completions, finished, prompt_logprobs)


# ---- the codec ----


def test_every_message_survives_the_wire():
    params = SamplingParams(n=2, temperature=0.5, top_k=5, seed=3, stop=["x", "yz"], stop_token_ids=[7],
                            logprobs=2, prompt_logprobs=1, max_tokens=None, output_kind=RequestOutputKind.DELTA)
    position = {5: Logprob(-0.5, 2, "hi"), 9: Logprob(-0.1, 1, None)}
    output = RequestOutput("r", None, [], [CompletionOutput(0, "hé", [5], -0.5, [position], "stop", "x")], True,
                           [None, position], 3, {"arrival_time": 1.5})
    messages = [
        AddRequest("r", [1, 2, 3], params), AddRequest("r", [1], params, "tenant-a"), AbortRequest("r"), Shutdown(), EngineReady(EngineInfo(512, 320, 4096)),
        StepOutputs([output], EngineStats(1, 2, 0.25, 10, 20, 0)), RequestFailed("r", "too long"),
        EngineFailed("Traceback ..."),
    ]
    for message in messages:
        assert roundtrip(message) == message
    assert roundtrip(StepOutputs([output])).outputs[0].outputs[0].logprobs[0][5] == Logprob(-0.5, 2, "hi")


def test_plain_deltas_travel_as_short_rows():
    plain = delta("r1", texts=("hé",), token_ids=((5, 6),))
    plain.num_cached_tokens = 32
    others = [delta("r2", finished=True), delta("r3", texts=("a", "b"), token_ids=((1,), (2,))),
              delta("r4", logprobs=[{1: Logprob(-0.5, 1, "a")}])]
    message = StepOutputs([plain, *others])
    assert roundtrip(message) == message
    outputs = json.loads(encode(message)[HEADER_BYTES:])[1][0]
    assert outputs[0] == ["r1", "hé", [5, 6], 32] and all(len(o) == 7 for o in outputs[1:])


@pytest.mark.parametrize("payload", [
    b"not json", b"[]", b'["Pickle", null]', b'["__import__", "os"]', b'["AddRequest", [1, [1], {}]]',
    b'["AddRequest", ["r", [1], {"evil": 1}, null]]', b'["AddRequest", ["r", [1], {"temperature": -1}, null]]',
    b'["AddRequest", ["r", [1], {}, 5]]',
    b'["EngineReady", [1, 2]]', b'{"t": 1}', b'["StepOutputs", [[[1, "a", [1], 0]], [0, 0, 0, 0, 0, 0, 0, 0], []]]',
])
def test_decode_builds_nothing_but_known_messages(payload):
    with pytest.raises(ValueError):
        decode(payload)


def test_frame_length_is_bounded():
    with pytest.raises(ValueError):
        frame_length((2**31).to_bytes(4, "big"))


# ---- merging deltas in the server's per-request stream ----


def test_deltas_merge_in_order():
    lp = [{1: Logprob(-1.0, 1, "a")}]
    merged = _merge_deltas(delta(texts=("a", "x"), token_ids=((1,), (4,)), logprobs=lp, prompt_logprobs=[None]),
                           delta(texts=("b", ""), token_ids=((2,), ()), finished=True, logprobs=lp))
    assert [c.text for c in merged.outputs] == ["ab", "x"]
    assert [c.token_ids for c in merged.outputs] == [[1, 2], [4]]
    assert merged.outputs[0].logprobs == lp + lp and merged.finished and merged.prompt_logprobs == [None]
    assert merged.outputs[0].finish_reason == "length"


def test_stream_coalesces_what_waits_and_raises_errors_in_order():
    async def run():
        stream = _Stream()
        stream.put(delta(texts=("a",)))
        stream.put(delta(texts=("b",), token_ids=((2,),)))
        stream.put(RequestRejected("no"))
        first = await stream.next_output()
        with pytest.raises(RequestRejected):
            await stream.next_output()
        return first

    first = asyncio.run(run())
    assert first.outputs[0].text == "ab" and first.outputs[0].token_ids == [1, 2]


# ---- admission ----


def test_admission_queue_and_drain():
    from ferry.server.admission import Admission
    from ferry.server.errors import ApiError

    admission = Admission(max_pending=3)
    ticket = admission.admit(2)
    with pytest.raises(ApiError) as full:
        admission.admit(2)
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"
    ticket.release()
    ticket.release()  # twice is harmless
    assert admission.pending == 0
    with admission.admit(3):
        assert admission.pending == 3
    admission.start_draining(30)
    with pytest.raises(ApiError) as draining:
        admission.admit(1)
    assert draining.value.status == 503 and 1 <= int(draining.value.headers["Retry-After"]) <= 30


# ---- the folds: the non-streaming reply is the stream's chunks put together ----


async def _aiter(items):
    for item in items:
        yield item


def test_completion_fold():
    from ferry.server.protocol import CompletionChoice, CompletionLogProbs, CompletionResponse, UsageInfo
    from ferry.server.serving_completion import fold_completion

    def chunk(index, text, finish=None, tokens=()):
        lp = CompletionLogProbs(tokens=list(tokens), token_logprobs=[-1.0] * len(tokens),
                                top_logprobs=[{t: -1.0} for t in tokens], text_offset=[0] * len(tokens))
        return CompletionResponse(id="c", created=1, model="m",
                                  choices=[CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish)])

    usage = UsageInfo(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    chunks = [chunk(1, "x", tokens="x"), chunk(0, "a", tokens="a"), chunk(0, "b", "stop", "b"),
              chunk(1, "y", "length", "y"), CompletionResponse(id="c", created=1, model="m", choices=[], usage=usage)]
    reply = asyncio.run(fold_completion(_aiter(chunks)))
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(0, "ab", "stop"), (1, "xy", "length")]
    assert reply.choices[0].logprobs.tokens == ["a", "b"] and reply.usage == usage


def test_chat_fold():
    from ferry.server.protocol import ChatCompletionChunk, ChatCompletionStreamChoice, DeltaMessage
    from ferry.server.serving_chat import fold_chat

    def chunk(delta, finish=None):
        choice = ChatCompletionStreamChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)
        return ChatCompletionChunk(id="c", created=1, model="m", choices=[choice])

    chunks = [chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content="Hel")),
              chunk(DeltaMessage(content="lo"), "stop")]
    reply = asyncio.run(fold_chat(_aiter(chunks)))
    assert reply.choices[0].message.content == "Hello" and reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.usage is None


def test_chat_deltas_carry_only_what_changed():
    from ferry.server.protocol import DeltaMessage

    assert json.loads(DeltaMessage(content="x").model_dump_json()) == {"content": "x"}
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {"role": "assistant", "content": ""}
    assert json.loads(DeltaMessage().model_dump_json()) == {}


# ---- API keys ----


def test_api_key_middleware():
    from ferry.server.auth import ApiKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guarded = ApiKeyMiddleware(app, "sésame")

    def status(path, header=None):
        sent = []

        async def send(message):
            sent.append(message)

        headers = [] if header is None else [(b"authorization", header)]
        asyncio.run(guarded({"type": "http", "path": path, "headers": headers, "method": "GET"}, None, send))
        return sent[0]["status"]

    assert status("/health") == 200 and status("/version") == 200
    assert status("/metrics") == 401 and status("/metrics", b"Bearer wrong") == 401
    assert status("/metrics", "Bearer sésame".encode()) == 200
    assert status("/metrics", "bearer  sésame ".encode()) == 200
    assert status("/v1/models", "sésame".encode()) == 401
    with pytest.raises(ValueError):
        ApiKeyMiddleware(app, "")


@pytest.mark.parametrize("text", ["", "hello", 'quote " and \\ backslash', "line\nbreak\ttab\x01\x1f", "héllo 😀 中文"])
@pytest.mark.parametrize("finish_reason,stop_reason", [(None, None), ("stop", "</s>"), ("stop", 7), ("length", None)])
@pytest.mark.parametrize("include_usage", [False, True, "continuous"])
def test_text_delta_json_is_the_pydantic_chunk_byte_for_byte(text, finish_reason, stop_reason, include_usage):
    """The hand-written JSON of a streamed completion delta equals what pydantic writes for the same
    CompletionResponse, so clients cannot tell them apart (also with the usage so far in it)."""
    from ferry.server.protocol import CompletionChoice, CompletionResponse, TextDelta, stream_head

    request_id, created, model = 'cmpl-"odd\\id', 1796032826, "models/qwen3 ü"
    usage = _usage_so_far() if include_usage == "continuous" else None
    delta = TextDelta(stream_head(request_id, created, model), 3, text, finish_reason, stop_reason, usage=usage)
    response = CompletionResponse(
        id=request_id, created=created, model=model, usage=usage,
        choices=[CompletionChoice(index=3, text=text, logprobs=None, finish_reason=finish_reason,
                                  stop_reason=stop_reason)],
    )
    assert delta.json(bool(include_usage)) == \
        response.model_dump_json(exclude=None if include_usage else {"usage"}).encode()
    assert delta.choice() == response.choices[0]


def _usage_so_far():
    from ferry.server.protocol import PromptTokensDetails, UsageInfo

    return UsageInfo(prompt_tokens=5, completion_tokens=2, total_tokens=7,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=4))



@pytest.mark.parametrize("text", ["", "hello", 'quote " and \\ backslash', "line\nbreak\x01", "héllo 😀 中文"])
@pytest.mark.parametrize("finish_reason,stop_reason", [(None, None), ("stop", "</s>"), ("stop", 7), ("length", None)])
@pytest.mark.parametrize("include_usage", [False, True, "continuous"])
def test_chat_text_delta_json_is_the_pydantic_chunk_byte_for_byte(text, finish_reason, stop_reason, include_usage):
    """The same for a chat stream's content delta ({} for no text, as the model's serializer drops Nones)."""
    from ferry.server.protocol import ChatCompletionChunk, ChatCompletionStreamChoice, DeltaMessage, TextDelta, stream_head

    request_id, created, model = "chatcmpl-1", 1796032826, "ferry-default"
    usage = _usage_so_far() if include_usage == "continuous" else None
    delta = TextDelta(stream_head(request_id, created, model, chat=True), 0, text, finish_reason, stop_reason, chat=True,
                      usage=usage)
    chunk = ChatCompletionChunk(
        id=request_id, created=created, model=model, usage=usage,
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content=text or None), logprobs=None,
                                            finish_reason=finish_reason, stop_reason=stop_reason)],
    )
    assert delta.json(bool(include_usage)) == \
        chunk.model_dump_json(exclude=None if include_usage else {"usage"}).encode()
    assert delta.choice() == chunk.choices[0]
