"""Triton kernels for the paged KV cache: one kernel (and its launcher) per file.

    store_kv.py           write this step's K/V at their slots (reshape_and_cache)
    decode_attention.py   the same few query tokens per request (one to decode, or one and the
                          proposals it verifies); grouped-query aware; split over the context
    prefill_attention.py  varlen causal attention of query chunks over a cached prefix
    paged_tiles.py        the pieces both attention kernels share: reading a K/V tile through a
                          block table, and one step of the online softmax
    launch.py             host-side launch helpers (multiprocessor count, dot precision)

Importing this package imports Triton; the rest of ferry imports it only when the Triton backend is
chosen (`ferry.attention.selector`). With `TRITON_INTERPRET=1` every kernel also runs on CPU tensors,
which is how the tests check them against the torch reference without a GPU.

Triton compiles a kernel anew for each value class of its integer arguments (1, divisible by 16,
other). Arguments that change from step to step (request and token counts, split counts, the
block-table width) are marked `do_not_specialize`: otherwise a step whose batch happens to hold 16
requests where the last held 15 stops for a compilation of a second or more.
"""
