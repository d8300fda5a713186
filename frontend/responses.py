"""OpenAI response bodies and SSE chunks, built from TextDeltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ipc.messages import TextDelta, TextLogprob

_json = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """Everything one choice has received so far."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # characters already streamed, for completions' text_offset

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass
class UsageCounter:
    """Token counts over all prompts and samples of one HTTP request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _counted_prompts: set[str] = field(default_factory=set)

    def add(self, delta: TextDelta) -> None:
        usage = delta.usage
        if usage is None:
            return
        self.completion_tokens += usage.completion_tokens
        if delta.rid not in self._counted_prompts:  # n samples share one prompt
            self._counted_prompts.add(delta.rid)
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Formatter:
    """Builds the bodies of one response (chat or completion), sharing id, created and model."""

    kind: str  # "chat" | "completion"
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # ---- streaming

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chunk of a chat choice: the role, as OpenAI sends it."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        logprobs = self._logprobs(choice, delta.text, delta.logprobs) if delta.logprobs else None
        if self.kind == "chat":
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            body = {"index": choice.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [body]}
        body = {"index": choice.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        return {**self._head("text_completion"), "choices": [body]}

    def usage_chunk(self, usage: UsageCounter) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage.body()}

    # ---- whole responses

    def full(self, choices: list[Choice], usage: UsageCounter) -> dict[str, Any]:
        if self.kind == "chat":
            bodies = [self._chat_choice(c) for c in choices]
            return {**self._head("chat.completion"), "choices": bodies, "usage": usage.body()}
        bodies = [self._completion_choice(c) for c in choices]
        return {**self._head("text_completion"), "choices": bodies, "usage": usage.body()}

    def _chat_choice(self, c: Choice) -> dict[str, Any]:
        logprobs = {"content": [_chat_logprob(lp) for lp in c.logprobs]} if c.logprobs else None
        message = {"role": "assistant", "content": c.text}
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _completion_choice(self, c: Choice) -> dict[str, Any]:
        logprobs = _completion_logprobs(c.logprobs, 0) if c.logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _logprobs(self, choice: Choice, text: str, entries: list[TextLogprob]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [_chat_logprob(lp) for lp in entries]}
        body = _completion_logprobs(entries, choice.text_offset)
        choice.text_offset += len(text)
        return body


def _chat_logprob(lp: TextLogprob) -> dict[str, Any]:
    top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in lp.top]
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes), "top_logprobs": top}


def _completion_logprobs(entries: list[TextLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in entries:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in entries],
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in entries],
        "text_offset": offsets,
    }
