"""The Responses API (`POST /v1/responses`) against the world-1 server: the same greedy text as chat completions for
the same conversation, whole and streamed (the deltas add up to it, every event in OpenAI's order and valid for the
`openai` client's own types), `text.format` held to its schema, tool calls as `function_call` items and their outputs
fed back (in Kimi-K2's chat format and in K3's), K3's thinking as a `reasoning` item and sent back, log-probabilities,
every refused field a 400 naming it, and stored responses: retrieval, a conversation continued by
`previous_response_id` (the text of the whole conversation sent again, the previous turn's prefix snapshot reused),
deletion, and a 404 naming an id that is not stored. Eviction and the Agents SDK are in
test_responses_agents.py, on a server with room for an agent's prompts."""

import json
import re

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

EVENT = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0, "max_output_tokens": 8}
TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]},
}
ITEMS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
MESSAGES += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "again"}]}]


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/responses", json={"model": server.model} | body, timeout=120)


def _whole(server, body: dict) -> dict:
    reply = _post(server, body)
    assert reply.status_code == 200, reply.text
    Response.model_validate(reply.json())  # every field the client's own type requires, of its type
    return reply.json()


def _streamed(server, body: dict) -> list[dict]:
    """The events, each valid for the client's types and numbered in order; the stream ends with the response."""
    reply = _post(server, body | {"stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream"), reply.text
    frames = [frame for frame in reply.text.split("\n\n") if frame]
    events = []
    for frame in frames:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events


def _text(response: dict) -> str:
    return "".join(p["text"] for o in response["output"] if o["type"] == "message" for p in o["content"])


def _chat(server, messages: list, **extra) -> dict:
    return server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0, **extra
    ).model_dump()  # fmt: skip


