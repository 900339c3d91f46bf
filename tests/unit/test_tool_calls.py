"""Tool calls without a server, in both chat formats (Kimi-K2's tool tokens, K3's tags): the parser on what engines
met in the wild (whole, and streamed in every cut adding up to the whole); any conversation's calls, rendered by the
twin's own template of the format and cut anywhere into deltas, read back whole; and the tool grammar walked by random
choices over the twin's vocabulary: every walk is an answer of valid calls that ends, for required, named, auto and
parallel_tool_calls=false."""

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3dist.serve.fields import Forms
from k3dist.serve.schema import ChatRequest
from k3dist.serve.tools import ToolCalls, chat_format
from k3dist.serve.tools_k2 import K2Stream
from k3dist.text.chat import load_chat_template, render_chat
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.tokenizer import KIMI_K2, KIMI_K3, write_tokenizer

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
FORMATS = [KIMI_K2, KIMI_K3]


def _call(name: str, idx: int, args: str) -> dict:
    return {"id": f"functions.{name}:{idx}", "type": "function", "function": {"name": name, "arguments": args}}


CASES = [  # (model output, content, calls)
    ("plain text <|tool", "plain text <|tool", []),
    (f"Let me look.{SB}{CB}functions.get_weather:0{AB}{{\"city\": \"Paris\"}}{CE}{SE}", "Let me look.",
     [_call("get_weather", 0, '{"city": "Paris"}')]),
    (f"{SB}{CB}functions.a:0{AB}{{}}{CE}{CB}functions.b:1{AB} [1, 2] {CE}{SE}trailing", None,
     [_call("a", 0, "{}"), _call("b", 1, "[1, 2]")]),  # several calls in one section; text after it is dropped
    (f"<|tool_call_section_begin|>{CB}functions.a:3{AB}{{\"x\": 1}}{CE}<|tool_call_section_end|>", None,
     [_call("a", 3, '{"x": 1}')]),  # the singular section tokens
    # no section, no ends, no functions. prefix
    (f"{CB}get_time:2{AB}{{\"tz\": \"CET\"}}", None, [_call("get_time", 2, '{"tz": "CET"}')]),
    (f"{SB}{CB}functions.a{AB}{{}}{CE}{CB}functions.a{AB}{{}}{CE}", None, [_call("a", 0, "{}"), _call("a", 1, "{}")]),
    (f"ok {SB}{CB}functions.a:0{AB}{{not json{CE}{SE}", f"ok {CB}functions.a:0{AB}{{not json{CE}", []),  # as content
    (f"{SB}{CB}functions.a:0 {{}}{CE}{CB}<bad id>:1{AB}{{}}{CE}{SE}",
     f"{CB}functions.a:0 {{}}{CE}{CB}<bad id>:1{AB}{{}}{CE}", []),
]  # fmt: skip


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict:
    """The smallest twin tokenizer in each format, and its template."""
    out = {}
    for name in FORMATS:
        path = tmp_path_factory.mktemp(name)
        write_tokenizer(path, 512, 2, 1, name)
        out[name] = (load_tokenizer(path), load_chat_template(path))
    return out


def _k2_calls(twins, parallel: bool = True) -> ToolCalls:
    return ToolCalls(chat_format(twins[KIMI_K2][0]), 1, True, parallel, "response")


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_parse_and_every_streamed_cut_agree(twins, text, content, calls):
    got = _k2_calls(twins).whole(0, text, "stop")
    assert got == (content, "", calls, "tool_calls" if calls else "stop")
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        out, reasoning, deltas = _fed(
            K2Stream(), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        )
        assert out == (content or "") and reasoning == "" and _assembled(deltas) == calls, cuts


def _fed(stream, pieces: list[str]) -> tuple[str, str, list[dict]]:
    out, reasoning, deltas = "", "", []
    for i, piece in enumerate(pieces):
        more, thought, new = stream.feed(piece, final=i == len(pieces) - 1)
        out, reasoning, deltas = out + more, reasoning + thought, deltas + new
    return out, reasoning, deltas


