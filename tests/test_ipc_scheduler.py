"""The scheduler process loop around a real (tiny, random) Engine, with in-memory pipes."""

from __future__ import annotations

import pytest
from helpers import build_tiny_model

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from ipc.messages import (
    Abort,
    DetokSetup,
    Finish,
    GetStats,
    RequestError,
    StatsReply,
    TokenBatch,
    TokenizedRequest,
)
from ipc.scheduler_process import SchedulerLoop, engine_info


class Inbox:
    """Stands in for the PULL socket: a list the test fills."""

    def __init__(self):
        self.queue = []

    def poll(self, timeout_ms=None) -> bool:
        return bool(self.queue)

    def drain(self):
        out, self.queue = self.queue, []
        return out


class Outbox:
    """Stands in for the PUSH socket: records what was sent."""

    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model("llama", folder)
    return Engine(EngineConfig(model=str(folder), page_size=4, kv_cache_memory=2**20))


@pytest.fixture
def loop(engine):
    yield SchedulerLoop(engine, Inbox(), Outbox())
    assert not engine.has_unfinished()
    assert engine.stats()["num_free_pages"] == engine.stats()["num_total_pages"]


def request(rid: str, max_tokens: int = 3, n: int = 1, prompt=(5, 6, 7)) -> TokenizedRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
    return TokenizedRequest(rid=rid, prompt_token_ids=list(prompt), params=params, detok=DetokSetup(rid=rid, n=n))


def run_until_idle(loop: SchedulerLoop, limit: int = 50) -> list:
    for _ in range(limit):
        loop.run_once(block=False)
        if not loop.engine.has_unfinished():
            break
    return loop.outbox.sent


def outputs(sent: list) -> list:
    return [o for msg in sent if isinstance(msg, TokenBatch) for o in msg.outputs]


def test_request_runs_and_setup_comes_first(loop):
    loop.inbox.queue = [request("a", max_tokens=3, n=2)]
    sent = run_until_idle(loop)
    first = sent[0]
    assert isinstance(first, TokenBatch) and [s.rid for s in first.started] == ["a"]
    outs = outputs(sent)
    assert [sum(len(o.new_token_ids) for o in outs if o.index == i) for i in (0, 1)] == [3, 3]
    assert sum(o.finished for o in outs) == 2
    assert loop.remaining == {}


def test_abort_frees_the_request_in_one_step(loop):
    loop.inbox.queue = [request("a", max_tokens=40)]
    loop.run_once(block=False)
    loop.run_once(block=False)
    loop.inbox.queue = [Abort("a")]
    loop.run_once(block=False)
    last = outputs(loop.outbox.sent)[-1]
    assert last.finished and last.finish_reason == "abort"
    assert not loop.engine.has_unfinished() and loop.remaining == {}


def test_abort_that_overtakes_its_request(loop):
    loop.inbox.queue = [Abort("early")]
    loop.run_once(block=False)
    loop.inbox.queue = [request("early")]
    loop.run_once(block=False)
    assert loop.outbox.sent == []  # never started, nothing to report
    assert "early" not in loop.early_aborts


def test_finish_for_an_unknown_request_is_ignored(loop):
    loop.inbox.queue = [Finish("nobody")]
    loop.run_once(block=False)
    assert loop.outbox.sent == [] and "nobody" not in loop.early_aborts


def test_engine_rejection_becomes_a_request_error(loop):
    loop.inbox.queue = [request("big", max_tokens=10_000), request("bad", prompt=(10_000,))]
    loop.run_once(block=False)
    errors = [m for m in loop.outbox.sent if isinstance(m, RequestError)]
    assert [(e.rid, e.param) for e in errors] == [("big", "max_tokens"), ("bad", "prompt")]
    assert errors[0].code == "context_length_exceeded"


def test_stats_reply(loop):
    loop.inbox.queue = [GetStats(3)]
    loop.run_once(block=False)
    (reply,) = loop.outbox.sent
    assert isinstance(reply, StatsReply) and reply.query_id == 3
    assert reply.stats["num_free_pages"] == reply.stats["num_total_pages"]
    assert reply.stats["requests_received"] == loop.num_received == 0


def test_engine_info(engine):
    info = engine_info(engine)
    assert info.max_model_len == engine.max_model_len and info.vocab_size == 128
    assert (info.page_size, info.num_total_pages) == (4, engine.stats()["num_total_pages"])
