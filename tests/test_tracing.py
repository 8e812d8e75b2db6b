"""Request traces and latency clocks without a server: the tracer on the fake engine (preemption
forced), the Chrome trace-event JSON checked against a schema of the subset ferry emits, the rolling
trace files, the traces' wire codec, and the latency definitions behind the server's histograms."""

from __future__ import annotations

import json

import pytest

from fake_model import fake_engine, reference_tokens
from ferry.engine.messages import HEADER_BYTES, StepOutputs, decode, encode
from ferry.metrics.chrome_trace import STEP_TRACK, chrome_trace
from ferry.metrics.latency import RequestClock
from ferry.metrics.trace_writer import TraceWriter
from ferry.metrics.tracing import (
    DECODE, FINISHED, PREEMPTED, PREFILL, QUEUED, RECOMPUTE, SCHEDULED, RequestTrace, RequestTracer, StepTrace,
    TraceEvent,
)
from ferry.outputs import CompletionOutput, RequestOutput
from ferry.sampling_params import SamplingParams
from test_scheduler import random_prompts

# The trace-event format (Chrome's "Trace Event Format" document, as Perfetto reads it), narrowed to
# what ferry writes: complete events, thread-scoped instants, flow arrows, and process/thread names.
_COMMON = {
    "name": {"type": "string", "minLength": 1},
    "pid": {"type": "integer", "minimum": 0},
    "tid": {"type": "integer", "minimum": 0},
    "args": {"type": "object", "additionalProperties": {"type": ["number", "string"]}},
}
TRACE_EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "additionalProperties": False,
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {"oneOf": [
            {"$ref": "#/$defs/complete"}, {"$ref": "#/$defs/instant"}, {"$ref": "#/$defs/metadata"},
            {"$ref": "#/$defs/flow"},
        ]}},
    },
    "$defs": {
        "complete": {
            "type": "object", "additionalProperties": False, "required": ["ph", "name", "pid", "tid", "ts", "dur"],
            "properties": {**_COMMON, "ph": {"const": "X"}, "ts": {"type": "number"},
                           "dur": {"type": "number", "minimum": 0}},
        },
        "instant": {
            "type": "object", "additionalProperties": False, "required": ["ph", "name", "pid", "tid", "ts", "s"],
            "properties": {**_COMMON, "ph": {"const": "i"}, "ts": {"type": "number"}, "s": {"enum": ["g", "p", "t"]}},
        },
        "flow": {
            "type": "object", "additionalProperties": False, "required": ["ph", "name", "cat", "pid", "tid", "ts", "id"],
            "properties": {**_COMMON, "ph": {"enum": ["s", "f"]}, "cat": {"type": "string"}, "ts": {"type": "number"},
                           "id": {"type": "string"}, "bp": {"const": "e"}},
        },
        "metadata": {
            "type": "object", "additionalProperties": False, "required": ["ph", "name", "pid", "args"],
            "properties": {
                **_COMMON, "ph": {"const": "M"}, "name": {"enum": ["process_name", "thread_name"]},
                "args": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
    },
}


def validate(trace_json: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(trace_json, TRACE_EVENT_SCHEMA)


def traced_run(engine, prompts, params, abort_after: dict[str, int] | None = None) -> list[RequestTrace]:
    traces: list[RequestTrace] = []
    engine.tracer = RequestTracer(traces.append)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for request_id, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(request_id)
        assert steps < 10_000
    assert engine.tracer.num_in_flight == 0
    return traces


def events(trace: RequestTrace, name: str) -> list[TraceEvent]:
    return [e for e in trace.events if e.name == name]


def assert_track_is_consistent(trace: RequestTrace, prompt_len: int) -> None:
    """Spans of one request never overlap. Each admission computes its tokens in contiguous chunks
    from its prefix-cache hit on; the chunk that completes them samples a token, and so does each
    decode step: together, the request's output tokens."""
    spans = sorted((e.start, e.start + e.duration) for e in trace.events if e.duration is not None)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 1e-9, trace
    (finished,) = events(trace, FINISHED)
    assert finished is trace.events[-1]
    preemptions = len(events(trace, PREEMPTED))
    assert finished.args["preemptions"] == preemptions
    assert len(events(trace, SCHEDULED)) == 1
    assert len(events(trace, QUEUED)) == preemptions + 1
    known, sampled, next_start = prompt_len, 0, None
    for event in sorted(trace.events, key=lambda e: e.start):
        if event.name in (PREFILL, RECOMPUTE):
            assert event.args["start"] == (event.args["cached_tokens"] if next_start is None else next_start)
            next_start = event.args["start"] + event.args["tokens"]
            assert next_start <= known
            sampled += next_start == known
        elif event.name == DECODE:
            sampled += event.args["steps"]
        elif event.name == PREEMPTED:
            known, next_start = prompt_len + sampled, None
    if finished.args["reason"] != "abort":
        assert finished.args["output_tokens"] == sampled


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_trace_with_forced_preemption_shows_each_preemption(async_scheduling):
    # As in test_scheduler's preemption test: 8 requests growing to ~40 tokens in 96 token slots,
    # with chunked prefill (16 tokens a step).
    engine = fake_engine(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, async_scheduling=async_scheduling,
                         decode_reserve=0)  # (admission without a reserve: the pool runs dry)
    prompts = random_prompts(8, 10, 20, seed=2)
    traces = traced_run(engine, prompts, SamplingParams(max_tokens=25))

    assert engine.scheduler.num_preemptions > 0
    assert sum(len(events(t, PREEMPTED)) for t in traces) == engine.scheduler.num_preemptions
    assert sorted(t.request_id for t in traces) == [str(i) for i in range(8)]
    assert len({t.track for t in traces}) == 8
    for trace in traces:
        assert_track_is_consistent(trace, len(prompts[int(trace.request_id)]))
        assert events(trace, FINISHED)[0].args == {"reason": "length", "output_tokens": 25,
                                                    "preemptions": len(events(trace, PREEMPTED))}
        for preempted in events(trace, PREEMPTED):
            # It waits again from the moment it is preempted, then recomputes what it had.
            after = [e for e in trace.events if e.start >= preempted.start and e is not preempted]
            assert any(e.name == QUEUED and e.start == preempted.start for e in after)
            assert any(e.name == RECOMPUTE for e in after)
            assert preempted.args["freed_tokens"] > 0

    trace_json = chrome_trace(traces)
    validate(trace_json)
    instants = [e for e in trace_json["traceEvents"] if e["ph"] == "i" and e["name"] == PREEMPTED]
    assert len(instants) == engine.scheduler.num_preemptions
    names = {e["tid"]: e["args"]["name"] for e in trace_json["traceEvents"] if e["name"] == "thread_name"}
    assert names[STEP_TRACK] == "engine steps"
    assert sorted(v for tid, v in names.items() if tid != STEP_TRACK) == [str(i) for i in range(8)]
    assert all(e["tid"] in names for e in trace_json["traceEvents"] if e["ph"] != "M")
    json.loads(json.dumps(trace_json))  # plain JSON all the way down


def test_aborts_and_n_sequences():
    engine = fake_engine(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    shared = list(range(1, 17))
    prompts = [shared + [20, 21], shared + [30, 31, 32], [5, 6, 7], [8, 9]]
    # "2" is aborted while it waits behind max_num_seqs=2; "0" mid-decode.
    traces = traced_run(engine, prompts, SamplingParams(max_tokens=12), abort_after={"2": 1, "0": 4})
    by_id = {t.request_id: t for t in traces}
    assert events(by_id["2"], FINISHED)[0].args["reason"] == "abort"
    assert [e.name for e in by_id["2"].events] == [QUEUED, FINISHED]  # never scheduled
    assert events(by_id["0"], FINISHED)[0].args["reason"] == "abort"
    assert events(by_id["0"], DECODE) and events(by_id["0"], DECODE)[0].args["steps"] == 3
    for i in (1, 3):
        assert_track_is_consistent(by_id[str(i)], len(prompts[i]))
    validate(chrome_trace(traces))

    # n sequences are n tracks, named by the scheduler's ids of the sequences.
    engine = fake_engine(num_kv_blocks=64)
    traces = traced_run(engine, [shared + [1]], SamplingParams(max_tokens=3, n=3, seed=1))
    assert sorted(t.request_id for t in traces) == ["0_0", "1_0", "2_0"] and len({t.track for t in traces}) == 3
    for trace in traces:
        assert_track_is_consistent(trace, len(shared) + 1)
    validate(chrome_trace(traces))


def test_prefix_cache_hit_shows_at_admission():
    engine = fake_engine(num_kv_blocks=64, block_size=4)
    shared = list(range(1, 17))
    first = traced_run(engine, [shared + [20, 21]], SamplingParams(max_tokens=2))
    traces: list[RequestTrace] = []
    engine.tracer = RequestTracer(traces.append)
    engine.add_request("again", {"prompt_token_ids": shared + [30, 31, 32]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert events(first[0], SCHEDULED)[0].args["cached_tokens"] == 0
    (trace,) = traces
    assert events(trace, SCHEDULED)[0].args == {"prompt_tokens": 19, "cached_tokens": 16}
    assert [(c.args["start"], c.args["tokens"]) for c in events(trace, PREFILL)] == [(16, 3)]


def test_token_stop_reason_is_recorded():
    engine = fake_engine(num_kv_blocks=64)
    prompt = [5, 6, 7]
    stop_token = reference_tokens(prompt, 5)[3]
    (trace,) = traced_run(engine, [prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_token]))
    args = events(trace, FINISHED)[0].args
    assert args["reason"] == "stop" and args["stop_reason"] == stop_token and args["output_tokens"] <= 4


def test_offline_llm_writes_traces_with_stop_strings(tmp_path):
    from ferry import LLM

    llm = LLM(dtype="float32", trace_dir=tmp_path)
    outs = llm.generate(["def fibonacci(n):", "import os"], SamplingParams(max_tokens=24, stop=["\n"]),
                        use_tqdm=False)
    (path,) = llm.trace_writer.files
    trace_json = json.loads(path.read_text())
    validate(trace_json)
    finishes = {e["tid"]: e["args"] for e in trace_json["traceEvents"] if e["name"] == FINISHED}
    assert sorted(f["reason"] for f in finishes.values()) == sorted(o.outputs[0].finish_reason for o in outs)


# ---- files ----


def fake_trace(i: int) -> RequestTrace:
    events = (TraceEvent(QUEUED, 1.0, 0.5), TraceEvent(FINISHED, 1.5, None, {"reason": "stop"}))
    return RequestTrace(f"r{i}", i, events)


def test_trace_files_roll_and_stay_bounded(tmp_path):
    (tmp_path / "someone-elses.json").write_text("{}")
    writer = TraceWriter(tmp_path, requests_per_file=3, max_files=2)
    for i in range(8):
        writer.add(fake_trace(i))
        writer.flush()
        for path in writer.files:
            validate(json.loads(path.read_text()))  # whole at every moment
    assert len(writer.files) == 2
    kept = [p.name for p in writer.files]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["someone-elses.json"])
    names = [[e["args"]["name"] for e in json.loads(p.read_text())["traceEvents"] if e["name"] == "thread_name"]
             for p in writer.files]
    assert names == [["engine steps", "r3", "r4", "r5"], ["engine steps", "r6", "r7"]]


def test_a_flush_writes_only_when_something_is_new(tmp_path):
    writer = TraceWriter(tmp_path, requests_per_file=10)
    writer.flush()
    assert writer.files == []
    writer.add(fake_trace(0))
    assert writer.files == []  # not before the flush
    writer.flush()
    (path,) = writer.files
    mtime = path.stat().st_mtime_ns
    writer.flush()
    assert path.stat().st_mtime_ns == mtime


# ---- the wire ----


def test_traces_cross_the_engine_channel():
    trace = RequestTrace("r", 3, (
        TraceEvent(PREFILL, 10.25, 0.5, {"start": 0, "tokens": 7, "cached_tokens": 0}),
        TraceEvent(FINISHED, 11.0, None, {"reason": "length", "stop_reason": "kv_cache_full"}),
    ))
    message = StepOutputs([], traces=[trace])
    assert decode(encode(message)[HEADER_BYTES:]) == message
    bad = encode(message)[HEADER_BYTES:].replace(b'"tokens":7', b'"tokens":[7]')
    with pytest.raises(ValueError):
        decode(bad)


# ---- latency definitions ----


def delta(texts_ids: dict[int, list[int]], finished: bool = False, metrics: dict | None = None) -> RequestOutput:
    completions = [CompletionOutput(i, "x" * len(ids), ids, finish_reason="length" if finished else None)
                   for i, ids in texts_ids.items()]
    return RequestOutput("r", None, [], completions, finished, metrics=metrics or {})


def test_request_clock_definitions():
    clock = RequestClock(arrival=100.0)
    first = clock.update(delta({0: [1], 1: []}), 100.5)
    assert first.time_to_first_token == 0.5 and first.inter_token_latencies == ()
    # Completion 1's first tokens arrive two at once: not a TTFT again, and no gap yet.
    second = clock.update(delta({0: [2], 1: [7, 8]}), 100.6)
    assert second.time_to_first_token is None and second.inter_token_latencies == pytest.approx((0.1,))
    # A merged delta of 4 tokens, 0.4 s after the previous: one chunk for the client, one gap.
    third = clock.update(delta({0: [3, 4, 5, 6], 1: []}), 101.0)
    assert third.inter_token_latencies == pytest.approx((0.4,)) and third.e2e_latency is None
    last = clock.update(delta({0: [], 1: [9]}, finished=True, metrics={"arrival_time": 7.0,
                                                                        "first_scheduled_time": 7.25}), 101.2)
    assert last.inter_token_latencies == pytest.approx((0.6,))
    assert last.e2e_latency == pytest.approx(1.2) and last.queue_time == pytest.approx(0.25)


def test_engine_reports_when_requests_were_first_scheduled():
    engine = fake_engine(num_kv_blocks=64, max_num_seqs=1)
    for i in range(2):
        engine.add_request(str(i), {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for out in final.values():
        m = out.metrics
        assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
    # The second waited for the first to finish (max_num_seqs=1).
    assert final["1"].metrics["first_scheduled_time"] >= final["0"].metrics["first_token_time"]


def test_steps_are_traced_with_their_bound_and_linked_to_the_chunks_they_computed():
    engine = fake_engine(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    traces: list[RequestTrace] = []
    steps: list[StepTrace] = []
    seen = []

    def bound(output):
        seen.append(output.step_id)
        return 1e-3 * output.num_scheduled_tokens

    engine.tracer = RequestTracer(traces.append, steps.append, bound)
    prompts = random_prompts(3, 10, 20, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=5))
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.step_id for s in steps] == seen and len(set(seen)) == len(seen)
    for step in steps:
        assert step.bound == pytest.approx(1e-3 * step.tokens) and step.duration >= 0
        assert step.tokens == step.prefill_tokens + step.decodes  # no proposals here: one token a decode
    assert sum(s.prefill_tokens for s in steps) == sum(map(len, prompts))
    by_id = {s.step_id: s for s in steps}
    for trace in traces:
        for chunk in events(trace, PREFILL):
            step = by_id[chunk.args["step"]]
            assert step.start == chunk.start and step.prefill_chunks >= 1
        (run,) = events(trace, DECODE)
        first, last = by_id[run.args["first_step"]], by_id[run.args["last_step"]]
        assert first.start == run.start and last.start + last.duration == pytest.approx(run.start + run.duration)
        assert run.args["last_step"] - run.args["first_step"] + 1 >= run.args["steps"]

    trace_json = chrome_trace(traces, steps)
    validate(trace_json)
    on_track = [e for e in trace_json["traceEvents"] if e["tid"] == STEP_TRACK and e["ph"] == "X"]
    assert len(on_track) == len(steps)
    assert all(e["args"]["roofline_ms"] == pytest.approx(e["args"]["tokens"]) for e in on_track)
    # Each chunk's arrow starts on its request's track and ends on its step's span, at the same time.
    flows = [e for e in trace_json["traceEvents"] if e["ph"] in "sf"]
    chunks = sum(len(events(t, PREFILL)) for t in traces)
    assert len(flows) == 2 * chunks and len({e["id"] for e in flows}) == chunks
    step_starts = {e["ts"] for e in on_track}
    assert all(e["ts"] in step_starts for e in flows if e["ph"] == "f")


def test_step_traces_cross_the_wire_and_the_trace_log_keeps_those_its_requests_span(tmp_path):
    from ferry.server.traces import TraceLog

    step = StepTrace(7, 10.0, 0.02, 1, 12, 3, 15, 0.005)
    message = StepOutputs([], steps=[step])
    assert decode(encode(message)[4:]).steps == [step]
    log = TraceLog(tmp_path)
    trace = RequestTrace("r", 1, (TraceEvent(PREFILL, 10.0, 0.02, {"start": 0, "tokens": 12, "cached_tokens": 0,
                                                                    "step": 7}),))
    log.add([trace])
    log.add_steps([StepTrace(6, 9.9, 0.05, 0, 0, 4, 4, None), step, StepTrace(8, 10.5, 0.01, 0, 0, 1, 1, None)])
    body = json.loads(log.recent_json("r"))
    kept = [e["args"]["step"] for e in body["traceEvents"] if e["tid"] == STEP_TRACK and e["ph"] == "X"]
    assert kept == [7]  # the steps within the request's spans
    log.writer.flush()
    (path,) = log.writer.files
    written = json.loads(path.read_text())
    validate(written)
    assert sorted(e["args"]["step"] for e in written["traceEvents"] if e["ph"] == "X" and e["tid"] == STEP_TRACK) \
        == [6, 7, 8]
