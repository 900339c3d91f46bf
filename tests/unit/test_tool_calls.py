"""Kimi tool calls without a server: the parser on what engines met in the wild (whole, and streamed in every cut
adding up to the whole), and the tool grammar walked by random choices over the twin's vocabulary: every walk is a
section of valid calls that ends, for required, named, auto and parallel_tool_calls=false."""

import json
import random

import jsonschema
import pytest
import torch

from k3dist.serve.fields import Forms
from k3dist.serve.protocol import ChatRequest
from k3dist.serve.tools import ToolCalls, ToolStream
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.tokenizer import write_tokenizer

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


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


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_parse_and_every_streamed_cut_agree(text, content, calls):
    got = ToolCalls(1, parallel=True).whole(0, text, "stop")
    assert got == (content, calls, "tool_calls" if calls else "stop")
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        stream, out, deltas = ToolStream(), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            more, new = stream.feed(text[a:b])
            out, deltas = out + more, deltas + new
        more, new = stream.finish()
        out, deltas = out + more, deltas + new
        assert out == (content or "") and _assembled(deltas) == calls, cuts


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


def test_one_call_only_without_parallel_tool_calls():
    text = f"{SB}{CB}functions.a:0{AB}{{}}{CE}{CB}functions.b:1{AB}{{}}{CE}{SE}"
    content, calls, finish = ToolCalls(1, parallel=False).whole(0, text, "stop")
    assert [c["function"]["name"] for c in calls] == ["a"] and content == f"{CB}functions.b:1{AB}{{}}{CE}"


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}, "exact": {"type": "boolean"}},
    "required": ["tz"],
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("weather", WEATHER), ("time", TIME))
]


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, 512, 2, 1)
    return Forms(load_tokenizer(path), 512)


def _walk(forms: Forms, matcher, rng: random.Random, favour: int | None, limit: int = 1000) -> list[int]:
    """Random allowed tokens until the grammar ends (an eos id); `favour` is taken whenever allowed, at 50%."""
    import xgrammar

    bitmask, out, ids = xgrammar.allocate_token_bitmask(1, forms.vocab), [], torch.arange(forms.vocab)
    while len(out) < limit:
        matcher.fill(bitmask, 0)
        allowed = ((bitmask[0, ids // 32] >> (ids % 32)) & 1).nonzero().flatten().tolist()
        token = favour if favour in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept(token)
        out.append(token)
        if token in forms.tokenizer.eos_ids:
            return out
    raise AssertionError(f"no end after {limit} tokens: {forms.tokenizer.decode(out)!r}")


@pytest.mark.parametrize(
    "choice, parallel",
    [
        ("required", True),
        ({"type": "function", "function": {"name": "time"}}, True),
        ("auto", True),
        ("required", False),
    ],
    ids=["required", "named", "auto", "one-call"],
)
def test_the_tool_grammar_gives_valid_calls_from_any_choices(forms, choice, parallel):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
    plan = forms.plan(ChatRequest.model_validate(body | {"parallel_tool_calls": parallel}))
    section = forms.tool_tokens.section_begin
    counts = set()
    for seed in range(12):
        tokens = _walk(forms, plan.engine["grammar"](), random.Random(seed), section if choice == "auto" else None)
        content, calls, finish = plan.tool_calls(1).whole(0, forms.tokenizer.decode(tokens[:-1]), "stop")
        if choice != "auto":
            assert content is None and calls and finish == "tool_calls", forms.tokenizer.decode(tokens)
        for call in calls:
            name = call["function"]["name"]
            assert choice in ("required", "auto") or name == "time"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER if name == "weather" else TIME)
        counts.add(len(calls))
    assert counts <= {1} if not parallel or isinstance(choice, dict) else len(counts) > 1
