"""OpenAI's logprobs entries: a sampled token's text, its own bytes and its log-prob.

A token of a byte-level BPE vocabulary (GPT-2's, Qwen's, Llama 3's) may be one byte of a multi-byte UTF-8 character:
its decoded text is then the replacement character, whose bytes are not the token's. ``TokenBytes`` reads a token's
bytes from the vocabulary itself: each symbol of a byte-level token stands for one byte (GPT-2's byte mapping), and a
SentencePiece byte-fallback token ``<0xAB>`` is that byte. A SentencePiece token is the UTF-8 of its piece with each
"▁" a space (``"▁is"``: b" is", the space its text has after other text; decoded alone it would lose it). Other
tokens (special and added tokens, a vocabulary without a byte map) are the UTF-8 of their text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from reinforge.models.tiny import byte_symbols

BYTE_OF_SYMBOL = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARK = "\u2581"
"""SentencePiece's "▁", which stands for a space in its pieces."""


def _decoder_parts(tokenizer: Any) -> list[dict[str, Any]]:
    """The tokenizer's decoder and the decoders of its sequence, as their JSON ([] without a tokenizers backend)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    try:
        config = json.loads(decoder.__getstate__())
    except (TypeError, ValueError):
        return []
    return [config, *(config.get("decoders") or [])]


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder maps its vocabulary's symbols to bytes (a ByteLevel decoder)."""
    return any(part.get("type") == "ByteLevel" for part in _decoder_parts(tokenizer))


def marks_spaces(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder reads "▁" as a space (SentencePiece's Metaspace, or Llama 2's Replace)."""
    return any(part.get("type") == "Metaspace" or part.get("type") == "Replace"
               and (part.get("pattern") or {}).get("String") == SPACE_MARK for part in _decoder_parts(tokenizer))


class TokenBytes:
    """Token id to the bytes it stands for (see the module docstring), remembered per id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.marks_spaces = marks_spaces(tokenizer)
        self.added = set(getattr(tokenizer, "added_tokens_decoder", None) or {})
        self.known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        known = self.known.get(token_id)
        if known is None:
            known = self.known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self.added:
            if self.byte_level and piece and all(symbol in BYTE_OF_SYMBOL for symbol in piece):
                return bytes(BYTE_OF_SYMBOL[symbol] for symbol in piece)
            fallback = BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if self.marks_spaces:
                return piece.replace(SPACE_MARK, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
