"""The frontend's side of the pipeline: send requests out, route text deltas back to them."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from frontend.protocol import ApiError
from ipc.messages import (
    Abort,
    GenerateRequest,
    GetStats,
    RequestError,
    StatsReply,
    TextBatch,
    TextDelta,
    ToFrontend,
)
from ipc.sockets import AsyncPullSocket, PushSocket, SocketPaths

logger = logging.getLogger(__name__)


class RequestStream:
    """The deltas of one HTTP request's prompts, each sampled n times, as they arrive.

    Choice `i` of the response is sample `i % n` of prompt `i // n`, as in OpenAI's API.
    """

    def __init__(self, rids: list[str], n: int):
        self.rids = rids
        self.n = n
        self.position = {rid: i for i, rid in enumerate(rids)}
        self.unfinished = dict.fromkeys(rids, n)  # rid -> samples still running
        self.queue: asyncio.Queue[TextDelta | RequestError] = asyncio.Queue()

    @property
    def num_choices(self) -> int:
        return len(self.rids) * self.n

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def choice_index(self, delta: TextDelta) -> int:
        return self.position[delta.rid] * self.n + delta.index

    async def next(self) -> list[TextDelta]:
        """Wait for at least one delta and return all that are queued; raise on an error."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, RequestError):
                self.unfinished.pop(item.rid, None)
                raise ApiError(item.status, item.message, item.param, item.code, item.error_type)
            if item.finish_reason is not None:
                self._finish_one(item.rid)
        return items  # type: ignore[return-value]

    def _finish_one(self, rid: str) -> None:
        left = self.unfinished[rid] - 1
        if left:
            self.unfinished[rid] = left
        else:
            del self.unfinished[rid]


class EngineClient:
    """Owns the frontend's sockets: requests out to the tokenizer workers, aborts and stats
    queries to the scheduler, and text deltas in, routed to their RequestStream."""

    def __init__(self, paths: SocketPaths):
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        # This PUSH binds and the workers' PULLs connect, so ZeroMQ deals requests round-robin.
        self.to_tokenizers = PushSocket(self._ctx, paths.tokenizer, bind=True)
        self.to_scheduler = PushSocket(self._ctx, paths.scheduler)
        self.inbox = AsyncPullSocket(self._actx, paths.frontend, ToFrontend)
        self.streams: dict[str, RequestStream] = {}
        self.worker_counts: Counter[int] = Counter()  # requests finished per tokenizer worker
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()

    def open(self, requests: list[GenerateRequest], n: int) -> RequestStream:
        stream = RequestStream([r.rid for r in requests], n)
        for req in requests:
            self.streams[req.rid] = stream
            self.to_tokenizers.send(req)
        return stream

    def close(self, stream: RequestStream) -> None:
        """Forget the stream; abort what is still running (the client left, or an error)."""
        for rid in stream.rids:
            self.streams.pop(rid, None)
        for rid in stream.unfinished:
            self.to_scheduler.send(Abort(rid))
        stream.unfinished.clear()

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        query_id = next(self._query_ids)
        waiter = self._stats_waiters[query_id] = asyncio.get_running_loop().create_future()
        self.to_scheduler.send(GetStats(query_id))
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._stats_waiters.pop(query_id, None)

    async def receive_forever(self) -> None:
        while True:
            msg = await self.inbox.recv()
            try:
                self._dispatch(msg)
            except Exception:  # a bug here must not silence every other request
                logger.exception("could not dispatch %s", type(msg).__name__)

    def _dispatch(self, msg: ToFrontend) -> None:
        if isinstance(msg, TextBatch):
            for delta in msg.deltas:
                self._route(delta.rid, delta)
                if delta.finish_reason is not None and delta.index == 0:
                    self.worker_counts[delta.tokenizer_worker] += 1
                    logger.debug("%s tokenized by worker %d", delta.rid, delta.tokenizer_worker)
        elif isinstance(msg, RequestError):
            self._route(msg.rid, msg)
        elif isinstance(msg, StatsReply):
            waiter = self._stats_waiters.get(msg.query_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.stats)

    def _route(self, rid: str, item: TextDelta | RequestError) -> None:
        stream = self.streams.get(rid)
        if stream is not None:  # else the client is gone and the request was aborted
            stream.queue.put_nowait(item)
