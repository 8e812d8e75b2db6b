"""Helpers that every Triton kernel of ferry shares, whichever layer it serves (pdl.py: programmatic
dependent launch)."""
