"""The server's handle on the engine process: `async for output in engine.generate(...)`.

    HTTP handler ─ generate() ─► AddRequest ──socket──► engine process (engine_process.py)
         ▲                                                   │ one StepOutputs per step
         └── per-request stream ◄── dispatch ◄── read loop ◄─┘

All of it runs on the server's event loop: writes are buffered by the transport and never block,
and the read loop hands each step's outputs to the streams of their requests. A stream that has
fallen behind gets its waiting deltas merged into one, so a slow client costs one chunk per turn,
not one per token.

Leaving a `generate` loop early (a client that went away, a cancelled task) aborts the request in
the engine, which frees its KV blocks at once. When the engine process dies, every stream fails
with `EngineDeadError` at once and `is_alive` turns False. Given a `RestartPolicy`, the engine is
then supervised: a new process starts (`is_restarting`, with backoff between failed starts) and
`is_alive` is True again once it is ready; without one, or when no start succeeds, it stays dead.
Started with `trace=True`, the engine sends the traces of the requests that finish, and
`trace_sink` gets them, and its steps' traces, which `step_trace_sink` gets. While `watch(True)` holds, the engine sends sampled views of itself for the
dashboard, and `view_sink` gets them (a restarted engine is asked again).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferry.engine.engine_process import run_engine_process
from ferry.engine.messages import (
    HEADER_BYTES, AbortRequest, AddRequest, EngineFailed, EngineInfo, EngineReady, EngineStats, EngineView, Message,
    RequestFailed, Shutdown, StepOutputs, Watch, decode, encode, encode_config, frame_length,
)
from ferry.metrics.tracing import RequestTrace, StepTrace
from ferry.outputs import CompletionOutput, RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ferry.config import EngineConfig
    from ferry.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can be served."""


class RequestRejected(ValueError):
    """The engine refused a request (the message says why); the engine is fine."""


class RequestAborted(RuntimeError):
    """The server ended the request before it finished (shutdown)."""


class RequestError(RuntimeError):
    """The engine failed on this request (a fault of the engine's, not of the request), and went
    on with the others."""


@dataclass(frozen=True)
class RestartPolicy:
    """How the server brings a dead engine back: a new process at once, then after waits that
    double from backoff_s up to max_backoff_s, until one starts; after max_attempts failed starts in
    a row it gives up (and the server exits non-zero, for systemd or Kubernetes to act)."""

    max_attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def waits(self) -> Iterator[float]:
        """The wait before each attempt (lazily: --engine-restarts may be huge)."""
        for attempt in range(self.max_attempts):
            yield 0.0 if attempt == 0 else min(self.backoff_s * 2 ** min(attempt - 1, 64), self.max_backoff_s)


@dataclass
class _EngineProcess:
    """One engine process and the server's end of its channel."""

    process: Any
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    info: EngineInfo


Launcher = Callable[[], Awaitable[_EngineProcess]]


