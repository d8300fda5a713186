"""What the process layout costs: the engine in-process vs the same engine behind HTTP.

    python scripts/bench_serving_overhead.py [--model M] [--max-tokens 64] [--concurrency 32]

Loads an in-process `Engine` and starts `python launch.py` with the same engine flags, then
alternates between the two for --rounds rounds (so a noisy neighbour hurts both sides
alike); only one side computes at a time. Each round measures, on each side:

- one request alone: TTFT (engine: add_request -> first token; HTTP: POST -> first SSE
  chunk with text) and the gaps between tokens (engine: decode step time; HTTP: ITL);
- --concurrency requests at once: output tokens/s (HTTP: concurrent SSE streams).

Prints one JSON object with medians over all rounds, the differences, and the issue's
targets (TTFT within 15 ms, ITL p50 within 2 ms, throughput >= 90% of offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# Its first generated token is plain text (" there"), so the first SSE chunk with text and
# the engine's first token are the same event. A prompt whose answer starts with a special
# token (say EOS under ignore_eos) would charge the HTTP side one extra decode step.
ONE_PROMPT = "Once upon a time, in a small village by the sea,"


def many_prompts(n: int) -> list[str]:
    return [f"Story {i}: write about a town where it rained for {i + 2} days." for i in range(n)]


def ms_p50(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


# ---------------------------------------------------------------- offline engine


class Offline:
    """The engine in this process, driven the way the scheduler process drives it."""

    def __init__(self, config: EngineConfig, max_tokens: int):
        self.eng = Engine(config)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.count = 0
        self.first_token = ""  # the first token of ONE_PROMPT's answer, reported as a check

    def one(self) -> tuple[float, list[float]]:
        """TTFT and the decode step times of one request alone."""
        start = time.perf_counter()
        self._add(ONE_PROMPT)
        first, steps = None, []
        while self.eng.has_unfinished():
            t0 = time.perf_counter()
            outs = self.eng.step()
            if first is None:
                if any(o.new_token_ids for o in outs):
                    first = time.perf_counter() - start
                    self.first_token = self.eng.tokenizer.decode(outs[0].new_token_ids)
            else:
                steps.append(time.perf_counter() - t0)
        return first, steps

    def many(self, n: int) -> float:
        """Output tokens/s of n requests added at once."""
        prompts = many_prompts(n)
        start = time.perf_counter()
        for prompt in prompts:
            self._add(prompt)
        tokens = 0
        while self.eng.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in self.eng.step())
        return tokens / (time.perf_counter() - start)

    def _add(self, prompt: str) -> None:
        self.count += 1
        self.eng.add_request(f"bench-{self.count}", self.eng.tokenizer.encode(prompt), self.params)


# ---------------------------------------------------------------- over HTTP


class OverHttp:
    """The same requests as SSE streams against a running server."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, max_tokens: int):
        self.http, self.url, self.model, self.max_tokens = http, url, model, max_tokens

    async def stream(self, prompt: str) -> tuple[float, list[float], int]:
        """(start time, arrival time of each chunk with text, completion tokens)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start, arrivals, tokens = time.perf_counter(), [], 0
        async with self.http.post(self.url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
        return start, arrivals, tokens

    async def one(self) -> tuple[float, list[float]]:
        start, arrivals, _ = await self.stream(ONE_PROMPT)
        return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]

    async def many(self, n: int) -> float:
        start = time.perf_counter()
        runs = await asyncio.gather(*(self.stream(p) for p in many_prompts(n)))
        return sum(r[2] for r in runs) / (time.perf_counter() - start)


def start_server(flags: list[str], port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--log-level", "warning", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:  # not listening yet, or 503 while loading
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not become ready")


# ---------------------------------------------------------------- main


async def compare(offline: Offline, url: str, args: argparse.Namespace) -> dict:
    samples = {k: [] for k in ("eng_ttft", "eng_step", "eng_tps", "http_ttft", "http_itl", "http_tps")}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        served = OverHttp(http, url, offline.eng.model_name, args.max_tokens)
        offline.one()  # warm-up, both sides
        await served.one()
        for _ in range(args.rounds):
            ttft, steps = offline.one()
            samples["eng_ttft"].append(ttft)
            samples["eng_step"] += steps
            ttft, gaps = await served.one()
            samples["http_ttft"].append(ttft)
            samples["http_itl"] += gaps
            samples["eng_tps"].append(offline.many(args.concurrency))
            samples["http_tps"].append(await served.many(args.concurrency))
    return samples


def summarize(s: dict, args: argparse.Namespace, offline: Offline) -> dict:
    engine = {"ttft_ms_p50": ms_p50(s["eng_ttft"]), "decode_step_ms_p50": ms_p50(s["eng_step"]),
              "concurrent_tok_s": statistics.median(s["eng_tps"]), "concurrent_tok_s_all": s["eng_tps"]}
    http = {"ttft_ms_p50": ms_p50(s["http_ttft"]), "itl_ms_p50": ms_p50(s["http_itl"]),
            "concurrent_tok_s": statistics.median(s["http_tps"]), "concurrent_tok_s_all": s["http_tps"]}
    ttft_gap = http["ttft_ms_p50"] - engine["ttft_ms_p50"]
    itl_gap = http["itl_ms_p50"] - engine["decode_step_ms_p50"]
    ratio = http["concurrent_tok_s"] / engine["concurrent_tok_s"]
    return {
        "settings": {"model": offline.eng.model_name, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "rounds": args.rounds, "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(), "first_token": offline.first_token},
        "engine": engine,
        "http": http,
        "overhead": {"ttft_ms": ttft_gap, "itl_ms": itl_gap, "throughput_ratio": ratio},
        "targets_met": {"ttft_within_15ms": ttft_gap <= 15, "itl_within_2ms": itl_gap <= 2,
                        "throughput_at_least_90pct": ratio >= 0.9},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="alternating offline/HTTP rounds")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    offline = Offline(EngineConfig(model=args.model, device=args.device, dtype=args.dtype), args.max_tokens)
    flags = ["--device", args.device, "--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sluice-bench-{port}.log"
    proc = start_server(flags, port, log_path)
    try:
        samples = asyncio.run(compare(offline, f"http://127.0.0.1:{port}", args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    text = json.dumps(summarize(samples, args, offline), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
