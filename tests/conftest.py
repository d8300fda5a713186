"""Fixtures that run a real server (`python launch.py`) and always clean up its process tree."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sk-sluice-test"
START_TIMEOUT = float(os.environ.get("SLUICE_TEST_START_TIMEOUT", "600"))  # first run converts the model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `python launch.py` subprocess on a free port, with clients and tree helpers."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "launch.py", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        # Its own session: a signal meant for pytest never reaches the server, and back.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    # ---- clients

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def connect(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                auth: bool = True) -> tuple[int, dict | None]:
        """One plain HTTP call (stdlib only); returns the status and the JSON body, if any."""
        headers = {"Content-Type": "application/json"}
        if auth and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn = self.connect()
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, None

    def server_info(self) -> dict:
        status, body = self.request("GET", "/v1/server_info")
        assert status == 200, body
        return body

    # ---- lifecycle

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.request("GET", "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-3000:]}")

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process below it."""
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def child_pid(self, name: str) -> int:
        """The pid the launcher logged for child `name` (e.g. "scheduler")."""
        for line in self.log().splitlines():
            if f"started {name} (pid " in line:
                return int(line.rsplit("(pid ", 1)[1].rstrip(")"))
        raise LookupError(f"no pid logged for {name}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def kill_tree(self) -> None:
        procs = self.tree()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


def start_server(log_path: Path, *args: str, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess(list(args), log_path, api_key)
    try:
        server.wait_ready()
    except BaseException:
        server.kill_tree()
        raise
    return server


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    """One shared server for the API tests: two tokenizer workers and an API key."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(log, "--tokenizer-workers", "2", "--max-request-bytes", str(2**20),
                          "--log-level", "info", api_key=API_KEY)
    yield server
    server.kill_tree()


@pytest.fixture
def server_factory(tmp_path):
    """Start private servers for destructive tests; all are killed at teardown."""
    servers: list[ServerProcess] = []

    def start(*args: str, api_key: str | None = None, wait: bool = True) -> ServerProcess:
        log = tmp_path / f"server-{len(servers)}.log"
        server = ServerProcess(list(args), log, api_key)
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.kill_tree()
