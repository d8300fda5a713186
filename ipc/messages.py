"""Every message that crosses a process boundary, as msgspec Structs.

Each socket carries one tagged union (the `To*` aliases at the bottom), so a receiver decodes
straight into the right type and dispatches on it with `isinstance`.

Token ids travel as plain `list[int]`: msgpack writes each id as a 1-3 byte varint, which
measured both smaller and faster to round-trip than `array('i')` bytes for 100-8000 ids
(the engine wants a list at the end, and building one from an array dominates).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# ---------------------------------------------------------------- launcher <-> child pipes


class EngineInfo(msgspec.Struct, tag=True, frozen=True):
    """What the scheduler learned while loading the model; the other processes need it."""

    model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_total_pages: int
    page_size: int


class ProcessReady(msgspec.Struct, tag=True):
    """A child finished its set-up; the scheduler attaches its EngineInfo."""

    name: str
    pid: int
    info: EngineInfo | None = None


class ProcessFailed(msgspec.Struct, tag=True):
    """A child could not start; `error` is one line meant for the operator."""

    name: str
    error: str


class Drain(msgspec.Struct, tag=True):
    """Launcher -> frontend: stop taking requests, finish the in-flight ones, then exit."""

    timeout: float


ToLauncher = ProcessReady | ProcessFailed
ToChild = EngineInfo | Drain

# ---------------------------------------------------------------- request path


class ChatMessage(msgspec.Struct, array_like=True):
    """One chat turn with its text content (content parts already joined)."""

    role: str
    content: str


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    """Frontend -> tokenizer worker: one prompt, validated but not yet tokenized.

    Exactly one of `prompt`, `prompt_token_ids` and `messages` is set. `max_tokens` None means
    "the rest of the context", which only the worker can compute; it overrides
    `params.max_tokens`.
    """

    rid: str
    params: SamplingParams
    max_tokens: int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: int = 0
    echo: bool = False
    skip_special_tokens: bool = True


class DetokSetup(msgspec.Struct, kw_only=True):
    """Per-request settings for the detokenizer; the scheduler passes it along unopened.

    Routing it through the scheduler guarantees it reaches the detokenizer before the
    request's first tokens, since both travel on the scheduler -> detokenizer socket.
    """

    rid: str
    n: int = 1
    stop: tuple[str, ...] = ()
    prompt_tail: list[int] = []  # last prompt tokens: context so the first word decodes right
    skip_special_tokens: bool = True
    logprobs: bool = False
    echo_text: str | None = None
    tokenizer_worker: int = -1


class TokenizedRequest(msgspec.Struct, tag=True, kw_only=True):
    """Tokenizer worker -> scheduler: a request ready for `Engine.add_request`."""

    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    detok: DetokSetup


class Abort(msgspec.Struct, tag=True):
    """Frontend -> scheduler: the client went away; drop the request and free its pages."""

    rid: str


class Finish(msgspec.Struct, tag=True):
    """Detokenizer -> scheduler: a stop string matched, so stop computing this request."""

    rid: str


class GetStats(msgspec.Struct, tag=True):
    """Frontend -> scheduler: ask for `Engine.stats()`; answered by a StatsReply."""

    query_id: int


class StatsReply(msgspec.Struct, tag=True):
    """Scheduler -> detokenizer -> frontend: the engine's counters at one moment."""

    query_id: int
    stats: dict[str, Any]


class RequestError(msgspec.Struct, tag=True, kw_only=True):
    """A request failed before generating; the frontend turns it into an OpenAI error."""

    rid: str
    message: str
    status: int = 400
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class TokenBatch(msgspec.Struct, tag=True):
    """Scheduler -> detokenizer: everything one engine step produced.

    `started` holds the setups of requests admitted since the previous batch; the
    detokenizer registers them before it reads `outputs`.
    """

    outputs: list[RequestOutput]
    started: list[DetokSetup] = []


# ---------------------------------------------------------------- text path


class TopLogprob(msgspec.Struct, array_like=True):
    """One alternative token at a position, as text."""

    token: str
    logprob: float
    token_bytes: bytes  # the raw bytes; `token` may show a partial character as U+FFFD


class TextLogprob(msgspec.Struct, array_like=True):
    """The sampled token at one position, as text, with its top alternatives."""

    token: str
    logprob: float
    token_bytes: bytes  # the raw bytes; `token` may show a partial character as U+FFFD
    top: list[TopLogprob]


class Usage(msgspec.Struct, array_like=True):
    """Token counts for one sample, sent with its last delta."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TextDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New text of one sample; the last one carries finish_reason and usage."""

    rid: str
    index: int = 0
    text: str = ""
    logprobs: list[TextLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    tokenizer_worker: int = -1  # set on the last delta: which worker tokenized the request


class TextBatch(msgspec.Struct, tag=True):
    """Detokenizer -> frontend: the deltas of one engine step, in one message."""

    deltas: list[TextDelta]


ToTokenizer = GenerateRequest
ToScheduler = TokenizedRequest | Abort | Finish | GetStats
ToDetokenizer = TokenBatch | RequestError | StatsReply
ToFrontend = TextBatch | RequestError | StatsReply
