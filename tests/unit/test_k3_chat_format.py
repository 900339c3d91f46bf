"""Kimi K3's chat format in k3dist: the twin's K3 template renders what K3's own template renders (the record in
tests/data/k3_template, and K3's template itself through k3dist's sandbox where a llama.cpp tree is at hand); the
recorded answers read back by the K3 parser; K3's special tokens where K3 has them, its markup kept in decoded text,
the Kimi-Linear twin's tokenizer byte for byte as before; the format chosen once per checkpoint; where a prompt leaves
the answer; and what the parser makes of answers gone wrong, whole and cut anywhere."""

import hashlib
import json
import random
from pathlib import Path

import pytest

from k3dist.serve.errors import APIError
from k3dist.serve.fields import Forms
from k3dist.serve.schema import ChatRequest
from k3dist.serve.tools import ToolCalls, chat_format
from k3dist.serve.tools_k3 import K3Format
from k3dist.text.chat import load_chat_template, render_chat
from k3dist.text.stream import TextAssembler
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin import checkpoint as twin
from k3dist.twin.checkpoint import ensure_twin, write_checkpoint
from k3dist.twin.tokenizer import K3_TEMPLATE, KIMI_K2, KIMI_K3, write_tokenizer
from tests.support import k3_template_cases as cases
from tests.support.configs import small_config
from tests.unit.test_k3_twin import small_k3

TWIN = Path(__file__).resolve().parents[2] / "k3dist" / "configs" / "Kimi-K3-twin-0.4B-config.json"
FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
KIMI_LINEAR_512 = "5eedd71989b2b77ce407ca147def3f6fe7af2ff9a9d6f74f41990aec813ae764"  # the files before K3 came


def _render(template: str, case: dict, source: str = "t.jinja") -> str:
    options = dict(add_generation_prompt=case.get("add_generation_prompt", True), variables=case.get("variables"))
    return render_chat(template, source, case["messages"], case.get("tools"), **options)


@pytest.mark.parametrize("case", cases.CASES, ids=[c["name"] for c in cases.CASES])
def test_the_twin_template_renders_what_k3s_does(case):
    assert _render(K3_TEMPLATE.read_text(), case) == cases.load()["renders"][case["name"]]


@pytest.mark.skipif(
    cases.tree() is None, reason="$LLAMA_CPP names no llama.cpp tree with models/templates/Kimi-K3.jinja"
)
def test_k3s_own_template_through_the_sandbox_renders_the_record():
    template, record = cases.template_of(cases.tree()), cases.load()
    assert hashlib.sha256(template.encode()).hexdigest() == record["template_sha256"], (
        "a new template: rerun the record"
    )
    for case in cases.CASES:
        assert _render(template, case, "Kimi-K3.jinja") == record["renders"][case["name"]], case["name"]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The K3 twin config's tokenizer (vocab 32768), as the K3 twin writes it."""
    path = tmp_path_factory.mktemp("k3tok")
    raw = json.loads(TWIN.read_text())
    write_tokenizer(path, 32768, raw["eos_token_id"], raw["bos_token_id"], KIMI_K3)
    return load_tokenizer(path, raw), raw


