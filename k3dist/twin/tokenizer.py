"""A tokenizer for the seeded random twin, in Kimi's layout, so twin checkpoints take and give text.

No package ships Kimi's vocabulary, so the twin trains a small byte-level BPE with Kimi's pattern on the corpus kept
next to this file (`tokenizers`' BpeTrainer: about 0.1 s, and the same merges in every process), then fills the rest
of the base ranks with concatenations of trained tokens: the random model emits every id below vocab_size, so every
one must decode to text. The special tokens sit at the model family's offsets in the last 256 ids, in one of two
chat formats (docs/tool-calls.md):
- `kimi_k2` (Kimi-Linear's): the `<|im_...|>` turn tokens and Kimi's five tool-call tokens (flagged not special, as
  Kimi flags them), with chat_template.jinja;
- `kimi_k3` (K3's): `<|end_of_msg|>` where `<|im_end|>` was, the `<|open|>`, `<|close|>`, `<|sep|>` markup K3 writes
  its messages, thinking, answers and tool calls in, K3's media tokens, with k3_chat_template.jinja (the twin's own
  template in K3's format, rendering what K3's does for every feature the server serves).
So a server on the twin renders chats and tool calls the way the family's checkpoints do, and makes tool calls.
"""

import base64
import json
import shutil
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ..text.json_tokenizer import byte_level_chars
from ..text.kimi_bpe import PATTERN, SPECIAL_BLOCK

TWIN_TOKENIZER_VERSION = 2  # part of the twin cache key: bump when the files written here change
K3_TOKENIZER_VERSION = 1  # part of a K3 twin's key too: bump when what the kimi_k3 format writes changes
CORPUS = Path(__file__).with_name("corpus.txt")
TEMPLATE = Path(__file__).with_name("chat_template.jinja")
K3_TEMPLATE = Path(__file__).with_name("k3_chat_template.jinja")
KIMI_K2, KIMI_K3 = "kimi_k2", "kimi_k3"  # the chat formats
# Offset in the special block -> token, as in Kimi-Linear's tokenizer_config.json.
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 9: "[EOT]"}
KIMI_SPECIALS |= {10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
KIMI_TOOL_TOKENS = {
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
}
# K3's special block: the turn end and the markup at offsets 2-5 (where Kimi's <|im_end|>, <|im_user|>,
# <|im_assistant|> were), the media tokens at 18-21 (config.json's media_placeholder_token_id is block + 21).
K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>"}
K3_SPECIALS |= {6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>"}
K3_SPECIALS |= {19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>"}
K3_SPECIALS |= {254: "[UNK]", 255: "[PAD]"}
FORMATS = {  # chat format -> (special tokens, tokens flagged not special, the template)
    KIMI_K2: (KIMI_SPECIALS, KIMI_TOOL_TOKENS, TEMPLATE),
    KIMI_K3: (K3_SPECIALS, {}, K3_TEMPLATE),
}
MODEL_MAX_LENGTH = 1_048_576


@lru_cache(maxsize=1)
def trained_tokens() -> tuple[bytes, ...]:
    """The merged tokens of a byte-level BPE trained on the corpus with Kimi's pattern, in merge order."""
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 20, min_frequency=2, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    chars = byte_level_chars()
    merges = json.loads(bpe.to_str())["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return tuple(dict.fromkeys(bytes(chars[c] for c in left + right) for left, right in pairs))


def base_tokens(count: int) -> list[bytes]:
    """`count` unique tokens, rank order: the 256 bytes, the trained merges, then fillers.

    A filler is a trained token that is whole UTF-8 text followed by another such token (fillers themselves join
    the left side as they are made), taken in order until `count` are reached, so the list is the same every time.
    """
    tokens = [bytes([b]) for b in range(256)][:count]
    tokens += trained_tokens()[: max(count - len(tokens), 0)]
    seen = set(tokens)
    parts = [t for t in trained_tokens() if _is_text(t)]
    left_side, next_left = list(parts), 0
    while len(tokens) < count:
        left = left_side[next_left]
        next_left += 1
        for right in parts:
            candidate = left + right
            if candidate not in seen:
                seen.add(candidate)
                tokens.append(candidate)
                left_side.append(candidate)
                if len(tokens) == count:
                    break
    return tokens


def _is_text(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def write_tokenizer(
    out_dir: str | Path, vocab_size: int, eos_token_id, bos_token_id, chat_format: str = KIMI_K2
) -> None:
    """Write tiktoken.model, tokenizer_config.json, chat_template.jinja and generation_config.json into `out_dir`.

    The base vocabulary is ids 0..vocab_size-257, the special block the last 256 ids (Kimi: 163584 + 256), its
    tokens and the template those of `chat_format` (kimi_k2 or kimi_k3). generation_config.json stops on the config's
    eos ids and on the turn's end (block + 2: <|im_end|>, or K3's <|end_of_msg|>) and [EOS].
    """
    if vocab_size < 2 * SPECIAL_BLOCK:
        raise ValueError(f"the twin tokenizer needs vocab_size >= {2 * SPECIAL_BLOCK}, got {vocab_size}")
    if chat_format not in FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(FORMATS)}, got {chat_format!r}")
    specials, plain, template = FORMATS[chat_format]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    block = vocab_size - SPECIAL_BLOCK
    tokens = base_tokens(block)
    (out_dir / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    added = {str(block + offset): {"content": name, **flags, "special": True} for offset, name in specials.items()}
    added |= {str(block + offset): {"content": name, **flags, "special": False} for offset, name in plain.items()}
    added = dict(sorted(added.items(), key=lambda item: int(item[0])))
    tok_config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    declared = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id] if eos_token_id is not None else []
    eos = list(dict.fromkeys([*declared, block + 2, block + 1]))  # + the turn's end, [EOS]
    gen_config = {"eos_token_id": eos} | ({"bos_token_id": bos_token_id} if bos_token_id is not None else {})
    _write_json(out_dir / "generation_config.json", gen_config)
    shutil.copyfile(template, out_dir / "chat_template.jinja")


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
