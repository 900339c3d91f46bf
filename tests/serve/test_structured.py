"""Structured outputs and tool calls through the real `openai` client, at world 1 and 2 in Kimi-K2's chat format and in
K3's (a small K3 model at world 1, the 0.4B K3 twin at world 2), on random weights: JSON that validates against its
schema and ends with `stop`, greedy and seeded, streamed and whole; the pydantic `parse` helper; vLLM's choice and
regex; tool calls under `required` and a named tool whose arguments validate, streamed deltas adding up to the whole
answer; a conversation with a tool result rendered as the format's template says; and free requests sharing a batch
with constrained ones drawing what they draw alone."""

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from k3dist.text.tokenizer import load_tokenizer

SERVERS = {"world1": "server1", "world2": "server2", "k3": "server_k3", "k3twin": "server_k3_twin"}
ON_THE_TWIN = pytest.param("k3twin", marks=pytest.mark.slow)  # the 0.4B K3 twin at world 2: the slow tier's


@pytest.fixture(params=["world1", "world2", "k3", ON_THE_TWIN])
def server(request):
    """The conftest's servers in Kimi-K2's format, and the two in K3's (a small K3 model and the 0.4B twin)."""
    return request.getfixturevalue(SERVERS[request.param])


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "count", "ok", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe it"}]
TOOL_ARGS = {"type": "object", "properties": {"c": {"enum": ["P", "R"]}}, "required": ["c"]}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": TOOL_ARGS}}]  # small: the prompt fits CAP


class Thing(BaseModel):
    colour: Literal["red", "green"]
    size: int = Field(ge=1, le=9)
    fresh: bool


def _chat_stream(chunks, thoughts: list | None = None) -> tuple[str, str, dict]:
    """(content, finish_reason, tool calls by index) of a streamed chat answer, merged the way clients merge them;
    the reasoning's pieces appended to `thoughts`."""
    content, finish, calls = "", None, {}
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        if thoughts is not None:
            thoughts.append((delta.model_extra or {}).get("reasoning_content", ""))
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, finish, calls


def test_json_schema_greedy_and_seeded_streamed_and_whole_and_parse(server):
    c, model = server.client(), server.model
    extra = server.chat_extra
    whole = c.chat.completions.create(
        model=model, messages=ASK, response_format=FORMAT, max_tokens=120, temperature=0, extra_body=extra
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = c.chat.completions.create(
        model=model, messages=ASK, response_format=FORMAT, max_tokens=120, temperature=1.0, seed=1, stream=True,
        extra_body=extra,
    )  # fmt: skip
    content, finish, _ = _chat_stream(stream)
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), SCHEMA)
    vllm = {"structured_outputs": {"json": SCHEMA}}
    done = c.completions.create(model=model, prompt="{", max_tokens=120, temperature=0.7, seed=3, extra_body=vllm)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    json_object = {"response_format": {"type": "json_object"}}
    obj = c.completions.create(model=model, prompt="x", max_tokens=12, temperature=0, extra_body=json_object)
    assert obj.choices[0].text.startswith("{")  # any object: random weights may not close it in 12 tokens
    parsed = c.chat.completions.parse(
        model=model, messages=ASK, response_format=Thing, max_tokens=120, temperature=0, extra_body=extra
    )
    assert isinstance(parsed.choices[0].message.parsed, Thing)


def test_choice_and_regex_hold(server):
    c, model = server.client(), server.model
    options = ["yes", "no way", 'a "quoted" one']
    for seed in range(2):
        r = c.chat.completions.create(
            model=model, messages=ASK, max_tokens=30, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": options}} | server.chat_extra,
        )  # fmt: skip
        assert r.choices[0].message.content in options and r.choices[0].finish_reason == "stop"
    pattern = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
    chunks = c.completions.create(
        model=model, prompt="Mail:", max_tokens=40, temperature=1.0, seed=4, stream=True,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert re.fullmatch(pattern, text), text


def test_tool_calls_required_and_named_streamed_and_whole(server):
    c, model = server.client(), server.model
    for choice in ("required", {"type": "function", "function": {"name": "w"}}):
        ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0)  # the cap's room
        ask |= {"extra_body": server.chat_extra}
        whole = c.chat.completions.create(**ask)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
        for call in message.tool_calls:
            assert call.type == "function" and call.function.name == "w" and call.id.startswith("functions.w:")
            jsonschema.validate(json.loads(call.function.arguments), TOOL_ARGS)
        content, finish, calls = _chat_stream(c.chat.completions.create(**ask, stream=True))
        assert finish == "tool_calls" and content == (message.content or "")
        got = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls]
        assert [calls[i] for i in sorted(calls)] == got
    sampled = c.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=8, extra_body=server.chat_extra,
    )  # fmt: skip
    assert len(sampled.choices[0].message.tool_calls) == 1
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )
    assert refused.value.body["param"] == "tool_choice"
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 60} for i in range(800)}}
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=model,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big}},
        )
    assert refused.value.body["param"] == "response_format" and "at most" in refused.value.body["message"]


