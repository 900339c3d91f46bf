"""Streamed detokenizing: split characters held back, stop strings cut exactly, the same text for every split."""

import codecs

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3dist.text.stream import TextAssembler
from k3dist.text.tokenizer import load_tokenizer
from tests.support.kimi_files import write_kimi_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    write_kimi_dir(path)
    return load_tokenizer(path)


def one_token(tok, text: str) -> int:
    [token_id] = tok.encode(text)
    return token_id


def test_split_character_waits_for_its_last_byte(tok):
    han = "中".encode()  # e4 b8 ad: single-byte tokens 0xe4, 0xb8, 0xad
    asm = TextAssembler(tok)
    assert asm.feed([han[0]]) == ("", None)
    assert asm.feed([han[1]]) == ("", None)
    assert asm.feed([han[2], one_token(tok, "hi")]) == ("中hi", None)
    assert asm.finish() == "" and asm.text == "中hi"
    cut = TextAssembler(tok)
    assert cut.feed([one_token(tok, "hi"), han[0], han[1]]) == ("hi", None)
    assert cut.finish() == "\ufffd" and cut.text == "hi\ufffd"


def test_stop_string_across_tokens_is_cut_exactly(tok):
    ids = [one_token(tok, "Hello"), one_token(tok, " world"), one_token(tok, "!")]
    asm = TextAssembler(tok, stop=["o w"])
    assert asm.feed(ids) == ("Hell", 1)  # completed by " world"; "!" is not consumed
    assert asm.stop_string == "o w" and asm.text == "Hell"
    assert asm.feed(ids) == ("", None) and asm.finish() == "" and asm.text == "Hell"


def test_tail_that_may_become_a_stop_is_held_back(tok):
    asm = TextAssembler(tok, stop=["world!", "zz"])
    assert asm.feed([one_token(tok, "Hello"), one_token(tok, " world")]) == ("Hello ", None)
    assert asm.text == "Hello world"
    assert asm.feed([one_token(tok, "?")]) == ("world?", None)
    assert asm.feed([ord("z")]) == ("", None)
    assert asm.finish() == "z" and asm.text == "Hello world?z" and not asm.stopped


def test_stop_inside_one_token_and_first_ending_stop_wins(tok):
    asm = TextAssembler(tok, stop=["ll"])
    assert asm.feed([one_token(tok, "Hello"), one_token(tok, "!")]) == ("He", 0)
    both = TextAssembler(tok, stop=["abcd", "bc"])
    assert both.feed([one_token(tok, "abc"), ord("d")]) == ("a", 0)  # "bc" ends first
    tie = TextAssembler(tok, stop=["c", "abc"])
    assert tie.feed([one_token(tok, "abc")]) == ("", 0) and tie.stop_string == "abc"  # same end: earlier start


def test_skip_ids_add_no_text(tok):
    eos = tok.special_ids["<|im_end|>"]
    asm = TextAssembler(tok, skip_ids=[eos])
    hi = one_token(tok, "hi")
    assert asm.feed([hi, eos, hi]) == ("hihi", None)
    assert TextAssembler(tok).feed([hi, eos]) == ("hi<|im_end|>", None)


def test_special_tokens_skipped_or_spaced_as_vllm_joins_them(tok):
    """skip_special_tokens drops the marked ones; without it spaces_between_special_tokens sets each apart by a space
    from the text beside it (the pieces joined by spaces), as vLLM detokenizes for a slow tokenizer such as Kimi's."""
    user, end, hi = tok.special_ids["<|im_user|>"], tok.special_ids["<|im_end|>"], one_token(tok, "hi")
    assert {user, end} <= tok.marked_special
    ids = [user, hi, hi, end, end, hi]
    assert TextAssembler(tok, skip_ids=tok.marked_special).feed(ids) == ("hihihi", None)
    spaced = TextAssembler(tok, spaced_ids=tok.marked_special)
    assert spaced.feed(ids[:2])[0] + spaced.feed(ids[2:])[0] == "<|im_user|> hihi <|im_end|> <|im_end|> hi"
    assert spaced.text == "<|im_user|> hihi <|im_end|> <|im_end|> hi"
    assert TextAssembler(tok).feed(ids)[0] == "<|im_user|>hihi<|im_end|><|im_end|>hi"


def test_empty_stop_string_is_refused(tok):
    with pytest.raises(ValueError, match="non-empty"):
        TextAssembler(tok, stop=["a", ""])


def expected(tok, ids, stops, skip):
    """The final text and the index of the stopping token, from the whole text at once."""
    kept = [i for i in ids if i not in skip]
    full = tok.decode_bytes(kept).decode("utf-8", errors="replace")
    hits = [(full.index(s) + len(s), full.index(s)) for s in stops if s in full]
    if not hits:
        return full, None
    end, start = min(hits)
    decoder, length = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
    for position, token_id in enumerate(ids):
        if token_id not in skip:
            length += len(decoder.decode(tok.decode_bytes([token_id])))
            if length >= end:
                return full[:start], position
    return full[:start], None  # completed by the flush at the end


TEXTS = st.text(alphabet=st.sampled_from("ab cd\n中文混合éHello World123🙂<|>"), max_size=30)


@st.composite
def cases(draw, tok):
    if draw(st.booleans()):
        ids = tok.encode(draw(TEXTS))
    else:
        ids = draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=25))
    full = tok.decode(ids)
    substring = st.builds(lambda a, n: full[a : a + n], st.integers(0, len(full)), st.integers(1, 4))
    stops = draw(st.lists(st.one_of(substring, TEXTS), max_size=3).map(lambda s: [x for x in s if x]))
    skip = draw(st.sets(st.sampled_from(ids), max_size=2)) if ids and draw(st.booleans()) else set()
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    return ids, stops, skip, cuts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_feeds_join_to_the_text_for_every_split(tok, data):
    ids, stops, skip, cuts = data.draw(cases(tok))
    asm = TextAssembler(tok, stop=stops, skip_ids=skip)
    printed, stop_at, bounds = [], None, [0, *cuts, len(ids)]
    for begin, end in zip(bounds, bounds[1:], strict=False):
        text, position = asm.feed(ids[begin:end])
        printed.append(text)
        if position is not None:
            stop_at = begin + position
            break
    printed.append(asm.finish())
    assert "".join(printed) == asm.text
    assert (asm.text, stop_at) == expected(tok, ids, stops, skip)
