"""vLLM's and SGLang's extras, each honoured for real (tested to change what it should) or refused by name, against a
real server: skip_special_tokens and spaces_between_special_tokens, chat's echo, add_generation_prompt,
continue_final_message, chat_template_kwargs and documents (to a template that reads them), request_id, priority,
text content parts, a 3 MB /tokenize, NUL characters; and serve.unknown_fields=ignore, which takes made-up fields
and logs each name once, boundedly.

The server here runs 2 slots on a copy of the serve checkpoint whose chat template also reads a `greeting` variable
and `documents` (the twin's reads neither: the refusal is tested against it); a request whose `user` is "raise" fails
in its route there (fault.raise_in=route), as a fault of k3dist's own would: a 500 envelope, and the server serves
on."""

import asyncio
import itertools
import json
import shutil
import time

import httpx
import pytest

from k3dist.text.tokenizer import load_tokenizer
from tests.serve.conftest import _server

GREETING = "{%- if greeting is defined -%}<|im_system|>greeting<|im_middle|>{{ greeting }}<|im_end|>{%- endif -%}\n"
DOCUMENTS = (
    "{%- for d in documents or [] -%}<|im_system|>document<|im_middle|>{{ d['text'] }}<|im_end|>{%- endfor -%}\n"
)
HI = [{"role": "user", "content": "Hi"}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def extras(serve_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("extras") / "m"
    shutil.copytree(serve_dir, model)
    template = model / "chat_template.jinja"
    template.write_text(GREETING + DOCUMENTS + template.read_text())
    faulty = ("fault.rank=0", "fault.raise_in=route")  # a request whose user is "raise" fails in its route
    server = _server(
        tmp_path_factory.mktemp("extras-run"), model, "generate.batch=2", "serve.unknown_fields=ignore", *faulty
    )
    server.tok = load_tokenizer(model)
    yield server
    server.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    """`path` under /v1, or a tokenizer route (at the root)."""
    return httpx.post(f"{server.base if path.startswith('/tok') else server.url}{path}", json=body, timeout=120)


def _chat(server, **body) -> dict:
    reply = _post(server, "/chat/completions", {"max_tokens": 3, "temperature": 0} | body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_special_tokens_are_skipped_unless_asked_and_then_spaced_as_asked(extras):
    user = extras.tok.special_ids["<|im_user|>"]  # special, and no eos: only skip_special_tokens keeps it out
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logit_bias": {str(user): 100}} | IDS
    texts = {}
    for skip, spaces in [(None, None), (False, False), (False, True)]:
        asked = {
            k: v for k, v in (("skip_special_tokens", skip), ("spaces_between_special_tokens", spaces)) if v is not None
        }
        reply = _post(extras, "/completions", body | asked).json()["choices"][0]
        assert reply["token_ids"] == [user] * 3
        texts[(skip, spaces)] = reply["text"]
    assert texts == {
        (None, None): "",  # vLLM's default: special tokens leave no text
        (False, False): "<|im_user|>" * 3,
        (False, True): "<|im_user|> <|im_user|> <|im_user|>",
    }


def test_echo_add_generation_prompt_and_continue_final_message(extras):
    turn = HI + [{"role": "assistant", "content": "Once upon"}]
    opened = _chat(extras, messages=turn, **IDS)
    cont = _chat(extras, messages=turn, add_generation_prompt=False, continue_final_message=True, **IDS)
    closed = _chat(extras, messages=turn, add_generation_prompt=False, **IDS)
    decode = extras.tok.decode
    assert decode(opened["prompt_token_ids"]).endswith("Once upon<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert decode(closed["prompt_token_ids"]).endswith("Once upon<|im_end|>")
    assert decode(cont["prompt_token_ids"]).endswith("<|im_middle|>Once upon")  # its turn left open
    echoed = _chat(extras, messages=turn, add_generation_prompt=False, continue_final_message=True, echo=True)
    answer = cont["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Once upon" + answer
    plain = _chat(extras, messages=HI)["choices"][0]["message"]["content"]
    assert _chat(extras, messages=HI, echo=True)["choices"][0]["message"]["content"] == plain  # last is the user's
    assert _chat(extras, messages=turn, echo=True)["choices"][0]["message"]["content"].startswith("Once upon")
    continued = {"messages": turn, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    stream = _post(extras, "/chat/completions", continued | {"stream": True, "max_tokens": 3, "temperature": 0})
    deltas = [json.loads(line[6:]) for line in stream.text.split("\n") if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas) == "Once upon" + answer
    both = _post(extras, "/chat/completions", {"messages": turn, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_template_variables_and_documents_reach_a_template_that_reads_them(extras, server1):
    greeted = _chat(extras, messages=HI, chat_template_kwargs={"greeting": "Ahoy there"}, **IDS)
    assert "<|im_system|>greeting<|im_middle|>Ahoy there<|im_end|>" in extras.tok.decode(greeted["prompt_token_ids"])
    documented = _chat(extras, messages=HI, documents=[{"title": "t", "text": "The pier is long."}], **IDS)
    assert "<|im_middle|>The pier is long.<|im_end|>" in extras.tok.decode(documented["prompt_token_ids"])
    tokenized = _post(extras, "/tokenize", {"messages": HI, "chat_template_kwargs": {"greeting": "Ahoy there"}})
    assert tokenized.json()["tokens"] == greeted["prompt_token_ids"]  # /tokenize renders as the chat route does
    for fields, param in [
        ({"chat_template_kwargs": {"nobody_reads_me": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
    ]:
        reply = _post(extras, "/chat/completions", {"messages": HI} | fields)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    twin = httpx.post(f"{server1.url}/chat/completions", json={"messages": HI, "documents": [{"text": "x"}]})
    assert twin.status_code == 400 and twin.json()["error"]["param"] == "documents"  # the twin's reads none


def test_text_parts_are_the_text_and_nul_characters_are_text(extras):
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    as_parts = _chat(extras, messages=[{"role": "user", "content": parts}], **IDS)
    assert as_parts["prompt_token_ids"] == _chat(extras, messages=HI, **IDS)["prompt_token_ids"]
    nul = _post(extras, "/completions", {"prompt": "a\u0000b", "max_tokens": 1, "temperature": 0})
    assert nul.status_code == 200, nul.text


def test_request_id_names_the_response_and_two_alike_do_not_mix(extras):
    async def both():
        async with httpx.AsyncClient(timeout=120) as c:
            bodies = [
                {"prompt": [5 + i, 9, 2], "max_tokens": 6, "temperature": 0, "request_id": "same-1"} for i in (0, 1)
            ]
            return await asyncio.gather(*(c.post(f"{extras.url}/completions", json=b | IDS) for b in bodies))

    replies = [r.json() for r in asyncio.run(both())]
    assert [r["id"] for r in replies] == ["cmpl-same-1", "cmpl-same-1"]
    for i, r in enumerate(replies):
        alone = _post(extras, "/completions", {"prompt": [5 + i, 9, 2], "max_tokens": 6, "temperature": 0} | IDS)
        assert r["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]
    assert _chat(extras, messages=HI, request_id="mine")["id"] == "chatcmpl-mine"


def test_priority_orders_the_waiting_requests(extras):
    """Both slots held by streams; a request of priority 5 waits, then one of priority -5: when one stream leaves, the
    later request takes its slot and is done before the earlier one starts (it starts once the other stream leaves)."""
    url = f"{extras.url}/completions"

    async def scenario() -> dict:
        async with httpx.AsyncClient(timeout=120) as c:
            started, leave, seen = [asyncio.Event(), asyncio.Event()], [asyncio.Event(), asyncio.Event()], {}

            async def holding(i: int) -> None:
                body = {"prompt": [3, 4], "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
                async with c.stream("POST", url, json=body) as r:
                    async for _ in r.aiter_lines():
                        started[i].set()
                        if leave[i].is_set():
                            return  # the stream closes: its slot is free at the next window
                seen[f"holder {i} ran out"] = time.monotonic()  # its 250 tokens ended before it was let go

            async def waiting(name: str, priority: int) -> None:
                body = {"prompt": [7, 8], "max_tokens": 3, "temperature": 0, "stream": True, "priority": priority}
                async with c.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            seen.setdefault(f"{name} first", time.monotonic())
                seen[f"{name} done"] = time.monotonic()

            async def queued(count: int) -> None:
                for _ in range(600):
                    if extras.metrics()["k3dist_requests_waiting"] >= count:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"never {count} waiting")

            holders = [asyncio.create_task(holding(i)) for i in (0, 1)]
            await asyncio.gather(*(e.wait() for e in started))
            low = asyncio.create_task(waiting("low", 5))
            await queued(1)
            high = asyncio.create_task(waiting("high", -5))
            await queued(2)
            leave[0].set()
            await high
            leave[1].set()
            await asyncio.gather(low, *holders)
            return seen

    for _ in range(3):  # a fast host may finish the second holder's 250 tokens first: two slots free, no order
        seen = asyncio.run(scenario())
        if "holder 1 ran out" not in seen:
            break
    assert "holder 1 ran out" not in seen and seen["high done"] < seen["low first"], seen


def test_a_3mb_tokenize_gets_its_tokens(extras):
    text = "The keeper wound the clock at seven. " * (3_000_000 // 37)
    start = time.monotonic()
    reply = _post(extras, "/tokenize", {"prompt": text})
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["count"] == len(extras.tok.encode_any(text)) > 256  # past cache.cap: counted all the same
    assert time.monotonic() - start < 60


def test_unknown_fields_ignored_are_logged_once_each_and_boundedly(extras):
    """serve.unknown_fields=ignore: 3 bodies of 3,000 made-up keys each (under serve.max_body) are served, and write
    no 9,000 log lines: each name once, at most 64 names ever."""
    for batch in range(3):
        made_up = {f"f{batch}_{i}": 0 for i in range(3000)}
        reply = _post(extras, "/completions", {"prompt": "hi", "max_tokens": 1} | made_up)
        assert reply.status_code == 200, reply.text
    nested = _post(extras, "/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"made_up": 1}})
    assert nested.status_code == 200, nested.text
    assert 0 < sum("k3_serve_unknown_field" in line for line in extras.lines) <= 64


def test_a_fault_of_k3dists_own_is_a_500_envelope_and_the_server_serves_on(extras):
    asked = [("/chat/completions", {"messages": HI, "max_tokens": 2}), ("/responses", {"input": "Hi"})]
    for (path, body), stream in itertools.product(asked, (False, True)):
        reply = _post(extras, path, body | {"user": "raise", "stream": stream})
        error = reply.json()["error"]
        assert reply.status_code == 500 and error["code"] == "internal_error", reply.text
        assert error["message"] == "internal error: RuntimeError: injected failure in a route (fault.raise_in=route)"
    assert any("k3_serve_fault" in line for line in extras.lines)
    assert _chat(extras, messages=HI)["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{extras.base}/health", timeout=10).status_code == 200