RENDERED = {  # the conversation below, as each format's template renders it (K3's: as K3's own does, without thinking)
    "kimi_k2": (
        "<|im_user|>user<|im_middle|>Describe it<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0<|tool_call_argument_begin|>"
        '{"c": "P"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.w:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    ),
    "kimi_k3": (
        '<|open|>message role="user"<|sep|>Describe it<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="w" index="1"<|sep|><|open|>argument key="c" type="string"<|sep|>P<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="w" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    ),
}


@pytest.fixture(params=["world1", "k3", ON_THE_TWIN])
def format_server(request):
    """One server in each chat format."""
    return request.getfixturevalue(SERVERS[request.param])


def test_tool_choice_auto_reads_whatever_comes_streamed_as_whole(format_server):
    """Free answers (thinking too, in K3's format), sampled: whatever the model writes reads the same streamed as
    whole, and each call it makes names a tool with arguments of its schema."""
    server = format_server
    c = server.client()
    for seed in range(2):
        ask = dict(model=server.model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=1.0, seed=seed)
        whole = c.chat.completions.create(**ask).choices[0]
        thoughts: list = []
        content, finish, calls = _chat_stream(c.chat.completions.create(**ask, stream=True), thoughts)
        reasoning = (whole.message.model_extra or {}).get("reasoning_content") or ""
        assert (content, "".join(thoughts), finish) == (whole.message.content or "", reasoning, whole.finish_reason)
        made = [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in whole.message.tool_calls or []
        ]
        assert [calls[i] for i in sorted(calls)] == made
        for call in made:
            jsonschema.validate(json.loads(call["arguments"]), TOOL_ARGS)
        assert reasoning if server.chat_format == "kimi_k3" else not reasoning  # K3's template opens the think tag


def test_a_conversation_with_a_tool_result_renders_as_the_template_says(server):
    """An assistant turn with a call (arguments as an object) and the tool's result, as the format's template renders
    them: the prompt ids are the checkpoint's encoding of exactly that text."""
    call = {"id": "functions.w:0", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.w:0", "content": "sunny"},
    ]
    r = server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True} | server.chat_extra,
    )  # fmt: skip
    assert r.prompt_token_ids == load_tokenizer(server.model_dir).encode(RENDERED[server.chat_format])
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


async def _together(server, requests: list[dict]) -> list:
    async with server.async_client() as c:
        return await asyncio.gather(*(c.completions.create(model=server.model, **r) for r in requests))


@pytest.fixture(params=["world1", "world2"])
def plain_server(request):
    return request.getfixturevalue(SERVERS[request.param])


def test_free_requests_beside_constrained_ones_draw_what_they_draw_alone(plain_server):
    server = plain_server
    ids = {"return_token_ids": True}
    free = [
        {"prompt": [5, 9, 2, 7], "max_tokens": 12, "temperature": 0, "extra_body": ids},
        {"prompt": [40, 41, 42], "max_tokens": 12, "temperature": 0.8, "seed": 11, "extra_body": ids},
    ]
    shaped = [
        {"prompt": "{", "max_tokens": 60, "temperature": 0, "extra_body": {"structured_outputs": {"json": SCHEMA}}},
        {"prompt": [3, 4], "max_tokens": 12, "temperature": 0, "extra_body": {"repetition_penalty": 1.5}},
    ]
    together = asyncio.run(_together(server, free + shaped))
    c = server.client()
    for r, got in zip(free, together, strict=False):
        assert got.choices[0].token_ids == c.completions.create(model=server.model, **r).choices[0].token_ids
    jsonschema.validate(json.loads(together[2].choices[0].text), SCHEMA)
