"""The twin's tokenizer: Kimi's layout at the config's ids, every id decodes, same bytes every time, fast."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import tiktoken

from k3dist.text.chat import load_chat_template, render_chat
from k3dist.text.kimi_bpe import SPECIAL_BLOCK
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin import checkpoint as twin
from k3dist.twin.checkpoint import ensure_twin, write_checkpoint
from k3dist.twin.tokenizer import CORPUS, trained_tokens, write_tokenizer
from tests.support.configs import small_config, twin_config
from tests.support.kimi_files import KIMI_OFFSETS, KIMI_PATTERN

FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SAMPLE = "The keeper wound the clock at 07:42. 山城的雨季 started; HelloWorld = parseJsonValue(x) + 12345!\n"


@pytest.fixture(scope="module")
def kimi_twin(tmp_path_factory):
    """The tokenizer for the 0.40B twin config, written next to that config; and how long the write took."""
    path = tmp_path_factory.mktemp("twin")
    raw = twin_config()
    (path / "config.json").write_text(json.dumps(raw))
    trained_tokens()  # training is cached per process; time the write itself
    start = time.perf_counter()
    write_tokenizer(path, raw["vocab_size"], raw["eos_token_id"], raw["bos_token_id"])
    return path, raw, time.perf_counter() - start


def test_specials_land_where_config_json_says(kimi_twin):
    path, raw, _ = kimi_twin
    tok = load_tokenizer(path)
    assert tok.vocab_size == raw["vocab_size"] == 163_840
    assert tok.bos_id == raw["bos_token_id"] == tok.special_ids["[BOS]"] == 163_584
    assert tok.eos_ids[0] == raw["eos_token_id"] == tok.special_ids["<|im_end|>"] == 163_586
    assert tok.eos_ids == (163_586, 163_585, 163_593)  # <|im_end|>, [EOS], [EOT]
    assert raw["pad_token_id"] == tok.special_ids["[PAD]"]
    assert {name: tok.special_ids[name] - 163_584 for name in KIMI_OFFSETS.values()} == {
        name: offset for offset, name in KIMI_OFFSETS.items()
    }
    lines = (path / "tiktoken.model").read_bytes().splitlines()
    assert len(lines) == len({line.split()[0] for line in lines}) == 163_840 - SPECIAL_BLOCK
    assert [int(line.split()[1]) for line in lines[:3]] == [0, 1, 2]


def test_every_id_decodes_and_text_round_trips(kimi_twin):
    path, raw, _ = kimi_twin
    tok = load_tokenizer(path)
    pieces = [tok.decode([i]) for i in range(raw["vocab_size"])]
    assert all(pieces)
    assert pieces[163_588] == "<|im_assistant|>" and pieces[163_600] == "<|reserved_token_163600|>"
    trained = trained_tokens()
    assert len(trained) > 1500  # the corpus gives real merges, not just fillers
    text = CORPUS.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) / 2.5  # it compresses its own corpus
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.encode("<|im_user|>hi<|im_end|>")[0] == 163_587


def test_ids_equal_a_tiktoken_encoding_of_the_written_files(kimi_twin):
    path, _, _ = kimi_twin
    tok = load_tokenizer(path)
    lines = (path / "tiktoken.model").read_bytes().splitlines()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}
    reference = tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_ids)
    for text in [CORPUS.read_text(encoding="utf-8"), SAMPLE, "<|im_user|>user<|im_middle|>中文English混合<|im_end|>"]:
        assert tok.encode(text) == reference.encode(text, allowed_special="all")


def test_chat_template_renders_kimi_turns(kimi_twin):
    path, _, _ = kimi_twin
    template, source = load_chat_template(path)
    messages = [
        {"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."},
        {"role": "user", "content": "Is 123 a prime?"},
    ]
    text = render_chat(template, source, messages)
    assert text == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant provided by Moonshot-AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    tok = load_tokenizer(path)
    ids = tok.encode(text)
    turns = [163_594, 163_601, 163_586, 163_587, 163_601, 163_586, 163_588, 163_601]  # system, user, assistant
    assert [i for i in ids if i >= 163_584] == turns and ids[-1] == 163_601 and tok.decode(ids) == text
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [163_586, 163_585], "bos_token_id": 163_584}


def test_same_bytes_every_time_and_in_another_process(kimi_twin, tmp_path):
    path, raw, _ = kimi_twin
    write_tokenizer(tmp_path, raw["vocab_size"], raw["eos_token_id"], raw["bos_token_id"])
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (path / name).read_bytes(), name
    code = (
        "import sys, hashlib; from k3dist.twin.tokenizer import write_tokenizer as w; "
        "w(sys.argv[1], 163840, 163586, 163584); "
        "print(hashlib.sha256(open(sys.argv[1] + '/tiktoken.model', 'rb').read()).hexdigest())"
    )
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p")], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == hashlib.sha256((path / "tiktoken.model").read_bytes()).hexdigest(), out.stderr


@pytest.mark.timing
def test_write_is_fast(kimi_twin):
    _, _, seconds = kimi_twin
    assert seconds < 1.5, f"writing 163,584 ranks took {seconds:.2f} s"
    start = time.perf_counter()
    load_tokenizer(kimi_twin[0]).encode("abc" * 10_000)
    assert time.perf_counter() - start < 3.0


def test_smallest_vocab_is_bytes_and_the_block(tmp_path):
    write_tokenizer(tmp_path, 512, 2, 1)
    tok = load_tokenizer(tmp_path)
    lines = (tmp_path / "tiktoken.model").read_bytes().splitlines()
    assert [base64.b64decode(line.split()[0]) for line in lines] == [bytes([b]) for b in range(256)]
    assert tok.special_ids["[BOS]"] == 256 and tok.special_ids["[PAD]"] == 511 and tok.vocab_size == 512
    assert all(tok.decode([i]) for i in range(512))
    assert tok.bos_id == 1 and tok.eos_ids == (2, 258, 257, 265)  # the config's ids come first
    with pytest.raises(ValueError, match="vocab_size >= 512"):
        write_tokenizer(tmp_path / "small", 511, 2, 1)


def test_write_checkpoint_writes_the_tokenizer(tmp_path):
    with_tok = write_checkpoint(small_config(), tmp_path / "a", seed=1)
    assert all((with_tok / name).is_file() for name in FILES)
    assert load_tokenizer(with_tok).vocab_size == 512
    without = write_checkpoint(small_config(), tmp_path / "b", seed=1, tokenizer=False)
    assert not any((without / name).exists() for name in FILES)
    odd = write_checkpoint(small_config(vocab_size=509), tmp_path / "c", seed=1)
    assert not any((odd / name).exists() for name in FILES) and load_tokenizer(odd) is None


def test_twin_cache_key_has_the_tokenizer_version(tmp_path, monkeypatch):
    config = tmp_path / "small.json"
    config.write_text(json.dumps(small_config()))
    first = ensure_twin(config, root=tmp_path / "cache")
    assert (first / "tiktoken.model").is_file() and ensure_twin(config, root=tmp_path / "cache") == first
    monkeypatch.setattr(twin, "TWIN_TOKENIZER_VERSION", 1_000)
    assert ensure_twin(config, root=tmp_path / "cache") != first
