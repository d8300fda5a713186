"""Engine settings, one frozen dataclass; CLI flags map onto these fields by name."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Everything the scheduler process needs to build the engine.

    `model` is a HF-style folder, a .gguf file, a hub id, or None for the embedded default.
    """

    model: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    seed: int = 0
    max_model_len: int | None = None  # default: the model's own context length
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_cache_memory: int | None = None  # bytes for the KV pool on CPU; default 2 GiB
    gpu_memory_utilization: float = 0.85  # fraction of free CUDA memory for weights + KV
    attention_backend: str = "torch"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Register one --flag per field, with vLLM's flag names."""
        parser.add_argument("--model", default=None, help="HF folder, .gguf file or hub id")
        parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
        parser.add_argument("--device", default="auto")
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--max-num-seqs", type=int, default=128)
        parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes on CPU")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
        parser.add_argument("--attention-backend", default="torch", choices=["torch"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
