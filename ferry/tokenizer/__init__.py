"""Text in and out: the tokenizer (tokenizer.json through the `tokenizers` library) and chat templates."""

from ferry.tokenizer.tokenizer import SpecialTokens, Tokenizer

__all__ = ["SpecialTokens", "Tokenizer"]
