"""The typed messages between the server and the engine process, and their wire format.

    server process                                   engine process
    AsyncEngine ── AddRequest, AbortRequest, Watch, Shutdown ──► EngineLoop
                ◄── EngineReady, StepOutputs, EngineView, RequestFailed, EngineFailed ──┘

On the wire a message is a 4-byte big-endian length, then `["TypeName", body]` as UTF-8 JSON.
Decoding builds only the message classes listed here, field by field: nothing that crosses the
channel is ever unpickled or imported by name.

Step outputs are deltas (`RequestOutputKind.DELTA`) and leave out the prompt and its token ids:
the server sent them, keeps them, and puts them back (`AsyncEngine`). Most of a step's outputs
are one completion's new text and tokens, nothing else; those travel as a short row,
`[request_id, text, token_ids, num_cached_tokens]`, which costs both ends much less than the full form
(a step's message carries hundreds of them). Prompt logprobs travel once,
in the first output that has all of them. With tracing on, a step's message also carries the
traces of the requests that finished in it, and the step's own trace.

The engine process gets its `EngineConfig` through the same codec (`encode_config`, as the
argument it is spawned with): every field by name, the sub-configs nested, folders as strings and
tuples as lists; decoding builds the config classes alone, whose checks run again.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ferry.config import EngineConfig, field_types
from ferry.metrics.tracing import RequestTrace, StepTrace, TraceEvent
from ferry.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams

# A frame this large is a bug, not a request (a 1M-token prompt is about 8 MB of JSON).
MAX_FRAME_BYTES = 1 << 30
_HEADER = struct.Struct(">I")


# ---- server -> engine ----


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # keeps the request's prefix-cache entries apart from other tenants'

    def to_json(self) -> Any:
        return [self.request_id, self.prompt_token_ids, _params_to_json(self.params), self.cache_salt]

    @classmethod
    def from_json(cls, body: Any) -> AddRequest:
        request_id, token_ids, params, cache_salt = body
        return cls(_str(request_id), _int_list(token_ids), _params_from_json(params),
                   None if cache_salt is None else _str(cache_salt))


@dataclass(frozen=True)
class AbortRequest:
    request_id: str

    def to_json(self) -> Any:
        return self.request_id

    @classmethod
    def from_json(cls, body: Any) -> AbortRequest:
        return cls(_str(body))


@dataclass(frozen=True)
class Watch:
    """Start (or stop) sampling views of the engine for the dashboard (dashboard/watch.py)."""

    on: bool

    def to_json(self) -> Any:
        return self.on

    @classmethod
    def from_json(cls, body: Any) -> Watch:
        if not isinstance(body, bool):
            raise TypeError(f"Watch takes a boolean, got {type(body).__name__}")
        return cls(body)


@dataclass(frozen=True)
class Shutdown:
    def to_json(self) -> Any:
        return None

    @classmethod
    def from_json(cls, body: Any) -> Shutdown:
        return cls()


# ---- engine -> server ----


@dataclass(frozen=True)
class EngineInfo:
    """What the server must know about the model to validate requests before they reach the engine."""

    max_model_len: int
    vocab_size: int
    kv_cache_tokens: int  # the most tokens one request can ever hold in the KV cache
    num_speculative_tokens: int = 0  # proposals a step verifies per request (0: no speculative decoding)


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges after a step, and its running totals (for Prometheus counters)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, in [0, 1]
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found there
    # Speculative decoding (core/spec_stats.py): verify rows, proposed tokens checked, of which kept,
    # and kept by position (the j-th entry counts rows that kept their (j+1)-th proposal).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # (JSON brings the tuple back as a list)
        object.__setattr__(self, "spec_decode_num_accepted_tokens_per_pos",
                           tuple(self.spec_decode_num_accepted_tokens_per_pos))


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo

    def to_json(self) -> Any:
        return _flat_to_json(self.info)

    @classmethod
    def from_json(cls, body: Any) -> EngineReady:
        return cls(_flat_from_json(EngineInfo, body))


@dataclass(frozen=True)
class StepOutputs:
    """One engine step's outputs (possibly none: a step-less change such as an abort still moves
    the gauges), the stats after it, and the traces of requests that finished (tracing on)."""

    outputs: list[RequestOutput]
    stats: EngineStats = field(default_factory=EngineStats)
    traces: list[RequestTrace] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)  # the steps traced since the last message

    def to_json(self) -> Any:
        return [[_output_to_json(o) for o in self.outputs], _flat_to_json(self.stats),
                [_trace_to_json(t) for t in self.traces], [_flat_to_json(s) for s in self.steps]]

    @classmethod
    def from_json(cls, body: Any) -> StepOutputs:
        outputs, stats, traces, steps = body
        return cls([_output_from_json(o) for o in outputs], _flat_from_json(EngineStats, stats),
                   [_trace_from_json(t) for t in traces], [_flat_from_json(StepTrace, s) for s in steps])


@dataclass(frozen=True)
class EngineView:
    """A sampled view of the engine for the dashboard: plain JSON data (numbers, strings and lists
    of them; dashboard/watch.py says what), passed on to browsers as it is."""

    view: dict[str, Any]

    def to_json(self) -> Any:
        return self.view

    @classmethod
    def from_json(cls, body: Any) -> EngineView:
        if not isinstance(body, dict):
            raise TypeError(f"EngineView takes an object, got {type(body).__name__}")
        return cls(body)


@dataclass(frozen=True)
class RequestFailed:
    """The engine refused a request (its ValueError message), or failed to add it (`internal`: a
    fault of the engine's, not of the request); either way the engine itself goes on."""

    request_id: str
    message: str
    internal: bool = False

    def to_json(self) -> Any:
        return [self.request_id, self.message, self.internal]

    @classmethod
    def from_json(cls, body: Any) -> RequestFailed:
        return cls(_str(body[0]), _str(body[1]), bool(body[2]))


@dataclass(frozen=True)
class EngineFailed:
    """The engine process is going down: why (the last lines of the traceback)."""

    message: str

    def to_json(self) -> Any:
        return self.message

    @classmethod
    def from_json(cls, body: Any) -> EngineFailed:
        return cls(_str(body))


Message = (AddRequest | AbortRequest | Watch | Shutdown | EngineReady | StepOutputs | EngineView | RequestFailed
           | EngineFailed)
_TYPES: dict[str, Any] = {
    cls.__name__: cls
    for cls in (AddRequest, AbortRequest, Watch, Shutdown, EngineReady, StepOutputs, EngineView, RequestFailed,
                EngineFailed)
}


def encode(message: Message) -> bytes:
    """One framed message: length header + JSON."""
    payload = json.dumps([type(message).__name__, message.to_json()], separators=(",", ":")).encode()
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> Message:
    """A message from a frame's payload (without its header). Raises ValueError on anything else."""
    try:
        name, body = json.loads(payload)
        cls = _TYPES[name]
        return cls.from_json(body)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed engine message: {e!r}") from None


def frame_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"engine message of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return length


HEADER_BYTES = _HEADER.size


def encode_config(config: EngineConfig) -> str:
    """The engine's configuration as JSON text."""
    return json.dumps(_config_to_json(config))


def decode_config(text: str) -> EngineConfig:
    """The configuration `encode_config` wrote. Raises ValueError on anything else."""
    try:
        return _config_from_json(EngineConfig, json.loads(text))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed engine config: {e!r}") from None


# ---- field codecs ----


def _config_to_json(config: Any) -> dict:
    body = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            value = _config_to_json(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    return body


def _config_from_json(cls: type, body: Any) -> Any:
    """A config class from its fields by name, each back in its field's type (a missing field is a
    TypeError; the class checks the values)."""
    if not isinstance(body, dict):
        raise TypeError(f"{cls.__name__} must be an object, got {type(body).__name__}")
    types = field_types(cls)
    unknown = set(body) - set(types)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    values = {}
    for name, value in body.items():
        kind = types[name]
        if value is not None and is_dataclass(kind):
            value = _config_from_json(kind, value)
        elif value is not None and kind is Path:
            value = Path(_str(value))
        elif value is not None and kind is tuple:
            value = tuple(value)
        values[name] = value
    return cls(**values)


def _flat_to_json(obj: Any) -> list:
    return [getattr(obj, f.name) for f in fields(obj)]


def _flat_from_json(cls: type, body: list) -> Any:
    names = [f.name for f in fields(cls)]
    if len(body) != len(names):
        raise ValueError(f"{cls.__name__} takes {len(names)} fields, got {len(body)}")
    return cls(*body)


_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _params_to_json(params: SamplingParams) -> dict:
    out = {f.name: getattr(params, f.name) for f in fields(params)}
    out["output_kind"] = params.output_kind.name
    if params.structured_outputs is not None:
        out["structured_outputs"] = params.structured_outputs.to_json()
    return out


def _params_from_json(body: dict) -> SamplingParams:
    unknown = set(body) - _PARAM_NAMES
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}")
    body = dict(body)
    body["output_kind"] = RequestOutputKind[body.get("output_kind", "CUMULATIVE")]
    return SamplingParams(**body)  # __post_init__ validates every value again


def _output_to_json(output: RequestOutput) -> list:
    if len(output.outputs) == 1 and not output.finished and output.prompt_logprobs is None and not output.metrics:
        c = output.outputs[0]
        if (c.index == 0 and c.logprobs is None and c.cumulative_logprob is None and c.finish_reason is None
                and c.stop_reason is None):
            return [output.request_id, c.text, c.token_ids, output.num_cached_tokens]  # the short row
    return [
        output.request_id,
        output.finished,
        [_completion_to_json(c) for c in output.outputs],
        _logprobs_list_to_json(output.prompt_logprobs),
        output.num_cached_tokens,
        output.metrics,
        output.error,
    ]


def _output_from_json(body: list) -> RequestOutput:
    if len(body) == 4:  # the short row
        request_id, text, token_ids, num_cached = body
        return RequestOutput(_str(request_id), None, [], [CompletionOutput(0, _str(text), _int_list(token_ids))],
                             False, num_cached_tokens=int(num_cached))
    request_id, finished, completions, prompt_logprobs, num_cached, metrics, error = body
    return RequestOutput(
        request_id=_str(request_id),
        prompt=None,
        prompt_token_ids=[],
        outputs=[_completion_from_json(c) for c in completions],
        finished=bool(finished),
        prompt_logprobs=_logprobs_list_from_json(prompt_logprobs),
        num_cached_tokens=int(num_cached),
        metrics={str(k): float(v) for k, v in metrics.items()},
        error=None if error is None else _str(error),
    )


def _completion_to_json(c: CompletionOutput) -> list:
    return [c.index, c.text, c.token_ids, c.cumulative_logprob, _logprobs_list_to_json(c.logprobs),
            c.finish_reason, c.stop_reason]


def _completion_from_json(body: list) -> CompletionOutput:
    index, text, token_ids, cumulative, logprobs, finish_reason, stop_reason = body
    return CompletionOutput(
        int(index), _str(text), _int_list(token_ids), cumulative, _logprobs_list_from_json(logprobs),
        finish_reason, stop_reason,
    )


def _logprobs_list_to_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    # A position is [[token_id, logprob, rank, decoded_token], ...] in the dict's order: the
    # chosen token first, then the top alternatives.
    if positions is None:
        return None
    return [
        None if p is None else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in p.items()]
        for p in positions
    ]