def test_the_same_greedy_text_as_chat_whole_and_streamed(server1):
    chat = _chat(server1, MESSAGES)
    whole = _whole(server1, {"input": ITEMS} | GREEDY)
    assert _text(whole) == chat["choices"][0]["message"]["content"] and _text(whole)
    assert whole["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert whole["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == 8
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = _streamed(server1, {"input": ITEMS} | GREEDY)
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == tail + ["response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == _text(events[-1]["response"]) == _text(whole)
    # instructions are a system message first; a text input is one user message
    brief = _whole(server1, {"instructions": "Be brief.", "input": "Say hi"} | GREEDY)
    assert _text(brief) == _chat(server1, MESSAGES[:2])["choices"][0]["message"]["content"]
    assert brief["instructions"] == "Be brief." and brief["max_output_tokens"] == 8


def test_the_openai_client(server1):
    client = server1.client()
    made = client.responses.create(model=server1.model, input="Say hi", **GREEDY)
    chat = _chat(server1, [{"role": "user", "content": "Say hi"}])
    assert made.output_text == chat["choices"][0]["message"]["content"] and made.usage.total_tokens > 8
    with client.responses.stream(model=server1.model, input="Say hi", **GREEDY) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == made.output_text


def test_text_format_json_schema_and_json_object(server1):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    asked = {"input": "A thing", "text": {"format": fmt}, "temperature": 0, "max_output_tokens": 60}
    made = _whole(server1, asked)
    jsonschema.validate(json.loads(_text(made)), schema)
    assert made["status"] == "completed" and made["text"]["format"] == fmt
    events = _streamed(server1, asked)
    assert _text(events[-1]["response"]) == _text(made)
    loose = _whole(server1, {"input": "A thing", "text": {"format": {"type": "json_object"}}} | GREEDY)
    assert _text(loose).startswith("{")  # any object: random weights may not close it in 8 tokens


@pytest.mark.parametrize("name", ["server1", "server_k3"], ids=["kimi_k2", "kimi_k3"])
def test_tool_calls_are_function_call_items_and_their_outputs_go_back(request, name):
    server1 = request.getfixturevalue(name)  # either format: the same items
    asked = {"input": "Go", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    asked |= server1.responses_extra  # the rest of cache.cap for tokens: K3's tags take more
    made = _whole(server1, asked)
    (call,) = made["output"]
    assert call["type"] == "function_call" and call["name"] == "f" and call["status"] == "completed"
    assert json.loads(call["arguments"]) in ({"a": "x"}, {"a": "y"}) and call["id"].startswith("fc_")
    named = _whole(server1, asked | {"tool_choice": {"type": "function", "name": "f"}})
    assert [o["type"] for o in named["output"]] == ["function_call"]
    events = _streamed(server1, asked)
    kinds = [e["type"] for e in events]
    assert kinds[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    streamed = events[-1]["response"]["output"][0]
    keys = ("call_id", "name", "arguments")
    assert {k: streamed[k] for k in keys} == {k: call[k] for k in keys}
    # the call and its output fed back as items (echoed with id and status), without the tools to keep it short
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "done"}
    back = [{"role": "user", "content": "Go"}, call, output]
    answer = _whole(server1, {"input": back} | GREEDY | server1.responses_extra)
    called = {"id": call["call_id"], "type": "function", "function": {"name": "f", "arguments": call["arguments"]}}
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": None, "tool_calls": [called]}]
    messages.append({"role": "tool", "tool_call_id": call["call_id"], "content": "done"})
    chat = _chat(server1, messages, extra_body=server1.chat_extra)
    assert _text(answer) == chat["choices"][0]["message"]["content"]


def test_k3s_thinking_is_a_reasoning_item_and_goes_back(server_k3):
    """K3's template opens the think tag unless told not to: random weights think to the end of their budget, and
    that thinking is a reasoning item (the chat answer's reasoning_content), which a later turn sends back."""
    made = _whole(server_k3, {"input": "Say hi"} | GREEDY)
    chat = _chat(server_k3, [{"role": "user", "content": "Say hi"}])["choices"][0]["message"]
    (item,) = made["output"]
    assert item["type"] == "reasoning" and item["status"] == "incomplete" and made["status"] == "incomplete"
    assert item["content"][0]["text"] == chat["reasoning_content"] and chat["content"] == ""
    assert made["usage"]["output_tokens_details"]["reasoning_tokens"] == 8
    events = _streamed(server_k3, {"input": "Say hi"} | GREEDY)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == item["content"][0]["text"] and "response.output_text.delta" not in {e["type"] for e in events}
    back = [{"role": "user", "content": "Say hi"}, item, {"role": "user", "content": "Again"}]
    again = _whole(server_k3, {"input": back} | GREEDY)
    thought = {"role": "assistant", "content": "", "reasoning_content": item["content"][0]["text"]}
    messages = [{"role": "user", "content": "Say hi"}, thought, {"role": "user", "content": "Again"}]
    assert (
        again["output"][0]["content"][0]["text"]
        == _chat(server_k3, messages)["choices"][0]["message"]["reasoning_content"]
    )
    assert (
        _whole(server_k3, {"input": "Say hi", "reasoning": {"effort": "none"}} | GREEDY)["output"][0]["type"]
        == "message"
    )


def test_log_probabilities_with_include(server1):
    body = {"input": "Say hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2} | GREEDY
    made = _whole(server1, body)
    chat = _chat(server1, [{"role": "user", "content": "Say hi"}], logprobs=True, top_logprobs=2)
    part = made["output"][0]["content"][0]
    assert len(part["logprobs"]) == 8 and all(len(t["top_logprobs"]) == 2 for t in part["logprobs"])
    _same_logprobs(part["logprobs"], chat["choices"][0]["logprobs"]["content"])
    events = _streamed(server1, body)
    _same_logprobs(
        [t for e in events if e["type"] == "response.output_text.delta" for t in e["logprobs"]], part["logprobs"]
    )


def _same_logprobs(got: list[dict], want: list[dict]) -> None:
    """The same tokens and bytes, log-probabilities within 1e-6: a later request may restore the first one's prefix
    snapshot, and a decode step after a restore may round its last bits otherwise on some CPUs."""
    flat = lambda ts: [(t["token"], t["bytes"], [(a["token"], a["bytes"]) for a in t["top_logprobs"]]) for t in ts]  # noqa: E731
    assert flat(got) == flat(want)
    values = lambda ts: [v for t in ts for v in (t["logprob"], *(a["logprob"] for a in t["top_logprobs"]))]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(values(got), values(want), strict=True)) <= 1e-6


def test_what_the_gateway_writes_into_every_body_is_served(server1):
    """The SGLang Model Gateway's defaults (store true, temperature 1, SGLang's neutral extras), with tools."""
    smg = {"store": True, "temperature": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    tools = {"tools": [TOOL], "parallel_tool_calls": True, "tool_choice": "auto", "max_output_tokens": 4}
    made = _whole(server1, {"input": "Hi", "include": []} | smg | tools)
    assert made["store"] is True and made["usage"]["output_tokens"] >= 1
    plain = _whole(server1, {"input": "Hi", "tools": [], "tool_choice": "auto", "max_output_tokens": 2} | smg)
    assert plain["tools"] == [] and plain["usage"]["output_tokens"] >= 1


REFUSED = [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"text": {"verbosity": "high"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"min_p": 0.1}, "min_p"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"max_output_tokens": 300}, "max_output_tokens"),
    ({"model": "another"}, "model"),
    ({"temprature": 0}, "temprature"),
    ({"previous_response_id": "resp_never"}, "previous_response_id"),
]


@pytest.mark.parametrize("extra, field", REFUSED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(REFUSED)])
def test_every_refused_field_is_a_400_naming_it(server1, extra, field):
    reply = _post(server1, {"input": "Hi"} | extra)
    error = reply.json()["error"]
    assert reply.status_code == (404 if field == "previous_response_id" else 400), reply.text
    assert error["param"] == field, error
    assert field in error["message"] or field in ("input", "tools", "metadata"), error


def _reused(server) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return float(re.search(r"^k3dist_prefix_tokens_reused (\S+)$", text, re.M)[1])


def test_stored_responses_are_retrieved_continued_and_deleted(server1):
    first = _whole(server1, {"input": "Say hi", "metadata": {"k": "v"}} | GREEDY)
    assert first["store"] is True and first["metadata"] == {"k": "v"}
    got = httpx.get(f"{server1.url}/responses/{first['id']}", timeout=30)
    assert got.status_code == 200 and got.json() == first
    before = _reused(server1)
    chained = _whole(server1, {"previous_response_id": first["id"], "input": "again"} | GREEDY)
    assert _reused(server1) - before >= first["usage"]["input_tokens"]  # the previous turn's prefix snapshot
    again = [{"role": "user", "content": "Say hi"}, *first["output"], {"role": "user", "content": "again"}]
    assert _text(chained) == _text(_whole(server1, {"input": again} | GREEDY)) and chained["previous_response_id"]
    # a continued response does not inherit the previous one's instructions
    told = _whole(server1, {"instructions": "Be brief.", "input": "Say hi"} | GREEDY)
    on = _whole(server1, {"previous_response_id": told["id"], "input": "again"} | GREEDY)
    assert _text(on) == _text(_whole(server1, {"input": again[:1] + told["output"] + again[2:]} | GREEDY))
    assert httpx.delete(f"{server1.url}/responses/{first['id']}", timeout=30).json()["deleted"] is True
    for reply in (
        httpx.get(f"{server1.url}/responses/{first['id']}", timeout=30),
        httpx.delete(f"{server1.url}/responses/{first['id']}", timeout=30),
        _post(server1, {"previous_response_id": first["id"], "input": "again"}),
    ):
        assert reply.status_code == 404 and first["id"] in reply.json()["error"]["message"], reply.text
    unkept = _whole(server1, {"input": "Say hi", "store": False} | GREEDY)
    assert unkept["store"] is False
    assert httpx.get(f"{server1.url}/responses/{unkept['id']}", timeout=30).status_code == 404
    asked = httpx.get(f"{server1.url}/responses/{chained['id']}?stream=true", timeout=30)
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "stream"
