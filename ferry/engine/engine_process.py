"""The engine in a process of its own, so that HTTP work never delays a step (and gets a core of its
own): the server's `AsyncEngine` starts it and talks to it over a local socket pair.

    reader thread:  socket ─► decode ─► inbox                (always draining the socket)
    engine loop:    inbox ─► add / abort / watch ─► engine.step() ─► StepOutputs (+ EngineView) ─► encode ─► outbox
    writer thread:  outbox ─► socket

The loop encodes each message itself (little work for plain deltas in their short form,
messages.py) and the writer only sends bytes, a wait that releases the GIL.
Encoding in the writer instead would not overlap with the GPU: with asynchronous scheduling the
loop waits on the GPU only after preparing the next step, so a writer with Python work to do
takes the GIL in the middle of that preparation (at every torch call that lets go of it) and
holds it until done, and the step waits anyway, at random places. One writer keeps the messages
in order.

The loop blocks on the inbox only while the engine has nothing to do; otherwise it takes what has
arrived between two steps, applies it, and steps. Every step sends one `StepOutputs` with the
outputs of all requests that moved and the stats after the step, so the server's gauges follow
the engine step by step (an abort that frees KV blocks sends one too, without a step). With
tracing on, it also carries the traces of the requests that finished; the server keeps and writes
them, so the engine's process spends no time on files. While the dashboard watches (`Watch`), the
loop also sends sampled `EngineView`s (dashboard/watch.py), at most ten a second.

If the server goes away (the socket closes), the loop ends: an engine nobody can reach only burns
the machine. If the engine fails, it says why (`EngineFailed`) and the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
import traceback

from ferry.engine.messages import (
    HEADER_BYTES, AbortRequest, AddRequest, EngineFailed, EngineInfo, EngineReady, EngineStats, EngineView, Message,
    RequestFailed, Shutdown, StepOutputs, Watch, decode, decode_config, encode, frame_length,
)
from ferry.engine.faults import is_device_fault
from ferry.gc_settings import quiet_gc
from ferry.metrics.tracing import RequestTrace, RequestTracer, StepTrace
from ferry.outputs import RequestOutput


def run_engine_process(sock: socket.socket, config: str, threads: int | None, trace: bool = False) -> None:
    """The engine process's entry point (the target of a spawned `multiprocessing.Process`): the
    engine of `config`, an `EngineConfig` as `encode_config` wrote it (the server built it, and
    checked it, once). With `trace`, finished requests' traces go to the server with the step outputs."""
    # Ctrl-C reaches the whole process group; the server shuts the engine down in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = Channel(sock)
    try:
        import torch

        from ferry.engine.engine import LLMEngine

        engine_config = decode_config(config)
        engine_config.model.check_folder()  # a restart, maybe long after the server read the folder
        threads = threads if threads is not None else default_threads(engine_config.device)
        if threads is not None:
            torch.set_num_threads(threads)
        finished_traces: list[RequestTrace] = []
        steps: list[StepTrace] = []
        tracer = None
        if trace:
            from ferry.bench.roofline import schedule_bound

            tracer = RequestTracer(finished_traces.append, steps.append, schedule_bound(engine_config))
        engine = LLMEngine.from_config(engine_config, tracer)
        quiet_gc()
        EngineLoop(engine, channel, finished_traces, steps).run()
        engine.shutdown()
    except BaseException:
        _report_failure(channel)
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """End the process now that everything is sent: flushed, but without the interpreter's teardown.
    Its C++ side (torch's thread pools, with the channel's reader thread still blocked in recv)
    could abort there with "terminate called without an active exception", and exit code -6 for
    an engine that stopped cleanly."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def default_threads(device: str) -> int | None:
    """On a CPU, all cores but one, so that the server's HTTP work has a core of its own: with
    torch's default (every core) its threads fight the server for the cores and a step takes
    several times longer. Elsewhere, torch's choice (None)."""
    if device != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _report_failure(channel: Channel) -> None:
    message = "".join(traceback.format_exc(limit=8))
    print(message, file=sys.stderr, flush=True)
    try:
        channel.send(EngineFailed(message))
    except OSError:
        pass  # the server is gone too


