"""Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on q and k), both Llama-shaped otherwise."""

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the q/k/v projections carry a bias."""

    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: no q/k/v bias, but a per-head RMSNorm on q and k before rotary."""

    qk_norm = True
