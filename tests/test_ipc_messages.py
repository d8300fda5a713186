"""Message types round-trip through msgpack; sockets carry them between real ZeroMQ ends."""

from __future__ import annotations

import os
import stat
import time

import msgspec
import pytest
import zmq

from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from ipc.messages import (
    Abort,
    ChatMessage,
    DetokSetup,
    Drain,
    EngineInfo,
    Finish,
    GenerateRequest,
    GetStats,
    ProcessFailed,
    ProcessReady,
    RequestError,
    StatsReply,
    TextBatch,
    TextDelta,
    TextLogprob,
    ToChild,
    ToDetokenizer,
    ToFrontend,
    TokenBatch,
    TokenizedRequest,
    ToLauncher,
    TopLogprob,
    ToScheduler,
    ToTokenizer,
    Usage,
)
from ipc.sockets import PullSocket, PushSocket, SocketPaths

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, stop=("\n\n", "END"), n=2, seed=3, logprobs=1)
INFO = EngineInfo("m", "/tmp/m", 2048, 49152, [2], 100, 16)
SETUP = DetokSetup(rid="r1", n=2, stop=("END",), prompt_tail=[1, 2], echo_text="hi", tokenizer_worker=1)

EXAMPLES = [
    (ToLauncher, ProcessReady("scheduler", 123, INFO)),
    (ToLauncher, ProcessReady("frontend", 124)),
    (ToLauncher, ProcessFailed("scheduler", "no such model")),
    (ToChild, INFO),
    (ToChild, Drain(2.5)),
    (ToTokenizer, GenerateRequest(rid="r1", params=PARAMS, prompt="hello")),
    (ToTokenizer, GenerateRequest(rid="r2", params=PARAMS, prompt_token_ids=[1, 2, 49151], echo=True)),
    (ToTokenizer, GenerateRequest(rid="r3", params=PARAMS, max_tokens=None, priority=-2,
                                  messages=[ChatMessage("user", "héllo 😀")])),
    (ToScheduler, TokenizedRequest(rid="r1", prompt_token_ids=list(range(5000)), params=PARAMS, detok=SETUP)),
    (ToScheduler, Abort("r1")),
    (ToScheduler, Finish("r1")),
    (ToScheduler, GetStats(7)),
    (ToDetokenizer, TokenBatch(
        [RequestOutput(rid="r1", index=1, new_token_ids=[5], finished=True, finish_reason="stop",
                       logprobs=[TokenLogprob(5, -0.1, [(5, -0.1), (6, -2.0)])], num_prompt_tokens=3,
                       num_output_tokens=4)],
        [SETUP],
    )),
    (ToDetokenizer, RequestError(rid="r1", message="too long", param="messages", code="context_length_exceeded")),
    (ToDetokenizer, StatsReply(7, {"num_free_pages": 10, "num_total_pages": 12})),
    (ToFrontend, TextBatch([
        TextDelta(rid="r1", text="😀"),
        TextDelta(rid="r1", index=1, text="", finish_reason="length", usage=Usage(3, 4, 1), tokenizer_worker=1,
                  logprobs=[TextLogprob("a", -0.5, b"a", [TopLogprob("b", -1.0, b"\xf0\x9f")])]),
    ])),
    (ToFrontend, RequestError(rid="r2", message="boom", status=500, error_type="server_error")),
]


@pytest.mark.parametrize("union,msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(union, msg):
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=union)
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_union_rejects_message_meant_for_another_socket():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(Abort("r")), type=ToFrontend)


def test_token_ids_travel_compactly():
    # 5000 ids below 65536 take at most 3 bytes each as msgpack ints.
    msg = TokenizedRequest(rid="r", prompt_token_ids=[60000] * 5000, params=SamplingParams(), detok=DetokSetup(rid="r"))
    assert len(msgspec.msgpack.encode(msg)) < 5000 * 3 + 500


def test_text_delta_omits_defaults():
    small = msgspec.msgpack.encode(TextDelta(rid="abc", text="x"))
    assert len(small) < 20


@pytest.fixture
def paths():
    p = SocketPaths.create()
    yield p
    p.remove()


def test_push_pull_over_ipc(paths):
    ctx = zmq.Context()
    pull = PullSocket(ctx, paths.scheduler, ToScheduler)
    push_a = PushSocket(ctx, paths.scheduler)
    push_b = PushSocket(ctx, paths.scheduler)
    try:
        assert pull.recv_nowait() is None
        push_a.send(Abort("a"))
        push_b.send(GetStats(1))
        assert pull.poll(2000)
        got = [pull.recv()]
        assert pull.poll(2000)
        got += pull.drain()
        assert sorted(map(repr, got)) == sorted(map(repr, [Abort("a"), GetStats(1)]))
    finally:
        for s in (pull, push_a, push_b):
            s.close()
        ctx.term()


def test_push_bind_deals_round_robin(paths):
    ctx = zmq.Context()
    push = PushSocket(ctx, paths.tokenizer, bind=True)
    pulls = [PullSocket(ctx, paths.tokenizer, ToTokenizer, bind=False) for _ in range(2)]
    try:
        time.sleep(0.2)  # let both connections finish their handshake
        for i in range(6):
            push.send(GenerateRequest(rid=str(i), params=SamplingParams(), prompt="x"))
        counts = []
        for pull in pulls:
            n = 0
            while pull.poll(500):
                pull.recv()
                n += 1
            counts.append(n)
        assert counts == [3, 3]
    finally:
        for s in (push, *pulls):
            s.close()
        ctx.term()


def test_socket_folder_is_private_and_removed():
    paths = SocketPaths.create()
    assert stat.S_IMODE(os.stat(paths.folder).st_mode) == 0o700
    assert paths.scheduler.startswith("ipc://" + paths.folder)
    paths.remove()
    assert not os.path.exists(paths.folder)