class Channel:
    """The engine side of the socket: blocking framed reads and writes."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock

    def send(self, message: Message) -> None:
        self.sock.sendall(encode(message))

    def send_frame(self, frame: bytes) -> None:
        """Send a message `encode` has framed."""
        self.sock.sendall(frame)

    def recv(self) -> Message:
        """The next message; EOFError when the server has closed its end."""
        header = self._recv_exactly(HEADER_BYTES)
        return decode(self._recv_exactly(frame_length(header)))

    def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the server closed the engine channel")
            buf += chunk
        return bytes(buf)


class EngineLoop:
    def __init__(
        self, engine, channel: Channel, finished_traces: list[RequestTrace] | None = None,
        steps: list[StepTrace] | None = None,
    ) -> None:
        self.engine = engine
        self.channel = channel
        # Where the engine's tracer puts finished requests' traces and its steps; each message takes
        # them all.
        self._finished_traces = finished_traces if finished_traces is not None else []
        self._steps = steps if steps is not None else []
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # encoded messages
        # Requests whose prompt logprobs have not been sent yet -> their prompt length.
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._watch = None  # an EngineWatch while the dashboard watches (dashboard/watch.py)

    def run(self) -> None:
        threading.Thread(target=self._read, name="engine-channel-reader", daemon=True).start()
        self.channel.send(EngineReady(self._info()))
        writer = threading.Thread(target=self._write, name="engine-channel-writer", daemon=True)
        writer.start()
        try:
            self._loop()
        finally:
            # Everything queued goes out before the process reports a failure or exits.
            self.outbox.put(None)
            writer.join()

    def _loop(self) -> None:
        while True:
            messages = self._take_messages(block=not self.engine.has_unfinished_requests())
            if any(isinstance(m, Shutdown) for m in messages):
                return
            changed = self._apply(messages)
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                changed = True
            if changed:
                wire_outputs = [self._for_wire(o) for o in outputs]
                self._post(StepOutputs(wire_outputs, self._stats(), *self._take_traces()))
            if self._watch is not None:
                view = self._watch.take(force=not self.engine.has_unfinished_requests())
                if view is not None:
                    self._post(EngineView(view))

    def _post(self, message: Message) -> None:
        self.outbox.put(encode(message))

    def _write(self) -> None:
        """Send the outbox's messages in order until None; a closed socket ends the loop too."""
        while (frame := self.outbox.get()) is not None:
            try:
                self.channel.send_frame(frame)
            except OSError:
                self.inbox.put(Shutdown())
                return

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(self.channel.recv())
        except (EOFError, OSError, ValueError):
            self.inbox.put(Shutdown())

    def _take_messages(self, block: bool) -> list[Message]:
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _apply(self, messages: list[Message]) -> bool:
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self.engine.abort_request(message.request_id)
            elif isinstance(message, Watch):
                self._set_watch(message.on)
        return bool(messages)

    def _set_watch(self, on: bool) -> None:
        from ferry.dashboard.watch import watch_engine

        if not on:
            self._watch = None
        elif self._watch is None:
            self._watch = watch_engine(self.engine)
        self.engine.step_listener = self._watch.on_step if self._watch is not None else None

    def _add(self, message: AddRequest) -> None:
        prompt = {"prompt_token_ids": message.prompt_token_ids, "cache_salt": message.cache_salt}
        try:
            self.engine.add_request(message.request_id, prompt, message.params)
        except ValueError as e:  # the request's fault
            self._post(RequestFailed(message.request_id, str(e)))
            return
        except Exception as e:  # the engine's: that request fails, the engine goes on
            if is_device_fault(e):
                raise
            logging.getLogger(__name__).exception("internal error adding request %s: failing it", message.request_id)
            self._post(RequestFailed(message.request_id, f"{type(e).__name__}: {e}", internal=True))
            return
        self._prompt_tokens_total += len(message.prompt_token_ids)

    def _for_wire(self, output: RequestOutput) -> RequestOutput:
        """Count the new tokens (DELTA outputs carry only those, and the prompt logprobs once)."""
        self._generation_tokens_total += sum(len(c.token_ids) for c in output.outputs)
        return output

    def _take_traces(self) -> tuple[list[RequestTrace], list[StepTrace]]:
        traces, steps = list(self._finished_traces), list(self._steps)
        self._finished_traces.clear()
        self._steps.clear()
        return traces, steps

    def _info(self) -> EngineInfo:
        config = self.engine.config
        kv_cache = self.engine.scheduler.kv_cache
        return EngineInfo(
            max_model_len=config.model.max_model_len,
            vocab_size=config.model.vocab_size,
            kv_cache_tokens=kv_cache.num_blocks * kv_cache.block_size,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
        )

    def _stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        prefix_cache = scheduler.kv_cache.prefix_cache
        spec = scheduler.spec_stats
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=scheduler.kv_cache.usage,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions_total=scheduler.num_preemptions,
            prefix_cache_queries_total=prefix_cache.queries if prefix_cache else 0,
            prefix_cache_hits_total=prefix_cache.hits if prefix_cache else 0,
            spec_decode_num_drafts_total=spec.num_drafts,
            spec_decode_num_draft_tokens_total=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.accepted_per_pos),
        )