class AsyncEngine:
    def __init__(
        self, launch: Launcher, first: _EngineProcess, tokenizer: Tokenizer | None,
        restart: RestartPolicy | None = None, on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.trace_sink: Callable[[list[RequestTrace]], None] | None = None
        self.step_trace_sink: Callable[[list[StepTrace]], None] | None = None
        self.view_sink: Callable[[dict[str, Any]], None] | None = None
        self._watching = False
        self.num_restarts = 0  # engine processes started after the first
        self._launch = launch
        self._restart = restart
        self._on_give_up = on_give_up
        self._streams: dict[str, _Stream] = {}
        self._dead_reason: str | None = None
        self._shutting_down = False
        self._restart_task: asyncio.Task | None = None
        self._attach(first)

    def _attach(self, engine: _EngineProcess) -> None:
        self._engine = engine
        self.info = engine.info  # a new process may size its KV cache differently
        self._dead_reason = None
        self._read_task = asyncio.create_task(self._read_loop(engine))
        if self._watching:  # a restarted engine: the dashboard still watches
            self._send(Watch(True))

    @classmethod
    async def start(
        cls, config: EngineConfig, threads: int | None = None, timeout_s: float = 900.0, trace: bool = False,
        restart: RestartPolicy | None = None, on_give_up: Callable[[str], None] | None = None,
        chat_template: str | None = None,
    ) -> AsyncEngine:
        """Spawn the engine process of `config` (which it gets encoded, engine/messages.py), wait
        until its model is loaded, and load the tokenizer here (the server tokenizes, so the
        engine's core spends its time on the model): from config.model.tokenizer_dir, with
        `chat_template` instead of the model's when given. With `trace`, the engine traces every
        request (see metrics/tracing.py). With `restart`, an engine process that dies is replaced,
        with the same config (see RestartPolicy); `on_give_up(reason)` runs if none will start."""
        tokenizer_dir = config.model.tokenizer_dir
        return await cls.spawn(run_engine_process, (encode_config(config), threads, trace),
                               lambda: _load_tokenizer(tokenizer_dir, chat_template), timeout_s, restart=restart,
                               on_give_up=on_give_up)

    @classmethod
    async def spawn(
        cls, target: Callable[..., None], args: tuple, tokenizer: Callable[[], Tokenizer | None] = lambda: None,
        timeout_s: float = 900.0, name: str = "ferry-engine", restart: RestartPolicy | None = None,
        on_give_up: Callable[[str], None] | None = None,
    ) -> AsyncEngine:
        """Run target(socket, *args) in a spawned process that speaks the engine's channel (the engine
        process, or a stand-in for benchmarks) and wait for its EngineReady."""
        launch = functools.partial(_launch_process, target, args, timeout_s, name)
        return cls(launch, await launch(), tokenizer(), restart, on_give_up)

    # ---- state ----

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    @property
    def is_restarting(self) -> bool:
        """Dead, and a new engine process is on its way."""
        return self._restart_task is not None

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the engine and not finished yet."""
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        return self._engine.process.pid

    # ---- requests ----

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as deltas (new text, tokens and logprobs of each of the n
        completions); the last one has `finished` set. Raises RequestRejected when the engine
        refuses the request, EngineDeadError when the engine dies, RequestAborted on shutdown.
        Leaving the loop before the last output aborts the request."""
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream()
        finished = False
        try:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
            self._send(AddRequest(request_id, prompt_token_ids, params, cache_salt))
            while not finished:
                output = await stream.next_output()
                finished = output.finished
                if output.error is not None:
                    raise RequestError(output.error)
                output.prompt, output.prompt_token_ids = prompt, prompt_token_ids
                yield output
        finally:
            del self._streams[request_id]
            if not finished and self.is_alive:
                self._send(AbortRequest(request_id))

    def watch(self, on: bool) -> None:
        """Ask the engine for views of itself (the dashboard's), or to stop sending them."""
        if on != self._watching:
            self._watching = on
            if self.is_alive:
                self._send(Watch(on))

    def abort_all(self, reason: str) -> None:
        """End every request in flight with RequestAborted (their streams abort them in the engine)."""
        for stream in self._streams.values():
            stream.put(RequestAborted(reason))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process: ask, wait up to timeout_s, then kill."""
        self._shutting_down = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.is_alive:
            self._send(Shutdown())
        self._mark_dead("the engine was shut down")
        await _stop(self._engine, timeout_s)
        self._read_task.cancel()

    # ---- the channel ----

    def _send(self, message: Message) -> None:
        self._engine.writer.write(encode(message))

    async def _read_loop(self, engine: _EngineProcess) -> None:
        reason = "the engine process exited"
        try:
            while True:
                message = await _read_message(engine.reader)
                if isinstance(message, EngineFailed):
                    reason = f"the engine process failed:\n{message.message}"
                    break
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            reason = f"the engine process exited ({e!r})"
        self._mark_dead(reason)
        if not self._shutting_down and self._restart is not None:
            logger.error("%s; starting a new engine process", reason)
            self._restart_task = asyncio.create_task(self._restart_engine(reason))

    async def _restart_engine(self, reason: str) -> None:
        """Replace the dead engine process (its requests have failed already), or give up."""
        await _stop(self._engine, timeout_s=5.0)
        for attempt, wait in enumerate(self._restart.waits(), start=1):
            await asyncio.sleep(wait)
            try:
                engine = await self._launch()
            except Exception as error:
                logger.error("engine restart %d of %d failed: %s", attempt, self._restart.max_attempts, error)
                reason = str(error)
                continue
            self.num_restarts += 1
            self._restart_task = None
            self._attach(engine)
            logger.warning("a new engine process is ready (pid %s, restart %d)", engine.process.pid, self.num_restarts)
            return
        self._restart_task = None
        logger.critical("no engine process would start after %d attempts: giving up", self._restart.max_attempts)
        if self._on_give_up is not None:
            self._on_give_up(reason)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, StepOutputs):
            self.stats = message.stats
            if message.traces and self.trace_sink is not None:
                self.trace_sink(message.traces)
            if message.steps and self.step_trace_sink is not None:
                self.step_trace_sink(message.steps)
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:  # else: aborted here while its last step ran
                    stream.put(output)
        elif isinstance(message, EngineView):
            if self.view_sink is not None:
                self.view_sink(message.view)
        elif isinstance(message, RequestFailed):
            stream = self._streams.get(message.request_id)
            if stream is not None:
                stream.put(RequestError(message.message) if message.internal else RequestRejected(message.message))

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self.stats = EngineStats()
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))


class _Stream:
    """One request's outputs waiting to be read, and the errors that end it."""

    def __init__(self) -> None:
        self._items: deque[RequestOutput | Exception] = deque()
        # The reader's wake-up, while it waits: a bare future, cheaper than an asyncio.Event (this
        # runs once per token of every stream).
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_output(self) -> RequestOutput:
        """The next output, merged with the ones queued behind it; raises a queued error."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        while self._items and isinstance(item, RequestOutput) and isinstance(self._items[0], RequestOutput) \
                and self._items[0].error is None:
            item = _merge_deltas(item, self._items.popleft())
        if isinstance(item, Exception):
            raise item
        return item


def _merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One delta output that says what `first` then `second` say."""
    completions = [
        CompletionOutput(
            a.index, a.text + b.text, a.token_ids + b.token_ids, b.cumulative_logprob,
            None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or []),
            b.finish_reason, b.stop_reason,
        )
        for a, b in zip(first.outputs, second.outputs)
    ]
    return RequestOutput(
        second.request_id, second.prompt, second.prompt_token_ids, completions, second.finished,
        first.prompt_logprobs if first.prompt_logprobs is not None else second.prompt_logprobs,
        second.num_cached_tokens, second.metrics, second.error,
    )


