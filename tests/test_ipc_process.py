"""ProcessGroup: readiness handshake, failure reports, death detection, and no orphans."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from ipc.messages import Drain, EngineInfo
from ipc.process import ChildFailed, ParentLink, ProcessGroup, one_line

HERE = "test_ipc_process"  # spawned children import their targets from this module


# ---- child targets (run in spawned processes)


def child_ready(link: ParentLink) -> None:
    link.ready()
    time.sleep(60)


def child_waits_for_info(link: ParentLink) -> None:
    info = link.wait_message(EngineInfo)
    link.ready(info)  # echo it back so the test sees it arrived
    time.sleep(60)


def child_raises(link: ParentLink) -> None:
    raise ValueError("no such model: 'nope'\n  (second line)")


def child_exits(link: ParentLink) -> None:
    os._exit(3)


def child_ignores_sigterm(link: ParentLink) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link.ready()
    time.sleep(60)


def child_handler(link: ParentLink) -> None:
    got = []
    link.set_handler(got.append)
    link.ready()
    while not got:
        time.sleep(0.01)
    link.ready(EngineInfo(f"got {type(got[0]).__name__}", "", 0, 0, [], 0, 0))
    time.sleep(60)


# ---- tests


@pytest.fixture
def group():
    g = ProcessGroup("warning")
    yield g
    g.stop_all(timeout=2)


def never() -> bool:
    return False


def test_ready_handshake(group):
    group.start("a", f"{HERE}:child_ready")
    group.start("b", f"{HERE}:child_ready")
    assert group.wait_ready(["a", "b"], 30, never)
    assert group.children["a"].ready.pid == group.children["a"].process.pid


def test_engine_info_reaches_waiting_child(group):
    group.start("w", f"{HERE}:child_waits_for_info")
    info = EngineInfo("m", "/x", 10, 20, [1], 3, 16)
    group.send("w", info)
    assert group.wait_ready(["w"], 30, never)
    assert group.children["w"].ready.info == info


def test_handler_gets_messages_sent_before_it_was_set(group):
    group.start("h", f"{HERE}:child_handler")
    group.send("h", Drain(1.0))  # most likely queued before set_handler runs
    assert group.wait_ready(["h"], 30, never)
    group.children["h"].ready = None
    assert group.wait_ready(["h"], 30, never)
    assert group.children["h"].ready.info.model_name == "got Drain"


def test_failure_is_one_line(group):
    group.start("bad", f"{HERE}:child_raises")
    with pytest.raises(ChildFailed) as err:
        group.wait_ready(["bad"], 30, never)
    assert str(err.value) == "bad failed: no such model: 'nope' (second line)"


def test_any_child_exit_fails_the_wait(group):
    group.start("ok", f"{HERE}:child_waits_for_info")
    group.start("dies", f"{HERE}:child_exits")
    with pytest.raises(ChildFailed, match="dies exited with code 3"):
        group.wait_ready(["ok"], 30, never)


def test_watch_reports_a_death(group):
    group.start("a", f"{HERE}:child_ready")
    assert group.wait_ready(["a"], 30, never)
    group.watch(0.1)  # nothing happened
    os.kill(group.children["a"].process.pid, signal.SIGKILL)
    with pytest.raises(ChildFailed, match="a exited"):
        group.watch(10)


def test_wait_ready_stops_when_asked(group):
    group.start("w", f"{HERE}:child_waits_for_info")
    assert group.wait_ready(["w"], 30, lambda: True) is False


def test_stop_all_kills_a_child_that_ignores_sigterm(group):
    group.start("stubborn", f"{HERE}:child_ignores_sigterm")
    assert group.wait_ready(["stubborn"], 30, never)
    proc = group.children["stubborn"].process
    t0 = time.monotonic()
    group.stop_all(timeout=1)
    assert not proc.is_alive()
    assert time.monotonic() - t0 < 5


def test_child_exits_when_launcher_pipe_closes(group):
    """A SIGKILLed launcher closes its pipe ends; the children must not linger."""
    group.start("orphan", f"{HERE}:child_ready")
    assert group.wait_ready(["orphan"], 30, never)
    pid = group.children["orphan"].process.pid
    group.children["orphan"].conn.close()
    psutil.Process(pid).wait(10)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_one_line():
    assert one_line(ValueError("a\n b")) == "a b"
    assert one_line(KeyError("k")) == "KeyError: 'k'"
