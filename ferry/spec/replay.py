"""A proposer that replays a reference run: it proposes each request's next tokens from a known
continuation, optionally wrong on purpose. It checks multi-token rows (outputs must equal the
reference whatever it proposes) and times verify steps whose acceptance is known in advance."""

from __future__ import annotations

from collections.abc import Sequence


class ReplayProposer:
    """Proposes reference[prompt][len(output):][:k]; with wrong_every n, every n-th proposed token
    is replaced by the next id (mod vocab_size), so that accepted and rejected runs of every length
    occur."""

    def __init__(self, k: int, reference: dict[tuple[int, ...], list[int]], wrong_every: int = 0,
                 vocab_size: int = 1 << 31) -> None:
        self.num_speculative_tokens = k
        self.reference = reference
        self.wrong_every = wrong_every
        self.vocab_size = vocab_size
        self.count = 0

    def propose(self, request_ids: list[str], prompt_token_ids: list[Sequence[int]],
                output_token_ids: list[Sequence[int]]) -> list[list[int]]:
        proposals = []
        for prompt, output in zip(prompt_token_ids, output_token_ids):
            guess = list(self.reference[tuple(prompt)][len(output):len(output) + self.num_speculative_tokens])
            for j in range(len(guess)):
                self.count += 1
                if self.wrong_every and self.count % self.wrong_every == 0:
                    guess[j] = (guess[j] + 1) % self.vocab_size
            proposals.append(guess)
        return proposals
