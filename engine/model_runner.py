"""Loads the model and the KV pool, and runs one scheduled batch through them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention import ATTENTION_BACKENDS, ForwardContext, SeqSlice
from engine.config import EngineConfig
from engine.kv_cache import KVLayout, KVPool
from engine.models import model_class
from engine.sampler import Sampler, SampleResult, SamplingRow
from engine.scheduler import ScheduledSeq

DEFAULT_CPU_KV_BYTES = 4 << 30  # as vLLM's CPU backend


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    # bf16 matmuls on CPU run ~100x slower than fp32, so fp32 is the CPU default.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class MemoryReport:
    """How the memory budget splits, logged at start-up and shown to operators."""

    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    max_full_length_seqs: int


class ModelRunner:
    """Owns the device: model weights, KV pool, attention backend and sampler."""

    def __init__(self, config: EngineConfig, hf_config, model_dir: Path, max_model_len: int):
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.model = self._load_model(config, hf_config, model_dir)
        attn = self.model.model.layers[0].self_attn
        layout = KVLayout(hf_config.num_hidden_layers, attn.num_kv_heads, attn.head_dim, config.page_size, self.dtype)
        self.pool = KVPool(layout, self._num_pages(config, layout), self.device)
        self.backend = ATTENTION_BACKENDS[config.attention_backend](self.pool)
        self.sampler = Sampler(hf_config.vocab_size, self.device)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv_bytes = 2 * self.pool.k.numel() * self.pool.k.element_size()
        self.memory = MemoryReport(weights, kv_bytes, self.pool.num_tokens, self.pool.num_tokens // max_model_len)

    def _load_model(self, config: EngineConfig, hf_config, model_dir: Path) -> torch.nn.Module:
        cls = model_class(hf_config)
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(hf_config)
        finally:
            torch.set_default_dtype(torch.float32)
        if config.load_format == "dummy":
            _init_dummy_weights(model, config.seed)
        else:
            model.load_weights(_iter_safetensors(model_dir))
        return model.eval()

    def _num_pages(self, config: EngineConfig, layout: KVLayout) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations: a few hundred MB covers the step budget on our models.
            budget = int(total * config.gpu_memory_utilization) - (total - free) - (512 << 20)
        else:
            budget = config.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        num_pages = layout.pages_for_budget(budget)
        if num_pages < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no page; raise it")
        return num_pages

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], SampleResult | None]:
        """Run one forward pass; returns the sequences that sampled and what they sampled."""
        # Attention batches single-token rows of similar KV length: those go first, longest first.
        batch = sorted(batch, key=lambda item: (item.num_new_tokens != 1, -item.seq.num_computed))
        ctx, input_ids = self._prepare(batch)
        logits = self.model(input_ids, ctx)
        sampling = [item for item in batch if item.samples]
        if not sampling:
            return [], None
        rows = [_sampling_row(item.seq) for item in sampling]
        return sampling, self.sampler(logits.float(), rows)

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[ForwardContext, torch.Tensor]:
        input_ids, positions, slots, logits_indices, seqs = [], [], [], [], []
        page_size = self.pool.layout.page_size
        for item in batch:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
            seqs.append(SeqSlice(item.num_new_tokens, end, seq.page_table))
        ctx = ForwardContext(
            positions=self._long_tensor(positions),
            slot_mapping=self._long_tensor(slots),
            logits_indices=self._long_tensor(logits_indices),
            backend=self.backend,
            attn_metadata=self.backend.prepare(seqs),
        )
        return ctx, self._long_tensor(input_ids)

    def _long_tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _sampling_row(seq) -> SamplingRow:
    return SamplingRow(seq.params, seq.prompt_ids, seq.output_ids, seq.stop_ids, seed_offset=seq.index)


def _iter_safetensors(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights, so big architectures can be benchmarked without downloads."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=generator) * 0.02
            param.data.copy_(values)
