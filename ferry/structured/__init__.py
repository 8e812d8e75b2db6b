"""Structured output: a grammar (a JSON schema, a regex, a choice, a context-free grammar) decides
which tokens may come next, and the sampler picks only among those.

    params.py    StructuredOutputsParams: what a request asks for (vLLM's `structured_outputs`)
    grammar.py   from those to a compiled matcher, through llguidance (one per sequence)
    bitmask.py   the allowed tokens of a step's rows as bits, applied to the logits on the device
"""
