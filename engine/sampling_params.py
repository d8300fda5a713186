"""Per-request generation settings, validated before any compute."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens and when to stop, with vLLM's field names and defaults.

    A msgspec Struct so that it travels between processes unchanged.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; matched on text by the detokenizer
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    n: int = 1
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be positive, got {self.repetition_penalty}",
        )
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"must be in [0, 20], got {self.logprobs}",
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative")


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it for OpenAI-style errors."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(f"{param} {message}")
        self.param = param
        self.code = code


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
