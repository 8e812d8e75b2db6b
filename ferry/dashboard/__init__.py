"""The live dashboard (`/dashboard`): what the engine is doing, step by step, in a browser.

    engine process: EngineWatch (watch.py) ─ samples ─► StepOutputs.view ─┐
    server:         DashboardFeed (feed.py) ◄──────────────────────────────┘ ─► SSE ─► static/index.html

The engine samples only while a browser watches, at bounded rates; see watch.py for what it costs.
"""
