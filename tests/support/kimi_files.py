"""Small tokenizer dirs in Kimi's layout for the text tests: byte ranks, chains of chosen words, Kimi's specials."""

import base64
import json
from pathlib import Path

# Kimi's pre-tokenizer, written out here from its published description (not imported from k3dist).
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",  # noqa: E501
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",  # noqa: E501
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 9: "[EOT]"}
KIMI_OFFSETS |= {10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
# Whole strings and the pieces Kimi's pattern cuts them into, so a wrong pattern changes the ids.
WORDS = ["中文English混合", "中文", "English", "混合", "HelloWorldFooBar", "Hello", "World", "Foo", "Bar"]
WORDS += ["1234567", "123", "456", " hi", "hi", "abc", " the", " world", "   ", "\n\n", "don't", " I'm"]


def chain(words: list[str]) -> list[bytes]:
    """Every byte prefix (2 bytes and longer) of each word, in order: BPE can then build each word whole."""
    out: dict[bytes, None] = {}
    for word in words:
        data = word.encode()
        for end in range(2, len(data) + 1):
            out.setdefault(data[:end])
    return list(out)


def write_kimi_dir(path: Path, words: list[str] = WORDS, eos_in_config: bool = True) -> tuple[dict, dict]:
    """tiktoken.model, tokenizer_config.json (named specials only) and config.json; returns (ranks, specials)."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + [t for t in chain(words) if len(t) > 1]
    ranks = {t: r for r, t in enumerate(tokens)}
    (path / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    block = len(ranks)
    added = {str(block + o): {"content": name, "special": True} for o, name in KIMI_OFFSETS.items()}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if eos_in_config:
        (path / "config.json").write_text(json.dumps({"bos_token_id": block, "eos_token_id": block + 2}))
    names = {block + o: name for o, name in KIMI_OFFSETS.items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(block, block + 256)}
    return ranks, specials
