"""Prompt files: every field read and typed, every bad line one K3Error naming file and line; atomic writes."""

import json
import os
import re

import pytest

from k3dist.base.errors import K3Error
from k3dist.text.prompt_file import Request, read_requests, write_jsonl

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]


def write_lines(tmp_path, *lines: str | bytes):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines))
    return path


def test_reads_every_field_in_order(tmp_path):
    path = write_lines(
        tmp_path,
        json.dumps({"prompt": "Once upon a time"}),
        "",
        "   ",
        json.dumps({"id": "chat-1", "messages": CHAT, "tools": [{"type": "function"}], "stop": "\n\n"}),
        json.dumps(
            {"ids": [1, 2, 3], "max_new_tokens": 0, "temperature": 0, "top_p": 1, "top_k": 0, "seed": 2**64 - 1}
        ),
        json.dumps({"prompt": "x", "temperature": 0.7, "top_p": 0.9, "top_k": 50, "stop": ["a", "bc"]}) + "\r",
    )
    requests = read_requests(path)
    assert requests == [
        Request(index=0, id="req-0", prompt="Once upon a time"),
        Request(index=1, id="chat-1", messages=CHAT, tools=[{"type": "function"}], stop=["\n\n"]),
        Request(
            index=2, id="req-2", ids=[1, 2, 3], max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, seed=2**64 - 1
        ),
        Request(index=3, id="req-3", prompt="x", temperature=0.7, top_p=0.9, top_k=50, stop=["a", "bc"]),
    ]
    assert isinstance(requests[2].temperature, float) and requests[0].max_new_tokens is None


@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"prompt": "caf\xe9"}', r"not UTF-8 \(byte 0xe9 at column 16\)"),
        ('{"prompt": "x",}', "not JSON"),
        ('["prompt", "x"]', "a request is a JSON object, got a JSON list"),
        ('"x"', "a request is a JSON object, got a JSON str"),
        ('{"max_new_tokens": 3}', "a request needs exactly one of prompt, messages, ids; this one has none"),
        (
            '{"prompt": "x", "ids": [1]}',
            "a request needs exactly one of prompt, messages, ids; this one has prompt and ids",
        ),
        ('{"prompt": "x", "max_tokens": 3}', "unknown key 'max_tokens'"),
        ('{"prompt": "x", "prompt": "y"}', "key 'prompt' appears twice"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"prompt": 5}', "prompt must be a non-empty string"),
        ('{"id": 3, "prompt": "x"}', "id must be a non-empty string"),
        ('{"ids": [1, -2]}', "ids must be a non-empty list of non-negative integers"),
        ('{"ids": [1, 2.0]}', "ids must be a non-empty list of non-negative integers"),
        ('{"ids": [true]}', "ids must be a non-empty list of non-negative integers"),
        ('{"ids": []}', "ids must be a non-empty list of non-negative integers"),
        ('{"messages": "hi"}', "messages: must be a list of {role, content} objects"),
        ('{"messages": [{"role": 1, "content": "x"}]}', r"messages: messages\[0\] has unknown role 1"),
        ('{"prompt": "x", "tools": []}', "tools go with messages"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": ["f"]}', "tools must be a list of objects"),
        ('{"prompt": "x", "max_new_tokens": -1}', "max_new_tokens must be an integer >= 0, got -1"),
        ('{"prompt": "x", "max_new_tokens": 1.5}', "max_new_tokens must be an integer >= 0, got 1.5"),
        ('{"prompt": "x", "temperature": -0.1}', "temperature must be a number >= 0"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature must be a number >= 0"),
        ('{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
        ('{"prompt": "x", "top_p": 0}', "top_p must be a number with 0 < top_p <= 1, got 0"),
        ('{"prompt": "x", "top_p": 1.01}', "top_p must be a number with 0 < top_p <= 1"),
        ('{"prompt": "x", "top_k": -1}', "top_k must be an integer >= 0"),
        ('{"prompt": "x", "top_k": false}', "top_k must be an integer >= 0"),
        ('{"prompt": "x", "seed": -1}', r"seed must be an integer in 0..2\*\*64-1"),
        ('{"prompt": "x", "seed": 18446744073709551616}', r"seed must be an integer in 0..2\*\*64-1"),
        ('{"prompt": "x", "stop": ""}', "stop must be a non-empty string or a list of them"),
        ('{"prompt": "x", "stop": ["a", 3]}', "stop must be a non-empty string or a list of them"),
        ('{"id": "req-0", "prompt": "x"}', "id 'req-0' is already used on line 1"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, line, why):
    path = write_lines(tmp_path, '{"prompt": "fine"}', "", line, '{"prompt": "after"}')
    with pytest.raises(K3Error, match=rf"^{re.escape(str(path))}:3: {why}"):
        read_requests(path)


def test_empty_or_missing_file(tmp_path):
    path = write_lines(tmp_path, "", "  ", "")
    with pytest.raises(K3Error, match=rf"^{re.escape(str(path))}: holds no requests"):
        read_requests(path)
    with pytest.raises(K3Error, match="cannot read the requests"):
        read_requests(tmp_path / "missing.jsonl")


def test_write_jsonl_is_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    write_jsonl(path, [{"id": "a", "text": "你好"}, {"id": "b", "text": "x\ny"}])
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [
        {"id": "a", "text": "你好"},
        {"id": "b", "text": "x\ny"},
    ]
    assert "你好" in path.read_text(encoding="utf-8")  # not \u-escaped
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_jsonl(path, [{"id": "c"}, {"id": "d", "bad": object()}])
    assert path.read_bytes() == before  # the old file stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no temp file left behind
