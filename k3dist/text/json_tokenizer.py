"""A `tokenizer.json` (Hugging Face `tokenizers` format), as some K3 derivatives and conversions ship it."""

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..base.errors import K3Error
from ..base.files import read_text


def byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def _is_byte_level(decoder: dict | None) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders") or [])
    return decoder.get("type") == "ByteLevel"


class JsonTokenizer:
    """Encodes and decodes exactly as `tokenizers` does (added tokens in the text become their ids, no BOS added).

    `decode_bytes` is exact per token for byte-level decoders (each token's bytes, the way the ByteLevel decoder maps
    them), so streamed text can hold back an unfinished UTF-8 character. For other decoders it is the UTF-8 of the
    decoded text, right for whole sequences but not always for tokens decoded one at a time.
    """

    def __init__(self, path: Path):
        text = read_text(path)
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise K3Error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise K3Error(f"{path}: not valid JSON (nested too deeply)") from None
        try:
            self.tokenizer = HFTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exception for every malformed file
            raise K3Error(f"{path}: not a tokenizers file ({str(exc)[:300]})") from None
        added = sorted(self.tokenizer.get_added_tokens_decoder().items())
        self.special_ids = {t.content: i for i, t in added}
        self.marked_special = frozenset(i for i, t in added if t.special)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise K3Error(f"{path}: holds no tokens")
        self.vocab_size = max(vocab.values()) + 1
        self._byte_level = _is_byte_level(raw.get("decoder") if isinstance(raw, dict) else None)
        self._table: list[bytes] | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        if not self._byte_level:
            return self.decode(ids).encode("utf-8")
        table = self._bytes_table()
        return b"".join(table[i] for i in ids if 0 <= i < len(table))

    def token_id(self, content: str) -> int | None:
        return self.tokenizer.token_to_id(content)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token covers: its bytes for byte-level decoders, else its own text's."""
        tokens = self._bytes_table() if self._byte_level else self.tokenizer.get_vocab(with_added_tokens=True)
        return max(map(len, tokens), default=1)

    def _bytes_table(self) -> list[bytes]:
        """id -> bytes as the ByteLevel decoder maps it: byte-alphabet chars to bytes, any other token as UTF-8."""
        if self._table is None:
            chars = byte_level_chars()
            table = [b""] * self.vocab_size
            for token, token_id in self.tokenizer.get_vocab(with_added_tokens=True).items():
                try:
                    table[token_id] = bytes(chars[c] for c in token)
                except KeyError:
                    table[token_id] = token.encode("utf-8")
            self._table = table
        return self._table
