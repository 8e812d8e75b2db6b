"""`ferry bench serve`: load an OpenAI-compatible server as its users would, and measure what they feel.

    python -m ferry.bench.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    ferry bench serve --endpoint /v1/chat/completions --dataset-name multi-turn --max-concurrency 16
    ferry bench serve --request-rate-sweep 1,2,4,inf --save-result sweep.json --plot-dir plots/

    workload (datasets.py) ─► arrivals (arrivals.py) ─► each conversation, turn after turn
        ─► send_request (openai_stream.py) ─► outcomes ─► metrics (serve_metrics.py)
        ─► report, JSON, plots (plots.py)

Conversations start at the arrival times; the turns of one conversation go one after another,
each when the reply to the one before has ended (it is part of the next prompt), so in a multi-turn
workload the request rate is the rate at which conversations start. `--max-concurrency` bounds the
requests in flight; a turn that waits for a slot records how long in `queue_times`. A turn whose
earlier turn failed is not sent and counts as failed too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
from tqdm import tqdm

from ferry.bench.arrivals import ArrivalProcess
from ferry.bench.datasets import Conversation, Lengths, PromptMaker, Turn, WorkloadConfig, load_tokenizer, make_workload
from ferry.bench.openai_stream import Api, Message, RequestInput, RequestOutcome, Target, send_request
from ferry.bench.serve_metrics import (
    ServeMetrics, Slo, compute_metrics, format_report, metric_fields, output_lengths, tpot,
)


@dataclass(frozen=True)
class LoadConfig:
    arrivals: ArrivalProcess
    max_concurrency: int | None
    seed: int


@dataclass(frozen=True)
class RunResult:
    duration_s: float
    outcomes: tuple[RequestOutcome, ...]  # conversation by conversation, turn by turn, as in the workload


class History:
    """What one conversation has said so far, in the form the endpoint takes."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.messages: list[Message] = []  # chat
        self.text = ""  # completions: the turns and replies, one after another
        self.tokens = 0  # the client's count of both

    def request(self, turn: Turn) -> RequestInput:
        if self.api is Api.CHAT:
            prompt = tuple(self.messages) + ({"role": "user", "content": turn.prompt},)
        elif isinstance(turn.prompt, tuple):
            prompt = turn.prompt  # token ids: single-turn workloads only
        else:
            prompt = self.text + turn.prompt
        return RequestInput(prompt, self.tokens + turn.prompt_len, turn.output_len)

    def add(self, turn: Turn, outcome: RequestOutcome) -> None:
        reply = outcome.generated_text
        self.messages += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": reply}]
        if isinstance(turn.prompt, str):
            self.text += turn.prompt + reply
        self.tokens += turn.prompt_len + (outcome.output_tokens or outcome.num_token_chunks)


def not_sent(turn: Turn, at: float) -> RequestOutcome:
    return RequestOutcome(
        error="not sent: an earlier turn of its conversation failed", start_time=at, ttft=None,
        itl=(), latency=None, prompt_len=turn.prompt_len, output_tokens=None, num_token_chunks=0, generated_text="",
    )


async def run_load(
    session: aiohttp.ClientSession, target: Target, conversations: list[Conversation], load: LoadConfig,
    progress: tqdm | None = None,
) -> RunResult:
    with frozen_heap():
        return await _run_load(session, target, conversations, load, progress)


@contextlib.contextmanager
def frozen_heap():
    """Keep the objects that exist before the run out of the garbage collector's sight while it
    runs: a full collection walks all of them, and a pause of milliseconds while tokens stream
    in would be timed as the server's latency (vLLM's benchmark does the same)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _run_load(
    session: aiohttp.ClientSession, target: Target, conversations: list[Conversation], load: LoadConfig,
    progress: tqdm | None,
) -> RunResult:
    origin = time.perf_counter()
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()

    async def converse(conversation: Conversation) -> list[RequestOutcome]:
        history, outcomes = History(target.api), []
        for turn in conversation.turns:
            if outcomes and not outcomes[-1].success:
                outcomes.append(not_sent(turn, time.perf_counter() - origin))
            else:
                ready = time.perf_counter()
                async with slots:
                    waited = time.perf_counter() - ready
                    outcome = await send_request(session, target, history.request(turn), origin)
                outcomes.append(replace(outcome, queue_time=waited))
                history.add(turn, outcome)
            if progress is not None:
                progress.update(1)
        return outcomes

    tasks = []
    for conversation, offset in zip(conversations, load.arrivals.offsets(len(conversations), load.seed)):
        delay = origin + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(converse(conversation)))
    per_conversation = await asyncio.gather(*tasks)
    duration = time.perf_counter() - origin
    return RunResult(duration, tuple(o for outcomes in per_conversation for o in outcomes))


async def warm_up(session: aiohttp.ClientSession, target: Target, conversations: list[Conversation], n: int) -> None:
    """n unmeasured requests (first turns of the workload, all at once), so that connection set-up
    and a cold server's first compilations stay out of the figures."""
    turns = [c.turns[0] for c in conversations]
    requests = [History(target.api).request(turns[i % len(turns)]) for i in range(n)]
    await asyncio.gather(*(send_request(session, target, r, time.perf_counter()) for r in requests))


