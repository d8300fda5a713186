"""The scheduler process: the in-process Engine behind a ZeroMQ inbox and outbox.

It only moves messages: requests and aborts in, one TokenBatch out per engine step. All the
scheduling, caching and sampling happen inside `Engine.step()`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import zmq

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import InvalidParameter
from ipc.messages import (
    Abort,
    DetokSetup,
    EngineInfo,
    Finish,
    GetStats,
    RequestError,
    StatsReply,
    TokenBatch,
    TokenizedRequest,
    ToScheduler,
)
from ipc.process import ParentLink, StartupError, one_line
from ipc.sockets import PullSocket, PushSocket, SocketPaths

logger = logging.getLogger(__name__)
_MAX_EARLY_ABORTS = 10_000  # aborts that overtook their request; bounded so it cannot grow


class SchedulerLoop:
    """Feeds the engine from the inbox and sends what each step produced to the detokenizer."""

    def __init__(self, engine: Engine, inbox: PullSocket, outbox: PushSocket):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.remaining: dict[str, int] = {}  # rid -> samples the engine has not finished
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        self.started: list[DetokSetup] = []
        self.num_received = 0  # requests that reached this process, valid or not

    def run_forever(self) -> None:
        while True:
            self.run_once(block=not self.engine.has_unfinished())

    def run_once(self, block: bool) -> None:
        """Take in every waiting message, then run one engine step if there is work."""
        if block:
            self.inbox.poll(None)
        for msg in self.inbox.drain():
            self.handle(msg)
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        for out in outputs:
            if out.finished:
                self._count_finished(out.rid)
        if outputs or self.started:
            self.outbox.send(TokenBatch(outputs, self.started))
            self.started = []

    def handle(self, msg: ToScheduler) -> None:
        if isinstance(msg, TokenizedRequest):
            self._add(msg)
        elif isinstance(msg, (Abort, Finish)):
            self._abort(msg.rid, remember=isinstance(msg, Abort))
        elif isinstance(msg, GetStats):
            stats = {**self.engine.stats(), "requests_received": self.num_received}
            self.outbox.send(StatsReply(msg.query_id, stats))

    def _add(self, req: TokenizedRequest) -> None:
        self.num_received += 1
        if req.rid in self.early_aborts:
            del self.early_aborts[req.rid]
            logger.debug("%s was aborted before it arrived", req.rid)
            return
        try:
            self.engine.add_request(req.rid, req.prompt_token_ids, req.params, req.priority)
        except InvalidParameter as exc:  # the worker checks first; this is the last line
            self.outbox.send(RequestError(rid=req.rid, message=str(exc), param=exc.param, code=exc.code))
            return
        self.remaining[req.rid] = req.params.n
        self.started.append(req.detok)

    def _abort(self, rid: str, remember: bool) -> None:
        if rid in self.remaining:
            self.engine.abort(rid)
        elif remember:
            # The client left while its request was still in a tokenizer worker.
            self.early_aborts[rid] = None
            if len(self.early_aborts) > _MAX_EARLY_ABORTS:
                self.early_aborts.popitem(last=False)

    def _count_finished(self, rid: str) -> None:
        left = self.remaining.get(rid, 0) - 1
        if left > 0:
            self.remaining[rid] = left
        else:
            self.remaining.pop(rid, None)


def engine_info(engine: Engine) -> EngineInfo:
    stats = engine.stats()
    return EngineInfo(
        model_name=engine.model_name,
        model_dir=str(engine.model_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        num_total_pages=stats["num_total_pages"],
        page_size=stats["page_size"],
    )


def run_scheduler(link: ParentLink, config: EngineConfig, paths: SocketPaths) -> None:
    """Process entry: load the model, report ready with its EngineInfo, then serve forever."""
    try:
        engine = Engine(config)
    except Exception as exc:
        raise StartupError(f"could not load the model: {one_line(exc)}") from exc
    ctx = zmq.Context()
    inbox = PullSocket(ctx, paths.scheduler, ToScheduler)
    outbox = PushSocket(ctx, paths.detokenizer)
    link.ready(engine_info(engine))
    logger.info("engine ready: %s, max_model_len %d", engine.model_name, engine.max_model_len)
    SchedulerLoop(engine, inbox, outbox).run_forever()
