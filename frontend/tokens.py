"""Tokenizer loading and token -> text helpers shared by the tokenizer workers and detokenizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model folder's own tokenizer; a clear error if it has none.

    With a tokenizer.json we load it as a plain fast tokenizer: AutoTokenizer would first
    read the model config, which imports torch and costs the text processes seconds of
    start-up and hundreds of MB each. Encoding, decoding and the chat template come from the
    folder's files either way.
    """
    try:
        if (Path(model_dir) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no usable tokenizer in {model_dir}: {exc}") from exc


def make_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A fast `ids -> text` with the same output as `tokenizer.decode`.

    The Rust tokenizer decodes about 4x faster than the transformers wrapper, which only
    adds the optional clean-up of spaces; we call it directly when that is off.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for the 256 byte values, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenPieces:
    """The text and raw bytes of single tokens, for logprobs; cached per id.

    A lone token may hold part of a UTF-8 character, so `bytes` is the truth and `text` is
    its lossy rendering. Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) spell the
    bytes in GPT-2's alphabet; other tokenizers fall back to decoding the single id.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        self.byte_level = decoder == "ByteLevel"
        self.special = set(tokenizer.all_special_ids)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        if self.byte_level and token_id not in self.special:
            spelled = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            table = _byte_decoder()
            if all(ch in table for ch in spelled):
                raw = bytes(table[ch] for ch in spelled)
                return raw.decode("utf-8", errors="replace"), raw
        text = self.tokenizer.decode([token_id])
        return text, text.encode("utf-8")
