"""The model dir's tokenizer behind one interface, with the ids generation stops on and the named special tokens.

`tiktoken.model` (Kimi's own format) wins over `tokenizer.json`: conversions of Kimi checkpoints to `tokenizer.json`
have been made with a generic cl100k-style pattern that splits CamelCase and Han/Latin text differently.

K3 writes every answer in tags of three markup tokens (`<|open|>think<|sep|>...<|close|>think<|sep|>`, then the
response's and the tool calls' tags): whatever flag the tokenizer's files give them, they stay in decoded text under
skip_special_tokens, as Kimi's tool-call tokens do, since the server reads the answer's parts from them
(docs/tool-calls.md).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..base.errors import K3Error
from ..base.files import optional_file, read_json_object
from .json_tokenizer import JsonTokenizer
from .kimi_bpe import KimiTiktoken

RANKS_FILE, JSON_FILE = "tiktoken.model", "tokenizer.json"
TOKENIZER_CONFIG, GENERATION_CONFIG, MODEL_CONFIG = "tokenizer_config.json", "generation_config.json", "config.json"
MAX_TOKEN_ID = 2**31  # token ids are int32 in the tokenizers' own tables
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
END_OF_TEXT = "[EOT]"
MARKUP = ("<|open|>", "<|close|>", "<|sep|>")  # K3's tag markup: kept in decoded text whatever skip_special_tokens says


class Backend(Protocol):
    special_ids: dict[str, int]  # every added token: text -> id
    marked_special: frozenset[int]  # those the tokenizer's files mark special: what skip_special_tokens leaves out
    vocab_size: int

    max_token_chars: int  # the most characters of text one token covers

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...
    def token_id(self, content: str) -> int | None: ...


class Tokenizer:
    """Text <-> ids. Special tokens' text in the input always becomes their ids; nothing is added (no BOS)."""

    def __init__(
        self,
        backend: Backend,
        eos_ids: tuple[int, ...],
        bos_id: int | None,
        named_tokens: dict[str, str],
        source: Path,
    ):
        self.backend = backend
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.named_tokens = named_tokens  # bos_token/eos_token/... -> text, the variables chat templates expect
        self.source = source
        self.cap: int | None = None  # the cache.cap prompts are for (`hold`): longer texts are refused untokenized
        self.markup = frozenset(i for name in MARKUP if (i := backend.token_id(name)) is not None)

    @property
    def special_ids(self) -> dict[str, int]:
        return self.backend.special_ids

    @property
    def marked_special(self) -> frozenset[int]:
        """The ids marked special, less K3's markup (Kimi's tool-call tokens are not marked): what
        skip_special_tokens leaves out of text."""
        return self.backend.marked_special - self.markup

    @property
    def vocab_size(self) -> int:
        """Highest id + 1."""
        return self.backend.vocab_size

    def hold(self, cap: int) -> None:
        """Prompts are for slots of `cap` tokens: from now on a text that could never fit is refused before it is
        tokenized (tokenizing megabytes takes seconds of a server's CPU, gigabytes minutes)."""
        self.cap = cap

    @property
    def max_chars(self) -> int | None:
        """The longest text `cap` tokens could cover (None: no cap set): no token covers more than max_token_chars."""
        return None if self.cap is None else self.cap * self.backend.max_token_chars

    def encode(self, text: str) -> list[int]:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise K3Error(
                f"the prompt text has {len(text)} characters: more than cache.cap={self.cap} tokens of at most "
                f"{self.backend.max_token_chars} characters each could hold ({self.max_chars})"
            )
        return self.backend.encode(text)

    def encode_any(self, text: str) -> list[int]:
        """Text of any length (not held to `cap`: the tokenizer routes count a document's tokens, as vLLM does)."""
        return self.backend.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """UTF-8 text; bytes that are not UTF-8 become U+FFFD, ids that name no token add nothing."""
        return self.backend.decode(ids)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.backend.decode_bytes(ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, bos_id={self.bos_id})"