async def _model(session: aiohttp.ClientSession, args: argparse.Namespace) -> str:
    """--model, or the server's first model. The server is asked even when --model is given: the
    client's first request pays for lazy imports and a new connection (tens of ms), which must not
    land in the first measured request."""
    headers = Target(args.base_url, args.endpoint, "", args.api_key).headers
    try:
        served = await first_model(session, args.base_url, headers)
    except ServerUnreachable:
        if args.model is None:
            raise
        served = None  # a server without /v1/models
    return args.model or served


class ServerUnreachable(RuntimeError):
    pass


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            return (await response.json(content_type=None))["data"][0]["id"]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerUnreachable(f"could not read the model name from GET {url} ({type(e).__name__}: {e}); "
                           "is the server up? or pass --model") from e


# ---- the result file ----


def result_record(
    settings: dict, rate: float, metrics: ServeMetrics, run: RunResult, turns: list[tuple[int, int, Turn]],
    count_tokens,
) -> dict:
    """One run as JSON: the settings, the summary under vLLM's keys, and per-request lists (seconds)."""
    outcomes = run.outcomes
    lengths = output_lengths(outcomes, count_tokens)
    return {
        **settings,
        "request_rate": "inf" if math.isinf(rate) else rate,
        **metric_fields(metrics),
        "conversation_ids": [c for c, _, _ in turns],
        "turn_indices": [t for _, t, _ in turns],
        "input_lens": [o.prompt_len for o in outcomes],
        "expected_output_lens": [turn.output_len for _, _, turn in turns],
        "output_lens": lengths,
        "ttfts": [o.ttft for o in outcomes],
        "tpots": [tpot(o, n) for o, n in zip(outcomes, lengths)],
        "itls": [list(o.itl) for o in outcomes],
        "latencies": [o.latency for o in outcomes],
        "start_times": [o.start_time for o in outcomes],
        "queue_times": [o.queue_time for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes],
        "errors": [o.error for o in outcomes],
    }


def save_json(path: str, records: list[dict]) -> None:
    """A single run is written as its record; a sweep as {"sweep": [record, ...]}."""
    document = records[0] if len(records) == 1 else {"sweep": records}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1, allow_nan=False))


def write_plots(plot_dir: str, records: list[dict]) -> list[Path]:
    from ferry.bench import plots

    out = Path(plot_dir)
    if len(records) == 1:
        return plots.plot_latency_distributions(records[0], out)
    paths = []
    for record in records:
        prefix = f"rate-{plots.rate_label(record['request_rate'])}_"
        paths += plots.plot_latency_distributions(record, out, prefix)
    return paths + plots.plot_sweep(records, out)


# ---- from the command line ----


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    rates: tuple[float, ...]
    burstiness: float
    max_concurrency: int | None
    percentiles: tuple[float, ...]
    slo: Slo | None
    workload: WorkloadConfig
    tokenizer: Path
    extra_body: dict


