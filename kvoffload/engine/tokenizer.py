"""Tokenizers of the reference engine: byte-level for presets, tokenizer.json for checkpoints."""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(ABC):
    """Text <-> token ids. ``eos_token_id`` ends generation."""

    eos_token_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens such as BOS added as the model expects)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special and unknown ids are skipped."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (a byte token inside a multi-byte character: its
        one byte, not U+FFFD's three); by default its text's UTF-8."""
        return self.decode([token_id]).encode("utf-8")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids ``0..255``; ``eos_token_id`` is reserved (presets use 256).

    Decoding drops EOS and ids that are not bytes (the unused rest of the vocabulary) and
    replaces invalid UTF-8 with U+FFFD, so any id sequence a model samples decodes without error.
    """

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        if vocab_size < 256:
            raise ConfigError(
                "vocab_size", f"a byte-level tokenizer needs at least 256 ids, got {vocab_size}"
            )
        if not 0 <= eos_token_id < vocab_size:
            raise ConfigError("eos_token_id", f"must be in [0, {vocab_size}), got {eos_token_id}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        eos = self.eos_token_id
        return bytes(i for i in ids if 0 <= i < 256 and i != eos).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 and token_id != self.eos_token_id else b""


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` package."""

    def __init__(self, tokenizer: Any, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self._specials: frozenset[int] | None = None

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-fallback token (``<0xE2>``) is its byte; in a byte-level (GPT-2) vocabulary a
        token's characters map back to bytes; otherwise its text's UTF-8."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._special_ids():
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        table = _byte_level_table()
        if type(self._tokenizer.decoder).__name__ == "ByteLevel" and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")

    def _special_ids(self) -> frozenset[int]:
        ids = self._specials
        if ids is None:
            added = self._tokenizer.get_added_tokens_decoder()
            ids = frozenset(i for i, t in added.items() if t.special)
            self._specials = ids
        return ids


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def load_tokenizer(directory: Path, vocab_size: int, eos_token_id: int) -> Tokenizer:
    """``directory/tokenizer.json`` if it exists and ``tokenizers`` is installed; otherwise a
    byte-level tokenizer, with a warning (its ids do not mean what the checkpoint's ids mean).
    """
    path = directory / "tokenizer.json"
    reason = f"no tokenizer.json in {directory}"
    if path.is_file():
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            reason = "the 'tokenizers' package is not installed"
        else:
            try:
                return HFTokenizer(_Tokenizer.from_file(str(path)), eos_token_id)
            except Exception as exc:  # the file is corrupt or of an unknown version
                raise ConfigError("tokenizer", f"cannot read {path}: {exc}") from exc
    warnings.warn(f"{reason}: falling back to a byte-level tokenizer", UserWarning, stacklevel=4)
    return ByteTokenizer(vocab_size, eos_token_id)
