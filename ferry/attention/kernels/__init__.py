"""Triton kernels for the paged KV cache: one kernel (and its launcher) per file.

    store_kv.py           write this step's K/V at their slots (reshape_and_cache)
    decode_attention.py   one query token per request; grouped-query aware; split over the context
    prefill_attention.py  varlen causal attention of query chunks over a cached prefix
    paged_tiles.py        the pieces both attention kernels share: reading a K/V tile through a
                          block table, and one step of the online softmax
    launch.py             host-side launch helpers (multiprocessor count, dot precision)

Importing this package imports Triton; the rest of ferry imports it only when the Triton backend is
chosen (`ferry.attention.selector`). With `TRITON_INTERPRET=1` every kernel also runs on CPU tensors,
which is how the tests check them against the torch reference without a GPU.
"""
