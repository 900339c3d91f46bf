"""A fuzzer against the live world-2 server (gloo, dist.check_tokens on): hypothesis draws bodies for every route,
valid ones, valid ones with one field mutated (a wrong type, NaN, inf, negative, huge, unicode digits, empty, a lone
surrogate, NUL, deep nesting, an unknown key) and structurally broken ones, with a fixed seed. It asserts:

- no 5xx, and every answer in bounded time;
- every 4xx is an OpenAI error envelope, and a 400 for a body that was a JSON object names a field (`param`);
- a stream that begins runs to `[DONE]` (the Responses API's: to `response.completed` or `response.incomplete`) with
  no error event;
- `/health` answers 200 after every batch of bodies, and every rank is alive;
- a fixed greedy request gives the same tokens at the end as at the start;
- every route answered some bodies (200) and refused some (400).

The default run sends 150 bodies; the `slow` tier sends 1,650 more from another seed."""

import json
import math
import os
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

VOCAB = 1024  # tests/support/configs.py small_config's vocabulary: ids past it are refused, not sent to the engine
BATCH = 25  # bodies between looks at /health and the ranks
ANSWER_S = 60.0  # the longest any one answer may take
GREEDY = {"prompt": [5, 9, 2, 7, 3], "max_tokens": 8, "temperature": 0, "return_token_ids": True}

text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
finite = lambda lo, hi: st.floats(lo, hi, allow_nan=False)  # noqa: E731
COMMON = {
    "max_tokens": st.integers(1, 3),
    "temperature": finite(0, 2),
    "top_p": finite(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": st.text(max_size=8),
    "return_token_ids": st.booleans(),
    "frequency_penalty": finite(-2, 2),
    "presence_penalty": finite(-2, 2),
    "repetition_penalty": finite(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), finite(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "ignore_eos": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "request_id": st.text("abcxyz-_0123456789", min_size=1, max_size=8),
    "priority": st.integers(-3, 3),
    "store": st.just(False),
    "service_tier": st.sampled_from(["auto", "default"]),
    "min_p": st.just(0.0),
}
COMPLETION = COMMON | {
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "add_special_tokens": st.booleans(),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
CHAT = COMMON | {
    "max_completion_tokens": st.integers(1, 3),
    "logprobs": st.booleans(),
    "echo": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "parallel_tool_calls": st.booleans(),
}
SHARED = ("temperature", "top_p", "top_k", "seed", "stop", "stream", "user", "frequency_penalty", "presence_penalty")
SHARED += ("repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens")
SHARED += ("spaces_between_special_tokens", "request_id", "priority", "service_tier", "min_p")
part = st.fixed_dictionaries({"type": st.just("input_text"), "text": text})
item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": text | st.lists(part)}
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": text}),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": text, "name": st.just("f"), "arguments": st.just("{}")}
    ),
)
RESPONSES = {name: COMMON[name] for name in SHARED} | {
    "max_output_tokens": st.integers(1, 3),
    "instructions": text,
    "store": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "include": st.sampled_from([[], ["message.output_text.logprobs"], ["reasoning.encrypted_content"]]),
    "parallel_tool_calls": st.booleans(),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {}]),
    "reasoning": st.sampled_from([{}, {"effort": None}, {"effort": "none"}]),
    "truncation": st.just("disabled"),
    "background": st.just(False),
    "previous_response_id": st.text("abcxyz_0123456789", min_size=1, max_size=8),
}
DEEP = json.loads("[" * 40 + "1" + "]" * 40)  # deeper than a body may nest
MUTANTS = st.sampled_from(
    [
        "x", "", [], {}, None, True, 1.5, -1, -(10**30), 10**30, 2**64, math.nan, math.inf, -math.inf, "²", "١٢",
        "\ud800", "\u0000", DEEP, "y" * 5000, {"nested": {"deeper": [1, "two", None]}}, [1, "a", None],
    ]
)  # fmt: skip
BROKEN = st.sampled_from(
    [
        b"", b"{", b"[]", b"[1, 2]", b"null", b"123", b'"a string"', b"{" * 5000, b"[" * 100_000,
        b'{"prompt": "\xff\xfe"}', b'{"prompt": "a\x00b"}', b"\x00", b'{"max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"prompt": "a", "prompt": 5}', b'{"messages": [{"role": "user", "content": "hi"}]', b'{"prompt": NaN}',
        b'{"prompt": "a", "max_tokens": Infinity}', b"\xef\xbb\xbf{}",
    ]
)  # fmt: skip


