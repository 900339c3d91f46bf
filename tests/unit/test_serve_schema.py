"""The routes' schemas and their page agree: every field each route declares is in docs/serving.md's tables, every
known-but-unserved field is declared and listed once, and nothing on a request's path reads a body but through its
model (no getattr, hasattr or model_extra in k3dist/serve/)."""

import re
from pathlib import Path
from typing import Any

from k3dist.serve.responses_schema import ResponsesRequest
from k3dist.serve.routes import ROUTES
from k3dist.serve.schema import INERT, UNSERVED, ChatRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[2]


def _declared(model) -> dict:
    return {f.alias or name: f for name, f in model.model_fields.items()}


def test_every_declared_field_is_on_the_page():
    page = (ROOT / "docs" / "serving.md").read_text()
    tables = page.split("## Every field", 1)[1].split("## Refusals", 1)[0]
    named = set(re.findall(r"`(\w+)`", tables)) | {n for pair in re.findall(r"`(\w+)\.(\w+)`", tables) for n in pair}
    missing = {path: sorted(set(_declared(model)) - named) for path, model in ROUTES.items()}
    assert not any(missing.values()), missing


def test_unserved_and_inert_fields_are_declared_once_each():
    generating = (CompletionRequest, ChatRequest, ResponsesRequest)
    json_typed = {n for model in generating for n, f in _declared(model).items() if f.annotation is Any}
    json_typed |= {n for n, f in _declared(ROUTES["/tokenize"]).items() if f.annotation is Any}
    assert json_typed == set(UNSERVED), json_typed ^ set(UNSERVED)
    declared = set().union(*(_declared(model) for model in ROUTES.values()))
    assert set(INERT) <= declared and not set(INERT) & set(UNSERVED)
    for name, (nothing, why) in UNSERVED.items():
        assert None in nothing and why, name  # not sending it asks for nothing


def test_nothing_reads_a_request_but_through_its_model():
    """The float/getattr class: a field a model does not declare can never be read, so its value never reaches the
    engine unchecked."""
    found = []
    for path in sorted((ROOT / "k3dist" / "serve").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(getattr|hasattr)\(|model_extra|extra=\"allow\"", line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found