async def _launch_process(target: Callable[..., None], args: tuple, timeout_s: float, name: str) -> _EngineProcess:
    """Spawn target(socket, *args) and wait for its EngineReady."""
    parent_sock, child_sock = socket.socketpair()
    # spawn, not fork: a forked copy of a server with threads and an event loop is unsafe.
    process = multiprocessing.get_context("spawn").Process(target=target, args=(child_sock, *args), name=name)
    process.start()
    child_sock.close()  # the child holds its own copy; ours would hide the child's exit from us
    reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
    try:
        first = await asyncio.wait_for(_read_message(reader), timeout_s)
    except BaseException as e:  # a cancelled start (shutdown) leaves no process behind either
        process.kill()
        writer.close()
        if isinstance(e, (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError)):
            raise RuntimeError(f"the engine process did not start: {e!r}") from None
        raise
    if not isinstance(first, EngineReady):
        process.kill()
        writer.close()
        if isinstance(first, EngineFailed):
            raise RuntimeError(f"the engine process failed to start:\n{first.message}")
        raise RuntimeError(f"the engine process sent {type(first).__name__} before EngineReady")
    return _EngineProcess(process, reader, writer, first.info)


async def _stop(engine: _EngineProcess, timeout_s: float) -> None:
    """Close the channel, wait up to timeout_s for the process to end, then kill it."""
    engine.writer.close()
    process = engine.process
    await asyncio.to_thread(process.join, timeout_s)
    if process.is_alive():
        logger.warning("the engine process did not stop in %.0f s: killing it", timeout_s)
        process.kill()
        await asyncio.to_thread(process.join, 5.0)
    elif process.exitcode != 0:
        logger.warning("the engine process exited with code %s", process.exitcode)


async def _read_message(reader: asyncio.StreamReader) -> Message:
    header = await reader.readexactly(HEADER_BYTES)
    return decode(await reader.readexactly(frame_length(header)))


def _load_tokenizer(folder: Path, chat_template: str | None = None) -> Tokenizer | None:
    if not (folder / "tokenizer.json").is_file():
        return None
    from ferry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(folder, chat_template=chat_template)
