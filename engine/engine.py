"""The in-process engine: requests in, one scheduled forward pass per step, tokens out."""

from __future__ import annotations

import logging

from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.kv_cache import PageAllocator, PageTableManager
from engine.model_files import resolve_model_dir
from engine.model_runner import ModelRunner
from engine.models import model_class
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


class Engine:
    """Scheduler plus model runner behind a small API: add_request, step, abort.

    The serving layer wraps this same object in its own process; tests and offline jobs
    call it directly.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        model_class(hf_config)  # fail on an unknown architecture before loading anything
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = _max_model_len(config, hf_config)
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer)
        self.runner = ModelRunner(config, hf_config, self.model_dir, self.max_model_len)
        allocator = PageAllocator(self.runner.pool.num_pages)
        self.pages = PageTableManager(self.runner.pool, allocator)
        limits = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs)
        self.scheduler = Scheduler(limits, self.pages)
        self._pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self._log_memory()

    def _log_memory(self) -> None:
        m = self.runner.memory
        logger.info(
            "memory: weights %.1f MiB, KV pool %.1f MiB = %d tokens (%d pages of %d); "
            "%d sequences at the full %d-token context",
            m.weights_bytes / 2**20, m.kv_bytes / 2**20, m.kv_tokens, self.runner.pool.num_pages,
            self.config.page_size, m.max_full_length_seqs, self.max_model_len,
        )

    def add_request(
        self, rid: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Queue a request; bad input raises InvalidParameter before any compute."""
        self.validate(prompt_token_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        first = Sequence(rid, prompt_token_ids, params, stop_ids, 0, priority)
        self.scheduler.add(first)
        for index in range(1, params.n):
            self.scheduler.add(Sequence(rid, prompt_token_ids, params, stop_ids, index, priority, first))

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter if this request could never run."""
        params.validate()
        if not prompt:
            raise InvalidParameter("prompt", "must not be empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidParameter("prompt", f"token ids must be in [0, {self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"plus the prompt's {len(prompt)} tokens is {total}, over the model's "
                f"context length of {self.max_model_len}",
                code="context_length_exceeded",
            )
        if self.pages.pages_for(total) > self.pages.allocator.num_pages:
            raise InvalidParameter("max_tokens", f"{total} tokens exceed the whole KV pool")

    def abort(self, rid: str) -> None:
        """Stop every sample of `rid` now and free its pages."""
        for seq in self.scheduler.find(rid):
            self.scheduler.finish(seq, "abort")
            self._pending.append(self._output(seq, []))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and report what each sequence gained."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        sampled, result = self.runner.run(batch)
        for item in batch:
            item.seq.num_computed += item.num_new_tokens
        for i, item in enumerate(sampled):
            seq = item.seq
            seq.token_ids.append(result.token_ids[i])
            reason = seq.check_stop(self.max_model_len)
            if reason:
                self.scheduler.finish(seq, reason)
            logprob = result.logprobs[i]
            outputs.append(self._output(seq, [result.token_ids[i]], [logprob] if logprob else None))
        return outputs

    def _output(self, seq: Sequence, new_ids: list[int], logprobs=None) -> RequestOutput:
        return RequestOutput(
            rid=seq.rid,
            index=seq.index,
            new_token_ids=new_ids,
            logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def stats(self) -> dict:
        allocator = self.pages.allocator
        return {
            "num_free_pages": allocator.num_free,
            "num_total_pages": allocator.num_pages,
            "page_size": self.pages.page_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "max_model_len": self.max_model_len,
            "weights_bytes": self.runner.memory.weights_bytes,
            "kv_cache_bytes": self.runner.memory.kv_bytes,
            "kv_cache_tokens": self.runner.memory.kv_tokens,
        }


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # we attend fully, which is exact only inside the window
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {limit}")
        limit = config.max_model_len
    return limit


def _load_tokenizer(model_dir):
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        # A config-only folder (dummy weights) can still run on token ids.
        logger.warning("no tokenizer in %s (%s); token ids only", model_dir, exc)
        return None


def _eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
