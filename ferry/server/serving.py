"""What the two generation endpoints share: a `Serving` plans a request, streams its chunks, and
folds them into the plain reply.

    plan(request)            the checks and the prompt (in a worker thread: templates, tokenizing)
    chunks(plan, usage)      the one code path: SSE events for stream=true ...
    reply(plan)              ... and fold(chunks) for stream=false

serving_completion.py and serving_chat.py each give the three for their API; the engine, the
server's limits, the metrics, the decoding of token ids and the usage block are here once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

from ferry.engine.async_engine import AsyncEngine
from ferry.server.config import ServerConfig
from ferry.server.metrics import ServerMetrics
from ferry.server.protocol import PromptTokensDetails, UsageInfo

PlanT = TypeVar("PlanT")
ReplyT = TypeVar("ReplyT")


class Serving(Generic[PlanT, ReplyT]):
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics

    def plan(self, request: Any, arrival_time: float) -> PlanT:
        """Check the request against the model and the server's limits; raises ApiError."""
        raise NotImplementedError

    def chunks(self, plan: PlanT, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[Any]:
        """The stream's chunks; include_usage: a usage chunk at the end; continuous_usage: the usage
        so far in every chunk (vLLM's continuous_usage_stats)."""
        raise NotImplementedError

    @staticmethod
    async def fold(chunks: AsyncIterator[Any]) -> ReplyT:
        """The chunks of one request folded into its plain reply."""
        raise NotImplementedError

    async def reply(self, plan: PlanT) -> ReplyT:
        """The non-streaming reply: the stream, folded."""
        return await self.fold(self.chunks(plan, include_usage=True))

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids as the model's tokenizer writes them, special tokens included."""
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)

    def decode_one(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """One token's text (special tokens written out, unless skip_special_tokens)."""
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
