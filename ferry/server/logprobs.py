"""The engine's logprobs (per position: {token_id: Logprob}, the chosen token first, then the top
alternatives) in the two formats of the OpenAI API.

Completions (legacy), parallel lists; echo puts the prompt's positions first, the very first with
nulls because nothing predicts it:
    tokens ["Hello", " world"]  token_logprobs [null, -2.1]  top_logprobs [null, {" world": -2.1}]
    text_offset [0, 5]
Chat, one entry per generated token: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ferry.outputs import PositionLogprobs
from ferry.server.protocol import ChatTokenLogprob, CompletionLogProbs, TopLogprob

# JSON has no -inf; vLLM clamps the same way.
_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _FLOOR)


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], start_offset: int,
    decode: Callable[[int], str],
) -> tuple[CompletionLogProbs, int]:
    """The legacy format for these tokens; text_offset counts from start_offset. Returns it and the
    offset after the last token."""
    out = CompletionLogProbs()
    offset = start_offset
    for token_id, position in zip(token_ids, positions):
        chosen = None if position is None else position.get(token_id)
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if position is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(chosen.logprob))
        out.top_logprobs.append({
            (lp.decoded_token if lp.decoded_token is not None else decode(t)): _clamp(lp.logprob)
            for t, lp in position.items()
        })
    return out, offset


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int, decode: Callable[[int], str],
) -> list[ChatTokenLogprob]:
    """The chat format: each token with its `top_n` most likely alternatives, most likely first."""
    out = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = _token_text(token_id, chosen.decoded_token if chosen else None, decode)
        ranked = sorted((lp.rank, t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n)
        top = [_top(t, lp.decoded_token, lp.logprob, decode) for _, t, lp in ranked]
        logprob = _clamp(chosen.logprob) if chosen is not None else _FLOOR
        out.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
    return out


def _top(token_id: int, decoded: str | None, logprob: float, decode: Callable[[int], str]) -> TopLogprob:
    token = _token_text(token_id, decoded, decode)
    return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode()))


def _token_text(token_id: int, decoded: str | None, decode: Callable[[int], str]) -> str:
    return decoded if decoded is not None else decode(token_id)
