"""The tokenizer: ids equal to the reference tiktoken encoding with Kimi's pattern, tokenizer.json, eos, bad files."""

import json
import os

import pytest
import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from k3dist.base.errors import K3Error
from k3dist.text.json_tokenizer import byte_level_chars
from k3dist.text.kimi_bpe import pieces
from k3dist.text.tokenizer import load_tokenizer
from tests.support.kimi_files import KIMI_PATTERN, write_kimi_dir

TEXTS = [
    "中文English混合",
    "HelloWorldFooBar",
    "1234567",
    "  leading, inner   and trailing whitespace   ",
    "tabs\tand\r\nnew\n\n\nlines \n",
    "<|im_user|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]don't I'm HELLO's world[EOS]",
    "emoji 🙂 and accents: café, naïve, Ångström; 日本語のテキスト",
    "",
]


@pytest.fixture
def kimi(tmp_path):
    ranks, specials = write_kimi_dir(tmp_path / "m")
    reference = tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return load_tokenizer(tmp_path / "m"), reference, ranks


def reference_cuts(text: str) -> list[str]:
    """The reference's cutting, character by character: 400,000-char pieces, runs longer than 25,000 cut."""
    out = []
    for begin in range(0, len(text), 400_000):
        piece, start, run, in_space = text[begin : begin + 400_000], 0, 0, None
        for i, ch in enumerate(piece):
            run = run + 1 if ch.isspace() == in_space else 1
            in_space = ch.isspace()
            if run > 25_000:
                out.append(piece[start:i])
                start, run = i, 1
        out.append(piece[start:])
    return out


def test_ids_equal_the_reference_encoding_and_decode_back(kimi):
    tok, reference, _ = kimi
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode()


def test_kimi_pattern_effects(kimi):
    tok, _, ranks = kimi
    plain = tiktoken.Encoding("plain", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})

    def split(text, enc=tok):
        return [enc.decode([i]) for i in enc.encode(text)]

    assert split("中文English混合") == ["中文", "English", "混合"]
    assert split("HelloWorldFooBar") == ["Hello", "World", "Foo", "Bar"]
    assert split("1234567") == ["123", "456", "7"]
    # The same ranks without Kimi's pattern build each whole string: the test would catch a wrong pattern.
    assert split("HelloWorldFooBar", plain) == ["HelloWorldFooBar"]
    assert split("中文English混合", plain) == ["中文English混合"]


def test_special_tokens_reserved_names_vocab_and_eos(kimi):
    tok, _, ranks = kimi
    block = len(ranks)
    assert tok.special_ids["[BOS]"] == block and tok.special_ids["<|im_end|>"] == block + 2
    assert tok.special_ids[f"<|reserved_token_{block + 5}|>"] == block + 5
    assert tok.encode(f"<|reserved_token_{block + 5}|>") == [block + 5]
    assert tok.encode("<|im_user|>hi<|im_end|>") == [block + 3, tok.encode("hi")[0], block + 2]
    assert tok.vocab_size == block + 256 and len(tok.special_ids) == 256
    # config.json's eos (<|im_end|>), tokenizer_config's eos_token ([EOS]), then [EOT]
    assert tok.eos_ids == (block + 2, block + 1, block + 9)
    assert tok.bos_id == block
    assert tok.named_tokens == {"bos_token": "[BOS]", "eos_token": "[EOS]"}


def test_eos_union_order_with_generation_config_and_passed_config(tmp_path):
    _, specials = write_kimi_dir(tmp_path, eos_in_config=False)
    block = specials["[BOS]"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [block + 4, block + 2]}))
    tok = load_tokenizer(tmp_path, {"eos_token_id": block + 2, "bos_token_id": 7})
    assert tok.eos_ids == (block + 4, block + 2, block + 1, block + 9)
    assert tok.bos_id == 7  # the model config's bos beats tokenizer_config's [BOS]


def test_long_runs_are_cut_like_the_reference(kimi):
    tok, reference, _ = kimi
    run = "abc" * 10_000  # 30,000 letters: one pre-token, cut at 25,000 (inside an "abc")
    cuts = reference_cuts(run)
    assert [len(c) for c in cuts] == [25_000, 5_000]
    expect = [i for c in cuts for i in reference.encode(c, allowed_special="all")]
    assert tok.encode(run) == expect
    assert expect != reference.encode(run)  # the cut is visible in the ids
    mixed = "x" * 30_000 + " " * 60_000 + "y"
    assert list(pieces(mixed)) == reference_cuts(mixed)
    assert [len(p) for p in pieces(mixed)] == [25_000, 30_000, 25_000, 10_001]
    words = "word " * 90_000  # 450,000 characters: two pieces for tiktoken
    assert list(pieces(words)) == reference_cuts(words) == [words[:400_000], words[400_000:]]
    assert tok.encode(words) == [i for c in reference_cuts(words) for i in reference.encode(c)]
    assert tok.decode(tok.encode(mixed)) == mixed


