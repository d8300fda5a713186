"""Continuous batching: decide which sequences run in the next forward pass, and how far."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import PageTableManager
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits."""

    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass
class ScheduledSeq:
    """A sequence and how many of its uncomputed tokens run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Only a chunk that reaches the end of the known tokens yields a new token."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    """FCFS continuous batching with chunked prefill under a per-step token budget.

    Running sequences are served first (decodes and unfinished prefill chunks), then waiting
    ones are admitted while the budget, the sequence cap and free pages allow. If a running
    sequence cannot get a page, the newest running sequence is preempted and will recompute.
    """

    def __init__(self, config: SchedulerConfig, pages: PageTableManager):
        self.config = config
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, seq.num_computed + num_new):
                continue
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        # A sequence scheduled early in the loop may have been preempted by a later one.
        batch = [item for item in batch if item.seq.status is SeqStatus.RUNNING]
        return batch + self._admit(budget)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Find pages for `seq`, preempting newer sequences; False if `seq` itself went."""
        while not self.pages.can_grow(seq, num_tokens):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
        self.pages.grow(seq, num_tokens)
        return True

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._try_share_parent_prompt(seq):
                break
            # Admit only when the whole prompt fits, so a fresh prompt rarely forces preemption.
            if self.pages.missing_pages(seq, seq.num_tokens) > self.pages.allocator.num_free:
                break
            num_new = min(seq.num_uncomputed, budget)
            self.pages.grow(seq, seq.num_computed + num_new)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return admitted

    def _try_share_parent_prompt(self, seq: Sequence) -> bool:
        """Parallel samples reuse their first sibling's prompt KV; wait while it is prefilling.

        The shared part stops one token short of the prompt, so the sample computes the last
        prompt token itself and gets its own logits to sample from.
        """
        parent = seq.parent
        if parent is None or seq.num_computed > 0:
            return True
        shared = seq.num_prompt_tokens - 1
        if parent.status is SeqStatus.WAITING:
            return False
        if parent.status is SeqStatus.RUNNING and parent.num_computed < shared:
            return False
        if parent.status is SeqStatus.RUNNING and shared > 0:
            self.pages.share_prefix(seq, parent, shared)
        seq.parent = None
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it rejoins the queue front and recomputes prompt + output."""
        self.pages.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence at once and return its pages."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.pages.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def find(self, rid: str) -> list[Sequence]:
        return [s for s in (*self.running, *self.waiting) if s.rid == rid]
