"""The 0.4B Kimi K3 twin served at world 2 (MXFP4 experts kept packed, bf16): chat and completions through the
`openai` client, greedy runs repeat token for token, a stream adds up to the whole answer, a json_schema answer is
valid JSON of its schema, and image content is refused with a 400 that names it while the server serves on."""

import json

import httpx
import jsonschema
import openai
import pytest

GREEDY = {"temperature": 0, "max_tokens": 12}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _chat(server, content, **extra):
    messages = [{"role": "user", "content": content}]
    return server.client().chat.completions.create(
        model=server.model, messages=messages, extra_body=server.chat_extra, **(GREEDY | extra)
    )


def test_the_k3_twin_answers_greedy_and_repeats(server_k3_twin):
    first, again = (_chat(server_k3_twin, "Name a colour.") for _ in range(2))
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"
    text = server_k3_twin.client().completions.create(model=server_k3_twin.model, prompt="Once upon", **GREEDY)
    assert text.usage.completion_tokens == 12


def test_a_k3_stream_adds_up_to_the_whole_answer(server_k3_twin):
    whole = _chat(server_k3_twin, "Count to five.").choices[0].message.content
    stream = server_k3_twin.client().chat.completions.create(
        model=server_k3_twin.model,
        messages=[{"role": "user", "content": "Count to five."}],
        extra_body=server_k3_twin.chat_extra,
        stream=True,
        **GREEDY,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole


def test_a_k3_json_schema_answer_is_valid(server_k3_twin):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    out = _chat(server_k3_twin, "Plan a trip as JSON.", response_format=fmt, max_tokens=64)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_k3_refuses_image_content_and_serves_on(server_k3_twin):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(server_k3_twin, [image, {"type": "text", "text": "What is this?"}])
    assert "image" in str(refused.value)
    assert httpx.get(server_k3_twin.base + "/health", timeout=10).status_code == 200
    assert _chat(server_k3_twin, "Still there?").usage.completion_tokens == 12
