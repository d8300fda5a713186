"""One stream of tokens being generated: its ids, its KV progress and its pages."""

from __future__ import annotations

import itertools
from enum import Enum

from engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt and the tokens sampled after it, for one of a request's n samples.

    The state is the token ids, how many of them have KV in the pool (`num_computed`), and
    the page table; every other number is derived from those.
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int],
        index: int = 0,
        priority: int = 0,
        parent: Sequence | None = None,
    ):
        self.rid = rid
        self.index = index
        self.params = params
        self.stop_ids = stop_ids
        self.priority = priority
        self.parent = parent  # the sample whose prompt KV this one may share (n > 1)
        self.arrival = next(_arrival_counter)  # total order for FCFS, even within one clock tick
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed = 0
        self.page_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None

    def __repr__(self) -> str:
        return f"Sequence({self.rid}#{self.index}, {self.num_computed}/{self.num_tokens}, {self.status.value})"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still without KV: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the latest token, or None to keep going."""
        last = self.token_ids[-1]
        if last in self.stop_ids and self.num_output_tokens >= self.params.min_tokens:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
