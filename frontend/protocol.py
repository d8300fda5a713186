"""OpenAI request bodies: typed parsing and validation into GenerateRequests.

msgspec checks the JSON types against the Structs below; the functions after them check
values and cross-field rules. Every problem becomes an ApiError that names the parameter,
so a bad request is answered here and never reaches the tokenizer or the scheduler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.sampling_params import InvalidParameter, SamplingParams
from ipc.messages import ChatMessage, GenerateRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_N = 128
MAX_PROMPTS = 256


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request bodies
# Optional fields are `X | None = None` because clients send null for "not given".


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions, vLLM extensions included."""

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as the issue asks
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    skip_special_tokens: bool | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # also a list of strings, token ids, or lists of token ids
    logprobs: int | None = None
    echo: bool | None = None


# ---------------------------------------------------------------- parsed plan


@dataclass
class Plan:
    """One HTTP request as the server runs it: prompts (each sampled n times) and output options."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[GenerateRequest]  # rid still empty; the server assigns them
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool = False


_DECODERS = {
    "chat": msgspec.json.Decoder(ChatCompletionRequest),
    "completion": msgspec.json.Decoder(CompletionRequest),
}


def decode_body(kind: str, body: bytes) -> Any:
    """JSON -> request Struct; type errors name the offending parameter."""
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"Malformed JSON body: {exc}") from None


def _validation_error(text: str) -> ApiError:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`"
    # or "Object missing required field `messages`".
    at = re.search(r" - at `\$\.?(.*)`$", text)
    if at:
        param = at.group(1) or None
        return ApiError(400, f"Invalid type for '{param}': {text[: at.start()]}", param)
    missing = re.search(r"required field `(\w+)`", text)
    return ApiError(400, f"Invalid request: {text}", missing.group(1) if missing else None)


def parse_chat(body: bytes, models: ModelNames) -> Plan:
    req: ChatCompletionRequest = decode_body("chat", body)
    model = models.check(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_params(req, max_tokens, logprobs)
    prompt = GenerateRequest(rid="", params=params, max_tokens=max_tokens, messages=_messages(req.messages),
                             priority=req.priority or 0, skip_special_tokens=_skip_special(req))
    return Plan("chat", model, [prompt], params.n, bool(req.stream), _include_usage(req), req.logprobs or False)


def parse_completion(body: bytes, models: ModelNames) -> Plan:
    req: CompletionRequest = decode_body("completion", body)
    model = models.check(req.model)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default here
    params = _sampling_params(req, max_tokens, req.logprobs)
    prompts = []
    for prompt in _prompts(req.prompt):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        prompts.append(GenerateRequest(rid="", params=params, max_tokens=max_tokens, prompt=text,
                                       prompt_token_ids=ids, priority=req.priority or 0,
                                       echo=bool(req.echo), skip_special_tokens=_skip_special(req)))
    return Plan("completion", model, prompts, params.n, bool(req.stream), _include_usage(req),
                req.logprobs is not None, echo=bool(req.echo))


class ModelNames:
    """The names this server answers to; the first is the one it reports."""

    def __init__(self, names: list[str]):
        self.names = names

    @property
    def primary(self) -> str:
        return self.names[0]

    def check(self, requested: str | None) -> str:
        if requested is None or requested in self.names:
            return self.primary
        raise ApiError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")


# ---------------------------------------------------------------- field checks


def _sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = _stop_strings(req.stop)
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise ApiError(400, f"n must be at most {MAX_N}, got {n}", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    min_tokens = req.min_tokens or 0
    params = SamplingParams(
        # The worker fills in "the rest of the context"; check the rest with a stand-in.
        max_tokens=max(min_tokens, 1) if max_tokens is None else max_tokens,
        min_tokens=min_tokens,
        temperature=_default(req.temperature, 1.0),
        top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, -1),
        min_p=_default(req.min_p, 0.0),
        presence_penalty=_default(req.presence_penalty, 0.0),
        frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        n=n,
        seed=req.seed,
    )
    try:
        params.validate()
    except InvalidParameter as exc:
        raise ApiError(400, str(exc), exc.param, exc.code) from None
    return params


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", "stop")
    return tuple(stops)


def _include_usage(req: _Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _skip_special(req: _Common) -> bool:
    return req.skip_special_tokens is not False


def _messages(messages: list[Message]) -> list[ChatMessage]:
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise ApiError(400, f"unknown role '{msg.role}'; expected one of {sorted(ROLES)}",
                           f"messages[{i}].role")
        out.append(ChatMessage(msg.role, _content_text(msg.content, i)))
    return out


def _content_text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"only text content parts are supported, got '{part.type}'",
                           f"messages[{i}].content")
        texts.append(part.text)
    return "".join(texts)


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion prompt in any of its four shapes, as a list of texts or token-id lists."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(_is_token(t) for t in prompt):
        prompts = [prompt]  # one prompt given as token ids
    else:
        prompts = prompt
    if not prompts:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    all_text = all(isinstance(p, str) for p in prompts)
    all_ids = all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompts)
    if not (all_text or all_ids):
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, "
                       "or a list of lists of token ids", "prompt")
    if any(not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", "prompt")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