def load_tokenizer(model_dir: str | Path, config: dict | None = None) -> Tokenizer | None:
    """The tokenizer of `model_dir`, or None when it has neither `tiktoken.model` nor `tokenizer.json`.

    `config` is the model's config.json already parsed; without it config.json is read from the dir if present.
    """
    model_dir = Path(model_dir)
    ranks = optional_file(model_dir, RANKS_FILE, "the tokenizer")
    json_file = None if ranks else optional_file(model_dir, JSON_FILE, "the tokenizer")
    if ranks is None and json_file is None:
        return None
    tok_config_path = optional_file(model_dir, TOKENIZER_CONFIG, "the tokenizer config")
    tok_config = read_json_object(tok_config_path) if tok_config_path else {}
    if ranks:
        added, plain = added_tokens(tok_config, tok_config_path), not_special(tok_config)
        backend: Backend = KimiTiktoken(ranks, added, tok_config_path or ranks, plain)
    else:
        backend = JsonTokenizer(json_file)
    gen_path = optional_file(model_dir, GENERATION_CONFIG, "the generation config")
    gen_config = read_json_object(gen_path) if gen_path else {}
    if config is None:
        config_path = optional_file(model_dir, MODEL_CONFIG, "the model config")
        config = read_json_object(config_path) if config_path else {}
    config_source = model_dir / MODEL_CONFIG
    named = named_tokens(tok_config, tok_config_path)
    declared = [
        *token_ids(gen_config.get("eos_token_id"), gen_path, "eos_token_id"),
        *token_ids(config.get("eos_token_id"), config_source, "eos_token_id"),
        *([_id_of(backend, named["eos_token"], tok_config_path, "eos_token")] if "eos_token" in named else []),
    ]
    bos_candidates = [
        *token_ids(gen_config.get("bos_token_id"), gen_path, "bos_token_id", single=True),
        *token_ids(config.get("bos_token_id"), config_source, "bos_token_id", single=True),
        *([_id_of(backend, named["bos_token"], tok_config_path, "bos_token")] if "bos_token" in named else []),
    ]
    source = ranks or json_file
    return Tokenizer(backend, eos_ids(declared, backend.special_ids), next(iter(bos_candidates), None), named, source)


def eos_ids(declared: list[int], special_ids: dict[str, int]) -> tuple[int, ...]:
    """The declared eos ids (generation config, model config, tokenizer config), in that order, then [EOT].

    [EOT] ends a text in Kimi's vocabulary; a model that emits it has finished, and whatever it produced after it
    would belong to another document, so generation stops on it as Kimi's ports do, even though no config of the
    checkpoint declares it. It comes last, so eos_ids[0] stays the checkpoint's own first choice.
    """
    found = list(declared)
    if END_OF_TEXT in special_ids:
        found.append(special_ids[END_OF_TEXT])
    return tuple(dict.fromkeys(found))


def added_tokens(tok_config: dict, source: Path | None) -> dict[int, str]:
    """`added_tokens_decoder` of tokenizer_config.json: id -> content."""
    raw = tok_config.get("added_tokens_decoder") or {}
    if not isinstance(raw, dict):
        raise K3Error(f"{source}: added_tokens_decoder must be an object of id -> token, got {type(raw).__name__}")
    names: dict[int, str] = {}
    for key, entry in raw.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not key.isdigit() or not isinstance(content, str) or not content:
            raise K3Error(f"{source}: added_tokens_decoder entry {key!r}: {entry!r} is not an id with a 'content' text")
        if int(key) >= MAX_TOKEN_ID:
            raise K3Error(f"{source}: added_tokens_decoder id {key} is beyond any vocabulary (ids must be < 2**31)")
        names[int(key)] = content
    return names


def not_special(tok_config: dict) -> frozenset[int]:
    """The added tokens tokenizer_config.json flags `"special": false` (Kimi's tool-call tokens): their text stays in
    the output whatever skip_special_tokens says."""
    raw = tok_config.get("added_tokens_decoder") or {}
    return frozenset(int(k) for k, v in raw.items() if isinstance(v, dict) and v.get("special") is False)


def named_tokens(tok_config: dict, source: Path | None) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token of tokenizer_config.json (text or {"content": text})."""
    named = {}
    for key in NAMED_TOKENS:
        value = tok_config.get(key)
        if value is None:
            continue
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str):
            raise K3Error(f"{source}: {key} must be a token text or {{'content': text}}, got {value!r}")
        named[key] = content
    return named


def token_ids(value, source: Path | None, key: str, single: bool = False) -> list[int]:
    """An id or a list of ids (None: none); anything else is a K3Error naming the file and key."""
    if value is None:
        return []
    values = [value] if isinstance(value, int) or single else value
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        kind = "a token id" if single else "a token id or a list of token ids"
        raise K3Error(f"{source}: {key} must be {kind}, got {value!r}")
    return values


def _id_of(backend: Backend, content: str, source: Path | None, key: str) -> int:
    token_id = backend.token_id(content)
    if token_id is None:
        raise K3Error(f"{source}: {key} {content!r} is not a token of the tokenizer")
    return token_id
