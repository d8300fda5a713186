"""Process lifecycle: graceful SIGTERM, a dying child, a killed launcher, bad command lines.

Each server test starts a private server (they end it) and checks with psutil that no
process of the tree outlives it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Tell me a story."}]


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Pids still running (zombies count as gone) after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree_pids(server) -> list[int]:
    pids = [p.pid for p in server.tree()]
    # launcher, scheduler, detokenizer, tokenizer worker, frontend (+ multiprocessing's tracker)
    assert len(pids) >= 5, pids
    return pids


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_stops_everything(server_factory):
    server = server_factory("--shutdown-timeout", "120", "--served-model-name", "storyteller")
    pids = tree_pids(server)
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["storyteller"]

    def generate() -> tuple[str, str, int]:
        stream = client.chat.completions.create(model="storyteller", messages=CHAT, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish, usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(generate) for _ in range(3)]
        deadline = time.monotonic() + 120
        while server.server_info()["engine"]["num_running"] < 3:
            assert time.monotonic() < deadline, "requests never started"
            time.sleep(0.05)
        server.signal(signal.SIGTERM)
        results = [f.result(timeout=180) for f in futures]
    # Every request that was in flight finished normally.
    assert [r[1:] for r in results] == [("length", 12)] * 3
    assert all(r[0] for r in results)
    assert server.proc.wait(60) == 0
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_a_dying_child_takes_the_server_down(server_factory):
    server = server_factory()
    pids = tree_pids(server)
    os.kill(server.child_pid("scheduler"), signal.SIGKILL)
    assert server.proc.wait(60) != 0
    assert "scheduler exited" in server.log()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_children_exit_when_the_launcher_is_killed(server_factory):
    server = server_factory()
    pids = tree_pids(server)
    server.signal(signal.SIGKILL)  # no chance to clean up: the children must notice alone
    assert server.proc.wait(10) == -signal.SIGKILL
    assert wait_gone(pids) == []


def run_launcher(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", "--log-level", "error", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "eighty"], "invalid int value"),
        (["--port", "70000"], "--port must be in"),
        (["--tokenizer-workers", "0"], "--tokenizer-workers must be at least 1"),
        (["--dtype", "int3"], "invalid choice"),
        (["--model", "/no/such/model.gguf"], "does not exist"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be non-negative"),
    ],
)
def test_bad_command_line_is_one_line(args, message):
    result = run_launcher(*args, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_port_in_use_is_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        result = run_launcher("--port", str(sock.getsockname()[1]), timeout=60)
    assert result.returncode == 2
    assert "cannot listen on" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_engine_startup_error_is_one_line():
    result = run_launcher("--max-model-len", "1000000", "--port", str(_free_port()))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: scheduler failed:") and "max-model-len" in last, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
