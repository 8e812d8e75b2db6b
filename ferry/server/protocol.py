"""The HTTP API's shapes, as OpenAI defines them (plus vLLM's sampling extras).

Requests ignore fields they do not know, so clients written for newer OpenAI APIs still work. A
field they know does what OpenAI's or vLLM's documentation says, or is refused: the fields of those
APIs that ferry does not implement are declared too, and listed in the request's `UNSUPPORTED`,
where any value but their default is a 400 naming them (`preprocess.refuse_unsupported`), never a
request served as though it had not been said. Every field is strict (`true` or `"5"` is not a
count, `"yes"` is not a boolean); value ranges are OpenAI's, so a bad value gets a 400 naming its
field before anything reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from json.encoder import encode_basestring  # JSON string syntax, non-ASCII kept as is (as pydantic writes it)
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_serializer

Int = Annotated[int, Strict()]
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Strict(), Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    # Fields of OpenAI's or vLLM's API that ferry does not implement -> why: any value but the
    # field's default, null, or an empty list or object is a 400 naming it.
    UNSUPPORTED: ClassVar[dict[str, str]] = {}


class StreamOptions(_Request):
    include_usage: bool | None = None  # None: as continuous_usage_stats (vLLM's default is true)
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far

    @property
    def usage(self) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage in every chunk)."""
        include = self.continuous_usage_stats if self.include_usage is None else self.include_usage
        return include, self.continuous_usage_stats


class SamplingFields(_Request):
    """What completions and chat completions share."""

    model: str | None = None
    n: Int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # vLLM's extras
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache isolation between tenants
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id -> bias
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    best_of: Int | None = Field(None, ge=1)  # only = n: ferry returns every completion it generates
    # Structured output (ferry/structured/requests.py): at most one of these asks for it.
    response_format: dict[str, Any] | None = None  # OpenAI's text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's json, regex, choice, grammar, json_object
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: ferry's one backend is llguidance
    regex: str | None = None  # SGLang's
    ebnf: str | None = None
    structural_tag: Any = None
    # They ask nothing of a server that serves the request (OpenAI monitors abuse and routes caches
    # with them): accepted, and nothing is done with them.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Known, not implemented: see UNSUPPORTED.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Int | None = None
    priority: Int = 0
    request_id: str | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    guided_whitespace_pattern: str | None = None
    truncation_side: str | None = None
    logprob_token_ids: list[Any] | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: Int | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "use_beam_search": "ferry does not do beam search",
        "length_penalty": "only beam search uses it, and ferry does not do beam search",
        "spaces_between_special_tokens": "ferry decodes special tokens as the tokenizer writes them",
        "truncate_prompt_tokens": "ferry does not truncate prompts: send the tokens you want the model to read",
        "priority": "ferry schedules requests first come, first served",
        "request_id": "ferry names its requests itself",
        "logits_processors": "ferry runs no user code in its sampler",
        "vllm_xargs": "ferry has no request extensions",
        "kv_transfer_params": "ferry does not transfer KV caches between servers",
        "ec_transfer_params": "ferry does not transfer encoder caches between servers",
        "guided_whitespace_pattern": "ferry lays JSON out as json.dumps writes it",
        "truncation_side": "ferry does not truncate prompts",
        "logprob_token_ids": "ferry returns the top logprobs (logprobs / top_logprobs), not those of chosen ids",
        "return_token_ids": "ferry returns text; /tokenize gives token ids",
        "return_token_offsets": "only vLLM's render endpoints use it",
        "repetition_detection": "ferry does not stop on repeated n-grams",
        "thinking_token_budget": "ferry has no reasoning controls",
        "structural_tag": "ferry constrains a whole output (response_format, structured_outputs), not tagged parts",
    }


