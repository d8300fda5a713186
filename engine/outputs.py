"""What the engine hands back after each step."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's logprob and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class RequestOutput(msgspec.Struct, kw_only=True):
    """New tokens of one sequence from one engine step.

    `index` tells parallel samples (n > 1) of the same request apart.
    """

    rid: str
    index: int = 0
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
