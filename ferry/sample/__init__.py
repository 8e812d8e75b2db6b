"""Choosing the next token of every running request from the model's logits."""

from ferry.sample.metadata import SamplingRow, request_generator
from ferry.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "request_generator"]
