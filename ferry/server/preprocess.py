"""From an OpenAI request to what the engine takes: prompts as token ids, checked against the model,
and `SamplingParams`.

Everything the engine would refuse is refused here first, with a 400 naming the parameter: the
engine runs in another process, and a request it rejects would cost a round trip and could only
be reported inside a stream that has already started.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ferry.engine.async_engine import AsyncEngine
from ferry.sampling_params import SamplingParams
from ferry.server.config import ServerConfig
from ferry.server.errors import ApiError, bad_request
from ferry.server.protocol import ChatMessage, Prompt, SamplingFields
from ferry.structured.requests import FIELDS as STRUCTURED_FIELDS
from ferry.structured.params import StructuredOutputsParams
from ferry.structured.requests import StructuredRequestError, structured_outputs_of
from ferry.tokenizer.tokenizer import PromptTooLong

_PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))
M = TypeVar("M", bound=BaseModel)
# vLLM's bound: each bad word costs a look at the output's tail per row and step.
MAX_BAD_WORDS = 128


@dataclass(frozen=True)
class EnginePrompt:
    token_ids: list[int]
    text: str | None  # the text the ids came from, when the client sent text
    text_offsets: list[int] | None = None  # where each token begins in `text`, when asked for


# ---- the body ----


async def parse_body(request: Request, model: type[M], max_bytes: int, timeout_s: float = 30.0) -> M:
    """The request body as `model`. 415 unless it is declared JSON (a browser's cross-site form or
    text/plain POST cannot declare it without a CORS preflight); 413 past max_bytes (checked on
    Content-Length, then while reading, for chunked uploads); 408 when the body does not arrive
    within timeout_s; 400 for bad JSON (NaN and Infinity included), lone surrogates, nesting deeper
    than MAX_JSON_DEPTH, a non-object, or a field that does not fit."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {media_type or 'none'!r})", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(len(body), max_bytes)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    data = parse_json(body)
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


# Deeper JSON than this is refused: no request of the API nests more than a few levels, and every
# recursive step after parsing (validation, templates, encoding) would risk Python's recursion limit.
MAX_JSON_DEPTH = 64


def parse_json(body: bytes | bytearray) -> Any:
    """Strict JSON: what json.loads takes, less NaN/Infinity, lone surrogates and deep nesting
    (all of them 400s, never a 500 later on)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    # Only an escape can make a surrogate (UTF-8 cannot encode one): a fast search of the bytes, and
    # a walk of the strings only when it finds one.
    if (b"\\ud" in body or b"\\uD" in body) and _has_lone_surrogate(data):
        raise bad_request("the body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string", code="invalid_json")
    return data


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _depth(data: Any) -> int:
    """How deep lists and objects nest in `data`, without recursion. Lists that begin with a number
    are taken as flat (token ids: walking millions of them would block the event loop). What such a
    list might hide fails validation where the API expects ints, and where it takes any JSON (tools,
    chat_template_kwargs) it only meets the chat template's code, whose RecursionError is a 400."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list) and not (item and isinstance(item[0], (int, float))):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _has_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"the body has {size} bytes or more; at most {max_bytes} are accepted", code="request_too_large")


def _validation_error(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    # Union members add their type names to the location ("prompt.list[int].0"); keep the fields.
    param = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or "[" not in str(p)) or None
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param)


# ---- prompts ----


