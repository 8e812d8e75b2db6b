"""Which proposer an engine gets: the one its speculative_config asks for (proposer.py is the seam)."""

from __future__ import annotations

from ferry.config import EngineConfig
from ferry.spec.proposer import Proposer


def get_proposer(config: EngineConfig) -> Proposer | None:
    """Prompt lookup, or a draft model (loaded here, on the engine's device); None without speculation."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from ferry.spec.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
    from ferry.spec.draft_model import DraftModelProposer

    return DraftModelProposer.load(config)
