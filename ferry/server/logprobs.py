"""The engine's logprobs (per position: {token_id: Logprob}, the chosen token first, then the top
alternatives) in the formats of the OpenAI API and vLLM's prompt_logprobs.

Completions (legacy), parallel lists; echo puts the prompt's positions first, the very first with
nulls because nothing predicts it; text_offset is where each token begins in the choice's text:
    tokens ["Hello", " world"]  token_logprobs [null, -2.1]  top_logprobs [null, {" world": -2.1}]
    text_offset [0, 5]
Chat, one entry per generated token: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
Prompt logprobs (vLLM's, both APIs), per prompt token: null, then {token_id: {logprob, rank, decoded_token}}

A token is named by its text, or with return_tokens_as_token_ids as "token_id:N" (vLLM's form: a
token that is part of a character has no text of its own that JSON can carry).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferry.outputs import PositionLogprobs
from ferry.server.protocol import ChatTokenLogprob, CompletionLogProbs, PromptLogprob, PromptLogprobs, TopLogprob

# JSON has no -inf; vLLM clamps the same way.
_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _FLOOR)


@dataclass(frozen=True)
class TokenNames:
    """How a reply names a token: the text the engine decoded for it (else `decode`'s), or "token_id:N"."""

    decode: Callable[[int], str]  # one token's text, special tokens written out
    as_ids: bool = False  # return_tokens_as_token_ids

    def __call__(self, token_id: int, decoded: str | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.decode(token_id)


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], offsets: Sequence[int], names: TokenNames,
) -> CompletionLogProbs:
    """The legacy format for these tokens; offsets[i]: where token i begins in the choice's text."""
    out = CompletionLogProbs(text_offset=list(offsets))
    for token_id, position in zip(token_ids, positions):
        chosen = None if position is None else position.get(token_id)
        out.tokens.append(names(token_id, chosen.decoded_token if chosen is not None else None))
        if position is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(chosen.logprob))
        out.top_logprobs.append({names(t, lp.decoded_token): _clamp(lp.logprob) for t, lp in position.items()})
    return out


def text_offsets(token_ids: Sequence[int], start: int, text_of: Callable[[int], str]) -> tuple[list[int], int]:
    """Where each token begins in a choice's text, each after the text of the ones before it, the
    first at `start`; and where a next one would begin. A function of the tokens alone, so a stream
    and its fold agree however the tokens were split into chunks (a character split over several
    tokens counts each one's U+FFFD, as vLLM counts it)."""
    offsets = []
    for token_id in token_ids:
        offsets.append(start)
        start += len(text_of(token_id))
    return offsets, start


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int, names: TokenNames,
) -> list[ChatTokenLogprob]:
    """The chat format: each token with its `top_n` most likely alternatives, most likely first."""
    out = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = names(token_id, chosen.decoded_token if chosen else None)
        ranked = sorted((lp.rank, t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_n)
        top = [_top(names(t, lp.decoded_token), lp.logprob) for _, t, lp in ranked]
        logprob = _clamp(chosen.logprob) if chosen is not None else _FLOOR
        out.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
    return out


def format_prompt_logprobs(
    positions: Sequence[PositionLogprobs | None], decode: Callable[[int], str],
) -> PromptLogprobs:
    """vLLM's prompt_logprobs: each position as it came, logprobs clamped, decoded tokens filled in."""
    return [
        None if position is None else {
            t: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                             decoded_token=lp.decoded_token if lp.decoded_token is not None else decode(t))
            for t, lp in position.items()
        }
        for position in positions
    ]


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode()))
