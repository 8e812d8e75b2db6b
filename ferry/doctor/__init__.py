"""`ferry doctor`: an engine's memory and speed predicted from a model's config.json and a GPU,
before anything runs; `ferry doctor --check` measures the same quantities on this machine.

    gpus.py         public specifications of common GPUs, each from its vendor's datasheet
    calibration.py  what ferry's kernels reach of a machine's ceilings, and its fixed costs
    predict.py      the formulas: each figure with the terms it is made of
    report.py       the figures of one deployment, the what-ifs beside it, as text and JSON
    check.py        the same quantities measured with ferry's own benchmarks
    cli.py          the command
"""
