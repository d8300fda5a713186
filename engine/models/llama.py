"""Llama family decoder (SmolLM2, Llama 2/3, Mistral without sliding window).

Qwen2 and Qwen3 differ only in the flags below, so they subclass this model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, rope_settings

# HF checkpoint names of the projections we fuse: name -> (fused name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm gated MLP block."""

    def __init__(self, cfg, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, the stack of decoder layers and the final norm."""

    def __init__(self, cfg, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(head_dim, cfg.max_position_embeddings, *rope_settings(cfg))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, qkv_bias, qk_norm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rope, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Runs one flat, unpadded batch of tokens and returns logits only where we sample."""

    qkv_bias_default = False
    qk_norm = False

    def __init__(self, cfg):
        super().__init__()
        qkv_bias = getattr(cfg, "attention_bias", self.qkv_bias_default)
        self.model = DecoderModel(cfg, qkv_bias, self.qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.model(input_ids, ctx)
        # Only the last token of each sampling sequence needs logits: skipping the rest
        # saves the vocab-sized matmul for every prefill token.
        return self.lm_head(hidden.index_select(0, ctx.logits_indices))

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Row counts of the checkpoint tensors packed into one fused parameter."""
        attn = self.model.layers[0].self_attn
        if "qkv_proj" in fused_name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.model.layers[0].mlp.down_proj.in_features] * 2

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; raises on any missing tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head.weight is self.model.embed_tokens.weight:
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            _copy_shard(params[target], tensor, shard, self.shard_sizes(target))
            loaded.add(f"{target}#{shard}")
        missing = [n for n in params if not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {missing[:4]}")


def _fused_target(name: str) -> tuple[str, int | None]:
    for short, (fused, shard) in FUSED_SHARDS.items():
        if f".{short}." in name:
            return name.replace(short, fused), shard
    return name, None


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, shard: int | None, sizes: list[int]) -> None:
    if shard is None:
        param.data.copy_(tensor)
        return
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)
