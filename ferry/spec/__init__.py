"""Speculative decoding: proposers guess a request's next tokens, and one step verifies them."""
