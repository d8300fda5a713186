"""Offline throughput: our engine against transformers `generate` on the same workload.

Workload (fixed seed): N requests, prompts of 32-512 random tokens, outputs of 16-256 tokens,
eos ignored. The baseline runs statically batched groups of 16 with left padding; each group
runs to its longest output, and only each request's own output tokens count, on both sides.

Prints one JSON line: engine_out_tok_s, baseline_out_tok_s, ratio, and the single-request
decode step time beside the fp32 weight-read floor.

    python scripts/bench_offline.py [--num-requests 64] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

MEMORY_BANDWIDTH_BYTES_S = 20e9  # measured on the 2-core development machine


def make_workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Skip the first ids: they are special tokens in SmolLM2's vocabulary.
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_engine(llm: LLM, workload) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in workload]
    start = time.perf_counter()
    outs = llm.generate([prompt for prompt, _ in workload], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(out for _, out in workload)
    return {"seconds": elapsed, "out_tokens": tokens, "out_tok_s": tokens / elapsed}


def run_transformers(model_dir: Path, workload, group: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as on our side
    start = time.perf_counter()
    for i in range(0, len(workload), group):
        chunk = workload[i : i + group]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in chunk),
                           do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    tokens = sum(out for _, out in workload)  # only each request's own outputs count
    return {"seconds": elapsed, "out_tokens": tokens, "out_tok_s": tokens / elapsed}


def decode_step_ms(llm: LLM, steps: int = 64) -> float:
    """Median time of one engine step for a lone request that is past its prefill."""
    engine = llm.engine
    engine.add_request("probe", list(range(100, 164)), SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--group", type=int, default=16, help="baseline static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    workload = make_workload(args.num_requests, llm.engine.vocab_size, args.seed)
    llm.generate([workload[0][0]], SamplingParams(max_tokens=4))  # warm-up
    step_ms = decode_step_ms(llm)
    floor_ms = llm.engine.runner.memory.weights_bytes / MEMORY_BANDWIDTH_BYTES_S * 1000
    engine = run_engine(llm, workload)
    result = {
        "num_requests": args.num_requests,
        "engine_out_tok_s": round(engine["out_tok_s"], 1),
        "engine_seconds": round(engine["seconds"], 1),
        "out_tokens": engine["out_tokens"],
        "preemptions": llm.engine.scheduler.num_preemptions,
        "decode_step_ms": round(step_ms, 1),
        "weight_read_floor_ms": round(floor_ms, 1),
    }
    if not args.skip_baseline:
        baseline = run_transformers(llm.engine.model_dir, workload, args.group)
        result |= {
            "baseline_out_tok_s": round(baseline["out_tok_s"], 1),
            "baseline_seconds": round(baseline["seconds"], 1),
            "ratio": round(engine["out_tok_s"] / baseline["out_tok_s"], 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
