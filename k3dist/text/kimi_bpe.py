"""Kimi's tokenizer proper: `tiktoken.model` ranks, Kimi's pre-tokenizer pattern, the special block, long-input cuts.

The ranks file is parsed here rather than with `tiktoken.load.load_tiktoken_bpe`: that function copies every file it
reads into a shared cache under the system temp dir, keyed by path, and serves the cached copy on the next load even
after the file changed (a rewritten twin, an edited checkpoint). Parsing here also gives bad lines their numbers.
"""

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from ..base.errors import K3Error

# Kimi's pre-tokenizer: Han runs alone, CamelCase split, digits in threes (fancy-regex; `&&` intersects classes).
PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
SPECIAL_BLOCK = 256  # ids right after the base vocabulary reserved for special tokens
MAX_PIECE_CHARS = 400_000  # tiktoken is handed at most this many characters at once ...
MAX_RUN_CHARS = 25_000  # ... and no run of whitespace or non-whitespace longer than this (it panics otherwise)
# The runs of whitespace or non-whitespace longer than MAX_RUN_CHARS, scanned in C. The lookbehinds let a match start
# only where a run does, so each run is read once (linear in the text, however long its runs). \s is str.isspace.
_LONG_RUNS = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def read_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token) rank` per line -> {token bytes: rank}; ranks 0..n-1 once each, every single byte present."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise K3Error(f"{path}: cannot read ({exc.strerror or exc})") from None
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise K3Error(f"{path}:{number}: expected 'base64 rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except binascii.Error:
            raise K3Error(f"{path}:{number}: {fields[0][:80]!r} is not base64") from None
        rank = int(fields[1])
        if token in ranks:
            raise K3Error(f"{path}:{number}: token {token!r} already has rank {ranks[token]}")
        if rank in line_of_rank:
            raise K3Error(f"{path}:{number}: rank {rank} is already given on line {line_of_rank[rank]}")
        ranks[token], line_of_rank[rank] = rank, number
    if not ranks:
        raise K3Error(f"{path}: holds no tokens")
    if len(ranks) <= max(line_of_rank):
        missing = next(r for r in range(len(ranks)) if r not in line_of_rank)
        raise K3Error(f"{path}: ranks must be 0..{len(ranks) - 1} with none missing, but rank {missing} is missing")
    if lacking := [b for b in range(256) if bytes([b]) not in ranks]:
        first = f"{lacking[0]:#04x}"
        raise K3Error(f"{path}: byte-level BPE needs all 256 single-byte tokens; {len(lacking)} missing, e.g. {first}")
    return ranks


def special_tokens(names: dict[int, str], base_size: int, source: Path) -> dict[str, int]:
    """The special block (named from `names`, the rest reserved) plus any named ids past it; content -> id."""
    if clash := sorted(i for i in names if i < base_size):
        token = f"{clash[0]} ({names[clash[0]]!r})"
        raise K3Error(f"{source}: added token id {token} is a base token id of tiktoken.model (0..{base_size - 1})")
    ids = range(base_size, base_size + SPECIAL_BLOCK)
    specials: dict[str, int] = {}
    for token_id in sorted(set(ids) | set(names)):
        content = names.get(token_id, reserved_name(token_id))
        if content in specials:
            raise K3Error(f"{source}: special token {content!r} has two ids, {specials[content]} and {token_id}")
        specials[content] = token_id
    return specials


def pieces(text: str) -> Iterator[str]:
    """Cut `text` the way Kimi's reference does before encoding, so the ids match it and tiktoken never panics.

    Pieces of at most MAX_PIECE_CHARS characters; inside each, a run of whitespace or non-whitespace longer than
    MAX_RUN_CHARS is cut every MAX_RUN_CHARS characters from the start of the run.
    """
    for start in range(0, len(text), MAX_PIECE_CHARS):
        chunk = text[start : start + MAX_PIECE_CHARS]
        cut = 0
        for run in _LONG_RUNS.finditer(chunk):
            for end in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:end]
                cut = end
        yield chunk[cut:]


class KimiTiktoken:
    """A `tiktoken.Encoding` over the ranks with Kimi's pattern and special tokens, every special allowed."""

    def __init__(
        self, ranks_path: Path, added: dict[int, str], added_source: Path, plain: frozenset[int] = frozenset()
    ):
        """`plain`: added ids not marked special (the special block's others are: skip_special_tokens drops them)."""
        ranks = read_ranks(ranks_path)
        self.special_ids = special_tokens(added, len(ranks), added_source)
        self.marked_special = frozenset(self.special_ids.values()) - plain
        self.encoding = tiktoken.Encoding(
            name=f"kimi:{ranks_path}", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        self.vocab_size = self.encoding.max_token_value + 1
        self.max_token_chars = max(max(map(len, ranks), default=1), max(map(len, self.special_ids), default=1))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in pieces(text):
            ids += self.encoding.encode(piece, allowed_special="all")
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The tokens' bytes; ids that name no token (past the vocabulary, negative) add nothing."""
        try:
            return self.encoding.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError):
            return self.encoding.decode_bytes([i for i in ids if self.token_bytes(i) is not None])

    def token_bytes(self, token_id: int) -> bytes | None:
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError, TypeError):
            return None

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_id(self, content: str) -> int | None:
        """The id of a special token's text, or of a text that is exactly one base token."""
        if content in self.special_ids:
            return self.special_ids[content]
        try:
            return self.encoding.encode_single_token(content)
        except KeyError:
            return None