def check_model(model: str | None, config: ServerConfig) -> None:
    if model is not None and model != config.served_model_name:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{config.served_model_name}`",
                       "model", "model_not_found")


def completion_prompts(
    prompt: Prompt, engine: AsyncEngine, add_special_tokens: bool = True, with_offsets: bool = False,
) -> list[EnginePrompt]:
    """The prompts of a completion request (a text, texts, token ids or lists of token ids); a text
    encoded with the special tokens the tokenizer adds (add_special_tokens), and with_offsets, where
    each of its tokens begins in it."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is empty", "prompt")
    return [_engine_prompt(item, engine, add_special_tokens, with_offsets) for item in items]


def _engine_prompt(item: str | list[int], engine: AsyncEngine, add_special_tokens: bool,
                   with_offsets: bool) -> EnginePrompt:
    if isinstance(item, str):
        if not item:
            raise bad_request("prompt is empty", "prompt")
        tokenizer = _tokenizer(engine, "prompt")
        check_text_length(item, tokenizer, engine, "prompt")
        offsets = None
        if with_offsets:
            token_ids, offsets = tokenizer.encode_with_offsets(item, add_special_tokens)
        else:
            token_ids = tokenizer.encode(item, add_special_tokens)
        if not token_ids:
            raise bad_request("the prompt encodes to no tokens", "prompt")
        return EnginePrompt(token_ids, item, offsets)
    if not item:
        raise bad_request("prompt is empty", "prompt")
    check_token_ids(item, engine, "prompt")
    return EnginePrompt(list(item), None)


def check_token_ids(token_ids: list[int], engine: AsyncEngine, param: str) -> None:
    vocab_size = engine.info.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of vocabulary (valid ids: 0 to {vocab_size - 1})", param)


def chat_prompt(
    messages: list[ChatMessage], engine: AsyncEngine, add_generation_prompt: bool = True,
    tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None,
) -> EnginePrompt:
    """The conversation rendered with the model's chat template, and its token ids."""
    tokenizer = _tokenizer(engine, "messages")
    conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
    max_chars = engine.info.max_model_len * tokenizer.max_chars_per_token
    try:
        prompt = tokenizer.chat_prompt(conversation, add_generation_prompt, tools, max_chars, **(template_kwargs or {}))
    except PromptTooLong:
        raise _too_long("messages", engine) from None
    except Exception as e:  # templates are the model's code: any error there is the request's
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
    if not prompt.token_ids:
        raise bad_request("the messages render to an empty prompt", "messages")
    return EnginePrompt(prompt.token_ids, prompt.text)


def check_text_length(text: str, tokenizer, engine: AsyncEngine, param: str) -> None:
    """400 for a text that must have more tokens than the context holds, before tokenizing it (a
    20 MB prompt would take seconds): no token stands for more than max_chars_per_token characters."""
    if len(text) > engine.info.max_model_len * tokenizer.max_chars_per_token:
        raise _too_long(param, engine, len(text))


def _too_long(param: str, engine: AsyncEngine, chars: int | None = None) -> ApiError:
    length = f"{chars} characters, more" if chars is not None else "more characters"
    return bad_request(
        f"This model's maximum context length is {engine.info.max_model_len} tokens, and the prompt has {length} "
        "than that many tokens can hold. Please shorten the prompt.", param, "context_length_exceeded",
    )


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        # Text parts join into one string, which every template understands.
        if any(part.type != "text" or part.text is None for part in message.content):
            raise bad_request("only text content parts are supported", f"messages.{index}.content")
        out["content"] = "".join(part.text for part in message.content)
    out.setdefault("content", "")
    return out


def _tokenizer(engine: AsyncEngine, param: str):
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer.json: send prompts as token ids", param)
    return engine.tokenizer


# ---- limits that need the model ----


def check_context(prompt_len: int, max_tokens: int | None, engine: AsyncEngine, prompt_param: str) -> None:
    """400 unless the prompt and max_tokens fit in the context (and the prompt in the KV cache)."""
    limit = engine.info.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} "
            "tokens, which leaves no room for output. Please shorten the prompt.",
            prompt_param, "context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the prompt or max_tokens.",
            "max_tokens", "context_length_exceeded",
        )
    if prompt_len + 1 > engine.info.kv_cache_tokens:
        raise bad_request(
            f"the prompt has {prompt_len} tokens, but the KV cache holds at most {engine.info.kv_cache_tokens}",
            prompt_param, "context_length_exceeded",
        )


def check_fan_out(num_prompts: int, n: int, config: ServerConfig) -> None:
    if num_prompts * n > config.max_fan_out:
        param = "n" if n > 1 else "prompt"
        raise bad_request(
            f"{num_prompts} prompt(s) times n={n} asks for {num_prompts * n} completions; "
            f"at most {config.max_fan_out} are allowed per request", param,
        )


# ---- sampling ----


def refuse_unsupported(request: SamplingFields) -> None:
    """400 naming the first field of the request's UNSUPPORTED that asks for something: anything
    but null, its default, or an empty list or object."""
    for name, why in request.UNSUPPORTED.items():
        value = getattr(request, name)
        if value is None or value == type(request).model_fields[name].default or value in ([], {}):
            continue
        raise bad_request(f"{name} is not supported: {why}", name, "unsupported_parameter")


def check_grammar(engine: AsyncEngine, structured: StructuredOutputsParams) -> None:
    """400 naming the schema or grammar that does not compile against the model's tokenizer (in the
    plan's worker thread: compiling takes milliseconds, building the tokenizer's view once longer)."""
    if engine.tokenizer is None:
        raise bad_request(f"{structured.source}: structured output needs the model's tokenizer", structured.source)
    key = id(engine.tokenizer)
    grammars = _GRAMMARS.get(key)
    if grammars is None:
        from ferry.structured.grammar import Grammars

        grammars = _GRAMMARS[key] = Grammars(engine.tokenizer.backend.to_str(), engine.info.vocab_size)
    try:
        grammars.check(structured)
    except ValueError as e:
        raise bad_request(str(e), structured.source) from None


# The server's view of each tokenizer for llguidance, made on the first structured request.
_GRAMMARS: dict[int, Any] = {}


def sampling_params(
    request: SamplingFields, config: ServerConfig, engine: AsyncEngine, max_tokens: int | None,
    logprobs: int | None = None, prompt_logprobs: int | None = None,
    tool_structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams; tool_structured: the schema a constraining tool_choice puts on
    the output (which the request's own structured-output fields may not also do)."""
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if request.stream_options is not None and request.stream_options.usage == (False, True):
        raise bad_request("stream_options.continuous_usage_stats needs include_usage", "stream_options")
    if request.best_of is not None and request.best_of != request.n:
        why = "must be >= n" if request.best_of < request.n else \
            "> n is not supported: ferry returns every completion it generates (vLLM V1 dropped best_of too)"
        raise bad_request(f"best_of {why}, got best_of={request.best_of}, n={request.n}", "best_of")
    if request.bad_words is not None and len(request.bad_words) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words has {len(request.bad_words)} words; at most {MAX_BAD_WORDS} are allowed",
                          "bad_words")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > config.max_stop_strings:
        raise bad_request(f"stop has {len(stop)} strings; at most {config.max_stop_strings} are allowed", "stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    check_token_ids(request.stop_token_ids or [], engine, "stop_token_ids")
    try:
        structured = structured_outputs_of({name: getattr(request, name) for name in STRUCTURED_FIELDS})
    except StructuredRequestError as e:
        raise bad_request(str(e), e.param) from None
    if tool_structured is not None:
        if structured is not None:
            raise bad_request(f"tool_choice 'required' or a named function constrains the output itself: it cannot "
                              f"be combined with {structured.source}", "tool_choice")
        structured = tool_structured
    if structured is not None:
        check_grammar(engine, structured)
    given = {
        "n": request.n, "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "min_p": request.min_p, "seed": request.seed, "max_tokens": max_tokens, "min_tokens": request.min_tokens,
        "stop": stop, "stop_token_ids": request.stop_token_ids, "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty, "repetition_penalty": request.repetition_penalty,
        "skip_special_tokens": request.skip_special_tokens, "logit_bias": request.logit_bias,
        "allowed_token_ids": request.allowed_token_ids, "bad_words": request.bad_words,
        "structured_outputs": structured,
    }
    # None means "not given": SamplingParams' default applies (max_tokens=None is meaningful).
    kwargs = {k: v for k, v in given.items() if v is not None or k in ("max_tokens", "logprobs", "prompt_logprobs")}
    try:
        return SamplingParams(**kwargs).for_model(engine.info.vocab_size, engine.tokenizer)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), name if name in _PARAM_NAMES else None) from None
