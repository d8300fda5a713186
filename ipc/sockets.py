"""ZeroMQ PUSH/PULL sockets that send and receive msgspec messages over `ipc://` paths.

Each pipe has one PULL end that binds a path and any number of PUSH ends that connect to
it, except the frontend -> tokenizer pipe, where one PUSH binds and N worker PULLs connect,
so ZeroMQ deals the requests out round-robin.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import msgspec
import msgspec.msgpack
import zmq
import zmq.asyncio

_ENCODER = msgspec.msgpack.Encoder()


class SocketPaths(msgspec.Struct, frozen=True):
    """The private folder of one launch and the address of each pipe inside it."""

    folder: str

    @classmethod
    def create(cls) -> SocketPaths:
        """Make a fresh folder only this user can read, so two servers never cross."""
        return cls(tempfile.mkdtemp(prefix="sluice-"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _addr(self, name: str) -> str:
        return "ipc://" + os.path.join(self.folder, name)

    @property
    def tokenizer(self) -> str:
        return self._addr("tokenizer")

    @property
    def scheduler(self) -> str:
        return self._addr("scheduler")

    @property
    def detokenizer(self) -> str:
        return self._addr("detokenizer")

    @property
    def frontend(self) -> str:
        return self._addr("frontend")


def _setup(sock: zmq.Socket, addr: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # at shutdown nobody is left to read what is queued
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst: the queue is the backlog
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)


class PushSocket:
    """The sending end of a pipe; `send` never blocks."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False):
        self.sock = ctx.socket(zmq.PUSH)
        _setup(self.sock, addr, bind)

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(_ENCODER.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close()


class PullSocket:
    """The receiving end of a pipe, decoding into one message union."""

    def __init__(self, ctx: zmq.Context, addr: str, msg_type: Any, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        self.decoder = msgspec.msgpack.Decoder(msg_type)
        _setup(self.sock, addr, bind)

    def recv(self) -> Any:
        """Wait for the next message."""
        return self.decoder.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self) -> Any | None:
        """The next message if one is queued, else None."""
        try:
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self.decoder.decode(frame.buffer)

    def drain(self) -> list[Any]:
        """Every message queued right now."""
        out = []
        while (msg := self.recv_nowait()) is not None:
            out.append(msg)
        return out

    def poll(self, timeout_ms: int | None = None) -> bool:
        """True once a message is waiting; None waits forever."""
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self.sock.close()


class AsyncPullSocket:
    """PullSocket for an asyncio event loop (the frontend)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, msg_type: Any, bind: bool = True):
        self.sock = ctx.socket(zmq.PULL)
        self.decoder = msgspec.msgpack.Decoder(msg_type)
        _setup(self.sock, addr, bind)

    async def recv(self) -> Any:
        frame = await self.sock.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close()