def parse_options(args: argparse.Namespace) -> Options:
    rates = (args.request_rate,) if args.request_rate_sweep is None else tuple(
        float(r) for r in args.request_rate_sweep.split(",") if r.strip()
    )
    for rate in rates:
        ArrivalProcess(rate, args.burstiness)  # checks both
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.prompt_token_ids and Api.of_endpoint(args.endpoint) is Api.CHAT:
        raise ValueError("--prompt-token-ids needs /v1/completions: chat messages are text")
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.plot_dir is not None:
        from ferry.bench.plots import require_matplotlib

        require_matplotlib()
    workload = WorkloadConfig(
        dataset=args.dataset_name, num_prompts=args.num_prompts,
        lengths=Lengths(args.random_input_len, args.random_output_len, args.random_range_ratio),
        token_ids=args.prompt_token_ids, prefix_groups=args.shared_prefix_groups,
        prefix_len=args.shared_prefix_len, turns=args.multi_turn_turns, seed=args.seed,
    )
    return Options(
        rates=rates, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        percentiles=tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip()),
        slo=Slo.parse(args.goodput), workload=workload, tokenizer=_tokenizer_folder(args.tokenizer),
        extra_body=extra_body,
    )


def _tokenizer_folder(folder: str | None) -> Path:
    if folder is not None:
        return Path(folder)
    from ferry.assets import default_model_path

    return default_model_path()


def main_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every run had a successful request, 1 otherwise, 2 when the
    server could not be asked for its model."""
    options = parse_options(args)
    maker = PromptMaker(load_tokenizer(options.tokenizer))
    conversations = make_workload(options.workload, maker)
    try:
        records = asyncio.run(_bench(args, options, maker, conversations))
    except ServerUnreachable as e:
        print(f"ferry bench serve: error: {e}", file=sys.stderr)
        return 2
    if args.save_result:
        save_json(args.save_result, records)
        print(f"wrote {args.save_result}")
    if args.plot_dir:
        for path in write_plots(args.plot_dir, records):
            print(f"wrote {path}")
    return 0 if all(r["completed"] > 0 for r in records) else 1


async def _bench(
    args: argparse.Namespace, options: Options, maker: PromptMaker, conversations: list[Conversation],
) -> list[dict]:
    # No limit on connections but --max-concurrency's (0: none), no timeout but --timeout's; and
    # (aiohttp's default) no proxy from the environment, which would be measured with the server.
    # Idle connections are dropped after 3 s, before servers drop them (uvicorn after 5 s): reusing
    # one the server has just closed fails the request with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=options.max_concurrency or 0, keepalive_timeout=3)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = await _model(session, args)
        target = Target(args.base_url, args.endpoint, model, args.api_key, args.timeout, args.ignore_eos,
                        options.extra_body)
        settings = _settings(args, options, model)
        turns = [(c, t, turn) for c, conv in enumerate(conversations) for t, turn in enumerate(conv.turns)]
        records = []
        for rate in options.rates:
            load = LoadConfig(ArrivalProcess(rate, options.burstiness), options.max_concurrency, options.workload.seed)
            if args.num_warmups:
                await warm_up(session, target, conversations, args.num_warmups)
            print(f"Traffic request rate: {rate:g} ({load.arrivals.name}); maximum request concurrency: "
                  f"{options.max_concurrency or 'none'}", flush=True)
            with tqdm(total=len(turns), disable=args.disable_tqdm, file=sys.stderr) as progress:
                run = await run_load(session, target, conversations, load, progress)
            metrics = compute_metrics(run.outcomes, run.duration_s, options.percentiles, options.slo, maker.count)
            for error in [o.error for o in run.outcomes if o.error][:5]:
                print(f"failed: {error}", file=sys.stderr)
            print(format_report(metrics), flush=True)
            records.append(result_record(settings, rate, metrics, run, turns, maker.count))
    return records


def _settings(args: argparse.Namespace, options: Options, model: str) -> dict:
    slo = options.slo
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "dataset_name": options.workload.dataset, "num_prompts": options.workload.num_prompts,
        "random_input_len": options.workload.lengths.input_len,
        "random_output_len": options.workload.lengths.output_len,
        "random_range_ratio": options.workload.lengths.range_ratio,
        "burstiness": "inf" if math.isinf(options.burstiness) else options.burstiness,
        "max_concurrency": options.max_concurrency, "seed": options.workload.seed,
        "tokenizer": str(options.tokenizer), "ignore_eos": args.ignore_eos,
        "percentiles": list(options.percentiles),
        "goodput_slos_ms": None if slo is None else {
            name.removesuffix("_ms"): bound for name, bound in vars(slo).items() if bound is not None
        },
    }


def main(argv: list[str] | None = None) -> int:
    from ferry.bench.cli import add_serve_args

    parser = argparse.ArgumentParser(prog="python -m ferry.bench.serve", description=__doc__.split("\n")[0])
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return main_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ferry bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
