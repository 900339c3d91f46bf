"""A grammar that compiles too slowly is refused with a 400 naming its field, and the server's compile places come
back once it ends (a hung compile holds no request)."""

import time

import pytest

from k3dist.serve import structured
from k3dist.serve.errors import APIError
from k3dist.serve.fields import Forms
from k3dist.serve.schema import CompletionRequest
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.tokenizer import write_tokenizer

SLOW = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,40}"} for i in range(100)}}


def test_a_slow_compile_is_a_400_and_frees_its_place(tmp_path, monkeypatch):
    write_tokenizer(tmp_path, 512, 2, 1)
    forms = Forms(load_tokenizer(tmp_path), 512)
    forms.grammars.compiler()  # made first: the limit below times the compile alone
    monkeypatch.setattr(structured, "COMPILE_S", 0.02)
    slow = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SLOW}}}
    start = time.monotonic()
    with pytest.raises(APIError) as refused:
        forms.plan(CompletionRequest.model_validate(slow))
    assert refused.value.param == "response_format" and "did not compile within" in refused.value.message
    assert time.monotonic() - start < 1
    monkeypatch.setattr(structured, "COMPILE_S", 60.0)
    quick = {"prompt": "x", "structured_outputs": {"regex": "[ab]{2}"}}
    assert forms.plan(CompletionRequest.model_validate(quick)).engine["grammar"] is not None
