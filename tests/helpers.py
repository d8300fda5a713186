"""Shared builders for tests: tiny random HF models saved as folders the engine can load."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # peaked logits, so greedy choices are not near-ties
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=64),
             rope_theta=500000.0),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}


def build_tiny_model(arch: str, folder: Path, seed: int = 0):
    """Save a random HF model of `arch` into `folder`; returns the HF model for reference."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra})
    model = model_cls(config).float().eval()
    if arch == "qwen2":  # HF zero-inits biases; random ones check that we load them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy generate, eos ignored, new tokens only."""
    ids = torch.tensor([prompt])
    # No eos at all, rather than min_new_tokens, which would also forbid sampling eos.
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()
