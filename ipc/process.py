"""Start, watch and stop the server's child processes, with a readiness handshake.

The launcher keeps one multiprocessing Pipe per child. Over it the child reports
ProcessReady or ProcessFailed, and the launcher sends EngineInfo and Drain. The pipe also
tells a child that the launcher is gone (EOF), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from ipc.messages import ProcessFailed, ProcessReady, ToChild, ToLauncher

logger = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_to_child = msgspec.msgpack.Decoder(ToChild)
_to_launcher = msgspec.msgpack.Decoder(ToLauncher)


def setup_logging(name: str, level: str) -> None:
    """One format for every process, naming the process in each line."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        force=True,
    )


class StartupError(Exception):
    """A child cannot start for a reason the operator can fix; the message says which."""


def one_line(exc: BaseException) -> str:
    """An exception as one readable line for the operator."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    plain = isinstance(exc, (StartupError, ValueError, OSError))
    return text if plain else f"{type(exc).__name__}: {text}"


class ParentLink:
    """The child's end of the launcher pipe.

    A daemon thread owns the reading side: it queues each control message for
    `wait_message` (or hands it to a handler) and exits the process when the launcher
    disappears.
    """

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self._inbox: list[Any] = []
        self._cond = threading.Condition()
        self._handler: Callable[[Any], None] | None = None  # None: queue for wait_message
        threading.Thread(target=self._watch, name="parent-link", daemon=True).start()

    def ready(self, info: msgspec.Struct | None = None) -> None:
        self.conn.send_bytes(_encoder.encode(ProcessReady(self.name, os.getpid(), info)))

    def failed(self, error: str) -> None:
        self.conn.send_bytes(_encoder.encode(ProcessFailed(self.name, error)))

    def wait_message(self, msg_type: type) -> Any:
        """Block until the launcher sends a message of `msg_type` (others are dropped)."""
        with self._cond:
            while True:
                while self._inbox:
                    msg = self._inbox.pop(0)
                    if isinstance(msg, msg_type):
                        return msg
                self._cond.wait()

    def set_handler(self, handler: Callable[[Any], None]) -> None:
        """Deliver control messages to `handler` (on the link's thread) from now on,
        starting with any that arrived before it was set."""
        with self._cond:  # held while replaying, so a new message cannot overtake the queued
            self._handler = handler
            queued, self._inbox = self._inbox, []
            for msg in queued:
                handler(msg)

    def _deliver(self, msg: Any) -> None:
        with self._cond:
            handler = self._handler
            if handler is None:
                self._inbox.append(msg)
                self._cond.notify_all()
                return
        handler(msg)

    def _watch(self) -> None:
        try:
            while True:
                self._deliver(_to_child.decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            # The launcher is gone (even SIGKILLed): nobody will ever stop us, so stop now.
            logging.getLogger(self.name).warning("launcher went away; exiting")
            os._exit(1)


def _child_main(target: str, name: str, conn: Connection, log_level: str, args: tuple) -> None:
    """Entry point of every child: logging, signals, failure reporting, then `target`."""
    # Ctrl+C reaches the whole process group; only the launcher decides what happens next.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(name, log_level)
    link = ParentLink(conn, name)
    try:
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(link, *args)
    except Exception as exc:  # report why, in one line, then die: the launcher stops the rest
        logging.getLogger(name).debug("failed:\n%s", traceback.format_exc())
        link.failed(one_line(exc))
        sys.exit(1)


@dataclass
class Child:
    """One started process and the launcher's end of its pipe."""

    name: str
    process: BaseProcess
    conn: Connection
    ready: ProcessReady | None = None


class ChildFailed(RuntimeError):
    """A child reported an error or exited; the message says which and why."""


def _exited(child: Child) -> str:
    code = child.process.exitcode
    if code is not None and code < 0:
        return f"{child.name} exited, killed by {signal.Signals(-code).name}"
    return f"{child.name} exited with code {code}"


class ProcessGroup:
    """The launcher's view of its children: start, await readiness, watch, stop."""

    def __init__(self, log_level: str = "info"):
        self.log_level = log_level
        self.ctx = multiprocessing.get_context("spawn")
        self.children: dict[str, Child] = {}

    def start(self, name: str, target: str, *args: Any) -> Child:
        """Spawn `target` ("module:function", called as function(link, *args)) as `name`.

        The target is named, not passed, so the launcher never imports torch itself.
        """
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_child_main, args=(target, name, theirs, self.log_level, args), name=name
        )
        proc.start()
        theirs.close()
        logger.info("started %s (pid %d)", name, proc.pid)
        child = self.children[name] = Child(name, proc, mine)
        return child

    def send(self, name: str, msg: msgspec.Struct) -> None:
        try:
            self.children[name].conn.send_bytes(_encoder.encode(msg))
        except OSError as exc:
            raise ChildFailed(f"{name} is gone ({exc})") from exc

    def wait_ready(self, names: list[str], timeout: float | None, should_stop: Callable[[], bool]) -> bool:
        """Wait until every child in `names` is ready; False if `should_stop` became true.

        Raises ChildFailed as soon as any child (listed or not) fails or exits.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(self.children[n].ready for n in names):
            if should_stop():
                return False
            if deadline is not None and time.monotonic() > deadline:
                waiting = [n for n in names if not self.children[n].ready]
                raise ChildFailed(f"timed out waiting for {', '.join(waiting)} to start")
            self._poll_once(0.2)
        return True

    def _poll_once(self, timeout: float) -> None:
        waitables = {}
        for child in self.children.values():
            waitables[child.conn] = child
            waitables[child.process.sentinel] = child
        for ready in multiprocessing.connection.wait(list(waitables), timeout):
            self._handle(waitables[ready])

    def _handle(self, child: Child) -> None:
        if child.conn.poll():
            try:
                msg = _to_launcher.decode(child.conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, ProcessFailed):
                raise ChildFailed(f"{child.name} failed: {msg.error}")
            if isinstance(msg, ProcessReady):
                child.ready = msg
                logger.debug("%s ready (pid %d)", child.name, msg.pid)
                return
        child.process.join(0.05)
        if child.process.exitcode is not None:
            raise ChildFailed(_exited(child))

    def watch(self, timeout: float) -> None:
        """Wait up to `timeout` s; raise ChildFailed if any child exits meanwhile."""
        sentinels = {c.process.sentinel: c for c in self.children.values()}
        for ready in multiprocessing.connection.wait(list(sentinels), timeout):
            child = sentinels[ready]
            child.process.join(0.05)
            raise ChildFailed(_exited(child))

    def wait_exit(self, name: str, timeout: float) -> bool:
        """Wait for one child to exit by itself; True if it did."""
        proc = self.children[name].process
        proc.join(timeout)
        return proc.exitcode is not None

    def stop_all(self, timeout: float = 5.0) -> None:
        """SIGTERM every child still alive, then SIGKILL whatever outlives `timeout`."""
        alive = [c.process for c in self.children.values() if c.process.is_alive()]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("%s ignored SIGTERM; killing it", proc.name)
                proc.kill()
                proc.join(1.0)
        for child in self.children.values():
            child.conn.close()
