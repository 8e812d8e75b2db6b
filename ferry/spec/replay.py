"""An oracle proposer: it replays a reference run, proposing each request's next tokens from a known
continuation, wrong on purpose where told to be. It checks multi-token rows (outputs must equal the
reference whatever it proposes) and measures what speculation gains at a chosen acceptance on
models that have no trained draft (random weights of a real shape: bench/spec_decode.py)."""

from __future__ import annotations

import random

from ferry.spec.proposer import Proposer, SpecRequest


class ReplayProposer(Proposer):
    """Proposes reference[prompt][len(output):][:k]. With wrong_every n, every n-th proposed token is
    replaced by the next id (mod vocab_size), so that accepted and rejected runs of every length
    occur; with wrong_rate r, each proposed token is replaced so with probability r (seeded), so a
    proposal's first token is accepted with probability 1 - r, as is each after an accepted one."""

    def __init__(self, k: int, reference: dict[tuple[int, ...], list[int]], wrong_every: int = 0,
                 vocab_size: int = 1 << 31, wrong_rate: float = 0.0, seed: int = 0) -> None:
        self.num_speculative_tokens = k
        self.reference = reference
        self.wrong_every = wrong_every
        self.wrong_rate = wrong_rate
        self.vocab_size = vocab_size
        self.count = 0
        self.rng = random.Random(seed)

    def propose(self, requests: list[SpecRequest], prefilled=()) -> list[list[int]]:
        proposals = []
        for request in requests:
            done = len(request.output_token_ids)
            guess = list(self.reference[tuple(request.prompt_token_ids)][done:done + self.num_speculative_tokens])
            for j in range(len(guess)):
                self.count += 1
                if (self.wrong_every and self.count % self.wrong_every == 0) or \
                        (self.wrong_rate and self.rng.random() < self.wrong_rate):
                    guess[j] = (guess[j] + 1) % self.vocab_size
            proposals.append(guess)
        return proposals
