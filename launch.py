"""Start Sluice: python launch.py [--model PATH|FILE.gguf|HUB_ID] [--port 8000] ...

Spawns the scheduler (which loads the model), the detokenizer, the tokenizer workers and
the HTTP frontend; waits until each is ready; prints the URL; then watches them. A child
that dies takes the server down with a non-zero exit. SIGINT or SIGTERM drains in-flight
requests (up to --shutdown-timeout seconds) and stops every process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from engine.config import EngineConfig
from ipc.messages import Drain, EngineInfo
from ipc.process import ChildFailed, ProcessGroup, setup_logging
from ipc.sockets import SocketPaths

logger = logging.getLogger("launch")


class OneLineParser(argparse.ArgumentParser):
    """Bad flags get one line on stderr, not a usage block or a traceback."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="launch.py", description="Serve a model over an OpenAI-compatible API.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--tokenizer-workers", "--tokenizer-worker-num", type=int, default=1,
                        dest="tokenizer_workers", help="tokenizer processes")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    server.add_argument("--served-model-name", default=None, help="model name in the API")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    server.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                        help="larger request bodies get a 413")
    EngineConfig.add_cli_args(parser.add_argument_group("engine"))
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.tokenizer_workers < 1:
        parser.error(f"--tokenizer-workers must be at least 1, got {args.tokenizer_workers}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}")
    if args.max_request_bytes < 1024:
        parser.error(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if args.model and _looks_like_path(args.model) and not os.path.exists(os.path.expanduser(args.model)):
        parser.error(f"--model {args.model!r} does not exist")
    try:
        _check_port_free(args.host, args.port)
    except OSError as exc:
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    return args


def _looks_like_path(model: str) -> bool:
    """A local path for sure (a hub id is "org/name"); checked here to fail in milliseconds."""
    return model.endswith(".gguf") or model.startswith(("/", "./", "../", "~"))


def _check_port_free(host: str, port: int) -> None:
    """Fail before loading a model for minutes if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


class Launcher:
    """Starts the processes in dependency order and supervises them until shutdown."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.group = ProcessGroup(args.log_level)
        self.signals = 0  # first signal: drain; second: stop now

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1
        logger.info("got %s%s", signal.Signals(signum).name, "; stopping now" if self.signals > 1 else "")

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        paths = SocketPaths.create()
        try:
            self._start_all(paths)
            if not self._wait_until_ready():
                return 0
            print(f"Sluice is serving at http://{self.args.host}:{self.args.port}/v1", flush=True)
            return self._supervise()
        except ChildFailed as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.group.stop_all()
            paths.remove()

    def _worker_names(self) -> list[str]:
        return [f"tokenizer-{i}" for i in range(self.args.tokenizer_workers)]

    def _start_all(self, paths: SocketPaths) -> None:
        from frontend.server import FrontendOptions  # light: no torch, no transformers

        args = self.args
        options = FrontendOptions(
            host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
            max_request_bytes=args.max_request_bytes, num_tokenizer_workers=args.tokenizer_workers,
        )
        # All start at once; the ones that need the model's facts wait for EngineInfo.
        self.group.start("scheduler", "ipc.scheduler_process:run_scheduler", EngineConfig.from_cli_args(args), paths)
        self.group.start("detokenizer", "frontend.detokenizer:run_detokenizer", paths)
        for i, name in enumerate(self._worker_names()):
            self.group.start(name, "frontend.tokenizer_worker:run_tokenizer_worker", i, paths)
        self.group.start("frontend", "frontend.server:run_frontend", options, paths)

    def _wait_until_ready(self) -> bool:
        """Scheduler first (it loads the model), then the text processes, then the frontend,
        so /ready turns 200 only when the whole pipeline can serve."""
        stop = lambda: self.signals > 0  # noqa: E731
        if not self.group.wait_ready(["scheduler"], None, stop):
            return False
        info: EngineInfo = self.group.children["scheduler"].ready.info
        pipeline = ["detokenizer", *self._worker_names()]
        for name in pipeline:
            self.group.send(name, info)
        if not self.group.wait_ready(pipeline, 300, stop):
            return False
        self.group.send("frontend", info)
        return self.group.wait_ready(["frontend"], 60, stop)

    def _supervise(self) -> int:
        while not self.signals:
            self.group.watch(0.5)
        timeout = self.args.shutdown_timeout
        logger.info("draining in-flight requests (up to %.0f s)", timeout)
        self.group.send("frontend", Drain(timeout))
        waited = 0.0
        while self.signals == 1 and waited < timeout + 5:
            if self.group.wait_exit("frontend", 0.2):
                break
            waited += 0.2
        logger.info("stopping")
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("launch", args.log_level)
    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
