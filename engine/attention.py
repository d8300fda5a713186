"""Attention over the paged KV pool, behind a backend interface.

A step's batch is flat: every sequence contributes `q_len` new tokens (a prefill chunk,
or 1 for decode) and attends to `kv_len` tokens, the cached ones plus its new ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import KVPool


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of the flat batch."""

    q_len: int
    kv_len: int
    page_table: list[int]


@dataclass
class ForwardContext:
    """Per-step tensors every layer reads; built once per step by the model runner."""

    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] pool slot each new token's K/V goes to
    logits_indices: torch.Tensor  # rows of the flat batch that need logits
    backend: AttentionBackend
    attn_metadata: object  # whatever backend.prepare returned


class AttentionBackend(ABC):
    """Writes new K/V into the pool and computes attention for a flat batch."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    @abstractmethod
    def prepare(self, seqs: list[SeqSlice]) -> object:
        """Build the per-step metadata once, so that the per-layer work stays small."""

    @abstractmethod
    def forward(self, q, k, v, layer_id: int, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""


# A decode group spans KV lengths down to this fraction of its longest row: padding to the
# longest costs gather traffic, and each extra group costs a few more calls per layer.
_DECODE_GROUP_SPAN = 0.5


@dataclass
class _DecodeRows:
    start: int  # first batch row of this group; one query token per row
    count: int
    slots: torch.Tensor  # [count, max_kv] pool slots, padded
    mask: torch.Tensor  # [count, 1, 1, max_kv] True where a slot is real


@dataclass
class _PrefillSeq:
    q_start: int
    q_len: int
    slots: torch.Tensor | None  # [kv_len] pool slots; None when nothing is cached before
    mask: torch.Tensor | None  # None: plain causal, no cached prefix


@dataclass
class _TorchMetadata:
    decodes: list[_DecodeRows]
    prefills: list[_PrefillSeq]


class TorchAttention(AttentionBackend):
    """Reference backend in plain torch: gathers each sequence's K/V from the pool and
    calls scaled_dot_product_attention. Runs anywhere torch runs.

    Single-token rows must come first in the batch, longest KV first: runs of rows with
    similar KV lengths share one padded call, while each multi-token chunk gets its own call
    with a causal mask offset by its prefix.
    """

    def prepare(self, seqs: list[SeqSlice]) -> _TorchMetadata:
        device = self.pool.k.device
        page_size = self.pool.layout.page_size
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].q_len == 1:
            num_decode += 1
        decodes = [
            self._decode_rows(seqs[start:end], start, page_size, device)
            for start, end in _similar_length_runs(seqs[:num_decode])
        ]
        prefills, q_start = [], num_decode
        for seq in seqs[num_decode:]:
            assert seq.q_len > 1, "single-token rows must come first"
            mask = _prefix_causal_mask(seq, device)
            # A chunk with no cached prefix attends to its own new K/V and needs no slots.
            slots = None if mask is None else _slots(seq.page_table, page_size, device)[: seq.kv_len]
            prefills.append(_PrefillSeq(q_start, seq.q_len, slots, mask))
            q_start += seq.q_len
        return _TorchMetadata(decodes, prefills)

    @staticmethod
    def _decode_rows(seqs: list[SeqSlice], start: int, page_size: int, device) -> _DecodeRows:
        max_pages = max(len(s.page_table) for s in seqs)
        tables = torch.tensor([s.page_table + [0] * (max_pages - len(s.page_table)) for s in seqs])
        offsets = torch.arange(page_size)
        slots = (tables[:, :, None] * page_size + offsets).flatten(1)
        kv_lens = torch.tensor([s.kv_len for s in seqs])
        mask = torch.arange(slots.shape[1])[None, :] < kv_lens[:, None]
        return _DecodeRows(start, len(seqs), slots.to(device), mask[:, None, None, :].to(device))

    def forward(self, q, k, v, layer_id: int, ctx: ForwardContext) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        k_cache.index_copy_(0, ctx.slot_mapping, k)
        v_cache.index_copy_(0, ctx.slot_mapping, v)
        meta: _TorchMetadata = ctx.attn_metadata
        out = torch.empty_like(q)
        for group in meta.decodes:
            rows = slice(group.start, group.start + group.count)
            out[rows] = self._decode(q[rows], k_cache, v_cache, group)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.mask is None:  # nothing cached before this chunk: its own K/V are all it sees
                keys, values = k[rows], v[rows]
            else:
                keys, values = k_cache.index_select(0, p.slots), v_cache.index_select(0, p.slots)
            # 4-D inputs [1, heads, len, dim]: on CPU only those reach the fused flash kernel,
            # which is ~3.5x faster than the 3-D path here.
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True,
            )
            out[rows] = attn[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, rows: _DecodeRows) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        # index_select, not fancy indexing: the latter is several times slower on CPU.
        flat = rows.slots.flatten()
        keys = k_cache.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        # One query token per row: fold each KV head's group of query heads into the query
        # length axis, which is cheaper than enable_gqa or repeating K/V.
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        attn = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=rows.mask)
        return attn.reshape(batch, num_heads, head_dim)


def _similar_length_runs(seqs: list[SeqSlice]) -> list[tuple[int, int]]:
    """Split rows sorted by falling KV length into [start, end) runs of similar lengths."""
    runs, start = [], 0
    for i in range(1, len(seqs) + 1):
        if i == len(seqs) or seqs[i].kv_len < _DECODE_GROUP_SPAN * seqs[start].kv_len:
            runs.append((start, i))
            start = i
    return runs


def _slots(page_table: list[int], page_size: int, device) -> torch.Tensor:
    pages = torch.tensor(page_table, dtype=torch.long)
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten().to(device)


def _prefix_causal_mask(seq: SeqSlice, device) -> torch.Tensor | None:
    """Causal mask for a chunk whose first query sits after `kv_len - q_len` cached tokens."""
    cached = seq.kv_len - seq.q_len
    if cached == 0:
        return None
    query_pos = torch.arange(seq.q_len)[:, None] + cached
    return (torch.arange(seq.kv_len)[None, :] <= query_pos).to(device)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}