def _valid(route: str):
    if route == "/v1/completions":
        fields, needed = COMPLETION, {"prompt": st.one_of(text, ids, st.lists(text, min_size=1, max_size=2))}
    elif route == "/v1/chat/completions":
        fields, needed = CHAT, {"messages": st.lists(message, min_size=1, max_size=3)}
    elif route == "/v1/responses":
        fields, needed = RESPONSES, {"input": st.one_of(text, st.lists(item, min_size=1, max_size=3))}
    elif route == "/tokenize":
        fields = {"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}
        needed = {"prompt": text}
    else:
        fields, needed = {}, {"tokens": ids}
    return st.fixed_dictionaries(needed, optional=fields)


@st.composite
def requests(draw):
    """(route, body bytes, whether the body is a JSON object)."""
    route = draw(
        st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"])
    )
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "unknown", "broken"]))
    if kind == "broken":
        return route, draw(BROKEN), False
    body = draw(_valid(route))
    if kind == "mutated":
        body[draw(st.sampled_from(sorted(body)))] = draw(MUTANTS)
    elif kind == "unknown":
        body[draw(st.sampled_from(["zz_made_up", "max_completion_tokens", "temprature", "extra_body"]))] = draw(MUTANTS)
    return route, json.dumps(body).encode(), True


def sse_lines(body: bytes) -> list[str]:
    """A stream's lines as SSE ends them (CRLF, LF or CR), not as str.splitlines does: a text field may hold U+2028,
    U+0085 or a form feed raw inside its JSON, and those end no SSE line."""
    return re.split(r"\r\n|\r|\n", body.decode())


class Fuzzing:
    """What the fuzzer saw: answers by status, and the server's health between batches."""

    def __init__(self, server):
        self.server, self.sent, self.statuses, self.routes = server, 0, {}, {}
        self.client = httpx.Client(timeout=ANSWER_S)

    def send(self, route: str, raw: bytes, is_object: bool) -> None:
        url = f"{self.server.base}{route}"
        start = time.monotonic()
        with self.client.stream("POST", url, content=raw, headers={"Content-Type": "application/json"}) as reply:
            body = reply.read()
        took = time.monotonic() - start
        self.statuses[reply.status_code] = self.statuses.get(reply.status_code, 0) + 1
        seen = self.routes.setdefault(route, {})
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        what = f"{route} {raw[:300]!r} -> {reply.status_code} {body[:500]!r}"
        assert reply.status_code < 500 and took < ANSWER_S, what
        if reply.status_code >= 400:
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], what
            if reply.status_code == 400 and is_object:
                assert isinstance(error["param"], str) and error["param"], what
        elif reply.headers["content-type"].startswith("text/event-stream") and route == "/v1/responses":
            kinds = [json.loads(line[6:])["type"] for line in sse_lines(body) if line.startswith("data: ")]
            assert kinds[-1] in ("response.completed", "response.incomplete") and "error" not in kinds, what
        elif reply.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in sse_lines(body) if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e[:10] for e in events[:-1]), what
        self.sent += 1
        if self.sent % BATCH == 0:
            self.healthy()

    def healthy(self) -> None:
        assert httpx.get(f"{self.server.base}/health", timeout=30).status_code == 200
        assert self.server.proc.poll() is None
        for pid in self.server.pids:
            os.kill(pid, 0)  # every rank alive (ProcessLookupError otherwise)

    def greedy(self) -> list[int]:
        reply = self.client.post(f"{self.server.url}/completions", json=GREEDY)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]


def _fuzz(server, examples: int, fixed_seed: int) -> dict:
    fuzzing, start = Fuzzing(server), time.monotonic()
    before = fuzzing.greedy()

    @seed(fixed_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=(Phase.generate,),  # no shrinking: against a live server it takes minutes, and bodies are small
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def run(request):
        fuzzing.send(*request)

    run()
    fuzzing.healthy()
    assert fuzzing.greedy() == before
    print(f"fuzzed {fuzzing.sent} bodies in {time.monotonic() - start:.1f} s: {fuzzing.routes}")
    assert all(seen.get(200) and seen.get(400) for seen in fuzzing.routes.values()), fuzzing.routes  # each route
    return fuzzing.statuses


def test_no_body_hurts_the_server(server2):
    statuses = _fuzz(server2, 150, 37)
    assert statuses.get(200, 0) >= 15 and statuses.get(400, 0) >= 50, statuses  # it reached the engine, and refused


@pytest.mark.slow
def test_no_body_hurts_the_server_thousands(server2):
    statuses = _fuzz(server2, 1650, 3737)
    assert statuses.get(200, 0) >= 165 and statuses.get(400, 0) >= 550, statuses
