"""The offline facade: `LLM.generate` and `LLM.chat`, as in vLLM, on top of one `LLMEngine`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from ferry.config import EngineConfig
from ferry.engine.engine import LLMEngine, PromptType
from ferry.outputs import RequestOutput
from ferry.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Run a model on a batch of prompts and return the completions.

    >>> llm = LLM(model="path/to/model")
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].outputs[0].text

    The other keyword arguments are the engine's options, vLLM's names (`dtype`, `max_num_seqs`,
    ...: the fields made with `option` in config.py; see `EngineConfig.create`). With `trace_dir`,
    every request is traced and `generate` leaves the traces there as Chrome trace files, which
    Perfetto opens (see metrics/tracing.py).
    """

    def __init__(self, model: str | Path | None = None, trace_dir: str | Path | None = None, **engine_args) -> None:
        if model is None:
            from ferry.assets import default_model_path

            model = default_model_path()
        config = EngineConfig.create(model, **engine_args)
        self.trace_writer = None
        tracer = None
        if trace_dir is not None:
            from ferry.bench.roofline import schedule_bound
            from ferry.metrics.trace_writer import TraceWriter
            from ferry.metrics.tracing import RequestTracer

            self.trace_writer = TraceWriter(Path(trace_dir))
            tracer = RequestTracer(self.trace_writer.add, self.trace_writer.add_step, schedule_bound(config))
        self.engine = LLMEngine.from_config(config, tracer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _broadcast(sampling_params, len(prompts))
        # Each distinct params checked against the model (token ids in its vocabulary) and its bad
        # words tokenized once, not once per prompt.
        for_model: dict[int, SamplingParams] = {}
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                if id(params) not in for_model:
                    for_model[id(params)] = params.for_model(self.engine.config.model.vocab_size, self.tokenizer)
                request_id = str(next(self._ids))
                params = for_model[id(params)].clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # A bad prompt in the middle of a batch, or Ctrl-C: leave the engine clean.
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if self.trace_writer is not None:
                self.trace_writer.flush()

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            prompt = self.tokenizer.chat_prompt(conversation, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[request_id] for request_id in request_ids]


def _broadcast(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
    return list(sampling_params)
