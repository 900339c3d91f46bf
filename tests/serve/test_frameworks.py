"""Agent frameworks against the real server with nothing but its base URL, in Kimi-K2's format and on the 0.4B K3 twin
in K3's: LangChain's ChatOpenAI (`bind_tools`, `with_structured_output` by JSON schema and by tool call), instructor
(tools and JSON schema modes) and the `openai` client. Every body they send is recorded and held to the route's
declared schema, so the fields these clients send are known to be declared (an undeclared one would be refused:
serve.unknown_fields=refuse). The weights are random: what makes the answers valid is the grammar every tool call
and schema is held to."""

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from k3dist.serve.routes import ROUTES
from tests.support.server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def roomy(serve_dir, tmp_path_factory):
    """The serve checkpoint with room for the prompts frameworks write (their tool and schema instructions)."""
    overrides = ("generate.batch=2", "cache.cap=2048", "generate.prefill_chunk=64")
    server = Server(tmp_path_factory.mktemp("frameworks"), f"model.path={serve_dir}", *overrides)
    server.chat_extra = {}
    yield server
    server.stop()


@pytest.fixture(params=["kimi_k2", "k3twin"])
def served(request):
    """The serve checkpoint in Kimi-K2's format, and the 0.4B K3 twin in K3's (its requests turn thinking off)."""
    return request.getfixturevalue("roomy" if request.param == "kimi_k2" else "server_k3_twin")


class Trip(BaseModel):
    """A short trip."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


def weather(city: Literal["Paris", "Oslo"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Recorder:
    """An httpx client that keeps every JSON body it sends, with its route."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        self.client = httpx.Client(event_hooks={"request": [self._keep]})

    def _keep(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append((request.url.path, json.loads(request.read())))

    def declared(self) -> None:
        """Every recorded body's fields are declared by its route (and it sent some)."""
        assert self.bodies
        for path, body in self.bodies:
            model = ROUTES[path]
            names = {f.alias or n for n, f in model.model_fields.items()}
            assert set(body) <= names, (path, set(body) - names)


def test_langchain_chat_openai_tools_and_structured_output(served):
    from langchain_openai import ChatOpenAI

    rec = Recorder()
    llm = ChatOpenAI(
        base_url=served.url, api_key="none", model=served.model, max_tokens=200, temperature=0, http_client=rec.client,
        max_retries=0, extra_body=served.chat_extra or None,
    )  # fmt: skip
    assert isinstance(llm.invoke("Hi").content, str)
    called = llm.bind_tools([weather], tool_choice="required").invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "weather"
    assert called.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")
    for method in ("json_schema", "function_calling"):
        trip = llm.with_structured_output(Trip, method=method).invoke("Plan a trip")
        assert isinstance(trip, Trip) and 1 <= trip.days <= 7, method
    chunks = list(llm.stream("Tell me a story"))
    assert all(isinstance(c.content, str) for c in chunks)
    rec.declared()


def test_instructor_tools_and_json_schema_modes(served):
    import instructor
    import openai

    rec = Recorder()
    client = openai.OpenAI(base_url=served.url, api_key="none", http_client=rec.client, max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        trip = patched.chat.completions.create(
            model=served.model, response_model=Trip, max_tokens=200, temperature=0, max_retries=0,
            messages=[{"role": "user", "content": "Plan a trip"}], extra_body=served.chat_extra,
        )  # fmt: skip
        assert isinstance(trip, Trip) and 1 <= trip.days <= 7, mode
    rec.declared()


def test_the_openai_client_with_every_kind_of_request(roomy):
    import openai

    rec = Recorder()
    client = openai.OpenAI(base_url=roomy.url, api_key="none", http_client=rec.client, max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}},
    }
    reply = client.chat.completions.create(model=roomy.model, messages=ask, tools=[tool], tool_choice="required",
                                           max_tokens=200, temperature=0)  # fmt: skip
    call = reply.choices[0].message.tool_calls[0]
    ask += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    again = client.chat.completions.create(model=roomy.model, messages=ask, tools=[tool], max_tokens=8, seed=1,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
    assert list(again)[-1].usage.completion_tokens > 0
    parsed = client.chat.completions.parse(model=roomy.model, messages=ask[:1], response_format=Trip, max_tokens=200)
    assert isinstance(parsed.choices[0].message.parsed, Trip)
    scored = client.completions.create(model=roomy.model, prompt=["a b", "c"], max_tokens=1, logprobs=2, echo=True,
                                       temperature=0, n=1, user="u", seed=3, stop=["\n"])  # fmt: skip
    assert len(scored.choices) == 2
    rec.declared()
