"""Model registry: HF `architectures` name -> our implementation."""

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    """Pick the class for a HF config; unknown architectures fail with the supported list."""
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported architecture {names or '(none given)'}; supported: {sorted(MODEL_REGISTRY)}"
    )
