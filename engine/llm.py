"""Offline batch API: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class Sample:
    """One of a request's n generated continuations."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Completion:
    """A prompt and its samples, in the order the prompts were given."""

    prompt_token_ids: list[int]
    samples: list[Sample]

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason


class LLM:
    """Runs prompts to completion in-process, batching them through the engine."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (text or token ids); params may be one or one per prompt."""
        prompt_ids = [self._encode(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts")
        for ids, p in zip(prompt_ids, params, strict=True):  # all first, so a bad one leaves none queued
            self.engine.validate(ids, p)
        rids = [f"offline-{next(self._ids)}" for _ in prompt_ids]
        results = {rid: Completion(ids, [Sample(i) for i in range(p.n)]) for rid, ids, p in zip(rids, prompt_ids, params, strict=True)}
        for rid, ids, p in zip(rids, prompt_ids, params, strict=True):
            self.engine.add_request(rid, ids, p)
        self._run(results)
        return [self._finish_text(results[rid]) for rid in rids]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, results: dict[str, Completion]) -> None:
        while self.engine.has_unfinished():
            for out in self.engine.step():
                sample = results[out.rid].samples[out.index]
                sample.token_ids += out.new_token_ids
                if out.logprobs:
                    sample.logprobs = (sample.logprobs or []) + out.logprobs
                if out.finished:
                    sample.finish_reason = out.finish_reason

    def _finish_text(self, completion: Completion) -> Completion:
        if self.engine.tokenizer is not None:
            decode = self.engine.tokenizer.decode
            completion.samples = [
                dataclasses.replace(s, text=decode(s.token_ids, skip_special_tokens=True))
                for s in completion.samples
            ]
        return completion