def test_k3s_special_tokens_sit_at_k3s_ids(k3):
    tok, raw = k3
    block = 32768 - 256
    named = {"<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5, "[EOT]": 9, "<|media_pad|>": 21}
    assert {name: tok.special_ids[name] - block for name in named} == named
    assert raw["eos_token_id"] == tok.eos_ids[0] == tok.special_ids["<|end_of_msg|>"]  # a turn ends generation
    assert raw["media_placeholder_token_id"] == tok.special_ids["<|media_pad|>"] and tok.bos_id == raw["bos_token_id"]
    assert "<|im_end|>" not in tok.special_ids and "<|tool_call_begin|>" not in tok.special_ids
    assert chat_format(tok).name == KIMI_K3


def test_k3s_markup_stays_in_decoded_text(k3):
    tok, _ = k3
    text = '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>'
    ids = [tok.special_ids["[BOS]"], *tok.encode(text), tok.special_ids["<|end_of_msg|>"]]
    skipped = TextAssembler(tok, (), (*tok.eos_ids, *tok.marked_special))
    assert skipped.feed(ids)[0] + skipped.finish() == text  # [BOS] and the end left out, the markup kept
    assert tok.special_ids["[BOS]"] in tok.marked_special and not tok.markup & tok.marked_special


def test_the_kimi_linear_twin_tokenizer_is_unchanged(tmp_path):
    write_tokenizer(tmp_path, 512, 2, 1)
    digest = hashlib.sha256(b"".join((tmp_path / name).read_bytes() for name in FILES)).hexdigest()
    assert digest == KIMI_LINEAR_512, "the kimi_k2 files changed: bump TWIN_TOKENIZER_VERSION and this digest"


def test_checkpoints_take_their_models_format_or_the_one_asked(tmp_path, monkeypatch):
    linear = write_checkpoint(small_config(), tmp_path / "a", seed=1)
    asked = write_checkpoint(small_config(), tmp_path / "b", seed=1, chat_format=KIMI_K3)
    k3 = write_checkpoint(small_k3(), tmp_path / "c", seed=1, variant="dequantized")
    for path, name in ((linear, KIMI_K2), (asked, KIMI_K3), (k3, KIMI_K3)):
        template = load_chat_template(path)[0]
        assert chat_format(load_tokenizer(path), template).name == name
    config = tmp_path / "k3.json"
    config.write_text(json.dumps(small_k3()))
    linear_config = tmp_path / "linear.json"
    linear_config.write_text(json.dumps(small_config()))
    before = [
        ensure_twin(c, root=tmp_path / "cache", variant=v) for c, v in ((config, "dequantized"), (linear_config, None))
    ]
    monkeypatch.setattr(twin, "K3_TOKENIZER_VERSION", 1_000)  # K3's tokens changed: K3 twins are written anew
    after = [
        ensure_twin(c, root=tmp_path / "cache", variant=v) for c, v in ((config, "dequantized"), (linear_config, None))
    ]
    assert after[0] != before[0] and after[1] == before[1]


def test_a_template_decides_between_two_formats_a_tokenizer_holds(tmp_path):
    write_tokenizer(tmp_path, 512, 2, 1, KIMI_K3)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    names = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"]
    names += ["<|tool_call_argument_begin|>", "<|tool_call_end|>"]
    for offset, name in enumerate(names, 11):
        config["added_tokens_decoder"][str(256 + offset)] = {"content": name, "special": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert chat_format(tok).name == KIMI_K2  # nothing else to go by: Kimi-Linear's
    assert chat_format(tok, K3_TEMPLATE.read_text()).name == KIMI_K3
    assert chat_format(tok, "{{ '<|tool_calls_section_begin|>' }}").name == KIMI_K2


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("small3")
    write_tokenizer(path, 512, 2, 1, KIMI_K3)
    tok = load_tokenizer(path)
    return tok, Forms(tok, 512, load_chat_template(path)[0])


@pytest.mark.parametrize(
    "variables, options, opened",
    [
        ({}, {}, "think"),
        ({"thinking": False}, {}, "response"),
        ({"thinking": False}, {"add_generation_prompt": False}, "start"),
        ({}, {"add_generation_prompt": False, "continue_final": True}, "response"),
    ],
)
def test_where_a_prompt_leaves_the_answer(small, variables, options, opened):
    tok, forms = small
    messages = [{"role": "user", "content": "Hi"}]
    if options.get("continue_final"):
        messages.append({"role": "assistant", "content": "The answer is"})
    text = render_chat(K3_TEMPLATE.read_text(), "t.jinja", messages, variables=variables, **options)
    assert forms.form.opening(tok, tok.encode(text)) == opened


def test_a_constrained_answer_needs_k3s_generation_prompt(small):
    tok, forms = small
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
    )
    plan = forms.plan(req)
    assert plan.engine["grammar"] is None and plan.pending is not None  # it waits on the prompt
    with pytest.raises(APIError) as refused:
        forms.bind(plan, tok.encode("no assistant message opened"))
    assert refused.value.param == "tools" and "generation prompt" in refused.value.message
    assert forms.bind(plan, tok.encode('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')).engine[
        "grammar"
    ]


def test_the_recorded_answers_read_back():
    """K3's own renders of assistant turns, after their opening tags: the calls, content and reasoning they hold."""
    turn = cases.load()["renders"]["tool-turn-results-by-id"].split('<|open|>message role="assistant"<|sep|>')[1]
    answer = turn.split("<|end_of_msg|>")[0].removeprefix("<|open|>think<|sep|>")
    content, reasoning, calls, finish = ToolCalls(_k3_form(), 1, True, True, "think").whole(0, answer, "stop")
    assert (content, reasoning, finish) == ("Checking.", "Tools first.", "tool_calls")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [cases.ARGS, {"q": 'rain "now"'}]
    assert [c["id"] for c in calls] == ["functions.get_weather:1", "functions.search.web:2"]


def _k3_form() -> K3Format:
    return K3Format(frozenset({1, 2, 3}), 4)  # any ids: the parser reads text


C, S = "<|close|>", "<|sep|>"
TOOLS, CALL = f"<|open|>tools{S}", f'<|open|>call tool="f" index="1"{S}'
ARG = f'<|open|>argument key="a" type="number"{S}'
NOT_A_NUMBER = f"{CALL}{ARG}x7{C}argument{S}{C}call{S}"
BAD_NAME = f'<|open|>call tool="b@d"{S}{C}call{S}'
NOT_AN_OBJECT = f'{CALL}<|open|>json type="object"{S} [1]{C}json{S}{C}call{S}'
ESCAPED = f'<|open|>call tool="f"{S}<|open|>argument key="k &amp; &quot;q&quot;"{S} 1 {C}argument{S}{C}call{S}'
WEIRD = [  # (opened, calls read, output, content, reasoning, calls' (name, arguments))
    ("think", True, "only thinking, cut", "", "only thinking, cut", []),
    ("think", True, f"t{C}think{S}no response opener{C}message{S}dropped", "no response opener", "t", []),
    ("response", True, f"a{TOOLS}{CALL}{ARG}7{C}argument{S}", "a", "", [("f", {"a": 7})]),  # no closers at all
    ("response", True, TOOLS + NOT_A_NUMBER, NOT_A_NUMBER, "", []),  # a call that does not parse: content
    ("response", True, TOOLS + BAD_NAME, BAD_NAME, "", []),
    ("response", False, f"{TOOLS}{CALL}{C}call{S}{C}tools{S}", f"{TOOLS}{CALL}{C}call{S}{C}tools{S}", "", []),  # none
    ("response", True, TOOLS + NOT_AN_OBJECT, NOT_AN_OBJECT, "", []),
    ("start", True, f'<|open|>message role="assistant"{S}<|open|>response{S}hi{C}response{S}', "hi", "", []),
    ("response", True, TOOLS + ESCAPED, "", "", [("f", {'k & "q"': 1})]),  # no type, no index: JSON, position
]  # fmt: skip


@pytest.mark.parametrize("opened, reads, text, content, reasoning, calls", WEIRD)
def test_answers_gone_wrong_read_the_same_whole_and_cut(opened, reads, text, content, reasoning, calls):
    whole = ToolCalls(_k3_form(), 1, reads, True, opened).whole(0, text, "stop")
    assert (whole[0] or "", whole[1]) == (content, reasoning)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[2]] == calls
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        stream, out, thought, count = _k3_form().stream(reads, True, opened), "", "", 0
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(text)], strict=True)):
            more, more_thought, deltas = stream.feed(text[a:b], final=i == len(cuts))
            out, thought, count = out + more, thought + more_thought, count + len(deltas)
        assert (out, thought, count) == (content, reasoning, 2 * len(calls)), cuts
