"""Measuring ferry as its users feel it: request latencies and per-request traces.

    latency.py       TTFT, inter-token latency, end-to-end and queue time of a request, from its
                     outputs as they reach the server (the server's Prometheus histograms)
    tracing.py       RequestTracer: what each step did to each request, as timed spans
    chrome_trace.py  those traces as Chrome trace-event JSON, which Perfetto opens
    trace_writer.py  finished requests' traces in a bounded, rolling series of files

Nothing here imports the server or the executor: the engine feeds the tracer, the server feeds
the latency clocks, and either can write traces.
"""