def _logprobs_list_from_json(body: list | None) -> list[PositionLogprobs | None] | None:
    if body is None:
        return None
    return [
        None if p is None else {int(t): Logprob(float(lp), rank, decoded) for t, lp, rank, decoded in p}
        for p in body
    ]


def _trace_to_json(trace: RequestTrace) -> list:
    return [trace.request_id, trace.track, [[e.name, e.start, e.duration, e.args] for e in trace.events]]


def _trace_from_json(body: list) -> RequestTrace:
    request_id, track, events = body
    return RequestTrace(_str(request_id), int(track), tuple(_event_from_json(e) for e in events))


def _event_from_json(body: list) -> TraceEvent:
    name, start, duration, args = body
    if not isinstance(args, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float, str)) for k, v in args.items()
    ):
        raise ValueError("a trace event's args must map names to numbers or strings")
    return TraceEvent(_str(name), float(start), None if duration is None else float(duration), args)


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise ValueError(f"expected a string, got {type(x).__name__}")
    return x


def _int_list(x: Any) -> list[int]:
    # The elements are not checked one by one: this runs for every output of every step, and the
    # engine checks the ids of a prompt itself.
    if not isinstance(x, list):
        raise ValueError(f"expected a list of integers, got {type(x).__name__}")
    return x