def test_unknown_ids_decode_to_nothing(kimi):
    tok, _, _ = kimi
    hi = tok.encode("hi")
    assert tok.decode([*hi, tok.vocab_size + 5, -1, *hi]) == "hihi"


def test_tokenizer_json_encodes_and_decodes_like_tokenizers(tmp_path):
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|im_end|>", "[EOS]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["hello world 你好世界 " * 20, "tokenizers are fast, 中文也可以"], trainer=trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = load_tokenizer(tmp_path)
    for text in ["hello world", "你好世界<|im_end|>", "unseen Wörter 🙂", "[EOS] and <|im_end|>"]:
        ids = tok.encode(text)
        assert ids == bpe.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == bpe.decode(ids, skip_special_tokens=False) == text
        for k in range(len(ids) + 1):  # per-token bytes, split characters included, agree with tokenizers
            assert tok.decode_bytes(ids[:k]).decode("utf-8", "replace") == bpe.decode(
                ids[:k], skip_special_tokens=False
            )
    assert tok.special_ids == {"<|im_end|>": 0, "[EOS]": 1}
    assert tok.eos_ids == (0,) and tok.vocab_size == bpe.get_vocab_size()
    longest = max(len(tok.decode_bytes([i])) for i in range(tok.vocab_size))  # a token's bytes, specials' text
    assert tok.backend.max_token_chars == longest
    assert set(byte_level_chars()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_tiktoken_model_wins_and_no_tokenizer_is_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    write_kimi_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not even json")
    assert load_tokenizer(tmp_path).source.name == "tiktoken.model"


@pytest.mark.parametrize(
    "line, why",
    [
        (b"aGk=", "expected 'base64 rank'"),
        (b"aGk= 1 2", "expected 'base64 rank'"),
        (b"aGk= x", "expected 'base64 rank'"),
        (b"a*k= 300", "is not base64"),
        (b"YQ== 300", "token b'a' already has rank 97"),
        (b"eHl6 5", "rank 5 is already given on line 6"),
    ],
)
def test_bad_tiktoken_model_lines_name_the_line(tmp_path, line, why):
    write_kimi_dir(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_bytes().splitlines()
    lines.insert(299, line)
    (tmp_path / "tiktoken.model").write_bytes(b"\n".join(lines))
    with pytest.raises(K3Error, match=rf"tiktoken.model:300: .*{why}"):
        load_tokenizer(tmp_path)


def test_bad_tokenizer_files(tmp_path):
    write_kimi_dir(tmp_path)
    model = tmp_path / "tiktoken.model"
    good = model.read_bytes()
    model.write_bytes(b"\n".join(good.splitlines()[1:]))  # drops the byte 0x00 (rank 0)
    with pytest.raises(K3Error, match="tiktoken.model: ranks must be 0..* rank 0 is missing"):
        load_tokenizer(tmp_path)
    model.write_bytes(good)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "[BOS]",\n "eos_token": }')
    with pytest.raises(K3Error, match=r"tokenizer_config.json:2: not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(K3Error, match=r"tokenizer_config.json: eos_token '<\|nope\|>' is not a token"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"3": {"content": "[X]"}}}')
    with pytest.raises(K3Error, match=r"tokenizer_config.json: added token id 3 .* is a base token id"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"100000000000": {"content": "[F]"}}}')
    with pytest.raises(K3Error, match=r"tokenizer_config.json: added_tokens_decoder id 100000000000 is beyond"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "[EOS]"}')
    with pytest.raises(K3Error, match=r"generation_config.json: eos_token_id must be a token id or a list"):
        load_tokenizer(tmp_path)


def test_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{\n"model": {\n"type": "BPE",,\n}}')
    with pytest.raises(K3Error, match=r"tokenizer.json:3: not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    with pytest.raises(K3Error, match=r"tokenizer.json: not a tokenizers file"):
        load_tokenizer(tmp_path)


def test_files_outside_the_model_dir_are_refused(tmp_path):
    write_kimi_dir(tmp_path / "elsewhere")
    (tmp_path / "m").mkdir()
    os.symlink(tmp_path / "elsewhere" / "tiktoken.model", tmp_path / "m" / "tiktoken.model")
    with pytest.raises(K3Error, match="outside the model dir"):
        load_tokenizer(tmp_path / "m")


def test_a_text_no_slot_could_hold_is_refused_untokenized(kimi):
    """Held to slots of 8 tokens, a text longer than 8 of the longest tokens is refused before any tokenizing; one
    that long still tokenizes (and is then refused for its token count, not here)."""
    tok, _, ranks = kimi
    longest = max(max(map(len, ranks)), max(map(len, tok.special_ids)))
    assert tok.backend.max_token_chars == longest and tok.max_chars is None
    tok.hold(8)
    assert tok.max_chars == 8 * longest and tok.encode("a" * tok.max_chars)
    with pytest.raises(K3Error, match=rf"has {8 * longest + 1} characters: more than cache.cap=8 tokens of at most"):
        tok.encode("a" * (8 * longest + 1))
