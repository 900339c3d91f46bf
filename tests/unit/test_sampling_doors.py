"""One SamplingParams, three doors: every field of the dataclass is in engine/sampling.py's DOORS, and each door (the
HTTP body, a prompts file's line, the CLI's generate.* keys) takes exactly the fields DOORS gives it, by DOORS' name,
and carries each into the SamplingParams it builds. The constructor checks every value, whoever calls it."""

import json
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from k3dist.engine.sampling import DOORS, BadValue, SamplingParams
from k3dist.offline.prompts import _from_file, cli_sampling
from k3dist.serve.fields import Forms
from k3dist.serve.protocol import parse_body
from k3dist.serve.responses_input import chat_request, input_messages
from k3dist.serve.responses_schema import ResponsesRequest
from k3dist.serve.schema import ChatRequest, CompletionRequest
from k3dist.settings import GROUPS, GenerateSettings, parse
from k3dist.text.prompt_file import SAMPLING, read_requests
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.tokenizer import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024
# a value of each field other than its default, as each door writes it
CHANGED = {
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 7,
    "seed": 123,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.5,
    "min_tokens": 2,
    "logit_bias": {"5": 1.0},
}


def _names(door: str) -> dict[str, str]:
    return {field: doors[door] for field, doors in DOORS.items() if door in doors}


def test_every_field_is_in_the_table_and_has_a_door_or_a_source():
    assert list(DOORS) == [f.name for f in fields(SamplingParams)]
    for field, doors in DOORS.items():
        assert set(doors) <= {"http", "file", "cli", "derived"}, field
        assert set(doors) - {"derived"} or doors.get("derived"), f"{field}: no door takes it and nothing makes it"


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, VOCAB, None, None)
    return Forms(load_tokenizer(folder), VOCAB)


def _planned(forms, route, body: dict):
    """The SamplingParams a body makes through its route (the Responses API's through the chat request it is)."""
    req = parse_body(json.dumps(body).encode(), route)
    return forms.plan(chat_request(req, input_messages(req)) if route is ResponsesRequest else req).sampling


@pytest.mark.parametrize("route", [CompletionRequest, ChatRequest, ResponsesRequest])
def test_the_http_door_takes_its_fields_and_carries_each(forms, route):
    marked = {n for n, f in route.model_fields.items() if (f.json_schema_extra or {}).get("sampling")}
    assert marked == set(_names("http").values())
    base = {
        CompletionRequest: {"prompt": [1, 2], "max_tokens": 4},
        ChatRequest: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        ResponsesRequest: {"input": "hi", "max_output_tokens": 4},
    }[route]
    plain = _planned(forms, route, base | {"seed": 0})
    for field, name in _names("http").items():
        sampling = _planned(forms, route, base | {"seed": 0, name: CHANGED[field]})
        assert sampling.__dict__[field] != plain.__dict__[field], field


def test_the_prompts_file_door_takes_its_fields_and_carries_each(tmp_path):
    assert set(SAMPLING) == set(_names("file").values())
    settings = parse(_default_job())
    lines = [{"ids": [1, 2]}] + [{"ids": [1, 2], name: CHANGED[f]} for f, name in _names("file").items()]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read_requests(path)  # the door's own schema takes every line
    plain, *changed = _from_file(str(path), settings, None, {"max_new_tokens": 1})
    for (field, _), prompt in zip(_names("file").items(), changed, strict=True):
        expected = CHANGED[field] if field != "seed" else CHANGED["seed"]
        assert prompt.sampling.__dict__[field] == expected, field
        if field != "seed":  # each line draws with generate.seed + its index unless it gives its own
            assert prompt.sampling.__dict__[field] != plain.sampling.__dict__[field], field


def test_the_cli_door_takes_its_fields_and_carries_each():
    keys = {f"generate.{f.name}" for f in fields(GenerateSettings)}
    cli = set(_names("cli").values())
    assert cli <= keys
    assert {k for k in keys if k.removeprefix("generate.") in DOORS} == cli  # no generate.* sampling key unlisted
    plain = cli_sampling(GenerateSettings())
    for field, name in _names("cli").items():
        g = replace(GenerateSettings(), **{name.removeprefix("generate."): CHANGED[field]})
        assert cli_sampling(g).__dict__[field] == CHANGED[field] != plain.__dict__[field], field


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_k", -1),
        ("seed", 2.0),
        ("presence_penalty", math.inf),
        ("repetition_penalty", 0),
        ("min_tokens", 1.5),
        ("logit_bias", ((5, math.inf),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", (("5", 1.0),)),
        ("logit_bias", tuple((i, 1.0) for i in range(321))),
        ("held", tuple(range(33))),
        ("grammar", 1),
    ],
)
def test_the_constructor_refuses_a_bad_value_naming_its_field(field, value):
    with pytest.raises(BadValue) as refused:
        SamplingParams(**{field: value})
    assert refused.value.field == field


def test_a_door_names_its_own_name_and_json_travels_whole():
    with pytest.raises(BadValue, match=r"^generate\.top_p "):
        SamplingParams.taken("cli", {"generate.top_p": 0})
    params = SamplingParams(0.7, 0.9, 3, -5, 0.1, 0.2, 1.1, 2, ((3, 1.5), (4, -math.inf)), (1, 2), True)
    assert SamplingParams.from_json(json.loads(json.dumps(params.to_json()))) == params


def _default_job() -> dict:
    conf = ROOT / "conf"
    load = lambda path: OmegaConf.to_container(OmegaConf.load(path))  # noqa: E731
    job = {g: load(conf / "model" / "twin_0_40b.yaml" if g == "model" else conf / g / "default.yaml") for g in GROUPS}
    return job | {"fault": load(conf / "fault" / "none.yaml"), "out": None}
