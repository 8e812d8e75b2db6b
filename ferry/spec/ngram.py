"""Prompt lookup: guess a request's next tokens from its own earlier tokens, with no model at all.

Code edits, summaries and retrieval answers repeat their prompt; a small model's greedy text repeats
itself. Where the last n tokens occurred before, the tokens that followed them then are a good guess
of what follows now:

    tokens:   ... a b c d e ... x y a b c            (the last 3, "a b c", occurred before)
                        ^^^^^ proposed: d e ...

The longest such n from prompt_lookup_max down to prompt_lookup_min wins, and the latest occurrence
among equals. A match that runs into the end of the context continues with its own proposals, so a
loop of period p is proposed in full ("x y x y" -> "x y x y ...").

Each request keeps an index of where every prompt_lookup_min-gram ended (its last few occurrences),
extended by the tokens that are new since its last step, so a step costs the new tokens and a few
comparisons, not a scan of the whole context.
"""

from __future__ import annotations

from ferry.spec.proposer import Proposer, SpecRequest

_OCCURRENCES = 4  # ends kept per n-gram: the latest ones (the older rarely win, and lists stay short)


class _Index:
    """Where each n-gram of the request's first `num_indexed` tokens ended (exclusive), latest last."""

    __slots__ = ("num_indexed", "ends")

    def __init__(self) -> None:
        self.num_indexed = 0
        self.ends: dict[tuple[int, ...], list[int]] = {}


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, requests: list[SpecRequest], prefilled=()) -> list[list[int]]:
        return [self._propose(request) for request in requests]

    def _propose(self, request: SpecRequest) -> list[int]:
        if request.memo is None:
            request.memo = _Index()
        tokens = request.prompt_token_ids + request.output_token_ids  # (a copy: the runner's lists grow)
        index, n, num = request.memo, self.min_n, len(tokens)
        # Index the n-grams that end before the last token: the suffix itself must find earlier ones.
        for end in range(max(index.num_indexed, n), num):
            ends = index.ends.setdefault(tuple(tokens[end - n:end]), [])
            ends.append(end)
            if len(ends) > _OCCURRENCES:
                del ends[0]
        index.num_indexed = max(index.num_indexed, num)
        if num <= n:
            return []
        best_end, best_len = None, 0
        for end in index.ends.get(tuple(tokens[num - n:]), ()):
            length = n  # how far the match reaches back, up to max_n
            while length < self.max_n and end - length > 0 and tokens[end - length - 1] == tokens[num - length - 1]:
                length += 1
            if length >= best_len:  # the later of equals (ends are oldest first)
                best_end, best_len = end, length
        if best_end is None:
            return []
        for j in range(self.num_speculative_tokens):
            tokens.append(tokens[best_end + j])  # past the context: the proposal's own tokens
        return tokens[num:]
