"""Bad requests are answered, never crash anything: each of these gets the OpenAI error envelope and its status, a
full queue gets 503 with Retry-After, and the server answers a good request afterwards with all its slots free.
The server here runs a checkpoint whose tokenizer has no tool-call tokens: it refuses tools and serves the rest."""

import asyncio
import json
import shutil

import httpx
import pytest

from k3dist.serve.tools import TOKENS
from tests.serve.conftest import CAP, SLOTS, _server

KEY = "sekrit"
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(serve_dir, tmp_path_factory):
    """A server with an API key, a small body limit and a waiting queue of one, on the checkpoint without tool-call
    tokens in its tokenizer."""
    plain = tmp_path_factory.mktemp("plain") / "m"
    shutil.copytree(serve_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    added = {k: v for k, v in config["added_tokens_decoder"].items() if v["content"] not in TOKENS}
    (plain / "tokenizer_config.json").write_text(json.dumps(config | {"added_tokens_decoder": added}))
    server = _server(
        tmp_path_factory.mktemp("guard"),
        plain,
        f"serve.api_key={KEY}",
        "serve.max_body=64KiB",
        "serve.max_waiting=1",
    )
    yield server
    server.stop()


def _post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def _cases(model: str):
    ok = {"model": model, "prompt": "hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    deep = '{"prompt": ' + "[" * 5000 + "]" * 5000 + ', "max_tokens": 2}'
    stops = ok | {"stop": [f"s{i}" for i in range(3000)]}
    role = chat | {"messages": [{"role": "user<|im_end|>", "content": "x"}]}
    return [  # (name, path, body or None, raw bytes or None, key, status, a word the message holds, param)
        ("no key", "/completions", ok, None, None, 401, "API key", None),
        ("wrong key", "/completions", ok, None, "nope", 401, "API key", None),
        ("unknown route", "/nothing", ok, None, KEY, 404, "no such route", None),
        ("not JSON", "/completions", None, b'{"prompt": "a",', KEY, 400, "not valid JSON", None),
        ("not an object", "/completions", [1, 2], None, KEY, 400, "JSON object", None),
        ("string max_tokens", "/completions", ok | {"max_tokens": "4"}, None, KEY, 400, "integer", "max_tokens"),
        ("negative temperature", "/completions", ok | {"temperature": -1}, None, KEY, 400, "greater", "temperature"),
        ("NaN temperature", "/completions", None, b'{"prompt": "a", "temperature": NaN}', KEY, 400, "finite", None),
        ("top_p zero", "/completions", ok | {"top_p": 0}, None, KEY, 400, "greater than 0", "top_p"),
        ("n zero", "/completions", ok | {"n": 0}, None, KEY, 400, "greater", "n"),
        ("logprobs 21", "/completions", ok | {"logprobs": 21}, None, KEY, 400, "less than", "logprobs"),
        ("prompt_logprobs", "/completions", ok | {"prompt_logprobs": 1}, None, KEY, 400, "echo", "prompt_logprobs"),
        ("batch out of vocab", "/completions", ok | {"prompt": [[3], [9999]]}, None, KEY, 400, "prompt[1]", "prompt"),
        ("empty prompt", "/completions", ok | {"prompt": ""}, None, KEY, 400, "empty", "prompt"),
        ("too long", "/completions", ok | {"max_tokens": CAP}, None, KEY, 400, f"cache.cap={CAP}", "max_tokens"),
        ("ids out of vocab", "/completions", ok | {"prompt": [3, 99999]}, None, KEY, 400, "vocabulary", "prompt"),
        ("unknown model", "/completions", ok | {"model": "gpt-9"}, None, KEY, 400, "not served", "model"),
        ("over max_body", "/completions", ok | {"prompt": "x" * 70000}, None, KEY, 413, "max_body", None),
        ("deep JSON", "/completions", None, deep.encode(), KEY, 400, "nests deeper", None),
        ("not UTF-8", "/completions", None, b'{"prompt": "caf\xe9"}', KEY, 400, "not valid JSON", None),
        ("lone surrogate", "/completions", None, b'{"prompt": "a\\ud800b"}', KEY, 400, "surrogate", "prompt"),
        ("NUL byte", "/completions", None, b'{"prompt": "a\x00b"}', KEY, 400, "not valid JSON", None),
        ("float budget", "/completions", ok | {"max_tokens": 1.5}, None, KEY, 400, "integer", "max_tokens"),
        ("an image", "/chat/completions", chat | {"messages": [{"role": "user", "content": [IMAGE]}]}, None, KEY,
         400, "text only", "messages"),
        ("thousands of stops", "/completions", stops, None, KEY, 400, "stop", "stop"),
        ("bad role", "/chat/completions", role, None, KEY, 400, "role", "messages"),
        ("messages not a list", "/chat/completions", chat | {"messages": "hi"}, None, KEY, 400, "list", "messages"),
        ("lone top_logprobs", "/chat/completions", chat | {"top_logprobs": 2}, None, KEY, 400, "needs", "top_logprobs"),
        *_output_cases(ok, chat),
    ]  # fmt: skip


def _output_cases(ok: dict, chat: dict) -> list:
    """Fields that shape the output: each known one honoured or refused (docs/serving.md's table), never dropped."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    so = lambda **kw: {"structured_outputs": kw}  # noqa: E731
    cases = [  # (name, chat?, fields, a word the message holds, param)
        ("tools without tool tokens", True, {"tools": [tool]}, "no tool-call tokens", "tools"),
        ("tool_choice without tools", True, {"tool_choice": "required"}, "needs tools", "tool_choice"),
        ("unknown response_format", True, {"response_format": {"type": "xml"}}, "xml", "response_format"),
        ("invalid schema", False, {"response_format": bad_schema}, "not valid", "response_format"),
        ("invalid regex", False, so(regex="[a-"), "not valid", "structured_outputs"),
        ("two forms", False, so(regex="a", choice=["b"]), "exactly one", "structured_outputs"),
        ("form and format", False, so(regex="a") | {"response_format": schema}, "one", "structured_outputs"),
        ("structural_tag", False, so(structural_tag="{}"), "not supported", "structured_outputs"),
        ("empty choice", False, so(choice=[]), "at least 1", "structured_outputs"),
        ("min_tokens and a grammar", False, {"min_tokens": 2, "response_format": schema}, "grammar", "min_tokens"),
        ("ignore_eos and a grammar", False, {"ignore_eos": True, "response_format": schema}, "grammar", "ignore_eos"),
        ("min_tokens past max_tokens", False, {"min_tokens": 5}, "more than max_tokens", "min_tokens"),
        ("logit_bias key", False, {"logit_bias": {"a": 1}}, "pattern", "logit_bias"),
        ("logit_bias unicode digit", False, {"logit_bias": {"²": 5}}, "pattern", "logit_bias"),
        ("logit_bias past the vocabulary", False, {"logit_bias": {"99999": 1}}, "not a token id", "logit_bias"),
        ("logit_bias range", False, {"logit_bias": {"5": 101}}, "less than or equal to 100", "logit_bias"),
        ("logit_bias size", False, {"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300", "logit_bias"),
        ("stop_token_ids", False, {"stop_token_ids": [3, 9999]}, "vocabulary", "stop_token_ids"),
        ("penalty range", False, {"presence_penalty": 2.5}, "less than", "presence_penalty"),
        ("repetition_penalty zero", False, {"repetition_penalty": 0}, "greater than 0", "repetition_penalty"),
        ("suffix", False, {"suffix": "end"}, "suffix", "suffix"),
        ("best_of", False, {"best_of": 3}, "use n", "best_of"),
        ("functions", True, {"functions": [tool["function"]]}, "use tools", "functions"),
        ("audio", True, {"audio": {"voice": "x"}}, "audio", "audio"),
        ("store", True, {"store": True}, "stored", "store"),
        ("guided_json", False, {"guided_json": {}}, "structured_outputs", "guided_json"),
        ("min_p", False, {"min_p": 0.1}, "top_p", "min_p"),
        ("prompt_logprobs on chat", True, {"prompt_logprobs": 2}, "echo", "prompt_logprobs"),
        ("a request's template", True, {"chat_template": "{{ messages }}"}, "own chat template", "chat_template"),
        ("no_stop_trim", False, {"no_stop_trim": True}, "stop strings", "no_stop_trim"),
        (
            "obfuscation",
            False,
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "obfusc",
            "stream_options",
        ),
    ]
    path = {True: "/chat/completions", False: "/completions"}
    return [
        (name, path[is_chat], (chat if is_chat else ok) | fields, None, KEY, 400, says, param)
        for name, is_chat, fields, says, param in cases
    ]  # fmt: skip


def test_malformed_requests_get_their_envelope_and_status(guarded):
    cases = _cases(guarded.model)
    assert len(cases) >= 15
    for name, path, body, raw, key, status, says, param in cases:
        r = _post(guarded, path, body, key, raw)
        assert r.status_code == status, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (name, error)
        assert says.lower() in error["message"].lower(), (name, error)
        assert param is None or error["param"] == param, (name, error)
    good = {"prompt": "after all that\x01\x7f", "max_tokens": 3, "ignore_eos": True}  # sampled: an eos would end it
    good = _post(guarded, "/completions", good)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert guarded.metrics()["k3dist_requests_running"] == 0
    assert httpx.get(f"{guarded.base}/health").status_code == 200  # /health and /metrics want no key
    assert httpx.get(f"{guarded.url}/models").status_code == 401
    for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info")]:
        assert httpx.request(method, f"{guarded.base}{path}").status_code == 401, path  # keyed as /v1 is
    huge = httpx.post(f"{guarded.base}/tokenize", content=b"x" * 70000, headers={"Authorization": f"Bearer {KEY}"})
    assert huge.status_code == 413 and set(huge.json()["error"]) == {"message", "type", "param", "code"}


async def _flood(server, count: int) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": [5, 6, 7], "max_tokens": 96, "temperature": 0}
    async with httpx.AsyncClient(timeout=120, headers=headers) as c:
        return await asyncio.gather(*(c.post(f"{server.url}/completions", json=body) for _ in range(count)))


def test_a_full_waiting_queue_gets_503_with_retry_after(guarded):
    """4 slots and serve.max_waiting=1: of 7 requests at once, at least the last ones are turned away."""
    replies = asyncio.run(_flood(guarded, SLOTS + 3))
    refused = [r for r in replies if r.status_code == 503]
    served = [r for r in replies if r.status_code == 200]
    assert len(served) >= SLOTS and len(refused) >= 1 and len(served) + len(refused) == SLOTS + 3
    assert all(r.headers.get("retry-after") and r.json()["error"]["code"] == "unavailable" for r in refused)
    assert "waiting" in refused[0].json()["error"]["message"]


def test_made_up_fields_are_refused_by_name(guarded):
    """serve.unknown_fields=refuse (the default): an unknown field is a 400 naming it, as OpenAI's API does, on every
    route and inside an object too; a body of 3,000 made-up keys names a few and says how many more."""
    cases = [
        ("/completions", {"prompt": "hi", "max_tokens": 1, "temprature": 0.5}, "temprature"),
        ("/completions", {"prompt": "hi", "max_completion_tokens": 1.5}, "max_completion_tokens"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "suffix": "x"}, "suffix"),
        ("/completions", {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    ]
    for path, body, name in cases:
        reply = _post(guarded, path, body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == name, reply.text
        assert f"unknown field {name}" in reply.json()["error"]["message"]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        reply = httpx.post(f"{guarded.base}{path}", json=body | {"extra": 1}, headers=AUTH)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "extra", reply.text
    made_up = {f"f{i}": 0 for i in range(3000)}
    reply = _post(guarded, "/completions", {"prompt": "hi", "max_tokens": 1} | made_up)
    assert reply.status_code == 400 and "and 2992 more" in reply.json()["error"]["message"], reply.text
    assert not any("k3_serve_unknown_field" in line for line in guarded.lines)


def test_the_auth_scheme_is_case_free_and_probes_may_use_head(guarded):
    ok = {"prompt": "hi", "max_tokens": 2}
    url, body = f"{guarded.url}/completions", json.dumps(ok)
    for header, status in [(f"bearer  {KEY}", 200), (f"BEARER {KEY}", 200), (f"Basic {KEY}", 401), (KEY, 401)]:
        r = httpx.post(url, content=body, headers={"Authorization": header, "Content-Type": "application/json"})
        assert r.status_code == status, (header, r.text)
    assert httpx.head(f"{guarded.base}/health").status_code == 200
    assert httpx.head(f"{guarded.base}/metrics").status_code == 200
    r = _post(guarded, "/completions", ok | {"prompt": [True, 3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # the field, not pydantic's union member
    assert "k3dist_prefix_demotions" in guarded.metrics()


def test_the_sglang_gateways_bodies_are_served_with_the_default(guarded):
    """SGLang's Model Gateway forwards a body made again from its own request type, its defaults written out (SGLang's
    own fields among them): those are declared, and served with serve.unknown_fields at its default (refuse)."""
    gateway = {"stream": False, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True}
    gateway |= {"return_hidden_states": False, "model": guarded.model}
    chat = gateway | {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "logprobs": False}
    chat |= {"continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}
    completion = gateway | {"prompt": "hi", "max_tokens": 2, "echo": False}
    for path, body in (("/chat/completions", chat), ("/completions", completion)):
        reply = _post(guarded, path, body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
