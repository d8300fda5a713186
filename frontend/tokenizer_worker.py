"""Tokenizer worker processes: chat template, tokenization and the context-length check.

N of them PULL from the frontend's one PUSH socket, which deals requests out round-robin.
Each forwards good requests to the scheduler and sends rejections straight back to the
frontend, so a bad request never reaches the scheduler.
"""

from __future__ import annotations

import logging

import msgspec
import zmq
from jinja2 import TemplateError

from engine.sampling_params import InvalidParameter
from frontend.tokens import load_tokenizer
from ipc.messages import (
    DetokSetup,
    EngineInfo,
    GenerateRequest,
    RequestError,
    TokenizedRequest,
    ToTokenizer,
)
from ipc.process import ParentLink
from ipc.sockets import PullSocket, PushSocket, SocketPaths

logger = logging.getLogger(__name__)
PROMPT_TAIL = 6  # prompt tokens the detokenizer decodes ahead of the output


class PromptTokenizer:
    """Turns a GenerateRequest into a TokenizedRequest, or raises InvalidParameter."""

    def __init__(self, tokenizer, info: EngineInfo, worker_id: int):
        self.tokenizer = tokenizer
        self.info = info
        self.worker_id = worker_id
        # The longest sequence that can ever run: the context, and the whole KV pool.
        self.max_total = min(info.max_model_len, info.num_total_pages * info.page_size)

    def __call__(self, req: GenerateRequest) -> TokenizedRequest:
        ids = self._prompt_ids(req)
        params = msgspec.structs.replace(req.params, max_tokens=self._max_tokens(req, len(ids)))
        params.validate()  # max_tokens may have changed: min_tokens must still fit
        echo = None
        if req.echo:
            echo = req.prompt if req.prompt is not None else self.tokenizer.decode(ids)
        detok = DetokSetup(
            rid=req.rid,
            n=params.n,
            stop=params.stop,
            prompt_tail=ids[-PROMPT_TAIL:],
            skip_special_tokens=req.skip_special_tokens,
            logprobs=params.logprobs is not None,
            echo_text=echo,
            tokenizer_worker=self.worker_id,
        )
        return TokenizedRequest(rid=req.rid, prompt_token_ids=ids, params=params, priority=req.priority, detok=detok)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            ids = self._chat_ids(req)
        elif req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt)
        else:
            ids = list(req.prompt_token_ids or [])
            if any(not 0 <= t < self.info.vocab_size for t in ids):
                raise InvalidParameter("prompt", f"token ids must be in [0, {self.info.vocab_size})")
        if not ids:
            raise InvalidParameter("prompt", "must not be empty")
        return ids

    def _chat_ids(self, req: GenerateRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in req.messages or []]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError) as exc:  # e.g. roles out of order, or no template
            raise InvalidParameter("messages", f"could not apply the chat template: {exc}") from exc
        # The template already wrote any BOS it wants.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _max_tokens(self, req: GenerateRequest, num_prompt: int) -> int:
        """The requested max_tokens, or the rest of the context; both must fit."""
        field = "messages" if req.messages is not None else "prompt"
        room = self.max_total - num_prompt
        if req.max_tokens is None:
            if room < 1:
                raise _too_long(field, num_prompt, 1, self.max_total)
            return room
        if req.max_tokens > room:
            raise _too_long(field if room < 1 else "max_tokens", num_prompt, req.max_tokens, self.max_total)
        return req.max_tokens


def _too_long(param: str, num_prompt: int, max_tokens: int, limit: int) -> InvalidParameter:
    return InvalidParameter(
        param,
        f"is too long: this model's maximum context length is {limit} tokens, but the request "
        f"has {num_prompt} prompt tokens and asks for {max_tokens} more "
        f"({num_prompt + max_tokens} in all). Shorten the prompt or lower max_tokens.",
        code="context_length_exceeded",
    )


def run_tokenizer_worker(link: ParentLink, worker_id: int, paths: SocketPaths) -> None:
    """Process entry: wait for the model folder, load the tokenizer, then serve forever."""
    info = link.wait_message(EngineInfo)
    prepare = PromptTokenizer(load_tokenizer(info.model_dir), info, worker_id)
    ctx = zmq.Context()
    inbox = PullSocket(ctx, paths.tokenizer, ToTokenizer, bind=False)
    to_scheduler = PushSocket(ctx, paths.scheduler)
    to_frontend = PushSocket(ctx, paths.frontend)
    link.ready()
    while True:
        req = inbox.recv()
        try:
            to_scheduler.send(prepare(req))
        except InvalidParameter as exc:
            to_frontend.send(RequestError(rid=req.rid, message=str(exc), param=exc.param, code=exc.code))
        except Exception as exc:  # a tokenizer bug must fail this request, not the worker
            logger.exception("tokenizing %s failed", req.rid)
            to_frontend.send(RequestError(rid=req.rid, message=f"tokenization failed: {exc}", status=500, error_type="server_error"))