# A prompt: text, texts, token ids, or lists of token ids.
Prompt = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True  # vLLM's: a text prompt is encoded with BOS (as the tokenizer adds it)
    suffix: str | None = None
    prompt_embeds: Any = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **SamplingFields.UNSUPPORTED,
        "suffix": "ferry does not insert text before a suffix",
        "prompt_embeds": "ferry takes prompts as text or token ids",
    }


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    max_tokens: Int | None = Field(None, ge=1)  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} (checked in
    # serving_chat with ferry.tools.choice: a bad one is a 400 naming tool_choice)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None  # OpenAI's tags for stored completions: nothing to do here
    service_tier: Literal["auto", "default"] | None = None  # ferry has one tier
    modalities: list[Literal["text"]] | None = None  # ferry writes text only
    # Known, not implemented: see UNSUPPORTED.
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[Any] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    store: bool | None = False
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **SamplingFields.UNSUPPORTED,
        "echo": "ferry does not echo the last message in chat replies",
        "continue_final_message": "ferry always starts a new assistant message",
        "add_special_tokens": "the chat template writes the special tokens",
        "documents": "ferry does not pass documents to the chat template",
        "chat_template": "ferry renders the model's own chat template (a template is code the server runs)",
        "mm_processor_kwargs": "ferry serves text models",
        "reasoning_effort": "ferry has no reasoning controls",
        "include_reasoning": "ferry does not parse reasoning out of the reply: it is in the content",
        "store": "ferry stores no completions",
        "audio": "ferry writes text only",
        "prediction": "ferry does not take predicted outputs",
        "web_search_options": "ferry does not search the web",
        "verbosity": "ferry has no verbosity control",
    }


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's form of one token's logprob in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, the token and the top alternatives by id; None for the
# first token, which nothing predicts. Only there when asked for (prompt_logprobs).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _only_when_asked() -> Any:
    """A field that is left out of the JSON while it is None."""
    return Field(None, exclude_if=lambda value: value is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: PromptLogprobs | None = _only_when_asked()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


@dataclass(slots=True)
class TextDelta:
    """One chunk of one choice without logprobs, of a completion or a chat stream: what a stream
    sends for nearly every token. Its JSON is that of CompletionResponse (or ChatCompletionChunk),
    written by hand around a head made once per request (`stream_head`): validating and dumping the
    pydantic models per token cost a fifth of the server's CPU."""

    head: bytes  # stream_head(): the chunk up to the choice's index
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    chat: bool = False  # a chat delta ({"content": ...}), else a completion's "text"
    usage: UsageInfo | None = None  # the usage so far (stream_options.continuous_usage_stats)

    def json(self, include_usage: bool) -> bytes:
        if self.chat:  # a delta carries only what changed: no content key for no text
            body = b',"delta":{"content":' + _json_str(self.text) + b"}" if self.text else b',"delta":{}'
        else:
            body = b',"text":' + _json_str(self.text)
        if not include_usage:
            tail = b"}]}"
        else:
            tail = b'}],"usage":' + (b"null" if self.usage is None else self.usage.model_dump_json().encode()) + b"}"
        return b"".join((
            self.head, str(self.index).encode(), body,
            b',"logprobs":null,"finish_reason":', _json_value(self.finish_reason),
            b',"stop_reason":', _json_value(self.stop_reason), tail,
        ))

    def choice(self) -> CompletionChoice | ChatCompletionStreamChoice:
        """The same chunk's choice as the pydantic model (for folding a stream into one reply)."""
        if self.chat:
            return ChatCompletionStreamChoice(index=self.index, delta=DeltaMessage(content=self.text or None),
                                              logprobs=None, finish_reason=self.finish_reason,
                                              stop_reason=self.stop_reason)
        return CompletionChoice(index=self.index, text=self.text, logprobs=None, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason)


def stream_head(request_id: str, created: int, model: str, chat: bool = False) -> bytes:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return (f'{{"id":{encode_basestring(request_id)},"object":"{kind}","created":{created},'
            f'"model":{encode_basestring(model)},"choices":[{{"index":').encode()


def _json_str(text: str) -> bytes:
    return encode_basestring(text).encode()


def _json_value(value: int | str | None) -> bytes:
    if value is None:
        return b"null"
    return str(value).encode() if isinstance(value, int) else _json_str(value)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    # [{"index", "id", "type": "function", "function": {"name", "arguments"}}]: id, type and name
    # in a call's first delta only (ferry.tools.ToolCallDelta.to_openai)
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        # OpenAI's deltas carry only what changed: {"role": "assistant"} or {"content": "..."}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = _only_when_asked()  # in one chunk, with no choices


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = _only_when_asked()  # ferry.tools.ToolCall.to_openai()


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = _only_when_asked()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferry"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