def _assembled(deltas: list[dict]) -> list[dict]:
    """Stream deltas merged the way OpenAI's clients merge them: by index, strings appended."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
        if "id" in d:
            assert d["function"]["arguments"] == "" and "type" in d  # the first delta: index, id, type and name
            call |= {"id": d["id"], "type": d["type"]}
        call["function"]["name"] += d["function"].get("name", "")
        call["function"]["arguments"] += d["function"]["arguments"]
    return [{"id": c["id"], "type": c["type"], "function": c["function"]} for _, c in sorted(calls.items())]


def test_one_call_only_without_parallel_tool_calls(twins):
    text = f"{SB}{CB}functions.a:0{AB}{{}}{CE}{CB}functions.b:1{AB}{{}}{CE}{SE}"
    content, _, calls, finish = _k2_calls(twins, parallel=False).whole(0, text, "stop")
    assert [c["function"]["name"] for c in calls] == ["a"] and content == f"{CB}functions.b:1{AB}{{}}{CE}"


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.text(max_size=12),
    st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.text("abc", min_size=1, max_size=3), st.booleans()),
)  # fmt: skip
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "search.web", "a-b_c"]),
        st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_ \-]{0,8}", fullmatch=True), VALUES, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=40, deadline=None)
@given(calls=CALLS, content=st.text(max_size=20), cuts=st.lists(st.integers(1, 10**4), max_size=8), data=st.data())
def test_any_rendered_calls_read_back_whole_and_in_any_cut(twins, name, calls, content, cuts, data):
    """An assistant turn with calls, as the format's twin template renders it (the answer the model writes, K3's
    thinking included), read back: the calls (arguments equal as JSON), content and reasoning; cut anywhere into
    deltas, the same."""
    tokenizer, (template, source) = twins[name]
    thinking = name == KIMI_K3 and data.draw(st.booleans())
    turn = {"role": "assistant", "content": content, "reasoning_content": "Hmm, think." if thinking else None}
    turn["tool_calls"] = [
        {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": args}}
        for i, (n, args) in enumerate(calls)
    ]
    rendered = render_chat(
        template, source, [{"role": "user", "content": "x"}, turn], add_generation_prompt=False,
        **({"variables": {"thinking": thinking}} if name == KIMI_K3 else {}),
    )  # fmt: skip
    form = chat_format(tokenizer, template)
    assert form.name == name
    answer = rendered.split("<|im_middle|>")[-1].removesuffix("<|im_end|>")
    if name == KIMI_K3:  # the model writes from its generation prompt on: K3's opens the think or response tag
        opened = "think" if thinking else "response"
        answer = rendered.split('<|open|>message role="assistant"<|sep|>')[-1]
        answer = answer.split(f"<|open|>{opened}<|sep|>", 1)[1]
    else:
        opened = "response"
    whole = ToolCalls(form, 1, True, True, opened).whole(0, answer, "stop")
    assert (
        whole[0] == (content or None) and whole[1] == ("Hmm, think." if thinking else "") and whole[3] == "tool_calls"
    )
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[2]] == calls
    at = sorted({c % len(answer) for c in cuts} - {0})
    pieces = [answer[a:b] for a, b in zip([0, *at], [*at, len(answer)], strict=True)]
    out, reasoning, deltas = _fed(form.stream(True, True, opened), pieces)
    assert (out, reasoning, _assembled(deltas)) == ((whole[0] or ""), whole[1], whole[2])


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}, "exact": {"type": "boolean"}, "note": {"type": "string"}},
    "required": ["tz"],
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("weather", WEATHER), ("time", TIME))
]


@pytest.fixture(scope="module")
def forms(twins):
    return {name: Forms(tokenizer, 512, template[0]) for name, (tokenizer, template) in twins.items()}


def _walk(forms: Forms, matcher, rng: random.Random, favour: set[int], limit: int = 3000) -> list[int]:
    """Random allowed tokens until the grammar ends (an eos id); one of `favour` is taken whenever allowed, at 50%."""
    import xgrammar

    bitmask, out, ids = xgrammar.allocate_token_bitmask(1, forms.vocab), [], torch.arange(forms.vocab)
    while len(out) < limit:
        matcher.fill(bitmask, 0)
        allowed = ((bitmask[0, ids // 32] >> (ids % 32)) & 1).nonzero().flatten().tolist()
        liked = sorted(favour.intersection(allowed))
        token = rng.choice(liked) if liked and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept(token)
        out.append(token)
        if token in forms.tokenizer.eos_ids:
            return out
    raise AssertionError(f"no end after {limit} tokens: {forms.tokenizer.decode(out)!r}")


WALKS = [
    ("required", True, False),
    ({"type": "function", "function": {"name": "time"}}, True, False),
    ("auto", True, False),
    ("required", False, False),
    ("required", True, True),  # K3: thinking first, then the calls
]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("choice, parallel, thinking", WALKS, ids=["required", "named", "auto", "one-call", "think"])
def test_the_tool_grammar_gives_valid_calls_from_any_choices(forms, name, choice, parallel, thinking):
    jsonschema = pytest.importorskip("jsonschema")  # a test extra: the module collects without it (issue 38)
    if thinking and name == KIMI_K2:
        pytest.skip("Kimi-K2's format writes no thinking apart")
    form, tok = forms[name], forms[name].tokenizer
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
    body |= {"chat_template_kwargs": {"thinking": thinking}} if name == KIMI_K3 else {}
    request = ChatRequest.model_validate(body | {"parallel_tool_calls": parallel})
    template, source = load_chat_template(tok.source.parent)
    variables = body.get("chat_template_kwargs")
    prompt = tok.encode(render_chat(template, source, body["messages"], TOOLS, variables=variables))
    plan = form.bind(form.plan(request), prompt)
    assert plan.opened == ("think" if thinking else "response")
    if name == KIMI_K2:
        favour = {form.form.tokens.section_begin} if choice == "auto" else set()
    else:
        favour = set(form.form.markup)  # <|open|> and <|close|> end free text and strings soonest
    counts = set()
    for seed in range(12):
        tokens = _walk(form, plan.engine["grammar"](), random.Random(seed), favour)
        content, reasoning, calls, finish = plan.tool_calls(1).whole(0, tok.decode(tokens[:-1]), "stop")
        if choice != "auto":
            assert not content and calls and finish == "tool_calls", tok.decode(tokens)
        assert thinking or not reasoning
        for call in calls:
            called = call["function"]["name"]
            assert choice in ("required", "auto") or called == "time"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER if called == "weather" else TIME)
        counts.add(len(calls))
    assert counts <= {1} if not parallel or isinstance(choice, dict) else len(counts) > 1
