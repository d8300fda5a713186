"""What the process layout costs: the engine in-process vs the same engine behind HTTP.

    python scripts/bench_serving_overhead.py [--model M] [--max-tokens 64] [--concurrency 32]

1. In-process `Engine` (nothing else running): TTFT of one request (add_request -> first
   token), the decode step time of one stream, and output tokens/s of N requests at once.
2. `python launch.py` on a free port with the same engine flags, driven by an aiohttp
   client: TTFT and inter-token latency of one SSE stream, and output tokens/s of the same
   N requests as concurrent streams.

Prints one JSON object: both sides, their differences, and the issue's targets
(TTFT within 15 ms, ITL p50 within 2 ms, N-stream throughput >= 90% of offline).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

ONE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def many_prompts(n: int) -> list[str]:
    return [f"Story {i}: write about a town where it rained for {i + 2} days." for i in range(n)]


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


# ---------------------------------------------------------------- offline engine


def offline(config: EngineConfig, args: argparse.Namespace) -> dict:
    eng = Engine(config)
    enc = eng.tokenizer.encode
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _run_one(eng, "warmup", enc(ONE_PROMPT), greedy)
    ttfts, steps = [], []
    for i in range(args.repeats):
        ttft, step_times = _run_one(eng, f"one-{i}", enc(ONE_PROMPT), greedy)
        ttfts.append(ttft)
        steps += step_times
    prompts = [enc(p) for p in many_prompts(args.concurrency)]
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        eng.add_request(f"many-{i}", ids, greedy)
    tokens = 0
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    elapsed = time.perf_counter() - start
    result = {
        "prompt_tokens": len(enc(ONE_PROMPT)),
        "ttft_ms_p50": p50(ttfts),
        "decode_step_ms_p50": p50(steps),
        "concurrent_output_tokens": tokens,
        "concurrent_tok_s": tokens / elapsed,
        "model_name": eng.model_name,
    }
    del eng
    gc.collect()
    return result


def _run_one(eng: Engine, rid: str, ids: list[int], params: SamplingParams) -> tuple[float, list[float]]:
    """TTFT and the decode step times of one request alone."""
    start = time.perf_counter()
    eng.add_request(rid, ids, params)
    first, steps = None, []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter() - start
        elif first is not None:
            steps.append(time.perf_counter() - t0)
    return first, steps


# ---------------------------------------------------------------- over HTTP


async def stream_once(http: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT, chunk arrival times, and the usage counts."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, usage = [], None
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals, "end": time.perf_counter(),
            "completion_tokens": usage["completion_tokens"] if usage else 0}


async def over_http(url: str, model: str, args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await stream_once(http, url, model, ONE_PROMPT, args.max_tokens)  # warm-up
        ttfts, gaps = [], []
        for _ in range(args.repeats):
            r = await stream_once(http, url, model, ONE_PROMPT, args.max_tokens)
            ttfts.append(r["arrivals"][0] - r["start"])
            gaps += [b - a for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
        start = time.perf_counter()
        runs = await asyncio.gather(*(stream_once(http, url, model, p, args.max_tokens)
                                      for p in many_prompts(args.concurrency)))
        elapsed = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in runs)
    return {"ttft_ms_p50": p50(ttfts), "itl_ms_p50": p50(gaps), "concurrent_output_tokens": tokens,
            "concurrent_tok_s": tokens / elapsed}


def start_server(engine_flags: list[str], port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--log-level", "warning", *engine_flags]
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="single-stream runs for TTFT and ITL")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    engine = offline(config, args)
    flags = ["--device", args.device, "--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sluice-bench-{port}.log"
    proc = start_server(flags, port, log_path)
    try:
        http = asyncio.run(over_http(f"http://127.0.0.1:{port}", engine["model_name"], args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    ttft_gap = http["ttft_ms_p50"] - engine["ttft_ms_p50"]
    itl_gap = http["itl_ms_p50"] - engine["decode_step_ms_p50"]
    ratio = http["concurrent_tok_s"] / engine["concurrent_tok_s"]
    result = {
        "settings": {"model": engine.pop("model_name"), "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "repeats": args.repeats, "cpus": os.cpu_count()},
        "engine": engine,
        "http": http,
        "overhead": {"ttft_ms": ttft_gap, "itl_ms": itl_gap, "throughput_ratio": ratio},
        "targets_met": {"ttft_within_15ms": ttft_gap <= 15, "itl_within_2ms": itl_gap <= 2,
                        "throughput_at_least_90pct": ratio >= 0.9},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
